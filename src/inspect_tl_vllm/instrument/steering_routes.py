"""Steering tables expanded on the device, so that a step costs the host O(requests that changed).

A hook reads one table row per token (``runtime.py``).  For small models a decode step leaves the
host little time beside vLLM's own work, so those rows are not built on the host, which would
mean numpy work over every steered row and a copy per site on every step.  Instead each steered
request's stages are written to the device once, when it is admitted, into tables indexed by
request slot: per site table and stage, the stage's nine
numbers, the range of positions it covers (or a listed-positions id) and the receipt slot its
rows count toward.  Before a step the router hands over each token row's request slot and
position, both on the device (vLLM computes the positions there anyway), and a few gathers
write the steered sites' per-row tables; a decode step whose rows belong to the same requests
as the last one's keeps them as they are.  After each step the steered rows' ``row_stats`` are
summed per row on the device, and one index kernel adds the sums and the step count into their
receipts when the rows change or results are read: a run of such repeated decode steps costs
the host one kernel launch a step.  None of it reads back from the device or loops over
requests in Python.  The tables take a few MB of device memory (a ``max_stack`` x 8 floats and
4 integers per site and live request), outside vLLM's budget.

Index 0 of every slot-indexed table is "no steered request": it covers no position, so rows
of plain requests (and of requests without steering at a site) get the identity stage and
pass through bit for bit.  A request slot ``s`` lives at index ``s + 1``; so does a receipt slot.

Rows a request recomputes after preemption are steered again but counted once: the router,
which knows each request's highest position on the host, hands over which rows are new
(``fresh``) in the rare step that has any others.
"""

from __future__ import annotations

import numpy as np
import torch

from inspect_tl_vllm.instrument.pooling import device_index
from inspect_tl_vllm.instrument.request_state import RequestState, SteerItem
from inspect_tl_vllm.instrument.runtime import IDENTITY_STAGE, HookRuntime
from inspect_tl_vllm.instrument.site_op import STAGE_WIDTH
from inspect_tl_vllm.instrument.steering_receipts import SteeringReceipts
from inspect_tl_vllm.specs import MAX_POSITION

SPAN = 4  # integers per stage entry besides its stage numbers: lo, hi, listed id, receipt index
LISTED_STRIDE = MAX_POSITION + 1  # a listed position's key: listed id * stride + position
UNBOUNDED = np.iinfo(np.int64).max
GATHER_ENTRIES = 1 << 19  # (site, row, stage) entries expanded at once: ~50 MB of temporaries at most


