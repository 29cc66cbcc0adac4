"""Every supported architecture, as a tiny random model: captures at every hook point (per head
and neuron ones, and a mixture of experts' router, included) equal transformers' (fp32), and
steering moves greedy tokens exactly as a transformers hook does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import TINY, booted_engine, build_tiny_model
from hf_reference import hf_activations, hf_greedy, hf_inner_activations, load_hf

pytestmark = pytest.mark.engine

MOE = {"num_experts_per_tok": 2, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 2}
TOKENS = {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 2}
OWN_NAMES = {  # families whose configs do not take TINY's field names: the same sizes in theirs
    "GPT2LMHeadModel": (
        "GPT2Config",
        {"n_embd": 64, "n_layer": 3, "n_head": 2, "n_inner": 128, "n_positions": 512, **TOKENS},
    ),
    "GPTNeoXForCausalLM": (
        "GPTNeoXConfig",
        {
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "intermediate_size": 128,
            "max_position_embeddings": 512,
            "rotary_pct": 0.5,
            **TOKENS,
        },
    ),
}
CONFIGS = {
    "Olmo2ForCausalLM": ("Olmo2Config", TOKENS),
    "MistralForCausalLM": ("MistralConfig", {}),
    "Phi3ForCausalLM": ("Phi3Config", {"eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 2}),
    "MixtralForCausalLM": ("MixtralConfig", {**MOE, "num_local_experts": 4}),
    "OlmoeForCausalLM": ("OlmoeConfig", {**MOE, "num_experts": 4}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {**MOE, "num_experts": 4, "moe_intermediate_size": 64}),
    "Qwen2ForCausalLM": ("Qwen2Config", {}),
    "Qwen3ForCausalLM": ("Qwen3Config", {}),
    "Gemma2ForCausalLM": (
        "Gemma2Config",
        {
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
        },
    ),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {"query_pre_attn_scalar": 32, "sliding_window": 4096, "tie_word_embeddings": True},
    ),
}


def build_tiny(architecture: str, target: Path, tokenizer_dir: Path) -> Path:
    import transformers

    if architecture in OWN_NAMES:
        config_name, fields = OWN_NAMES[architecture]
    else:
        config_name, extra = CONFIGS[architecture]
        fields = {**TINY, **extra}
    config = getattr(transformers, config_name)(**{"vocab_size": 49152, "tie_word_embeddings": False, **fields})
    return build_tiny_model(architecture, config, target, tokenizer_dir)


MIXTURES = {"MixtralForCausalLM", "OlmoeForCausalLM", "Qwen3MoeForCausalLM"}
UNFUSED_PROJECTIONS = {"Phi3ForCausalLM"}
"""Phi-3's transformers model fuses q/k/v and gate/up as vLLM does: no per-projection modules to
compare the per-head and neuron hook points with (the mixtures of experts' MLP is their router)."""


@pytest.mark.parametrize("architecture", sorted([*CONFIGS, *OWN_NAMES]))
def test_architecture_fidelity_and_steering(architecture, tmp_path, vllm_ready, smollm2_dir):
    """Every hook point (residual, per head and neuron, or a mixture of experts' router logits)
    equals transformers' tensor, and steering equals a transformers hook."""
    path = build_tiny(architecture, tmp_path / architecture, smollm2_dir)
    inner = [] if architecture in MIXTURES | UNFUSED_PROJECTIONS else ["blocks.*.attn.*", "blocks.*.mlp.*"]
    router = ["blocks.*.mlp.hook_router_logits"] if architecture in MIXTURES else []
    with booted_engine(path, instrument={"hook_points": ["all", *inner, *router]}) as engine:
        hf = load_hf(path)
        hooks = [h for h in engine.core.instrumentation.sites if not h.endswith("router_logits")]
        out = engine.generate("Once upon a time", max_tokens=4, capture={"hooks": hooks})[0]
        ids = out.prompt_token_ids + out.token_ids[:-1]
        reference = {**hf_activations(hf, ids), **(hf_inner_activations(hf, ids) if inner else {})}
        errors = {
            h: float((out.activations[h] - reference[h]).norm() / reference[h].norm().clamp_min(1e-12)) for h in hooks
        }
        assert max(errors.values()) < 1e-4, {h: e for h, e in errors.items() if e >= 1e-4}
        assert any(".attn." in h for h in hooks) == bool(inner)
        torch.manual_seed(1)
        vector = torch.randn(64) * 2
        steer = [{"hook": "blocks.1.hook_resid_post", "vector": vector.tolist(), "coef": 3.0}]
        steered = engine.generate("Once upon a time", max_tokens=12, steering=steer)[0]
        expected = hf_greedy(hf, out.prompt_token_ids, 12, edit=lambda h: h + 3.0 * vector, layer=1)
        assert steered.token_ids == expected
        if router:
            check_router(engine, hf)


def check_router(engine, hf) -> None:
    """``mlp.hook_router_logits``: the router's logits per token as transformers' router computes
    them; raising one expert's logit at every position makes the block route to it."""
    router = "blocks.1.mlp.hook_router_logits"
    out = engine.generate("Once upon a time", max_tokens=4, capture={"hooks": [router, "blocks.1.hook_mlp_out"]})[0]
    kept: list[torch.Tensor] = []
    handle = hf.model.layers[1].mlp.gate.register_forward_hook(lambda mod, args, res: kept.append(res[0]))
    try:
        with torch.no_grad():
            hf(torch.tensor([out.prompt_token_ids + out.token_ids[:-1]]))
    finally:
        handle.remove()
    logits = out.activations[router]
    assert logits.shape == (len(out.prompt_token_ids) + 3, 4)
    assert float((logits - kept[0]).norm() / kept[0].norm()) < 1e-4
    push = [0.0, 0.0, 0.0, 100.0]  # expert 3 wins every token's top 2
    steered = engine.generate(
        "Once upon a time",
        max_tokens=4,
        steering=[{"hook": router, "vector": push}],
        capture={"hooks": [router, "blocks.1.hook_mlp_out"]},
    )[0]
    assert bool((steered.activations[router].argmax(-1) == 3).all())
    torch.testing.assert_close(steered.activations[router][:4], logits[:4] + torch.tensor(push))
    assert not torch.allclose(
        steered.activations["blocks.1.hook_mlp_out"][:4], out.activations["blocks.1.hook_mlp_out"][:4]
    )
