"""Every Python snippet and command block of the README and the docs/ guides runs as written (on the
real CPU engine) and prints what it says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import generate

from conftest import environment

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(language: str) -> list[str]:
    return [code for doc in DOCS for code in re.findall(rf"```{language}\n(.*?)```", doc.read_text(), flags=re.DOTALL)]


def python_snippets() -> list[str]:
    return _blocks("python")


def snippet(marker: str) -> str:
    found = [code for code in python_snippets() if marker in code]
    assert len(found) == 1, f"one snippet of the README or docs/ should contain {marker!r}"
    return found[0]


def run_snippet(code: str, cwd: Path, folder: Path) -> str:
    """Run ``code`` as a script file (vLLM's engine processes import it again) in ``cwd``."""
    folder.mkdir(exist_ok=True)
    script = folder / "snippet.py"
    script.write_text(code)
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "VLLM_LOGGING_LEVEL": "ERROR"}  # stdout: the snippet's own
    done = subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Found no NVIDIA driver" not in done.stderr  # the CPU worker's shutdown is quiet
    return done.stdout


def test_every_python_snippet_is_run_by_a_test_here():
    """Each snippet of the README and docs/ holds the marker of exactly one ``snippet(...)`` call of
    this file, so a snippet added without a test, or one whose marker no longer finds it, fails."""
    import ast

    markers = [
        node.args[0].value
        for node in ast.walk(ast.parse(Path(__file__).read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "snippet" and node.args
        and isinstance(node.args[0], ast.Constant)
    ]  # fmt: skip
    for code in python_snippets():
        found = [marker for marker in markers if marker in code]
        assert len(found) == 1, f"no test (or more than one) runs this snippet:\n{code[:300]}"


def test_head_ablation_snippet(smollm2_dir, vllm_ready, tmp_path):
    out = run_snippet(snippet('"heads": [3]'), ROOT, tmp_path / "script")
    shape = re.search(r"^\((\d+), 9, 64\) head 3 zero: True$", out, flags=re.MULTILINE)
    assert shape and int(shape.group(1)) > 10, out[-2000:]
    assert re.search(r"^'.+' -> '.+'$", out, flags=re.MULTILINE), out[-2000:]
    pattern = re.search(r"^pattern \((\d+), 9, (\d+)\) head 0 of the last query attends most to key \d+$", out, re.M)
    assert pattern and pattern.group(1) == pattern.group(2), out[-2000:]


def test_python_api_snippet(smollm2_dir, vllm_ready, tmp_path):
    out = run_snippet(snippet("smollm2_ocean_l12.safetensors"), ROOT, tmp_path / "script")
    shape = re.search(r"^torch\.Size\(\[(\d+), 576\]\) \[\{'index': 0, .*'rows': (\d+)", out, flags=re.MULTILINE)
    assert shape and int(shape.group(1)) > 0 and int(shape.group(2)) > 0, out[-2000:]
    assert out[: shape.start()].strip(), "the snippet printed no answer"


def test_activations_load_snippet(vllm_ready, tiny_llama_dir, tmp_path):
    args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "capture": "blocks.1.hook_resid_post"}
    task = Task(
        dataset=[Sample(id="q1", input="Hello"), Sample(id="q2", input="Name a colour.")],
        solver=generate(),
        config=GenerateConfig(max_tokens=3, temperature=0.0),
    )
    with environment(TORCH_COMPILE_DISABLE="1"):
        log = eval(
            task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path / "logs"), display="none"
        )[0]
    assert log.status == "success"
    out = run_snippet(snippet("print(r.sample_id, r.epoch, r.scores"), tmp_path, tmp_path / "script")
    assert sorted(out.strip().splitlines()) == [
        "q1 1 {} {'blocks.1.hook_resid_post': (1, 64)}",
        "q2 1 {} {'blocks.1.hook_resid_post': (1, 64)}",
    ]


def bash_lines(marker: str) -> list[str]:
    found = [block for block in _blocks("bash") if marker in block]
    assert len(found) == 1, f"one bash block of the README or docs/ should contain {marker!r}"
    return [line.split("#")[0].strip() for line in found[0].strip().splitlines()]


def test_sae_features_commands(smollm2_dir, vllm_ready, tmp_path):
    """The README's SAE commands as written (the sweep with one sample per point): the eval steers by
    the demonstration SAE's feature 0, stores each answer's top features, and scores the feature as
    stored; the sweep runs its points with controls."""
    import shlex

    from inspect_ai.log import read_eval_log

    from inspect_tl_vllm import activations
    from inspect_tl_vllm.vectors.sae import densify

    run, sweep = bash_lines("evals/sae_features.py")
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "INSPECT_LOG_DIR": str(tmp_path / "logs")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # inspect, tl-vllm
    command = shlex.split(run)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    [log_file] = (tmp_path / "logs").glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.status == "success" and len(log.samples) == 6
    for sample in activations.load(log_file):
        indices = sample.activations["blocks.12.hook_resid_post.sae_indices"]
        values = sample.activations["blocks.12.hook_resid_post.sae_values"]
        assert indices.shape == values.shape == (1, 8)
        feature = float(densify(indices, values, 64)[0, 0])
        assert feature > 1.0  # steered by 2 units of the feature's own direction
        assert sample.scores["sae_feature"] == pytest.approx(feature)
    receipt = log.samples[0].output.metadata["tlvllm"]["receipt"]["interventions"][0]
    assert receipt["feature_before"] + 1.0 < receipt["feature_after"] <= receipt["feature_before"] + 2.0 + 1e-3

    command = [*shlex.split(sweep), "--limit", "1", "--log-dir", str(tmp_path / "sweep")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "sweep").glob("*.eval"))) == 3 + 2 * 2  # 3 coefficients, 2 controls at 1 and 2


def test_agent_tools_commands(smollm2_dir, vllm_ready, tmp_path):
    """The README's agent eval as written: a three-turn tool loop on SmolLM2 stores three captures
    per sample, each with every row of its own call (input and answer, as its model event counts
    them), and the README's reader prints them in order."""
    import shlex

    from inspect_ai.log import read_eval_log

    from inspect_tl_vllm import activations

    [command] = bash_lines("evals/agent_tools.py")
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "INSPECT_LOG_DIR": str(tmp_path / "logs")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(shlex.split(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    [log_file] = (tmp_path / "logs").glob("*.eval")
    log = read_eval_log(str(log_file))
    assert log.status == "success" and len(log.samples) == 2
    records = activations.load(log_file)
    for sample in log.samples:
        calls = [m for m in sample.messages if m.role == "assistant"]
        assert len(calls) == 3 and all(m.tool_calls and m.tool_calls[0].function == "add" for m in calls)
        events = [e for e in sample.events if e.event == "model"]
        mine = [r for r in records if r.sample_id == sample.id]
        assert [(r.call, r.input_messages) for r in mine] == [(0, 1), (1, 3), (2, 5)]
        for event, record in zip(events, mine, strict=True):
            rows = record.activations["blocks.20.hook_resid_post"]
            assert rows.shape == (event.output.usage.input_tokens + event.output.usage.output_tokens - 1, 576)
        assert mine[0].scores == {"tool_calls_made": 3}
    out = run_snippet(snippet('"*agent-tools*.eval"'), tmp_path, tmp_path / "script")
    printed = [line.split(":")[0] for line in out.strip().splitlines()]
    assert printed == [f"{s} call {c} after {1 + 2 * c} messages" for s in ("q1", "q2") for c in range(3)], out
