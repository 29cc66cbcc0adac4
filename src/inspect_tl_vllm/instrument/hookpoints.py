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

from inspect_tl_vllm.specs import (
    BLOCK_HOOKS,
    FINAL_HOOK,
    INNER_HOOKS,
    ROUTER_HOOK,
    SpecError,
    is_pattern,
    parse_hook_point,
)

SiteKind = Literal[
    "layer_in", "layer_out", "norm_in", "module_out", "final_norm_out", "arg_in", "columns_in", "columns_out"
]


@dataclass(frozen=True)
class ArchLayout:
    """Where each hook point lives in one family's vLLM model.

    ``model``, ``layers`` and ``final_norm`` lead from the causal LM to its decoder stack, its
    layers and its final norm.  Inside a layer: the norm whose input is ``resid_mid`` (None where
    the residual is not handed to a norm, so ``resid_mid`` has no hook), the modules whose outputs
    are ``attn_out`` and ``mlp_out``, the fused query-key-value projection, the attention op, the
    output projection, the MLP's first projection (``mlp_up``) and its down projection; a ``gated``
    MLP's activation (``act``) takes ``[gate | up]``.  (vLLM shares one rotary embedding, and a plain
    MLP's activation, between layers: they carry no hook.)  ``router``
    names a mixture-of-experts block's router (None for a dense MLP, whose neurons have hook points
    of their own).  ``fused_residual``: layers take and return ``(hidden, residual)`` with the add
    folded into the next norm (vLLM's Llama-like families); otherwise a layer returns the stream.
    ``hidden_arg`` is the position of the hidden states among a layer's arguments."""

    resid_mid_norm: str | None
    attn_out_module: str
    mlp_out_module: str
    router: str | None = None
    model: str = "model"
    layers: str = "layers"
    final_norm: str = "norm"
    fused_residual: bool = True
    hidden_arg: int = 1
    qkv: str = "self_attn.qkv_proj"
    attention: str = "self_attn.attn"
    out_proj: str = "self_attn.o_proj"
    act: str = "mlp.act_fn"
    mlp_up: str = ""
    mlp_down: str = "mlp.down_proj"
    gated: bool = True


_LLAMA_LIKE = ArchLayout("post_attention_layernorm", "self_attn", "mlp")
_GEMMA_LIKE = ArchLayout("pre_feedforward_layernorm", "post_attention_layernorm", "post_feedforward_layernorm")
_MOE = ArchLayout("post_attention_layernorm", "self_attn", "mlp", router="mlp.gate")
_UNFUSED = {"fused_residual": False}

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
    # Post-norm: each block's output is normalised before it is added (as Gemma's).
    "Olmo2ForCausalLM": ArchLayout(None, "post_attention_layernorm", "post_feedforward_layernorm", **_UNFUSED),
    # Attention and MLP both read the block's input when use_parallel_residual (Pythia).
    "GPTNeoXForCausalLM": ArchLayout(
        None,
        "attention",
        "mlp",
        model="gpt_neox",
        final_norm="final_layer_norm",
        qkv="attention.query_key_value",
        attention="attention.attn",
        out_proj="attention.dense",
        mlp_up="mlp.dense_h_to_4h",
        mlp_down="mlp.dense_4h_to_h",
        gated=False,
        **_UNFUSED,
    ),
    "GPT2LMHeadModel": ArchLayout(
        None,
        "attn",
        "mlp",
        model="transformer",
        layers="h",
        final_norm="ln_f",
        hidden_arg=0,
        qkv="attn.c_attn",
        attention="attn.attn",
        out_proj="attn.c_proj",
        mlp_up="mlp.c_fc",
        mlp_down="mlp.c_proj",
        gated=False,
        **_UNFUSED,
    ),
}

