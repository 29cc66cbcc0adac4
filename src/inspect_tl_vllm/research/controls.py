"""Control directions: same norm and hook point as a real vector, another direction.

A sweep that shows the steering effect against chance needs controls that differ from the real
vector only in direction.  Three kinds, from the easiest null to the hardest:

- ``gauss``: a direction drawn uniformly at random.  Easy to beat: activations are far from
  isotropic, and a vector extracted from them puts much of its norm in a few coordinates that a
  random direction seldom touches.
- ``covariance``: a Gaussian draw with the covariance of the activations the vector was extracted
  from (the pairs' rows, ``extract.rows_path``): a direction of the kind those activations vary in.
- ``relabel``: the vector extracted again from the same pairs with each pair's positive and
  negative swapped at random: what the extraction finds without the concept.

Each is rescaled to the vector's norm, written once to the per-user cache and referenced by path
like any other vector. ``control_samples`` puts many directions into one eval: each question once
per direction, steered by it through the sample's metadata, so that all of them share one
continuous batch instead of one eval each (``tl-vllm sweep --controls-in-one-eval``). A direction
is drawn from the seed *and* the source's content, so two vectors get different controls for one
seed; the file name says how it was drawn, so a cache written by another rule is never read back as
this one's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from inspect_tl_vllm.model_prep import cache_root
from inspect_tl_vllm.specs import SpecError

KINDS = ("gauss", "covariance", "relabel")
DRAWS = {"gauss": "gauss-by-source", "covariance": "cov-by-source", "relabel": "relabel-by-source"}
"""How each kind is drawn, as its cache files are named."""


def random_like(vector_ref: str, seed: int, kind: str = "gauss") -> str:
    """Path of a safetensors file holding a control direction of ``kind`` with the norm of the
    vector ``vector_ref`` (``path`` or ``path:key``).  ``covariance`` and ``relabel`` read the
    pairs' rows that ``tl-vllm extract-vector`` saved beside the vector file."""
    from inspect_tl_vllm.vectors.files import read_vector_file, split_vector_ref

    if kind not in KINDS:
        raise SpecError(f"control kind {kind!r}: use one of {', '.join(KINDS)}")
    source = read_vector_file(vector_ref, "control vector")
    if kind == "gauss":
        return random_like_vector(source, seed)
    path, key = split_vector_ref(vector_ref)
    return _write(source, seed, kind, _pair_rows(path, key, source.numel(), kind))


def random_like_vector(source: Any, seed: int) -> str:
    """Path of a safetensors file holding a uniformly random direction with the norm of the tensor
    ``source`` (an SAE feature's decoder row, say)."""
    return _write(source, seed, "gauss", None)


def _pair_rows(path: Path, key: str, width: int, kind: str) -> Any:
    from safetensors import safe_open

    from inspect_tl_vllm.research.extract import rows_path

    rows_file = rows_path(path)
    if not rows_file.is_file():
        raise SpecError(
            f"control kind {kind!r} needs the pairs' rows beside the vector ({rows_file}): extract the vector with "
            "`tl-vllm extract-vector`, which writes them, or use control kind 'gauss'"
        )
    with safe_open(str(rows_file), "pt") as handle:
        keys = list(handle.keys())
        name = key if key else (keys[0] if len(keys) == 1 else None)
        if name not in keys:
            raise SpecError(f"{rows_file}: no rows for {key or 'the vector'} (it holds {keys}); name one as path:hook")
        rows = handle.get_tensor(name).float()
    if rows.ndim != 2 or rows.shape[1] != width or rows.shape[0] < 4 or rows.shape[0] % 2:
        raise SpecError(f"{rows_file}: rows {tuple(rows.shape)} are not [2 x pairs (at least 2), {width}]")
    return rows


def _write(source: Any, seed: int, kind: str, rows: Any) -> str:
    import torch
    from safetensors.torch import save_file

    source = source.flatten().float()
    digest = hashlib.sha256(source.numpy().tobytes()).hexdigest()[:16]
    path = cache_root() / "controls" / f"{digest}-{DRAWS[kind]}-seed{seed}.safetensors"
    if not path.is_file():
        mixed = hashlib.sha256(f"{digest}:{seed}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(mixed[:8], "little") >> 1)
        direction = _direction(source.numel(), kind, rows, generator)
        control = direction / direction.norm() * source.norm()
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"source_sha256": digest, "seed": str(seed), "draw": DRAWS[kind]}
        save_file({"vector": control}, str(path), metadata=metadata)
    return str(path)


def _direction(width: int, kind: str, rows: Any, generator: Any) -> Any:
    import torch

    if kind == "gauss":
        return torch.randn(width, generator=generator)
    if kind == "covariance":  # x_c^T g: a Gaussian with the rows' sample covariance
        centred = rows - rows.mean(dim=0)
        return centred.T @ torch.randn(rows.shape[0], generator=generator)
    differences = rows[0::2] - rows[1::2]  # relabel: each pair's sign flipped with probability 1/2
    signs = torch.randint(0, 2, (differences.shape[0],), generator=generator).float() * 2 - 1
    return (signs[:, None] * differences).mean(dim=0)


SEED_KEY = "control_seed"
QUESTION_KEY = "question_id"


def parse_seeds(seeds: str | list[int]) -> list[int]:
    """``control_seeds`` as a task argument: a comma-separated list, or a list."""
    values = seeds.split(",") if isinstance(seeds, str) else list(seeds)
    try:
        parsed = [int(value) for value in values]
    except (TypeError, ValueError):
        raise SpecError(f"control_seeds {seeds!r}: give whole numbers, comma-separated") from None
    if not parsed or len(set(parsed)) != len(parsed):
        raise SpecError(f"control_seeds {seeds!r}: give one or more distinct seeds")
    return parsed


def control_samples(
    samples: Any, vector_ref: str, seeds: list[int], *, hook: str, coef: float, kind: str = "gauss"
) -> list[Any]:
    """Every sample once per seed, steered at ``hook`` by that seed's control direction (the sample's
    ``metadata["tlvllm"]``); ids ``<id>~<seed>``, metadata ``control_seed`` and ``question_id``; a
    question's directions one after the other."""
    steering = {
        seed: {"interventions": [{"hook": hook, "vector": random_like(vector_ref, seed, kind), "coef": coef}]}
        for seed in seeds
    }
    out = []
    for index, sample in enumerate(samples):  # question by question, so that a sample limit takes whole questions
        question = sample.id if sample.id is not None else index
        for seed in seeds:
            metadata = {**(sample.metadata or {}), "tlvllm": steering[seed], SEED_KEY: seed, QUESTION_KEY: question}
            out.append(sample.model_copy(update={"id": f"{question}~{seed}", "metadata": metadata}))
    return out
