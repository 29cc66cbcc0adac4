"""The SAEs that requests capture features of, on the worker's device.

A request's SAE capture names a folder (``wire.FeaturesWire.sae``); the worker reads it itself
(a worker on another host needs the same path) and keeps its encoder on the device, in the
model's dtype (a float32 encoder would cost bfloat16 tensor cores several times over), for the
requests that follow.  ``instrument/feature_captures.py`` only calls ``encode`` and reads
``d_sae``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

MAX_HELD = 2
"""SAEs kept on the device at once: each holds a d_in x d_sae encoder (0.5 GB for 4096 x 65,536 in bf16)."""


class SaeEncoders:
    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._held: dict[int, tuple[Any, Any]] = {}  # id of a loaded SAE -> (it, its encoder on the device)
        self._lock = threading.Lock()

    def encoder(self, folder: str) -> Any:
        """The encoder of the SAE in ``folder`` (a SpecError naming what is wrong with it)."""
        from inspect_tl_vllm.vectors.sae import load_sae

        sae = load_sae(folder, "capture.sae")
        with self._lock:  # an entry holds ``sae`` itself, so its id is not reused while held
            if id(sae) not in self._held:
                while len(self._held) >= MAX_HELD:
                    self._held.pop(next(iter(self._held)))
                self._held[id(sae)] = (sae, sae.encoder_on(self.device, self.dtype))
            return self._held[id(sae)][1]
