"""The default model, converted from its PyPI GGUF, on the real engine and in transformers."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import boot_engine
from hf_reference import hf_activations, load_hf
from sae_reference import saved_sae

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_prepared_config_is_plain_bf16_llama(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["dtype"] == "bfloat16"
    marker = json.loads((smollm2_dir / "tlvllm-prepared.json").read_text())
    assert len(marker["weights_sha256"]) == 64


def test_tokenizer_round_trip_and_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = "Steering vectors, activations & résumés: 42!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is" in rendered


@pytest.mark.engine
def test_smollm2_answers_paris_and_captures_match_transformers(vllm_ready, smollm2_dir):
    engine = boot_engine(smollm2_dir)
    hooks = ["blocks.0.hook_resid_pre", "blocks.15.hook_resid_post", "blocks.29.hook_resid_post"]
    out = engine.generate(QUESTION, max_tokens=12, capture={"hooks": hooks})[0]
    assert "Paris" in out.text
    reference = hf_activations(load_hf(smollm2_dir), out.prompt_token_ids + out.token_ids[:-1])
    for hook in hooks:
        got, want = out.activations[hook], reference[hook]
        assert got.shape == want.shape
        assert float((got - want).norm() / want.norm()) < 1e-4, hook
    again = engine.generate([QUESTION, QUESTION], max_tokens=12)
    assert again[0].token_ids == again[1].token_ids == out.token_ids
    assert torch.isfinite(out.activations[hooks[-1]]).all()


@pytest.mark.engine
def test_smollm2_sae_features_equal_sae_lens_on_transformers(vllm_ready, smollm2_dir, tmp_path):
    """An SAE capture's features are sae-lens' own ``encode`` of transformers' activations (fp32,
    rel < 1e-4), per token and as the mean over the answer."""
    from inspect_tl_vllm.specs import sae_keys

    hook = "blocks.15.hook_resid_post"
    reference_sae = saved_sae(tmp_path / "sae", "jumprelu", d_in=576, d_sae=1024, hook=hook)
    engine = boot_engine(smollm2_dir)
    specs = [
        {"capture": {"sae": str(tmp_path / "sae"), "top_k": 16}},
        {"capture": {"sae": str(tmp_path / "sae"), "top_k": 16, "reduce": "mean", "positions": "generated"}},
    ]
    per_token, mean = engine.generate([QUESTION, QUESTION], specs=specs, max_tokens=12)
    reference = hf_activations(load_hf(smollm2_dir), per_token.prompt_token_ids + per_token.token_ids[:-1])
    acts = reference_sae.encode(reference[hook]).detach()
    indices_key, values_key = sae_keys(hook)
    want_values, want_indices = acts.topk(16, dim=-1)
    assert (want_values > 0).float().mean() > 0.5  # features fire: the comparison is not of zeros
    got_values = per_token.activations[values_key]
    assert float((got_values - want_values).norm() / want_values.norm()) < 1e-4
    assert (per_token.activations[indices_key] == want_indices).float().mean() > 0.99  # near-ties may swap
    prompt_len = len(per_token.prompt_token_ids)
    want_mean, _ = acts[prompt_len:].mean(0).topk(16)
    assert float((mean.activations[values_key][0] - want_mean).norm() / want_mean.norm()) < 1e-4
