"""Host time of the step router per decode step, without a model.

    python bench/router_cost.py [--requests 256] [--steps 300] [--width 4096] [--sites 34] [--profile] [--out F]

The router's ``begin_step`` / ``end_step`` run on vLLM's critical path: at 256 concurrent
requests an 8B decode step on an H200 is ~11 ms, most of it vLLM's own host work, so every
tenth of a millisecond the router adds can show in throughput.  This drives a real
``StepRouter`` through a prefill step and then decode steps for four workloads (every request
steered at one site, every request capturing one site reduced by mean, every request capturing
the top 32 features of a stand-in SAE per token, and nothing requested) and prints the median
host time per decode step, as wall time and as the thread's CPU time.  It runs on the GPU when
there is one (device copies and kernel launches included) and on the CPU otherwise.  Set
against the worker's ``host_seconds`` in the throughput bench (which records both too), it tells
the router's own cost apart from time the worker spends waiting (for the GIL, or for the
device) inside vLLM.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.plans import CaptureItem, RequestState, Scope, SteerItem
from inspect_tl_vllm.instrument.routing import StepRouter
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.wire import FeaturesWire

PROMPT_LEN = 40
SAE_FEATURES = 1024  # the stand-in SAE's width: the host work does not depend on it


class StandInEncoder:
    """An SAE encoder for the ``features`` workload: a ReLU of one matmul, as cheap as it gets,
    so that what is measured is the router's host work around it."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.d_sae = SAE_FEATURES
        self.weight = torch.randn(width, SAE_FEATURES, device=device, dtype=torch.bfloat16) / width**0.5

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows @ self.weight).float().relu()


def states(workload: str, count: int, site: int, encoder: Any = None) -> list[RequestState]:
    out = []
    for i in range(count):
        state = RequestState(uid=f"r{i}", prompt_len=PROMPT_LEN, steer=[], capture=[])
        if workload == "steer":
            row = np.array([i + 1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)  # add bank row i + 1
            state.steer = [SteerItem(0, "add", site, 0, row, Scope.resolve("all", PROMPT_LEN))]
        elif workload == "capture_mean":
            state.capture = [CaptureItem(hook="h", site=site)]
            state.capture_scope = Scope.resolve("all", PROMPT_LEN)
            state.reduce = "mean"
        elif workload == "features":  # top 32 SAE features per token (instrument/feature_captures.py)
            state.capture = [CaptureItem(hook="h", site=site)]
            state.capture_scope = Scope.resolve("all", PROMPT_LEN)
            state.features = FeaturesWire(sae="-", top_k=32, features=None, reduce="none")
            state.encoder = encoder
        out.append(state)
    return out


def run(workload: str, args: argparse.Namespace, device: torch.device) -> list[tuple[float, float]]:
    """Per decode step: (wall seconds, this thread's CPU seconds)."""
    runtime = HookRuntime(
        site_indices=list(range(args.sites)),
        hidden_size=args.width,
        max_tokens=max(args.requests * PROMPT_LEN, 8192),
        max_stack=1,
        max_vectors=args.requests,
        device=device,
        act_dtype=torch.bfloat16,
    )
    router = StepRouter(runtime)
    site = args.sites // 2
    encoder = StandInEncoder(args.width, device) if workload == "features" else None
    requests = states(workload, args.requests, site, encoder) if workload != "plain" else []
    for state in requests:
        router.admit(state)
    n = len(requests)
    batch_index = np.arange(n, dtype=np.int64)
    query_start = np.arange(0, (n + 1) * PROMPT_LEN, PROMPT_LEN, dtype=np.int32)  # prefill: PROMPT_LEN rows each
    computed = np.zeros(n, dtype=np.int32)
    router.begin_step(batch_index, query_start, computed)
    router.end_step()
    query_start = np.arange(n + 1, dtype=np.int32)  # decode: one row each
    computed += PROMPT_LEN
    times = []
    for _ in range(args.steps):
        started, cpu = time.perf_counter(), time.thread_time()
        router.begin_step(batch_index, query_start, computed)
        router.end_step()
        times.append((time.perf_counter() - started, time.thread_time() - cpu))
        computed += 1
    router.drain()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sites", type=int, default=34)
    parser.add_argument("--profile", action="store_true", help="print the top functions of the steer workload")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": str(device), "requests": args.requests, "width": args.width, "sites": args.sites}
    for workload in ("plain", "steer", "capture_mean", "features"):
        times = run(workload, args, device)[10:]
        result[f"{workload}_ms_per_step"] = round(1e3 * statistics.median(wall for wall, _ in times), 3)
        result[f"{workload}_cpu_ms_per_step"] = round(1e3 * statistics.median(cpu for _, cpu in times), 3)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        run("steer", args, device)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
