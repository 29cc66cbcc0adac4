"""The plugin installs into a researcher's existing Inspect environment and reads Inspect through
public API, but for one guarded function.

The install tests build this package's wheel and install it, with its dependencies, into a fresh
environment that already holds the newest inspect-ai PyPI serves (scripts/test.sh builds one with
the oldest this package declares and runs the provider tests there), then run ``inspect eval
--model tl-vllm/...`` there: the provider must be found by its entry point and pip must change
nothing the researcher had (scripts/range_env.py).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import TINY_MODEL_ARGS_CLI

ROOT = Path(__file__).resolve().parent.parent
HOOK = "blocks.1.hook_resid_post"
PRIVATE_ACCESS = ("src/inspect_tl_vllm/provider/active.py", "active_sample")


def private_inspect_imports(path: Path) -> list[tuple[str, str]]:
    """(enclosing function or '<module>', module) for each import of a private inspect_ai module."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else where
            modules: list[str] = []
            if isinstance(child, ast.ImportFrom) and child.module:
                modules = [child.module] + [f"{child.module}.{a.name}" for a in child.names]
            elif isinstance(child, ast.Import):
                modules = [a.name for a in child.names]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "inspect_ai" and any(p.startswith("_") for p in parts[1:]):
                    found.append((where, module))
                    break
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_inspect_is_read_privately_in_one_function_only():
    offenders = []
    for folder in ("src", "bench", "evals", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            for where, module in private_inspect_imports(path):
                if (relative, where) != PRIVATE_ACCESS:
                    offenders.append(f"{relative} ({where}): {module}")
    assert not offenders, "private inspect_ai imports outside provider/active.py:active_sample: " + "; ".join(offenders)
    # and the check sees the one that is there
    assert private_inspect_imports(ROOT / PRIVATE_ACCESS[0]) == [("active_sample", "inspect_ai.log._samples")]


def test_a_moved_inspect_api_fails_with_the_supported_range(monkeypatch):
    import inspect_ai.log._samples as samples

    from inspect_tl_vllm.provider.active import active_sample

    assert active_sample() is None  # outside an eval
    monkeypatch.delattr(samples, "sample_active")
    with pytest.raises(RuntimeError, match=r"supports inspect-ai.*>=0\.3\.221.*install a release in that range"):
        active_sample()


def test_the_declared_ranges_admit_what_the_suite_runs():
    from importlib.metadata import version

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for name in ("inspect-ai", "transformers"):
        spec = next(d for d in declared if d.startswith(name))
        assert re.search(r">=[\d.]+,\s*<\d", spec), f"{spec}: declare a range (oldest supported up to the next major)"
        from packaging.specifiers import SpecifierSet

        assert version(name) in SpecifierSet(spec[len(name) :]), f"{name} {version(name)} is outside {spec}"


def range_env(folder: Path, *args: str) -> dict:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "range_env.py"), str(folder), *args, "--wheel"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["returncode"] = result.returncode
    return report


@pytest.mark.engine
def test_the_wheel_installs_beside_inspect_without_changing_it_and_runs_an_eval(vllm_ready, tiny_llama_dir, tmp_path):
    """With the newest inspect-ai.  The oldest end is scripts/test.sh's: it builds the same kind of
    environment (range_env.py exits 1 when the wheel's install changes anything else) and runs the
    provider tests there, ``inspect eval`` on the command line included."""
    report = range_env(tmp_path / "env", "--pin", "inspect-ai")
    assert report["changed"] == {"inspect-tl-vllm": [None, "0.1.0"]}, f"pip changed the environment: {report}"
    assert report["returncode"] == 0

    python = Path(report["python"])
    (tmp_path / "task.py").write_text(
        "from inspect_ai import Task, task\nfrom inspect_ai.dataset import Sample\n"
        "from inspect_ai.solver import generate\n"
        "@task\ndef t():\n    return Task(dataset=[Sample(id=1, input='Hello'), Sample(id=2, input='Bye')],"
        " solver=generate())\n"
    )
    (tmp_path / "steer.json").write_text(
        json.dumps({"interventions": [{"hook": HOOK, "vector": [0.5] * 64, "coef": 4.0}]})
    )
    inspect = python.parent / "inspect"  # the console script of the environment's own inspect-ai
    cmd = [str(inspect), "eval", "task.py", "--model", f"tl-vllm/{tiny_llama_dir}", *TINY_MODEL_ARGS_CLI]
    cmd += ["-M", "steer=steer.json", "-M", f"capture={HOOK}", "-M", "capture_reduce=mean"]
    cmd += ["--max-tokens", "4", "--log-dir", "logs", "--display", "plain"]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "PYTHONPATH": ""}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    check = (
        "import sys, inspect_ai, inspect_tl_vllm\n"
        "from inspect_ai.log import read_eval_log\n"
        "from inspect_tl_vllm import activations\n"
        "log = read_eval_log(sys.argv[1])\n"
        "records = activations.load(log)\n"
        "print(inspect_ai.__version__, inspect_tl_vllm.__file__, log.status, len(records),\n"
        "      sorted({len(s.output.metadata['tlvllm']['receipt']['interventions']) for s in log.samples}))\n"
    )
    log = next((tmp_path / "logs").glob("*.eval"))
    shown = subprocess.run([str(python), "-c", check, str(log)], capture_output=True, text=True, env=env, timeout=300)
    assert shown.returncode == 0, shown.stderr[-2000:]
    version, module, status, records, receipts = shown.stdout.split(maxsplit=4)
    assert version == report["versions"]["inspect-ai"]
    assert str(tmp_path / "env") in module  # the installed wheel, not the project's source tree
    assert (status, records, receipts.strip()) == ("success", "2", "[1]")
