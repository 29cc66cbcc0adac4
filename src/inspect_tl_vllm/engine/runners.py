"""The two model runners of vLLM's V1 engine, behind one interface.

vLLM has two GPU model runners: the first (``vllm/v1/worker/gpu_model_runner.py``, the CPU
runner subclasses it) and Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``: opt-in with
``VLLM_USE_V2_MODEL_RUNNER=1`` up to 0.31, the default on CUDA from 0.32, the only one in 0.34).
The worker (``worker.py``) needs the same three things from either, each step:

- before the step: the requests vLLM finished (to let them go) and the new ones (to plan them);
- once the batch's layout is final and before the forward: each request's place in the batch,
  the row offsets and computed-token counts on the host, and each token row's batch index and
  position on the device;
- after the step: a call to harvest.

``runner_for`` picks the adapter by what the runner has; ``install`` wraps the runner's methods.
Requests are read from the scheduler's ``NewRequestData`` for both runners (V2 keeps no
``SamplingParams`` after admitting a request).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class StepLayout:
    """A step's batch as the router needs it, in vLLM's batch order."""

    req_ids: Sequence[str]  # batch index -> vLLM request id
    index_of: Mapping[str, int]  # vLLM request id -> batch index
    query_start: np.ndarray  # [requests + 1] row offsets, on the host
    computed: np.ndarray  # per batch index: tokens computed before this step
    rows: tuple[torch.Tensor, torch.Tensor]  # per token row, on the device: batch index, position


@dataclass
class NewRequest:
    req_id: str
    extra_args: dict[str, Any] | None
    prompt_len: int


def new_requests(scheduler_output: Any) -> list[NewRequest]:
    """The requests this step schedules for the first time (under V2 also resumed ones, which
    the scheduler sends again in full)."""
    found = []
    for new in scheduler_output.scheduled_new_reqs:
        params = new.sampling_params
        found.append(NewRequest(new.req_id, params.extra_args if params is not None else None, _prompt_len(new)))
    return found


def _prompt_len(new: Any) -> int:
    length = getattr(new, "prompt_len", None)  # vLLM >= 0.34
    if isinstance(length, int):
        return length
    if new.prompt_token_ids is not None:
        return len(new.prompt_token_ids)
    return int(new.prompt_embeds.shape[0])


OnExecute = Callable[[Any], None]
OnLayout = Callable[[Any, StepLayout], None]
OnAfter = Callable[[], None]


class V1Runner:
    """vLLM's first GPU model runner (and the CPU runner built on it): the layout is final in
    ``_preprocess``, where vLLM has computed each row's batch index (``req_indices``) and position."""

    name = "V1"

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def resumed(self, scheduler_output: Any, live: Mapping[str, Any]) -> int:
        return len(live.keys() & scheduler_output.scheduled_cached_reqs.resumed_req_ids)

    def layout(self, scheduler_output: Any) -> StepLayout:
        runner, batch = self.runner, self.runner.input_batch
        rows = scheduler_output.total_num_scheduled_tokens
        return StepLayout(
            batch.req_ids,
            batch.req_id_to_index,
            runner.query_start_loc.np[: batch.num_reqs + 1],
            batch.num_computed_tokens_cpu,
            (runner.req_indices.gpu[:rows], runner.positions[:rows]),
        )

    def install(self, on_execute: OnExecute, on_layout: OnLayout, on_after: OnAfter) -> None:
        runner = self.runner
        preprocess, execute = runner._preprocess, runner.execute_model

        def _preprocess(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            on_layout(scheduler_output, self.layout(scheduler_output))
            return preprocess(scheduler_output, *args, **kwargs)

        runner._preprocess = _preprocess
        runner.execute_model = routed_execute(execute, on_execute, on_after)


class V2Runner:
    """Model Runner V2: the layout is final when ``prepare_inputs`` returns the step's
    ``InputBatch``.  Its positions are a persistent device buffer; each row's batch index is
    found on the device from the batch's row offsets (no host copy, no sync).  Dummy runs
    (memory profile, graph capture) pass through ``execute_model`` untouched."""

    name = "V2"

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        device = runner.input_buffers.positions.device
        self._row_numbers = torch.arange(int(runner.max_num_tokens), dtype=torch.int32, device=device)
        self._index_of: tuple[list[str], dict[str, int]] | None = None

    def resumed(self, scheduler_output: Any, live: Mapping[str, Any]) -> int:
        """A resumed request comes back as a new one (its captures so far are kept)."""
        return sum(new.req_id in live for new in scheduler_output.scheduled_new_reqs)

    def layout(self, batch: Any) -> StepLayout:
        count, rows = batch.num_reqs, batch.num_tokens
        computed = getattr(batch, "num_computed_tokens_np", None)  # vLLM >= 0.34 has it in batch order
        if computed is None:
            computed = self.runner.req_states.num_computed_tokens_np[batch.idx_mapping_np]
        row_offsets = batch.query_start_loc[1 : count + 1].to(torch.int32)
        batch_of_row = torch.searchsorted(row_offsets, self._row_numbers[:rows], right=True)
        return StepLayout(
            batch.req_ids,
            self._batch_index(batch.req_ids),
            batch.query_start_loc_np[: count + 1],
            computed,
            (batch_of_row, batch.positions[:rows]),
        )

    def _batch_index(self, req_ids: list[str]) -> dict[str, int]:
        """Request id -> batch index (V2's ``req_id_to_index`` maps to state slots instead),
        made again only when the batch's order changed."""
        if self._index_of is None or self._index_of[0] != req_ids:
            self._index_of = (list(req_ids), {req_id: index for index, req_id in enumerate(req_ids)})
        return self._index_of[1]

    def install(self, on_execute: OnExecute, on_layout: OnLayout, on_after: OnAfter) -> None:
        runner = self.runner
        prepare, execute = runner.prepare_inputs, runner.execute_model

        def prepare_inputs(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            batch = prepare(scheduler_output, *args, **kwargs)
            on_layout(scheduler_output, self.layout(batch))
            return batch

        runner.prepare_inputs = prepare_inputs
        runner.execute_model = routed_execute(execute, on_execute, on_after)


def routed_execute(execute: Callable[..., Any], on_execute: OnExecute, on_after: OnAfter) -> Callable[..., Any]:
    """``execute_model`` that calls ``on_execute`` with the step's scheduler output before it and
    ``on_after`` after it.  V2's dummy runs (memory profile, graph capture, warm-up padding) carry
    no requests and pass through untouched; V1 runs none through ``execute_model``."""

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("dummy_run"):
            return execute(*args, **kwargs)
        on_execute(args[0] if args else kwargs["scheduler_output"])
        try:
            return execute(*args, **kwargs)
        finally:
            on_after()

    return execute_model


def runner_for(runner: Any) -> V1Runner | V2Runner:
    """The adapter for ``runner``, or a RuntimeError naming it when it is neither vLLM runner."""
    if hasattr(runner, "prepare_inputs") and hasattr(runner, "req_states"):
        return V2Runner(runner)
    if hasattr(runner, "_preprocess") and hasattr(runner, "input_batch"):
        return V1Runner(runner)
    raise RuntimeError(
        f"tl-vllm: {type(runner).__module__}.{type(runner).__name__} is neither of the vLLM model runners "
        "tl-vllm instruments (V1's GPUModelRunner with _preprocess, or Model Runner V2 with prepare_inputs)"
    )
