"""Pooled captures (mean, last, max_norm) and steering receipts: accumulated on the device by
the step router; pooled captures are finished on the host.

The engine tests compare every reduction with a reference through the real CPU engine.
These drive the real router on CPU buffers through what those runs cannot produce on CPU:
the newest row of a request that vLLM's asynchronous scheduling computes once more after the
request stopped (it must be left out), and two requests folded in the same steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import cpu_hook_runtime
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState, Scope, SteerItem, finish_pooled
from inspect_tl_vllm.instrument.routing import StepRouter
from random_traffic import Rows, random_walk

WIDTH = 8


def pooled_state(reduce: str, prompt_len: int) -> RequestState:
    state = RequestState(uid=reduce, prompt_len=prompt_len, steer=[], capture=[CaptureItem(hook="h", site=0)])
    state.capture_scope, state.reduce = Scope.resolve("all", prompt_len), reduce
    return state


def run_steps(reduce: str, steps: list[tuple[torch.Tensor, list[int], list[int], list[int]]]) -> list[RequestState]:
    """Per step: the staging rows the hook would have written, then the batch index of each
    request, the row offsets and the computed-token counts, as the worker passes them."""
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime)
    states = [pooled_state(reduce, 3), pooled_state(reduce, 2)]
    for state in states:
        router.admit(state)
    for staging, batch_index, query_start, computed in steps:
        router.begin_step(np.array(batch_index), np.array(query_start), np.array(computed))
        runtime.sites[0].staging[: len(staging)] = staging
        router.end_step()
    router.drain()
    router.snapshot(states)  # both at once: each must get its own slot's row
    return states


def reference(rows: torch.Tensor, reduce: str) -> np.ndarray:
    return {"mean": rows.mean(0), "last": rows[-1], "max_norm": rows[rows.norm(dim=1).argmax()]}[reduce].numpy()


@pytest.mark.parametrize("reduce", ["mean", "last", "max_norm"])
@pytest.mark.parametrize("spurious", [False, True])
def test_prefill_then_decode_two_requests(reduce: str, spurious: bool) -> None:
    """Request a: a 3-row prefill, then two decode rows; request b (prompt 2) alongside, in
    swapped batch order at the second step.  With ``spurious`` a's last row (position 4)
    was computed after a had stopped, so it is no input of the answer and must not count."""
    torch.manual_seed(0)
    ra = torch.randn(5, WIDTH) * torch.tensor([1.0, 5.0, 2.0, 0.5, 9.0])[:, None]
    rb = torch.randn(3, WIDTH)
    steps = [
        (torch.cat([ra[:3], rb[:2]]), [0, 1], [0, 3, 5], [0, 0]),  # prefill of both
        (torch.stack([rb[2], ra[3]]), [1, 0], [0, 1, 2], [2, 3]),  # decode, b first in the batch
        (ra[4:5], [0, -1], [0, 1], [4]),  # a alone; b not scheduled
    ]
    a, b = run_steps(reduce, steps)
    kept = ra[:4] if spurious else ra
    got = finish_pooled(a, 3 if spurious else 4)["h"]
    assert a.captured == len(kept)
    np.testing.assert_allclose(got, reference(kept, reduce), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(finish_pooled(b, 2)["h"], reference(rb, reduce), rtol=1e-5, atol=1e-6)
    assert b.captured == 3


@pytest.mark.parametrize("reduce", ["mean", "last", "max_norm"])
def test_decode_steps_that_repeat_the_last_ones_requests_fold_every_row(reduce: str) -> None:
    """Decode steps with the same requests in the same batch order reuse the last step's folds
    (``PooledCaptures.fold(repeat=True)``); every row must still count once, the newest kept
    apart.  b joins late (its prefill breaks the run), a leaves the batch for a step, and the
    last step, a repeat, computed a row past a's answer (spurious) but b's last is an input."""
    torch.manual_seed(1)
    ra = torch.randn(14, WIDTH) * torch.rand(14, 1) * 4
    rb = torch.randn(10, WIDTH) * torch.rand(10, 1) * 4
    steps = [(ra[:3], [0, -1], [0, 3], [0])]  # a's prefill; b not scheduled yet
    steps += [(ra[p : p + 1], [0, -1], [0, 1], [p]) for p in (3, 4, 5)]  # a alone: repeats from the third
    steps.append((torch.cat([ra[6:7], rb[:2]]), [0, 1], [0, 1, 3], [6, 0]))  # b's prefill beside a's row
    steps += [(torch.stack([ra[p], rb[p - 5]]), [0, 1], [0, 1, 2], [p, p - 5]) for p in (7, 8, 9, 10)]
    steps.append((rb[6:7], [-1, 0], [0, 1], [6]))  # a preempted for a step: the batch changes
    steps.append((torch.stack([rb[7], ra[11]]), [1, 0], [0, 1, 2], [7, 11]))  # back, in the other batch order
    steps += [(torch.stack([rb[p - 4], ra[p]]), [1, 0], [0, 1, 2], [p - 4, p]) for p in (12, 13)]  # repeats
    a, b = run_steps(reduce, steps)
    got_a, got_b = finish_pooled(a, 12)["h"], finish_pooled(b, 9)["h"]
    assert a.captured == 13 and b.captured == 10
    np.testing.assert_allclose(got_a, reference(ra[:13], reduce), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, reference(rb, reduce), rtol=1e-5, atol=1e-6)


def steered_state(uid: str, prompt_len: int) -> RequestState:
    stage_row = np.array([1.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=np.float32)  # add bank row 1, coef 2
    item = SteerItem(index=0, label="add", site=0, stage=0, stage_row=stage_row, scope=Scope.resolve("all", prompt_len))
    return RequestState(uid=uid, prompt_len=prompt_len, steer=[item], capture=[])


@pytest.mark.parametrize("hook_runs", [True, False])
def test_receipts_sum_on_the_device_and_prove_the_hook_ran(hook_runs: bool) -> None:
    """Receipts are summed on the device: rows per request, their norm changes (what the hook
    wrote to ``row_stats``), and ``fired`` only if the site's counter moved while the
    request was live.  Request a retires after two steps; b is read while still live."""
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime)
    a, b = steered_state("a", 3), steered_state("b", 2)
    for state in (a, b):
        router.admit(state)
    deltas = {"a": [], "b": []}
    steps = [([0, 1], [0, 3, 5], [0, 0]), ([0, 1], [0, 1, 2], [3, 2])]  # prefill of both, then one decode row each
    for batch_index, query_start, computed in steps:
        router.begin_step(np.array(batch_index), np.array(query_start), np.array(computed))
        written = torch.randn(query_start[-1])
        runtime.sites[0].row_stats[: len(written), 0] = written
        deltas["a"] += written[query_start[0] : query_start[1]].tolist()
        deltas["b"] += written[query_start[1] : query_start[2]].tolist()
        if hook_runs:
            runtime.sites[0].fired += 1
        router.end_step()
    router.retire(a)
    router.begin_step(np.array([0]), np.array([0, 1]), np.array([3]))  # b's third row; a's reads launch here
    runtime.sites[0].row_stats[0, 0] = 0.5
    deltas["b"].append(0.5)
    router.end_step()
    router.drain()
    router.snapshot([b])
    for state, rows in ((a, 4), (b, 4)):
        item = state.steer[0]
        assert item.rows == rows
        assert item.sums[0] == pytest.approx(sum(deltas[state.uid]), rel=1e-6)
        assert item.fired is hook_runs


def traffic_row(uid: str, position: int) -> torch.Tensor:
    """The row a request's token at ``position`` has, the same whenever it is computed again."""
    phase = torch.arange(WIDTH, dtype=torch.float32) * 0.37 + int(uid) * 1.3 + position * 0.71
    return torch.sin(phase) * (1 + (position * 7 + int(uid)) % 5)


