"""Host side of the hooks: per-step routing tables, and harvesting what the hooks saw.

Before each forward step the worker tells ``begin_step`` where each live instrumented
request sits in vLLM's batch.  The router writes each steered row's stage parameters into
pinned host tables and copies the rows in use to the device, one transfer per site whose
table changed; a step with nothing requested does no work at all.

The per-step cost must not grow with Python work per request: at 256 concurrent requests a
decode step of an 8B model takes ~11 ms on an H200, and vLLM's own host work uses most of
that.  So the live requests are kept as arrays (``_Layout``, rebuilt only when a request
is admitted or retired), their counters live in the router's arrays under integer slots,
and a decode step (one row per request) is a few numpy operations over all of them.
Prefill chunks, listed positions and per-token captures take a per-request path.

After the step, ``end_step`` folds pooled captures into device accumulators (``pooling.py``),
adds the steered rows' norm changes to device-side receipt sums (``receipts.py``), and
*launches* the copies of per-token captures into pinned host memory without waiting, so
vLLM's asynchronous scheduling keeps the GPU busy; copies are accounted once their event has
completed (checked without blocking), or when results are fetched.

Those copies go into pinned blocks of at most ``HOST_CHUNK_BYTES`` each.  Torch's pinned
host pool caches blocks by power-of-two size and never splits one, so copies of whole
prefill steps (a different size every step, up to 128 MiB per site for an 8B model) left
cached blocks of the wrong sizes idle while it made new ones: 66 new blocks took 2.6 s of
one round's step loop (docs/BENCHMARKS.md, round 6).  In fixed chunks every large copy
reuses the same blocks, and the pool grows only when more rows are held at once than before.

Rows that a request recomputes after preemption are steered again but counted and captured
only once (a position at or below the highest one already seen is skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.plans import SCOPE_CODES, CaptureItem, RequestState, SteerItem, scopes_cover
from inspect_tl_vllm.instrument.pooling import MODES, SiteAccumulators, device_index
from inspect_tl_vllm.instrument.receipts import ReceiptAccumulators
from inspect_tl_vllm.instrument.runtime import IDENTITY_STAGE, HookRuntime

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
MAX_IN_FLIGHT = 8  # launched copies not yet accounted; beyond this the host waits for the oldest
HOST_CHUNK_BYTES = 8 << 20  # largest pinned block a per-token copy takes (module docstring)


@dataclass
class _Layout:
    """The live requests as arrays; index ``k`` is the k-th live state."""

    states: list[RequestState]
    slot: np.ndarray  # request slot
    steered: np.ndarray  # bool
    capture_kind: np.ndarray  # scope code of the capture, -1 without one
    prompt_len: np.ndarray
    pooled: np.ndarray  # bool: pooled captures (reduced on the device)
    per_token: list[int]  # states with per-token captures (host path)
    # steering items, flattened over the live requests
    s_state: np.ndarray
    s_slot: np.ndarray
    s_site: np.ndarray
    s_table: np.ndarray  # index of the site's host table
    s_stage: np.ndarray
    s_row: np.ndarray  # (n, 4) stage parameters
    s_kind: np.ndarray
    s_items: list[SteerItem]
    s_listed: list[int]  # item indices whose scope lists positions
    # pooled capture items, flattened
    p_state: np.ndarray
    p_site: np.ndarray
    p_mode: np.ndarray

    @classmethod
    def build(cls, states: list[RequestState], table_of_site: dict[int, int]) -> _Layout:
        steer = [(k, item) for k, state in enumerate(states) for item in state.steer]
        pooled = [
            (k, item.site, MODES[state.reduce])
            for k, state in enumerate(states)
            if state.pooled
            for item in state.capture
        ]
        capture_kind = [s.capture_scope.code if s.capture and s.capture_scope else -1 for s in states]
        return cls(
            states=states,
            slot=np.array([s.slot for s in states], dtype=np.int64),
            steered=np.array([bool(s.steer) for s in states], dtype=bool),
            capture_kind=np.array(capture_kind, dtype=np.int64),
            prompt_len=np.array([s.prompt_len for s in states], dtype=np.int64),
            pooled=np.array([s.pooled for s in states], dtype=bool),
            per_token=[k for k, s in enumerate(states) if s.capture and not s.pooled],
            s_state=np.array([k for k, _ in steer], dtype=np.int64),
            s_slot=np.array([item.slot for _, item in steer], dtype=np.int64),
            s_site=np.array([item.site for _, item in steer], dtype=np.int64),
            s_table=np.array([table_of_site[item.site] for _, item in steer], dtype=np.int64),
            s_stage=np.array([item.stage for _, item in steer], dtype=np.int64),
            s_row=np.array([item.stage_row for _, item in steer], dtype=np.float32).reshape(-1, 4),
            s_kind=np.array([item.scope.code for _, item in steer], dtype=np.int64),
            s_items=[item for _, item in steer],
            s_listed=[m for m, (_, item) in enumerate(steer) if item.scope.kind == "listed"],
            p_state=np.array([k for k, _, _ in pooled], dtype=np.int64),
            p_site=np.array([site for _, site, _ in pooled], dtype=np.int64),
            p_mode=np.array([mode for _, _, mode in pooled], dtype=np.int64),
        )


@dataclass
class _StepWork:
    """What a step's harvest must account; arrays are concatenated at launch."""

    steer: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)  # item slots, sites, rows
    pooled: list[tuple[np.ndarray, ...]] = field(default_factory=list)  # sites, modes, rows, slots, positions
    per_token: list[tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.steer or self.pooled or self.per_token)


