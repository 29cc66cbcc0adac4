"""Per-head and neuron hook points: captures equal transformers' tensors (fp32), and edits
restricted to chosen heads equal the same edits made by a transformers hook.

On the CPU engine (CI) the site op runs as torch ops; on a GPU the same tests run the Triton
kernel inside a compiled engine with CUDA graphs (``pytest tests/test_head_hooks.py`` there), at
the GPU's float32 tolerance (``verify.GPU_FLOAT32_TOLERANCE``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import (
    TINY,
    assert_batch_matches_solo,
    booted_engine,
    build_tiny_model,
    gpu_provider_args,
    gpu_settings,
    tolerance,
)
from hf_reference import hf_activations, hf_inner_activations, load_hf

pytestmark = pytest.mark.engine

INNER = ["blocks.*.attn.*", "blocks.*.mlp.*"]
PROMPT = "Once upon a time there was"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def head_engine(vllm_ready, tiny_llama_dir: Path):
    settings = {"hook_points": [*INNER, "all"], "max_stack": 2}
    with booted_engine(tiny_llama_dir, instrument=settings, **gpu_settings()) as engine:
        yield engine


def check_fidelity(engine, hf) -> None:
    hooks = sorted(
        {s.name for s in engine.core.instrumentation.sites.values() if ".attn." in s.name or ".mlp." in s.name}
    )
    assert len(hooks) == 8 * hf.config.num_hidden_layers
    out = engine.generate(PROMPT, max_tokens=4, capture={"hooks": hooks})[0]
    reference = hf_inner_activations(hf, out.prompt_token_ids + out.token_ids[:-1])
    errors = {h: relative_error(out.activations[h], reference[h]) for h in hooks}
    assert max(errors.values()) < tolerance(), {h: e for h, e in errors.items() if e >= tolerance()}
    heads = hf.config.num_attention_heads
    d_head = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // heads
    kv_heads = getattr(hf.config, "num_key_value_heads", None) or heads
    rows = len(out.prompt_token_ids) + len(out.token_ids) - 1
    assert out.activations["blocks.0.attn.hook_z"].shape == (rows, heads, d_head)
    assert out.activations["blocks.0.attn.hook_v"].shape == (rows, kv_heads, d_head)
    assert out.activations["blocks.0.mlp.hook_post"].shape == (rows, 128)
    pooled = engine.generate(PROMPT, max_tokens=2, capture={"hooks": ["blocks.1.attn.hook_z"], "reduce": "mean"})[0]
    assert pooled.activations["blocks.1.attn.hook_z"].shape == (1, heads, d_head)


def test_llama_inner_hook_points_equal_transformers(head_engine, tiny_llama_dir):
    """Llama here, with the shapes and a pooled capture (every other family: test_architectures.py)."""
    check_fidelity(head_engine, load_hf(tiny_llama_dir))


def hf_edited(hf, token_ids: list[int], module, edit, pre: bool) -> dict[str, torch.Tensor]:
    """transformers' residual-stream activations with ``edit`` applied to ``module``'s input or output."""
    if pre:
        handle = module.register_forward_pre_hook(lambda mod, args: (edit(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(lambda mod, args, out: edit(out))
    try:
        return hf_activations(hf, token_ids)
    finally:
        handle.remove()


def test_head_edits_equal_a_transformers_hook(head_engine, tiny_llama_dir):
    """Zero- and mean-ablating one head at hook_z, adding to one head's value, scaling neurons: the
    edited heads change and the others stay bit for bit; downstream, the residual stream and the
    final norm equal transformers' with the same edit (fp32)."""
    hf = load_hf(tiny_llama_dir)
    d_head = hf.config.head_dim
    plain = head_engine.generate(PROMPT, max_tokens=1, capture={"hooks": ["blocks.1.attn.hook_z"]})[0]
    ids = plain.prompt_token_ids
    z_plain = plain.activations["blocks.1.attn.hook_z"]
    mean_head1 = z_plain[:, 1].mean(0)
    torch.manual_seed(3)
    value_push = torch.randn(d_head)
    neurons = torch.randn(hf.config.intermediate_size)
    layer = hf.model.layers[1]

    def columns(x: torch.Tensor, head: int, new: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[..., head * d_head : (head + 1) * d_head] = new
        return x

    cases = {
        "zero-ablate head 1": (
            {"hook": "blocks.1.attn.hook_z", "op": "scale", "coef": 0.0, "heads": [1]},
            layer.self_attn.o_proj,
            True,
            lambda x: columns(x, 1, 0.0),
        ),
        "mean-ablate head 1": (
            {"hook": "blocks.1.attn.hook_z", "op": "set", "vector": [0.0] * d_head + mean_head1.tolist(), "heads": [1]},
            layer.self_attn.o_proj,
            True,
            lambda x: columns(x, 1, mean_head1),
        ),
        "add to the value of kv head 0": (
            # a vector over both query heads' width would be refused: hook_v has one key-value head
            {"hook": "blocks.1.attn.hook_v", "vector": value_push.tolist(), "coef": 2.0, "heads": [0]},
            layer.self_attn.v_proj,
            False,
            lambda x: x + 2.0 * value_push,
        ),
        "add to the MLP neurons": (
            {"hook": "blocks.1.mlp.hook_post", "vector": neurons.tolist(), "coef": 0.5},
            layer.mlp.down_proj,
            True,
            lambda x: x + 0.5 * neurons,
        ),
    }
    downstream = ["blocks.1.hook_resid_post", "blocks.2.hook_resid_post", "ln_final.hook_normalized"]
    for name, (intervention, module, pre, edit) in cases.items():
        out = head_engine.generate(
            PROMPT,
            max_tokens=1,
            steering=[intervention],
            capture={"hooks": ["blocks.1.attn.hook_z", *downstream], "positions": "prompt"},
        )[0]
        want = hf_edited(hf, ids, module, edit, pre)
        errors = {h: relative_error(out.activations[h], want[h]) for h in downstream}
        assert max(errors.values()) < tolerance(), (name, errors)
        assert (
            relative_error(
                out.activations["ln_final.hook_normalized"], hf_activations(hf, ids)["ln_final.hook_normalized"]
            )
            > 1e-3
        ), f"{name}: the edit must move the final norm, or this test proves nothing"
        z = out.activations["blocks.1.attn.hook_z"]
        if "ablate" in name:
            assert torch.equal(z[:, 0], z_plain[:, 0]), f"{name}: head 0 must pass unchanged"
            expected = 0.0 if name.startswith("zero") else mean_head1
            torch.testing.assert_close(z[:, 1], torch.broadcast_to(torch.as_tensor(expected), z[:, 1].shape))
        assert out.receipt["interventions"][0]["rows"] == len(ids)


def test_heads_steering_stays_per_request_in_a_batch(head_engine):
    """Requests ablating different heads, or scaling neurons, batched together: each equals its run alone."""
    capture = {"hooks": ["blocks.0.attn.hook_z", "blocks.1.mlp.hook_pre"]}
    specs = [
        {"interventions": [{"hook": "blocks.0.attn.hook_z", "op": "scale", "coef": 0.0, "heads": [head]}]}
        for head in (0, 1)
    ]
    specs.append({"interventions": [{"hook": "blocks.1.mlp.hook_pre", "op": "scale", "coef": 0.5}]})
    specs = [{**spec, "capture": capture} for spec in specs]
    prompts = [PROMPT, "The capital of France", "1 2 3 4"]
    outs = assert_batch_matches_solo(head_engine, prompts, specs)
    for head, out in zip((0, 1), outs, strict=False):
        assert not out.activations["blocks.0.attn.hook_z"][:, head].any()
        assert out.activations["blocks.0.attn.hook_z"][:, 1 - head].any()


def test_head_fields_are_checked_against_the_model(head_engine):
    from inspect_tl_vllm.specs import SpecError

    bad = {
        r"heads \[2\] do not exist at blocks.0.attn.hook_z, which has heads 0..1": {
            "hook": "blocks.0.attn.hook_z", "op": "scale", "coef": 0.0, "heads": [2],
        },
        r"64 entries but the width of blocks.0.attn.hook_k \(1 heads x 32\) is 32": {
            "hook": "blocks.0.attn.hook_k", "vector": [1.0] * 64,  # one key-value head: 32 wide
        },
        "zero direction within the chosen heads": {
            "hook": "blocks.0.attn.hook_z", "op": "ablate", "vector": [1.0] * 32 + [0.0] * 32, "heads": [1],
        },
    }  # fmt: skip
    for message, intervention in bad.items():
        with pytest.raises(SpecError, match=message):
            head_engine.generate(PROMPT, max_tokens=1, steering=[intervention])


def test_inner_hook_points_are_refused_under_tensor_parallelism(tiny_llama_dir):
    from transformers import AutoConfig

    from inspect_tl_vllm.engine.construct import check_sharded_sites
    from inspect_tl_vllm.engine.frontend import Instrumentation
    from inspect_tl_vllm.specs import InstrumentConfig, SpecError

    config = AutoConfig.from_pretrained(str(tiny_llama_dir))
    residual = Instrumentation(config, InstrumentConfig(hook_points=["all"]))
    check_sharded_sites(residual, {"tensor_parallel_size": 2})
    heads = Instrumentation(config, InstrumentConfig(hook_points=["blocks.0.attn.hook_z"]))
    check_sharded_sites(heads, {"tensor_parallel_size": 1})
    with pytest.raises(SpecError, match="blocks.0.attn.hook_z.*tensor_parallel_size=2"):
        check_sharded_sites(heads, {"tensor_parallel_size": 2})


def gemma2_windowed(target: Path, tokenizer_dir: Path) -> Path:
    """A tiny Gemma 2 whose sliding window (4, on alternate layers) and logit soft-cap both act."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        vocab_size=49152,
        **TINY,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        sliding_window=4,
        tie_word_embeddings=True,
    )
    return build_tiny_model("Gemma2ForCausalLM", config, target, tokenizer_dir)


def hf_attention(path: Path, token_ids: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' eager attention weights per layer, [head, query, key]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), output_attentions=True)
    return tuple(layer[0] for layer in out.attentions)


PATTERN_PROMPT = PROMPT + " a little house in the woods"
PATTERNS = [f"blocks.{i}.attn.hook_pattern" for i in range(TINY["num_hidden_layers"])]


def check_patterns(engine, path: Path) -> None:
    """Every layer's pattern, prompt and generated rows, against transformers' eager attention."""
    out = engine.generate(PATTERN_PROMPT, max_tokens=4, capture={"hooks": PATTERNS})[0]
    ids = out.prompt_token_ids + out.token_ids[:-1]
    assert len(out.prompt_token_ids) > 8, "the prompt must reach past the sliding window"
    for layer, want in enumerate(hf_attention(path, ids)):
        got = out.activations[PATTERNS[layer]]
        assert got.shape == (len(ids), want.shape[0], len(ids))
        assert out.positions[PATTERNS[layer]] == list(range(len(ids)))
        error = float((got.permute(1, 0, 2) - want).abs().max())
        assert error < tolerance(), (layer, error)  # CPU 1e-4; compiled on a GPU 1.4e-4 was measured
    assert out.receipt["captures"] == dict.fromkeys(PATTERNS, len(ids))
    assert set(out.activations) == set(PATTERNS)  # the query and key they came from are not kept


def test_windowed_soft_capped_patterns_equal_transformers_eager_attention(tmp_path, vllm_ready, smollm2_dir):
    """Gemma 2 with a sliding window of 4 on alternate layers, a logit soft-cap and its own query
    scale (Llama's grouped-query heads: the next test); and a pattern's limits."""
    path = gemma2_windowed(tmp_path / "gemma2", smollm2_dir)
    settings = {"hook_points": PATTERNS, "capture_bytes_per_request": 500_000}
    with booted_engine(path, instrument=settings, **gpu_settings()) as engine:
        check_patterns(engine, path)
        with pytest.raises(Exception, match="positions 'all' or 'prompt'"):
            engine.generate(PATTERN_PROMPT, max_tokens=2, capture={"hooks": PATTERNS[:1], "positions": "generated"})
        with pytest.raises(Exception, match="captured only"):
            engine.generate(PATTERN_PROMPT, max_tokens=2, steering=[{"hook": PATTERNS[0], "op": "scale", "coef": 0.5}])
        with pytest.raises(Exception, match="capture_bytes_per_request"):
            engine.generate(PATTERN_PROMPT, max_tokens=200, capture={"hooks": PATTERNS})


def test_llama_patterns_equal_transformers_and_need_their_query_and_key_hooked(head_engine, tiny_llama_dir):
    from transformers import AutoConfig

    from inspect_tl_vllm.engine.frontend import Instrumentation
    from inspect_tl_vllm.specs import InstrumentConfig, SpecError, parse_request_spec

    check_patterns(head_engine, tiny_llama_dir)
    residual = Instrumentation(AutoConfig.from_pretrained(str(tiny_llama_dir)), InstrumentConfig(hook_points=["all"]))
    spec = parse_request_spec({"capture": {"hooks": ["blocks.1.attn.hook_pattern"]}})
    with pytest.raises(SpecError, match="blocks.1.attn.hook_rot_q and blocks.1.attn.hook_rot_k.*hook_points listing"):
        residual.prepare(spec, prompt_len=4, max_tokens=2)


def test_an_eval_stores_per_head_and_pattern_captures_beside_its_log(vllm_ready, tiny_llama_dir, tmp_path):
    """Through Inspect: `-M capture=` of a head hook point and a pattern, stored per sample and read
    back with the shapes the engine returned, and one Parquet row per position."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.solver import generate

    from conftest import PROVIDER_ARGS, environment
    from inspect_tl_vllm.store import activations

    pytest.importorskip("pyarrow")

    def run(capture: str, folder: str):  # one engine serves both evals (same engine settings)
        args = {**PROVIDER_ARGS, "hook_points": "blocks.1.attn.*", "capture": capture, "capture_reduce": "none"}
        args.update(gpu_provider_args())
        task = Task(
            dataset=[Sample(id="q1", input="Hello there")], solver=generate(), config=GenerateConfig(max_tokens=3)
        )
        with environment(TORCH_COMPILE_DISABLE="1"):
            log = eval(
                task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path / folder), display="none"
            )[0]
        assert log.status == "success", log.error
        return log

    from inspect_tl_vllm.provider.engine_pool import engines, shutdown_engines

    before = set(engines())
    try:
        log = run("blocks.1.attn.hook_z,blocks.1.attn.hook_pattern", "both")
        heads = run("blocks.1.attn.hook_z", "heads")
    finally:  # this test's own engine (its settings are no other test's); the others stay shared
        shutdown_engines([key for key in engines() if key not in before])
    (record,) = activations.load(log.location)
    z, pattern = record.activations["blocks.1.attn.hook_z"], record.activations["blocks.1.attn.hook_pattern"]
    rows = z.shape[0]
    assert z.shape == (rows, 2, 32) and pattern.shape == (rows, 2, rows)
    assert record.positions["blocks.1.attn.hook_pattern"] == list(range(rows))
    table = activations.arrow_reader(heads.location).read_all().to_pydict()
    assert table["position"] == list(range(rows))  # one row per position: heads x d_head numbers
    assert {len(vector) for vector in table["vector"]} == {64}
