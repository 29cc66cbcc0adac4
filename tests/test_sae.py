"""Sparse autoencoders in SAELens' format: built and saved by ``sae-lens`` itself, read here and
encoded as ``sae-lens`` encodes.  On the real CPU engine: steering by a feature adds its decoder
row, clamping sets its activation through the decoder, receipts report the feature before and
after, and captures return its features as sae-lens encodes the engine's rows.  Bad folders,
features, hook points and capture fields fail by name."""

from __future__ import annotations

import json

import pytest
import torch

from inspect_tl_vllm.specs import SpecError, parse_request_spec
from inspect_tl_vllm.vectors.sae import load_sae
from sae_reference import HOOK, WIDTH, saved_sae


@pytest.mark.parametrize("architecture", ["standard", "jumprelu", "topk"])
def test_features_equal_sae_lens_encode(tmp_path, architecture):
    reference = saved_sae(tmp_path, architecture)
    sae = load_sae(tmp_path)
    x = torch.randn(40, WIDTH, generator=torch.Generator().manual_seed(1)) * 2
    expected = reference.encode(x).detach()
    got = sae.encode(x)
    assert (expected != 0).sum() > 40  # features fire: the comparison is not of zeros
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    assert torch.equal(sae.decoder_row(3, "f"), reference.W_dec[3].detach())
    assert (sae.architecture, sae.hook, sae.d_in, sae.d_sae) == (architecture, HOOK, WIDTH, 256)


def test_bad_sae_folders_fail_by_name(tmp_path):
    with pytest.raises(SpecError, match=r"not an SAE folder: cfg.json not found"):
        load_sae(tmp_path / "nothing")
    saved_sae(tmp_path / "sae", "standard")
    config_path = tmp_path / "sae" / "cfg.json"
    config = json.loads(config_path.read_text())
    for change, fragment in [
        ({"architecture": "gated"}, "architecture 'gated' is not supported"),
        ({"normalize_activations": "layer_norm"}, "normalize_activations='layer_norm' is not supported"),
        ({"d_sae": 128}, r"W_enc has shape \(64, 256\), expected \(64, 128\)"),
        ({"metadata": {}}, "names no hook point"),
        ({"metadata": {"hook_name": "blocks.1.hook_nonsense"}}, "hook 'blocks.1.hook_nonsense'"),
    ]:
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(SpecError, match=fragment):
            load_sae(tmp_path / "sae", "steer")
    config_path.write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "sae" / "sae_weights.safetensors"))
    weights["W_dec"][0, 0] = float("nan")
    save_file(weights, str(tmp_path / "sae" / "sae_weights.safetensors"))
    with pytest.raises(SpecError, match="W_dec holds NaN or inf"):
        load_sae(tmp_path / "sae")


@pytest.mark.parametrize(
    ("item", "fragment"),
    [
        ({"sae": "x"}, "needs both the SAE folder and the feature index"),
        ({"feature": 3}, "needs both the SAE folder and the feature index"),
        ({"sae": "x", "feature": 3, "op": "ablate"}, "op 'add' or 'clamp' and no vector"),
        ({"sae": "x", "feature": 3, "vector": [1.0]}, "op 'add' or 'clamp' and no vector"),
        ({"op": "clamp", "vector": [1.0]}, "'clamp' sets an SAE feature's activation; give sae and feature"),
        ({"sae": "x", "feature": -1}, "feature"),
        ({"sae": "x", "feature": 2**24}, "feature"),
        ({"sae": "x", "feature": 1.5}, "feature"),
    ],
)
def test_feature_steering_specs_are_checked(item, fragment):
    with pytest.raises(SpecError, match=fragment):
        parse_request_spec({"interventions": [{"hook": HOOK, **item}]})


