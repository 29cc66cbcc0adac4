"""SAE captures in the step: captured rows encoded on the device right after the forward pass.

A request that captures an SAE's features (``state.features``, with ``state.encoder`` attached by
the worker: anything with ``d_sae`` and ``encode(rows) -> [n, d_sae] float32``) never sends its
rows to the host.  After each step the router hands over the (slot, row, position) of every
such row; here the rows are gathered from the site's ``staging``, encoded together (in chunks of
``CHUNK_ROWS``, so that a prefill step never holds [8192, d_sae] at once), and then

- per token (``reduce`` none): each row's top-k (or listed) features, 2k float32 numbers (the
  indices are exact in float32 below 2**24), are copied to pinned host memory without waiting,
  and landed a step later into a host arena indexed by (slot, row number) with one numpy
  assignment for all requests: no Python per request and step;
- per sample (mean, max, last): folded into dense accumulators per slot on the device, the
  newest row kept apart as the pending one, exactly as ``pooled_captures.py`` does for rows
  (``plans.finish_pooled`` says why), so the reduction is exact in feature space.

When a request retires or is fetched its arena rows, or its accumulators (one device read for
all requests of an SAE), are settled into ``state.feature_rows`` / ``state.feature_pooled``;
``engine/packing.py`` turns them into the stored tensors.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.pooled_captures import fold_group
from inspect_tl_vllm.instrument.pooling import MODES, SiteAccumulators, device_index
from inspect_tl_vllm.instrument.request_state import RequestState
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.wire import FeaturesWire

CHUNK_ROWS = 512
"""Rows encoded at once: [512, d_sae] float32 is 128 MiB for a 65,536-feature SAE."""


@dataclass
class FeatureFlight:
    """Per-token feature rows copied to the host after one step, waiting to land in the arena."""

    width: int
    slots: np.ndarray
    cursors: np.ndarray
    positions: np.ndarray
    rows: torch.Tensor  # [n, width] on the host (pinned on CUDA)


@dataclass
class FeatureReads:
    """Accumulator rows of retiring or fetched requests, per SAE (its key): sorted slots, rows."""

    pooled: dict[int, tuple[np.ndarray, torch.Tensor]] = field(default_factory=dict)


class Arena:
    """Per-token feature rows on the host: [slot, row number, width] float32, grown by doubling.

    ``np.zeros`` maps its pages lazily, so a large arena costs only the rows written to it."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.rows = np.zeros((64, 256, width), dtype=np.float32)
        self.positions = np.zeros((64, 256), dtype=np.int64)

    def ensure(self, slots: int, rows: int) -> None:
        have_slots, have_rows, _ = self.rows.shape
        if slots <= have_slots and rows <= have_rows:
            return
        new_slots, new_rows = max(slots, have_slots * (2 if slots > have_slots else 1)), have_rows
        while new_rows < rows:
            new_rows *= 2
        grown = np.zeros((new_slots, new_rows, self.width), dtype=np.float32)
        grown[:have_slots, :have_rows] = self.rows
        positions = np.zeros((new_slots, new_rows), dtype=np.int64)
        positions[:have_slots, :have_rows] = self.positions
        self.rows, self.positions = grown, positions


