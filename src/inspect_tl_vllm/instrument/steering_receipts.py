"""Steering receipts: per steering item, its rows' stats summed on the device.

A receipt says how many token rows a steering item steered, their mean change in L2 norm
(and, for an SAE feature's intervention, the feature's mean activation before and after it),
and whether its site's hook ran while the request was live.  Each steering item gets an
integer slot while it is live.  The steered rows' stats (``row_stats``) and their count are
summed on the device (``ReceiptAccumulators``, added to by ``steering_routes.py`` with one index
kernel per step), as is the site's ``fired`` count at admission, so that no step waits for the
device.  They are read back, one read for all items, when requests retire or their results are
fetched, and settled into the steering items.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from inspect_tl_vllm.instrument.pooling import device_index
from inspect_tl_vllm.instrument.request_state import SteerItem
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.instrument.site_op import ROW_STATS
from inspect_tl_vllm.instrument.slots import Slots

SUMS = ROW_STATS + 1  # per steering item: its rows' row_stats summed, then how many rows


class ReceiptAccumulators:
    """Per steering-item slot + 1 (index 0 takes the rows no item counts): the sums of its rows'
    stats and their count, and the site's ``fired`` count at admission."""

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self.stat_sums = torch.zeros(capacity, SUMS, dtype=torch.float64, device=device)
        self.fired_at_admission = torch.zeros(capacity, dtype=torch.int64, device=device)

    def ensure(self, slots: int) -> None:
        """Grow (doubling) so that ``slots`` fit; existing values are kept."""
        size = self.stat_sums.shape[0]
        if slots <= size:
            return
        grown = max(slots, 2 * size)
        sums = torch.zeros(grown, SUMS, dtype=torch.float64, device=self.device)
        fired = torch.zeros(grown, dtype=torch.int64, device=self.device)
        sums[:size] = self.stat_sums
        fired[:size] = self.fired_at_admission
        self.stat_sums, self.fired_at_admission = sums, fired

    def admit(self, slots: torch.Tensor, fired: torch.Tensor) -> None:
        """Start the items of ``slots``; ``fired`` holds each one's site counter now."""
        self.stat_sums.index_fill_(0, slots, 0.0)
        self.fired_at_admission.index_copy_(0, slots, fired)

    def add(self, index: torch.Tensor, stats: torch.Tensor, steps: int) -> None:
        """Add ``stats[..., r, :]`` (float64, summed over ``steps`` rows) and ``steps`` rows to
        the items at ``index[..., r, k]`` (each stage k)."""
        counted = torch.cat([stats, stats.new_full((*stats.shape[:-1], 1), steps)], -1)
        values = counted.unsqueeze(-2).expand(*index.shape, SUMS)
        self.stat_sums.index_add_(0, index.reshape(-1), values.reshape(-1, SUMS))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Per index ``(stat sums..., rows, fired at admission)`` as float64 rows."""
        fired = self.fired_at_admission.index_select(0, slots).double().unsqueeze(1)
        return torch.cat([self.stat_sums.index_select(0, slots), fired], 1)


@dataclass
class ReceiptReads:
    """Receipt sums of some steering-item slots (sorted), and every site's ``fired`` count."""

    slots: np.ndarray
    sums: torch.Tensor  # per slot: stat sums (ROW_STATS of them), rows, fired at admission
    fired: torch.Tensor  # per site table index


class SteeringReceipts:
    """Per steering-item slot: row-stat sums, rows counted and ``fired`` at admission (device).

    ``sites`` lists the site indices in the router's table order.  Without ``collect`` items
    get slots (the routing tables need them) but nothing is summed on the device.
    """

    def __init__(self, runtime: HookRuntime, sites: list[int], *, collect: bool, cuda: bool) -> None:
        self.runtime = runtime
        self.sites = sites
        self.table_of_site = {site: j for j, site in enumerate(sites)}
        self.collect = collect
        self.cuda = cuda
        self.items = Slots()
        self.sums = ReceiptAccumulators(runtime.device)
        self.admitted: list[SteerItem] = []  # steering items whose fired count is not yet recorded

    def admit(self, item: SteerItem) -> None:
        item.slot = self.items.take()
        if self.collect:
            self.sums.ensure(item.slot + 2)
            self.admitted.append(item)

    def flush_admissions(self) -> None:
        """Record the newly admitted steering items' site ``fired`` counts, before their first step."""
        if not self.admitted:
            return
        items, self.admitted = self.admitted, []
        slots = np.array([item.slot + 1 for item in items], dtype=np.int64)
        tables = np.array([self.table_of_site[item.site] for item in items], dtype=np.int64)
        index = device_index(np.concatenate([slots, tables]), self.runtime.device, self.cuda)
        self.sums.admit(index[: len(items)], self.fired_counts().index_select(0, index[len(items) :]))

    def fired_counts(self) -> torch.Tensor:
        """Every site's ``fired`` counter, in site-table order, as one device tensor."""
        return torch.cat([self.runtime.sites[site].fired for site in self.sites])

    def add_rows(self, index: torch.Tensor, stats: torch.Tensor, *, steps: int = 1) -> None:
        """Sum steered rows: ``index[t, r, k]`` is the slot + 1 of the item that stage ``k`` of
        row ``r`` counts toward at the t-th site (0: none), ``stats[t, r]`` its ``row_stats``
        (float64) summed over the ``steps`` steps that routed the rows alike."""
        self.sums.add(index, stats, steps)

    def read(self, items: list[SteerItem], to_host: Callable[[torch.Tensor], torch.Tensor]) -> ReceiptReads | None:
        """The receipt sums of ``items`` and the sites' ``fired`` counts, copied by ``to_host``."""
        if not items:
            return None
        self.flush_admissions()  # an item admitted since the last step still needs its count
        slots = np.sort(np.array([item.slot for item in items], dtype=np.int64))
        sums = self.sums.read(device_index(slots + 1, self.runtime.device, self.cuda))
        return ReceiptReads(slots, to_host(sums), to_host(self.fired_counts()))

    def settle(self, items: list[SteerItem], reads: ReceiptReads | None) -> None:
        """Copy the sums, row counts and ``fired`` in ``reads`` (None: nothing collected) into ``items``."""
        if reads is None:
            return
        for item in items:
            *sums, rows, fired_then = reads.sums.numpy()[int(np.searchsorted(reads.slots, item.slot))]
            item.sums = np.array(sums)
            item.rows = int(rows)
            item.fired = int(reads.fired.numpy()[self.table_of_site[item.site]]) > int(fired_then)

    def free(self, items: list[SteerItem]) -> None:
        for item in items:
            self.items.free.append(item.slot)
            item.slot = -1
