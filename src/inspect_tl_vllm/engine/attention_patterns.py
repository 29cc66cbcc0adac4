"""Attention patterns (``blocks.N.attn.hook_pattern``), computed in the front end from the captured
rotated query and key rows.

vLLM's attention kernels never materialise the softmax, so a pattern is recomputed from what the
attention op received (``hook_rot_q``, ``hook_rot_k``) with the settings of the model's own vLLM
attention layer, which the workers report at boot (``worker.attention_settings``): its scale, its
sliding window and its logit soft-cap.  The result is [query position, head, key position] in
float32: rows are positions, as in every other per-token capture; ``pattern.permute(1, 0, 2)`` is
TransformerLens' [head, query_pos, key_pos].  Keys after a query, or outside its window, get 0.
"""

from __future__ import annotations

import torch

QUERY, KEY = ":q", ":k"
"""Suffixes of the internal captures a pattern is computed from (``<pattern hook>:q`` and ``:k``)."""


def attention_pattern(
    q: torch.Tensor, k: torch.Tensor, positions: list[int], scale: float, window: float, soft_cap: float
) -> torch.Tensor:
    """Softmax attention weights of each row's query over the keys of every row up to it.

    ``q`` is [rows, heads, d_head], ``k`` [rows, kv heads, d_head] (grouped-query heads share a
    key head), both at ``positions``, which must be 0, 1, ... (every key before a query present).
    ``window`` 0 means none; ``soft_cap`` 0 means none."""
    if positions != list(range(len(positions))):
        raise ValueError("an attention pattern needs the query and key rows of every position from 0")
    heads, kv_heads = q.shape[1], k.shape[1]
    keys = k.float().repeat_interleave(heads // kv_heads, dim=1)  # [rows, heads, d_head]
    scores = torch.einsum("qhd,khd->qhk", q.float(), keys) * scale
    if soft_cap:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    where = torch.arange(len(positions))
    offset = where[:, None] - where[None, :]  # query minus key position
    allowed = offset >= 0
    if window:
        allowed &= offset < window
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1)
