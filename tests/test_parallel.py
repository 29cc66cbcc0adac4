"""Tensor and pipeline parallel on vLLM's CPU build (two worker processes, one core each).

Every tensor-parallel rank steers (each holds the same residual stream after the all-reduce)
and only rank 0 records; each pipeline stage hooks only its own layers and the front end merges
the stages' results.  Both must give the tokens, captures and receipts of one worker.
"""

from __future__ import annotations

import pytest
import torch

from conftest import booted_engine

pytestmark = pytest.mark.engine
HOOKS = [
    "blocks.0.hook_resid_pre",
    "blocks.0.hook_resid_post",
    "blocks.1.hook_attn_out",
    "blocks.2.hook_mlp_out",
    "ln_final.hook_normalized",
]
PROMPTS = ["Once upon a time", "The quick brown fox", "In a hole in the ground"]


def specs() -> list[dict]:
    torch.manual_seed(11)
    early, late = torch.randn(64).tolist(), torch.randn(64).tolist()
    return [
        {  # steered on both pipeline stages, captured on both
            "interventions": [
                {"hook": "blocks.0.hook_resid_post", "vector": early, "coef": 4.0},
                {"hook": "blocks.2.hook_resid_mid", "vector": late, "op": "ablate"},
            ],
            "capture": {"hooks": HOOKS},
        },
        {"capture": {"hooks": HOOKS, "reduce": "mean"}},
        {
            "interventions": [
                {"hook": "blocks.2.hook_resid_post", "vector": late, "coef": 6.0, "positions": "generated"}
            ]
        },
    ]


@pytest.fixture(scope="module")
def reference(tiny_engine):
    return tiny_engine.generate(PROMPTS, specs=specs(), max_tokens=8)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_parallel_workers_match_one_worker(vllm_ready, tiny_llama_dir, reference, layout):
    # vLLM's CPU workers bind OpenMP threads per rank; with one NUMA node the cores are named.
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    instrument = {"hook_points": ["all"], "max_stack": 2}
    with booted_engine(tiny_llama_dir, env=binding, instrument=instrument, **layout) as engine:
        status = engine.status()
        assert status["workers"] == 2
        assert len(status["sites"]) == len(set(status["sites"])) == 14  # every site recorded exactly once
        got = engine.generate(PROMPTS, specs=specs(), max_tokens=8)
    for mine, theirs in zip(got, reference, strict=True):
        assert mine.token_ids == theirs.token_ids
        assert mine.receipt["captures"] == theirs.receipt["captures"]
        for a, b in zip(mine.receipt["interventions"], theirs.receipt["interventions"], strict=True):
            # the all-reduce sums in another order: norms agree to float32 rounding, not bit for bit
            assert a["mean_norm_change"] == pytest.approx(b["mean_norm_change"], rel=1e-4)
            assert {**a, "mean_norm_change": 0} == {**b, "mean_norm_change": 0}
        assert set(mine.activations) == set(theirs.activations)
        for hook, value in theirs.activations.items():
            assert float((mine.activations[hook] - value).norm() / value.norm()) < 1e-5, hook


def test_a_hook_point_no_worker_holds_fails_boot():
    from types import SimpleNamespace

    from inspect_tl_vllm.engine.frontend import adopt_worker_status

    names = ["blocks.0.hook_resid_post", "ln_final.hook_normalized"]
    table = SimpleNamespace(sites={name: SimpleNamespace(name=name) for name in names})
    adopt_worker_status(table, {"sites": names, "attention": {}})
    with pytest.raises(RuntimeError, match=r"hook points \['ln_final.hook_normalized'\] landed on no worker"):
        adopt_worker_status(table, {"sites": names[:1], "attention": {}})
