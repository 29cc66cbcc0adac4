"""Sweeps: random controls, degenerate-output flags, and a real two-point sweep plus report."""

from __future__ import annotations

import json

import pytest
import torch

from inspect_tl_vllm.research.sweep import control_seed, is_degenerate, sweep_points


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


def test_two_vectors_get_their_own_control_directions_for_one_seed(tmp_path, monkeypatch):
    """Seeded by the source too: with the seed alone, every vector of a width got the same direction."""
    from safetensors.torch import load_file, save_file

    from inspect_tl_vllm.research.controls import DRAWS, random_like

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    paths = []
    for name, values in (("a", torch.arange(64.0)), ("b", torch.arange(64.0).flip(0))):
        save_file({"v": values}, str(tmp_path / f"{name}.safetensors"))
        paths.append(random_like(str(tmp_path / f"{name}.safetensors"), 7))
    a, b = (load_file(path)["vector"] for path in paths)
    assert abs(float(a @ b) / float(a.norm() * b.norm())) < 0.6  # independent draws in 64 dimensions
    assert all(f"-{DRAWS['gauss']}-seed7." in path for path in paths)  # a cache of another drawing rule is never reused


def test_degenerate_outputs_are_flagged():
    assert is_degenerate("icate" * 30)
    assert is_degenerate("the sea the sea the sea the sea the sea the sea the sea the sea")
    assert not is_degenerate("My weekend is a mix of adventure and relaxation, with long walks by the river.")


def test_every_coefficient_draws_its_own_control_directions():
    points = sweep_points([0.0, 1.0, 2.0], [3], controls=3)
    assert len(points) == 3 + 2 * 3
    assert not any(p.get("control_seed") is not None and p["coef"] == 0 for p in points)
    seeds = [p["control_seed"] for p in points if "control_seed" in p]
    assert len(set(seeds)) == len(seeds)
    # a point's seeds do not depend on the other points of the sweep
    assert [p["control_seed"] for p in sweep_points([2.0], [3], controls=3) if "control_seed" in p] == seeds[3:]
    assert control_seed(3, 1.0, 0) != control_seed(4, 1.0, 0)


def test_control_directions_are_independent_draws(tmp_path, monkeypatch):
    """Directions of one sweep's seeds: the vector's norm each, and pairwise as close to
    orthogonal as independent draws in 512 dimensions are (|cos| about 0.044; 0.25 is 5.7 sd)."""
    from safetensors.torch import load_file, save_file

    from inspect_tl_vllm.research.controls import random_like

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "v.safetensors"
    vector = torch.randn(512, generator=torch.Generator().manual_seed(0))
    save_file({"v": vector}, str(source))
    seeds = [p["control_seed"] for p in sweep_points([1.0, 2.0, 4.0], [12], controls=4) if "control_seed" in p]
    directions = torch.stack([load_file(random_like(str(source), seed))["vector"] for seed in seeds])
    assert torch.allclose(directions.norm(dim=1), vector.norm().expand(len(seeds)))
    unit = directions / directions.norm(dim=1, keepdim=True)
    cosines = (unit @ unit.T - torch.eye(len(seeds))).abs()
    assert float(cosines.max()) < 0.25
    assert float((unit @ (vector / vector.norm())).abs().max()) < 0.25


def test_report_row_tests_steering_against_the_control_spread():
    from inspect_tl_vllm.research.sweep import Point, Row

    steering = Point(2.0, 12, None, scores=[1.0] * 18 + [0.0] * 2, fluency=[-1.0, -2.0] * 10, degenerate=1)
    controls = [Point(2.0, 12, seed, scores=[float(i % 10 == seed % 10) for i in range(20)]) for seed in range(4)]
    summary = Row(12, 2.0, steering, controls).summary()
    assert summary["score"]["estimate"] == 0.9 and summary["score"]["method"] == "Wilson score"
    assert summary["score"]["low"] == pytest.approx(0.698966, abs=1e-6)  # SciPy: binomtest(18, 20), Wilson
    assert summary["fluency"]["estimate"] == pytest.approx(-1.5)
    assert summary["controls"]["scores"] == [0.1] * 4 and summary["controls"]["seeds"] == [0, 1, 2, 3]
    assert summary["controls"]["sd"] == 0.0 and summary["p_value"] == pytest.approx(1 / 5)