@pytest.mark.engine
def test_steering_by_a_feature_adds_its_decoder_row(tiny_engine, tmp_path):
    """``{"sae": DIR, "feature": i, "coef": c}`` steers exactly as the vector ``W_dec[i]`` with
    coef c: the same tokens and bit-identical activations downstream; a feature of an SAE trained
    elsewhere, or past its width, fails that request by name."""
    reference = saved_sae(tmp_path / "sae", "jumprelu")
    row = reference.W_dec[7].detach().tolist()
    prompt = ["Once upon a time"]
    capture = {"hooks": ["blocks.2.hook_resid_post"], "reduce": "none"}
    by_feature = {"interventions": [{"hook": HOOK, "sae": str(tmp_path / "sae"), "feature": 7, "coef": 4.0}]}
    by_vector = {"interventions": [{"hook": HOOK, "vector": row, "coef": 4.0}]}
    plain = tiny_engine.generate(prompt, specs=[{"capture": capture}], max_tokens=6)[0]
    [feature] = tiny_engine.generate(prompt, specs=[{**by_feature, "capture": capture}], max_tokens=6)
    [vector] = tiny_engine.generate(prompt, specs=[{**by_vector, "capture": capture}], max_tokens=6)
    assert feature.token_ids == vector.token_ids
    assert torch.equal(feature.activations["blocks.2.hook_resid_post"], vector.activations["blocks.2.hook_resid_post"])
    assert not torch.equal(
        feature.activations["blocks.2.hook_resid_post"], plain.activations["blocks.2.hook_resid_post"]
    )
    assert feature.receipt["interventions"][0]["rows"] > 0

    saved_sae(tmp_path / "other", "standard", hook="blocks.0.hook_resid_post")
    elsewhere = {"interventions": [{"hook": HOOK, "sae": str(tmp_path / "other"), "feature": 7}]}
    with pytest.raises(SpecError, match=r"trained on 'blocks.0.hook_resid_post', not 'blocks.1.hook_resid_post'"):
        tiny_engine.generate(prompt, specs=[elsewhere], max_tokens=2)
    past = {"interventions": [{"hook": HOOK, "sae": str(tmp_path / "sae"), "feature": 256}]}
    with pytest.raises(SpecError, match=r"feature 256 is out of range; .* has features 0..255"):
        tiny_engine.generate(prompt, specs=[past], max_tokens=2)
    saved_sae(tmp_path / "wide", "standard", d_in=32)
    wide = {"interventions": [{"hook": HOOK, "sae": str(tmp_path / "wide"), "feature": 1}]}
    with pytest.raises(SpecError, match="reads 32-wide activations but the model's hidden size is 64"):
        tiny_engine.generate(prompt, specs=[wide], max_tokens=2)


def test_a_spec_file_names_its_sae_relative_to_itself_and_the_cache_key_follows_the_weights(tmp_path):
    """``-M steer=spec.yaml`` finds ``sae: sae`` beside the file; retraining the SAE (new weights in
    the same folder) changes the run's fingerprint, which Inspect's cache key carries."""
    from inspect_tl_vllm.provider.model_args import parse_model_args

    saved_sae(tmp_path / "sae", "standard")
    spec = tmp_path / "steer.yaml"
    spec.write_text(f"interventions:\n  - {{hook: {HOOK}, sae: sae, feature: 3, coef: 2.0}}\n")
    settings = parse_model_args({"steer": str(spec)})
    assert settings.run_spec.interventions[0].sae == str(tmp_path / "sae")
    before = settings.fingerprint("m")
    assert parse_model_args({"steer": str(spec)}).fingerprint("m") == before
    saved_sae(tmp_path / "sae", "standard", seed=1)
    assert parse_model_args({"steer": str(spec)}).fingerprint("m") != before


@pytest.mark.engine
def test_clamping_a_feature_sets_it_through_the_decoder_and_the_receipt_reports_it(tiny_engine, tmp_path):
    """``op: clamp`` to c makes each steered row h + (c - f_i(h)) W_dec[i] (the SAE's error term
    kept), and the receipt's ``feature_before``/``feature_after`` are f_i of the rows before and
    after, averaged; f_i as sae-lens' own ``encode`` computes it.  Prompt rows only, so that the
    unsteered run sees the same rows before the hook."""
    reference = saved_sae(tmp_path / "sae", "jumprelu")
    prompt = ["Once upon a time there was"]
    capture = {"hooks": [HOOK], "reduce": "none", "positions": "prompt"}
    [plain] = tiny_engine.generate(prompt, specs=[{"capture": capture}], max_tokens=3)
    before = reference.encode(plain.activations[HOOK]).detach()
    feature = int(before.mean(0).argmax())  # a feature that fires on this prompt
    assert before[:, feature].max() > 0
    sae_dir = str(tmp_path / "sae")
    clamp = {"hook": HOOK, "op": "clamp", "sae": sae_dir, "feature": feature, "coef": 3.0, "positions": "prompt"}
    [clamped] = tiny_engine.generate(prompt, specs=[{"interventions": [clamp], "capture": capture}], max_tokens=3)
    h, steered = plain.activations[HOOK], clamped.activations[HOOK]
    expected = h + (3.0 - before[:, feature : feature + 1]) * reference.W_dec[feature].detach()
    assert float((steered - expected).abs().max()) < 1e-4
    receipt = clamped.receipt["interventions"][0]
    assert receipt["rows"] == h.shape[0]
    assert receipt["feature_before"] == pytest.approx(float(before[:, feature].mean()), rel=1e-4, abs=1e-5)
    after = reference.encode(steered).detach()[:, feature].mean()
    assert receipt["feature_after"] == pytest.approx(float(after), rel=1e-4, abs=1e-5)
    assert receipt["feature_after"] != pytest.approx(receipt["feature_before"], abs=1e-3)

    add = {"hook": HOOK, "sae": sae_dir, "feature": feature, "coef": 2.0, "positions": "prompt"}
    vector = {"hook": HOOK, "vector": reference.W_dec[feature].detach().tolist(), "coef": 2.0, "positions": "prompt"}
    [both] = tiny_engine.generate(prompt, specs=[{"interventions": [add, vector], "capture": capture}], max_tokens=3)
    by_feature, by_vector = both.receipt["interventions"]
    assert by_feature["feature_before"] == pytest.approx(float(before[:, feature].mean()), rel=1e-4, abs=1e-5)
    after_add = reference.encode(h + 2.0 * reference.W_dec[feature].detach()).detach()[:, feature].mean()
    assert by_feature["feature_after"] == pytest.approx(float(after_add), rel=1e-4, abs=1e-5)  # right after its stage
    assert by_vector["feature_before"] is None and by_vector["feature_after"] is None

    saved_sae(tmp_path / "topk", "topk")
    topk = {**clamp, "sae": str(tmp_path / "topk")}
    with pytest.raises(SpecError, match="TopK SAE's feature activation depends on every other feature"):
        tiny_engine.generate(prompt, specs=[{"interventions": [topk]}], max_tokens=2)


