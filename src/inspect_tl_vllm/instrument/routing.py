"""Per-step routing: which rows of vLLM's batch each live request's steering and captures touch.

Before each forward step the worker tells ``begin_step`` where each live instrumented
request sits in vLLM's batch, and hands over each token row's batch index and position as
device tensors (vLLM computes both there).  Steering is expanded on the device: each
request's stages were written there when it was admitted, and a few gathers per step write
the steered sites' per-row tables (``steering_routes.py``), so the host's part does not grow
with the number of requests or rows; only when the batch's membership or order changes does
the host write the map from batch index to request slot.  A step with nothing requested
does no work at all.

Captures are routed on the host: the live requests are kept as arrays (``slots.Layout``,
rebuilt only when a request is admitted or retired), their counters live in arrays under
integer slots (``slots.Slots``), and a decode step (one row per request) is a few numpy
operations over all of them.  Prefill chunks, listed positions and per-token captures take a
per-request path.  A step that repeats the last one (the same requests in the same batch
order, one generated row each: ``_compare_with_last_step``) reuses its routing, steering tables
and pooled folds alike, and only advances positions and counters.

After the step, ``end_step`` hands what the step's requests need to the modules that
account it, all without waiting for the device: steered rows' stats to device-side receipt
sums (``steering_receipts.py``), pooled captures to device accumulators
(``pooled_captures.py``), SAE captures to their encoding on the device
(``feature_captures.py``), and per-token captures to pinned host copies (``host_copies.py``)
that land a step or more later.  When a request retires, or its results are fetched, its
device counters are read back and settled into its ``RequestState``.

Rows that a request recomputes after preemption are steered again but counted and captured
only once (a position at or below the highest one already seen is skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from inspect_tl_vllm.instrument.feature_captures import FeatureCaptures, FeatureReads
from inspect_tl_vllm.instrument.host_copies import MAX_IN_FLIGHT, HostCopies, InFlight, PerToken
from inspect_tl_vllm.instrument.pooled_captures import PooledCaptures, PooledReads
from inspect_tl_vllm.instrument.pooling import MODES
from inspect_tl_vllm.instrument.request_state import SCOPE_CODES, RequestState, scopes_cover
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.instrument.slots import LAYOUT_COLUMNS, Layout, PooledItems, Slots
from inspect_tl_vllm.instrument.steering_receipts import ReceiptReads, SteeringReceipts
from inspect_tl_vllm.instrument.steering_routes import SteeringRoutes

STEP_KINDS = ("new_batch", "same_batch", "repeated")
"""How much of the last step's routing a step reused: none, the batch map, or all of it."""


@dataclass
class _StepWork:
    """What a step's harvest must account on the host's side; arrays are concatenated at launch."""

    pooled: list[tuple[np.ndarray, ...]] = field(default_factory=list)  # sites, modes, rows, slots, positions
    per_token: list[PerToken] = field(default_factory=list)
    features: list[tuple[np.ndarray, ...]] = field(default_factory=list)  # slots, rows, positions (SAE captures)
    repeat: bool = False  # pooled holds the last step's rows, one position on (``_route_repeat``)

    def __bool__(self) -> bool:
        return bool(self.pooled or self.per_token or self.features)