class SteeringRoutes:
    """Per request slot, what it steers at each site; expanded into the sites' tables every step.

    ``sites`` lists the site indices in the router's table order.  ``receipts`` counts the
    steered rows when ``collect`` is set (tensor-parallel rank 0).
    """

    def __init__(self, runtime: HookRuntime, sites: list[int], receipts: SteeringReceipts, *, collect: bool) -> None:
        self.runtime = runtime
        self.sites = sites
        self.table_of_site = {site: j for j, site in enumerate(sites)}
        self.receipts = receipts
        self.collect = collect
        self.stack = runtime.max_stack
        self.device = runtime.device
        self.cuda = self.device.type == "cuda"
        self.identity = torch.tensor(IDENTITY_STAGE, device=self.device)
        self.capacity = 0
        # per site table, slot index and stage: (lo, hi, listed id, receipt index); the stage
        # covers positions lo <= p < hi, or the listed id's positions when that is >= 0
        self.empty_span = torch.tensor([0, 0, -1, 0], dtype=torch.int64, device=self.device)
        self.stages = self.spans = torch.empty(0)
        self._grow(64)
        self.users = np.zeros(len(sites), dtype=np.int64)  # live steering items per site table
        self.used: list[int] = []  # site tables with live steering items
        self._used_index = torch.empty(0, dtype=torch.int64)
        self._to_clear: set[int] = set()  # site tables that lost their last item: reset to identity
        self._admitted: list[RequestState] = []
        self._listed: dict[int, np.ndarray] = {}  # listed id -> keys of its positions
        self._listed_keys: torch.Tensor | None = None
        self._listed_changed = False
        # per group of steered site tables: the receipt index of each row's stages, as routed
        # (``_routed``) and as counted (``_counted``: rows recomputed after preemption left out)
        self._routed: list[tuple[list[int], torch.Tensor | None]] = []
        self._counted: list[tuple[list[int], torch.Tensor]] = []
        # per group of ``_counted``: the row_stats of the ``_pending`` steps since, summed per row
        self._sums: list[torch.Tensor] = []
        self._pending = 0
        self._stepped = False  # ``begin`` routed the step that ``end`` closes

    # -- requests -------------------------------------------------------------------------
    def admit(self, state: RequestState) -> None:
        """``state`` (slot taken, items' receipt slots taken) starts steering at the next step."""
        for item in state.steer:
            self._use(self.table_of_site[item.site], +1)
            if item.scope.kind == "listed":
                positions = np.array(sorted(p for p in item.scope.listed if p >= 0), dtype=np.int64)
                self._listed[item.slot] = item.slot * LISTED_STRIDE + positions
                self._listed_changed = True
        self._admitted.append(state)

    def retire(self, state: RequestState) -> None:
        """``state`` left the batch for good; its slot's entries are overwritten when reused."""
        for item in state.steer:
            self._use(self.table_of_site[item.site], -1)
            if self._listed.pop(item.slot, None) is not None:
                self._listed_changed = True

    def _use(self, table: int, change: int) -> None:
        self.users[table] += change
        if (self.users[table] > 0) != (table in self.used):
            self.used = np.nonzero(self.users)[0].tolist()
            self._used_index = device_index(np.array(self.used), self.device, self.cuda)
            if self.users[table] == 0:
                self._to_clear.add(table)
            else:
                self._to_clear.discard(table)

    @property
    def active(self) -> bool:
        return bool(self.used or self._to_clear or self._admitted)

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity - 1`` request slots (index 0 is the no-request row); doubling, values kept."""
        old = self.capacity
        tables, stack = len(self.sites), self.stack
        stages = self.identity.repeat(tables, capacity, stack, 1)
        spans = self.empty_span.repeat(tables, capacity, stack, 1)
        if old:
            stages[:, :old] = self.stages
            spans[:, :old] = self.spans
        self.stages, self.spans = stages, spans
        self.capacity = capacity

    def _write_admissions(self) -> None:
        """Write the admitted requests' entries: their slots' spans are emptied (a stale stage is
        then never used), then each item's stage and span filled in."""
        states = [state for state in self._admitted if state.slot >= 0]  # not retired and freed already
        self._admitted = []
        if not states:
            return
        top = max(state.slot for state in states) + 1
        if top >= self.capacity:
            self._grow(max(2 * self.capacity, top + 1))
        items = [(state, item) for state in states for item in state.steer]
        entries = np.array([self._entry(state, item) for state, item in items], dtype=np.int64).reshape(-1, 3 + SPAN)
        cleared = [state.slot + 1 for state in states]
        numbers = device_index(np.concatenate([entries.T.ravel(), cleared]), self.device, self.cuda)
        stage_rows = torch.from_numpy(np.array([item.stage_row for _, item in items], dtype=np.float32))
        if self.cuda:
            stage_rows = stage_rows.pin_memory().to(self.device, non_blocking=True)
        n = len(items)
        slots = numbers[(3 + SPAN) * n :]
        self.spans[:, slots] = self.empty_span
        table, slot, stage = numbers[:n], numbers[n : 2 * n], numbers[2 * n : 3 * n]
        self.stages[table, slot, stage] = stage_rows.view(n, STAGE_WIDTH)
        self.spans[table, slot, stage] = numbers[3 * n : (3 + SPAN) * n].view(SPAN, n).T

    def _entry(self, state: RequestState, item: SteerItem) -> tuple[int, ...]:
        """(site table, slot index, stage) of one item, then its span (lo, hi, listed id, receipt index)."""
        kind, prompt_len = item.scope.kind, state.prompt_len
        lo = prompt_len if kind == "generated" else 0
        hi = {"all": UNBOUNDED, "generated": UNBOUNDED, "prompt": prompt_len}.get(kind, 0)
        listed = item.slot if kind == "listed" else -1
        return (self.table_of_site[item.site], state.slot + 1, item.stage, lo, hi, listed, item.slot + 1)

    # -- per step -------------------------------------------------------------------------
    def begin(
        self,
        slot_of_row: torch.Tensor,
        positions: torch.Tensor,
        *,
        same_rows: bool = False,
        fresh: torch.Tensor | None = None,
    ) -> None:
        """Write this step's rows of every steered site's table (``slot_of_row``: each row's
        request slot + 1, 0 for a plain request; ``positions``: each row's position; ``fresh``:
        whether each row is new, None when all are).

        ``same_rows``: the rows are the last step's requests' next rows, one generated row each
        in both steps (the router's ``_compare_with_last_step``), all new in both, so with no
        listed positions the tables already hold them: coverage of a prompt/generated/all scope
        cannot change within the generated tokens.  The rows then count toward the same
        receipts too."""
        changed = bool(self._admitted or self._listed_changed or self._to_clear)
        self._stepped = True
        if same_rows and not changed and self._listed_keys is None and self._routed:
            return
        self.flush()
        if self._admitted:
            self._write_admissions()
        if self._listed_changed:
            self._upload_listed()
        for table in self._to_clear:
            self.runtime.sites[self.sites[table]].table[:] = self.identity
        self._to_clear.clear()
        self._routed = self._counted = []
        if not self.used or slot_of_row.shape[0] == 0:
            return
        self._routed = self._expand(slot_of_row, positions)
        if self.collect:
            keep = None if fresh is None else fresh[None, :, None]
            self._counted = [
                (group, receipt if keep is None else torch.where(keep, receipt, 0))
                for group, receipt in self._routed
                if receipt is not None
            ]

    def _expand(
        self, slot_of_row: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[list[int], torch.Tensor | None]]:
        """Write the steered sites' tables for these rows; per group of sites, the receipt slot
        + 1 that each row's stages count toward (0: not steered), or None when nothing is counted."""
        rows = slot_of_row.shape[0]
        routed = []
        per_group = max(1, GATHER_ENTRIES // (rows * self.stack))
        for start in range(0, len(self.used), per_group):
            group = self.used[start : start + per_group]
            index = self._used_index[start : start + per_group]
            spans = self.spans[index[:, None], slot_of_row[None, :]]  # [group, rows, stack, SPAN]
            covered = self._covered(spans, positions)
            stages = torch.where(covered[..., None], self.stages[index[:, None], slot_of_row[None, :]], self.identity)
            for k, table in enumerate(group):
                self.runtime.sites[self.sites[table]].table[:rows].copy_(stages[k])
            routed.append((group, torch.where(covered, spans[..., 3], 0) if self.collect else None))
        return routed

    def _covered(self, spans: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Whether each stage entry covers its row's position."""
        at = positions[None, :, None]
        covered = (at >= spans[..., 0]) & (at < spans[..., 1])
        if self._listed_keys is not None:
            listed = spans[..., 2]
            keys = listed * LISTED_STRIDE + at
            found = torch.searchsorted(self._listed_keys, keys).clamp_(max=self._listed_keys.numel() - 1)
            covered |= (listed >= 0) & (self._listed_keys[found] == keys)
        return covered

    def _upload_listed(self) -> None:
        self._listed_changed = False
        if not self._listed:
            self._listed_keys = None
            return
        keys = np.sort(np.concatenate(list(self._listed.values())))
        self._listed_keys = device_index(keys, self.device, self.cuda) if keys.size else None

    def end(self) -> None:
        """Sum this step's steered rows' ``row_stats`` (written by the forward pass) per row;
        ``flush`` adds them to the receipts.  A step that vLLM ends before routing it (one that
        schedules no tokens) has none."""
        if not self._stepped:
            return
        self._stepped = False
        for k, (group, receipt) in enumerate(self._counted):
            rows = receipt.shape[1]
            if len(group) == 1:
                stats = self.runtime.sites[self.sites[group[0]]].row_stats[None, :rows]
            else:
                stats = torch.stack([self.runtime.sites[self.sites[table]].row_stats[:rows] for table in group])
            if self._pending:
                self._sums[k].add_(stats)
            else:
                self._sums.append(stats.double())
        if self._counted:
            self._pending += 1

    def flush(self) -> None:
        """Add the row stats summed since the rows were routed, and the step count, to the
        receipts (before a step routes other rows, and before receipts are read, which may
        happen outside the step's inference mode; the receipt sums are inference tensors)."""
        if self._pending:
            with torch.inference_mode():
                for (_, receipt), sums in zip(self._counted, self._sums, strict=True):
                    self.receipts.add_rows(receipt, sums, steps=self._pending)
        self._sums = []
        self._pending = 0
