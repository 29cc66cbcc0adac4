"""Sweeps: random controls, degenerate-output flags, and a real two-point sweep plus report."""

from __future__ import annotations

import pytest
import torch

from inspect_tl_vllm.research.sweep import is_degenerate, sweep_points


def test_random_control_keeps_norm_and_is_reproducible(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from inspect_tl_vllm.research.controls import random_like

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "v.safetensors"
    save_file({"v": torch.arange(8, dtype=torch.float32)}, str(source))
    a, b, c = random_like(str(source), 0), random_like(str(source), 0), random_like(str(source), 1)
    va, vc = load_file(a)["vector"], load_file(c)["vector"]
    assert a == b and a != c
    assert torch.isclose(va.norm(), torch.arange(8.0).norm()) and torch.isclose(vc.norm(), va.norm())
    assert abs(float(va @ vc) / float(va.norm() * vc.norm())) < 0.99


def test_degenerate_outputs_are_flagged():
    assert is_degenerate("icate" * 30)
    assert is_degenerate("the sea the sea the sea the sea the sea the sea the sea the sea")
    assert not is_degenerate("My weekend is a mix of adventure and relaxation, with long walks by the river.")


def test_sweep_points_pair_every_steered_point_with_controls():
    points = sweep_points([0.0, 1.0], [3], controls=2)
    assert {"coef": 0.0, "layer": 3} in points and {"coef": 1.0, "layer": 3, "control_seed": 1} in points
    assert not any(p.get("control_seed") is not None and p["coef"] == 0 for p in points)
    assert len(points) == 2 + 2


@pytest.mark.engine
def test_sweep_and_report_on_the_real_engine(vllm_ready, tiny_llama_dir, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from conftest import TINY_MODEL_ARGS_CLI, environment
    from inspect_tl_vllm.cli import main
    from inspect_tl_vllm.research.sweep import report

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    vector = tmp_path / "v.safetensors"
    save_file({"vector": torch.randn(64) * 4}, str(vector))
    task = tmp_path / "task.py"
    task.write_text(
        "from inspect_ai import Task, task\nfrom inspect_ai.dataset import Sample\n"
        "from inspect_ai.scorer import includes\nfrom inspect_ai.solver import generate\n"
        "from inspect_tl_vllm.solvers import steer\n"
        "@task\ndef t(coef: float = 0.0, layer: int = 1, control_seed: int | None = None, vector: str = ''):\n"
        "    from inspect_tl_vllm.research.controls import random_like\n"
        "    path = random_like(vector, control_seed) if control_seed is not None else vector\n"
        "    solver = steer([{'hook': f'blocks.{layer}.hook_resid_post', 'vector': path, 'coef': coef}]) "
        "if coef else generate()\n"
        "    return Task(dataset=[Sample(input='Hi', target='x'), Sample(input='Bye', target='y')], "
        "solver=solver, scorer=includes())\n"
    )
    monkeypatch.chdir(tmp_path)
    args = [
        "sweep",
        "task.py",
        "--model",
        f"tl-vllm/{tiny_llama_dir}",
        "--coef",
        "0,2",
        "--layer",
        "1",
        "--controls",
        "1",
        "-T",
        f"vector={vector}",
        *TINY_MODEL_ARGS_CLI,
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    with environment(TORCH_COMPILE_DISABLE="1"):
        assert main(args) == 0
    assert main(["report", str(tmp_path / "logs")]) == 0
    table, png = report(str(tmp_path / "logs"))
    assert png.is_file() and png.stat().st_size > 1000
    assert "| 1 | 0 | steering | 2 |" in table and "| 1 | 2 | random control | 2 |" in table
    assert "| 1 | 2 | steering | 2 |" in table
