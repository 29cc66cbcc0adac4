"""A LoRA adapter served through vLLM's LoRA layers: every hook point sees the adapted model.

The reference is transformers on the same base weights with the adapter merged in
(W + alpha/r * B A): captures at the residual, per-head and neuron hook points, greedy tokens,
and steering on top of the adapter must equal it (fp32).  Folders vLLM must not or cannot use
are refused by name before an engine boots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import booted_engine, gpu_provider_args, gpu_settings, on_gpu, tolerance
from hf_reference import hf_activations, hf_greedy, hf_inner_activations, load_hf

RANK, ALPHA = 4, 8
TARGETS = ("q_proj", "v_proj", "o_proj", "down_proj")
PROMPT = "Once upon a time there was"


def _module(layer: torch.nn.Module, name: str) -> torch.nn.Linear:
    return getattr(layer.mlp if name == "down_proj" else layer.self_attn, name)


@pytest.fixture(scope="module")
def adapter_and_merged(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A PEFT-format adapter (safetensors) for the tiny Llama, and the tiny Llama with it merged."""
    from safetensors.torch import save_file

    hf = load_hf(tiny_llama_dir)
    adapter = tmp_path_factory.mktemp("adapter")
    generator = torch.Generator().manual_seed(11)
    tensors = {}
    for i, layer in enumerate(hf.model.layers):
        for name in TARGETS:
            linear = _module(layer, name)
            a = torch.randn(RANK, linear.in_features, generator=generator) * 0.2
            b = torch.randn(linear.out_features, RANK, generator=generator) * 0.2
            part = "mlp" if name == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{i}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"] = a, b
            with torch.no_grad():
                linear.weight += (ALPHA / RANK) * b @ a
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(TARGETS), "bias": "none"}
    config.update(base_model_name_or_path=str(tiny_llama_dir), task_type="CAUSAL_LM", lora_dropout=0.0)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    merged = tmp_path_factory.mktemp("merged")
    hf.save_pretrained(str(merged))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_llama_dir / name, merged / name)
    return adapter, merged


def lora_settings() -> dict:
    """The CPU engine in float32; on a GPU compiled in bfloat16 (vLLM's LoRA kernels there take no float32)."""
    return {**gpu_settings(), "dtype": "bfloat16"} if on_gpu() else {}


def lora_tolerance() -> float:
    return 5e-2 if on_gpu() else tolerance()  # bfloat16 through three layers against float32


@pytest.mark.engine
def test_an_adapted_model_equals_the_merged_model_at_every_hook_point(vllm_ready, tiny_llama_dir, adapter_and_merged):
    adapter, merged = adapter_and_merged
    hf = load_hf(merged)
    settings = {"hook_points": ["all", "blocks.*.attn.hook_q", "blocks.*.attn.hook_v", "blocks.*.mlp.hook_post"]}
    with booted_engine(tiny_llama_dir, instrument=settings, lora=str(adapter), **lora_settings()) as engine:
        hooks = sorted({site.name for site in engine.core.instrumentation.sites.values()})
        out = engine.generate(PROMPT, max_tokens=6, capture={"hooks": hooks})[0]
        ids = out.prompt_token_ids + out.token_ids[:-1]
        reference = {**hf_activations(hf, ids), **hf_inner_activations(hf, ids)}
        errors = {h: float((out.activations[h] - reference[h]).norm() / reference[h].norm()) for h in hooks}
        assert max(errors.values()) < lora_tolerance(), errors
        if not on_gpu():  # in bfloat16 a near tie of the random model may go either way
            assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 6)
        # without the adapter the same weights answer otherwise: the adapter really ran
        base = load_hf(tiny_llama_dir)
        unadapted = hf_activations(base, ids)["blocks.2.hook_resid_post"]
        assert (unadapted - reference["blocks.2.hook_resid_post"]).abs().max() > 1e-2

        torch.manual_seed(5)
        vector = torch.randn(64)
        steered = engine.generate(
            PROMPT,
            max_tokens=8,
            steering=[{"hook": "blocks.1.hook_resid_post", "vector": vector.tolist(), "coef": 4.0}],
        )[0]
        if not on_gpu():
            edit = lambda x: x + 4.0 * vector  # noqa: E731
            assert steered.token_ids == hf_greedy(hf, out.prompt_token_ids, 8, edit=edit, layer=1)
        assert steered.token_ids[: len(out.token_ids)] != out.token_ids  # the steering reached the answer


