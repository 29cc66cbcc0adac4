"""The in-graph part: buffers allocated once and the branch-free hook math that reads them.

Everything a request asks for arrives as *contents* of these buffers, written on the host
before each forward step (see ``routing.py``).  The hooks themselves never branch on a
request, never allocate persistent state and never read Python-side step metadata, so
torch.compile traces them once and CUDA graphs replay them with the current contents.

Per token row ``t`` and site ``s`` the hook applies ``max_stack`` stages::

    v = bank[vec_index[t, s, k]]
    x = x * mult + add * v - proj * (x . v) v

Row 0 of the bank is zeros and the defaults (mult 1, add 0, proj 0) make a stage an exact
no-op, so unsteered rows pass through bit for bit.  The result is then copied into
``staging[s]`` (captures are read from there after the step), the change in L2 norm per row
goes to ``norm_delta`` (steering receipts), and ``fired[s]`` counts executions (the loud
check that a hook really runs inside the compiled graph).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from inspect_tl_vllm.instrument.hookpoints import Site

MULT, ADD, PROJ = 0, 1, 2


class HookRuntime:
    """Device buffers shared by all hooks of one model replica."""

    def __init__(
        self,
        *,
        num_sites: int,
        hidden_size: int,
        max_tokens: int,
        max_stack: int,
        max_vectors: int,
        device: torch.device,
        act_dtype: torch.dtype,
    ) -> None:
        self.num_sites = num_sites
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.max_stack = max_stack
        self.max_vectors = max_vectors
        self.device = device
        self.act_dtype = act_dtype
        self.bank = torch.zeros(max_vectors + 1, hidden_size, dtype=torch.float32, device=device)
        self.vec_index = torch.zeros(max_tokens, num_sites, max_stack, dtype=torch.int64, device=device)
        self.coefs = torch.zeros(max_tokens, num_sites, max_stack, 3, dtype=torch.float32, device=device)
        self.coefs[..., MULT] = 1.0
        self.staging = torch.zeros(num_sites, max_tokens, hidden_size, dtype=act_dtype, device=device)
        self.norm_delta = torch.zeros(num_sites, max_tokens, dtype=torch.float32, device=device)
        self.fired = torch.zeros(num_sites, dtype=torch.int64, device=device)

    def apply(self, site: int, hidden: torch.Tensor) -> torch.Tensor:
        """The hook math for one site; ``hidden`` is ``[num_tokens, hidden_size]``."""
        rows = hidden.shape[0]
        x = hidden.float()
        before = torch.linalg.vector_norm(x, dim=-1)
        for stage in range(self.max_stack):
            v = self.bank[self.vec_index[:rows, site, stage]]
            c = self.coefs[:rows, site, stage]
            dot = (x * v).sum(dim=-1, keepdim=True)
            x = x * c[:, MULT : MULT + 1] + c[:, ADD : ADD + 1] * v - c[:, PROJ : PROJ + 1] * dot * v
        out = x.to(hidden.dtype)
        self.norm_delta[site, :rows].copy_(torch.linalg.vector_norm(out.float(), dim=-1) - before)
        self.staging[site, :rows].copy_(out)
        self.fired[site : site + 1].add_(1)
        return out

    def memory_bytes(self) -> int:
        tensors = (self.bank, self.vec_index, self.coefs, self.staging, self.norm_delta, self.fired)
        return sum(t.numel() * t.element_size() for t in tensors)


def install_hooks(layers: nn.ModuleList, final_norm: nn.Module, sites: list[Site], runtime: HookRuntime) -> list[Any]:
    """Register one forward (pre-)hook per site; returns the handles.

    Must run before the first forward pass: torch.compile traces the hooks with the model.
    """
    handles = []
    for site in sites:
        hook = _make_hook(site, runtime)
        if site.kind == "layer_in":
            handles.append(layers[site.layer].register_forward_pre_hook(hook, with_kwargs=True))
        elif site.kind == "norm_in":
            norm = getattr(layers[site.layer], site.module)
            handles.append(norm.register_forward_pre_hook(hook, with_kwargs=True))
        elif site.kind == "layer_out":
            handles.append(layers[site.layer].register_forward_hook(hook))
        elif site.kind == "module_out":
            handles.append(getattr(layers[site.layer], site.module).register_forward_hook(hook))
        else:
            handles.append(final_norm.register_forward_hook(hook))
    return handles


def _make_hook(site: Site, runtime: HookRuntime) -> Callable[..., Any]:
    index = site.index
    apply = runtime.apply

    if site.kind == "layer_in":
        # Only layer 0 has its own resid_pre site; vLLM calls it with residual=None, so the
        # hidden states are the whole residual stream (the embeddings).
        def layer_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return (args[0], apply(index, args[1]), *args[2:]), kwargs

        return layer_in

    if site.kind == "norm_in":

        def norm_in(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            out = apply(index, args[0] + args[1])
            return (out, torch.zeros_like(out), *args[2:]), kwargs

        return norm_in

    if site.kind == "layer_out":

        def layer_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            hidden, residual = output[0], output[1]
            out = apply(index, hidden if residual is None else hidden + residual)
            return (out, torch.zeros_like(out), *output[2:])

        return layer_out

    if site.kind == "module_out":

        def module_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            return apply(index, output)

        return module_out

    def final_norm_out(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if isinstance(output, tuple):
            return (apply(index, output[0]), *output[1:])
        return apply(index, output)

    return final_norm_out