@pytest.mark.engine
def test_feature_capture_is_sae_lens_encode_kept_sparse(tiny_engine, tmp_path):
    """``capture: {sae, top_k, reduce}`` returns each row's top-k features as sae-lens encodes the
    rows the engine computed, per token or reduced in feature space (mean, max, last), or just
    the listed features; ``densify`` turns them back into dense rows.  Bad fields fail by name."""
    from inspect_tl_vllm.specs import sae_keys
    from inspect_tl_vllm.vectors.sae import densify

    reference = saved_sae(tmp_path / "sae", "jumprelu")
    sae_dir = str(tmp_path / "sae")
    prompt = ["Once upon a time there was a"]
    indices_key, values_key = sae_keys(HOOK)
    specs = [
        {"capture": {"hooks": [HOOK], "reduce": "none"}},
        {"capture": {"sae": sae_dir, "top_k": 5}},
        {"capture": {"sae": sae_dir, "top_k": 5, "reduce": "mean"}},
        {"capture": {"sae": sae_dir, "features": [3, 200, 17], "reduce": "max"}},
        {"capture": {"sae": sae_dir, "hooks": [HOOK], "top_k": 4, "reduce": "last", "dtype": "bfloat16"}},
    ]
    raw, top, mean, listed, last = tiny_engine.generate(prompt * len(specs), specs=specs, max_tokens=5)
    acts = reference.encode(raw.activations[HOOK]).detach()
    assert set(top.activations) == {indices_key, values_key}
    indices, values = top.activations[indices_key], top.activations[values_key]
    assert indices.dtype == torch.int32 and tuple(values.shape) == (acts.shape[0], 5)
    assert top.positions[values_key] == raw.positions[HOOK]
    expected_values, expected_indices = acts.topk(5, dim=-1)
    assert torch.allclose(values, expected_values, rtol=1e-4, atol=1e-5)
    assert torch.equal(densify(indices, values, 256) != 0, densify(expected_indices, expected_values, 256) != 0)
    mean_values, mean_indices = acts.mean(0, keepdim=True).topk(5, dim=-1)
    assert torch.equal(mean.activations[indices_key], mean_indices.int())
    assert torch.allclose(mean.activations[values_key], mean_values, rtol=1e-4, atol=1e-5)
    assert listed.activations[indices_key].tolist() == [[3, 200, 17]]
    assert torch.allclose(listed.activations[values_key], acts[:, [3, 200, 17]].amax(0, keepdim=True), atol=1e-5)
    assert last.activations[values_key].dtype == torch.bfloat16
    last_values, _ = acts[-1:].topk(4, dim=-1)
    assert torch.allclose(last.activations[values_key].float(), last_values, rtol=1e-2)
    assert (mean.activations[values_key] > 0).all(), "features fire: the comparison is not of zeros"

    for capture, fragment in [
        ({"sae": sae_dir, "top_k": 300}, "top_k: 300 is more than the SAE's 256 features"),
        ({"sae": sae_dir, "features": [1, 256]}, r"features: \[256\] out of range"),
        ({"sae": sae_dir, "hooks": ["blocks.0.hook_resid_post"]}, "reads 'blocks.1.hook_resid_post', not"),
    ]:
        with pytest.raises(SpecError, match=fragment):
            tiny_engine.generate(prompt, specs=[{"capture": capture}], max_tokens=2)