def test_a_bootstrap_over_five_values_or_fewer_is_flagged():
    from inspect_tl_vllm.research.sweep import Point, Row

    few = Row(1, 2.0, Point(2.0, 1, None, scores=[0.2, 0.5, 0.7], fluency=[-1.0, -2.0, -1.5]), []).summary()
    assert few["too_few_for_bootstrap"] == ["score", "fluency"]
    binary = Row(1, 2.0, Point(2.0, 1, None, scores=[1.0, 0.0, 1.0]), []).summary()  # Wilson: no flag
    assert "too_few_for_bootstrap" not in binary
    enough = Row(1, 2.0, Point(2.0, 1, None, scores=[0.1 * i for i in range(6)]), []).summary()
    assert "too_few_for_bootstrap" not in enough


@pytest.mark.engine
def test_sweep_and_report_on_the_real_engine(vllm_ready, tiny_llama_dir, tmp_path, monkeypatch, capsys):
    """The CLI's sweep and report on the tiny model; running the sweep again runs only the points
    that have no successful log (here one whose log was removed)."""
    from inspect_ai.log import read_eval_log
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
        "from inspect_tl_vllm.research.fluency import fluency\nfrom inspect_tl_vllm.solvers import steer\n"
        "@task\ndef t(coef: float = 0.0, layer: int = 1, control_seed: int | None = None, vector: str = ''):\n"
        "    from inspect_tl_vllm.research.controls import random_like\n"
        "    path = random_like(vector, control_seed) if control_seed is not None else vector\n"
        "    solver = steer([{'hook': f'blocks.{layer}.hook_resid_post', 'vector': path, 'coef': coef}]) "
        "if coef else generate()\n"
        "    return Task(dataset=[Sample(input='Hi', target='x'), Sample(input='Bye', target='y')], "
        "solver=solver, scorer=[includes(), fluency()])\n"
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
    logs = sorted((tmp_path / "logs").glob("*.eval"))
    assert len(logs) == 3  # coef 0, coef 2, one control at 2

    # run again: every point is done; with one point's log gone, only that point runs
    assert main(args) == 0
    assert sorted((tmp_path / "logs").glob("*.eval")) == logs
    control = next(path for path in logs if read_eval_log(str(path)).eval.task_args.get("control_seed") is not None)
    control.unlink()
    with environment(TORCH_COMPILE_DISABLE="1"):
        assert main(args) == 0
    assert len(set((tmp_path / "logs").glob("*.eval")) - set(logs)) == 1
    out = capsys.readouterr().out
    assert out.count("done already") == 3 + 2
    last_run = [line for line in out.splitlines() if line.startswith("sweep: point 3/3")][-1]
    assert "control_seed=" in last_run and "done already" not in last_run
    table, png = report(str(tmp_path / "logs"))
    assert png.is_file() and png.stat().st_size > 1000
    rows = {line.split(" | ")[1]: line.split(" | ") for line in table.splitlines() if line.startswith("| 1 | ")}
    assert set(rows) == {"0", "2"}
    assert rows["0"][2] == "2" and rows["0"][6] == "—"  # the unsteered point has no controls
    assert rows["2"][2] == "2" and rows["2"][6].startswith("1, ") and rows["2"][9] != "—"
    assert rows["2"][8] != "—" and rows["0"][8] == "—"  # steering less its control, per question
    assert float(rows["2"][4].split(" [")[0]) < 0  # fluency: a mean log-probability
    assert "too narrow (they cover the mean less often than 95%); run more samples for: layer 1, coef 0;" in table
    assert "- layer 1: slope " in table and "over 2 questions answered at every coefficient (0, 2)" in table
    saved = json.loads((tmp_path / "logs" / "report.json").read_text())
    assert saved["method"].startswith("Intervals are 95%: Wilson")
    assert saved["dose_response"][0]["questions"] == 2 and saved["rows"][1]["effect"]["questions"] == 2
    assert len(saved["rows"][1]["spec_sha256"]) == 1 and len(saved["rows"][1]["spec_sha256"][0]) == 64
    assert saved["rows"][1]["controls"]["seeds"] == [control_seed(1, 2.0, 0)]


@pytest.mark.parametrize("controls", ["-1", "1001"])
def test_sweep_refuses_a_control_count_out_of_range(controls, capsys):
    from inspect_tl_vllm.cli import main

    assert main(["sweep", "absent_task.py", "--controls", controls]) == 2
    assert f"--controls {controls} is out of range; give 0 to 1000 directions" in capsys.readouterr().err


SWEEP_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, solver


@solver
def broken():
    async def solve(state, generate):
        raise RuntimeError("the engine ran out of memory")

    return solve


@task
def point(coef: float = 0.0, layer: int = 1, control_seed: int | None = None, fail: bool = False):
    samples = [Sample(id="a", input="Hi", target="x"), Sample(id="b", input="Bye", target="absent")]
    return Task(dataset=samples, solver=broken() if fail else generate(), scorer=includes())
