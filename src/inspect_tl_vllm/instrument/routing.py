"""Host side of the hooks: per-request plans, per-step routing tables, and harvesting.

Before each forward step the engine hands ``begin_step`` the batch layout (which rows of the
flattened token dimension belong to which request, and at which sequence positions).  The
router writes each steered row's stage parameters into pinned host tables and copies the
used prefix into the device tables in one transfer.  After the step, ``end_step`` reads the
captured rows and the per-row norm changes of the requests that asked for them.

Work is per request and per step (numpy slices), never per token in Python.  Rows that a
request recomputes after preemption are steered again but counted and captured only once
(a position at or below the highest one already seen is skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.runtime import ADD, MULT, PROJ, HookRuntime

OP_COEFS = {  # op -> (mult, add, proj) as functions of coef
    "add": lambda c: (1.0, c, 0.0),
    "scale": lambda c: (c, 0.0, 0.0),
    "set": lambda c: (0.0, c, 0.0),
    "ablate": lambda c: (1.0, 0.0, c),
}


def scope_mask(positions: np.ndarray, prompt_len: int, scope: Any) -> np.ndarray:
    """Which of ``positions`` a position scope covers (see specs.PositionScope)."""
    if scope == "all":
        return np.ones(positions.shape, dtype=bool)
    if scope == "prompt":
        return positions < prompt_len
    if scope == "generated":
        return positions >= prompt_len
    wanted = np.array([p + prompt_len if p < 0 else p for p in scope], dtype=np.int64)
    return np.isin(positions, wanted)


@dataclass
class SteerItem:
    label: str
    site: int
    stage: int
    bank_row: int
    coefs: tuple[float, float, float]
    positions: Any
    rows: int = 0
    norm_delta_sum: float = 0.0
    fired: bool = True


@dataclass
class CaptureItem:
    hook: str
    site: int
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # reduce == "none": position -> row
    total: np.ndarray | None = None  # mean: running float64 sum
    count: int = 0
    best: np.ndarray | None = None  # last / max_norm
    best_key: float = -np.inf


@dataclass
class RequestState:
    """What the worker keeps for one request until the front end fetches it."""

    uid: str
    prompt_len: int
    steer: list[SteerItem]
    capture: list[CaptureItem]
    capture_scope: Any = "all"
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
            return len(item.rows)
        return item.count


def plan_request(wire: dict[str, Any], prompt_len: int, bank_rows: dict[str, int]) -> RequestState:
    """Turn a request's wire spec (built by the front end) into worker-side state."""
    steer = []
    for item in wire.get("steer", []):
        vector = item.get("vector")
        if vector is not None and vector not in bank_rows:
            raise KeyError(f"vector {vector} was not uploaded to this worker")
        steer.append(
            SteerItem(
                label=item["label"],
                site=int(item["site"]),
                stage=int(item["stage"]),
                bank_row=bank_rows[vector] if vector is not None else 0,
                coefs=OP_COEFS[item["op"]](float(item["coef"])),
                positions=item["positions"],
            )
        )
    cap = wire.get("capture")
    if not cap:
        return RequestState(uid=wire["uid"], prompt_len=prompt_len, steer=steer, capture=[])
    return RequestState(
        uid=wire["uid"],
        prompt_len=prompt_len,
        steer=steer,
        capture=[CaptureItem(hook=name, site=int(site)) for name, site in cap["hooks"]],
        capture_scope=cap["positions"],
        reduce=cap["reduce"],
        dtype=cap["dtype"],
        max_bytes=int(cap["max_bytes"]),
    )


@dataclass
class BatchEntry:
    """One scheduled request in a step: its rows ``[start, start + count)`` at ``first_pos..``."""

    state: RequestState
    start: int
    count: int
    first_pos: int


@dataclass
class _StepWork:
    steer: list[tuple[SteerItem, np.ndarray]]  # rows to account (new positions only)
    capture: list[tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]]  # rows, positions
    entries: list[BatchEntry]


