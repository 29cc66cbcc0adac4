"""Quantized checkpoints and LoRA adapters for the quantized and adapted runs, made here (no download):

    python bench/checkpoints.py gptq SRC DST [--group-size 128]  # SRC: a model folder, an alias or a
                                                                 # throughput.py shape (random weights)
    python bench/checkpoints.py lora SRC DST [--rank 16]         # a random LoRA adapter for SRC's shapes

GPTQ: the layout is AutoGPTQ's (symmetric, no act-order), which vLLM loads as ``quantization="gptq"``
(Marlin on a GPU where the shapes allow it, its CPU kernel on CPU): each projection's weight W
[out, in] becomes ``qweight`` [in/8, out] int32 (eight 4-bit values per int, along the input),
``scales`` [in/g, out], ``qzeros`` [in/g, out/8] (the zero point 8, stored minus one as the format
does) and ``g_idx`` [in].  Round-to-nearest instead of GPTQ's error-compensating solve: the kernels
and layout are GPTQ's, the accuracy is not (nothing here measures accuracy).  ``dequantized``
leaves the weights the kernels compute with in the model, for a reference.

LoRA: a PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) on every attention and
MLP projection of a Llama-like model, A and B normal with std 0.02 (B not zero, so the adapter
changes the outputs), alpha = 2 x rank.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BITS, ZERO = 4, 8


def quantize(weight: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """GPTQ tensors of one [out, in] weight, and the weight they stand for."""
    w = weight.detach().float().t().contiguous()  # [in, out]
    n_in, n_out = w.shape
    if n_in % group_size or n_in % 8 or n_out % 8:
        raise ValueError(f"a [{n_out}, {n_in}] weight does not split into groups of {group_size} and packs of 8")
    groups = w.reshape(n_in // group_size, group_size, n_out)
    scales = (groups.abs().amax(dim=1) / (2 ** (BITS - 1) - 1)).clamp_min(1e-8).to(torch.float16)
    q = torch.clamp(torch.round(groups / scales.float()[:, None, :]) + ZERO, 0, 2**BITS - 1).to(torch.int64)
    q = q.reshape(n_in, n_out)
    packed = torch.zeros(n_in // 8, n_out, dtype=torch.int64)
    for j in range(8):
        packed |= q[j::8] << (BITS * j)
    zeros = sum((ZERO - 1) << (BITS * j) for j in range(8))
    tensors = {
        "qweight": _as_int32(packed),
        "qzeros": torch.full((n_in // group_size, n_out // 8), zeros, dtype=torch.int64).to(torch.int32),
        "scales": scales,
        "g_idx": (torch.arange(n_in) // group_size).to(torch.int32),
    }
    stands_for = (q - ZERO).float().reshape(n_in // group_size, group_size, n_out) * scales.float()[:, None, :]
    return tensors, stands_for.reshape(n_in, n_out).t().contiguous()


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> the same bits as int32."""
    return torch.where(values >= 2**31, values - 2**32, values).to(torch.int32)


def write_gptq(model: Any, target: Path, group_size: int, tokenizer_dir: Path | None = None) -> Any:
    """Save ``model`` (a transformers causal LM) as a GPTQ checkpoint in ``target``; the model's
    projections are replaced in place by the weights the checkpoint stands for (a reference)."""
    from safetensors.torch import save_file

    target.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, stands_for = quantize(module.weight, group_size)
            tensors.update({f"{name}.{key}": value for key, value in parts.items()})
            with torch.no_grad():
                module.weight.copy_(stands_for.to(module.weight.dtype))
            quantized.add(f"{name}.weight")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, value in model.state_dict().items():
        if name in quantized or (tied and name == "lm_head.weight"):
            continue
        tensors[name] = value.detach().to(torch.float16).contiguous().clone()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["torch_dtype"] = "float16"
    config.pop("dtype", None)
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": BITS,
        "group_size": group_size,
        "desc_act": False,
        "sym": True,
        "damp_percent": 0.01,
        "static_groups": False,
        "true_sequential": True,
    }
    (target / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer_dir is not None:
        for file in Path(tokenizer_dir).iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", "generation")):
                shutil.copy(file, target / file.name)
    return model


def write_lora(config: Any, target: Path, rank: int, seed: int = 0) -> None:
    """A random PEFT LoRA adapter for every projection of a Llama-like model with ``config``."""
    from safetensors.torch import save_file

    d_model, d_mlp = config.hidden_size, config.intermediate_size
    d_head = getattr(config, "head_dim", None) or d_model // config.num_attention_heads
    q_width = config.num_attention_heads * d_head
    kv_width = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * d_head
    shapes = {  # (in, out) of each projection
        "self_attn.q_proj": (d_model, q_width),
        "self_attn.k_proj": (d_model, kv_width),
        "self_attn.v_proj": (d_model, kv_width),
        "self_attn.o_proj": (q_width, d_model),
        "mlp.gate_proj": (d_model, d_mlp),
        "mlp.up_proj": (d_model, d_mlp),
        "mlp.down_proj": (d_mlp, d_model),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name, (n_in, n_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.02
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16) for k, v in tensors.items()}, str(target / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0}
    adapter.update(bias="none", target_modules=sorted({name.split(".")[1] for name in shapes}))
    (target / "adapter_config.json").write_text(json.dumps(adapter, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=["gptq", "lora"])
    parser.add_argument("source", help="a Hugging Face model folder, an alias (smollm2), or a throughput.py shape")
    parser.add_argument("target")
    parser.add_argument("--group-size", type=int, default=128, help="gptq: input columns per scale")
    parser.add_argument("--rank", type=int, default=16, help="lora: the adapter's rank")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    from inspect_tl_vllm.aliases import resolve_model

    target = Path(args.target)
    if args.source.endswith("-shape"):
        from throughput import model_dir  # bench/ is on sys.path (this file's folder)

        source, _ = model_dir(args.source, target.parent)
    else:
        source = resolve_model(args.source)
    config = AutoConfig.from_pretrained(source)
    if args.kind == "lora":
        write_lora(config, target, args.rank)
        print(f"checkpoints: LoRA adapter of rank {args.rank} for {args.source} in {target}")
        return 0
    torch.manual_seed(0)
    if args.source.endswith("-shape"):  # transformers' init: normal(0, 0.02), norm weights 1
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float16)
    write_gptq(model, target, args.group_size, Path(source))
    print(f"checkpoints: GPTQ (4 bits, groups of {args.group_size}, round-to-nearest) of {args.source} in {target}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
