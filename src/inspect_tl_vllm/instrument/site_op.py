"""The hook math of one site as one operator, ``tlvllm::site_hook``.

Written as plain torch ops, one site's hook (norm before, ``max_stack`` steering stages that
each need a dot product, norm after, the staging copy, the ``fired`` counter) became several
kernels once Inductor compiled it, and a model with every residual stream hooked runs that
34 times per step (Llama-3-8B), each kernel one more node in the CUDA graph.  On CUDA the
operator is one Triton kernel: one program per token row holds the row in registers, so the
hidden states are read once and ``out``, ``staging`` and the residual's zeros written once.

Everywhere else (CPU, or ``TLVLLM_FUSED_HOOK=0``) the operator runs ``reference``, the same
math in torch ops; the GPU check compares the two (``bench/gpu_check.py``).

The operator is opaque to torch.compile: it declares which buffers it writes (``staging``,
``norm_delta``, ``fired``), so Inductor keeps it in place and orders it; its outputs are new
tensors.  ``residual`` is the second half of vLLM's folded residual stream: when given, the
hook sees ``hidden + residual`` rounded to the activation dtype (what the next fused
add-norm would have computed) and returns zeros for the residual.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

ROW, MULT, ADD, PROJ = 0, 1, 2, 3
FUSED = os.environ.get("TLVLLM_FUSED_HOOK", "1") != "0"


def reference(
    hidden: Tensor,
    residual: Tensor | None,
    table: Tensor,
    bank: Tensor,
    staging: Tensor,
    norm_delta: Tensor,
    fired: Tensor,
) -> tuple[Tensor, Tensor]:
    """The hook math in torch ops; see ``runtime.py`` for what the table holds."""
    rows = hidden.shape[0]
    stream = hidden if residual is None else hidden + residual
    x = stream.float()
    before = torch.linalg.vector_norm(x, dim=-1)
    table = table[:rows]
    for stage in range(table.shape[1]):
        v = bank[table[:, stage, ROW].long()]
        dot = (x * v).sum(dim=-1, keepdim=True)
        mult = table[:, stage, MULT : MULT + 1]
        add = table[:, stage, ADD : ADD + 1]
        proj = table[:, stage, PROJ : PROJ + 1]
        x = x * mult + add * v - proj * dot * v
    out = x.to(hidden.dtype)
    norm_delta[:rows].copy_(torch.linalg.vector_norm(out.float(), dim=-1) - before)
    staging[:rows].copy_(out)
    fired.add_(1)
    return out, _residual_out(hidden, residual)


def _residual_out(hidden: Tensor, residual: Tensor | None) -> Tensor:
    return torch.zeros_like(hidden) if residual is not None else hidden.new_empty((0, hidden.shape[1]))


@torch.library.custom_op("tlvllm::site_hook", mutates_args=("staging", "norm_delta", "fired"))
def site_hook(
    hidden: Tensor,
    residual: Tensor | None,
    table: Tensor,
    bank: Tensor,
    staging: Tensor,
    norm_delta: Tensor,
    fired: Tensor,
) -> tuple[Tensor, Tensor]:
    """Steer, record and count one site's rows; returns (stream out, residual out)."""
    return reference(hidden, residual, table, bank, staging, norm_delta, fired)


@site_hook.register_fake
def _(hidden, residual, table, bank, staging, norm_delta, fired):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden), _residual_out(hidden, residual)


@site_hook.register_kernel("cuda")
def _(hidden, residual, table, bank, staging, norm_delta, fired):  # noqa: ANN001, ANN202
    if not FUSED:
        return reference(hidden, residual, table, bank, staging, norm_delta, fired)
    from inspect_tl_vllm.instrument.site_kernel import launch

    return launch(hidden, residual, table, bank, staging, norm_delta, fired)
