"""The messages between the front end and the workers (``wire.py``): they survive the trip as
plain builtins, malformed ones are refused by field, and pipeline stages' parts merge."""

from __future__ import annotations

import msgspec
import pytest
import torch
from safetensors.torch import load, save

from inspect_tl_vllm.engine.frontend import merge_fetched, merge_status
from inspect_tl_vllm.wire import (
    CaptureWire,
    FetchedResult,
    InterventionReceipt,
    Receipt,
    RequestWire,
    SteerWire,
    WorkerStatus,
)


def request() -> RequestWire:
    steer = SteerWire(label="a", site=3, stage=0, op="add", coef=2.0, vector="abc", positions=[0, -1])
    capture = CaptureWire(
        hooks=[("blocks.1.hook_resid_post", 3)],
        positions="all",
        reduce="none",
        dtype="float32",
        max_bytes=10,
        handoff=None,
    )
    return RequestWire(uid="u", steer=[steer], capture=capture)


def test_a_request_survives_msgpack_as_vllm_carries_it():
    sent = request()
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(sent.encode()))  # what the worker finds in extra_args
    assert isinstance(raw, dict) and RequestWire.decode(raw) == sent


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda raw: raw["steer"][0].update(site="3"), "steer[0].site"),
        (lambda raw: raw["steer"][0].update(coef="big"), "steer[0].coef"),
        (lambda raw: raw["capture"].update(hooks=[["h"]]), "capture.hooks[0]"),
        (lambda raw: raw.update(extra=1), "extra"),
        (lambda raw: raw.pop("uid"), "uid"),
    ],
)
def test_a_malformed_request_is_refused_naming_the_field(change, field):
    raw = request().encode()
    change(raw)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        RequestWire.decode(raw)


def part(index: int, hook: str, error: str | None = None) -> dict:
    receipt = Receipt(
        interventions=[InterventionReceipt(index=index, label=f"i{index}", rows=4, mean_norm_change=0.5, fired=True)],
        captures={hook: 4},
        error=error,
    )
    tensors = save({hook: torch.full((1, 2), float(index))})
    return FetchedResult(uid="u", receipt=receipt, positions={hook: [index]}, tensors=tensors, files=[]).encode()


def test_pipeline_stages_parts_merge_into_one_result():
    # stage 2 answers first for its later intervention; a missing part makes the result None
    per_worker = [[part(1, "late"), part(0, "early")], [part(0, "early", error="boom"), None]]
    merged, missing = merge_fetched(per_worker)
    assert missing is None
    assert [item.index for item in merged.receipt.interventions] == [0, 1]
    assert merged.receipt.captures == {"late": 4, "early": 4} and merged.receipt.error == "boom"
    assert merged.positions == {"late": [1], "early": [0]}
    assert {name: float(t[0, 0]) for name, t in load(merged.tensors).items()} == {"late": 1.0, "early": 0.0}


def test_tensor_parallel_ranks_that_record_nothing_are_skipped():
    assert merge_fetched([None, [part(0, "h")]])[0].receipt.captures == {"h": 4}
    with pytest.raises(RuntimeError, match="no worker records captures"):
        merge_fetched([None, None])


def status(collects: bool, sites: list[str], steps: int) -> dict:
    return WorkerStatus(
        runner="V1",
        sites=sites,
        fired=[steps] * len(sites),
        buffer_bytes=100,
        vectors=2,
        max_requests_steered_in_one_step=1,
        pending_results=1,
        live_requests=0,
        collects=collects,
        steps=steps,
        step_kinds={"new_batch": 1, "same_batch": 0, "repeated": steps - 1},
        resumed_after_preemption=0,
        written_early=0,
        host_seconds={"route": 0.5},
        pinned_host={"blocks_made": 0.0},
        sae_held={"encoders": 1, "groups": 0, "pools": 0, "arenas": 0},
        attention={"3": [0.125, 0.0, 0.0]} if collects else {"4": [0.125, 4096.0, 50.0]},
    ).encode()


def test_worker_statuses_merge_recording_ranks_and_total_the_rest():
    merged = merge_status([status(True, ["a", "b"], 5), status(False, ["a", "b"], 7)])
    assert merged["sites"] == ["a", "b"] and merged["fired"] == [5, 5] and merged["runner"] == "V1"
    assert (merged["buffer_bytes"], merged["pending_results"], merged["steps"], merged["workers"]) == (200, 1, 7, 2)
    assert merged["host_seconds"] == {"route": 0.5}
    assert merged["step_kinds"] == {"new_batch": 1, "same_batch": 0, "repeated": 4}
    assert merged["sae_held"] == {"encoders": 1, "groups": 0, "pools": 0, "arenas": 0}
    assert merged["attention"] == {"3": [0.125, 0.0, 0.0], "4": [0.125, 4096.0, 50.0]}  # pipeline stages: the union