class StepRouter:
    """Fills the runtime's routing tables before a step and harvests after it."""

    def __init__(self, runtime: HookRuntime) -> None:
        self.runtime = runtime
        pin = runtime.device.type == "cuda"
        shape = runtime.vec_index.shape
        self.vec_index = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        self.coefs = torch.zeros(runtime.coefs.shape, dtype=torch.float32, pin_memory=pin)
        self.coefs[..., MULT] = 1.0
        self._vec_np = self.vec_index.numpy()
        self._coef_np = self.coefs.numpy()
        self._dirty_rows = 0  # rows of the device tables that hold non-default values
        self._work: _StepWork | None = None
        self.max_requests_steered_in_one_step = 0  # evidence that batches really mix specs

    def begin_step(self, entries: list[BatchEntry]) -> None:
        """Write routing for this step's rows; reset what the previous step left."""
        dirty = self._dirty_rows
        if dirty:
            self._vec_np[:dirty] = 0
            self._coef_np[:dirty] = 0.0
            self._coef_np[:dirty, ..., MULT] = 1.0
        used = 0
        work = _StepWork(steer=[], capture=[], entries=entries)
        steered_requests = 0
        for entry in entries:
            state = entry.state
            positions = entry.first_pos + np.arange(entry.count, dtype=np.int64)
            fresh = positions > state.seen_upto
            if state.steer:
                steered_requests += 1
            for item in state.steer:
                mask = scope_mask(positions, state.prompt_len, item.positions)
                rows = entry.start + np.nonzero(mask)[0]
                if rows.size == 0:
                    continue
                self._vec_np[rows, item.site, item.stage] = item.bank_row
                self._coef_np[rows, item.site, item.stage, MULT] = item.coefs[0]
                self._coef_np[rows, item.site, item.stage, ADD] = item.coefs[1]
                self._coef_np[rows, item.site, item.stage, PROJ] = item.coefs[2]
                used = max(used, int(rows[-1]) + 1)
                counted = entry.start + np.nonzero(mask & fresh)[0]
                if counted.size:
                    work.steer.append((item, counted))
            if state.capture and state.error is None:
                mask = scope_mask(positions, state.prompt_len, state.capture_scope) & fresh
                idx = np.nonzero(mask)[0]
                if idx.size:
                    for item in state.capture:
                        work.capture.append((state, item, entry.start + idx, positions[idx]))
        self.max_requests_steered_in_one_step = max(self.max_requests_steered_in_one_step, steered_requests)
        span = max(used, dirty)
        if span:
            self.runtime.vec_index[:span].copy_(self.vec_index[:span], non_blocking=True)
            self.runtime.coefs[:span].copy_(self.coefs[:span], non_blocking=True)
        self._dirty_rows = used
        self._work = work if entries else None

    def end_step(self) -> None:
        """Account steering receipts and collect captured rows of the step just run."""
        work, self._work = self._work, None
        if work is None:
            return
        runtime = self.runtime
        if work.steer:
            sites = sorted({item.site for item, _ in work.steer})
            deltas = runtime.norm_delta[sites].cpu().numpy()
            fired = runtime.fired[sites].cpu().numpy()
            where = {site: i for i, site in enumerate(sites)}
            for item, rows in work.steer:
                item.rows += int(rows.size)
                item.norm_delta_sum += float(deltas[where[item.site], rows].sum())
                item.fired = item.fired and bool(fired[where[item.site]] > 0)
        if work.capture:
            self._harvest(work.capture)
        for entry in work.entries:
            last = entry.first_pos + entry.count - 1
            entry.state.seen_upto = max(entry.state.seen_upto, last)

    def _harvest(self, capture: list[tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]]) -> None:
        """One device gather and transfer per site, for the union of rows captured there."""
        host: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for site in {item.site for _, item, _, _ in capture}:
            rows = np.unique(np.concatenate([r for _, it, r, _ in capture if it.site == site]))
            index = torch.from_numpy(rows).to(self.runtime.device)
            host[site] = (rows, self.runtime.staging[site, index].float().cpu().numpy())
        for state, item, rows, positions in capture:
            site_rows, data = host[item.site]
            _accumulate(state, item, data[np.searchsorted(site_rows, rows)], positions)


def _accumulate(state: RequestState, item: CaptureItem, block: np.ndarray, positions: np.ndarray) -> None:
    width = block.shape[1]
    if state.reduce == "none":
        cost = block.shape[0] * width * np.dtype(np.float32).itemsize
        if state.bytes_used + cost > state.max_bytes:
            state.error = (
                f"capture exceeded capture_bytes_per_request ({state.max_bytes} bytes) at position "
                f"{int(positions[0])}; capture fewer hook points or positions, or reduce per sample"
            )
            return
        state.bytes_used += cost
        for pos, row in zip(positions.tolist(), block, strict=True):
            item.rows[pos] = row.copy()
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