@dataclass
class _InFlight:
    """Device-to-host copies launched after a step, or when requests retire."""

    per_token: list[tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]] = field(default_factory=list)
    captured: dict[int, tuple[np.ndarray, list[torch.Tensor]]] = field(default_factory=dict)  # site -> rows, chunks
    retired: list[RequestState] = field(default_factory=list)
    pooled_reads: dict[int, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)  # site -> slots, data
    receipt_reads: _ReceiptReads | None = None
    event: Any = None


@dataclass
class _ReceiptReads:
    """Receipt sums of some steering-item slots (sorted), and every site's ``fired`` count."""

    slots: np.ndarray
    sums: torch.Tensor  # per slot: norm sum, fired at admission
    fired: torch.Tensor  # per site table index


class _Slots:
    """Integer slots with a free list, and the growable counter arrays they index."""

    def __init__(self, **arrays: tuple[Any, Any]) -> None:
        self.fill = {name: value for name, (_, value) in arrays.items()}
        self.arrays = {name: np.full(64, value, dtype=dtype) for name, (dtype, value) in arrays.items()}
        self.free: list[int] = []
        self.next = 0

    def take(self) -> int:
        slot = self.free.pop() if self.free else self.next
        if slot == self.next:
            self.next += 1
        size = len(next(iter(self.arrays.values())))
        if slot >= size:
            for name, array in self.arrays.items():
                grown = np.full(2 * size, self.fill[name], dtype=array.dtype)
                grown[:size] = array
                self.arrays[name] = grown
        for name, array in self.arrays.items():
            array[slot] = self.fill[name]
        return slot

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


