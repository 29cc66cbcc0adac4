"""The step router's side of pooled captures: which rows each step folds into which slot.

``pooling.py`` holds the device accumulators and their kernels; this module decides what
they are given.  Each site with pooled captures gets one ``SiteAccumulators``, indexed by
request slot.  A slot is zeroed before the first step of the request admitted to it.  After
each step the captured rows of all pooled requests are folded in with a few index kernels
per site and reduction, whatever the number of requests, and each request's newest row is
kept apart as its pending row (``plans.finish_pooled`` says why).  A decode step that repeats
the last one (the same slots' next rows, at the same batch rows) applies the last step's folds
again; for means, a run of such steps sums its rows per batch row instead (``MeanRun``, two
kernel launches a step against five) and folds the sum in when the run ends.  The accumulators
are read back, one read per site, when requests retire or their results are fetched, and
settled into the requests' capture items.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inspect_tl_vllm.instrument.pooling import MODES, SiteAccumulators, device_index
from inspect_tl_vllm.instrument.request_state import RequestState
from inspect_tl_vllm.instrument.runtime import HookRuntime

PooledReads = dict[int, tuple[np.ndarray, torch.Tensor]]  # site -> slots (sorted), their rows on the host


class PooledCaptures:
    """The accumulators of every site with pooled captures, and the slots to zero before the next step."""

    def __init__(self, runtime: HookRuntime, cuda: bool) -> None:
        self.runtime = runtime
        self.cuda = cuda
        self.pools: dict[int, SiteAccumulators] = {}
        self.resets: dict[int, list[int]] = {}  # site -> slots whose accumulators must be zeroed
        # the last step's folds (accumulators, mode, source), when a repeat of that step may apply them again
        self._repeatable: list[tuple[SiteAccumulators, int, torch.Tensor, Fold]] | None = None
        self._runs: dict[int, MeanRun] = {}  # index in ``_repeatable`` -> its mean fold's run of repeated steps

    def admit(self, state: RequestState) -> None:
        """Make room for the pooled request ``state`` (slot already taken); zeroed at the next step."""
        for item in state.capture:
            pool = self.pools.get(item.site)
            if pool is None:  # allocated once per site, not per request
                width = self.runtime.sites[item.site].width
                pool = self.pools[item.site] = SiteAccumulators(width, self.runtime.device)
            pool.ensure(state.slot + 1)
            self.resets.setdefault(item.site, []).append(state.slot)

    def end_runs(self) -> None:
        """Fold the runs of repeated steps into the accumulators: before a step folds other rows,
        and before a read.  (A slot zeroed for a new request is never in a run: runs hold live
        requests' slots, and a slot is freed only after its request's read.)"""
        if self._runs:
            with torch.inference_mode():  # reads may come outside the step's inference mode
                for run in self._runs.values():
                    run.end()
        self._runs = {}

    def flush_resets(self) -> None:
        for site, slots in self.resets.items():
            if slots:
                self.pools[site].reset(device_index(np.array(slots), self.runtime.device, self.cuda))
        self.resets.clear()

    def fold(
        self,
        pending: np.ndarray,
        site_of: np.ndarray,
        mode_of: np.ndarray,
        rows: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
        *,
        repeat: bool = False,
    ) -> None:
        """Fold this step's pooled rows into the accumulators, keeping each request's newest
        row apart as its pending row; ``pending`` (per request slot, the position of the
        pending row, -1 for none) is updated.  ``repeat``: the rows are the next rows of the
        last step's slots, at the same batch rows, so its folds apply again when they were
        ``Fold.repeatable``."""
        if repeat and self._repeatable is not None:
            for index, (pool, mode, staging, fold) in enumerate(self._repeatable):
                if mode != MODES["mean"]:
                    fold.apply(pool, mode, staging)
                elif index in self._runs:
                    self._runs[index].step(staging)
                else:
                    self._runs[index] = MeanRun(pool, staging, fold)
            pending[slots] = positions  # one row per slot: each is its slot's newest
            return
        self.end_runs()
        order = np.lexsort((positions, slots))
        newest_of_slot: dict[int, int] = {}
        folds = []
        for key in np.unique(site_of * len(MODES) + mode_of).tolist():
            site, mode = divmod(key, len(MODES))
            group = order[(site_of[order] == site) & (mode_of[order] == mode)]
            staging = self.runtime.sites[site].staging
            fold = fold_group(
                self.pools[site], mode, staging, rows[group], slots[group], positions[group], pending,
                self.runtime.device, self.cuda,
            )  # fmt: skip
            folds.append((self.pools[site], mode, staging, fold))
            newest_of_slot.update(zip(fold.slots.tolist(), fold.newest.tolist(), strict=True))
        if newest_of_slot:
            pending[np.fromiter(newest_of_slot, np.int64)] = np.fromiter(newest_of_slot.values(), np.int64)
        self._repeatable = folds if all(fold.repeatable for *_, fold in folds) else None

    def read(self, states: list[RequestState], to_host: Callable[[torch.Tensor], torch.Tensor]) -> PooledReads:
        """The pooled rows of ``states``, copied by ``to_host``: one read per site, however many requests."""
        self.end_runs()
        reads: PooledReads = {}
        for site, pool in self.pools.items():
            slots = np.sort(
                np.array([s.slot for s in states if s.pooled and any(c.site == site for c in s.capture)], np.int64)
            )
            if slots.size:
                reads[site] = (slots, to_host(pool.read(device_index(slots, pool.device, self.cuda))))
        return reads

    def settle(self, state: RequestState, reads: PooledReads) -> None:
        """Copy the pooled request ``state``'s rows out of ``reads`` into its capture items."""
        for item in state.capture:
            if item.site in reads:
                width = self.runtime.sites[item.site].width
                slots, data = reads[item.site]
                row = data.numpy()[int(np.searchsorted(slots, state.slot))]
                item.pooled = (row[:width].copy(), float(row[width]), row[width + 1 :].copy())


