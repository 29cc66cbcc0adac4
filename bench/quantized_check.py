"""Steering and capture on quantized weights and under a LoRA adapter, on the GPU (compiled engine):

    python bench/quantized_check.py --modes fp8,gptq,lora [--model smollm2] [--out results.json]

``fp8``: vLLM quantizes the weights as it loads them; ``gptq``: a 4-bit GPTQ checkpoint of the
model made here (``checkpoints.py``, round-to-nearest); ``lora``: a random rank-16 adapter on every
projection.  For each, in an engine of its own (hook points ``all`` and ``blocks.*.attn.hook_z``):

1. every hook fired during warm-up (the engine boots only then) and the engine answers;
2. an ``add`` at ``blocks.L.hook_resid_post`` lands: the prompt rows captured there, steered
   minus plain, equal coef x vector, within the dtype's rounding of the plain row, the vector and
   their sum, plus what two plain runs differ by (quantized kernels need not be deterministic);
3. zero-ablating one head at ``blocks.L.attn.hook_z`` zeroes that head's rows and changes the other
   heads' rows by no more than two plain runs differ;
4. steering changes the greedy answer (the edit reaches the output).

Whether the instrumented engine's greedy tokens equal vanilla vLLM's with the same quantization or
adapter is measured by ``throughput.py`` (``agreement``), beside the speed.  Exits non-zero if a
check fails.  (The CPU build runs none of these quantized kernels: this runs on a GPU only.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = "Write a short story about a lighthouse keeper."
COEF = 8.0
EPS = {"bfloat16": 2.0**-8, "float16": 2.0**-11}
"""One rounding of a value in the dtype is at most this times its size."""


def engine_settings(mode: str, model: str, scratch: Path) -> tuple[str, dict[str, Any]]:
    """The model path and engine arguments for one mode."""
    from checkpoints import write_gptq, write_lora  # bench/ is on sys.path (this file's folder)
    from transformers import AutoConfig, AutoModelForCausalLM

    from inspect_tl_vllm.aliases import resolve_model

    path = resolve_model(model)
    settings: dict[str, Any] = {"gpu_memory_utilization": 0.3, "max_model_len": 512}
    if mode == "fp8":
        return path, {**settings, "quantization": "fp8", "dtype": "bfloat16"}
    if mode == "gptq":
        target = scratch / f"{Path(path).name}-gptq"
        write_gptq(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16), target, 64, Path(path))
        return str(target), {**settings, "dtype": "float16"}
    adapter = scratch / f"{Path(path).name}-lora"
    write_lora(AutoConfig.from_pretrained(path), adapter, 16)
    return path, {**settings, "dtype": "bfloat16", "lora": str(adapter)}


def check_mode(mode: str, model: str, scratch: Path) -> dict[str, Any]:
    import inspect_tl_vllm

    path, settings = engine_settings(mode, model, scratch)
    started = time.perf_counter()
    engine = inspect_tl_vllm.boot(path, instrument={"hook_points": ["all", "blocks.*.attn.hook_z"]}, **settings)
    result: dict[str, Any] = {"boot_s": round(time.perf_counter() - started, 1), "engine_args": settings}
    config = engine.llm.llm_engine.vllm_config
    result["quantization"] = str(config.model_config.quantization)
    layers = config.model_config.hf_text_config.num_hidden_layers
    layer = layers // 2
    hook, z_hook = f"blocks.{layer}.hook_resid_post", f"blocks.{layer}.attn.hook_z"
    width = engine.hidden_size
    vector = torch.randn(width, generator=torch.Generator().manual_seed(1))
    vector = vector / vector.norm() * 8.0
    capture = {"hooks": [hook, z_hook], "positions": "prompt"}
    prompt = [{"role": "user", "content": PROMPT}]
    plain = engine.generate(prompt, max_tokens=24, capture=capture)[0]
    again = engine.generate(prompt, max_tokens=24, capture=capture)[0]  # the kernels' own run-to-run noise
    steer = [{"hook": hook, "vector": vector.tolist(), "coef": COEF}]
    steered = engine.generate(prompt, max_tokens=24, capture=capture, steering=steer)[0]
    ablate = [{"hook": z_hook, "op": "scale", "coef": 0.0, "heads": [1]}]
    ablated = engine.generate(prompt, max_tokens=24, capture=capture, steering=ablate)[0]
    x = plain.activations[hook].float()
    noise = float((again.activations[hook].float() - x).norm(dim=-1).max())
    y = steered.activations[hook].float()
    miss = (y - x - COEF * vector).norm(dim=-1)  # per prompt row
    # the engine rounds the vector, the sum and the plain row it is compared with, each in the dtype
    rounding = (x.norm(dim=-1) + y.norm(dim=-1) + COEF * vector.norm()) * EPS[settings["dtype"]]
    z_plain, z_again, z_ablated = (r.activations[z_hook].float() for r in (plain, again, ablated))
    result.update(
        steer_miss_max=float(miss.max()),
        steer_miss_over_rounding=float((miss / rounding).max()),
        steer_norm=COEF * float(vector.norm()),
        resid_row_norm_median=float(x.norm(dim=-1).median()),
        run_to_run_resid_max=noise,
        head_zeroed=bool((z_ablated[:, 1] == 0).all()),
        other_heads_max_abs_diff=float((z_ablated[:, :1] - z_plain[:, :1]).abs().max()),
        run_to_run_z_max=float((z_again - z_plain).abs().max()),
        steered_answer_differs=steered.token_ids != plain.token_ids,
        plain_text=plain.text[:120],
        steered_text=steered.text[:120],
    )
    failures = []
    if bool((miss - noise > rounding).any()):
        failures.append(f"steering at {hook} did not land as coef x vector (off by {float(miss.max()):.3g})")
    if not result["head_zeroed"]:
        failures.append(f"zero-ablating head 1 at {z_hook} left non-zero rows")
    if result["other_heads_max_abs_diff"] > result["run_to_run_z_max"]:
        failures.append(f"ablating head 1 changed head 0 at {z_hook} by more than two plain runs differ")
    if not result["steered_answer_differs"]:
        failures.append("steering did not change the greedy answer")
    result["failures"] = failures
    engine.llm.llm_engine.engine_core.shutdown()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="fp8,gptq,lora")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--scratch", default="/tmp/tlvllm-quantized")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": args.model}
    failed = False
    for mode in args.modes.split(","):
        try:
            summary[mode] = check_mode(mode, args.model, scratch)
        except Exception as err:  # report and go on: one mode failing must not hide the others
            summary[mode] = {"failures": [f"{type(err).__name__}: {err}"[:2000]]}
        failed |= bool(summary[mode]["failures"])
        print(f"[quantized_check] {mode}: {json.dumps(summary[mode])}", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
