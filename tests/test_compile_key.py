"""The compile-cache key covers the code traced into the compiled graph, and only that code."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from inspect_tl_vllm.engine.config import GRAPH_CODE, PACKAGE, hook_code_version


def _edited_copy(tmp_path: Path, name: str) -> Path:
    package = tmp_path / "package"
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    with (package / name).open("a") as file:
        file.write("\n# an edit\n")
    return package


def test_editing_graph_code_changes_the_key_and_host_code_does_not(tmp_path):
    before = hook_code_version()
    assert hook_code_version(_edited_copy(tmp_path / "a", "instrument/routing.py")) == before
    assert hook_code_version(_edited_copy(tmp_path / "b", "engine/frontend.py")) == before
    for name in GRAPH_CODE:
        assert hook_code_version(_edited_copy(tmp_path / name.replace("/", "_"), name)) != before, name


def test_graph_code_lists_every_instrument_module_it_imports():
    """A module of instrument/ that the graph code imports runs in the graph too: it must be listed."""
    listed = set(GRAPH_CODE)
    for name in GRAPH_CODE:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("inspect_tl_vllm.instrument"):
                modules = [node.module] if node.module != "inspect_tl_vllm.instrument" else [
                    f"inspect_tl_vllm.instrument.{alias.name}" for alias in node.names
                ]  # fmt: skip
                for module in modules:
                    path = module.removeprefix("inspect_tl_vllm.").replace(".", "/") + ".py"
                    assert path in listed, f"{name} imports {module}, which GRAPH_CODE leaves out"
