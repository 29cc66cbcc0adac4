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


POST_NORMED = ("gemma2", "gemma3_text", "olmo2")
"""Families whose blocks normalise their attention and MLP outputs before adding them."""
UNFUSED = ("olmo2", "gpt_neox", "gpt2")
"""Families without a module whose input is resid_mid (no hook for it)."""


def hf_stack(model) -> tuple[object, object]:
    """A transformers causal LM's decoder layers and final norm."""
    if model.config.model_type == "gpt2":
        return model.transformer.h, model.transformer.ln_f
    if model.config.model_type == "gpt_neox":
        return model.gpt_neox.layers, model.gpt_neox.final_layer_norm
    return model.model.layers, model.model.norm


def hf_activations(model, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """Every hook point's value (rows = positions) for one forward over ``token_ids``.

    attn_out / mlp_out are the tensors each block adds to the residual stream: the outputs of
    the attention and the MLP, or for post-normed families (Gemma, OLMo-2) of
    ``post_attention_layernorm`` / ``post_feedforward_layernorm``.
    """
    acts: dict[str, torch.Tensor] = {}
    handles = []
    layers, final_norm = hf_stack(model)
    kind = model.config.model_type

    def keep(name: str, pre: bool = False) -> Callable:
        if pre:
            return lambda mod, args, kwargs: acts.__setitem__(name, (args[0] if args else kwargs["hidden_states"])[0])
        return lambda mod, args, out: acts.__setitem__(name, _first(out)[0])

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(keep(f"blocks.{i}.hook_resid_pre", pre=True), with_kwargs=True))
        handles.append(layer.register_forward_hook(keep(f"blocks.{i}.hook_resid_post")))
        if kind in POST_NORMED:
            attn, mlp = layer.post_attention_layernorm, layer.post_feedforward_layernorm
        else:
            attn = {"gpt2": getattr(layer, "attn", None), "gpt_neox": getattr(layer, "attention", None)}.get(kind)
            attn, mlp = attn or layer.self_attn, layer.mlp
        handles.append(attn.register_forward_hook(keep(f"blocks.{i}.hook_attn_out")))
        handles.append(mlp.register_forward_hook(keep(f"blocks.{i}.hook_mlp_out")))
    handles.append(final_norm.register_forward_hook(keep("ln_final.hook_normalized")))
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        for handle in handles:
            handle.remove()
    for i in range(len(layers) if kind not in UNFUSED else 0):
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
        handle = hf_stack(model)[0][layer].register_forward_hook(
            lambda mod, args, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out)
        )
    try:
        with torch.no_grad():
            out = model.generate(torch.tensor([token_ids]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    finally:
        if handle is not None:
            handle.remove()
    return out[0, len(token_ids) :].tolist()


def hf_inner_activations(model, token_ids: list[int]) -> dict[str, torch.Tensor]:
    """The per-head and neuron hook points' values for one forward over ``token_ids``, shaped as
    the engine returns them ([pos, head, d_head] and [pos, d_mlp]).

    hook_q / hook_k / hook_v: the query, key and value projections (q_proj..., or their parts of
    GPT-2's c_attn and of GPT-NeoX's per-head interleaved query_key_value); hook_rot_q / hook_rot_k:
    what ``apply_rotary_pos_emb`` returns (GPT-2 has no rotary embedding: the query and key);
    hook_z: the input of the output projection; mlp.hook_pre: the gate (or first) projection;
    mlp.hook_post: the input of the down projection."""
    import sys

    acts: dict[str, torch.Tensor] = {}
    handles = []
    config = model.config
    d_head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    modeling = sys.modules[type(model).__module__]
    rotary = getattr(modeling, "apply_rotary_pos_emb", None)
    rotated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record_rotary(q, k, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        out = rotary(q, k, *args, **kwargs)
        rotated.append(out)
        return out

    def by_head(x: torch.Tensor) -> torch.Tensor:
        return x[0].reshape(x.shape[1], -1, d_head)

    def keep(name: str, shape: Callable = by_head, pre: bool = False) -> Callable:
        if pre:
            return lambda mod, args: acts.__setitem__(name, shape(args[0]))
        return lambda mod, args, out: acts.__setitem__(name, shape(_first(out)))

    def fused(i: int, part: int, per_head: bool) -> Callable:
        """q, k or v (``part``) of a fused projection: [q | k | v] (GPT-2) or per head (GPT-NeoX)."""

        def split(out: torch.Tensor) -> torch.Tensor:
            x = out[0]
            parts = x.reshape(x.shape[0], -1, 3 * d_head).chunk(3, dim=-1) if per_head else x.chunk(3, dim=-1)
            return parts[part].reshape(x.shape[0], -1, d_head)

        return lambda mod, args, out: acts.__setitem__(f"blocks.{i}.attn.hook_{'qkv'[part]}", split(out))

    plain = lambda x: x[0]  # noqa: E731
    kind = config.model_type
    for i, layer in enumerate(hf_stack(model)[0]):
        if kind in ("gpt2", "gpt_neox"):
            attn = layer.attn if kind == "gpt2" else layer.attention
            qkv = attn.c_attn if kind == "gpt2" else attn.query_key_value
            handles += [qkv.register_forward_hook(fused(i, part, kind == "gpt_neox")) for part in range(3)]
            out_proj = attn.c_proj if kind == "gpt2" else attn.dense
            first, down = (
                (layer.mlp.c_fc, layer.mlp.c_proj)
                if kind == "gpt2"
                else (layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h)
            )
        else:
            attn = layer.self_attn
            handles += [
                attn.q_proj.register_forward_hook(keep(f"blocks.{i}.attn.hook_q")),
                attn.k_proj.register_forward_hook(keep(f"blocks.{i}.attn.hook_k")),
                attn.v_proj.register_forward_hook(keep(f"blocks.{i}.attn.hook_v")),
            ]
            out_proj, first, down = attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj
        handles += [
            out_proj.register_forward_pre_hook(keep(f"blocks.{i}.attn.hook_z", pre=True)),
            first.register_forward_hook(keep(f"blocks.{i}.mlp.hook_pre", plain)),
            down.register_forward_pre_hook(keep(f"blocks.{i}.mlp.hook_post", plain, pre=True)),
        ]
    if rotary is not None:
        modeling.apply_rotary_pos_emb = record_rotary
    try:
        with torch.no_grad():
            model(torch.tensor([token_ids]))
    finally:
        if rotary is not None:
            modeling.apply_rotary_pos_emb = rotary
        for handle in handles:
            handle.remove()
    for i in range(len(hf_stack(model)[0])):
        if rotary is None:  # no rotary embedding: the attention op sees the projections themselves
            acts[f"blocks.{i}.attn.hook_rot_q"] = acts[f"blocks.{i}.attn.hook_q"]
            acts[f"blocks.{i}.attn.hook_rot_k"] = acts[f"blocks.{i}.attn.hook_k"]
        else:  # [batch, head, pos, d_head], one call per layer
            q, k = rotated[i]
            acts[f"blocks.{i}.attn.hook_rot_q"] = q[0].transpose(0, 1)
            acts[f"blocks.{i}.attn.hook_rot_k"] = k[0].transpose(0, 1)
    return acts
