"""Seeded random traffic for the step router, as vLLM's scheduler would send it.

Requests (instrumented or not) arrive, prefill in chunks, decode, often for several steps in
an unchanged batch (the router's repeated-step path), are preempted and recompute every row
they had, and leave, their request slots reused.  Between steps, now and then, vLLM ends a step
it never routed (one that schedules no tokens) and live requests' results are read.  The tests
in ``test_steering_routes.py`` and ``test_pooling.py`` check, step by step and at the end, what
the router made of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from inspect_tl_vllm.instrument.request_state import RequestState
from inspect_tl_vllm.instrument.routing import StepRouter

Batch = list[tuple[RequestState | None, int, int]]
"""Per scheduled request: its state (None: not instrumented), computed tokens, rows this step."""
Rows = list[tuple[RequestState | None, int]]
"""Per token row of a step: its request and position."""


def drive(router: StepRouter, batch: Batch, during: Callable[[Rows], None]) -> None:
    """One step as the worker routes it; ``during`` plays the model (reads tables, writes rows)."""
    index_of = {id(state): b for b, (state, _, _) in enumerate(batch) if state is not None}
    batch_index = np.array([index_of.get(id(s), -1) for s in router.states], dtype=np.int64)
    query_start = np.concatenate([[0], np.cumsum([n for _, _, n in batch])]).astype(np.int64)
    computed = np.array([c for _, c, _ in batch], dtype=np.int64)
    router.begin_step(batch_index, query_start, computed)
    during([(state, c + i) for state, c, n in batch for i in range(n)])
    router.end_step()


@dataclass
class _Request:
    state: RequestState | None
    prompt_len: int
    answer: int
    computed: int = 0
    high: int = -1  # the highest position computed so far


def random_walk(
    router: StepRouter,
    rng: np.random.Generator,
    new_state: Callable[[int, int], RequestState | None],
    during: Callable[[Rows], None],
    *,
    steps: int = 300,
    max_rows: int = 64,
) -> list[tuple[RequestState, int]]:
    """Run ``steps`` steps of random traffic; ``new_state(uid, prompt_len)`` makes each arrival's
    state (None: not instrumented).  Returns every instrumented request with the highest
    position it computed, its numbers read as the worker's fetch reads them."""
    live: list[_Request] = []
    order: list[_Request] = []
    done: list[tuple[RequestState, int]] = []
    uid = 0
    for _ in range(steps):
        decoding = all(r.computed >= r.prompt_len for r in order)
        if not (order and decoding and rng.random() < 0.5):  # else: the same batch decodes again
            while len(live) < 8 and rng.random() < 0.6:
                uid += 1
                prompt_len = int(rng.integers(1, 12))
                state = new_state(uid, prompt_len)
                if state is not None:
                    router.admit(state)
                live.append(_Request(state, prompt_len, answer=int(rng.integers(1, 9))))
            for request in live:
                if request.computed > 0 and rng.random() < 0.05:
                    request.computed = 0  # preempted: its prompt and answer so far are computed again
            order = [live[k] for k in rng.permutation(len(live)) if rng.random() < 0.85]
        batch: Batch = []
        scheduled: list[_Request] = []
        for request in order:
            if request.computed <= request.high:  # recomputing after preemption
                want = int(rng.integers(1, request.high + 2 - request.computed))
            elif request.computed < request.prompt_len:  # a chunk of the prompt
                want = int(rng.integers(1, request.prompt_len - request.computed + 1))
            else:
                want = 1
            room = max_rows - sum(n for _, _, n in batch)
            want = min(want, room, request.prompt_len + request.answer - request.computed)
            if want > 0:
                batch.append((request.state, request.computed, want))
                scheduled.append(request)
        if not batch:
            order = []
            continue
        drive(router, batch, during)
        for request, (_, _, count) in zip(scheduled, batch, strict=True):
            request.computed += count
            request.high = max(request.high, request.computed - 1)
        for request in [r for r in live if r.computed >= r.prompt_len + r.answer]:
            live.remove(request)
            if request in order:
                order.remove(request)
            if request.state is not None:
                router.retire(request.state)
                done.append((request.state, request.high))
        if rng.random() < 0.05:  # a step that only reports finished requests: vLLM ends it unrouted
            router.end_step()
        if rng.random() < 0.05:  # results of live requests read between steps (a fetch mid-run)
            router.drain()
            router.snapshot([r.state for r in live if r.state is not None])
    # As the worker's fetch reads results: what is in flight lands, then every request is read
    # (those retired at the last steps are read from their slots, not yet handed on).
    router.drain()
    done += [(r.state, r.high) for r in live if r.state is not None]
    router.snapshot([state for state, _ in done])
    return done