class StepRouter:
    """Fills the sites' routing tables before a step and harvests after it.

    ``collect=False`` (tensor-parallel ranks other than 0, which hold the same residual
    stream) steers but records nothing.  ``on_capture_complete`` receives each request
    whose per-token capture is complete before the request ends (a scope inside the prompt),
    as soon as its last rows are on the host.  ``chunk_rows`` (default: what fits in
    ``HOST_CHUNK_BYTES``) is the most rows one host copy holds.
    """

    def __init__(
        self,
        runtime: HookRuntime,
        *,
        collect: bool = True,
        on_capture_complete: Callable[[RequestState], None] | None = None,
        chunk_rows: int | None = None,
    ) -> None:
        self.runtime = runtime
        self.collect = collect
        self.on_capture_complete = on_capture_complete
        row_bytes = runtime.hidden_size * runtime.act_dtype.itemsize
        self.chunk_rows = chunk_rows or max(1, HOST_CHUNK_BYTES // row_bytes)
        self.cuda = runtime.device.type == "cuda"
        self.sites = sorted(runtime.sites)
        self.table_of_site = {site: j for j, site in enumerate(self.sites)}
        first = next(iter(runtime.sites.values()), None)
        shape = (len(self.sites), *(first.table.shape if first is not None else (0, 0, 4)))
        self.host = torch.tensor(IDENTITY_STAGE).repeat(*shape[:-1], 1)
        if self.cuda:
            self.host = self.host.pin_memory()
        self._table = self.host.numpy()
        self._identity = np.array(IDENTITY_STAGE, dtype=np.float32)
        self._dirty = np.zeros(len(self.sites), dtype=np.int64)  # rows of each table holding non-defaults
        self._live: dict[int, RequestState] = {}  # request slot -> state, in admission order
        self._layout: _Layout | None = None
        self._requests = _Slots(seen=(np.int64, -1), captured=(np.int64, 0), pending=(np.int64, -1))
        self._items = _Slots(rows=(np.int64, 0))  # steered rows counted per steering item
        self._receipts = ReceiptAccumulators(runtime.device)
        self._admitted: list[SteerItem] = []  # steering items whose fired count is not yet recorded
        self._pools: dict[int, SiteAccumulators] = {}
        self._resets: dict[int, list[int]] = {}  # site -> slots whose accumulators must be zeroed
        self._retiring: list[RequestState] = []
        self._work: _StepWork | None = None
        self._in_flight: list[_InFlight] = []
        self.max_requests_steered_in_one_step = 0  # evidence that batches really mix specs

    # -- requests -------------------------------------------------------------------------
    @property
    def states(self) -> list[RequestState]:
        """The live requests; ``begin_step`` takes their batch indices in this order."""
        return self._current_layout().states

    def admit(self, state: RequestState) -> None:
        state.slot = self._requests.take()
        for item in state.steer:
            item.slot = self._items.take()
            if self.collect:
                self._receipts.ensure(item.slot + 1)
                self._admitted.append(item)
        if self.collect and state.pooled:
            for item in state.capture:
                pool = self._pools.setdefault(
                    item.site, SiteAccumulators(self.runtime.hidden_size, self.runtime.device)
                )
                pool.ensure(state.slot + 1)
                self._resets.setdefault(item.site, []).append(state.slot)
        self._live[state.slot] = state
        self._layout = None

    def retire(self, state: RequestState) -> None:
        """The request left vLLM: settle its numbers once the copies in flight have landed."""
        if self._live.pop(state.slot, None) is not None:
            self._layout = None
            self._retiring.append(state)

    def _current_layout(self) -> _Layout:
        if self._layout is None:
            self._layout = _Layout.build(list(self._live.values()), self.table_of_site)
        return self._layout

    # -- before the step ------------------------------------------------------------------
    def begin_step(self, batch_index: np.ndarray, query_start: np.ndarray, computed: np.ndarray) -> None:
        """Route one step.  ``batch_index[k]`` is the vLLM batch index of ``states[k]`` (-1:
        not scheduled); ``query_start`` and ``computed`` are the runner's per-request row
        offsets and computed-token counts."""
        table = self._table
        for j in np.nonzero(self._dirty)[0]:
            table[j, : self._dirty[j]] = self._identity
        self._flush_resets()
        self._flush_admissions()
        if self._retiring:
            self._in_flight.append(self._launch_retire(self._retiring))
            self._retiring = []
        used = np.zeros_like(self._dirty)
        work = _StepWork()
        layout = self._current_layout()
        if layout.states:
            self._route(layout, batch_index, query_start, computed, used, work)
        for j in np.nonzero(np.maximum(used, self._dirty))[0]:
            span = int(max(used[j], self._dirty[j]))
            site = self.runtime.sites[self.sites[j]]
            site.table[:span].copy_(self.host[j, :span], non_blocking=True)
        self._dirty = used
        self._work = work if self.collect and work else None

    def _route(
        self,
        layout: _Layout,
        batch_index: np.ndarray,
        query_start: np.ndarray,
        computed: np.ndarray,
        used: np.ndarray,
        work: _StepWork,
    ) -> None:
        present = batch_index >= 0
        index = np.where(present, batch_index, 0)
        starts = query_start[index].astype(np.int64)
        counts = np.where(present, query_start[index + 1] - starts, 0)
        first = computed[index].astype(np.int64)
        active = counts > 0
        decode = active & (counts == 1)
        seen = self._requests["seen"][layout.slot]
        fresh = first > seen  # for decode rows: the row is new (not a recomputation)
        self.max_requests_steered_in_one_step = max(
            self.max_requests_steered_in_one_step, int(np.count_nonzero(active & layout.steered))
        )
        if len(layout.s_state):
            self._steer_decode(layout, decode, starts, first, fresh, used, work)
        if self.collect and (layout.per_token or layout.pooled.any()):
            captured = self._captured_decode_rows(layout, decode, first, fresh)
            if (captured & layout.pooled).any():
                self._pool_decode(layout, captured & layout.pooled, starts, first, work)
            for k in layout.per_token:
                state = layout.states[k]
                if captured[k] and state.error is None:
                    rows, positions = starts[k : k + 1], first[k : k + 1]
                    work.per_token.extend((state, item, rows, positions) for item in state.capture)
        for k in np.nonzero(active & ~decode)[0]:
            self._route_block(layout.states[k], int(starts[k]), int(counts[k]), int(first[k]), int(seen[k]), used, work)
        self._requests["seen"][layout.slot[active]] = np.maximum(seen[active], first[active] + counts[active] - 1)

    def _steer_decode(
        self,
        layout: _Layout,
        decode: np.ndarray,
        starts: np.ndarray,
        first: np.ndarray,
        fresh: np.ndarray,
        used: np.ndarray,
        work: _StepWork,
    ) -> None:
        """Decode rows of every steered request at once: one fancy-indexed table write."""
        owner = layout.s_state
        pos = first[owner]
        covered = scopes_cover(layout.s_kind, layout.prompt_len[owner], pos)
        for m in layout.s_listed:
            covered[m] = layout.s_items[m].scope.covers(int(pos[m]))
        chosen = decode[owner] & covered
        if not chosen.any():
            return
        rows = starts[owner[chosen]]
        tables = layout.s_table[chosen]
        self._table[tables, rows, layout.s_stage[chosen]] = layout.s_row[chosen]
        np.maximum.at(used, tables, rows + 1)
        counted = fresh[owner[chosen]]
        if self.collect and counted.any():
            work.steer.append((layout.s_slot[chosen][counted], layout.s_site[chosen][counted], rows[counted]))

    def _captured_decode_rows(
        self, layout: _Layout, decode: np.ndarray, first: np.ndarray, fresh: np.ndarray
    ) -> np.ndarray:
        """Per live request: whether its decode row this step is new and inside its capture scope."""
        kind = layout.capture_kind
        captured = decode & fresh & (kind >= 0)
        covered = scopes_cover(kind, layout.prompt_len, first)
        for k in np.nonzero(captured & (kind == SCOPE_CODES["listed"]))[0]:
            covered[k] = layout.states[k].capture_scope.covers(int(first[k]))
        return captured & covered

    def _pool_decode(
        self, layout: _Layout, captured: np.ndarray, starts: np.ndarray, first: np.ndarray, work: _StepWork
    ) -> None:
        """Decode rows of every pooled capture at once (``captured``: the requests whose row counts)."""
        np.add.at(self._requests["captured"], layout.slot[captured], 1)
        take = captured[layout.p_state]
        owner = layout.p_state[take]
        work.pooled.append((layout.p_site[take], layout.p_mode[take], starts[owner], layout.slot[owner], first[owner]))

    def _route_block(
        self, state: RequestState, start: int, count: int, first: int, seen: int, used: np.ndarray, work: _StepWork
    ) -> None:
        """A prefill chunk (or a recomputation after preemption): numpy masks over its rows."""
        positions = first + np.arange(count, dtype=np.int64)
        fresh = positions > seen
        for item in state.steer:
            mask = item.scope.mask(positions)
            rows = start + np.nonzero(mask)[0]
            if rows.size == 0:
                continue
            j = self.table_of_site[item.site]
            self._table[j, rows, item.stage] = item.stage_row
            used[j] = max(used[j], int(rows[-1]) + 1)
            counted = start + np.nonzero(mask & fresh)[0]
            if self.collect and counted.size:
                work.steer.append((np.full(counted.size, item.slot), np.full(counted.size, item.site), counted))
        if not (self.collect and state.capture and state.error is None and state.capture_scope is not None):
            return
        idx = np.nonzero(state.capture_scope.mask(positions) & fresh)[0]
        if idx.size == 0:
            return
        rows, kept = start + idx, positions[idx]
        if state.pooled:
            self._requests["captured"][state.slot] += idx.size
            mode = MODES[state.reduce]
            for item in state.capture:
                n = idx.size
                work.pooled.append(
                    (np.full(n, item.site), np.full(n, mode), rows, np.full(n, state.slot, dtype=np.int64), kept)
                )
        else:
            work.per_token.extend((state, item, rows, kept) for item in state.capture)

    def _flush_resets(self) -> None:
        for site, slots in self._resets.items():
            if slots:
                self._pools[site].reset(device_index(np.array(slots), self.runtime.device, self.cuda))
        self._resets.clear()

    def _flush_admissions(self) -> None:
        """Record the newly admitted steering items' site ``fired`` counts, before their first step."""
        if not self._admitted:
            return
        items, self._admitted = self._admitted, []
        slots = np.array([item.slot for item in items], dtype=np.int64)
        tables = np.array([self.table_of_site[item.site] for item in items], dtype=np.int64)
        index = device_index(np.concatenate([slots, tables]), self.runtime.device, self.cuda)
        self._receipts.admit(index[: len(items)], self._fired_counts().index_select(0, index[len(items) :]))

    def _fired_counts(self) -> torch.Tensor:
        """Every site's ``fired`` counter, in site-table order, as one device tensor."""
        return torch.cat([self.runtime.sites[site].fired for site in self.sites])

    # -- after the step -------------------------------------------------------------------
    def end_step(self) -> None:
        """Fold and launch what this step's requests need; account earlier steps' copies."""
        work, self._work = self._work, None
        flight = self._launch(work) if work else None
        if flight is not None:
            self._in_flight.append(flight)
        # Account what has landed without waiting for the device; wait only when too much is in flight.
        while self._in_flight and (len(self._in_flight) > MAX_IN_FLIGHT or _landed(self._in_flight[0])):
            self._complete(self._in_flight.pop(0))

    def drain(self) -> None:
        """Account every launched copy (before results are read)."""
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def _launch(self, work: _StepWork) -> _InFlight | None:
        """Account a step on the device; only per-token rows need copies (a flight) to the host."""
        sites = self.runtime.sites
        if work.steer:  # receipts: rows counted here, norm changes summed on the device
            slots, site_of, rows = (np.concatenate(parts) for parts in zip(*work.steer, strict=True))
            np.add.at(self._items["rows"], slots, 1)
            for site in np.unique(site_of).tolist():
                mine = site_of == site
                n = int(np.count_nonzero(mine))
                index = device_index(np.concatenate([slots[mine], rows[mine]]), self.runtime.device, self.cuda)
                self._receipts.add(index[:n], sites[site].norm_delta.index_select(0, index[n:]))
        if work.pooled:
            self._fold_pooled(*(np.concatenate(parts) for parts in zip(*work.pooled, strict=True)))
        if not work.per_token:
            return None
        flight = _InFlight(per_token=work.per_token)
        # A request's entries (one per hook) share one rows array, and most sites see the same
        # requests, so the rows of a site are worked out once per distinct set of requests:
        # the sites that share it share one array, which ``_complete`` relies on.
        arrays_of_site: dict[int, dict[int, np.ndarray]] = {}
        for _, item, rows, _ in work.per_token:
            arrays_of_site.setdefault(item.site, {})[id(rows)] = rows
        rows_of: dict[tuple[int, ...], tuple[np.ndarray, slice | None]] = {}  # -> (rows, their span if copied whole)
        for site, arrays in arrays_of_site.items():
            key = tuple(arrays)
            if key not in rows_of:
                rows = np.unique(np.concatenate(list(arrays.values())))
                lo, hi = int(rows[0]), int(rows[-1]) + 1
                dense = 2 * rows.size >= hi - lo  # then one contiguous copy beats gathering
                rows_of[key] = (np.arange(lo, hi), slice(lo, hi)) if dense else (rows, None)
            rows, span = rows_of[key]
            staging = sites[site].staging
            if span is not None:
                source = staging[span]
            else:
                source = staging.index_select(0, device_index(rows, self.runtime.device, self.cuda))
            step = self.chunk_rows
            flight.captured[site] = (rows, [self._to_host(source[lo : lo + step]) for lo in range(0, len(rows), step)])
        flight.event = self._record()
        return flight

    def _fold_pooled(
        self, site_of: np.ndarray, mode_of: np.ndarray, rows: np.ndarray, slots: np.ndarray, positions: np.ndarray
    ) -> None:
        """Fold this step's pooled rows into the accumulators, keeping each request's newest
        row apart as its pending row (``plans.finish_pooled`` says why)."""
        pending = self._requests["pending"]
        order = np.lexsort((positions, slots))
        newest_of_slot: dict[int, int] = {}
        device = self.runtime.device
        for key in np.unique(site_of * len(MODES) + mode_of).tolist():
            site, mode = divmod(key, len(MODES))
            group = order[(site_of[order] == site) & (mode_of[order] == mode)]
            s, r, p = slots[group], rows[group], positions[group]
            newest = np.r_[s[1:] != s[:-1], True]  # per slot, the row with the highest position
            step_slots, step_rows = s[newest], r[newest]
            earlier = ~newest
            if mode == MODES["last"]:  # of the earlier rows only the last per slot matters
                earlier &= np.r_[newest[1:], False]
            carried = step_slots[pending[step_slots] >= 0]
            parts = [carried, r[earlier], s[earlier], step_slots, step_rows]
            index = device_index(np.concatenate(parts), device, self.cuda)
            bounds = np.cumsum([0, *(len(part) for part in parts)]).tolist()
            carried_t, earlier_rows, earlier_slots, step_slots_t, step_rows_t = (
                index[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            )
            pool, staging = self._pools[site], self.runtime.sites[site].staging
            if len(carried):
                pool.fold(mode, pool.pending, carried_t, carried_t)
            if earlier.any():
                pool.fold(mode, staging, earlier_rows, earlier_slots)
            pool.stash(staging, step_rows_t, step_slots_t)
            newest_of_slot.update(zip(step_slots.tolist(), p[newest].tolist(), strict=True))
        if newest_of_slot:
            pending[np.fromiter(newest_of_slot, np.int64)] = np.fromiter(newest_of_slot.values(), np.int64)

    def _launch_retire(self, states: list[RequestState]) -> _InFlight:
        """Read the retiring requests' pooled rows; their slots are freed once this lands."""
        flight = _InFlight(retired=states)
        flight.pooled_reads, flight.receipt_reads = self._read_results(states, self._to_host)
        flight.event = self._record()
        return flight

    def _read_results(
        self, states: list[RequestState], to_host: Any
    ) -> tuple[dict[int, tuple[np.ndarray, torch.Tensor]], _ReceiptReads | None]:
        """The pooled rows and receipt sums of ``states``, copied by ``to_host``: one read per
        site and one for all receipts, however many requests (each read is a device round trip)."""
        pooled_reads: dict[int, tuple[np.ndarray, torch.Tensor]] = {}
        if not self.collect:
            return pooled_reads, None
        for site, pool in self._pools.items():
            slots = np.sort(
                np.array([s.slot for s in states if s.pooled and any(c.site == site for c in s.capture)], np.int64)
            )
            if slots.size:
                pooled_reads[site] = (slots, to_host(pool.read(device_index(slots, pool.device, self.cuda))))
        return pooled_reads, self._read_receipts([item for s in states for item in s.steer], to_host)

    def _record(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return tensor.clone()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out

    def _complete(self, flight: _InFlight) -> None:
        if flight.event is not None:
            flight.event.synchronize()
        # Rows kept past this call leave pinned memory (a pageable copy), so that the pinned
        # blocks return to the allocator; unless every request in the flight completes its
        # capture here and hands its rows straight to ``on_capture_complete``.
        # A request's entries (one per hook) share its rows, so ask once per request.
        landing = {id(state): (state, positions) for state, _, _, positions in flight.per_token}
        closing = [state for state, positions in landing.values() if state.capture_closes_with(positions)]
        keep_pinned = self.on_capture_complete is not None and len(closing) == len(landing)
        copy = self.cuda and not keep_pinned
        host = {
            site: (rows, [chunk.clone() for chunk in chunks] if copy else chunks)
            for site, (rows, chunks) in flight.captured.items()
        }
        where: dict[tuple[int, int], list[_Piece]] = {}  # (site rows, request rows) -> where they lie
        for state, item, rows, positions in flight.per_token:
            site_rows, chunks = host[item.site]
            key = (id(site_rows), id(rows))
            if key not in where:
                where[key] = _pieces(np.searchsorted(site_rows, rows), self.chunk_rows)
            for chunk, index, part in where[key]:
                _keep_rows(state, item, chunks[chunk][index], positions[part], self.runtime.hidden_size)
        for state in closing if self.on_capture_complete is not None else ():
            if state.error is None:
                self.on_capture_complete(state)
            elif keep_pinned:  # the byte budget stopped it just now: its rows must not hold pinned memory
                for item in state.capture:
                    item.blocks = [(positions, rows.clone()) for positions, rows in item.blocks]
        for state in flight.retired:
            self._settle(state, flight.pooled_reads, flight.receipt_reads)
            self._free(state)

    # -- reading results ------------------------------------------------------------------
    def snapshot(self, states: list[RequestState]) -> None:
        """Copy still-live requests' counters and pooled rows into them (after ``drain``).

        All of them at once: a fetch of 256 live requests read one at a time cost 0.08 s of
        device round trips on an H200 (docs/BENCHMARKS.md, round 5)."""
        live = [state for state in states if state.slot >= 0]  # retired ones are already settled
        if not live:
            return
        reads, receipts = self._read_results(live, torch.Tensor.cpu)
        for state in live:
            self._settle(state, reads, receipts)

    def _read_receipts(self, items: list[SteerItem], to_host: Any) -> _ReceiptReads | None:
        """The receipt sums of ``items`` and the sites' ``fired`` counts, copied by ``to_host``."""
        if not items:
            return None
        self._flush_admissions()  # an item admitted since the last step still needs its count
        slots = np.sort(np.array([item.slot for item in items], dtype=np.int64))
        sums = self._receipts.read(device_index(slots, self.runtime.device, self.cuda))
        return _ReceiptReads(slots, to_host(sums), to_host(self._fired_counts()))

    def _settle(
        self,
        state: RequestState,
        reads: dict[int, tuple[np.ndarray, torch.Tensor]],
        receipts: _ReceiptReads | None,
    ) -> None:
        for item in state.steer:
            item.rows = int(self._items["rows"][item.slot])
            if receipts is not None:
                norm_sum, fired_then = receipts.sums.numpy()[int(np.searchsorted(receipts.slots, item.slot))]
                item.norm_delta_sum = float(norm_sum)
                item.fired = int(receipts.fired.numpy()[self.table_of_site[item.site]]) > int(fired_then)
        state.captured = int(self._requests["captured"][state.slot])
        state.pending_pos = int(self._requests["pending"][state.slot])
        width = self.runtime.hidden_size
        for item in state.capture if state.pooled else []:
            if item.site in reads:
                slots, data = reads[item.site]
                row = data.numpy()[int(np.searchsorted(slots, state.slot))]
                item.pooled = (row[:width].copy(), float(row[width]), row[width + 1 :].copy())

    def _free(self, state: RequestState) -> None:
        self._requests.free.append(state.slot)
        state.slot = -1
        for item in state.steer:
            self._items.free.append(item.slot)
            item.slot = -1


_Piece = tuple[int, slice | torch.Tensor, slice]  # chunk, rows within it, the matching part of the request's


def _pieces(at: np.ndarray, chunk_rows: int) -> list[_Piece]:
    """Where a request's rows (``at``: their increasing indices into the copied rows) lie
    in the host chunks: one piece per chunk they touch, a slice where they are contiguous."""
    chunk_of = at // chunk_rows
    bounds = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), at.size]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = int(chunk_of[a])
        local = at[a:b] - chunk * chunk_rows
        contiguous = local[-1] - local[0] + 1 == local.size
        index = slice(int(local[0]), int(local[-1]) + 1) if contiguous else torch.from_numpy(local)
        pieces.append((chunk, index, slice(a, b)))
    return pieces


def _landed(flight: _InFlight) -> bool:
    return flight.event is None or flight.event.query()


def _keep_rows(state: RequestState, item: CaptureItem, block: torch.Tensor, positions: np.ndarray, width: int) -> None:
    """Keep per-token rows, within the request's byte budget (counted in the requested dtype)."""
    if state.error is not None:
        return
    cost = block.shape[0] * width * _ITEMSIZE[state.dtype]
    if state.bytes_used + cost > state.max_bytes:
        state.error = (
            f"capture exceeded capture_bytes_per_request ({state.max_bytes} bytes) at position "
            f"{int(positions[0])}; capture fewer hook points or positions, or reduce per sample"
        )
        return
    state.bytes_used += cost
    item.blocks.append((positions, block))
    item.rows_kept += len(positions)
