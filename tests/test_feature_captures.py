"""SAE captures folded and stored by the step router (``instrument/feature_captures.py``), driven
on CPU buffers through what the engine tests cannot force: prefill rows encoded in several chunks,
two requests in one step in swapped batch order, and a request's last row computed after it
stopped (it must not count).  Finished by the worker's packer, as a fetch does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load

from conftest import cpu_hook_runtime
from inspect_tl_vllm.engine.packing import ResultPacker
from inspect_tl_vllm.instrument import feature_captures
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState, Scope
from inspect_tl_vllm.instrument.routing import StepRouter
from inspect_tl_vllm.specs import sae_keys
from inspect_tl_vllm.wire import FeaturesWire

WIDTH, D_SAE = 8, 12


class Encoder:
    """A ReLU encoder, as the worker attaches an SAE's: ``d_sae`` and ``encode``."""

    d_sae = D_SAE

    def __init__(self) -> None:
        self.weight = torch.randn(WIDTH, D_SAE, generator=torch.Generator().manual_seed(1))

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows.float() @ self.weight).relu()


def feature_state(uid: str, prompt_len: int, reduce: str, encoder: Encoder, **wire) -> RequestState:
    state = RequestState(uid=uid, prompt_len=prompt_len, steer=[], capture=[CaptureItem(hook="h", site=0)])
    state.capture_scope = Scope.resolve("all", prompt_len)
    state.features = FeaturesWire(
        digest="-", sae="unused", top_k=wire.get("top_k", 3), features=wire.get("features"), reduce=reduce
    )
    state.encoder = encoder
    return state


@pytest.mark.parametrize("reduce", ["none", "mean", "max", "last"])
@pytest.mark.parametrize("spurious", [False, True])
def test_features_of_two_requests_over_chunked_steps(monkeypatch, reduce: str, spurious: bool) -> None:
    monkeypatch.setattr(feature_captures, "CHUNK_ROWS", 2)  # a's 3-row prefill spans two chunks
    torch.manual_seed(0)
    encoder = Encoder()
    ra, rb = torch.randn(5, WIDTH), torch.randn(3, WIDTH)
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime)
    a = feature_state("a", 3, reduce, encoder)
    b = feature_state("b", 2, reduce, encoder, features=[0, 5, 11])
    for state in (a, b):
        router.admit(state)
    steps = [
        (torch.cat([ra[:3], rb[:2]]), [0, 1], [0, 3, 5], [0, 0]),  # prefill of both
        (torch.stack([rb[2], ra[3]]), [1, 0], [0, 1, 2], [2, 3]),  # decode, b first in the batch
        (ra[4:5], [0, -1], [0, 1], [4]),  # a alone; b not scheduled
    ]
    for staging, batch_index, query_start, computed in steps:
        router.begin_step(np.array(batch_index), np.array(query_start), np.array(computed))
        runtime.sites[0].staging[: len(staging)] = staging
        router.end_step()
    router.drain()
    router.snapshot([a, b])
    packer = ResultPacker({0: WIDTH})
    indices_key, values_key = sae_keys("h")
    kept_a = ra[:4] if spurious else ra
    for state, rows, max_pos in ((a, kept_a, 3 if spurious else 4), (b, rb, 2)):
        result = packer.pack(state, max_pos, folder=None)
        assert result.receipt.error is None, result.receipt.error
        tensors, positions = load(result.tensors), result.positions
        acts = encoder.encode(rows)
        if reduce == "none":
            assert positions[values_key] == list(range(len(rows)))
        else:
            acts = {"mean": acts.mean(0), "max": acts.amax(0), "last": acts[-1]}[reduce][None]
        if state.features.features is not None:
            assert tensors[indices_key].tolist() == [[0, 5, 11]] * len(acts)
            torch.testing.assert_close(tensors[values_key], acts[:, [0, 5, 11]])
        else:
            values, indices = acts.topk(3, dim=-1)
            torch.testing.assert_close(tensors[values_key], values)
            assert torch.equal(tensors[indices_key], indices.int())
        assert result.receipt.captures == {"h": len(rows)} and result.receipt.error is None


def test_features_that_are_not_finite_fail_their_request_only() -> None:
    encoder = Encoder()
    runtime = cpu_hook_runtime(WIDTH)
    router = StepRouter(runtime)
    bad, good = feature_state("bad", 2, "none", encoder), feature_state("good", 2, "mean", encoder)
    for state in (bad, good):
        router.admit(state)
    router.begin_step(np.array([0, 1]), np.array([0, 2, 4]), np.array([0, 0]))
    runtime.sites[0].staging[:4] = torch.randn(4, WIDTH)
    runtime.sites[0].staging[1, 0] = float("nan")
    router.end_step()
    router.drain()
    router.snapshot([bad, good])
    packer = ResultPacker({0: WIDTH})
    assert (
        packer.pack(bad, 1, folder=None).receipt.error == "the SAE features captured at h are not finite (NaN or inf)"
    )
    assert packer.pack(good, 1, folder=None).receipt.error is None