# Per-head and neuron hook points: (kind, the ArchLayout field naming the submodule of the decoder
# layer).  ``_site_arg`` says which argument, or the first column of the part of a fused tensor,
# carries each.
_INNER_SITES: dict[str, tuple[SiteKind, str]] = {
    "attn.q": ("columns_out", "qkv"),  # [q | k | v]
    "attn.k": ("columns_out", "qkv"),
    "attn.rot_q": ("arg_in", "attention"),  # attn(q, k, v), after the rotary embedding (if any)
    "attn.rot_k": ("arg_in", "attention"),
    "attn.v": ("arg_in", "attention"),
    "attn.z": ("arg_in", "out_proj"),
    "mlp.pre": ("columns_in", "act"),  # a gated act([gate | up]): the gate half (plain MLP: mlp_up's output)
    "mlp.post": ("arg_in", "mlp_down"),
    "mlp.router_logits": ("columns_out", "router"),  # the router's linear layer returns (logits, bias)
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
            # GPT-2's is n_inner, or 4 x d_model when unset
            d_mlp=int(getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * d_model),
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


def _exists(hook: str, layout: ArchLayout | None) -> bool:
    """Whether a family has a block hook point (any family, for ``layout`` None)."""
    if layout is None:
        return True
    if hook == "hook_resid_mid":
        return layout.resid_mid_norm is not None
    if hook in ("mlp.hook_pre", "mlp.hook_post"):
        return layout.router is None
    return hook != ROUTER_HOOK or layout.router is not None


def all_hook_points(num_layers: int, layout: ArchLayout | None = None) -> list[str]:
    """Every residual-width hook point of a family (what ``all`` enables), model order."""
    hooks = [hook for hook in BLOCK_HOOKS if _exists(hook, layout)]
    return [*(f"blocks.{i}.{hook}" for i in range(num_layers) for hook in hooks), FINAL_HOOK]


def every_hook_point(num_layers: int, layout: ArchLayout | None = None) -> list[str]:
    """Every hook point of a family, per-head and neuron ones included (what patterns match), model order."""
    hooks = [hook for hook in BLOCK_HOOKS + INNER_HOOKS if _exists(hook, layout)]
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


def expand_patterns(patterns: list[str], num_layers: int, layout: ArchLayout | None = None) -> list[str]:
    """Engine hook point patterns ('*' wildcards, 'all') -> concrete names, model order.

    ``all`` is every residual-width hook point; per-head and neuron ones are named or matched
    by a pattern (``blocks.*.attn.hook_z``), since each costs a buffer of its own width.  A
    pattern matches the hook points the family has; a name it lacks is kept, so that building
    its site says why."""
    every = every_hook_point(num_layers, layout)
    chosen: set[str] = set()
    for pattern in patterns:
        if pattern == "all":
            chosen.update(all_hook_points(num_layers, layout))
            continue
        matched = fnmatch.filter(every, pattern)
        if "*" not in pattern and not matched and pattern in every_hook_point(num_layers):
            matched = [pattern]
            every = [*every, pattern]
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
    for name in expand_patterns(patterns, shape.num_layers, layout):
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
        return Site(index, name, "final_norm_out", None, layout.final_norm, width)
    if kind == "resid_pre":
        return Site(index, name, "layer_in", layer, None, width)
    if kind == "resid_post":
        return Site(index, name, "layer_out", layer, None, width)
    if kind == "resid_mid":
        if layout.resid_mid_norm is None:
            raise SpecError(
                f"hook point {name!r}: {architecture or 'this model'} hands the residual stream between attention "
                "and MLP to no module, so resid_mid has no hook here; use resid_pre/resid_post, attn_out or mlp_out"
            )
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
        site_kind, field = _INNER_SITES[kind]
        module = getattr(layout, field)
        if kind == "mlp.pre" and not layout.gated:  # the first projection's whole output
            site_kind, module = "columns_out", layout.mlp_up
        return Site(index, name, site_kind, layer, module, width, heads=shape.heads(kind), arg=_site_arg(kind, shape))
    module = layout.attn_out_module if kind == "attn_out" else layout.mlp_out_module
    return Site(index, name, "module_out", layer, module, width)
