"""Random control directions: same norm and hook point as a real vector, random direction.

A sweep that shows the steering effect against chance needs controls that differ from the
real vector only in direction.  They are written once, keyed by source content and seed, to
the per-user cache, and referenced by path like any other vector.

A direction is drawn from the seed *and* the source's content, so two vectors of one width get
different controls for one seed; the file name says how it was drawn (``DRAW``), so a cache
written by another drawing rule is never read back as this one's.
"""

from __future__ import annotations

import hashlib
from typing import Any

from inspect_tl_vllm.model_prep import cache_root

DRAW = "gauss-by-source"
"""How a control is drawn: a standard normal direction, seeded by the source's digest and the seed."""


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
    path = cache_root() / "controls" / f"{digest}-{DRAW}-seed{seed}.safetensors"
    if not path.is_file():
        mixed = hashlib.sha256(f"{digest}:{seed}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") >> 1)
        direction = torch.randn(source.numel(), generator=generator)
        control = direction / direction.norm() * source.norm()
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"source_sha256": digest, "seed": str(seed), "draw": DRAW}
        save_file({"vector": control}, str(path), metadata=metadata)
    return str(path)