@pytest.mark.parametrize("seed", [7, 8])
@pytest.mark.parametrize("mixed", [True, False])
def test_captures_under_random_traffic_hold_each_covered_row_once(mixed: bool, seed: int) -> None:
    """Seeded random traffic (``random_traffic.py``): requests capture site 0 pooled (mean,
    last, max_norm) or per token, over random scopes, beside steered and uninstrumented
    requests; they are preempted and recompute their rows, and decode in unchanged batches.
    Each capture must equal the reference over the positions its scope covers, each counted
    once.  ``mixed=False`` sends pooled captures over whole-prompt or answer scopes only, the
    traffic whose unchanged decode batches reuse the last step's folds (any per-token or
    listed capture in the batch routes every step afresh)."""
    rng = np.random.default_rng(seed)
    runtime = cpu_hook_runtime(WIDTH, max_tokens=64)
    router = StepRouter(runtime)

    def new_state(uid: int, prompt_len: int) -> RequestState | None:
        kind = rng.random()
        if kind < 0.15:
            return None
        if kind < 0.3:
            return steered_state(str(uid), prompt_len)
        state = RequestState(uid=str(uid), prompt_len=prompt_len, steer=[], capture=[CaptureItem(hook="h", site=0)])
        scopes = ["all", "prompt", "generated", [0, 2, -1], [1, 4, 9]] if mixed else ["all", "prompt", "generated"]
        state.capture_scope = Scope.resolve(scopes[int(rng.integers(len(scopes)))], prompt_len)
        state.reduce = str(rng.choice(["mean", "last", "max_norm", "none"] if mixed else ["mean", "last", "max_norm"]))
        return state

    def write_rows(rows: Rows) -> None:
        zero = torch.zeros(WIDTH)
        staged = [zero if state is None else traffic_row(state.uid, position) for state, position in rows]
        runtime.sites[0].staging[: len(rows)] = torch.stack(staged)

    finished = random_walk(router, rng, new_state, write_rows)
    checked = {"mean": 0, "last": 0, "max_norm": 0, **({"none": 0} if mixed else {})}
    for state, high in finished:
        if not state.capture:
            continue
        # Half the answers end a row early: asynchronous scheduling computed one row past the
        # end, which is no input of the answer and must not count.
        last = high - 1 if high >= state.prompt_len and rng.random() < 0.5 else high
        covered = [p for p in range(last + 1) if state.capture_scope.covers(p)]
        expected = torch.stack([traffic_row(state.uid, p) for p in covered]) if covered else None
        if state.reduce == "none":
            positions, rows = state.capture[0].per_token(last)
            assert positions == covered, state.uid
            if covered:
                torch.testing.assert_close(rows, expected)
        else:
            got = finish_pooled(state, last)
            assert state.captured == len(covered), (state.uid, state.reduce)
            if covered:
                np.testing.assert_allclose(
                    got["h"], reference(expected, state.reduce), rtol=1e-5, atol=1e-6, err_msg=state.reduce
                )
        checked[state.reduce] += bool(covered)
    assert min(checked.values()) >= 5, checked
