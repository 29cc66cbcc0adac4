"""Steering tables expanded on the device (``steering_routes.py``), against the scope rules.

The engine tests prove steering through the real CPU engine; these drive the real router on
CPU buffers through what is hard to arrange there: many requests with every kind of scope,
stacked stages and two sites, in batches that change order, chunked prefills, a request
recomputing its rows after preemption, slots handed from a steered request to an unsteered
one, and a site whose last steering request left.  After every step each site's table must
hold, row by row, exactly the stages whose scope covers that row's position, and the receipts
must count each steered position once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cpu_hook_runtime
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState, Scope, SteerItem
from inspect_tl_vllm.instrument.routing import StepRouter
from inspect_tl_vllm.instrument.runtime import IDENTITY_STAGE, HookRuntime
from random_traffic import Batch, Rows, drive, random_walk

SITES = (3, 7)
STACK = 2
SCOPES = ["all", "prompt", "generated", [0, 2, 5, -1], [1, 7, 8, 40]]


def runtime() -> HookRuntime:
    return cpu_hook_runtime(4, sites=SITES, max_stack=STACK, max_tokens=64)


def steered(uid: int, rng: np.random.Generator, prompt_len: int) -> RequestState:
    """A request with one to three interventions at random sites, stages and scopes."""
    items, used = [], set()
    for index in range(int(rng.integers(1, 4))):
        site = int(rng.choice(SITES))
        stage = next((k for k in range(STACK) if (site, k) not in used), None)
        if stage is None:
            continue
        used.add((site, stage))
        row = np.array([uid, 1.0 + index, float(uid), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)
        scope = Scope.resolve(SCOPES[int(rng.integers(len(SCOPES)))], prompt_len)
        items.append(SteerItem(index, "add", site, stage, row, scope))
    return RequestState(uid=str(uid), prompt_len=prompt_len, steer=items, capture=[])


def expected_table(run: HookRuntime, site: int, rows: Rows) -> torch.Tensor:
    table = torch.tensor(IDENTITY_STAGE).repeat(len(rows), STACK, 1)
    for r, (state, position) in enumerate(rows):
        for item in state.steer if state is not None else []:
            if item.site == site and item.scope.covers(position):
                table[r, item.stage] = torch.from_numpy(item.stage_row)
    return table


def check_tables(run: HookRuntime, rows: Rows) -> None:
    """Every site's table must equal the expected one; then the 'hook' writes ``row_stats``:
    row r's norm change is 1 + r, so receipts can be checked."""
    for site in SITES:
        got = run.sites[site].table[: len(rows)]
        assert torch.equal(got, expected_table(run, site, rows)), site
        run.sites[site].row_stats[: len(rows), 0] = torch.arange(1, len(rows) + 1, dtype=torch.float32)


def step(router: StepRouter, run: HookRuntime, batch: Batch) -> None:
    """One step, checked: per batch entry the request (None: not instrumented), its computed
    tokens and its rows this step."""
    drive(router, batch, lambda rows: check_tables(run, rows))


def test_tables_follow_scopes_through_changing_batches_and_receipts_count_each_position_once() -> None:
    rng = np.random.default_rng(0)
    run = runtime()
    router = StepRouter(run)
    plain = RequestState(uid="plain", prompt_len=3, steer=[], capture=[])  # instrumented, steers nothing
    states = [steered(uid, rng, prompt_len=int(rng.integers(2, 7))) for uid in range(1, 7)]
    for state in [*states, plain]:
        router.admit(state)
    # Chunked prefills of the first three in one step, beside an uninstrumented request (None).
    a, b, c, d, e, f = states
    step(router, run, [(a, 0, a.prompt_len), (None, 0, 3), (b, 0, 2), (c, 0, c.prompt_len)])
    step(router, run, [(c, c.prompt_len, 1), (b, 2, b.prompt_len - 2), (a, a.prompt_len, 1), (plain, 0, 3)])
    # b's first decode row; d and e join with prefills; the batch order changes.
    step(router, run, [(d, 0, d.prompt_len), (b, b.prompt_len, 1), (e, 0, e.prompt_len), (a, a.prompt_len + 1, 1)])
    # a is preempted and recomputes its prompt and first answer rows: steered again, counted once.
    step(router, run, [(a, 0, a.prompt_len + 2), (d, d.prompt_len, 1), (f, 0, f.prompt_len), (plain, 3, 1)])
    for k in range(3):
        step(router, run, [(s, s.prompt_len + 1 + k, 1) for s in (e, b, f, d, c)])
    router.drain()
    router.snapshot(states)
    for state, last in [(a, a.prompt_len + 1), (b, b.prompt_len + 3), (c, c.prompt_len + 3), (d, d.prompt_len + 3)]:
        for item in state.steer:
            covered = [p for p in range(last + 1) if item.scope.covers(p)]
            assert item.rows == len(covered), (state.uid, item.scope)
    assert router.max_requests_steered_in_one_step == 5


