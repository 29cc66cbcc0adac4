"""The GPU benchmarks' own code runs on CPU too, so that a change to the instrumentation cannot
break a benchmark unnoticed until the next GPU session (their numbers come from the GPU only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_router_cost_runs_every_workload(tmp_path):
    out = tmp_path / "router_cost.json"
    command = [
        sys.executable,
        "bench/router_cost.py",
        "--steps",
        "30",
        "--width",
        "64",
        "--sites",
        "4",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    workloads = ("plain", "steer", "steer_churn", "capture_mean", "capture_mean_churn", "features")
    assert {f"{workload}_ms_per_step" for workload in workloads} <= set(result)
