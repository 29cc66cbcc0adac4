"""The GPU benchmarks' own code runs on CPU too, so that a change to the instrumentation cannot
break a benchmark unnoticed until the next GPU session (their numbers come from the GPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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
        "--count-ops",
        "--profile-workload",
        "steer_churn",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    workloads = ("plain", "steer", "steer_churn", "capture_mean", "capture_mean_churn", "features")
    assert {f"{workload}_ms_per_step" for workload in workloads} <= set(result)
    # a request replaced every step writes its routing entries: the count names the lines that do it
    assert "steer_churn: " in done.stdout and "_write_admissions index_put_" in done.stdout, done.stdout[-2000:]


def test_prepare_cost_times_every_vector_form(tmp_path):
    out = tmp_path / "prepare_cost.json"
    command = [sys.executable, "bench/prepare_cost.py", "--requests", "16", "--width", "64", "--rounds", "2"]
    done = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"list", "numpy", "tensor"}
    assert all(phases["total_s"] > 0 for phases in results.values())
    assert "| tensor |" in done.stdout


def test_cpu_pinning_gives_each_engine_whole_cores_and_pins_a_process_tree(monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import cpu_pinning
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert cpu_pinning._parse_cpu_list("0-3,8\n") == {0, 1, 2, 3, 8}
    siblings = [[i, i + 8] for i in range(8)]  # a 16-CPU host with hyperthreads
    monkeypatch.setattr(cpu_pinning, "physical_cores", lambda cpus: [list(core) for core in siblings])
    layout = cpu_pinning.plan(["vanilla", "instrumented"], set(range(16)))
    assert layout == {
        "vanilla": {"front_end": [0, 8], "engine_core": [1, 9, 2, 10]},
        "instrumented": {"front_end": [3, 11], "engine_core": [4, 12, 5, 13]},
        "rest": [6, 7, 14, 15],
    }
    monkeypatch.setattr(cpu_pinning, "physical_cores", lambda cpus: [[cpu] for cpu in sorted(cpus)])
    assert cpu_pinning.plan(["vanilla", "instrumented"], set(range(12))) is None  # nothing left for the rest
    assert cpu_pinning.plan(["vanilla", "instrumented"], set(range(13)))["rest"] == [12]
    monkeypatch.undo()

    # a real process with a child: the parent's threads on one CPU, the child's on another
    import psutil

    cpus = sorted(os.sched_getaffinity(0))
    script = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        process = psutil.Process(parent.pid)
        for _ in range(100):
            if process.children():
                break
            time.sleep(0.1)
        (child,) = process.children()
        assert cpu_pinning.pin_tree(parent.pid, cpus[:1], children_to=cpus[-1:]) >= 2
        assert os.sched_getaffinity(parent.pid) == set(cpus[:1])
        assert os.sched_getaffinity(child.pid) == set(cpus[-1:])
    finally:
        for proc in psutil.Process(parent.pid).children(recursive=True):
            proc.kill()
        parent.kill()
        parent.wait()


def test_e2e_rounds_give_each_variant_its_medians_spread_and_failed_rounds():
    """``bench/e2e.py --rounds N``: the ratios to ``vllm`` divide medians over the rounds, each
    measure keeps its min and max, and a failed round is counted, not averaged in."""
    import argparse

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import e2e
        import tables
    finally:
        sys.path.remove(str(ROOT / "bench"))

    def run(variant: str, round_number: int, wall: float, status: str = "success") -> dict:
        return {
            "variant": variant,
            "round": round_number,
            "status": status,
            "wall_s": wall,
            "to_first_call_s": wall - 10,
            "generation_s": wall / 10,
            "output_tokens": 1000,
        }

    walls = {"vllm": [60.0, 64.0, 62.0], "tl": [40.0, 44.0, 90.0]}
    results = [run(v, i + 1, w) for v in walls for i, w in enumerate(walls[v])]
    results[-1]["status"] = "error"  # tl's third round failed: its 90 s counts nowhere
    args = argparse.Namespace(
        model="m", samples=4, max_tokens=250, ignore_eos=False, warm_up=True, rounds=3, variants="vllm,tl"
    )
    summary = e2e.summarize(args, results, {"vllm": {1: "a"}, "tl": {1: "a"}})
    vllm, tl = summary["results"]
    assert (vllm["wall_s"], vllm["spread"]["wall_s"], vllm["rounds_failed"]) == (62.0, [60.0, 64.0], 0)
    assert (tl["wall_s"], tl["spread"]["wall_s"], tl["rounds_failed"]) == (42.0, [40.0, 44.0], 1)
    assert tl["wall_ratio_to_vllm"] == round(42.0 / 62.0, 3)
    assert tl["output_tok_s_generation"] == round(1000 / 4.2, 2)
    assert len(summary["runs"]) == 6 and tl["identical_completions_to_vllm"] == {"identical": 1, "total": 1}
    rendered = "\n".join(tables.e2e(summary))
    assert "Medians of 3 interleaved rounds" in rendered
    assert "| tl | 40.0–44.0 | 30.0–34.0 | 4.0–4.4 | — | 1 |" in rendered