def test_adapter_folders_vllm_must_not_or_cannot_use_are_refused(tmp_path, adapter_and_merged):
    from inspect_tl_vllm.engine.adapters import check_lora_dtype, read_adapter
    from inspect_tl_vllm.provider.model_args import parse_model_args
    from inspect_tl_vllm.specs import SpecError

    adapter, _ = adapter_and_merged
    assert read_adapter(adapter).rank == RANK and read_adapter(adapter).engine_args()["max_lora_rank"] == 8
    with pytest.raises(SpecError, match="no such folder"):
        read_adapter(tmp_path / "missing")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapter / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SpecError, match="adapter_model.bin is pickled"):
        read_adapter(pickled)
    for rank in (0, 513, "8", True):
        bad = tmp_path / f"rank-{rank}"
        shutil.copytree(adapter, bad)
        (bad / "adapter_config.json").write_text(json.dumps({"r": rank}))
        with pytest.raises(SpecError, match="rank r="):
            read_adapter(bad)
    with pytest.raises(SpecError, match="-M lora=.*no such folder"):
        parse_model_args({"lora": str(tmp_path / "missing")})
    with pytest.raises(SpecError, match="enable_lora: give the adapter as lora"):
        parse_model_args({"engine_args": '{"enable_lora": true}'})
    with pytest.raises(SpecError, match="max_lora_rank: set by tl-vllm"):
        parse_model_args({"lora": str(adapter), "engine_args": '{"max_lora_rank": 64}'})
    check_lora_dtype(read_adapter(adapter), {"dtype": "float32"}, on_gpu=False)  # the CPU build takes float32
    with pytest.raises(SpecError, match="LoRA kernels on a GPU take bfloat16"):  # measured on an H100
        check_lora_dtype(read_adapter(adapter), {"dtype": "float32"}, on_gpu=True)
    # the engine key, and so Inspect's cache key, changes with the adapter's weights
    before = parse_model_args({"lora": str(adapter)}).fingerprint("m")
    changed = tmp_path / "changed"
    shutil.copytree(adapter, changed)
    (changed / "adapter_model.safetensors").write_bytes((adapter / "adapter_model.safetensors").read_bytes() + b" ")
    assert parse_model_args({"lora": str(changed)}).fingerprint("m") != before


@pytest.mark.engine
def test_an_eval_with_m_lora_answers_as_the_merged_model(vllm_ready, tiny_llama_dir, adapter_and_merged, tmp_path):
    """``-M lora=DIR``: the provider's engine serves the adapter to every sample (its greedy answer is
    the merged model's), and the capture stored for the sample is the adapted model's."""
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.solver import generate

    from conftest import PROVIDER_ARGS, environment
    from inspect_tl_vllm.provider.engine_pool import engines, shutdown_engines
    from inspect_tl_vllm.store import activations

    adapter, merged = adapter_and_merged
    hook = "blocks.2.hook_resid_post"
    args = {**PROVIDER_ARGS, "lora": str(adapter), "capture": hook, "capture_reduce": "none", **gpu_provider_args()}
    if on_gpu():
        args["dtype"] = "bfloat16"
    config = GenerateConfig(max_tokens=5, temperature=0.0)
    task = Task(dataset=[Sample(id="s", input=PROMPT)], solver=generate(), config=config)
    before = set(engines())
    try:
        with environment(TORCH_COMPILE_DISABLE="1"):
            model = f"tl-vllm/{tiny_llama_dir}"
            log = eval(task, model=model, model_args=args, log_dir=str(tmp_path), display="none")[0]
    finally:  # this test's own engine; the others stay shared
        shutdown_engines([key for key in engines() if key not in before])
    assert log.status == "success", log.error
    (record,) = activations.load(log.location)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompt_ids = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    hf = load_hf(merged)
    rows = record.activations[hook][: len(prompt_ids)]
    want = hf_activations(hf, prompt_ids)[hook]
    assert float((rows - want).norm() / want.norm()) < lora_tolerance()
    if not on_gpu():
        answer = tokenizer.decode(hf_greedy(hf, prompt_ids, 5), skip_special_tokens=True)
        assert log.samples[0].output.completion.strip() == answer.strip()
