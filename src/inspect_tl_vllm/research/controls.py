"""Random control directions: same norm and hook point as a real vector, random direction.

A sweep that shows the steering effect against chance needs controls that differ from the
real vector only in direction.  They are written once, keyed by source content and seed, to
the per-user cache, and referenced by path like any other vector.
"""

from __future__ import annotations

import hashlib
from typing import Any

from inspect_tl_vllm.model_prep import cache_root


def random_like(vector_ref: str, seed: int) -> str:
    """Path of a safetensors file holding a random vector with the norm of ``vector_ref``."""
    from inspect_tl_vllm.vectors.files import read_vector_file

    return random_like_vector(read_vector_file(vector_ref, "control vector"), seed)


def random_like_vector(source: Any, seed: int) -> str:
    """Path of a safetensors file holding a random vector with the norm of the tensor ``source``
    (an SAE feature's decoder row, say)."""
    import torch
    from safetensors.torch import save_file

    source = source.flatten().float()
    digest = hashlib.sha256(source.numpy().tobytes()).hexdigest()[:16]
    path = cache_root() / "controls" / f"{digest}-seed{seed}.safetensors"
    if not path.is_file():
        generator = torch.Generator().manual_seed(seed)
        direction = torch.randn(source.numel(), generator=generator)
        control = direction / direction.norm() * source.norm()
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"vector": control}, str(path), metadata={"source_sha256": digest, "seed": str(seed)})
    return str(path)