"""


@pytest.mark.engine
def test_report_counts_a_rerun_point_once_and_lists_failed_points(vllm_ready, tiny_llama_dir, tmp_path, monkeypatch):
    """Evals of sweep points on the tiny model: a point run twice counts each (sample, epoch)
    once; a control direction whose eval failed is named in the table and report.json, not dropped
    in silence; once rerun successfully it counts again."""
    from inspect_ai import eval

    from conftest import provider_model_args
    from inspect_tl_vllm.research.sweep import report

    (tmp_path / "task.py").write_text(SWEEP_TASK)
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "logs"

    def run(**point):
        with provider_model_args() as args:
            model = f"tl-vllm/{tiny_llama_dir}"
            return eval("task.py", task_args=point, model=model, model_args=args, log_dir=str(logs), display="none")[0]

    assert run(coef=2.0, layer=1).status == "success"
    assert run(coef=2.0, layer=1).status == "success"  # the same point again: not twice the samples
    assert run(coef=2.0, layer=1, control_seed=5).status == "success"
    assert run(coef=2.0, layer=1, control_seed=7, fail=True).status == "error"
    table, _ = report(str(logs))
    row = next(line.split(" | ") for line in table.splitlines() if line.startswith("| 1 | 2 |"))
    assert row[2] == "2" and row[6].startswith("1 (+1 failed), ")
    assert "| p | p, Holm over 1 |" in table and row[10].rstrip(" |") == row[9]  # one tested row: no adjustment
    assert "- layer 1, coef 2, control seed 7: error: RuntimeError('the engine ran out of memory')" in table
    saved = json.loads((logs / "report.json").read_text())["rows"][0]
    assert saved["n"] == 2 and saved["controls"]["directions"] == 1
    assert saved["controls_failed"][0]["seed"] == 7 and "out of memory" in saved["controls_failed"][0]["error"]

    assert run(coef=2.0, layer=1, control_seed=7).status == "success"  # the failed point rerun
    table, _ = report(str(logs))
    row = next(line.split(" | ") for line in table.splitlines() if line.startswith("| 1 | 2 |"))
    assert row[6].startswith("2, ") and "failed" not in table.split("\n\n")[0]


def test_steering_less_controls_is_paired_by_question():
    """Each question's steered score less the mean of the controls that answered it; a question
    no control answered is left out; the dose-response test pairs questions across coefficients."""
    from inspect_tl_vllm.research.sweep import Point, Row, dose_responses

    questions = [("a", 1), ("b", 1), ("c", 1)]
    steering = Point(2.0, 1, None, scores=[1.0, 1.0, 0.0], questions=questions)
    controls = [
        Point(2.0, 1, 11, scores=[0.0, 1.0], questions=questions[:2]),
        Point(2.0, 1, 12, scores=[1.0, 1.0], questions=questions[:2]),
    ]
    row = Row(1, 2.0, steering, controls)
    assert row.paired_differences() == [0.5, 0.0]
    summary = row.summary()
    assert summary["effect"]["estimate"] == 0.25 and summary["effect"]["questions"] == 2
    assert "effect" in summary["too_few_for_bootstrap"]
    unsteered = Row(1, 0.0, Point(0.0, 1, None, scores=[0.0, 0.0, 0.0], questions=questions), [])
    [dose] = dose_responses([unsteered, row])
    assert (dose["layer"], dose["questions"], dose["coefs"]) == (1, 3, [0.0, 2.0])
    assert dose["slope"] == pytest.approx((2 / 3) / 2.0)


def _vector_with_rows(tmp_path, pairs: int = 12, width: int = 32):
    """A vector file and its pairs' rows, as extract-vector writes them: the concept lives in the
    first coordinate, and the activations vary mostly along the last four."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(5)
    base = torch.randn(2 * pairs, width, generator=generator) * 0.1
    base[:, -4:] += torch.randn(2 * pairs, 4, generator=generator) * 5  # the directions activations vary in
    base[0::2, 0] += 3.0  # positives carry the concept
    vector = (base[0::2] - base[1::2]).mean(0)
    save_file({"h": vector}, str(tmp_path / "v.safetensors"))
    save_file({"h": base}, str(tmp_path / "v.rows.safetensors"))
    return str(tmp_path / "v.safetensors"), vector, base


