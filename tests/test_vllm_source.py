"""The vLLM internals tl-vllm wraps and reads, checked against vLLM's own source, never imported.

``scripts/vllm_source.py`` holds the checker and the table of what tl-vllm needs (the methods
``engine/plugin.py`` and ``engine/runners.py`` wrap, with the parameters the wrappers rely on; the
attributes, batch and scheduler fields ``engine/runners.py`` and ``engine/worker.py`` read; the
engine arguments ``engine/construct.py`` passes or refuses; the imports and environment variables
the package names).  Here it runs on the CUDA wheel of each release in ``RELEASES`` (downloaded
once, cached in ``~/.cache/inspect-tl-vllm/vllm-wheels/``; PyPI out of reach fails under
``CI=true``, skips elsewhere) and on the installed vLLM's files, and on edited copies of that
source, each of which it must refuse: a rename in a future vLLM fails here with the file, class,
member and what tl-vllm needs it for.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import require
from inspect_tl_vllm.engine.plugin import RUN_UP_TO, release_tuple

ROOT = Path(__file__).resolve().parents[1]
RELEASES = ("0.33.0", "0.34.0")
"""The releases of tl-vllm's range (``plugin.VLLM_RANGE``) that have no CPU build, so the test suite
cannot run them: checked from their wheels; the next release is one more entry."""


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_source", ROOT / "scripts" / "vllm_source.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm_source"] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


vs = _load_script()


def _say(request: pytest.FixtureRequest, line: str) -> None:
    """A line on the terminal, past pytest's output capture."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module", params=RELEASES)
def release(request: pytest.FixtureRequest) -> Iterator[vs.WheelSource]:
    """A tracked release's wheel, fetched once per session (then from the cache)."""
    version = request.param
    started = time.monotonic()
    try:
        wheel, downloaded = vs.fetch_wheel(version)
    except vs.FetchError as err:
        require(False, f"vLLM {version}'s wheel could not be fetched from PyPI: {err}")
    took = time.monotonic() - started
    how = f"downloaded in {took:.1f} s" if downloaded else f"from the cache ({took:.2f} s)"
    _say(request, f"vLLM {version}: {wheel.name}, {wheel.stat().st_size / 2**20:.0f} MiB, {how}")
    source = vs.WheelSource(wheel, f"vLLM {version}")
    yield source
    source.close()


@pytest.fixture(scope="module")
def installed() -> vs.DirSource:
    source = vs.installed_source()
    require(source is not None, "vLLM is not installed: run scripts/setup.sh")
    return source


@pytest.fixture(scope="module")
def installed_passing(installed) -> vs.DirSource:
    """The installed source, which passes unedited: what fails once it is edited is the edit."""
    assert not vs.check(installed)
    return installed


def test_the_newest_tracked_release_has_what_tl_vllm_needs(release) -> None:
    assert vs.runners_built(release), f"{release.label}: its worker builds neither model runner"
    problems = vs.check(release)
    assert not problems, "\n".join(problems)


def test_the_installed_vllm_has_what_tl_vllm_needs(installed) -> None:
    from inspect_tl_vllm.engine.plugin import installed_vllm

    if release_tuple(installed_vllm()) <= release_tuple(RUN_UP_TO):  # both model runners, V1 the CPU build's
        assert vs.runners_built(installed) == ["V1", "V2"]
    problems = vs.check(installed)
    assert not problems, "\n".join(problems)


def test_every_method_the_package_wraps_is_in_the_table() -> None:
    """A wrapper added to plugin.py or runners.py without its entry here would go unchecked."""
    runner_classes = {"GPUModelRunner": "runner"}
    table = {
        (runner_classes.get(need.cls, need.cls), need.name)
        for need in (*vs.COMMON, *vs.V1, *vs.V2)
        if isinstance(need, vs.Method)
    }
    wrapped = vs.wrapped_by_package()
    assert wrapped == table, f"wrapped but not checked: {wrapped - table}; checked but not wrapped: {table - wrapped}"
    assert ("Worker", "load_model") in wrapped and ("runner", "prepare_inputs") in wrapped  # the scan sees them


def test_the_package_leaves_the_model_runner_to_vllm() -> None:
    """vLLM 0.34 refuses VLLM_USE_V2_MODEL_RUNNER other than "1" (Model Runner V1 is gone) and
    earlier releases pick the runner per platform: tl-vllm neither sets nor reads the variable."""
    named = vs.package_env_vars()
    assert "VLLM_USE_V2_MODEL_RUNNER" not in named, named.get("VLLM_USE_V2_MODEL_RUNNER")
    assert "VLLM_PLUGINS" in named  # the scan sees the names the code does use
    assert "VLLM_USE_V2_MODEL_RUNNER" in vs.package_env_vars(include_docstrings=True)  # runners.py's docstring


