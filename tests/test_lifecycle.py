"""An instrumented engine dies with the process that owns it, and leaves no hand-off folder.

A front end killed with SIGKILL (``inspect`` ended by the OOM killer or a scheduler) runs no
clean-up.  The engine's processes must notice and end themselves (``plugin.py``'s parent
watchdog), and the next front end must remove the dead one's hand-off folder (``handoff.py``).

Run as a script, this file is that front end: ``python test_lifecycle.py MODEL_DIR INFO_FILE``
boots an instrumented engine through the Inspect provider (on its private event-loop thread,
as ``inspect eval`` does), writes its pid and hand-off folder to INFO_FILE, and waits to be killed.
"""

from __future__ import annotations

import contextlib
import json
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


@pytest.mark.engine
def test_killed_front_end_takes_engine_and_handoff_folder_with_it(
    vllm_ready: None, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    from inspect_tl_vllm.engine.handoff import HandoffFolder

    info_file, log_file = tmp_path / "info.json", tmp_path / "front_end.log"
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    with log_file.open("w") as log:
        front_end = subprocess.Popen(
            [sys.executable, __file__, str(tiny_llama_dir), str(info_file)], stdout=log, stderr=log, env=env
        )
    engine: list[Process] = []
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not info_file.exists() and front_end.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert info_file.exists(), f"front end did not boot (exit {front_end.poll()}):\n{log_file.read_text()[-3000:]}"
        info = json.loads(info_file.read_text())
        assert info["pid"] == front_end.pid
        engine = _descendants(front_end.pid)  # engine core, its worker, multiprocessing's resource tracker
        names = [_cmdline(pid) for pid, _ in engine]
        assert any("EngineCore" in name for name in names), names
        assert any("Worker" in name for name in names), names
        assert Path(info["handoff"]).is_dir()

        front_end.kill()
        front_end.wait(timeout=10)
        survivors = _wait_until_gone(engine, GONE_TIMEOUT_S)
        assert not survivors, f"still running {GONE_TIMEOUT_S} s after the front end was killed: {survivors}"
        assert "is gone; exiting" in log_file.read_text()  # the watchdog, not some other exit, ended the core

        HandoffFolder().close()  # the next front end's folder sweeps the dead one's away
        assert not Path(info["handoff"]).exists()
    finally:
        front_end.kill()  # a no-op once it is reaped
        _kill_all(engine)
        front_end.wait(timeout=10)


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


def _front_end(model_dir: str, info_file: Path) -> None:
    import asyncio

    from inspect_ai.model import get_model

    model = get_model(f"tl-vllm/{model_dir}", boot="eager", dtype="float32", max_model_len=256, seed=0)
    core = asyncio.run(model.api.engine_thread.instrumented())
    partial = info_file.with_suffix(".tmp")
    partial.write_text(json.dumps({"pid": os.getpid(), "handoff": str(core.instrumentation.handoff.path)}))
    partial.rename(info_file)  # the test never reads a half-written file
    time.sleep(BOOT_TIMEOUT_S)


if __name__ == "__main__":
    _front_end(sys.argv[1], Path(sys.argv[2]))
