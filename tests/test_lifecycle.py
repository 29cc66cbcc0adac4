"""An instrumented engine dies with the process that owns it, and leaves no shared memory behind.

``inspect eval`` may end by SIGINT (Ctrl-C: Inspect cancels and the provider shuts its engine
down, or ends one still booting), SIGTERM or SIGKILL (a scheduler, the OOM killer: no clean-up
runs).  The engine's processes must then end themselves (``plugin.py``'s parent watchdog) and
remove the dead front end's hand-off folder (``handoff.py``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BOOT_TIMEOUT_S = 300  # the tiny model boots in 25-60 s on two shared cores
GONE_TIMEOUT_S = 15


Process = tuple[int, str]
"""A pid with its start time: a pid is reused once its process ends (other tests run alongside
this one), and clean-up must never signal a stranger."""


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name ([0] state, [1] ppid, [19] start
    time); empty when the process is gone (psutil is not a dependency)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def _process(pid: int) -> Process:
    fields = _stat(pid)
    return pid, fields[19] if fields else ""


def _running(process: Process) -> bool:
    """Whether the process exists and is not a zombie (ended, but not yet reaped by its new parent)."""
    fields = _stat(process[0])
    return bool(fields) and fields[0] != "Z" and fields[19] == process[1]


def _descendants(pid: int) -> list[Process]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(_process(child))
            todo.append(child)
    return found


def _wait_until_gone(processes: list[Process], timeout: float) -> list[Process]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p in processes if _running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _kill_all(processes: list[Process]) -> None:
    """Clean up after a failed test.  The engine's processes go first: once they are gone,
    multiprocessing's resource tracker unlinks the shared memory they left in /dev/shm and exits;
    killed with them, it would leave those segments behind."""
    trackers = [p for p in processes if "resource_tracker" in _cmdline(p[0])]
    _kill([p for p in processes if p not in trackers])
    _kill(_wait_until_gone(trackers, 5))


def _kill(processes: list[Process]) -> None:
    for process in processes:
        if _running(process):
            with contextlib.suppress(ProcessLookupError):
                os.kill(process[0], signal.SIGKILL)


TASK = """
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import Generate, TaskState, solver


@solver
def answer_then_mark():
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        state = await generate(state)
        Path("answered").touch()  # the engine has booted and generates
        return await generate(state)

    return solve


@task
def long_run():
    return Task(
        dataset=[Sample(id=i, input=f"Count to {i}.") for i in range(48)],
        solver=answer_then_mark(),
        config=GenerateConfig(max_tokens=200, temperature=0.0),
    )
