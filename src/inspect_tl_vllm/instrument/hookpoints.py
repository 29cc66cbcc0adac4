"""Hook points per architecture: where each TransformerLens-style name lives in vLLM's model.

vLLM folds each residual add into the next RMSNorm (a decoder layer returns
``(hidden_states, residual)`` whose sum is the residual stream).  Every hook point here is
placed so that its value equals the Hugging Face tensor named in docs/HOOKPOINTS.md:

- ``resid_pre`` of layer 0: the input of layer 0 (embeddings, scaled for Gemma).
- ``resid_pre`` of layer i > 0: the same tensor as ``resid_post`` of layer i-1, so both
  names share one site (one buffer, one hook).
- ``resid_post``: ``hidden_states + residual`` after the layer, handed on as
  ``(resid, zeros)`` so the next fused add-norm sees the edited stream exactly.
- ``resid_mid``: the fused add-norm between attention and MLP gets ``(resid_mid, zeros)``.
- ``attn_out`` / ``mlp_out``: the tensor the block adds to the residual stream (for Gemma,
  after the post-attention / post-feedforward norm).
- ``ln_final.hook_normalized``: the output of the final norm, weight included.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal

from inspect_tl_vllm.specs import BLOCK_HOOKS, FINAL_HOOK, SpecError, parse_hook_point

SiteKind = Literal["layer_in", "layer_out", "norm_in", "module_out", "final_norm_out"]


@dataclass(frozen=True)
class ArchLayout:
    """Names of the submodules (inside one decoder layer) that carry each hook point."""

    resid_mid_norm: str
    attn_out_module: str
    mlp_out_module: str


_LLAMA_LIKE = ArchLayout("post_attention_layernorm", "self_attn", "mlp")
_GEMMA_LIKE = ArchLayout("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")

ARCHITECTURES: dict[str, ArchLayout] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Phi3ForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Gemma2ForCausalLM": _GEMMA_LIKE,
    "Gemma3ForCausalLM": _GEMMA_LIKE,
    # Mixture-of-experts blocks: mlp_out is the weighted sum of the chosen experts' outputs.
    "MixtralForCausalLM": ArchLayout("post_attention_layernorm", "self_attn", "block_sparse_moe"),
    "OlmoeForCausalLM": _LLAMA_LIKE,
    "Qwen3MoeForCausalLM": _LLAMA_LIKE,
}


def layout_for(architecture: str) -> ArchLayout:
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise SpecError(
            f"architecture {architecture!r} is not supported by the instrumentation; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


@dataclass(frozen=True)
class Site:
    """One place in the model where the hook math runs; several names may share it."""

    index: int
    name: str
    kind: SiteKind
    layer: int | None
    module: str | None


def all_hook_points(num_layers: int) -> list[str]:
    names = [f"blocks.{i}.{hook}" for i in range(num_layers) for hook in BLOCK_HOOKS]
    return [*names, FINAL_HOOK]


def canonical_hook_point(name: str, num_layers: int) -> str:
    """The site name for a hook point (``resid_pre`` of i>0 is ``resid_post`` of i-1)."""
    layer, kind = parse_hook_point(name)
    if layer is not None and layer >= num_layers:
        raise SpecError(f"hook point {name!r}: layer {layer} does not exist (the model has {num_layers} layers)")
    if kind == "resid_pre" and layer:
        return f"blocks.{layer - 1}.hook_resid_post"
    return name


def expand_patterns(patterns: list[str], num_layers: int) -> list[str]:
    """Engine hook point patterns ('*' wildcards, 'all') -> concrete names, model order."""
    every = all_hook_points(num_layers)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == "all":
            chosen.update(every)
            continue
        matched = fnmatch.filter(every, pattern)
        if not matched:
            canonical_hook_point(pattern, num_layers)  # raises a precise error for bad names
            raise SpecError(f"hook_points: pattern {pattern!r} matches no hook point of this model")
        chosen.update(matched)
    return [name for name in every if name in chosen]


def build_sites(layout: ArchLayout, num_layers: int, patterns: list[str]) -> dict[str, Site]:
    """Map every enabled hook point name to its Site; names that alias share one Site."""
    by_canonical: dict[str, Site] = {}
    table: dict[str, Site] = {}
    for name in expand_patterns(patterns, num_layers):
        canon = canonical_hook_point(name, num_layers)
        site = by_canonical.get(canon)
        if site is None:
            site = _make_site(len(by_canonical), canon, layout)
            by_canonical[canon] = site
        table[name] = site
        table[canon] = site
    return table


def _make_site(index: int, name: str, layout: ArchLayout) -> Site:
    layer, kind = parse_hook_point(name)
    if kind == "ln_final":
        return Site(index, name, "final_norm_out", None, "norm")
    if kind == "resid_pre":
        return Site(index, name, "layer_in", layer, None)
    if kind == "resid_post":
        return Site(index, name, "layer_out", layer, None)
    if kind == "resid_mid":
        return Site(index, name, "norm_in", layer, layout.resid_mid_norm)
    module = layout.attn_out_module if kind == "attn_out" else layout.mlp_out_module
    return Site(index, name, "module_out", layer, module)
