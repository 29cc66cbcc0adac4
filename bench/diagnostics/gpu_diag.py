"""Where do compiled and eager differ on the GPU?  Plain vLLM (no instrumentation) compiled
vs eager greedy tokens, and per-hook captures of the instrumented eager engine against
transformers (bf16).  Usage: python bench/diagnostics/gpu_diag.py --out diag.json"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for gpu_check's prompts and report
from gpu_check import HOOKS, QUESTIONS, report  # noqa: E402

PROMPTS = QUESTIONS[:3]


def hook_reference(hf, acts: dict[str, torch.Tensor]) -> list:
    """Forward hooks on the transformers model that record the hook points of HOOKS."""

    def first(out):
        return (out[0] if isinstance(out, tuple) else out)[0]

    def keep(name):
        return lambda module, args, out: acts.__setitem__(name, first(out))

    def keep_input(module, args, kwargs):
        acts[HOOKS[0]] = (args[0] if args else kwargs["hidden_states"])[0]

    return [
        hf.model.layers[0].register_forward_pre_hook(keep_input, with_kwargs=True),
        hf.model.layers[10].register_forward_hook(keep(HOOKS[1])),
        hf.model.layers[25].mlp.register_forward_hook(keep(HOOKS[3])),
        hf.model.norm.register_forward_hook(keep(HOOKS[4])),
    ]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    import inspect_tl_vllm
    from inspect_tl_vllm.aliases import resolve_model

    path = resolve_model("smollm2")
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    out: dict = {}
    tokens = {}
    for mode, eager in (("compiled", False), ("eager", True)):
        llm = LLM(model=path, dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.2, enforce_eager=eager)
        tokens[mode] = [list(o.outputs[0].token_ids) for o in llm.chat(chats, params, use_tqdm=False)]
        del llm
    out["plain_vllm_compiled_vs_eager_tokens_equal"] = [
        a == b for a, b in zip(tokens["compiled"], tokens["eager"], strict=False)
    ]
    engine = inspect_tl_vllm.boot(
        "smollm2",
        instrument={"hook_points": HOOKS},
        dtype="bfloat16",
        max_model_len=1024,
        gpu_memory_utilization=0.2,
        enforce_eager=True,
    )
    got = engine.generate(chats, max_tokens=24, capture={"hooks": HOOKS})
    out["instrumented_eager_vs_plain_eager_tokens_equal"] = [
        g.token_ids == t for g, t in zip(got, tokens["eager"], strict=False)
    ]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    errs: dict[str, float] = {}
    for g in got:
        seq = g.prompt_token_ids + g.token_ids[:-1]
        acts: dict[str, torch.Tensor] = {}
        hs = hook_reference(hf, acts)
        with torch.no_grad():
            hf(torch.tensor([seq], device="cuda"))
        for h in hs:
            h.remove()
        for hook, ref in acts.items():
            e = float((g.activations[hook].float() - ref.float().cpu()).norm() / ref.float().norm())
            errs[hook] = max(errs.get(hook, 0.0), e)
    out["instrumented_eager_vs_hf_bf16_max_rel_err"] = errs
    report(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