@dataclass
class Fold:
    """One group's fold into its accumulators, as device indices: each slot's pending row from an
    earlier step (``carried``), its earlier rows of this step, then its newest row, stashed as the
    slot's pending row.  ``slots`` got a new pending row, at position ``newest``."""

    carried: torch.Tensor
    earlier_rows: torch.Tensor
    earlier_slots: torch.Tensor
    step_rows: torch.Tensor
    step_slots: torch.Tensor
    slots: np.ndarray
    newest: np.ndarray

    def apply(self, pool: SiteAccumulators, mode: int, source: torch.Tensor) -> None:
        if len(self.carried):
            pool.fold(mode, pool.pending, self.carried, self.carried)
        if len(self.earlier_rows):
            pool.fold(mode, source, self.earlier_rows, self.earlier_slots)
        pool.stash(source, self.step_rows, self.step_slots)

    @property
    def repeatable(self) -> bool:
        """One row per slot, each slot with a pending row already: the fold of the same slots'
        next rows, at the same batch rows, is this same fold."""
        return len(self.carried) == len(self.slots) and len(self.earlier_rows) == 0


class MeanRun:
    """A run of repeated steps of one repeatable mean fold, summed per batch row.

    Each step of the fold adds every slot's pending row to its sum and stashes the slot's new
    row as pending (five kernel launches).  Over a run of repeated steps the same
    slots take rows from the same batch rows, so the run keeps, per row, the sum of the rows it
    would have folded in (``total``, float32 as the accumulators) and the newest row (``newest``,
    in the activations' dtype): one add and one gather a step.  ``end`` folds them in."""

    def __init__(self, pool: SiteAccumulators, staging: torch.Tensor, fold: Fold) -> None:
        self.pool, self.fold = pool, fold
        self.total = pool.pending.index_select(0, fold.step_slots)
        self.newest = staging.index_select(0, fold.step_rows)

    def step(self, staging: torch.Tensor) -> None:
        self.total.add_(self.newest)
        torch.index_select(staging, 0, self.fold.step_rows, out=self.newest)

    def end(self) -> None:
        self.pool.rows.index_add_(0, self.fold.step_slots, self.total)
        self.pool.pending.index_copy_(0, self.fold.step_slots, self.newest.float())


def fold_group(
    pool: SiteAccumulators,
    mode: int,
    source: torch.Tensor,
    rows: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    pending: np.ndarray,
    device: torch.device,
    cuda: bool,
) -> Fold:
    """Fold ``source[rows]`` (sorted by slot, then position) into ``pool`` by ``mode``: each
    slot's pending row from an earlier step first (``pending[slot] >= 0``), then its earlier rows
    of this step; its newest row becomes the pending one.  Returns the fold; the caller records
    its slots' new pending positions in ``pending``."""
    newest = np.r_[slots[1:] != slots[:-1], True]  # per slot, the row with the highest position
    step_slots, step_rows = slots[newest], rows[newest]
    earlier = ~newest
    if mode == MODES["last"]:  # of the earlier rows only the last per slot matters
        earlier &= np.r_[newest[1:], False]
    carried = step_slots[pending[step_slots] >= 0]
    parts = [carried, rows[earlier], slots[earlier], step_slots, step_rows]
    index = device_index(np.concatenate(parts), device, cuda)
    bounds = np.cumsum([0, *(len(part) for part in parts)]).tolist()
    carried_t, earlier_rows, earlier_slots, step_slots_t, step_rows_t = (
        index[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )
    fold = Fold(carried_t, earlier_rows, earlier_slots, step_rows_t, step_slots_t, step_slots, positions[newest])
    fold.apply(pool, mode, source)
    return fold
