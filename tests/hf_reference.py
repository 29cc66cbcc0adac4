"""Reference values from Hugging Face transformers on the same weights, via forward hooks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def load_hf(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _first(x: object) -> torch.Tensor:
    return x[0] if isinstance(x, tuple) else x  # type: ignore[index,return-value]


GEMMA_LIKE = ("gemma2", "gemma3_text")


def hf_activations(model, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Every hook point's value (rows = positions) for one forward over ``token_ids``.

    attn_out / mlp_out are the tensors each block adds to the residual stream: the outputs of
    ``self_attn`` / ``mlp``, or for Gemma of ``post_attention_layernorm`` / ``post_feedforward_layernorm``.
    """
    acts: dict[str, torch.Tensor] = {}
    handles = []
    layers = model.model.layers
    gemma = model.config.model_type in GEMMA_LIKE

    def keep(name: str, pre: bool = False) -> Callable:
        if pre:
            return lambda mod, args, kwargs: acts.__setitem__(name, (args[0] if args else kwargs["hidden_states"])[0])
        return lambda mod, args, out: acts.__setitem__(name, _first(out)[0])

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(keep(f"blocks.{i}.hook_resid_pre", pre=True), with_kwargs=True))
        handles.append(layer.register_forward_hook(keep(f"blocks.{i}.hook_resid_post")))
        attn = layer.post_attention_layernorm if gemma else layer.self_attn
        mlp = layer.post_feedforward_layernorm if gemma else layer.mlp
        handles.append(attn.register_forward_hook(keep(f"blocks.{i}.hook_attn_out")))
        handles.append(mlp.register_forward_hook(keep(f"blocks.{i}.hook_mlp_out")))
    handles.append(model.model.norm.register_forward_hook(keep("ln_final.hook_normalized")))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    for i in range(len(layers)):
        acts[f"blocks.{i}.hook_resid_mid"] = acts[f"blocks.{i}.hook_resid_pre"] + acts[f"blocks.{i}.hook_attn_out"]
    return acts


def hf_greedy(
    model,
    token_ids: list[int],
    steps: int,
    edit: Callable[[torch.Tensor], torch.Tensor] | None = None,
    layer: int | None = None,
) -> list[int]:
    """Greedy tokens, with ``edit`` applied to the output of decoder layer ``layer`` at every position."""
    handle = None
    if edit is not None:
        handle = model.model.layers[layer].register_forward_hook(
            lambda mod, args, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
        )
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([token_ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    finally:
        if handle is not None:
            handle.remove()
    return out[0, len(token_ids) :].tolist()
