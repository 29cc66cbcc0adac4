"""How the instrumentation settings travel inside vLLM's own config.

``additional_config`` is serialised to every worker (local processes, Ray actors on other
nodes) and is part of the config hash that keys vLLM's compile cache, so a graph compiled
without hooks, or with an older version of the hook code, is never reused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from inspect_tl_vllm.specs import TAG, InstrumentConfig


def hook_code_version() -> str:
    """Hash of the code that torch.compile traces into the model (salts the compile cache)."""
    root = Path(__file__).resolve().parent.parent / "instrument"
    digest = hashlib.sha256()
    for path in sorted(root.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def additional_config(settings: InstrumentConfig) -> dict[str, Any]:
    return {TAG: {**settings.model_dump(), "code": hook_code_version()}}
