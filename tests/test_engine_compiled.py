"""Compiled mode (torch.compile, vLLM's CPU DYNAMO_TRACE_ONCE): hooks must be inside the
graph.  Steering and captures must match the eager engine on the same weights."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_batch_matches_solo, boot_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]
PROMPTS = ["The quick brown fox jumps over", "Once upon a time", "In a hole in the ground there lived"]
HOOKS = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_mid", "blocks.2.hook_attn_out", "ln_final.hook_normalized"]


@pytest.fixture(scope="module")
def compiled_engine(vllm_ready, tiny_llama_dir):
    return boot_engine(tiny_llama_dir, compiled=True, instrument={"hook_points": ["all"]})


def test_compiled_engine_steers_and_captures_like_eager(compiled_engine, tiny_engine):
    torch.manual_seed(3)
    vector = torch.randn(64).tolist()
    specs = [
        {
            "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": vector, "coef": 6.0}],
            "capture": {"hooks": HOOKS},
        },
        {"capture": {"hooks": HOOKS}},
        {"interventions": [{"hook": "blocks.0.hook_mlp_out", "vector": vector, "op": "ablate"}]},
    ]
    compiled = compiled_engine.generate(PROMPTS, specs=specs, max_tokens=10)
    eager = tiny_engine.generate(PROMPTS, specs=specs, max_tokens=10)
    for c, e in zip(compiled, eager, strict=True):
        assert c.token_ids == e.token_ids
        for hook, value in e.activations.items():
            err = float((c.activations[hook] - value).norm() / value.norm())
            assert err < 1e-4, (hook, err)
    assert compiled[0].token_ids != compiled[1].token_ids
    fired = compiled_engine.status()["fired"]
    assert min(fired) > 10, "every hook must run in every compiled forward step"


def test_compiled_captures_equal_transformers_at_every_hook_point(compiled_engine, tiny_llama_dir):
    from hf_reference import hf_activations, load_hf

    hooks = list(compiled_engine.core.instrumentation.sites)
    out = compiled_engine.generate(PROMPTS[0], max_tokens=5, capture={"hooks": hooks})[0]
    reference = hf_activations(load_hf(tiny_llama_dir), out.prompt_token_ids + out.token_ids[:-1])
    worst = max(float((out.activations[h] - reference[h]).norm() / reference[h].norm()) for h in hooks)
    assert worst < 1e-4


def test_compiled_mixed_batch_gives_each_request_its_solo_result(compiled_engine):
    torch.manual_seed(4)
    specs = [
        {
            "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": torch.randn(64).tolist(), "coef": 5.0}],
            "capture": {"hooks": HOOKS},
        },
        {
            "interventions": [{"hook": "blocks.2.hook_attn_out", "vector": torch.randn(64).tolist(), "coef": 5.0}],
            "capture": {"hooks": HOOKS, "reduce": "mean"},
        },
        None,
        {"interventions": [{"hook": "blocks.0.hook_resid_pre", "op": "scale", "coef": 0.5}]},
    ]
    assert_batch_matches_solo(compiled_engine, [*PROMPTS, PROMPTS[0]], specs)
