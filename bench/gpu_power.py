"""GPU clock and power while a block runs, sampled through NVML (nothing without a GPU).

A GPU under its power cap lowers its clocks, and how much power a matrix multiply draws
depends on the numbers in it: rows that repeat, or values near zero, switch fewer bits.
A random-weight model with vLLM's dummy weights (uniform in +-1e-3, norm weights included)
decodes nearly the same token for every request, so its batches are full of repeated rows,
and a variant that changes the outputs (steering) may thereby change how hard the GPU
works.  The throughput bench records each run's clocks and power so that such a difference,
if there is one, shows as what it is.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from collections.abc import Iterator
from typing import Any

_SW_POWER_CAP = 0x4  # nvmlClocksThrottleReasonSwPowerCap
_HW_SLOWDOWN = 0x8  # nvmlClocksThrottleReasonHwSlowdown


@contextlib.contextmanager
def sampled(into: dict[str, Any], device: int = 0, period_s: float = 0.02) -> Iterator[None]:
    """Fill ``into`` with the SM clock (MHz), power (W) and throttle share seen during the block."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device)
    except Exception:  # no NVML, no driver or no GPU: the run is simply not annotated
        yield
        return
    clocks: list[int] = []
    watts: list[float] = []
    capped = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal capped
        while not done.wait(period_s):
            clocks.append(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM))
            watts.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1000)
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
            capped += bool(reasons & (_SW_POWER_CAP | _HW_SLOWDOWN))

    thread = threading.Thread(target=sample, name="gpu-power", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        if clocks:
            into["gpu"] = {
                "sm_clock_mhz_median": statistics.median(clocks),
                "sm_clock_mhz_min": min(clocks),
                "power_w_median": round(statistics.median(watts), 1),
                "power_capped_share": round(capped / len(clocks), 3),
                "samples": len(clocks),
            }
        pynvml.nvmlShutdown()