@pytest.mark.parametrize(
    ("capture", "fragment"),
    [
        ({"hooks": [HOOK], "top_k": 4}, "top_k: only an SAE capture takes these"),
        ({"hooks": [HOOK], "features": [1]}, "features: only an SAE capture takes these"),
        ({"hooks": [HOOK], "reduce": "max"}, "'max' is per SAE feature"),
        ({}, "name at least one hook point"),
        ({"sae": "x", "reduce": "max_norm"}, "reduces per feature"),
        ({"sae": "x", "hooks": [HOOK, "blocks.0.hook_resid_post"]}, "name it alone"),
        ({"sae": "x", "features": [1, 1]}, "each feature once"),
        ({"sae": "x", "features": []}, "features"),
        ({"sae": "x", "top_k": 0}, "top_k"),
        ({"sae": "x", "top_k": 4097}, "top_k"),
    ],
)
def test_feature_capture_specs_are_checked(capture, fragment):
    with pytest.raises(SpecError, match=fragment):
        parse_request_spec({"capture": capture})


def test_densify_checks_its_input():
    from inspect_tl_vllm.vectors.sae import densify

    dense = densify(torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([[1.5, 0.5]]), 4)
    assert dense.tolist() == [[0.5, 0.0, 1.5, 0.0]]
    with pytest.raises(ValueError, match="outside 0..3"):
        densify(torch.tensor([[4]]), torch.tensor([[1.0]]), 4)
    with pytest.raises(ValueError, match="must be"):
        densify(torch.tensor([1]), torch.tensor([1.0]), 4)


def test_a_dumped_capture_spec_parses_again():
    """Solvers and the run-wide spec travel as ``model_dump()``: every default comes back set."""
    for capture in ({"hooks": [HOOK], "reduce": "last"}, {"sae": "x", "top_k": 8, "reduce": "max"}):
        spec = parse_request_spec({"capture": capture})
        assert parse_request_spec(spec.model_dump()) == spec


def test_the_feature_scorer_refuses_features_the_sae_lacks(tmp_path):
    from inspect_tl_vllm.research.features import sae_feature

    saved_sae(tmp_path / "sae", "standard")
    for feature, fragment in [(256, r"feature 256 is out of range; .* has features 0..255"), (-1, "whole number"),
                              (1.5, "whole number"), (2**24, "whole number")]:  # fmt: skip
        with pytest.raises(SpecError, match=fragment):
            sae_feature(str(tmp_path / "sae"), feature)
    with pytest.raises(SpecError, match="not an SAE folder"):
        sae_feature(str(tmp_path / "nothing"), 0)


def test_the_capture_memory_cap_counts_what_an_sae_capture_keeps_on_the_host(tmp_path):
    """An SAE capture is encoded on the device: per token the host keeps its top-k (index, value)
    pairs, 8 bytes each, and nothing per token when it is reduced per sample.  So the cap refuses
    it by that size, not by the hook point's row width, and names the field to shrink."""
    from types import SimpleNamespace

    from inspect_tl_vllm.engine.frontend import Instrumentation
    from inspect_tl_vllm.specs import InstrumentConfig

    saved_sae(tmp_path / "sae", "jumprelu")
    config = SimpleNamespace(
        architectures=["LlamaForCausalLM"], num_hidden_layers=3, hidden_size=WIDTH, num_attention_heads=2
    )
    front = Instrumentation(config, InstrumentConfig(capture_bytes_per_request=4096))
    sae = str(tmp_path / "sae")

    def prepare(capture):  # 10 prompt tokens and up to 40 generated: 50 rows
        return front.prepare(parse_request_spec({"capture": capture}, "x"), prompt_len=10, max_tokens=40)

    prepare({"sae": sae, "top_k": 8})  # 50 x 8 pairs x 8 bytes = 3,200 (a raw row per token: 12,800)
    prepare({"sae": sae, "top_k": 200, "reduce": "mean"})
    prepare({"sae": sae, "features": list(range(10))})
    prepare({"hooks": [HOOK], "reduce": "mean"})
    with pytest.raises(SpecError, match="needs up to 6400 bytes.*capture a smaller top_k or fewer features"):
        prepare({"sae": sae, "top_k": 16})
    with pytest.raises(SpecError, match="needs up to 12800 bytes.*capture fewer positions or hooks"):
        prepare({"hooks": [HOOK]})
