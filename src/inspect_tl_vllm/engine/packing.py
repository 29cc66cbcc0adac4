"""Worker side: a finished request's results as the ``wire.FetchedResult`` the front end reads.

Results are checked here, where the rows are: a capture holding NaN or inf fails its request
(per-token rows are checked as they land, ``instrument/host_copies.py``).  Pooled captures (one
row per hook point) travel inside the answer; per-token rows go to a
hand-off file when the front end shares the host (``handoff.py``).  A capture that ends inside
the prompt is complete long before its request, so it is written out early, on a writer
thread, while the request still decodes; the fetch then only names the file.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.engine.handoff import shared_folder, write_tensors
from inspect_tl_vllm.instrument.dtypes import TORCH_DTYPES
from inspect_tl_vllm.instrument.plans import RequestState, finish_pooled
from inspect_tl_vllm.specs import sae_keys
from inspect_tl_vllm.wire import FeaturesWire, FetchedResult


class ResultPacker:
    """Packs results and owns the writer thread for early writes."""

    def __init__(self, hidden_size: int, device: torch.device, act_dtype: torch.dtype) -> None:
        self.hidden_size = hidden_size
        self.device = device
        self.act_dtype = act_dtype
        self._saes: dict[int, tuple[Any, Any]] = {}  # id of a loaded SAE -> (it, its copy on ``device``)
        self._saes_lock = threading.Lock()  # the writer thread packs too
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
            kept, rows = item.per_token(max_pos)
            if rows is None:
                rows = torch.zeros(0, self.hidden_size)
            if state.features is not None:
                tensors.update(self._features(state.features, item.hook, rows, dtype))
                if state.features.reduce == "none":
                    positions.update({key: kept for key in sae_keys(item.hook)})
                continue
            positions[item.hook] = kept
            tensors[item.hook] = rows.to(dtype)
        return tensors, positions

    def _features(
        self, wire: FeaturesWire, hook: str, rows: torch.Tensor, dtype: torch.dtype
    ) -> dict[str, torch.Tensor]:
        """An SAE capture's sparse features of ``rows``, encoded on this worker's device in the
        model's dtype.  The worker reads the SAE from the path the front end checked (a worker on
        another host needs the same path); its encoder stays on the device for the next request."""
        from inspect_tl_vllm.vectors.sae import load_sae

        sae = load_sae(wire.sae, "capture.sae")
        with self._saes_lock:  # the entry holds ``sae`` itself, so its id is not reused while cached
            if id(sae) not in self._saes:
                while len(self._saes) >= 2:  # each copy holds two d_in x d_sae matrices of device memory
                    self._saes.pop(next(iter(self._saes)))
                self._saes[id(sae)] = (sae, sae.encoder_on(self.device, self.act_dtype))
            on_device = self._saes[id(sae)][1]
        indices, values = on_device.features_of(rows, reduce=wire.reduce, top_k=wire.top_k, features=wire.features)
        indices_key, values_key = sae_keys(hook)
        return {indices_key: indices, values_key: values.to(dtype)}

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


def early_writes() -> bool:
    """``TLVLLM_EARLY_WRITES=0`` keeps prompt captures in host memory until they are fetched
    instead of writing them out while their requests decode: a switch for measuring what the
    writer thread costs the step loop.  Read when the worker boots, so an engine booted with it
    set keeps it."""
    return os.environ.get("TLVLLM_EARLY_WRITES", "1") != "0"


def writer_threads() -> int:
    """How many threads write prompt captures out early: ``TLVLLM_WRITER_THREADS``, else one.

    Every time a writer takes the GIL back, the step loop may have to wait for it.  On an H200
    with the 8B shape, capturing every layer's prompt rows kept 0.914 of vanilla's throughput
    with one writer and 0.712 with four, while one writer still finished within 0.1-0.2 s of the
    last request (docs/BENCHMARKS.md).  More threads only help when a single one cannot keep up
    with the captures."""
    value = os.environ.get("TLVLLM_WRITER_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1