def test_a_slot_left_by_a_steered_request_steers_nothing_for_the_next() -> None:
    """The next request in a freed slot, steered elsewhere or not at all, must not inherit stages."""
    run = runtime()
    router = StepRouter(run)
    row = np.array([1, 1.0, 2.0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    first = RequestState(
        uid="first", prompt_len=3, steer=[SteerItem(0, "add", 3, 1, row, Scope.resolve("all", 3))], capture=[]
    )
    router.admit(first)
    step(router, run, [(first, 0, 3)])
    router.retire(first)
    router.begin_step(np.zeros(0, dtype=np.int64), np.array([0, 2]), np.array([0]))  # first's slot is freed
    router.end_step()
    router.drain()
    capture_only = RequestState(uid="c", prompt_len=3, steer=[], capture=[CaptureItem(hook="h", site=3)])
    capture_only.capture_scope = Scope.resolve("all", 3)
    other = RequestState(
        uid="o", prompt_len=2, steer=[SteerItem(0, "add", 3, 0, row, Scope.resolve("all", 2))], capture=[]
    )
    router.admit(capture_only)
    router.admit(other)
    assert first.slot == -1 and capture_only.slot == 0  # first's slot
    step(router, run, [(capture_only, 0, 3), (other, 0, 2)])
    step(router, run, [(other, 2, 1), (capture_only, 3, 1)])
    # other leaves too: site 3 has no steering request left, and its table must be identity again.
    router.retire(other)
    step(router, run, [(capture_only, 4, 1)])


def test_a_batch_that_keeps_its_requests_from_prefill_to_decode_gets_new_rows() -> None:
    """The same requests in the same order over a chunked prefill, its last chunk and the first
    decode steps: only a step of generated rows after another may keep the last step's tables."""
    run = runtime()
    router = StepRouter(run)
    row = np.array([1, 1.0, 2.0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    answer = RequestState(
        uid="g", prompt_len=5, steer=[SteerItem(0, "add", 3, 0, row, Scope.resolve("generated", 5))], capture=[]
    )
    prompt = RequestState(
        uid="p", prompt_len=5, steer=[SteerItem(0, "add", 7, 1, row, Scope.resolve("prompt", 5))], capture=[]
    )
    for state in (answer, prompt):
        router.admit(state)
    step(router, run, [(answer, 0, 1), (prompt, 0, 1)])
    step(router, run, [(answer, 1, 3), (prompt, 1, 3)])
    # Prefill chunks of one row look like decode rows, up to the prompt's last position and past it.
    for position in range(4, 8):
        step(router, run, [(answer, position, 1), (prompt, position, 1)])
    router.drain()
    router.snapshot([answer, prompt])
    assert answer.steer[0].rows == 3 and prompt.steer[0].rows == 5


def test_answer_rows_recomputed_one_a_step_in_an_unchanged_batch_count_once() -> None:
    """After preemption a request may recompute its answer rows one a step beside decoding
    requests: the batch repeats itself, but those rows were counted before and must not be again."""
    run = runtime()
    router = StepRouter(run)
    row = np.array([1, 1.0, 2.0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    a, b = (
        RequestState(uid=uid, prompt_len=2, steer=[SteerItem(0, "add", 3, 0, row, Scope.resolve("all", 2))], capture=[])
        for uid in "ab"
    )
    for state in (a, b):
        router.admit(state)
    step(router, run, [(a, 0, 2), (b, 0, 2)])
    for position in range(2, 6):  # both decode: positions 2..5
        step(router, run, [(a, position, 1), (b, position, 1)])
    step(router, run, [(a, 0, 2), (b, 6, 1)])  # a preempted: its prompt again
    for position in range(2, 8):  # a recomputes 2..5 one a step (counted already), then 6 and 7 are new
        step(router, run, [(a, position, 1), (b, position + 5, 1)])
    router.drain()
    router.snapshot([a, b])
    assert a.steer[0].rows == 8 and b.steer[0].rows == 13


@pytest.mark.parametrize("seed", [24, 25, 26])
def test_a_random_walk_of_arrivals_chunked_prefills_preemptions_and_departures_keeps_every_table_exact(
    seed: int,
) -> None:
    """Hundreds of steps of seeded random traffic (``random_traffic.py``): requests steered at
    random sites, stages and scopes, instrumented without steering, and not instrumented.
    Every step each site's table must hold exactly the stages whose scope covers each row; at
    the end each intervention's receipt must count each position it covered once, however
    often it was computed."""
    rng = np.random.default_rng(seed)
    run = runtime()
    router = StepRouter(run)

    def new_state(uid: int, prompt_len: int) -> RequestState | None:
        kind = rng.random()
        if kind < 0.6:
            return steered(uid, rng, prompt_len)
        return RequestState(uid=str(uid), prompt_len=prompt_len, steer=[], capture=[]) if kind < 0.8 else None

    finished = random_walk(router, rng, new_state, lambda rows: check_tables(run, rows))
    assert sum(1 for state, _ in finished if state.steer) > 40
    for state, high in finished:
        for item in state.steer:
            assert item.rows == sum(item.scope.covers(p) for p in range(high + 1)), (state.uid, item.scope)
