"""The in-graph part: buffers allocated once and the branch-free hook math that reads them.

Everything a request asks for arrives as *contents* of these buffers, written on the host
before each forward step (see ``routing.py``).  The hooks themselves never branch on a
request, never allocate persistent state and never read Python-side step metadata, so
torch.compile traces them once and CUDA graphs replay them with the current contents.

Each site owns separate tensors (``SiteBuffers``) instead of a slice of one shared table.
That keeps every decoder layer's compiled piece isometric: the hook reads its own graph
inputs and no per-layer constant, so vLLM compiles one layer's piece and reuses it for the
others (a site number baked into the graph made compile time grow with the site count).

Per token row ``t`` the hook at a site applies ``max_stack`` stages, with
``table[t, k] = (bank row, mult, add, proj, encoder row, bias, threshold, gate, mask row)``::

    v = bank[table[t, k, 0]]
    u = bank[table[t, k, 4]]                      # an SAE encoder column; row 0 (zeros) if none
    m = bank[table[t, k, 8]] if table[t, k, 8] else 1   # 0/1 per column: the heads a stage edits
    f = x . u + bias if x . u + bias > threshold else 0   # the SAE feature's activation
    x = where(m != 0, x * mult + (add - proj * (x . v) - gate * f) v, x)

So ``add``/``scale``/``set``/``ablate`` are (add, mult, add, proj) choices with no encoder row,
and an SAE feature's ``clamp`` to c is (v = W_dec[i], u = W_enc[:, i], add c, gate 1).  Row 0 of
the bank is zeros and the defaults (mult 1, everything else 0) make a stage an exact no-op, so
unsteered rows pass through bit for bit.  The result is then copied into the site's
``staging`` (captures are read from there after the step), each row's change in L2 norm and a
feature stage's f before and after go to ``row_stats`` (steering receipts), and ``fired``
counts executions (the loud check that a hook really runs inside the compiled graph).
``site_op.py`` holds that math, as one operator that is a single Triton kernel on CUDA.

Sites differ in width (d_model, heads x d_head, d_mlp); the bank is as wide as the widest, and
a site reads the first ``width`` numbers of a row (narrower vectors are stored zero-padded).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inspect_tl_vllm.instrument import site_op  # noqa: F401  (registers torch.ops.tlvllm.site_hook)
from inspect_tl_vllm.instrument.hookpoints import ArchLayout, Site
from inspect_tl_vllm.instrument.site_op import ROW_STATS

IDENTITY_STAGE = (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


class SiteBuffers:
    """The tensors one site's hook reads and writes."""

    def __init__(self, *, max_tokens: int, max_stack: int, width: int, device: torch.device, act_dtype: Any):
        self.width = width
        self.table = torch.tensor(IDENTITY_STAGE, device=device).repeat(max_tokens, max_stack, 1)
        self.staging = torch.zeros(max_tokens, width, dtype=act_dtype, device=device)
        self.row_stats = torch.zeros(max_tokens, ROW_STATS, dtype=torch.float32, device=device)
        self.fired = torch.zeros(1, dtype=torch.int64, device=device)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.table, self.staging, self.row_stats, self.fired)


