"""Which processes and threads used the host's CPU while a block ran.

On SmolLM2 a step is so short that host work sets the pace, so a thread that keeps
spinning, a thread count or memory that grows, or some other process taking the cores
would each change the numbers.  The throughput bench records, per run, the CPU seconds of
the busiest processes on the machine (their busiest threads by name), their kernel time,
thread counts, resident memory and involuntary context switches (times they were made to
wait for a core).  They show, for instance, whether the engine core's main thread is busy
all the time, and whether the same work takes more CPU time in one run than in another
(the host's own speed drifting; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_FIELDS = ["pid", "name", "cpu_times", "num_threads", "memory_info", "num_ctx_switches"]


@contextlib.contextmanager
def sampled(into: dict[str, Any], top: int = 5) -> Iterator[None]:
    """Fill ``into["procs"]`` with the block's CPU use (nothing without psutil)."""
    try:
        import psutil
    except ImportError:
        yield
        return
    before, system_before = _snapshot(psutil), psutil.cpu_times()
    started = time.perf_counter()
    try:
        yield
    finally:
        wall = time.perf_counter() - started
        after, system_after = _snapshot(psutil), psutil.cpu_times()
        idle = system_after.idle - system_before.idle
        total = sum(system_after) - sum(system_before)
        into["procs"] = {
            "wall_s": round(wall, 3),
            "busy_cores": round((total - idle) / max(wall, 1e-9), 2),  # system CPU seconds per second
            "cores": psutil.cpu_count(),
            "top": _busiest(before, after, top),
        }


def _snapshot(psutil: Any) -> dict[int, dict[str, Any]]:
    procs = {}
    for process in psutil.process_iter(_FIELDS):
        info = process.info
        if info["cpu_times"] is None:  # gone, or not ours to read
            continue
        try:
            threads = {t.id: t.user_time + t.system_time for t in process.threads()}
        except (psutil.Error, OSError):
            threads = {}
        procs[info["pid"]] = {**info, "threads": threads}
    return procs


def _busiest(before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]], top: int) -> list[dict[str, Any]]:
    rows = []
    for pid, now in after.items():
        then = before.get(pid)
        if then is None:
            continue
        user = now["cpu_times"].user - then["cpu_times"].user
        system = now["cpu_times"].system - then["cpu_times"].system
        rows.append((user + system, pid, user, system, now, then))
    rows.sort(key=lambda row: row[0], reverse=True)
    out = []
    for cpu, pid, user, system, now, then in rows[:top]:
        threads = sorted(
            ((now["threads"][tid] - then["threads"].get(tid, 0.0), tid) for tid in now["threads"]), reverse=True
        )
        out.append(
            {
                "pid": pid,
                "name": now["name"],
                "cpu_s": round(cpu, 3),
                "user_s": round(user, 3),
                "sys_s": round(system, 3),
                "threads": now["num_threads"],
                "rss_gb": round(now["memory_info"].rss / 1e9, 2),
                "involuntary_switches": now["num_ctx_switches"].involuntary - then["num_ctx_switches"].involuntary,
                "busiest_threads": [
                    {"name": _thread_name(pid, tid), "cpu_s": round(seconds, 3)} for seconds, tid in threads[:4]
                ],
            }
        )
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return str(tid)