class FeatureCaptures:
    """The SAE captures of the live requests: what each step encodes, lands and folds."""

    def __init__(self, runtime: HookRuntime, cuda: bool, to_host: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.runtime = runtime
        self.cuda = cuda
        self.to_host = to_host
        self.count = np.zeros(64, dtype=np.int64)  # per request slot: rows captured so far
        self.arenas: dict[int, Arena] = {}  # per-token width -> arena
        self.pools: dict[int, tuple[Any, SiteAccumulators]] = {}  # id(encoder) -> (encoder, accumulators)
        self.pending = np.full(64, -1, dtype=np.int64)  # per slot: position of the pending row (pooled)
        self.resets: dict[int, list[int]] = {}
        self.states: dict[int, RequestState] = {}  # request slot -> its request, while it holds the slot
        self.group_of = np.zeros(64, dtype=np.int64)  # per slot: its encoding group (``group_key``), numbered
        self.groups: dict[tuple[Any, ...], int] = {}
        self.wanted: dict[int, torch.Tensor] = {}  # group number -> its listed features, on the device
        # Live requests per group, pool and arena: what no admitted request uses is let go, so a
        # worker that meets many SAEs and feature lists over its life holds only the current ones.
        self.users: Counter[tuple[str, Any]] = Counter()
        self._numbers = itertools.count()

    # -- requests -------------------------------------------------------------------------
    def admit(self, state: RequestState) -> None:
        if state.slot >= len(self.count):
            size = max(state.slot + 1, 2 * len(self.count))
            self.count = np.resize(self.count, size)
            self.pending = np.resize(self.pending, size)
            self.group_of = np.resize(self.group_of, size)
        self.count[state.slot] = 0
        self.pending[state.slot] = -1
        self.states[state.slot] = state
        key = group_key(state)
        if key not in self.groups:
            self.groups[key] = next(self._numbers)
        number = self.group_of[state.slot] = self.groups[key]
        listed = state.features.features if state.features is not None else None
        if listed is not None and number not in self.wanted:  # copied once, not every step
            self.wanted[number] = device_index(np.array(listed), self.runtime.device, self.cuda)
        self.users.update(self._uses(state))
        if pooled(state):
            key = id(state.encoder)
            if key not in self.pools:
                self.pools[key] = (state.encoder, SiteAccumulators(state.encoder.d_sae, self.runtime.device))
            self.pools[key][1].ensure(state.slot + 1)
            self.resets.setdefault(key, []).append(state.slot)

    def _uses(self, state: RequestState) -> list[tuple[str, Any]]:
        """What ``state`` keeps in use while admitted: its group, and its pool or arena."""
        assert state.features is not None
        held = ("pool", id(state.encoder)) if pooled(state) else ("arena", row_width(state.features))
        return [("group", group_key(state)), held]

    def flush_resets(self) -> None:
        for key, slots in self.resets.items():
            self.pools[key][1].reset(device_index(np.array(slots), self.runtime.device, self.cuda))
        self.resets.clear()

    # -- after a step ---------------------------------------------------------------------
    def launch(self, slots: np.ndarray, rows: np.ndarray, positions: np.ndarray) -> list[FeatureFlight]:
        """Encode this step's captured rows (``rows[i]`` of request slot ``slots[i]`` at
        ``positions[i]``) and fold or copy the results."""
        order = np.lexsort((positions, slots))  # per request, in position order
        slots, rows, positions = slots[order], rows[order], positions[order]
        first = np.searchsorted(slots, slots, side="left")
        cursors = self.count[slots] + np.arange(len(slots)) - first
        np.add.at(self.count, slots, 1)
        flights = []
        group = self.group_of[slots]
        for number in np.unique(group).tolist():
            mine = group == number
            state = self.states[int(slots[np.argmax(mine)])]  # the group's settings are any member's
            site = state.capture[0].site
            if pooled(state):
                self._fold(state, slots[mine], rows[mine], positions[mine], site)
            else:
                copied = self._copy(
                    state, self.wanted.get(number), slots[mine], cursors[mine], rows[mine], positions[mine], site
                )
                flights.append(copied)
        return flights

    def _encoded(self, encoder: Any, site: int, rows: np.ndarray) -> list[tuple[slice, torch.Tensor]]:
        staging = self.runtime.sites[site].staging
        index = device_index(rows, self.runtime.device, self.cuda)
        return [
            (slice(lo, lo + CHUNK_ROWS), encoder.encode(staging.index_select(0, index[lo : lo + CHUNK_ROWS])))
            for lo in range(0, len(rows), CHUNK_ROWS)
        ]

    def _copy(
        self,
        state: RequestState,
        wanted: torch.Tensor | None,
        slots: np.ndarray,
        cursors: np.ndarray,
        rows: np.ndarray,
        positions: np.ndarray,
        site: int,
    ) -> FeatureFlight:
        """Each row's top-k (or the ``wanted``, listed) features, as [values | indices] float32 rows, to the host."""
        wire = state.features
        assert wire is not None
        parts = []
        for _, acts in self._encoded(state.encoder, site, rows):
            if wanted is not None:
                values, indices = acts.index_select(1, wanted), wanted.expand(acts.shape[0], -1)
            else:
                values, indices = acts.topk(min(wire.top_k, acts.shape[1]), dim=-1)
            parts.append(torch.cat([values, indices.float()], dim=1))
        packed = torch.cat(parts)
        width = row_width(wire)
        if width not in self.arenas:
            self.arenas[width] = Arena(width)
        arena = self.arenas[width]
        arena.ensure(int(slots.max()) + 1, int(cursors.max()) + 1)
        return FeatureFlight(width, slots, cursors, positions, self.to_host(packed))

    def _fold(self, state: RequestState, slots: np.ndarray, rows: np.ndarray, positions: np.ndarray, site: int) -> None:
        """Fold encoded rows into the SAE's accumulators, chunk after chunk (each chunk's rows come
        after the previous chunk's for every request, so the pending row carries over exactly)."""
        wire = state.features
        assert wire is not None
        pool = self.pools[id(state.encoder)][1]
        mode = MODES[wire.reduce]
        for part, acts in self._encoded(state.encoder, site, rows):
            chunk = np.arange(len(rows))[part]
            device, cuda = self.runtime.device, self.cuda
            fold = fold_group(
                pool, mode, acts, chunk - chunk[0], slots[part], positions[part], self.pending, device, cuda
            )
            self.pending[fold.slots] = fold.newest

    def land(self, flights: list[FeatureFlight]) -> None:
        """Write landed per-token rows into their arenas (the flights' copies have completed)."""
        for flight in flights:
            arena = self.arenas[flight.width]
            arena.rows[flight.slots, flight.cursors] = flight.rows.numpy()
            arena.positions[flight.slots, flight.cursors] = flight.positions

    # -- reading results ------------------------------------------------------------------
    def read(self, states: list[RequestState], to_host: Callable[[torch.Tensor], torch.Tensor]) -> FeatureReads:
        """The accumulators of ``states``' pooled SAE captures: one read per SAE."""
        reads = FeatureReads()
        for key, (_, pool) in self.pools.items():
            slots = np.sort(np.array([s.slot for s in states if pooled(s) and id(s.encoder) == key], np.int64))
            if slots.size:
                reads.pooled[key] = (slots, to_host(pool.read(device_index(slots, pool.device, self.cuda))))
        return reads

    def settle(self, state: RequestState, reads: FeatureReads) -> None:
        """Copy ``state``'s rows (per token) or accumulators (pooled) out, before its slot is reused."""
        if state.encoder is None or state.features is None:
            return
        count = int(self.count[state.slot])
        if pooled(state):
            key = id(state.encoder)
            if key in reads.pooled:
                slots, data = reads.pooled[key]
                row = data.numpy()[int(np.searchsorted(slots, state.slot))]
                d_sae = state.encoder.d_sae
                state.feature_pooled = (
                    row[:d_sae].copy(),
                    row[d_sae + 1 :].copy(),
                    int(self.pending[state.slot]),
                    count,
                )
            return
        width = row_width(state.features)
        arena = self.arenas.get(width)
        if arena is None or count == 0:
            state.feature_rows = (np.zeros(0, dtype=np.int64), np.zeros((0, width), dtype=np.float32))
            return
        state.feature_rows = (arena.positions[state.slot, :count].copy(), arena.rows[state.slot, :count].copy())

    def free(self, state: RequestState) -> None:
        """Let go of the slot, and of the group, pool or arena that no admitted request uses any more."""
        if self.states.pop(state.slot, None) is None:
            return
        self.users.subtract(self._uses(state))
        for use in self._uses(state):
            if self.users[use] > 0:
                continue
            del self.users[use]
            kind, key = use
            if kind == "group":
                self.wanted.pop(self.groups.pop(key), None)
            elif kind == "pool":
                del self.pools[key]
                self.resets.pop(key, None)
            else:
                self.arenas.pop(key, None)  # none when no row was captured

    def held(self) -> dict[str, int]:
        """How many groups, pools and arenas are held (telemetry: they follow the live requests)."""
        return {"groups": len(self.groups), "pools": len(self.pools), "arenas": len(self.arenas)}


def pooled(state: RequestState) -> bool:
    return state.encoder is not None and state.features is not None and state.features.reduce != "none"


def row_width(wire: FeaturesWire) -> int:
    """Numbers per per-token row: the kept features' values, then their indices."""
    return 2 * wire.kept()


def group_key(state: RequestState) -> tuple[Any, ...]:
    """Requests encoded together: one SAE and the same selection of features."""
    wire = state.features
    assert wire is not None
    return (id(state.encoder), wire.reduce, wire.top_k, tuple(wire.features or ()))
