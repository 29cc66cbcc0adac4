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

Per-head and neuron hook points (enabled by name or pattern only; ``all`` means the residual-width
ones above) sit inside the attention and the dense MLP of dense families:

- ``attn.hook_q`` / ``attn.hook_k``: the query and key projections (their part of the fused qkv
  projection's output; before Qwen3's and Gemma 3's q/k norms and the rotary embedding, which
  vLLM shares between layers, so it carries no per-layer hook); ``attn.hook_rot_q`` /
  ``hook_rot_k`` / ``hook_v``: the query and key after the norms and the rotary embedding, and
  the value, as the attention op receives them; ``attn.hook_z``: the attention's output per head,
  entering the output projection.  Rows are heads x d_head wide (key and value: the model's
  key-value heads).
- ``mlp.hook_pre``: the gate projection (before its activation); ``mlp.hook_post``: the gated
  activation entering the down projection.  Rows are d_mlp wide.
- ``mlp.hook_router_logits`` (mixture-of-experts blocks): the router's logits, one per expert; the
  block routes each token to their top k, so steering them moves the routing.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Literal

from inspect_tl_vllm.specs import BLOCK_HOOKS, FINAL_HOOK, INNER_HOOKS, SpecError, is_pattern, parse_hook_point

SiteKind = Literal[
    "layer_in", "layer_out", "norm_in", "module_out", "final_norm_out", "arg_in", "columns_in", "columns_out"
]


@dataclass(frozen=True)
class ArchLayout:
    """Names of the submodules (inside one decoder layer) that carry each hook point.

    ``router`` names a mixture-of-experts block's router (None for a dense MLP, whose neurons have
    hook points of their own)."""

    resid_mid_norm: str
    attn_out_module: str
    mlp_out_module: str
    router: str | None = None


_LLAMA_LIKE = ArchLayout("post_attention_layernorm", "self_attn", "mlp")
_GEMMA_LIKE = ArchLayout("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")
_MOE = ArchLayout("post_attention_layernorm", "self_attn", "mlp", router="mlp.gate")

ARCHITECTURES: dict[str, ArchLayout] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Phi3ForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Gemma2ForCausalLM": _GEMMA_LIKE,
    "Gemma3ForCausalLM": _GEMMA_LIKE,
    # Mixture-of-experts blocks: mlp_out is the weighted sum of the chosen experts' outputs.
    "MixtralForCausalLM": ArchLayout(
        "post_attention_layernorm", "self_attn", "block_sparse_moe", router="block_sparse_moe.gate"
    ),
    "OlmoeForCausalLM": _MOE,
    "Qwen3MoeForCausalLM": _MOE,
}

# Per-head and neuron hook points: (kind, submodule of the decoder layer). vLLM's dense families
# share these names: self_attn.{qkv_proj, attn, o_proj}, mlp.act_fn.  ``_site_arg`` says which
# argument, or the first column of the part of a fused tensor, carries each.
_INNER_SITES: dict[str, tuple[SiteKind, str]] = {
    "attn.q": ("columns_out", "self_attn.qkv_proj"),  # [q | k | v]
    "attn.k": ("columns_out", "self_attn.qkv_proj"),
    "attn.rot_q": ("arg_in", "self_attn.attn"),  # attn(q, k, v)
    "attn.rot_k": ("arg_in", "self_attn.attn"),
    "attn.v": ("arg_in", "self_attn.attn"),
    "attn.z": ("arg_in", "self_attn.o_proj"),
    "mlp.pre": ("columns_in", "mlp.act_fn"),  # act_fn([gate | up]): the gate half
    "mlp.post": ("module_out", "mlp.act_fn"),
    "mlp.router_logits": ("columns_out", ""),  # the router's linear layer returns (logits, bias)
}


def _site_arg(kind: str, shape: ModelShape) -> int:
    if kind == "attn.k":
        return shape.n_heads * shape.d_head  # the key follows the query in the fused projection
    return {"attn.rot_k": 1, "attn.v": 2}.get(kind, 0)


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set each hook point's width (from the model's text config)."""

    num_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    n_experts: int = 0

    @classmethod
    def of(cls, config: object) -> ModelShape:
        d_model = int(config.hidden_size)  # type: ignore[attr-defined]
        n_heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        d_head = getattr(config, "head_dim", None) or d_model // n_heads
        return cls(
            num_layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(getattr(config, "num_key_value_heads", None) or n_heads),
            d_head=int(d_head),
            d_mlp=int(getattr(config, "intermediate_size", 0) or 0),
            n_experts=int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0),
        )

    def heads(self, kind: str) -> int:
        """Heads of a per-head hook point's kind (0 for the others)."""
        if kind in ("attn.k", "attn.rot_k", "attn.v"):
            return self.n_kv_heads
        return self.n_heads if kind.startswith("attn.") else 0

    def width(self, kind: str) -> int:
        """Numbers per token row at a hook point of this kind."""
        if kind.startswith("attn."):
            return self.heads(kind) * self.d_head
        if kind == "mlp.router_logits":
            return self.n_experts
        return self.d_mlp if kind.startswith("mlp.") else self.d_model


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
    """One place in the model where the hook math runs; several names may share it.

    ``module`` is a dotted path inside the decoder layer; ``arg`` the argument that carries the
    hook point, or for a part of a fused tensor its first column; ``width`` its numbers per token
    row and ``heads`` its attention heads (0 unless per head)."""

    index: int
    name: str
    kind: SiteKind
    layer: int | None
    module: str | None
    width: int
    heads: int = 0
    arg: int = 0


