"""Per-token captures on their way to the host: pinned copies launched after a step, landed later.

After a step the captured rows of each site are copied into pinned host memory without
waiting, so vLLM's asynchronous scheduling keeps the GPU busy; each batch of copies (an
``InFlight``) records an event and is landed once the event has completed (checked without
blocking), or when results are fetched.  Landing hands each request its own rows, within its
byte budget.

The copies go into pinned blocks of at most ``HOST_CHUNK_BYTES`` each.  Torch's pinned host
pool caches blocks by power-of-two size and never splits one, so copies of whole prefill
steps (a different size every step, up to 128 MiB per site for an 8B model) leave cached
blocks of the wrong sizes idle while the pool makes new ones, and making them is slow (each
stalls the step loop).  In fixed chunks every large
copy reuses the same blocks, and the pool grows only when more rows are held at once than
before.  Rows kept past landing are copied once more, to pageable memory, so that the pinned
blocks go back to the pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.dtypes import TORCH_DTYPES
from inspect_tl_vllm.instrument.pooled_captures import PooledReads
from inspect_tl_vllm.instrument.pooling import device_index
from inspect_tl_vllm.instrument.request_state import CaptureItem, RequestState
from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.instrument.steering_receipts import ReceiptReads

MAX_IN_FLIGHT = 8  # launched copies not yet landed; beyond this the host waits for the oldest
HOST_CHUNK_BYTES = 8 << 20  # largest pinned block a per-token copy takes (module docstring)

PerToken = tuple[RequestState, CaptureItem, np.ndarray, np.ndarray]  # request, its item, batch rows, positions


@dataclass
class InFlight:
    """Device-to-host copies launched after a step, or when requests retire."""

    per_token: list[PerToken] = field(default_factory=list)
    captured: dict[int, tuple[np.ndarray, list[torch.Tensor]]] = field(default_factory=dict)  # site -> rows, chunks
    row_max: torch.Tensor | None = None  # each copied row's largest magnitude, site after site
    row_max_at: dict[int, int] = field(default_factory=dict)  # site -> where its rows start in row_max
    retired: list[RequestState] = field(default_factory=list)
    pooled_reads: PooledReads = field(default_factory=dict)
    receipt_reads: ReceiptReads | None = None
    feature_reads: Any = None  # feature_captures.FeatureReads of the retiring requests
    features: list[Any] = field(default_factory=list)  # feature_captures.FeatureFlight: SAE rows to land
    event: Any = None

    def landed(self) -> bool:
        """Whether the copies have completed (without waiting for them)."""
        return self.event is None or self.event.query()


class HostCopies:
    """Launches device-to-host copies and lands per-token rows in their requests.

    ``on_capture_complete`` receives each request whose per-token capture is complete before
    the request ends (a scope inside the prompt), as soon as its last rows are on the host.
    ``chunk_rows`` (default: what fits in ``HOST_CHUNK_BYTES``) is the most rows one host
    copy holds.
    """

    def __init__(
        self,
        runtime: HookRuntime,
        *,
        on_capture_complete: Callable[[RequestState], None] | None,
        chunk_rows: int | None,
    ) -> None:
        self.runtime = runtime
        self.cuda = runtime.device.type == "cuda"
        self.on_capture_complete = on_capture_complete
        row_bytes = runtime.bank_width * runtime.act_dtype.itemsize  # the widest site's rows
        self.chunk_rows = chunk_rows or max(1, HOST_CHUNK_BYTES // row_bytes)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self.cuda:
            return tensor.clone()
        out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        out.copy_(tensor, non_blocking=True)
        return out

    def record(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def launch(self, per_token: list[PerToken]) -> InFlight:
        """Copy a step's per-token rows to the host in chunks, each site's rows once."""
        sites = self.runtime.sites
        flight = InFlight(per_token=per_token)
        # A request's entries (one per hook) share one rows array, and most sites see the same
        # requests, so the rows of a site are worked out once per distinct set of requests:
        # the sites that share it share one array, which ``land`` relies on.
        arrays_of_site: dict[int, dict[int, np.ndarray]] = {}
        for _, item, rows, _ in per_token:
            arrays_of_site.setdefault(item.site, {})[id(rows)] = rows
        rows_of: dict[tuple[int, ...], tuple[np.ndarray, slice | None]] = {}  # -> (rows, their span if copied whole)
        row_max: list[torch.Tensor] = []
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
            flight.captured[site] = (rows, [self.to_host(source[lo : lo + step]) for lo in range(0, len(rows), step)])
            flight.row_max_at[site] = sum(len(m) for m in row_max)
            row_max.append(torch.linalg.vector_norm(source, ord=math.inf, dim=-1))
        if row_max:
            flight.row_max = self.to_host(torch.cat(row_max).float())
        flight.event = self.record()
        return flight

    def land(self, flight: InFlight) -> None:
        """Wait for ``flight``'s copies and hand each request its per-token rows."""
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
        row_max = flight.row_max.numpy() if flight.row_max is not None else None
        where: dict[tuple[int, int], tuple[np.ndarray, list[Piece]]] = {}  # (site rows, request rows) -> where
        for state, item, rows, positions in flight.per_token:
            site_rows, chunks = host[item.site]
            key = (id(site_rows), id(rows))
            if key not in where:
                at = np.searchsorted(site_rows, rows)
                where[key] = (at, pieces(at, self.chunk_rows))
            at, found = where[key]
            if row_max is not None:
                _check_finite(state, item, row_max[flight.row_max_at[item.site] + at], positions)
            for chunk, index, part in found:
                _keep_rows(state, item, chunks[chunk][index], positions[part])
        for state in closing if self.on_capture_complete is not None else ():
            if state.error is None:
                self.on_capture_complete(state)
            elif keep_pinned:  # the byte budget stopped it just now: its rows must not hold pinned memory
                for item in state.capture:
                    item.blocks = [(positions, rows.clone()) for positions, rows in item.blocks]