class HookRuntime:
    """Device buffers of the sites this worker owns (``site_widths``: site -> numbers per row),
    plus the shared vector bank."""

    def __init__(
        self,
        *,
        site_widths: dict[int, int],
        bank_width: int,
        max_tokens: int,
        max_stack: int,
        max_vectors: int,
        device: torch.device,
        act_dtype: torch.dtype,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_stack = max_stack
        self.max_vectors = max_vectors
        self.device = device
        self.act_dtype = act_dtype
        self.bank_width = bank_width  # the widest site of the engine (every pipeline stage's)
        self.bank = torch.zeros(max_vectors + 1, self.bank_width, dtype=torch.float32, device=device)
        self.sites = {
            index: SiteBuffers(
                max_tokens=max_tokens, max_stack=max_stack, width=width, device=device, act_dtype=act_dtype
            )
            for index, width in sorted(site_widths.items())
        }

    def apply(self, buffers: SiteBuffers, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        """The hook math for one site (``site_op.site_hook``); ``hidden`` is ``[num_tokens, site width]``.

        With ``residual`` the site sees ``hidden + residual`` and returns ``(stream, zeros)``
        for the next fused add-norm; without it, the stream alone."""
        out, residual_out = torch.ops.tlvllm.site_hook(
            hidden, residual, buffers.table, self.bank, buffers.staging, buffers.row_stats, buffers.fired
        )
        return out if residual is None else (out, residual_out)

    def fired(self) -> dict[int, int]:
        return {index: int(buffers.fired.item()) for index, buffers in self.sites.items()}

    def memory_bytes(self) -> int:
        tensors = [self.bank, *(t for buffers in self.sites.values() for t in buffers.tensors())]
        return sum(t.numel() * t.element_size() for t in tensors)


def install_hooks(
    layers: nn.ModuleList, final_norm: nn.Module, sites: list[Site], runtime: HookRuntime, layout: ArchLayout
) -> list[Any]:
    """Register one forward (pre-)hook per site; returns the handles.

    Must run before the first forward pass: torch.compile traces the hooks with the model.
    """
    handles = []
    for site in sites:
        hook = _make_hook(site, runtime, layout)
        if site.kind == "layer_in":
            handles.append(layers[site.layer].register_forward_pre_hook(hook, with_kwargs=True))
        elif site.kind in ("norm_in", "arg_in", "columns_in"):
            module = layers[site.layer].get_submodule(site.module)
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        elif site.kind == "layer_out":
            handles.append(layers[site.layer].register_forward_hook(hook))
        elif site.kind in ("module_out", "columns_out"):
            handles.append(layers[site.layer].get_submodule(site.module).register_forward_hook(hook))
        else:
            handles.append(final_norm.register_forward_hook(hook))
    return handles


def _make_hook(site: Site, runtime: HookRuntime, layout: ArchLayout) -> Callable[..., Any]:
    buffers = runtime.sites[site.index]
    apply = runtime.apply

    if site.kind == "layer_in":
        # Only layer 0 has its own resid_pre site; vLLM calls it with residual=None, so the
        # hidden states are the whole residual stream (the embeddings).
        at = layout.hidden_arg

        def layer_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (*args[:at], apply(buffers, args[at]), *args[at + 1 :]), kwargs

        return layer_in

    if site.kind == "norm_in":

        def norm_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (*apply(buffers, args[0], args[1]), *args[2:]), kwargs

        return norm_in

    if site.kind == "layer_out" and not layout.fused_residual:  # the layer returns the stream itself

        def stream_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return apply(buffers, output)

        return stream_out

    if site.kind == "layer_out":

        def layer_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            hidden, residual = output[0], output[1]
            if residual is None:  # a layer that hands on the whole stream (none of vLLM's today)
                return (apply(buffers, hidden), torch.zeros_like(hidden), *output[2:])
            return (*apply(buffers, hidden, residual), *output[2:])

        return layer_out

    if site.kind == "arg_in":  # one positional argument of the module: q or k, v, the heads' output
        arg = site.arg

        def arg_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (*args[:arg], apply(buffers, args[arg]), *args[arg + 1 :]), kwargs

        return arg_in

    start, end = site.arg, site.arg + site.width

    def edit_columns(fused: torch.Tensor) -> torch.Tensor:
        """The fused tensor with the site's columns run through the hook ([q | k | v], [gate | up])."""
        return torch.cat([fused[..., :start], apply(buffers, fused[..., start:end]), fused[..., end:]], dim=-1)

    if site.kind == "columns_in":

        def columns_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (edit_columns(args[0]), *args[1:]), kwargs

        return columns_in

    if site.kind == "columns_out":  # a vLLM linear layer returns (output, bias)

        def columns_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if isinstance(output, tuple):
                return (edit_columns(output[0]), *output[1:])
            return edit_columns(output)

        return columns_out

    if site.kind == "module_out":

        def module_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return apply(buffers, output)

        return module_out

    def final_norm_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, tuple):
            return (apply(buffers, output[0]), *output[1:])
        return apply(buffers, output)

    return final_norm_out
