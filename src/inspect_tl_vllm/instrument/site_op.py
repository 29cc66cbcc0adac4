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
``row_stats``, ``fired``), so Inductor keeps it in place and orders it; its outputs are new
tensors.  ``residual`` is the second half of vLLM's folded residual stream: when given, the
hook sees ``hidden + residual`` rounded to the activation dtype (what the next fused
add-norm would have computed) and returns zeros for the residual.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

ROW, MULT, ADD, PROJ, ENC, BIAS, THRESH, GATE, MASK = range(9)
STAGE_WIDTH = 9
"""The entries of one stage in a site's table (``runtime.py`` says what each means)."""
NORM_CHANGE, FEATURE_BEFORE, FEATURE_AFTER = range(3)
ROW_STATS = 3
"""What the hook records per token row in ``row_stats``: the change in L2 norm, and a feature
stage's SAE feature activation before and after it (zeros without one)."""
FUSED = os.environ.get("TLVLLM_FUSED_HOOK", "1") != "0"


def reference(
    hidden: Tensor,
    residual: Tensor | None,
    table: Tensor,
    bank: Tensor,
    staging: Tensor,
    row_stats: Tensor,
    fired: Tensor,
) -> tuple[Tensor, Tensor]:
    """The hook math in torch ops; see ``runtime.py`` for what the table holds."""
    rows, width = hidden.shape
    bank = bank[:, :width]  # a site reads the first ``width`` numbers of each bank row
    stream = hidden if residual is None else hidden + residual
    x = stream.float()
    before = torch.linalg.vector_norm(x, dim=-1)
    table = table[:rows]
    feature_before = torch.zeros(rows, 1, device=x.device)
    feature_after = torch.zeros(rows, 1, device=x.device)
    for stage in range(table.shape[1]):
        entry = table[:, stage]
        v = bank[entry[:, ROW].long()]
        u = bank[entry[:, ENC].long()]
        mult, add, proj = entry[:, MULT : MULT + 1], entry[:, ADD : ADD + 1], entry[:, PROJ : PROJ + 1]
        bias, thresh, gate = entry[:, BIAS : BIAS + 1], entry[:, THRESH : THRESH + 1], entry[:, GATE : GATE + 1]
        dot = (x * v).sum(dim=-1, keepdim=True)
        xu = (x * u).sum(dim=-1, keepdim=True)
        pre = xu + bias
        f = torch.where(pre > thresh, pre, 0.0)
        coef = add - proj * dot - gate * f
        pre_after = mult * xu + coef * (v * u).sum(dim=-1, keepdim=True) + bias
        feature = entry[:, ENC : ENC + 1] != 0
        feature_before = torch.where(feature, f, feature_before)
        feature_after = torch.where(feature, torch.where(pre_after > thresh, pre_after, 0.0), feature_after)
        mask_row = entry[:, MASK].long()
        columns = torch.where((mask_row != 0).unsqueeze(1), bank[mask_row], 1.0)
        x = torch.where(columns != 0, x * mult + coef * v, x)
    out = x.to(hidden.dtype)
    norm_change = (torch.linalg.vector_norm(out.float(), dim=-1) - before).unsqueeze(1)
    row_stats[:rows].copy_(torch.cat([norm_change, feature_before, feature_after], dim=1))
    staging[:rows].copy_(out)
    fired.add_(1)
    return out, _residual_out(hidden, residual)


def _residual_out(hidden: Tensor, residual: Tensor | None) -> Tensor:
    return torch.zeros_like(hidden) if residual is not None else hidden.new_empty((0, hidden.shape[1]))


@torch.library.custom_op("tlvllm::site_hook", mutates_args=("staging", "row_stats", "fired"))
def site_hook(
    hidden: Tensor,
    residual: Tensor | None,
    table: Tensor,
    bank: Tensor,
    staging: Tensor,
    row_stats: Tensor,
    fired: Tensor,
) -> tuple[Tensor, Tensor]:
    """Steer, record and count one site's rows; returns (stream out, residual out)."""
    return reference(hidden, residual, table, bank, staging, row_stats, fired)


@site_hook.register_fake
def _(hidden, residual, table, bank, staging, row_stats, fired):  # noqa: ANN001, ANN202
    return torch.empty_like(hidden), _residual_out(hidden, residual)


@site_hook.register_kernel("cuda")
def _(hidden, residual, table, bank, staging, row_stats, fired):  # noqa: ANN001, ANN202
    if not FUSED:
        return reference(hidden, residual, table, bank, staging, row_stats, fired)
    from inspect_tl_vllm.instrument.site_kernel import launch

    return launch(hidden, residual, table, bank, staging, row_stats, fired)
