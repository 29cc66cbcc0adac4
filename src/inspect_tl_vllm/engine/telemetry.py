"""Where a worker's host time and memory go: counters that ``tlvllm_status`` reports and the
benchmarks difference per run.  Nothing here changes what the engine computes."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch


class HostTimer:
    """Wall time per phase of the worker's own per-step work, and (``<phase>_cpu``) the thread's
    CPU time within it: wall well above CPU time means the thread was waiting (for the GIL, or in
    a blocking call) rather than working."""

    def __init__(self, *phases: str) -> None:
        self.seconds = {key: 0.0 for phase in phases for key in (phase, f"{phase}_cpu")}

    @staticmethod
    def start() -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def add(self, phase: str, started: tuple[float, float]) -> None:
        self.seconds[phase] += time.perf_counter() - started[0]
        self.seconds[f"{phase}_cpu"] += time.thread_time() - started[1]

    def report(self) -> dict[str, float]:
        return {**{key: round(value, 6) for key, value in self.seconds.items()}, "gc": round(GC_TIMER.seconds, 6)}


class _GcTimer:
    """Time this process spends in Python's garbage collector, which pauses the step loop
    like any other host work.  One per process: collections belong to the process, and a
    callback bound to a controller would keep its buffers alive after its engine is gone."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._on_collection)
            self._installed = True

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started


GC_TIMER = _GcTimer()


def pinned_host_stats() -> dict[str, float]:
    """Growth of torch's pinned host memory pool in this process so far (zeros without CUDA).

    Per-token captures land in pinned blocks, and prompt captures written out early hold
    theirs until the writer is done, so a capture-heavy run may need new blocks; making one
    (``cudaHostAlloc``) is slow.
    """
    stats = torch.cuda.host_memory_stats() if torch.cuda.is_available() else {}
    return {
        "blocks_made": int(stats.get("num_host_alloc", 0)),
        "alloc_seconds": round(stats.get("host_alloc_time.total", 0) / 1e6, 4),  # reported in microseconds
        "bytes_held": int(stats.get("allocated_bytes.current", 0)),
    }
