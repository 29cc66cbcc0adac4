"""Worker side: a finished request's results as the ``wire.FetchedResult`` the front end reads.

Results are checked here, where the rows are: a capture holding NaN or inf fails its request
(per-token rows are checked as they land, ``instrument/host_copies.py``; SAE features here).  Pooled captures (one
row per hook point) travel inside the answer; per-token rows go to a
hand-off file when the front end shares the host (``handoff.py``).  A capture that ends inside
the prompt is complete long before its request, so it is written out early, on a writer
thread, while the request still decodes; the fetch then only names the file.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.engine.handoff import shared_folder, write_tensors
from inspect_tl_vllm.instrument.dtypes import TORCH_DTYPES
from inspect_tl_vllm.instrument.request_state import RequestState, finish_pooled
from inspect_tl_vllm.specs import sae_keys
from inspect_tl_vllm.wire import FetchedResult


class ResultPacker:
    """Packs results and owns the writer thread for early writes."""

    def __init__(self, site_widths: dict[int, int]) -> None:
        self.site_widths = site_widths  # numbers per row at each site (an empty capture's shape)
        self.written_early = 0  # requests whose per-token rows were written out before their fetch
        self._writer: ThreadPoolExecutor | None = None
        self._folders: dict[tuple[str, ...], Path | None] = {}

    def pack(self, state: RequestState, max_pos: int, folder: Path | None) -> FetchedResult:
        """The request's result; one request's failure becomes that result's error, so it fails
        that request only, not the fetch of the others (nor, through the RPC, the engine)."""
        try:
            return self._pack(state, max_pos, folder)
        except Exception as err:
            state.error = f"packing the results failed: {type(err).__name__}: {err}"
            return FetchedResult(uid=state.uid, receipt=state.receipt(), positions={}, tensors=b"", files=[])

    def _pack(self, state: RequestState, max_pos: int, folder: Path | None) -> FetchedResult:
        # a capture of generated tokens when the answer is one token (the last token is never an
        # input) comes back empty, as such, not as a capture that failed; listed positions past the
        # answer's end still fail it (those rows were asked for by name)
        scope = state.capture_scope
        state.unreached = scope is not None and scope.kind == "generated" and not scope.reaches(max_pos)
        if state.written is not None:
            try:
                written = state.written.result()
            except Exception as err:  # this request's rows are lost; the others in the fetch are not
                state.error = f"writing the captured rows failed: {type(err).__name__}: {err}"
                written = {"positions": {}, "tensors": b"", "files": []}
            return FetchedResult(uid=state.uid, receipt=state.receipt(), **written)
        tensors: dict[str, torch.Tensor] = {}
        positions: dict[str, list[int]] = {}
        if state.pooled:
            dtype = TORCH_DTYPES[state.dtype]
            for hook, row in finish_pooled(state, max_pos).items():
                if not np.isfinite(row).all() and state.error is None:
                    state.error = f"the activations captured at {hook} are not finite (NaN or inf)"
                tensors[hook] = torch.from_numpy(row).to(dtype).unsqueeze(0)
        elif state.reduce == "none":
            tensors, positions = self._per_token(state, max_pos)
        # Pooled captures (one row per hook point) travel with the answer: a file each would cost more.
        moved = write_tensors(None if state.pooled else folder, state.uid, tensors)
        return FetchedResult(uid=state.uid, receipt=state.receipt(), positions=positions, **moved)

    def _per_token(self, state: RequestState, max_pos: int) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
        """Each hook's rows up to ``max_pos`` in the requested dtype, and their positions (an SAE
        capture: the rows' features, ``_features``)."""
        dtype = TORCH_DTYPES[state.dtype]
        tensors, positions = {}, {}
        for item in state.capture:
            if state.features is not None:
                features, kept = self._features(state, item.hook, max_pos)
                tensors.update(features)
                if state.features.reduce == "none":
                    positions.update({key: kept for key in features})
                continue
            kept, rows = item.per_token(max_pos)
            positions[item.hook] = kept
            empty = rows is None
            tensors[item.hook] = torch.zeros(0, self.site_widths[item.site], dtype=dtype) if empty else rows.to(dtype)
        return tensors, positions

    def _features(self, state: RequestState, hook: str, max_pos: int) -> tuple[dict[str, torch.Tensor], list[int]]:
        """An SAE capture's tensors (``feature_captures.py`` encoded them in the step): per token,
        the rows up to ``max_pos``; per sample, the reduction (the pending row joins it only when
        it was an input, as for pooled rows), then its top-k or listed features."""
        wire = state.features
        assert wire is not None
        dtype = TORCH_DTYPES[state.dtype]
        indices_key, values_key = sae_keys(hook)
        if state.feature_rows is not None:
            positions, rows = state.feature_rows
            keep = np.argsort(positions, kind="stable")
            keep = keep[positions[keep] <= max_pos]
            k = rows.shape[1] // 2
            kept = torch.from_numpy(rows[keep])
            _check_features(state, hook, kept[:, :k])
            state.capture[0].rows_kept = len(keep)
            indices = kept[:, k:].to(torch.int32)
            return {indices_key: indices, values_key: kept[:, :k].to(dtype).contiguous()}, positions[keep].tolist()
        if state.feature_pooled is None:
            raise RuntimeError("the SAE capture's results were never read back")
        reduced, pending, pending_pos, count = state.feature_pooled
        keep = 0 <= pending_pos <= max_pos
        rows = count - (1 if pending_pos >= 0 and not keep else 0)
        state.captured = state.capture[0].rows_kept = rows
        if rows == 0:  # no row to reduce: no features (not the top k of zeros)
            kept = len(wire.features) if wire.features is not None else wire.top_k
            empty = torch.zeros(0, kept)
            return {indices_key: empty.to(torch.int32), values_key: empty.to(dtype)}, []
        if wire.reduce == "mean":
            row = ((reduced + pending) if keep else reduced) / max(rows, 1)
        elif wire.reduce == "max":
            row = np.maximum(reduced, pending) if keep else reduced
        else:
            row = pending if keep else reduced
        dense = torch.from_numpy(np.ascontiguousarray(row, dtype=np.float32))[None]
        _check_features(state, hook, dense)
        if wire.features is not None:
            wanted = torch.tensor(wire.features, dtype=torch.int64)
            indices, values = wanted[None], dense.index_select(1, wanted)
        else:
            values, indices = dense.topk(min(wire.top_k, dense.shape[1]), dim=-1)
        return {indices_key: indices.to(torch.int32).contiguous(), values_key: values.to(dtype).contiguous()}, []

    def write_early(self, state: RequestState) -> None:
        """Write a capture that ends inside the prompt out now, on the writer thread (the step
        loop goes on); the rows' host memory is let go once they are written.

        Large writes release the GIL, so the thread costs the step loop little.
        """
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=writer_threads(), thread_name_prefix="tlvllm-write")
        key = tuple(state.handoff or ())
        if key not in self._folders:
            self._folders[key] = shared_folder(state.handoff)
        folder = self._folders[key]
        last = state.capture_scope.last_prompt_position if state.capture_scope else None
        assert last is not None  # the router calls this only for scopes that end in the prompt

        def write() -> dict[str, Any]:
            tensors, positions = self._per_token(state, last)
            payload = {"positions": positions, **write_tensors(folder, state.uid, tensors)}
            for item in state.capture:
                item.blocks.clear()
            return payload

        state.written = self._writer.submit(write)
        self.written_early += 1


def _check_features(state: RequestState, hook: str, values: torch.Tensor) -> None:
    """Fail the request if its SAE features are not finite (its rows were not, or the SAE overflowed)."""
    if state.error is None and not bool(torch.isfinite(values).all()):
        state.error = f"the SAE features captured at {hook} are not finite (NaN or inf)"


def early_writes() -> bool:
    """``TLVLLM_EARLY_WRITES=0`` keeps prompt captures in host memory until they are fetched
    instead of writing them out while their requests decode: a switch for measuring what the
    writer thread costs the step loop.  Read when the worker boots, so an engine booted with it
    set keeps it."""
    return os.environ.get("TLVLLM_EARLY_WRITES", "1") != "0"


def writer_threads() -> int:
    """How many threads write prompt captures out early: ``TLVLLM_WRITER_THREADS``, else one.

    Every time a writer takes the GIL back, the step loop may have to wait for it, so each added
    writer slows generation; one keeps up with every layer's prompt rows of an 8B model
    (docs/BENCHMARKS.md).  More threads only help when a single one cannot keep up."""
    value = os.environ.get("TLVLLM_WRITER_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1