class StepRouter:
    """Fills the sites' routing tables before a step and harvests after it.

    ``collect=False`` (tensor-parallel ranks other than 0, which hold the same residual
    stream) steers but records nothing.  ``on_capture_complete`` receives each request
    whose per-token capture is complete before the request ends (a scope inside the prompt),
    as soon as its last rows are on the host.  ``chunk_rows`` (default: what fits in
    ``host_copies.HOST_CHUNK_BYTES``) is the most rows one host copy holds.
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
        self.cuda = runtime.device.type == "cuda"
        self.sites = sorted(runtime.sites)
        self.table_of_site = {site: j for j, site in enumerate(self.sites)}
        # batch index -> request slot + 1 of a steered request (0: none), on the host and the device
        self._slot_of_batch = torch.zeros(runtime.max_tokens + 1, dtype=torch.int64)
        if self.cuda:
            self._slot_of_batch = self._slot_of_batch.pin_memory()
        self._slot_of_batch_device = self._slot_of_batch.to(runtime.device)
        self._mapped = 0  # entries of the map that may be non-zero
        self._slot_of_row: torch.Tensor | None = None  # the last step's rows' request slots + 1
        self._last_batch: tuple[Layout, np.ndarray] | None = None  # the last step's layout and batch indices
        self._generated_rows = -1  # the last step's row count when each was an instrumented request's generated row
        self._steered_rows_fresh = False  # every steered row of the last step was new
        # the last step's capture work when a repeat can redo it: slots counted, pooled rows
        self._repeat: tuple[np.ndarray, tuple[np.ndarray, ...] | None] | None = None
        self._live: dict[int, RequestState] = {}  # request slot -> state, in admission order
        self._pooled_items: dict[int, PooledItems] = {}  # request slot -> its pooled captures
        self._layout: Layout | None = None
        self._requests = Slots(seen=(np.int64, -1), captured=(np.int64, 0), pending=(np.int64, -1), **LAYOUT_COLUMNS)
        self._receipts = SteeringReceipts(runtime, self.sites, collect=collect, cuda=self.cuda)
        self._steering = SteeringRoutes(runtime, self.sites, self._receipts, collect=collect)
        self._pooled = PooledCaptures(runtime, self.cuda)
        self._copies = HostCopies(runtime, on_capture_complete=on_capture_complete, chunk_rows=chunk_rows)
        self._features = FeatureCaptures(runtime, self.cuda, self._copies.to_host)
        self._retiring: list[RequestState] = []
        self._work: _StepWork | None = None
        self._in_flight: list[InFlight] = []
        self.max_requests_steered_in_one_step = 0  # evidence that batches really mix specs
        # steps routed, by ``STEP_KINDS``: benchmarks report how many reused the last step's routing
        self.step_kinds = dict.fromkeys(STEP_KINDS, 0)

    # -- requests -------------------------------------------------------------------------
    @property
    def states(self) -> list[RequestState]:
        """The live requests; ``begin_step`` takes their batch indices in this order."""
        return self._current_layout().states

    def admit(self, state: RequestState) -> None:
        state.slot = self._requests.take()
        for item in state.steer:
            self._receipts.admit(item)
        if state.steer:
            self._steering.admit(state)
        if self.collect and state.pooled:
            self._pooled.admit(state)
        if self.collect and state.encoder is not None:
            self._features.admit(state)
        self._live[state.slot] = state
        pooled = Layout.describe(state, self._requests)
        if pooled:
            self._pooled_items[state.slot] = pooled
        self._layout = None

    def feature_holdings(self) -> dict[str, int]:
        """What the SAE captures hold for the live requests (``FeatureCaptures.held``)."""
        return self._features.held()

    def retire(self, state: RequestState) -> None:
        """The request left vLLM: settle its numbers once the copies in flight have landed."""
        if self._live.pop(state.slot, None) is not None:
            self._pooled_items.pop(state.slot, None)
            self._layout = None
            self._steering.retire(state)
            self._retiring.append(state)

    def _current_layout(self) -> Layout:
        if self._layout is None:
            slots = np.fromiter(self._live, dtype=np.int64, count=len(self._live))
            self._layout = Layout.build(list(self._live.values()), slots, self._pooled_items, self._requests)
        return self._layout

    # -- before the step ------------------------------------------------------------------
    def begin_step(
        self,
        batch_index: np.ndarray,
        query_start: np.ndarray,
        computed: np.ndarray,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Route one step.  ``batch_index[k]`` is the vLLM batch index of ``states[k]`` (-1:
        not scheduled); ``query_start`` and ``computed`` are the runner's per-request row
        offsets and computed-token counts (``query_start`` runs to the step's last request).
        ``rows`` holds each token row's batch index and position on the device (vLLM's
        ``req_indices`` and ``positions``); without it they are derived from the two arrays."""
        self._pooled.flush_resets()
        self._features.flush_resets()
        self._receipts.flush_admissions()
        if self._retiring:
            self._in_flight.append(self._launch_retire(self._retiring))
            self._retiring = []
        work = _StepWork()
        layout = self._current_layout()
        self._work = None
        if not (layout.states or self._steering.active):
            return
        same_batch, repeat = self._compare_with_last_step(layout, batch_index, query_start, computed)
        self.step_kinds["repeated" if repeat else "same_batch" if same_batch else "new_batch"] += 1
        if self._steering.active:
            self._steer(layout, batch_index, query_start, computed, rows, same_batch, repeat)
        if not (layout.states and self.collect and layout.captures):
            self._repeat = None
            self._advance_seen(layout, batch_index, query_start, computed)
        elif repeat and self._repeat is not None:
            self._route_repeat(layout, batch_index, computed, work)
        else:
            self._route(layout, batch_index, query_start, computed, work)
        self._work = work if work else None

    def _compare_with_last_step(
        self, layout: Layout, batch_index: np.ndarray, query_start: np.ndarray, computed: np.ndarray
    ) -> tuple[bool, bool]:
        """Whether the live requests and their batch indices are the last step's, and whether
        this step repeats it: its rows are the last step's requests' next rows, one generated
        row each in both steps.  No row can then have crossed into or out of a
        prompt/generated/all scope, and each lies where its request's row lay, so the last
        step's routing holds again (listed positions aside)."""
        same = self._last_batch is not None and self._last_batch[0] is layout
        same = same and np.array_equal(self._last_batch[1], batch_index)
        if not same:
            self._last_batch = (layout, batch_index.copy())
        count = int(query_start[-1]) if len(query_start) else 0
        generated = count == len(query_start) - 1 and self._generated_rows_only(layout, batch_index, computed)
        repeat = same and generated and count == self._generated_rows
        self._generated_rows = count if generated else -1
        return same, repeat

    def _steer(
        self,
        layout: Layout,
        batch_index: np.ndarray,
        query_start: np.ndarray,
        computed: np.ndarray,
        rows: tuple[torch.Tensor, torch.Tensor] | None,
        same_batch: bool,
        repeat: bool,
    ) -> None:
        """Hand the steering its rows: each row's request slot, and whether the tables the last
        step wrote still hold (``repeat``).  The batch-index map is rewritten when the batch or
        the live requests changed; with steering live in both steps (admitting or retiring a
        steered request changes the layout) it was written for the last step otherwise."""
        if rows is None:
            rows = self._rows_of(query_start, computed)
        if not same_batch:
            self._map_batch(layout, batch_index)
        if not repeat or self._slot_of_row is None:
            self._slot_of_row = self._slot_of_batch_device.index_select(0, rows[0])
        # A repeat of a step whose rows were all new has only new rows (each is one position on),
        # so they count as the last step's did; otherwise the rows are counted afresh.
        same_rows, fresh = repeat and self._steered_rows_fresh, None
        if not same_rows:
            fresh = self._fresh_rows(layout, batch_index, query_start, computed)
            self._steered_rows_fresh = fresh is None
        self._steering.begin(self._slot_of_row, rows[1], same_rows=same_rows, fresh=fresh)

    def _fresh_rows(
        self, layout: Layout, batch_index: np.ndarray, query_start: np.ndarray, computed: np.ndarray
    ) -> torch.Tensor | None:
        """Whether each row of the step is new (above its request's highest position seen), on
        the device; None when every steered request's rows are, as they are unless a request
        recomputes its rows after preemption."""
        steered = (batch_index >= 0) & layout.steered
        seen = self._requests["seen"][layout.slot[steered]]
        if not (computed[batch_index[steered]] <= seen).any():
            return None
        batch, positions = _host_rows(query_start, computed)
        seen_at = np.full(len(query_start) - 1, -1, dtype=np.int64)
        seen_at[batch_index[steered]] = seen
        fresh = torch.from_numpy(positions > seen_at[batch])
        return fresh.pin_memory().to(self.runtime.device, non_blocking=True) if self.cuda else fresh

    def _advance_seen(
        self, layout: Layout, batch_index: np.ndarray, query_start: np.ndarray, computed: np.ndarray
    ) -> None:
        """Record each scheduled request's highest position (``_route`` does this when it runs)."""
        present = batch_index >= 0
        index = batch_index[present]
        self._record_seen(layout.slot[present], computed[index] + query_start[index + 1] - query_start[index] - 1)

    def _record_seen(self, slots: np.ndarray, last: np.ndarray) -> None:
        """Raise each request's highest position seen to ``last`` (a recomputation leaves it)."""
        self._requests["seen"][slots] = np.maximum(self._requests["seen"][slots], last)

    @staticmethod
    def _generated_rows_only(layout: Layout, batch_index: np.ndarray, computed: np.ndarray) -> bool:
        """In a step of one row per request: whether every instrumented request's row is a generated token's."""
        mine = (batch_index >= 0) & (layout.steered | (layout.capture_kind >= 0))
        return bool(np.all(computed[batch_index[mine]] >= layout.prompt_len[mine]))

    def _map_batch(self, layout: Layout, batch_index: np.ndarray) -> None:
        """Write which steered request's slot sits at each batch index."""
        present = batch_index >= 0
        mapped = int(batch_index.max(initial=-1)) + 1
        span = max(self._mapped, mapped)
        table = self._slot_of_batch.numpy()
        table[:span] = 0
        steered = present & layout.steered  # a slot's entries are written when a steered request takes it
        table[batch_index[steered]] = layout.slot[steered] + 1
        self._slot_of_batch_device[:span].copy_(self._slot_of_batch[:span], non_blocking=True)
        self._mapped = mapped
        self.max_requests_steered_in_one_step = max(self.max_requests_steered_in_one_step, int(steered.sum()))

    def _rows_of(self, query_start: np.ndarray, computed: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token row's batch index and position, on the device."""
        batch, positions = _host_rows(query_start, computed)
        device = self.runtime.device
        return torch.from_numpy(batch).to(device), torch.from_numpy(positions.astype(np.int64)).to(device)

    def _route(
        self,
        layout: Layout,
        batch_index: np.ndarray,
        query_start: np.ndarray,
        computed: np.ndarray,
        work: _StepWork,
    ) -> None:
        """Captures: which rows each capturing request keeps this step."""
        present = batch_index >= 0
        index = np.where(present, batch_index, 0)
        starts = query_start[index].astype(np.int64)
        counts = np.where(present, query_start[index + 1] - starts, 0)
        first = computed[index].astype(np.int64)
        active = counts > 0
        decode = active & (counts == 1)
        seen = self._requests["seen"][layout.slot]
        fresh = first > seen  # for decode rows: the row is new (not a recomputation)
        captured = self._captured_decode_rows(layout, decode, first, fresh)
        if (captured & layout.pooled).any():
            self._pool_decode(layout, captured & layout.pooled, starts, first, work)
        encoded = captured & layout.features
        if encoded.any():
            work.features.append((layout.slot[encoded], starts[encoded], first[encoded]))
        for k in layout.per_token:
            state = layout.states[k]
            if captured[k] and state.error is None:
                rows, positions = starts[k : k + 1], first[k : k + 1]
                work.per_token.extend((state, item, rows, positions) for item in state.capture)
        blocks = np.nonzero(active & ~decode & (layout.capture_kind >= 0))[0]
        for k in blocks:
            self._route_block(layout.states[k], int(starts[k]), int(counts[k]), int(first[k]), int(seen[k]), work)
        self._record_seen(layout.slot[active], first[active] + counts[active] - 1)
        # What a repeat of this step (``_compare_with_last_step``) redoes: only pooled decode rows, all new.
        candidates = decode & (layout.capture_kind >= 0)
        simple = not (blocks.size or work.per_token or work.features) and bool(fresh[candidates].all())
        simple = simple and not (layout.capture_kind == SCOPE_CODES["listed"]).any()
        pooled = work.pooled[0] if work.pooled else None
        self._repeat = (layout.slot[captured & layout.pooled], pooled) if simple else None

    def _route_repeat(self, layout: Layout, batch_index: np.ndarray, computed: np.ndarray, work: _StepWork) -> None:
        """Captures of a step that repeats the last one: the same pooled rows, one position on."""
        assert self._repeat is not None
        counted, pooled = self._repeat
        present = batch_index >= 0
        self._requests["seen"][layout.slot[present]] = computed[batch_index[present]]
        self._requests["captured"][counted] += 1
        if pooled is not None:
            sites, modes, rows, slots, positions = pooled
            pooled = (sites, modes, rows, slots, positions + 1)
            self._repeat = (counted, pooled)
            work.pooled.append(pooled)
            work.repeat = True

    def _captured_decode_rows(
        self, layout: Layout, decode: np.ndarray, first: np.ndarray, fresh: np.ndarray
    ) -> np.ndarray:
        """Per live request: whether its decode row this step is new and inside its capture scope."""
        kind = layout.capture_kind
        captured = decode & fresh & (kind >= 0)
        covered = scopes_cover(kind, layout.prompt_len, first)
        for k in np.nonzero(captured & (kind == SCOPE_CODES["listed"]))[0]:
            covered[k] = layout.states[k].capture_scope.covers(int(first[k]))
        return captured & covered

    def _pool_decode(
        self, layout: Layout, captured: np.ndarray, starts: np.ndarray, first: np.ndarray, work: _StepWork
    ) -> None:
        """Decode rows of every pooled capture at once (``captured``: the requests whose row counts)."""
        np.add.at(self._requests["captured"], layout.slot[captured], 1)
        take = captured[layout.p_state]
        owner = layout.p_state[take]
        work.pooled.append((layout.p_site[take], layout.p_mode[take], starts[owner], layout.slot[owner], first[owner]))

    def _route_block(self, state: RequestState, start: int, count: int, first: int, seen: int, work: _StepWork) -> None:
        """A prefill chunk (or a recomputation after preemption) of a capture: numpy masks over its rows."""
        if not (state.capture and state.error is None and state.capture_scope is not None):
            return
        positions = first + np.arange(count, dtype=np.int64)
        fresh = positions > seen
        idx = np.nonzero(state.capture_scope.mask(positions) & fresh)[0]
        if idx.size == 0:
            return
        rows, kept = start + idx, positions[idx]
        if state.encoder is not None:
            work.features.append((np.full(idx.size, state.slot, dtype=np.int64), rows, kept))
        elif state.pooled:
            self._requests["captured"][state.slot] += idx.size
            mode = MODES[state.reduce]
            for item in state.capture:
                n = idx.size
                work.pooled.append(
                    (np.full(n, item.site), np.full(n, mode), rows, np.full(n, state.slot, dtype=np.int64), kept)
                )
        else:
            work.per_token.extend((state, item, rows, kept) for item in state.capture)

    # -- after the step -------------------------------------------------------------------
    def end_step(self) -> None:
        """Fold and launch what this step's requests need; account earlier steps' copies."""
        self._steering.end()
        work, self._work = self._work, None
        flight = self._launch(work) if work else None
        if flight is not None:
            self._in_flight.append(flight)
        # Account what has landed without waiting for the device; wait only when too much is in flight.
        while self._in_flight and (len(self._in_flight) > MAX_IN_FLIGHT or self._in_flight[0].landed()):
            self._complete(self._in_flight.pop(0))

    def drain(self) -> None:
        """Account every launched copy (before results are read)."""
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def _launch(self, work: _StepWork) -> InFlight | None:
        """Account a step's captures on the device; only per-token rows need copies (a flight) to the host."""
        if work.pooled:
            pending = self._requests["pending"]
            parts = (np.concatenate(parts) for parts in zip(*work.pooled, strict=True))
            self._pooled.fold(pending, *parts, repeat=work.repeat)
        features = []
        if work.features:
            slots, rows, positions = (np.concatenate(parts) for parts in zip(*work.features, strict=True))
            features = self._features.launch(slots, rows, positions)
        if not work.per_token and not features:
            return None
        flight = self._copies.launch(work.per_token) if work.per_token else InFlight()
        flight.features = features
        if flight.event is None:
            flight.event = self._copies.record()
        return flight

    def _launch_retire(self, states: list[RequestState]) -> InFlight:
        """Read the retiring requests' pooled rows and receipts; their slots are freed once this lands."""
        flight = InFlight(retired=states)
        flight.pooled_reads, flight.receipt_reads, flight.feature_reads = self._read_results(
            states, self._copies.to_host
        )
        flight.event = self._copies.record()
        return flight

    def _complete(self, flight: InFlight) -> None:
        self._copies.land(flight)
        self._features.land(flight.features)
        for state in flight.retired:
            self._settle(state, flight.pooled_reads, flight.receipt_reads, flight.feature_reads)
            self._free(state)

    # -- reading results ------------------------------------------------------------------
    def snapshot(self, states: list[RequestState]) -> None:
        """Copy still-live requests' counters and pooled rows into them (after ``drain``).

        All of them at once: one request at a time would cost a device round trip each."""
        live = [state for state in states if state.slot >= 0]  # retired ones are already settled
        if not live:
            return
        reads, receipts, features = self._read_results(live, torch.Tensor.cpu)
        for state in live:
            self._settle(state, reads, receipts, features)

    def _read_results(
        self, states: list[RequestState], to_host: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[PooledReads, ReceiptReads | None, FeatureReads]:
        """The pooled rows, receipt sums and SAE accumulators of ``states``, copied by ``to_host``:
        one read per site or SAE and one for all receipts, however many requests (each read is a
        device round trip)."""
        if not self.collect:
            return {}, None, FeatureReads()
        self._steering.flush()
        pooled_reads = self._pooled.read(states, to_host)
        receipts = self._receipts.read([item for s in states for item in s.steer], to_host)
        return pooled_reads, receipts, self._features.read(states, to_host)

    def _settle(
        self, state: RequestState, reads: PooledReads, receipts: ReceiptReads | None, features: FeatureReads
    ) -> None:
        self._receipts.settle(state.steer, receipts)
        if self.collect:
            self._features.settle(state, features)
        state.captured = int(self._requests["captured"][state.slot])
        state.pending_pos = int(self._requests["pending"][state.slot])
        if state.pooled:
            self._pooled.settle(state, reads)

    def _free(self, state: RequestState) -> None:
        self._features.free(state)
        self._requests.free.append(state.slot)
        state.slot = -1
        self._receipts.free(state.steer)


def _host_rows(query_start: np.ndarray, computed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each token row's batch index and position, as vLLM's runner computes them."""
    counts = np.diff(query_start)
    batch = np.repeat(np.arange(len(counts)), counts)
    return batch, computed[batch] + np.arange(len(batch)) - query_start[batch]
