"""Why a dead engine died, in words a user can act on.

vLLM reports a dead engine as ``EngineDeadError`` whatever ended it.  The engine-core processes'
exit statuses say more (a negative status is the signal that killed the process), and on Linux
with cgroup v2 the kernel counts the processes its out-of-memory killer ended in this memory
group (``oom_kill`` in ``memory.events``): a count that rose since the engine booted means the
engine, or one of its workers, ran the machine out of memory.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

MEMORY_EVENTS = Path("/sys/fs/cgroup/memory.events")
EXIT_WAIT_S = 2.0
"""How long to wait for a dying engine's processes to report their exit status."""
LOWER_MEMORY = (
    "lower -M max_num_seqs, -M max_model_len or -M kv_cache_memory_bytes, run fewer evals on this machine "
    "at once, or free memory"
)


def oom_kills(events: Path = MEMORY_EVENTS) -> int | None:
    """Processes the out-of-memory killer has ended in this memory group, or None where the kernel
    keeps no such count (no cgroup v2, another OS)."""
    try:
        text = events.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def finished_engine_processes(llm: Any, wait_s: float = EXIT_WAIT_S) -> dict[str, int]:
    """{process name: exit status} of the engine's core processes that have ended (vLLM's
    ``CoreEngineProcManager.finished_procs``); waits up to ``wait_s`` for one to end."""
    manager = getattr(getattr(getattr(llm, "engine_core", None), "resources", None), "engine_manager", None)
    finished = getattr(manager, "finished_procs", None)
    if not callable(finished):
        return {}
    deadline = time.monotonic() + wait_s
    while True:
        codes = dict(finished())
        if codes or time.monotonic() >= deadline:
            return codes
        time.sleep(0.1)


def describe_exit(name: str, status: int) -> str:
    if status >= 0:
        return f"{name} exited with status {status}"
    try:
        signame = signal.Signals(-status).name
    except ValueError:
        signame = f"signal {-status}"
    return f"{name} was killed by {signame}"


def why_engine_died(llm: Any, oom_kills_at_boot: int | None, events: Path = MEMORY_EVENTS) -> str:
    """The cause of an engine's death as far as this machine tells: its processes' exit statuses,
    and whether the out-of-memory killer acted since the boot, with what to lower."""
    codes = finished_engine_processes(llm)
    parts = [describe_exit(name, status) for name, status in sorted(codes.items())]
    now = oom_kills(events)
    if now is not None and oom_kills_at_boot is not None and now > oom_kills_at_boot:
        parts.append(
            f"the kernel's out-of-memory killer ended {now - oom_kills_at_boot} process(es) of this memory group "
            f"since the engine booted: {LOWER_MEMORY}"
        )
    elif -signal.SIGKILL in codes.values():
        parts.append(
            "SIGKILL comes from another process or from the kernel's out-of-memory killer (see `dmesg`); "
            f"if memory ran out, {LOWER_MEMORY}"
        )
    return "; ".join(parts) if parts else "no engine process reported an exit status"
