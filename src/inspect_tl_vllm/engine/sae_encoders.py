"""The SAEs that requests capture features of, on the worker's device.

A request's SAE capture names a folder and the sha256 of its files as the front end read them at
admission (``wire.FeaturesWire``); the worker reads the folder itself (a worker on another host
needs the same path), refuses the request when the files it reads are not those (the folder was
rewritten meanwhile) or do not fit the model, and keeps the encoder on the device, in the
model's dtype (a float32 encoder would cost bfloat16 tensor cores several times over), for the
requests that follow.  Only the encoder is kept, and at most ``MAX_HELD`` of them: a request
holds its own encoder until it is fetched, so one evicted here stays alive only that long.
``instrument/feature_captures.py`` only calls ``encode`` and reads ``d_sae``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

MAX_HELD = 2
"""SAEs kept on the device at once: each holds a d_in x d_sae encoder (0.5 GB for 4096 x 65,536 in bf16)."""


class SaeEncoders:
    def __init__(self, device: torch.device, dtype: torch.dtype, width: int) -> None:
        self.device = device
        self.dtype = dtype
        self.width = width
        self._held: dict[Any, Any] = {}  # the folder's files' version (``sae_version``) -> its encoder
        self._lock = threading.Lock()

    def encoder(self, folder: str, digest: str) -> Any:
        """The encoder of the SAE in ``folder``, whose files must hash to ``digest`` (a SpecError
        naming what is wrong: other files, another width, not an SAE)."""
        from inspect_tl_vllm.vectors.sae import read_sae, sae_version

        where = "capture.sae"
        version = sae_version(folder, where)
        with self._lock:
            encoder = self._held.get(version)
        if encoder is None:
            sae = read_sae(version[0], where)
            sae.check_digest(digest, where)  # first: other files are the cause of any other mismatch
            sae.check_width(self.width, where)
            encoder = sae.encoder_on(self.device, self.dtype)
            with self._lock:
                self._held[version] = encoder
                while len(self._held) > MAX_HELD:
                    self._held.pop(next(iter(self._held)))
        encoder.check_digest(digest, where)
        return encoder

    def __len__(self) -> int:
        return len(self._held)
