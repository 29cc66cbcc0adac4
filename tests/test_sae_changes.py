"""SAE folders that change under a running engine, on the real CPU engine.

A request's SAE capture is pinned at admission by the sha256 of the SAE's files: a worker that
reads other files (the folder was rewritten while the request waited) fails that request alone,
by name, and the engine serves the next one.  A rewrite that keeps the size and restores the
mtime is still seen (caches key on the ctime too).  What a worker holds for SAE captures follows
its live requests: fourteen SAEs one after another leave no more than ``MAX_HELD`` encoders and
no pools, groups or arenas behind.  The config's own checks: booleans must be JSON booleans, and
a config nested past Python's recursion limit is refused by name.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from inspect_tl_vllm.specs import SpecError, sae_keys
from inspect_tl_vllm.vectors.sae import load_sae, read_sae
from sae_reference import HOOK, saved_sae

PROMPT = ["Once upon a time there was a"]


def capture_of(folder, **extra) -> dict:
    return {"capture": {"sae": str(folder), "top_k": 5, **extra}}


def rewrite_during_admission(engine, monkeypatch, rewrite) -> None:
    """Run ``rewrite`` after the front end has prepared a call's requests and before vLLM gets
    them: the worker then reads the folder as ``rewrite`` left it."""
    add = engine._add

    def add_after_rewrite(*args, **kwargs):
        rewrite()
        return add(*args, **kwargs)

    monkeypatch.setattr(engine, "_add", add_after_rewrite)


@pytest.mark.engine
def test_an_sae_rewritten_while_its_request_waits_fails_that_request_only(tiny_engine, tmp_path, monkeypatch):
    """The folder gets an SAE of another width between admission and the worker's read: the
    worker used to load it unchecked, encode raised inside the step and the engine died."""
    folder = tmp_path / "sae"
    saved_sae(folder, "standard")
    before = tiny_engine.generate(PROMPT, specs=[capture_of(folder)], max_tokens=4)[0]
    rewrite_during_admission(tiny_engine, monkeypatch, lambda: saved_sae(folder, "standard", d_in=32, seed=1))
    with pytest.raises(Exception, match=r"the SAE files at .* changed after this request was admitted"):
        tiny_engine.generate(PROMPT, specs=[capture_of(folder)], max_tokens=4)
    monkeypatch.undo()
    saved_sae(folder, "standard")  # the first SAE again: same files, same features as before
    again = tiny_engine.generate(PROMPT, specs=[capture_of(folder)], max_tokens=4)[0]
    assert again.token_ids == before.token_ids
    for key, value in before.activations.items():
        assert torch.equal(again.activations[key], value), key


@pytest.mark.engine
def test_same_shape_weights_rewritten_in_waiting_fail_and_same_size_rewrites_are_not_served_stale(
    tiny_engine, tmp_path, monkeypatch
):
    """Weights of the same shape swapped in while a request waits fail it too (its features
    would be another SAE's); a rewrite with the same size and the mtime put back is read anew
    by both the front end and the worker: features equal those of a fresh copy of the new SAE."""
    folder, fresh = tmp_path / "sae", tmp_path / "fresh"
    saved_sae(folder, "standard", seed=0)
    rewrite_during_admission(tiny_engine, monkeypatch, lambda: saved_sae(folder, "standard", seed=1))
    with pytest.raises(Exception, match="changed after this request was admitted"):
        tiny_engine.generate(PROMPT, specs=[capture_of(folder)], max_tokens=4)
    monkeypatch.undo()

    saved_sae(folder, "standard", seed=0)
    first = tiny_engine.generate(PROMPT, specs=[capture_of(folder)], max_tokens=4)[0]
    weights = folder / "sae_weights.safetensors"
    stat = weights.stat()
    saved_sae(fresh, "standard", seed=2)
    shutil.copyfile(fresh / "sae_weights.safetensors", weights)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    rewritten, reference = tiny_engine.generate(PROMPT * 2, specs=[capture_of(folder), capture_of(fresh)], max_tokens=4)
    indices, values = sae_keys(HOOK)
    assert not torch.equal(rewritten.activations[values], first.activations[values])
    assert torch.equal(rewritten.activations[indices], reference.activations[indices])
    assert torch.equal(rewritten.activations[values], reference.activations[values])
    assert load_sae(folder).digest == read_sae(fresh).digest


@pytest.mark.engine
def test_a_worker_holds_only_what_its_live_sae_captures_use(tiny_engine, tmp_path):
    """Fourteen SAEs, each captured per token and pooled, with listed features: once their
    requests are retired the worker holds ``MAX_HELD`` encoders, and no feature group, pool or
    arena (it used to keep every SAE's pool and group on the device)."""
    from inspect_tl_vllm.engine.sae_encoders import MAX_HELD

    for number in range(14):
        folder = tmp_path / f"sae{number}"
        saved_sae(folder, "standard", seed=number)
        specs = [capture_of(folder), capture_of(folder, reduce="mean", features=[number, 100 + number])]
        tiny_engine.generate(PROMPT * 2, specs=specs, max_tokens=3)
    tiny_engine.generate(PROMPT, max_tokens=2)  # a worker retires requests at the step after their last
    held = tiny_engine.status()["sae_held"]
    assert held == {"encoders": MAX_HELD, "groups": 0, "pools": 0, "arenas": 0}


@pytest.mark.parametrize("flag", ["apply_b_dec_to_input", "rescale_acts_by_decoder_norm"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_sae_config_flags_must_be_json_booleans(tmp_path, flag, value):
    """``"false"`` used to read as True (a non-empty string)."""
    saved_sae(tmp_path, "standard")
    config = json.loads((tmp_path / "cfg.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps({**config, flag: value}))
    with pytest.raises(SpecError, match=rf"{flag} must be true or false \(JSON booleans\), got {value!r}"):
        read_sae(tmp_path, "capture.sae")


def test_a_deeply_nested_sae_config_is_refused_by_name(tmp_path):
    saved_sae(tmp_path, "standard")
    (tmp_path / "cfg.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(SpecError, match="nests too deeply"):
        load_sae(tmp_path, "capture.sae")
