"""Host time of the step router per decode step, without a model.

    python bench/router_cost.py [--requests 256] [--steps 300] [--width 4096] [--sites 34]
                                [--profile | --count-ops] [--profile-workload W] [--out F]

The router's ``begin_step`` / ``end_step`` run on vLLM's critical path: at 256 concurrent
requests an 8B decode step on an H200 is ~11 ms, most of it vLLM's own host work, so every
tenth of a millisecond the router adds can show in throughput.  This drives a real
``StepRouter`` through a prefill step and then decode steps for six workloads (every request
steered at one site; every request capturing one site reduced by mean; each of the two with
one request replaced by a new one, prefilling, every step, as when an eval's samples finish at
different times; every request capturing the top 32 features of a stand-in SAE per token; and
nothing requested) and prints the median host time per step, as wall time and as the thread's CPU
time.  Each row's batch index and position are made before the clock starts: vLLM's runner
computes them for its own inputs.  It runs on the GPU when
there is one (device copies and kernel launches included) and on the CPU otherwise.  Set
against the worker's ``host_seconds`` in the throughput bench (which records both too), it tells
the router's own cost apart from time the worker spends waiting (for the GIL, or for the
device) inside vLLM.

``--count-ops`` counts the torch operations one workload's steps dispatch, per line of this
package that called them (views left out: they launch nothing).  On a GPU each is a kernel
launch or copy of some 20-30 µs of host time, so the count carries over from the CPU machine.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import itertools
import json
import pstats
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.engine.worker import batch_indices
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState, Scope, SteerItem
from inspect_tl_vllm.instrument.routing import StepRouter
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.wire import FeaturesWire

PROMPT_LEN = 40
REQUEST_IDS = itertools.count()
SAE_FEATURES = 1024  # the stand-in SAE's width: the host work does not depend on it
WORKLOADS = ("plain", "steer", "steer_churn", "capture_mean", "capture_mean_churn", "features")


class StandInEncoder:
    """An SAE encoder for the ``features`` workload: a ReLU of one matmul, as cheap as it gets,
    so that what is measured is the router's host work around it."""

    def __init__(self, width: int, device: torch.device) -> None:
        self.d_sae = SAE_FEATURES
        self.weight = torch.randn(width, SAE_FEATURES, device=device, dtype=torch.bfloat16) / width**0.5

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows @ self.weight).float().relu()


def states(workload: str, count: int, site: int, encoder: Any = None) -> list[RequestState]:
    kind = workload.removesuffix("_churn")
    out = []
    for i in range(count):
        state = RequestState(uid=f"r{i}", prompt_len=PROMPT_LEN, steer=[], capture=[])
        state.req_id = f"{state.uid}-{next(REQUEST_IDS)}"  # as vLLM's, unique per request
        if kind == "steer":
            row = np.array([i + 1, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)  # add bank row i + 1
            state.steer = [SteerItem(0, "add", site, 0, row, Scope.resolve("all", PROMPT_LEN))]
        elif kind == "capture_mean":
            state.capture = [CaptureItem(hook="h", site=site)]
            state.capture_scope = Scope.resolve("all", PROMPT_LEN)
            state.reduce = "mean"
        elif kind == "features":  # top 32 SAE features per token (instrument/feature_captures.py)
            state.capture = [CaptureItem(hook="h", site=site)]
            state.capture_scope = Scope.resolve("all", PROMPT_LEN)
            state.features = FeaturesWire(sae="-", digest="-", top_k=32, features=None, reduce="none")
            state.encoder = encoder
        out.append(state)
    return out


def run(workload: str, args: argparse.Namespace, device: torch.device) -> list[tuple[float, float]]:
    """Per decode step: (wall seconds, this thread's CPU seconds)."""
    runtime = HookRuntime(
        site_widths=dict.fromkeys(range(args.sites), args.width),
        bank_width=args.width,
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
    computed += PROMPT_LEN
    churn = workload.endswith("_churn")
    times = []
    for step in range(args.steps):
        if churn:  # one request done, a new one in its batch slot (a real eval's steady state)
            k = step % n
            router.retire(requests[k])
            requests[k] = states(workload, 1, site)[0]
            router.admit(requests[k])
            computed[k] = 0
        # What vLLM's runner computes for the step, on the device: each row's batch index and position.
        counts = np.where(computed == 0, PROMPT_LEN, 1)
        query_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        row_batch = np.repeat(np.arange(n), counts)
        positions = computed[row_batch] + np.arange(len(row_batch)) - query_start[row_batch]
        rows = (torch.from_numpy(row_batch).to(device), torch.from_numpy(positions.astype(np.int64)).to(device))
        index_of = {state.req_id: b for b, state in enumerate(requests)}  # vLLM's req_id_to_index
        started, cpu = time.perf_counter(), time.thread_time()
        index = batch_indices(router.states, index_of) if churn else batch_index  # the worker's lookup
        router.begin_step(index, query_start, computed, rows)
        router.end_step()
        times.append((time.perf_counter() - started, time.thread_time() - cpu))
        computed += counts
    router.drain()
    return times


VIEW_OPS = {"alias", "detach", "expand", "lift_fresh", "permute", "reshape", "select", "slice", "unsqueeze", "view"}


def count_ops(workload: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """Per decode step, how many torch operations (views aside) each line of this package
    dispatches within ``begin_step`` and ``end_step``, most first."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts: collections.Counter[str] = collections.Counter()
    routing = {"on": False}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if routing["on"] and name not in VIEW_OPS:
                frames = [f for f in traceback.extract_stack()[:-1] if "inspect_tl_vllm" in f.filename]
                caller = f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}" if frames else "?"
                counts[f"{caller} {name}"] += 1
            return func(*args, **(kwargs or {}))

    def counted(method: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            routing["on"] = True
            try:
                return method(*a, **k)
            finally:
                routing["on"] = False

        return wrapper

    begin, end = StepRouter.begin_step, StepRouter.end_step
    StepRouter.begin_step, StepRouter.end_step = counted(begin), counted(end)  # type: ignore[method-assign]
    try:
        with Counter():
            run(workload, args, device)
    finally:
        StepRouter.begin_step, StepRouter.end_step = begin, end  # type: ignore[method-assign]
    steps = args.steps + 1  # and the prefill step
    return {key: round(n / steps, 2) for key, n in counts.most_common()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sites", type=int, default=34)
    parser.add_argument("--profile", action="store_true", help="print the top functions of one workload")
    parser.add_argument("--count-ops", action="store_true", help="print one workload's torch ops per step, by caller")
    parser.add_argument("--profile-workload", default="steer", choices=WORKLOADS)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": str(device), "requests": args.requests, "width": args.width, "sites": args.sites}
    for workload in WORKLOADS:
        times = run(workload, args, device)[10:]
        result[f"{workload}_ms_per_step"] = round(1e3 * statistics.median(wall for wall, _ in times), 3)
        result[f"{workload}_cpu_ms_per_step"] = round(1e3 * statistics.median(cpu for _, cpu in times), 3)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        run(args.profile_workload, args, device)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    if args.count_ops:
        ops = count_ops(args.profile_workload, args, device)
        print(f"{args.profile_workload}: {sum(ops.values()):.1f} torch ops per step")
        for caller, per_step in ops.items():
            print(f"  {per_step:6.2f}  {caller}")


if __name__ == "__main__":
    main()
