"""Optional dependencies: what one feature needs is an extra (``pip install 'inspect-tl-vllm[parquet]'``),
and a missing one is named with the extra that brings it."""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRAS = {"pyarrow": "parquet", "matplotlib": "report"}
"""Top-level package -> the extra of this project that installs it."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (a dotted name) for ``feature``, or an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = module.split(".")[0]
        raise ImportError(
            f"{feature} needs {package}, which is not installed: pip install 'inspect-tl-vllm[{EXTRAS[package]}]' "
            "(or 'inspect-tl-vllm[all]')"
        ) from err
