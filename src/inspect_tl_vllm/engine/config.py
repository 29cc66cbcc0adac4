"""How the instrumentation settings travel inside vLLM's own config.

``additional_config`` is serialised to every worker (local processes, Ray actors on other
nodes) and is part of the config hash that keys vLLM's compile cache, so a graph compiled
without hooks, or with other hook code, is never reused.  The hash covers only the code that
ends up in the compiled graph (``GRAPH_CODE``): the hooks and their custom op, the kernel it
launches, which modules get hooks, and the plugin's replacement of vLLM ops on the CPU.  Host
code (routing, copies, receipts, the front end) can change without throwing compiled graphs away.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from inspect_tl_vllm.specs import TAG, InstrumentConfig

PACKAGE = Path(__file__).resolve().parent.parent
GRAPH_CODE = (
    "instrument/runtime.py",
    "instrument/site_op.py",
    "instrument/site_kernel.py",
    "instrument/hookpoints.py",
    "engine/plugin.py",
)
"""The package's files whose code torch.compile traces into the model, or that decide what it traces."""


def hook_code_version(package: Path = PACKAGE) -> str:
    """Hash of ``GRAPH_CODE`` (salts the compile cache)."""
    digest = hashlib.sha256()
    for name in GRAPH_CODE:
        digest.update(name.encode() + b"\0" + (package / name).read_bytes())
    return digest.hexdigest()[:16]


def additional_config(settings: InstrumentConfig) -> dict[str, Any]:
    return {TAG: {**settings.model_dump(), "code": hook_code_version()}}
