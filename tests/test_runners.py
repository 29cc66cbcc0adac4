"""The model-runner adapters (``engine/runners.py``) against vLLM's own V2 classes.

Model Runner V2 needs CUDA (Triton kernels, UVA), so the CPU build cannot run it; its classes
do import there.  These tests build real V2 ``InputBatch``es and ``NewRequestData`` and drive the
V2 adapter on a stand-in runner with V2's method names and call order: the layout it reports
must be the one the router derives from the host arrays, dummy runs must pass through
untouched, and resumed requests (V2 sends them again as new) must be counted.  The same
adapter runs for real in ``bench/gpu_check.py`` under ``VLLM_USE_V2_MODEL_RUNNER=1`` on the GPU
(docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inspect_tl_vllm.engine.runners import V1Runner, V2Runner, new_requests, runner_for
from inspect_tl_vllm.instrument.routing import _host_rows

MAX_TOKENS = 64


def v2_batch(req_ids: list[str], counts: list[int], computed: list[int], buffers) -> object:
    """A V2 ``InputBatch`` of requests with ``counts`` rows each, as ``prepare_inputs`` leaves it."""
    from vllm.v1.worker.gpu.input_batch import InputBatch

    rows = int(sum(counts))
    dummy = InputBatch.make_dummy(len(req_ids), rows, buffers)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    buffers.query_start_loc[: len(starts)] = torch.from_numpy(starts)
    batch, positions = _host_rows(starts.astype(np.int64), np.array(computed, dtype=np.int64))
    buffers.positions[:rows] = torch.from_numpy(positions)
    # vLLM >= 0.32 keeps the batch's computed-token counts in the batch itself; 0.20.2 in the runner's
    # per-slot mirror (set by the test)
    own = (
        {"num_computed_tokens_np": np.array(computed, dtype=np.int32)}
        if hasattr(dummy, "num_computed_tokens_np")
        else {}
    )
    return dataclasses.replace(
        dummy,
        **own,
        req_ids=req_ids,
        idx_mapping_np=np.arange(len(req_ids))[::-1].copy(),  # state slots in another order than the batch
        query_start_loc=buffers.query_start_loc[: len(starts)],
        query_start_loc_np=starts,
        positions=buffers.positions[:rows],
    )


class FakeV2Runner:
    """V2's names and call order: ``execute_model`` admits requests, then (unless it is a dummy
    run or schedules no tokens) calls ``prepare_inputs``, then runs the model."""

    def __init__(self, batches: list) -> None:
        from vllm.v1.worker.gpu.input_batch import InputBuffers

        self.max_num_tokens = MAX_TOKENS
        self.input_buffers = InputBuffers(8, MAX_TOKENS, torch.device("cpu"))
        self.req_states = SimpleNamespace(num_computed_tokens_np=np.zeros(8, dtype=np.int64))
        self.batches = batches
        self.calls: list[str] = []

    def prepare_inputs(self, scheduler_output, batch_desc):
        self.calls.append("prepare_inputs")
        return self.batches.pop(0)

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False):
        self.calls.append("execute_model")
        if not dummy_run and scheduler_output.total_num_scheduled_tokens:
            self.prepare_inputs(scheduler_output, None)
        self.calls.append("forward")


def new_request(req_id: str, prompt: list[int], extra_args: dict | None):
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData

    return NewRequestData(
        req_id=req_id, prompt_token_ids=prompt, mm_features=[], sampling_params=SamplingParams(extra_args=extra_args),
        pooling_params=None, block_ids=([],), num_computed_tokens=0, lora_request=None,
    )  # fmt: skip


def test_the_v2_layout_is_the_routers_host_layout_on_the_device() -> None:
    runner = FakeV2Runner([])
    adapter = runner_for(runner)
    assert isinstance(adapter, V2Runner)
    rng = np.random.default_rng(0)
    for _ in range(20):
        count = int(rng.integers(1, 7))
        counts = rng.integers(1, 9, size=count).tolist()
        computed = rng.integers(0, 100, size=count).tolist()
        req_ids = [f"r{i}" for i in rng.permutation(count)]
        batch = v2_batch(req_ids, counts, computed, runner.input_buffers)
        runner.req_states.num_computed_tokens_np[batch.idx_mapping_np] = computed  # the runner's mirror, by slot
        layout = adapter.layout(batch)
        expected_batch, expected_positions = _host_rows(np.asarray(batch.query_start_loc_np, np.int64), layout.computed)
        assert layout.computed.tolist() == computed
        assert layout.rows[0].tolist() == expected_batch.tolist()
        assert layout.rows[1].tolist() == expected_positions.tolist()
        assert dict(layout.index_of) == {req_id: index for index, req_id in enumerate(req_ids)}
        assert layout.query_start.tolist() == [0, *np.cumsum(counts).tolist()]


def test_the_v2_adapter_routes_real_steps_and_leaves_dummy_runs_alone() -> None:
    runner = FakeV2Runner([])
    runner.batches = [v2_batch(["a", "b"], [3, 1], [0, 7], runner.input_buffers)]
    events: list = []
    runner_for(runner).install(
        lambda so: events.append(("execute", so.total_num_scheduled_tokens)),
        lambda so, layout: events.append(("layout", list(layout.req_ids), layout.rows[0].tolist())),
        lambda: events.append(("after",)),
    )
    runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=0), None, dummy_run=True)
    assert events == [], "a dummy run (profile, graph capture) was routed"
    runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=4))
    assert events == [("execute", 4), ("layout", ["a", "b"], [0, 0, 0, 1]), ("after",)]
    events.clear()
    runner.execute_model(SimpleNamespace(total_num_scheduled_tokens=0))  # finishes requests, runs nothing
    assert events == [("execute", 0), ("after",)]


def test_new_requests_carry_their_extra_args_and_prompt_length_and_resumed_ones_are_counted() -> None:
    from vllm.v1.core.sched.output import CachedRequestData

    spec = {"tlvllm": {"uid": "u"}}
    scheduled = SimpleNamespace(
        scheduled_new_reqs=[new_request("a", [1, 2, 3], spec), new_request("b", [4], None)],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
    )
    found = new_requests(scheduled)
    assert [(n.req_id, n.extra_args, n.prompt_len) for n in found] == [("a", spec, 3), ("b", None, 1)]
    assert runner_for(FakeV2Runner([])).resumed(scheduled, {"a": object()}) == 1  # V2 re-sends "a" in full
    v1 = V1Runner(SimpleNamespace())
    assert v1.resumed(scheduled, {"a": object()}) == 0


def test_a_runner_that_is_neither_is_refused_by_name() -> None:
    class SomeRunner:
        pass

    with pytest.raises(RuntimeError, match="SomeRunner is neither of the vLLM model runners"):
        runner_for(SomeRunner())