"""
SHARED_MEMORY = Path("/dev/shm")


def _held_elsewhere(entries: set[Path]) -> set[Path]:
    """The entries that a live process holds: mapped or open, or a hand-off folder whose owner
    runs.  The session under test has ended, so these belong to other programs (another test
    run on the machine), not to it."""
    from inspect_tl_vllm.engine.handoff import folder_owner

    held = set()
    for entry in entries:
        owner = folder_owner(entry.name)
        if owner and _stat(owner[1]):
            held.add(entry)
    names = {str(entry): entry for entry in entries - held}
    for proc in Path("/proc").iterdir():
        if not (names and proc.name.isdigit()):
            continue
        with contextlib.suppress(OSError):
            open_paths = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            mapped = (proc / "maps").read_text()
            for name in list(names):
                if name in open_paths or name in mapped:
                    held.add(names.pop(name))
    return held


def _left_in_shared_memory(before: set[Path], settle_s: float = 3.0) -> list[str]:
    """What the ended session left in /dev/shm: entries new since ``before`` that no live process
    holds, and that are still there ``settle_s`` later (another program's short-lived entries are not)."""
    new = set(SHARED_MEMORY.iterdir()) - before
    new -= _held_elsewhere(new)
    if new:
        time.sleep(settle_s)
        new &= set(SHARED_MEMORY.iterdir())
        new -= _held_elsewhere(new)
    return sorted(str(path) for path in new)


def _session(sid: int) -> list[Process]:
    """The processes of session ``sid``: the eval and every process it started, re-parented or not."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) and int(fields[3]) == sid:
            found.append(_process(int(entry.name)))
    return [p for p in found if _running(p)]


@pytest.mark.engine
@pytest.mark.parametrize("phase", ["boot", "generation"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_an_interrupted_eval_leaves_no_engine_process_or_shared_memory(
    vllm_ready: None, tiny_llama_dir: Path, tmp_path: Path, signum: signal.Signals, phase: str
) -> None:
    """``inspect eval`` ended by a signal while its engine boots or generates: within seconds no
    process it started runs (engine core, worker, resource tracker) and ``/dev/shm`` holds nothing
    new (hand-off folder, vLLM's shared-memory queues)."""
    (tmp_path / "task.py").write_text(TASK)
    shared_before = set(SHARED_MEMORY.iterdir())
    log_file = tmp_path / "eval.log"
    inspect = str(Path(sys.executable).with_name("inspect"))
    # the generation cases boot in the background: a fresh process whose engine boots beside
    # Inspect's sample start (their imports once met in a circular import and failed the eval)
    boot = "background" if phase == "generation" else "lazy"
    model_args = ["-M", "dtype=float32", "-M", "max_model_len=512", "-M", f"boot={boot}"]
    command = [inspect, "eval", "task.py", "--model", f"tl-vllm/{tiny_llama_dir}", *model_args, "--display", "plain"]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    with log_file.open("w") as log:
        eval_process = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=log, env=env, start_new_session=True)
    session: list[Process] = []
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while eval_process.poll() is None and time.monotonic() < deadline:
            session = _session(eval_process.pid)
            booting = any("EngineCore" in _cmdline(pid) for pid, _ in session)
            if (phase == "boot" and booting) or (phase == "generation" and (tmp_path / "answered").exists()):
                break
            time.sleep(0.2)
        assert eval_process.poll() is None, f"the eval ended first:\n{log_file.read_text()[-3000:]}"
        if phase == "boot":
            time.sleep(2)  # into the engine core's start-up, before any sample is answered
            assert not (tmp_path / "answered").exists()
        session = _session(eval_process.pid)
        assert len(session) >= 3, [_cmdline(pid) for pid, _ in session]  # eval, engine core, resource tracker
        eval_process.send_signal(signum)
        eval_process.wait(timeout=GONE_TIMEOUT_S * 4 if signum == signal.SIGINT else GONE_TIMEOUT_S)
        survivors = _wait_until_gone(_session(eval_process.pid), GONE_TIMEOUT_S)
        assert not survivors, f"still running: {[_cmdline(pid) for pid, _ in survivors]}"
        left = _left_in_shared_memory(shared_before)
        assert not left, f"left in /dev/shm: {left}\n{log_file.read_text()[-3000:]}"
    finally:
        eval_process.kill()  # a no-op once it is reaped
        _kill_all(_session(eval_process.pid))
        eval_process.wait(timeout=10)


def test_sweep_keeps_live_owners_and_other_namespaces(tmp_path: Path) -> None:
    from inspect_tl_vllm.engine.handoff import PREFIX, _pid_namespace, sweep_stale

    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    assert not _stat(dead.pid)
    here = _pid_namespace()
    folders = {
        "dead": tmp_path / f"{PREFIX}{here}.{dead.pid}-abc",
        "live": tmp_path / f"{PREFIX}{here}.{os.getpid()}-abc",
        "other namespace": tmp_path / f"{PREFIX}{here + 1}.{dead.pid}-abc",
        "older name": tmp_path / f"{PREFIX}q8z1k2m3",
    }
    for folder in folders.values():
        folder.mkdir()
        (folder / "TOKEN").write_text("x")
    assert sweep_stale(tmp_path) == [folders["dead"]]
    assert {name for name, folder in folders.items() if folder.exists()} == {"live", "other namespace", "older name"}


def _watchdog_owner(report: multiprocessing.Queue) -> None:
    """A parent (the test kills it) of one vLLM-named child and one child of the user's own."""
    context = multiprocessing.get_context("fork")
    for name in ("VllmWorker-0", "user-process"):
        context.Process(target=_watchdog_child, args=(report,), name=name).start()
    time.sleep(BOOT_TIMEOUT_S)


def _watchdog_child(report: multiprocessing.Queue) -> None:
    from inspect_tl_vllm.engine.plugin import install_parent_watchdog

    installed = [install_parent_watchdog() for _ in range(3)]  # plugins load several times
    threads = sum(thread.name == "tlvllm-watchdog" for thread in threading.enumerate())
    report.put((multiprocessing.current_process().name, os.getpid(), installed, threads))
    time.sleep(BOOT_TIMEOUT_S)


def test_watchdog_only_in_vllm_children_once_and_ends_them_with_their_parent() -> None:
    from inspect_tl_vllm.engine.plugin import install_parent_watchdog

    assert install_parent_watchdog() is False  # never in the user's own process
    context = multiprocessing.get_context("fork")
    report = context.Queue()
    owner = context.Process(target=_watchdog_owner, args=(report,), name="owner")
    owner.start()
    children: dict[str, Process] = {}
    try:
        for _ in range(2):
            name, pid, installed, threads = report.get(timeout=30)
            children[name] = _process(pid)
            assert (installed, threads) == (([True] * 3, 1) if name == "VllmWorker-0" else ([False] * 3, 0)), name
        owner.kill()
        owner.join(timeout=10)
        assert not _wait_until_gone([children["VllmWorker-0"]], GONE_TIMEOUT_S)
        assert _running(children["user-process"])  # left alone
    finally:
        owner.kill()  # a no-op once it is reaped
        _kill_all(list(children.values()))
        owner.join(timeout=10)


def test_shared_memory_left_by_an_ended_session_is_told_from_another_programs() -> None:
    """The check above reports what nobody holds, and leaves out what a live process holds (a
    test run beside this one): an entry it has open, and a hand-off folder of a live owner."""
    from inspect_tl_vllm.engine.handoff import PREFIX

    before = set(SHARED_MEMORY.iterdir())
    left = SHARED_MEMORY / f"tlvllm-test-left-{os.getpid()}"
    held = SHARED_MEMORY / f"tlvllm-test-held-{os.getpid()}"
    live_handoff = SHARED_MEMORY / f"{PREFIX}0.{os.getpid()}-test"
    holder = None
    try:
        left.write_bytes(b"x")
        held.write_bytes(b"x")
        live_handoff.mkdir()
        holder = subprocess.Popen(["sleep", "30"], stdin=held.open("rb"))
        assert _left_in_shared_memory(before, settle_s=0.1) == [str(left)]
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        for path in (left, held):
            path.unlink(missing_ok=True)
        live_handoff.rmdir()
