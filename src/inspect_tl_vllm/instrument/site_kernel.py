"""The Triton kernel behind ``tlvllm::site_hook`` on CUDA (imported only there).

One program per token row: load the row (adding the residual and rounding to the
activation dtype, as vLLM's fused add-norm would), apply the stages, write the row out and
to ``staging``, write the residual's zeros, the row's stats (norm change, feature activation
before and after), and let program 0 count the execution.  A row whose stages are all the
identity skips the stage math and both norms, so an unsteered row costs one read and two or
three writes of the row and no reductions (the norms and dot products, each a reduction
across the program's warps, set the kernel's time).  Only a feature stage (an SAE encoder row
in its table entry) loads that row and takes its two extra dot products.
The arithmetic is ``reference``'s in float32, in the same order, so unsteered rows leave bit
for bit unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _site_hook_kernel(
    hidden,
    residual,
    out,
    residual_out,
    staging,
    row_stats,
    fired,
    table,
    bank,
    width,
    bank_stride,
    hidden_stride,
    residual_stride,
    HAS_RESIDUAL: tl.constexpr,
    STACK: tl.constexpr,
    WIDTH: tl.constexpr,
    TABLE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(hidden + row * hidden_stride + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * residual_stride + cols, mask=inside, other=0.0).to(tl.float32)
        x = (x + r).to(out.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(residual_out + row * width + cols, tl.zeros([BLOCK], dtype=out.dtype.element_ty), mask=inside)
    # A row is steered when any of its stages differs from the identity (0, 1, 0, 0, 0, 0, 0, 0, 0).
    entries = tl.arange(0, TABLE_BLOCK)
    stages = tl.load(table + row * STACK * WIDTH + entries, mask=entries < STACK * WIDTH, other=0.0)
    identity = tl.where(entries % WIDTH == 1, 1.0, 0.0)
    steered = tl.max(((stages != identity) & (entries < STACK * WIDTH)).to(tl.int32), axis=0) > 0
    if steered:
        before = tl.sqrt(tl.sum(x * x, axis=0))
        feature_before = tl.zeros_like(before)
        feature_after = tl.zeros_like(before)
        for stage in tl.static_range(STACK):
            entry = table + (row * STACK + stage) * WIDTH
            vector_row = tl.load(entry).to(tl.int64)
            mult = tl.load(entry + 1)
            add = tl.load(entry + 2)
            proj = tl.load(entry + 3)
            encoder_row = tl.load(entry + 4).to(tl.int64)
            mask_row = tl.load(entry + 8).to(tl.int64)
            v = tl.load(bank + vector_row * bank_stride + cols, mask=inside & (vector_row != 0), other=0.0)
            coef = add - proj * tl.sum(x * v, axis=0)
            if encoder_row != 0:  # a feature stage: f = act(x . u + bias), as ``reference``
                bias = tl.load(entry + 5)
                thresh = tl.load(entry + 6)
                gate = tl.load(entry + 7)
                u = tl.load(bank + encoder_row * bank_stride + cols, mask=inside, other=0.0)
                xu = tl.sum(x * u, axis=0)
                pre = xu + bias
                feature_before = tl.where(pre > thresh, pre, 0.0)
                coef = coef - gate * feature_before
                pre_after = mult * xu + coef * tl.sum(v * u, axis=0) + bias
                feature_after = tl.where(pre_after > thresh, pre_after, 0.0)
            # the columns a stage edits (its heads): a 0/1 bank row, or every column (row 0)
            columns = tl.load(bank + mask_row * bank_stride + cols, mask=inside & (mask_row != 0), other=1.0)
            x = tl.where(columns != 0, x * mult + coef * v, x)
        y = x.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        yf = y.to(tl.float32)
        tl.store(row_stats + row * 3, tl.sqrt(tl.sum(yf * yf, axis=0)) - before)
        tl.store(row_stats + row * 3 + 1, feature_before)
        tl.store(row_stats + row * 3 + 2, feature_after)
    else:  # the identity: no reductions, the row passes through (and its norm is unchanged)
        y = x.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(row_stats + row * 3, 0.0)
        tl.store(row_stats + row * 3 + 1, 0.0)
        tl.store(row_stats + row * 3 + 2, 0.0)
    tl.store(out + row * width + cols, y, mask=inside)
    tl.store(staging + row * width + cols, y, mask=inside)
    if row == 0:
        tl.atomic_add(fired, 1)


def launch(
    hidden: Tensor,
    residual: Tensor | None,
    table: Tensor,
    bank: Tensor,
    staging: Tensor,
    row_stats: Tensor,
    fired: Tensor,
) -> tuple[Tensor, Tensor]:
    rows, width = hidden.shape
    if hidden.stride(1) != 1:
        hidden = hidden.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    out = torch.empty((rows, width), dtype=hidden.dtype, device=hidden.device)
    residual_out = torch.empty_like(out) if residual is not None else hidden.new_empty((0, width))
    block = triton.next_power_of_2(width)
    _site_hook_kernel[(rows,)](
        hidden,
        hidden if residual is None else residual,
        out,
        residual_out,
        staging,
        row_stats,
        fired,
        table,
        bank,
        width,
        bank.stride(0),
        hidden.stride(0),
        0 if residual is None else residual.stride(0),
        HAS_RESIDUAL=residual is not None,
        STACK=table.shape[1],
        WIDTH=table.shape[2],
        TABLE_BLOCK=triton.next_power_of_2(table.shape[2] * table.shape[1]),
        BLOCK=block,
        num_warps=max(1, min(16, block // 256)),
    )
    return out, residual_out
