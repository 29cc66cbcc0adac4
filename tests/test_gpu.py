"""GPU correctness checks (compiled engine, CUDA graphs, async scheduling), run from the test
suite on a CUDA machine and skipped on CPU-only machines such as CI.  The checks themselves
live in ``bench/gpu_check.py`` so they also run as a plain script; see docs/BENCHMARKS.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _has_cuda_gpu() -> bool:
    # nvidia-smi, not torch.cuda: initialising CUDA in the test process would break vLLM's fork
    # of its engine core for every engine test after this one.
    if shutil.which("nvidia-smi") is None:
        return False
    return subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_cuda_gpu(), reason="needs a CUDA GPU")]
SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def test_compiled_engine_checks_pass_on_the_gpu(tmp_path: Path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--requests", "256", "--out", str(out)], timeout=1800)
    summary = json.loads(out.read_text())
    assert summary["failures"] == [], summary["failures"]
    assert done.returncode == 0