def test_covariance_controls_lie_where_the_activations_vary(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from inspect_tl_vllm.research.controls import random_like

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    ref, vector, rows = _vector_with_rows(tmp_path)
    controls = [load_file(random_like(ref, seed, "covariance"))["vector"] for seed in range(6)]
    for control in controls:
        assert torch.isclose(control.norm(), vector.norm())
        assert float(control[-4:].norm() / control.norm()) > 0.9  # a gauss draw puts about 4/32 of its norm there
    centred = rows - rows.mean(0)
    basis = torch.linalg.svd(centred, full_matrices=False).Vh  # the rows' span
    for control in controls:
        assert torch.allclose(basis.T @ (basis @ control), control, atol=1e-4)
    gauss = load_file(random_like(ref, 0))["vector"]
    assert not torch.allclose(gauss, controls[0]) and "cov-by-source" in random_like(ref, 0, "covariance")


def test_relabel_controls_are_the_mean_of_sign_flipped_pair_differences(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from inspect_tl_vllm.research.controls import random_like

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    ref, vector, rows = _vector_with_rows(tmp_path)
    differences = rows[0::2] - rows[1::2]
    for seed in range(4):
        control = load_file(random_like(ref, seed, "relabel"))["vector"]
        assert torch.isclose(control.norm(), vector.norm())
        # some choice of signs gives it: solve for the weights over the pairs' differences
        weights = torch.linalg.lstsq(differences.T, control[:, None]).solution[:, 0]
        assert torch.allclose(differences.T @ weights, control, atol=1e-4)
        assert torch.allclose(weights.abs(), weights.abs()[0].expand_as(weights), rtol=1e-3)  # +-1 each, rescaled
        cosine = float(control @ vector / (control.norm() * vector.norm()))
        assert cosine < 0.99  # not the vector itself


def test_stronger_controls_need_the_pairs_rows_and_a_known_kind(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from inspect_tl_vllm.research.controls import random_like
    from inspect_tl_vllm.specs import SpecError

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    save_file({"h": torch.randn(16)}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(SpecError, match="needs the pairs' rows beside the vector .*extract-vector"):
        random_like(str(tmp_path / "bare.safetensors"), 0, "relabel")
    with pytest.raises(SpecError, match="control kind 'shuffle': use one of gauss, covariance, relabel"):
        random_like(str(tmp_path / "bare.safetensors"), 0, "shuffle")


def test_a_sweep_passes_its_control_kind_and_a_report_takes_one_kind(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from inspect_tl_vllm.research import sweep
    from inspect_tl_vllm.specs import SpecError

    points = sweep_points([0.0, 1.0], [3], controls=2, kind="relabel")
    assert [p.get("control_kind") for p in points] == [None, None, "relabel", "relabel"]
    assert all("control_kind" not in p for p in sweep_points([1.0], [3], controls=2))  # gauss: tasks need no arg

    def log(**task_args):
        spec = SimpleNamespace(task_args=task_args, created="2026-12-07")
        return SimpleNamespace(eval=spec, status="success", samples=[], error=None)

    logs = [log(coef=1.0, layer=3), log(coef=1.0, layer=3, control_seed=1, control_kind="relabel")]
    monkeypatch.setattr("inspect_ai.log.list_eval_logs", lambda folder: logs)
    monkeypatch.setattr("inspect_ai.log.read_eval_log", lambda item: item)
    assert [row.control_kind for row in sweep.collect(str(tmp_path))] == ["relabel"]
    logs.append(log(coef=1.0, layer=3, control_seed=2))
    with pytest.raises(SpecError, match="controls of 2 kinds \\(gauss, relabel\\).*its own --log-dir"):
        sweep.collect(str(tmp_path))


def test_controls_in_one_eval_are_points_of_their_own_seeds(tmp_path, monkeypatch):
    from inspect_ai.dataset import Sample
    from safetensors.torch import save_file

    from inspect_tl_vllm.research.controls import control_samples, random_like
    from inspect_tl_vllm.research.sweep import point_sample_limit

    separate = sweep_points([0.0, 2.0], [1], controls=3)
    together = sweep_points([0.0, 2.0], [1], controls=3, one_eval=True)
    seeds = [p["control_seed"] for p in separate if "control_seed" in p]
    assert together[2:] == [{"coef": 2.0, "layer": 1, "control_seeds": ",".join(map(str, seeds))}]
    assert point_sample_limit(together[2], 5) == 15 and point_sample_limit(separate[2], 5) == 5

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    save_file({"v": torch.randn(16)}, str(tmp_path / "v.safetensors"))
    questions = [Sample(id="a", input="Hi"), Sample(id="b", input="Bye")]
    source = str(tmp_path / "v.safetensors")
    samples = control_samples(questions, source, [7, 9], hook="blocks.1.hook_resid_post", coef=2)
    assert [s.id for s in samples] == ["a~7", "a~9", "b~7", "b~9"]  # whole questions first: a limit takes whole ones
    for sample in samples:
        seed = sample.metadata["control_seed"]
        [item] = sample.metadata["tlvllm"]["interventions"]
        assert item == {"hook": "blocks.1.hook_resid_post", "vector": random_like(source, seed), "coef": 2}
        assert sample.metadata["question_id"] == sample.id.split("~")[0]


ONE_EVAL_TASK = """
from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate
from inspect_tl_vllm.research.controls import control_samples, parse_seeds, random_like
from inspect_tl_vllm.research.fluency import fluency
from inspect_tl_vllm.solvers import steer


@task
def t(coef: float = 0.0, layer: int = 1, control_seed: int | None = None, control_seeds: str | None = None,
      vector: str = ""):
    hook = f"blocks.{layer}.hook_resid_post"
    samples = [Sample(id="hi", input="Hi", target="x"), Sample(id="bye", input="Bye", target="y")]
    if control_seeds is not None:
        dataset = control_samples(samples, vector, parse_seeds(control_seeds), hook=hook, coef=coef)
        return Task(dataset=dataset, solver=generate(), scorer=[includes(), fluency()])
    path = random_like(vector, control_seed) if control_seed is not None else vector
    solver = steer([{"hook": hook, "vector": path, "coef": coef}]) if coef else generate()
    return Task(dataset=samples, solver=solver, scorer=[includes(), fluency()])
"""


def _applied_controls(log_dir):
    """(seed, question) -> the content hash of the vector each control answer was steered by."""
    from inspect_ai.log import list_eval_logs, read_eval_log

    found = {}
    for info in list_eval_logs(str(log_dir)):
        log = read_eval_log(info)
        args = log.eval.task_args
        if args.get("control_seed") is None and args.get("control_seeds") is None:
            continue
        for sample in log.samples:
            seed = sample.metadata.get("control_seed", args.get("control_seed"))
            question = sample.metadata.get("question_id", sample.id)
            [item] = sample.output.metadata["tlvllm"]["applied"]["interventions"]
            assert sample.output.metadata["tlvllm"]["receipt"]["interventions"][0]["rows"] > 0
            found[(seed, question)] = (item["vector"], item["coef"])
    return found


@pytest.mark.engine
def test_controls_in_one_eval_are_steered_each_by_its_own_direction(vllm_ready, tiny_llama_dir, tmp_path, monkeypatch):
    """A sweep with all control directions in one eval: every (direction, question) answer is steered
    by that direction (the content hash of the vector its seed draws) at the point's coefficient, and
    the report finds each direction and pairs it with the steering vector by question."""
    from safetensors.torch import load_file, save_file

    from conftest import TINY_MODEL_ARGS_CLI, environment
    from inspect_tl_vllm.cli import main
    from inspect_tl_vllm.research.controls import random_like
    from inspect_tl_vllm.research.sweep import collect, report
    from inspect_tl_vllm.vectors.files import vector_hash

    monkeypatch.setenv("TLVLLM_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "v.safetensors"
    save_file({"vector": torch.randn(64, generator=torch.Generator().manual_seed(2)) * 4}, str(source))
    (tmp_path / "task.py").write_text(ONE_EVAL_TASK)
    monkeypatch.chdir(tmp_path)
    command = ["sweep", "task.py", "--model", f"tl-vllm/{tiny_llama_dir}", "--coef", "0,2", "--layer", "1"]
    command += ["--controls", "3", "-T", f"vector={source}", *TINY_MODEL_ARGS_CLI, "--controls-in-one-eval"]
    with environment(TORCH_COMPILE_DISABLE="1"):
        assert main([*command, "--log-dir", str(tmp_path / "logs")]) == 0
    assert len(list((tmp_path / "logs").glob("*.eval"))) == 3  # coef 0, coef 2, all controls at 2
    seeds = [p["control_seed"] for p in sweep_points([2.0], [1], controls=3) if "control_seed" in p]
    expected = {
        (seed, question): (vector_hash(load_file(random_like(str(source), seed))["vector"]), 2.0)
        for seed in seeds
        for question in ("hi", "bye")
    }
    assert _applied_controls(tmp_path / "logs") == expected
    row = {row.coef: row for row in collect(str(tmp_path / "logs"))}[2.0]
    assert sorted(c.seed for c in row.controls) == sorted(seeds)
    assert all(c.by_question().keys() == {("hi", 1), ("bye", 1)} for c in row.controls)
    assert len(row.paired_differences()) == 2
    table, _ = report(str(tmp_path / "logs"))
    assert "3, " in next(line for line in table.splitlines() if line.startswith("| 1 | 2 | 2 |"))