def all_hook_points(num_layers: int) -> list[str]:
    """Every residual-width hook point (what ``all`` enables), model order."""
    names = [f"blocks.{i}.{hook}" for i in range(num_layers) for hook in BLOCK_HOOKS]
    return [*names, FINAL_HOOK]


def every_hook_point(num_layers: int) -> list[str]:
    """Every hook point, per-head and neuron ones included (what patterns match), model order."""
    hooks = BLOCK_HOOKS + INNER_HOOKS
    return [*(f"blocks.{i}.{hook}" for i in range(num_layers) for hook in hooks), FINAL_HOOK]


def pattern_sources(name: str) -> tuple[str, str]:
    """The hook points an attention pattern is computed from: that block's rotated query and key."""
    block = name.removesuffix("hook_pattern")
    return block + "hook_rot_q", block + "hook_rot_k"


def canonical_hook_point(name: str, num_layers: int) -> str:
    """The site name for a hook point (``resid_pre`` of i>0 is ``resid_post`` of i-1)."""
    layer, kind = parse_hook_point(name)
    if layer is not None and layer >= num_layers:
        raise SpecError(f"hook point {name!r}: layer {layer} does not exist (the model has {num_layers} layers)")
    if kind == "resid_pre" and layer:
        return f"blocks.{layer - 1}.hook_resid_post"
    return name


def expand_patterns(patterns: list[str], num_layers: int) -> list[str]:
    """Engine hook point patterns ('*' wildcards, 'all') -> concrete names, model order.

    ``all`` is every residual-width hook point; per-head and neuron ones are named or matched
    by a pattern (``blocks.*.attn.hook_z``), since each costs a buffer of its own width."""
    every = every_hook_point(num_layers)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == "all":
            chosen.update(all_hook_points(num_layers))
            continue
        matched = fnmatch.filter(every, pattern)
        if not matched:
            canonical_hook_point(pattern, num_layers)  # raises a precise error for bad names
            raise SpecError(f"hook_points: pattern {pattern!r} matches no hook point of this model")
        chosen.update(matched)
    for name in [name for name in chosen if is_pattern(name)]:  # a pattern needs its query and key, no site
        chosen.discard(name)
        chosen.update(pattern_sources(name))
    return [name for name in every if name in chosen]


def build_sites(layout: ArchLayout, shape: ModelShape, patterns: list[str], architecture: str = "") -> dict[str, Site]:
    """Map every enabled hook point name to its Site; names that alias share one Site."""
    by_canonical: dict[str, Site] = {}
    table: dict[str, Site] = {}
    for name in expand_patterns(patterns, shape.num_layers):
        canon = canonical_hook_point(name, shape.num_layers)
        site = by_canonical.get(canon)
        if site is None:
            site = _make_site(len(by_canonical), canon, layout, shape, architecture)
            by_canonical[canon] = site
        table[name] = site
        table[canon] = site
    return table


def _make_site(index: int, name: str, layout: ArchLayout, shape: ModelShape, architecture: str) -> Site:
    layer, kind = parse_hook_point(name)
    width = shape.width(kind)
    if kind == "ln_final":
        return Site(index, name, "final_norm_out", None, "norm", width)
    if kind == "resid_pre":
        return Site(index, name, "layer_in", layer, None, width)
    if kind == "resid_post":
        return Site(index, name, "layer_out", layer, None, width)
    if kind == "resid_mid":
        return Site(index, name, "norm_in", layer, layout.resid_mid_norm, width)
    if kind in _INNER_SITES:
        model = architecture or "this model"
        if kind in ("mlp.pre", "mlp.post") and layout.router is not None:
            raise SpecError(
                f"hook point {name!r}: {model}'s MLP is a mixture of experts; neuron hook points (mlp.hook_pre, "
                "mlp.hook_post) exist for dense MLPs only (use hook_mlp_out, or mlp.hook_router_logits)"
            )
        if kind == "mlp.router_logits" and layout.router is None:
            raise SpecError(f"hook point {name!r}: {model}'s MLP is dense; only a mixture of experts has a router")
        site_kind, module = _INNER_SITES[kind]
        module = module or layout.router
        return Site(index, name, site_kind, layer, module, width, heads=shape.heads(kind), arg=_site_arg(kind, shape))
    module = layout.attn_out_module if kind == "attn_out" else layout.mlp_out_module
    return Site(index, name, "module_out", layer, module, width)
