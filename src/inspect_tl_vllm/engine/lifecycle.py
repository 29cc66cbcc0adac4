"""The life of instrumented requests around vLLM's own generation, written once for both fronts.

Before generation the workers' vector bank must hold the requests' vectors (``upload``); after
it the results are fetched from the workers and the vectors let go (``fetch``), then decoded
and checked (``decode``); a request
aborted or cancelled on the way has its worker-side results taken back (``release_aborted``).  Each
step needs worker calls (``collective_rpc``), which are synchronous on ``vllm.LLM`` (the Python
API, ``offline.py``) and awaited on ``AsyncLLM`` (the Inspect provider).  So each step is a generator
that yields the calls it needs and receives their answers (``RpcCall``), and ``drive`` and
``drive_async`` run it on either engine: the bookkeeping exists in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from inspect_tl_vllm.engine.frontend import (
    CaptureResult,
    Instrumentation,
    PreparedRequest,
    max_input_position,
    merge_fetched,
)
from inspect_tl_vllm.wire import FetchedResult

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RpcCall:
    """One ``collective_rpc`` to every worker."""

    method: str
    args: tuple[Any, ...]


Steps = Generator[RpcCall, Any, T]


def upload(front: Instrumentation, requests: list[PreparedRequest | None]) -> Steps[None]:
    """Give the workers' bank the vectors ``requests`` need; they hold them until ``fetch`` or
    ``release_aborted``."""
    pending = front.pending_upload(requests)
    if pending is not None:
        yield RpcCall("tlvllm_put_vectors", pending.args)
    front.hold(requests, pending)


Finished = tuple[PreparedRequest, int, int]
"""A request that ran to its end, with its prompt length and the number of tokens generated."""


def fetch(front: Instrumentation, finished: list[Finished]) -> Steps[list[FetchedResult | None]]:
    """What the workers hold for finished requests; the vectors are let go whatever happens.
    ``decode`` turns each answer into a result (the provider does that off the engine's loop)."""
    wanted = [[request.uid, max_input_position(prompt, generated)] for request, prompt, generated in finished]
    try:
        answers = yield RpcCall("tlvllm_fetch", front.fetch_args(wanted))
    finally:
        front.release([request for request, _, _ in finished])
    return merge_fetched(answers)


def decode(front: Instrumentation, payload: FetchedResult | None, where: str, *, strict: bool = True) -> CaptureResult:
    """One request's result; with ``strict`` it is checked (``CaptureResult.check``), so that an
    unsteered answer is never reported as steered."""
    result = front.decode(payload, where)
    if strict:
        result.check(where)
    return result


def release_aborted(front: Instrumentation, requests: list[PreparedRequest]) -> Steps[None]:
    """Take back what the workers hold for requests that did not finish: their receipts,
    captured rows and early-written files would otherwise stay until the engine stops.  A
    failure is logged, not raised, so that it does not hide the error that caused the abort
    (the engine may be what failed)."""
    if not requests:
        return
    front.release(requests)
    try:
        answers = yield RpcCall("tlvllm_release", front.release_args(requests))
    except Exception as err:
        logger.warning(f"tl-vllm: could not release the aborted requests' results in the workers: {err}")
        return
    front.drop_released(answers)


def drive(steps: Steps[T], llm: Any) -> T:
    """Drive ``steps`` on a synchronous ``vllm.LLM``."""
    try:
        call = next(steps)
        while True:
            try:
                answer = llm.collective_rpc(call.method, args=call.args)
            except BaseException as err:  # the step's clean-up runs (an interrupt included)
                call = steps.throw(err)
            else:
                call = steps.send(answer)
    except StopIteration as done:
        return done.value


async def drive_async(steps: Steps[T], llm: Any) -> T:
    """Drive ``steps`` on an ``AsyncLLM``."""
    try:
        call = next(steps)
        while True:
            try:
                answer = await llm.collective_rpc(call.method, args=call.args)
            except BaseException as err:  # the step's clean-up runs (a cancellation included)
                call = steps.throw(err)
            else:
                call = steps.send(answer)
    except StopIteration as done:
        return done.value
