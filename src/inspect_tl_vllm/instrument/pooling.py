"""Pooled captures (``reduce`` = mean, last, max_norm) reduced on the device.

A pooled capture needs one row per request and hook point, so copying every captured row
to the host each step and reducing it there is wasted traffic and per-request Python.  Each
site that has pooled captures gets accumulators indexed by request slot; after a step the
router hands over the captured rows with their slots and a few index kernels fold them in,
stream-ordered after the forward pass that wrote ``staging`` and before the next one
overwrites it.  Nothing here synchronises with the device: the router copies ``read``'s
rows to pinned host memory asynchronously and completes the copy a step later.

Slots index the accumulators; a slot is zeroed when a request is admitted to it.  Each
request's newest row waits in ``pending`` until a newer one arrives, because under
asynchronous scheduling the last row may not belong to the answer (``plans.finish_pooled``).
"""

from __future__ import annotations

import numpy as np
import torch

MODES = {"mean": 0, "last": 1, "max_norm": 2, "max": 3}
"""The reductions computed on the device (every ``Capture.reduce`` but ``none``), by their code;
``max`` (per entry) is for SAE features (``feature_captures.py``)."""


class SiteAccumulators:
    """The accumulators of one site (or SAE): sum (mean), last row, best row and its norm
    (max_norm), or each entry's largest value (max)."""

    def __init__(self, hidden_size: int, device: torch.device, capacity: int = 64) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.rows = torch.zeros(capacity, hidden_size, dtype=torch.float32, device=device)
        self.best_norm = torch.full((capacity,), -torch.inf, dtype=torch.float32, device=device)
        self.pending = torch.zeros(capacity, hidden_size, dtype=torch.float32, device=device)

    @property
    def capacity(self) -> int:
        return self.rows.shape[0]

    def ensure(self, slots: int) -> None:
        """Grow (doubling) so that ``slots`` fit; existing rows keep their values."""
        if slots <= self.capacity:
            return
        size = max(slots, 2 * self.capacity)
        rows, pending = (torch.zeros(size, self.hidden_size, dtype=torch.float32, device=self.device) for _ in "ab")
        rows[: self.capacity] = self.rows
        pending[: self.capacity] = self.pending
        best = torch.full((size,), -torch.inf, dtype=torch.float32, device=self.device)
        best[: self.capacity] = self.best_norm
        self.rows, self.best_norm, self.pending = rows, best, pending

    def reset(self, slots: torch.Tensor) -> None:
        self.rows.index_fill_(0, slots, 0.0)
        self.best_norm.index_fill_(0, slots, -torch.inf)

    def fold(self, mode: int, source: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Fold ``source[rows]`` (a site's staging, or ``pending``) into the accumulators of ``slots``.

        For ``last`` the router passes one row per slot; for ``max_norm`` any number, reduced
        here per slot without a host sync.
        """
        x = source.index_select(0, rows).float()
        if mode == MODES["mean"]:
            self.rows.index_add_(0, slots, x)
        elif mode == MODES["last"]:
            self.rows.index_copy_(0, slots, x)
        elif mode == MODES["max"]:  # entries are SAE feature activations, never negative: rows start at 0
            self.rows.scatter_reduce_(0, slots[:, None].expand_as(x), x, "amax")
        else:
            self._fold_max_norm(x, slots)

    def _fold_max_norm(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        norms = torch.linalg.vector_norm(x, dim=-1)
        step_best = torch.full_like(self.best_norm, -torch.inf).scatter_reduce_(0, slots, norms, "amax")
        # index in x of the (last) row reaching each slot's best norm this step
        candidate = torch.where(norms == step_best[slots], torch.arange(len(norms), device=x.device), -1)
        winner = torch.full(self.best_norm.shape, -1, dtype=torch.int64, device=x.device)
        winner.scatter_reduce_(0, slots, candidate, "amax")
        touched = torch.zeros(self.best_norm.shape, dtype=torch.bool, device=x.device).index_fill_(0, slots, True)
        better = touched & (step_best > self.best_norm)
        chosen = x.index_select(0, winner.clamp_min(0))  # one row per slot; those of untouched slots are ignored
        self.rows.copy_(torch.where(better[:, None], chosen, self.rows))
        self.best_norm.copy_(torch.where(better, step_best, self.best_norm))

    def stash(self, staging: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Keep ``staging[rows]`` as the pending (newest) row of ``slots``."""
        self.pending.index_copy_(0, slots, staging.index_select(0, rows).float())

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot: the reduced row, the best norm (max_norm) and the pending row, as one row."""
        best = self.best_norm.index_select(0, slots).unsqueeze(1)
        return torch.cat([self.rows.index_select(0, slots), best, self.pending.index_select(0, slots)], dim=1)


def device_index(indices: np.ndarray, device: torch.device, pinned: bool) -> torch.Tensor:
    """Slot or row indices on the device, without a host sync (pinned, non-blocking copy)."""
    index = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int64))
    if not pinned:
        return index
    return index.pin_memory().to(device, non_blocking=True)
