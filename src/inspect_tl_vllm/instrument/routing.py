"""Host side of the hooks: per-request plans, per-step routing tables, and harvesting.

Before each forward step the engine hands ``begin_step`` the batch layout of the
instrumented requests (which rows of the flattened token dimension belong to which request,
and at which sequence positions).  The router writes each steered row's stage parameters
into pinned host tables and copies the rows in use to the device, one transfer per site
whose table changed; a step with nothing requested does no work at all.

After the step, ``end_step`` *launches* the copies of captured rows and steering receipts
into pinned host memory and returns without waiting, so vLLM's asynchronous scheduling keeps
the GPU busy; the copies of a step are accounted on the host one step later (or when results
are fetched), when they have long finished.

Work is per request and per step (numpy slices; scalar writes for one-token decode rows),
never per token in Python.  Rows that a request recomputes after preemption are steered
again but counted and captured only once (a position at or below the highest one already
seen is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.runtime import IDENTITY_STAGE, HookRuntime

OP_STAGES = {  # op -> (mult, add, proj) as functions of coef
    "add": lambda c: (1.0, c, 0.0),
    "scale": lambda c: (c, 0.0, 0.0),
    "set": lambda c: (0.0, c, 0.0),
    "ablate": lambda c: (1.0, 0.0, c),
}


@dataclass
class Scope:
    """A position scope (see specs.PositionScope) resolved against one prompt length."""

    kind: str  # all | prompt | generated | listed
    prompt_len: int
    listed: frozenset[int] = frozenset()

    @classmethod
    def resolve(cls, scope: Any, prompt_len: int) -> Scope:
        if isinstance(scope, str):
            return cls(scope, prompt_len)
        return cls("listed", prompt_len, frozenset(p + prompt_len if p < 0 else p for p in scope))

    def covers(self, pos: int) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "prompt":
            return pos < self.prompt_len
        if self.kind == "generated":
            return pos >= self.prompt_len
        return pos in self.listed

    def mask(self, positions: np.ndarray) -> np.ndarray:
        if self.kind == "all":
            return np.ones(positions.shape, dtype=bool)
        if self.kind == "prompt":
            return positions < self.prompt_len
        if self.kind == "generated":
            return positions >= self.prompt_len
        return np.isin(positions, np.fromiter(self.listed, dtype=np.int64, count=len(self.listed)))


@dataclass
class SteerItem:
    index: int  # position in the request's intervention list (receipts merge across ranks by it)
    label: str
    site: int
    stage: int
    stage_row: np.ndarray  # (bank row, mult, add, proj) as written into the site's table
    scope: Scope
    rows: int = 0
    norm_delta_sum: float = 0.0
    fired: bool = True


@dataclass
class CaptureItem:
    hook: str
    site: int
    blocks: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # reduce none: (positions, rows)
    total: np.ndarray | None = None  # mean: running float64 sum
    count: int = 0
    best: np.ndarray | None = None  # last / max_norm
    best_key: float = -np.inf

    def per_token(self, max_pos: int) -> tuple[list[int], np.ndarray | None]:
        """Positions (sorted, at most ``max_pos``) and their rows, for ``reduce="none"``."""
        if not self.blocks:
            return [], None
        positions = np.concatenate([p for p, _ in self.blocks])
        rows = np.concatenate([r for _, r in self.blocks])
        order = np.argsort(positions, kind="stable")
        order = order[positions[order] <= max_pos]
        return positions[order].tolist(), rows[order]


@dataclass
class RequestState:
    """What the worker keeps for one request until the front end fetches it."""

    uid: str
    prompt_len: int
    steer: list[SteerItem]
    capture: list[CaptureItem]
    capture_scope: Scope | None = None
    reduce: str = "none"
    dtype: str = "float32"
    max_bytes: int = 1 << 30
    seen_upto: int = -1  # highest position already accounted for
    bytes_used: int = 0
    error: str | None = None

    def receipt(self) -> dict[str, Any]:
        return {
            "interventions": [
                {
                    "index": s.index,
                    "label": s.label,
                    "rows": s.rows,
                    "mean_norm_change": (s.norm_delta_sum / s.rows) if s.rows else 0.0,
                    "fired": s.fired,
                }
                for s in self.steer
            ],
            "captures": {c.hook: self.captured_rows(c) for c in self.capture},
            "error": self.error,
        }

    def captured_rows(self, item: CaptureItem) -> int:
        if self.reduce == "none":
            return sum(len(p) for p, _ in item.blocks)
        return item.count


def plan_request(
    wire: dict[str, Any], prompt_len: int, bank_rows: dict[str, int], owned_sites: set[int] | None = None
) -> RequestState:
    """Turn a request's wire spec (built by the front end) into worker-side state.

    ``owned_sites`` (pipeline parallel) keeps only the items at sites this worker runs.
    """

    def owned(site: int) -> bool:
        return owned_sites is None or site in owned_sites

    steer = []
    for index, item in enumerate(wire.get("steer", [])):
        site = int(item["site"])
        if not owned(site):
            continue
        vector = item.get("vector")
        if vector is not None and vector not in bank_rows:
            raise KeyError(f"vector {vector} was not uploaded to this worker")
        bank_row = bank_rows[vector] if vector is not None else 0
        stage_row = np.array([bank_row, *OP_STAGES[item["op"]](float(item["coef"]))], dtype=np.float32)
        steer.append(
            SteerItem(
                index=index,
                label=item["label"],
                site=site,
                stage=int(item["stage"]),
                stage_row=stage_row,
                scope=Scope.resolve(item["positions"], prompt_len),
            )
        )
    state = RequestState(uid=wire["uid"], prompt_len=prompt_len, steer=steer, capture=[])
    cap = wire.get("capture")
    if cap:
        state.capture = [CaptureItem(hook=name, site=int(site)) for name, site in cap["hooks"] if owned(int(site))]
        state.capture_scope = Scope.resolve(cap["positions"], prompt_len)
        state.reduce = cap["reduce"]
        state.dtype = cap["dtype"]
        state.max_bytes = int(cap["max_bytes"])
    return state


@dataclass
class BatchEntry:
    """One scheduled request in a step: its rows ``[start, start + count)`` at ``first_pos..``."""

    state: RequestState
    start: int
    count: int
    first_pos: int


@dataclass
class _StepWork:
    steer: list[tuple[SteerItem, np.ndarray]] = field(default_factory=list)  # rows to account (new positions)
    capture: list[tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]] = field(default_factory=list)


@dataclass
class _InFlight:
    """Device-to-host copies launched after a step; ``event`` completes them (None on CPU)."""

    work: _StepWork
    deltas: dict[int, tuple[int, torch.Tensor, torch.Tensor]]  # site -> (first row, norm deltas, fired)
    captured: dict[int, tuple[np.ndarray, torch.Tensor]]  # site -> (row of each host row, host rows)
    event: Any


class StepRouter:
    """Fills the sites' routing tables before a step and harvests after it.

    ``collect=False`` (tensor-parallel ranks other than 0, which hold the same residual
    stream) steers but records nothing.
    """

    def __init__(self, runtime: HookRuntime, *, collect: bool = True) -> None:
        self.runtime = runtime
        self.collect = collect
        self.cuda = runtime.device.type == "cuda"
        self.sites = sorted(runtime.sites)
        self.slot = {site: j for j, site in enumerate(self.sites)}
        first = next(iter(runtime.sites.values()), None)
        shape = (len(self.slot), *(first.table.shape if first is not None else (0, 0, 4)))
        self.host = torch.tensor(IDENTITY_STAGE).repeat(*shape[:-1], 1)
        if self.cuda:
            self.host = self.host.pin_memory()
        self._table = self.host.numpy()
        self._identity = np.array(IDENTITY_STAGE, dtype=np.float32)
        self._dirty = np.zeros(len(self.slot), dtype=np.int64)  # rows of each table holding non-defaults
        self._work: _StepWork | None = None
        self._in_flight: list[_InFlight] = []
        self.max_requests_steered_in_one_step = 0  # evidence that batches really mix specs

    # -- before the step ------------------------------------------------------------------
    def begin_step(self, entries: list[BatchEntry]) -> None:
        """Write routing for this step's rows; reset what the previous step left."""
        table, slot = self._table, self.slot
        for j in np.nonzero(self._dirty)[0]:
            table[j, : self._dirty[j]] = self._identity
        used = np.zeros_like(self._dirty)
        work = _StepWork()
        steered_requests = 0
        for entry in entries:
            state = entry.state
            if state.steer:
                steered_requests += 1
            if entry.count == 1:
                self._route_one(entry, table, slot, used, work)
            else:
                self._route_block(entry, table, slot, used, work)
        self.max_requests_steered_in_one_step = max(self.max_requests_steered_in_one_step, steered_requests)
        for j in np.nonzero(np.maximum(used, self._dirty))[0]:
            span = int(max(used[j], self._dirty[j]))
            site = self.runtime.sites[self.sites[j]]
            site.table[:span].copy_(self.host[j, :span], non_blocking=True)
        self._dirty = used
        self._work = work if self.collect and (work.steer or work.capture) else None
        for entry in entries:
            entry.state.seen_upto = max(entry.state.seen_upto, entry.first_pos + entry.count - 1)

    def _route_one(
        self, entry: BatchEntry, table: np.ndarray, slot: dict[int, int], used: np.ndarray, work: _StepWork
    ) -> None:
        """The decode case: one row, scalar writes only."""
        state, row, pos = entry.state, entry.start, entry.first_pos
        fresh = pos > state.seen_upto
        for item in state.steer:
            if item.scope.covers(pos):
                j = slot[item.site]
                table[j, row, item.stage] = item.stage_row
                used[j] = max(used[j], row + 1)
                if fresh:
                    work.steer.append((item, np.array([row])))
        if fresh and state.capture and state.error is None and state.capture_scope.covers(pos):
            rows, positions = np.array([row]), np.array([pos])
            for item in state.capture:
                work.capture.append((state, item, rows, positions))

    def _route_block(
        self, entry: BatchEntry, table: np.ndarray, slot: dict[int, int], used: np.ndarray, work: _StepWork
    ) -> None:
        """Prefill chunks: numpy masks over the chunk's rows."""
        state = entry.state
        positions = entry.first_pos + np.arange(entry.count, dtype=np.int64)
        fresh = positions > state.seen_upto
        for item in state.steer:
            mask = item.scope.mask(positions)
            rows = entry.start + np.nonzero(mask)[0]
            if rows.size == 0:
                continue
            j = slot[item.site]
            table[j, rows, item.stage] = item.stage_row
            used[j] = max(used[j], int(rows[-1]) + 1)
            counted = entry.start + np.nonzero(mask & fresh)[0]
            if counted.size:
                work.steer.append((item, counted))
        if state.capture and state.error is None:
            idx = np.nonzero(state.capture_scope.mask(positions) & fresh)[0]
            if idx.size:
                for item in state.capture:
                    work.capture.append((state, item, entry.start + idx, positions[idx]))

    # -- after the step -------------------------------------------------------------------
    def end_step(self) -> None:
        """Launch the copies this step's requests need; account those of earlier steps."""
        work, self._work = self._work, None
        if work is not None:
            self._in_flight.append(self._launch(work))
        while len(self._in_flight) > 1:
            self._complete(self._in_flight.pop(0))

    def drain(self) -> None:
        """Account every launched copy (before results are read)."""
        while self._in_flight:
            self._complete(self._in_flight.pop(0))

    def _launch(self, work: _StepWork) -> _InFlight:
        sites = self.runtime.sites
        deltas = {}
        for site in {item.site for item, _ in work.steer}:
            rows = np.concatenate([r for item, r in work.steer if item.site == site])
            lo, hi = int(rows.min()), int(rows.max()) + 1
            deltas[site] = (lo, self._to_host(sites[site].norm_delta[lo:hi]), self._to_host(sites[site].fired))
        captured = {}
        for site in {item.site for _, item, _, _ in work.capture}:
            rows = np.unique(np.concatenate([r for _, it, r, _ in work.capture if it.site == site]))
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            staging = sites[site].staging
            if 2 * rows.size >= hi - lo:  # dense: one contiguous copy
                captured[site] = (np.arange(lo, hi), self._to_host(staging[lo:hi].float()))
            else:
                index = torch.from_numpy(rows)
                index = index.pin_memory().to(self.runtime.device, non_blocking=True) if self.cuda else index
                captured[site] = (rows, self._to_host(staging.index_select(0, index).float()))
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return _InFlight(work, deltas, captured, event)

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return tensor.clone()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out

    def _complete(self, flight: _InFlight) -> None:
        if flight.event is not None:
            flight.event.synchronize()
        for item, rows in flight.work.steer:
            lo, deltas, fired = flight.deltas[item.site]
            item.rows += int(rows.size)
            item.norm_delta_sum += float(deltas.numpy()[rows - lo].sum())
            item.fired = item.fired and bool(fired.item() > 0)
        host = {site: (rows, data.numpy()) for site, (rows, data) in flight.captured.items()}
        for state, item, rows, positions in flight.work.capture:
            site_rows, data = host[item.site]
            _accumulate(state, item, data[np.searchsorted(site_rows, rows)], positions)


def _accumulate(state: RequestState, item: CaptureItem, block: np.ndarray, positions: np.ndarray) -> None:
    if state.error is not None:
        return
    if state.reduce == "none":
        cost = block.nbytes
        if state.bytes_used + cost > state.max_bytes:
            state.error = (
                f"capture exceeded capture_bytes_per_request ({state.max_bytes} bytes) at position "
                f"{int(positions[0])}; capture fewer hook points or positions, or reduce per sample"
            )
            return
        state.bytes_used += cost
        item.blocks.append((positions, block))
        return
    if state.reduce == "mean":
        item.total = block.sum(axis=0, dtype=np.float64) + (0.0 if item.total is None else item.total)
        item.count += block.shape[0]
    elif state.reduce == "last":
        item.best = block[-1].copy()
        item.count += block.shape[0]
    else:  # max_norm
        norms = np.linalg.norm(block, axis=1)
        i = int(np.argmax(norms))
        if norms[i] > item.best_key:
            item.best_key = float(norms[i])
            item.best = block[i].copy()
        item.count += block.shape[0]