Piece = tuple[int, slice | torch.Tensor, slice]  # chunk, rows within it, the matching part of the request's


def pieces(at: np.ndarray, chunk_rows: int) -> list[Piece]:
    """Where a request's rows (``at``: their increasing indices into the copied rows) lie
    in the host chunks: one piece per chunk they touch, a slice where they are contiguous."""
    chunk_of = at // chunk_rows
    bounds = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), at.size]
    found = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        chunk = int(chunk_of[a])
        local = at[a:b] - chunk * chunk_rows
        contiguous = local[-1] - local[0] + 1 == local.size
        index = slice(int(local[0]), int(local[-1]) + 1) if contiguous else torch.from_numpy(local)
        found.append((chunk, index, slice(a, b)))
    return found


def _check_finite(state: RequestState, item: CaptureItem, row_max: np.ndarray, positions: np.ndarray) -> None:
    """Fail the request if one of its rows holds NaN or inf (``row_max``: each row's largest magnitude)."""
    bad = ~np.isfinite(row_max)
    if state.error is None and bad.any():
        state.error = (
            f"the activations captured at {item.hook} are not finite (NaN or inf) at position "
            f"{int(positions[np.argmax(bad)])}"
        )


def _keep_rows(state: RequestState, item: CaptureItem, block: torch.Tensor, positions: np.ndarray) -> None:
    """Keep per-token rows, within the request's byte budget (counted in the requested dtype)."""
    if state.error is not None:
        return
    cost = block.numel() * TORCH_DTYPES[state.dtype].itemsize
    if state.bytes_used + cost > state.max_bytes:
        state.error = (
            f"capture exceeded capture_bytes_per_request ({state.max_bytes} bytes) at position "
            f"{int(positions[0])}; capture fewer hook points or positions, or reduce per sample"
        )
        return
    state.bytes_used += cost
    item.blocks.append((positions, block))
    item.rows_kept += len(positions)
