"""Give each engine's busy processes physical cores of their own for the throughput bench.

On the small models the engine core's main thread is busy for the whole run, in vanilla vLLM
too, so its speed sets tokens/s.  On an H100 host the rounds of every variant fell into two
clusters, the busiest thread taking 1.6 s or 2.3 s of CPU for the same steps: wider apart than
the overheads the bench measures.  One cause that fits is the scheduler putting that thread on
the hyperthread sibling of another busy thread; pinning rules it out and gives every engine the
same kind of place: its engine core processes get whole physical cores (both siblings) for at
least four CPUs, its front-end process for two, and everything else (the bench's own process,
its samplers) the cores that are left.  It is an experiment of the bench (``--pin-cpus on``),
and it did not narrow the spread where tried (docs/BENCHMARKS.md, the 1B section: on a noisy
H200 host vanilla's pinned rounds spread as widely as its unpinned ones; on a quiet H100 host
neither spread); users' runs are not pinned.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def physical_cores(cpus: set[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), in CPU order; each CPU
    alone when the topology cannot be read."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(cpus):
        siblings_file = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            siblings = tuple(sorted(_parse_cpu_list(siblings_file.read_text()) & cpus))
        except (OSError, ValueError):
            siblings = (cpu,)
        groups.setdefault(siblings or (cpu,), []).append(cpu)
    return sorted(groups.values())


def _parse_cpu_list(text: str) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


ROLE_CPUS = {"front_end": 2, "engine_core": 4}
"""CPUs each role gets at least: the front end's main thread and its socket threads; the engine
core's main thread, and room beside it for the threads the instrumented engine adds (writers)."""


def plan(engines: list[str], cpus: set[int]) -> dict[str, Any] | None:
    """Which CPUs each engine's front end and engine core get (whole physical cores, at least
    ``ROLE_CPUS`` each), and what is left for the rest; None when the host has too few cores for
    that and one core more."""
    cores = physical_cores(cpus)
    layout: dict[str, Any] = {}
    for engine in engines:
        roles = {}
        for role, wanted in ROLE_CPUS.items():
            taken: list[int] = []
            while cores and len(taken) < wanted:
                taken += cores.pop(0)
            roles[role] = taken
        layout[engine] = roles
    short = any(len(roles[role]) < wanted for roles in layout.values() for role, wanted in ROLE_CPUS.items())
    if short or not cores:
        return None
    layout["rest"] = sorted(cpu for core in cores for cpu in core)
    return layout


def pin_tree(pid: int, cpus: list[int], *, children_to: list[int]) -> int:
    """Pin every thread of process ``pid`` to ``cpus`` and every thread of its descendants to
    ``children_to``; returns how many threads were pinned."""
    import psutil

    process = psutil.Process(pid)
    pinned = _pin_threads(pid, cpus)
    for child in process.children(recursive=True):
        pinned += _pin_threads(child.pid, children_to)
    return pinned


def _pin_threads(pid: int, cpus: list[int]) -> int:
    pinned = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
            pinned += 1
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            continue
    return pinned


def pin_engines(engine_pids: dict[str, int]) -> dict[str, Any]:
    """Pin each engine's process tree (front end: the process; engine core: its descendants)
    and the calling process (to the cores left); returns the layout, or why nothing was pinned."""
    cpus = os.sched_getaffinity(0)
    layout = plan(list(engine_pids), cpus)
    if layout is None:
        return {"pinned": False, "why": f"{len(physical_cores(cpus))} physical cores for {len(engine_pids)} engines"}
    try:
        threads = {
            engine: pin_tree(pid, layout[engine]["front_end"], children_to=layout[engine]["engine_core"])
            for engine, pid in engine_pids.items()
        }
        threads["bench"] = _pin_threads(os.getpid(), layout["rest"])
    except ImportError:
        return {"pinned": False, "why": "psutil is not installed"}
    return {"pinned": True, "layout": layout, "threads_pinned": threads}
