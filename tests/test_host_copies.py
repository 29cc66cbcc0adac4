"""Per-token captures travel to the host in fixed-size chunks (``host_copies.HOST_CHUNK_BYTES``).

The engine tests read per-token captures through the real CPU engine, where a step's rows
fit one chunk.  These drive the real router on CPU buffers with three-row chunks, so that
requests straddle chunk boundaries, in a contiguous copy and in a gathered one, and check
that every request gets exactly its own rows back, in position order.
"""

from __future__ import annotations

import numpy as np
import torch

from conftest import cpu_hook_runtime
from inspect_tl_vllm.instrument.host_copies import pieces as _pieces
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState, Scope
from inspect_tl_vllm.instrument.routing import StepRouter

WIDTH = 4


def per_token_state(uid: str, prompt_len: int, capture: bool = True) -> RequestState:
    state = RequestState(
        uid=uid, prompt_len=prompt_len, steer=[], capture=[CaptureItem(hook="h", site=0)] if capture else []
    )
    state.capture_scope = Scope.resolve("all", prompt_len) if capture else None
    return state


def test_pieces_split_at_chunk_boundaries() -> None:
    pieces = _pieces(np.array([1, 2, 3, 4, 7]), 3)
    assert [(chunk, part) for chunk, _, part in pieces] == [(0, slice(0, 2)), (1, slice(2, 4)), (2, slice(4, 5))]
    assert [index for _, index, _ in pieces[:2]] == [slice(1, 3), slice(0, 2)]
    gathered = _pieces(np.array([0, 2]), 3)[0][1]
    assert isinstance(gathered, torch.Tensor) and gathered.tolist() == [0, 2]


def test_rows_straddling_chunks_come_back_whole() -> None:
    """Step 1: prefill of a (5 rows) and b (4 rows): nine contiguous rows, three chunks,
    a and b each over two.  Step 2: a's and b's prefill continue around c's long prefill
    (not captured), so the router gathers rows 0, 1, 12 and 13: b straddles two chunks
    again.  Step 3: one decode row each."""
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime, chunk_rows=3)
    a, b, c = per_token_state("a", 7), per_token_state("b", 6), per_token_state("c", 10, capture=False)
    for state in (a, b, c):
        router.admit(state)
    torch.manual_seed(0)
    expected: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    steps = [
        ([0, 1, -1], [0, 5, 9], [0, 0]),  # batch index per state (c absent), row offsets, computed tokens
        ([0, 2, 1], [0, 2, 12, 14], [5, 0, 4]),  # batch order a, b, c: b's rows are 12 and 13
        ([1, 0, -1], [0, 1, 2], [6, 7]),  # decode: b first in the batch
    ]
    for batch_index, query_start, computed in steps:
        router.begin_step(np.array(batch_index), np.array(query_start), np.array(computed))
        rows = torch.randn(query_start[-1], WIDTH)
        runtime.sites[0].staging[: len(rows)] = rows
        for state, k in ((a, 0), (b, 1)):
            at = batch_index[k]
            expected[state.uid].append(rows[query_start[at] : query_start[at + 1]])
        router.end_step()
    router.drain()
    assert len(a.capture[0].blocks) > len(steps)  # some steps' rows came in two pieces
    for state in (a, b):
        positions, rows = state.capture[0].per_token(max_pos=state.prompt_len)
        want = torch.cat(expected[state.uid])
        assert positions == list(range(len(want)))
        torch.testing.assert_close(rows, want, rtol=0, atol=0)


def test_non_finite_rows_fail_their_request_only() -> None:
    """A NaN in one request's rows and an inf in another's fail those two requests, each naming
    the hook and the position; the request between them in the same step keeps its rows."""
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime, chunk_rows=3)
    a, b, c = per_token_state("a", 4), per_token_state("b", 4), per_token_state("c", 4)
    for state in (a, b, c):
        router.admit(state)
    router.begin_step(np.array([0, 1, 2]), np.array([0, 4, 8, 12]), np.array([0, 0, 0]))
    rows = torch.randn(12, WIDTH)
    rows[2, 1] = float("nan")  # a's position 2
    rows[11, 0] = -float("inf")  # c's position 3
    runtime.sites[0].staging[:12] = rows
    router.end_step()
    router.drain()
    assert a.error == "the activations captured at h are not finite (NaN or inf) at position 2"
    assert c.error == "the activations captured at h are not finite (NaN or inf) at position 3"
    assert b.error is None
    positions, kept = b.capture[0].per_token(max_pos=b.prompt_len)
    assert positions == [0, 1, 2, 3]
    torch.testing.assert_close(kept, rows[4:8], rtol=0, atol=0)


def test_a_non_finite_row_of_a_later_site_is_found_at_its_own_offset() -> None:
    """Two hook points: each site's row maxima sit at their own offset in the step's one array, so a
    NaN in the second site's rows fails the request that owns it, naming that hook and position, and
    the first site's finite rows at the same offsets fail nothing."""
    runtime = cpu_hook_runtime(WIDTH, sites=(0, 1))
    router = StepRouter(runtime, chunk_rows=3)
    states = []
    for uid in ("a", "b"):
        state = RequestState(
            uid=uid, prompt_len=4, steer=[], capture=[CaptureItem(hook="h0", site=0), CaptureItem(hook="h1", site=1)]
        )
        state.capture_scope = Scope.resolve("all", 4)
        router.admit(state)
        states.append(state)
    a, b = states
    router.begin_step(np.array([0, 1]), np.array([0, 4, 8]), np.array([0, 0]))
    runtime.sites[0].staging[:8] = torch.randn(8, WIDTH)
    second = torch.randn(8, WIDTH)
    second[5, 2] = float("nan")  # b's position 1, at the second site only
    runtime.sites[1].staging[:8] = second
    router.end_step()
    router.drain()
    assert a.error is None
    assert b.error == "the activations captured at h1 are not finite (NaN or inf) at position 1"
    positions, kept = a.capture[1].per_token(max_pos=4)
    assert positions == [0, 1, 2, 3]
    torch.testing.assert_close(kept, second[:4], rtol=0, atol=0)