# -- the checker refuses edited source --------------------------------------------------------------


Edit = Callable[[ast.Module], int]
"""Changes a parsed file in place; returns how many places it changed."""


def _classes(tree: ast.Module, name: str) -> list[ast.ClassDef]:
    return [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]


def _defs(tree: ast.Module, cls: str, method: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [
        node
        for klass in _classes(tree, cls)
        for node in klass.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == method
    ]


def drop_param(cls: str, method: str, param: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for func in _defs(tree, cls, method):
            args = func.args
            for kind in ("args", "kwonlyargs"):
                names = [a.arg for a in getattr(args, kind)]
                if param in names:
                    index = names.index(param)
                    getattr(args, kind).pop(index)
                    if kind == "args":
                        first_default = len(names) - len(args.defaults)
                        if index >= first_default:
                            args.defaults.pop(index - first_default)
                    else:
                        args.kw_defaults.pop(index)
                    count += 1
        return count

    return edit


def swap_first_params(cls: str, method: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        funcs = _defs(tree, cls, method)
        for func in funcs:
            func.args.args[1], func.args.args[2] = func.args.args[2], func.args.args[1]
        return len(funcs)

    return edit


def rename_def(cls: str, method: str, new: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        funcs = _defs(tree, cls, method)
        for func in funcs:
            func.name = new
        return len(funcs)

    return edit


def make_async(cls: str, method: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for klass in _classes(tree, cls):
            for index, node in enumerate(klass.body):
                if isinstance(node, ast.FunctionDef) and node.name == method:
                    async_def = ast.AsyncFunctionDef(**{f: getattr(node, f) for f in node._fields})
                    klass.body[index] = ast.copy_location(async_def, node)
                    count += 1
        return count

    return edit


def set_return(cls: str, method: str, annotation: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        funcs = _defs(tree, cls, method)
        for func in funcs:
            func.returns = ast.Name(annotation)
        return len(funcs)

    return edit


def drop_members(cls: str, *names: str) -> Edit:
    """Remove class-level fields and methods named ``names``."""

    def edit(tree: ast.Module) -> int:
        count = 0
        for klass in _classes(tree, cls):
            kept = []
            for node in klass.body:
                target = node.target if isinstance(node, ast.AnnAssign) else node
                if getattr(target, "id", getattr(target, "name", None)) in names:
                    count += 1
                else:
                    kept.append(node)
            klass.body = kept or [ast.Pass()]
        return count

    return edit


def rename_field(cls: str, name: str, new: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for klass in _classes(tree, cls):
            for node in klass.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    node.target.id = new
                    count += 1
        return count

    return edit


def rename_self_attr(cls: str, attr: str, new: str) -> Edit:
    """``self.attr`` becomes ``self.new`` throughout the class (assignments and reads)."""

    def edit(tree: ast.Module) -> int:
        count = 0
        for klass in _classes(tree, cls):
            for node in ast.walk(klass):
                if isinstance(node, ast.Attribute) and node.attr == attr and vs.dotted(node.value) == "self":
                    node.attr = new
                    count += 1
        return count

    return edit


def reassign(cls: str, attr: str, value: str) -> Edit:
    """Every ``self.attr = ...`` in the class assigns ``value`` instead."""

    def edit(tree: ast.Module) -> int:
        count = 0
        for klass in _classes(tree, cls):
            for node in ast.walk(klass):
                targets = node.targets if isinstance(node, ast.Assign) else []
                if any(vs.dotted(t) == f"self.{attr}" for t in targets):
                    node.value = ast.parse(value, mode="eval").body
                    count += 1
        return count

    return edit


def rename_self_calls(cls: str, method: str, callee: str, new: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for func in _defs(tree, cls, method):
            for node in ast.walk(func):
                if isinstance(node, ast.Call) and vs.dotted(node.func) == f"self.{callee}":
                    node.func.attr = new
                    count += 1
        return count

    return edit


def keywords_to_positional(method: str, keyword: str) -> Edit:
    """Calls ``x.method(..., keyword=...)`` pass all their keyword arguments positionally."""

    def edit(tree: ast.Module) -> int:
        count = 0
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method):
                continue
            if any(k.arg == keyword for k in node.keywords):
                node.args += [k.value for k in node.keywords]
                node.keywords = []
                count += 1
        return count

    return edit


def add_method(cls: str, name: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        klasses = _classes(tree, cls)
        for klass in klasses:
            klass.body.append(ast.parse(f"def {name}(self):\n    return None").body[0])
        return len(klasses)

    return edit


def retarget_imports(name: str, modules: tuple[str, ...], new: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in modules and any(a.name == name for a in node.names):
                node.module = new
                count += 1
        return count

    return edit


def drop_dict_key(variable: str, key: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        count = 0
        for node in ast.walk(tree):
            target = node.target if isinstance(node, ast.AnnAssign) else None
            if isinstance(target, ast.Name) and target.id == variable and isinstance(node.value, ast.Dict):
                pairs = [(k, v) for k, v in zip(node.value.keys, node.value.values, strict=True)]
                kept = [(k, v) for k, v in pairs if not (isinstance(k, ast.Constant) and k.value == key)]
                count += len(pairs) - len(kept)
                node.value.keys, node.value.values = [k for k, _ in kept], [v for _, v in kept]
        return count

    return edit


def rename_class(name: str, new: str) -> Edit:
    def edit(tree: ast.Module) -> int:
        klasses = _classes(tree, name)
        for klass in klasses:
            klass.name = new
        return len(klasses)

    return edit


@dataclass(frozen=True)
class Mutation:
    name: str
    edits: tuple[tuple[str, Edit], ...]  # (file, edit); together they must change something
    expect: str  # in one of the checker's problem lines
    runner: str | None = None  # the model runner it edits ("V1": releases without it are left out)


MUTATIONS = (
    Mutation(
        "execute_model without dummy_run",
        ((vs.V2_RUNNER, drop_param("GPUModelRunner", "execute_model", "dummy_run")),),
        "gpu/model_runner.py: GPUModelRunner.execute_model: parameter 'dummy_run' (by keyword) is missing",
        "V2",
    ),
    Mutation(
        "prepare_inputs renamed",
        ((vs.V2_RUNNER, rename_def("GPUModelRunner", "prepare_inputs", "prepare_batch")),),
        "gpu/model_runner.py: GPUModelRunner.prepare_inputs: no such method",
        "V2",
    ),
    Mutation(
        "scheduler_output no longer first",
        ((vs.V2_RUNNER, swap_first_params("GPUModelRunner", "execute_model")),),
        "GPUModelRunner.execute_model: parameters after self are ['intermediate_tensors', 'scheduler_output'",
        "V2",
    ),
    Mutation(
        "prepare_inputs returns another type",
        ((vs.V2_RUNNER, set_return("GPUModelRunner", "prepare_inputs", "StepInputs")),),
        "GPUModelRunner.prepare_inputs: returns StepInputs, expected InputBatch",
        "V2",
    ),
    Mutation(
        "prepare_inputs called around self",
        ((vs.V2_RUNNER, rename_self_calls("GPUModelRunner", "execute_model", "prepare_inputs", "_prepare")),),
        "GPUModelRunner.execute_model: never calls self.prepare_inputs(...)",
        "V2",
    ),
    Mutation(
        "dummy_run passed positionally",
        ((vs.V2_RUNNER, keywords_to_positional("execute_model", "dummy_run")),),
        "passes dummy_run positionally",
        "V2",
    ),
    Mutation(
        "an InputBatch field renamed",
        ((vs.V2_BATCH, rename_field("InputBatch", "query_start_loc_np", "query_start_loc_cpu")),),
        "gpu/input_batch.py: InputBatch.query_start_loc_np: no such field",
        "V2",
    ),
    Mutation(
        "computed tokens in neither place",
        (
            (vs.V2_BATCH, rename_field("InputBatch", "num_computed_tokens_np", "computed_np")),
            (vs.V2_STATES, rename_self_attr("RequestState", "num_computed_tokens_np", "computed_np")),
        ),
        "none of the alternatives holds: vllm/v1/worker/gpu/input_batch.py: InputBatch.num_computed_tokens_np",
        "V2",
    ),
    Mutation(
        "Worker.load_model renamed",
        ((vs.WORKER, rename_def("Worker", "load_model", "load_weights")),),
        "gpu_worker.py: Worker.load_model: no such method",
    ),
    Mutation(
        "compile_or_warm_up_model made async",
        ((vs.WORKER, make_async("Worker", "compile_or_warm_up_model")),),
        "Worker.compile_or_warm_up_model: is async now",
    ),
    Mutation(
        "the worker gains an extension's method",
        ((vs.WORKER, add_method("Worker", "tlvllm_status")),),
        "gpu_worker.py: Worker.tlvllm_status: exists",
    ),
    Mutation(
        "the worker builds another runner",
        ((vs.WORKER, retarget_imports("GPUModelRunner", tuple(vs.RUNNER_MODULES.values()), "vllm.v1.worker.gpu3")),),
        "imports GPUModelRunner from neither",
    ),
    Mutation(
        "the executor built from another argument",
        ((vs.EXECUTOR, drop_param("Executor", "__init__", "vllm_config")),),
        "abstract.py: Executor.__init__",
    ),
    Mutation(
        "a request's prompt length gone",
        ((vs.SCHED, drop_members("NewRequestData", "prompt_len", "prompt_embeds")),),
        "none of the alternatives holds: vllm/v1/core/sched/output.py: NewRequestData.prompt_len: no such field",
    ),
    Mutation(
        "finished requests renamed",
        ((vs.SCHED, rename_field("SchedulerOutput", "finished_req_ids", "finished_ids")),),
        "output.py: SchedulerOutput.finished_req_ids: no such field",
    ),
    Mutation(
        "a refused engine argument renamed",
        (("vllm/engine/arg_utils.py", rename_field("EngineArgs", "enable_dbo", "dual_batch_overlap")),),
        "arg_utils.py: EngineArgs.enable_dbo: no such field",
    ),
    Mutation(
        "an environment variable dropped",
        (("vllm/envs.py", drop_dict_key("environment_variables", "VLLM_PLUGINS")),),
        "vllm/envs.py: environment_variables has no VLLM_PLUGINS",
    ),
    Mutation(
        "an imported class renamed",
        (("vllm/v1/engine/exceptions.py", rename_class("EngineDeadError", "EngineGone")),),
        "exceptions.py: defines no EngineDeadError (src/inspect_tl_vllm/provider/model_api.py:",
    ),
    Mutation(
        "V1 _preprocess renamed",
        ((vs.V1_RUNNER, rename_def("GPUModelRunner", "_preprocess", "_prepare_step")),),
        "gpu_model_runner.py: GPUModelRunner._preprocess: no such method",
        "V1",
    ),
    Mutation(
        "V1 req_indices renamed",
        ((vs.V1_RUNNER, rename_self_attr("GPUModelRunner", "req_indices", "row_requests")),),
        "gpu_model_runner.py: GPUModelRunner.req_indices: no such attribute",
        "V1",
    ),
    Mutation(
        "V1 positions made a CPU/GPU buffer",
        ((vs.V1_RUNNER, reassign("GPUModelRunner", "positions", "self._make_buffer(8, dtype=torch.int64)")),),
        "GPUModelRunner.positions: __init__ assigns self._make_buffer(8, dtype=torch.int64), expected a result of",
        "V1",
    ),
    Mutation(
        "V1 resumed requests renamed",
        ((vs.SCHED, rename_field("CachedRequestData", "resumed_req_ids", "resumed_ids")),),
        "output.py: CachedRequestData.resumed_req_ids: no such field",
        "V1",
    ),
)


def edited(source, mutation: Mutation):
    """``source`` with ``mutation``'s edits applied."""
    edits: dict[str, str | None] = {}
    changed = 0
    for path in dict.fromkeys(path for path, _ in mutation.edits):
        text = source.text(path)
        assert text is not None, f"{mutation.name}: {source.label} has no {path}"
        tree = ast.parse(text)  # a copy of its own: the source's parse is cached
        changed += sum(edit(tree) for p, edit in mutation.edits if p == path)
        edits[path] = ast.unparse(tree)
    assert changed, f"{mutation.name}: the edits found nothing to change in {source.label}"
    return vs.EditedSource(source, edits)


def refused(source, mutation: Mutation) -> str | None:
    """Why the checker failed to refuse the edited source, or None when it refused it as expected."""
    problems = vs.check(edited(source, mutation))
    if any(mutation.expect in line for line in problems):
        return None
    return f"{mutation.name}: expected a problem with {mutation.expect!r}, got {problems or 'none'}"


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_the_checker_refuses_an_edited_installed_vllm(installed_passing, mutation: Mutation) -> None:
    assert refused(installed_passing, mutation) is None


def test_the_checker_refuses_edited_copies_of_the_release(release) -> None:
    assert not vs.check(release)
    built = vs.runners_built(release)
    applicable = [m for m in MUTATIONS if m.runner is None or m.runner in built]
    assert len(applicable) >= 15, [m.name for m in applicable]
    misses = [miss for mutation in applicable if (miss := refused(release, mutation))]
    assert not misses, "\n".join(misses)
