"""Loading and checking steering vectors; never unpickles user files.

Accepted: inline lists, ``.safetensors`` (``path`` with one tensor, or ``path:key``),
``.npy`` (``allow_pickle=False``) and ``.pt`` via ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import torch

from inspect_tl_vllm.specs import MAX_VECTOR_ENTRY, SpecError, parse_hook_point


def load_vector(ref: list[float] | str, width: int, *, where: str = "vector") -> torch.Tensor:
    """A 1-D float32 vector of ``width`` finite entries within ``MAX_VECTOR_ENTRY``, or a SpecError
    naming ``where``."""
    vector = (_from_floats(ref, where) if isinstance(ref, list) else read_vector_file(ref, where)).squeeze()
    if vector.ndim != 1:
        raise SpecError(f"{where}: expected a 1-D vector, got shape {tuple(vector.shape)}")
    if vector.numel() != width:
        raise SpecError(
            f"{where}: vector has {vector.numel()} entries but the model's hidden size is {width}; "
            "was it extracted from another model?"
        )
    vector = vector.to(torch.float32).contiguous()
    entries = vector.numpy()  # numpy's checks cost a few µs; torch's, ~10x that per vector
    if not np.isfinite(entries).all():
        raise SpecError(f"{where}: vector contains NaN or inf")
    largest = float(np.abs(entries).max())
    if largest > MAX_VECTOR_ENTRY:
        raise SpecError(
            f"{where}: an entry of magnitude {largest:g} is out of range; entries lie within "
            f"+-{MAX_VECTOR_ENTRY:g} (scale the vector down and raise coef instead)"
        )
    return vector


def _from_floats(values: list[float], where: str) -> torch.Tensor:
    """A float32 tensor from a list of numbers: packing them is about 3x faster than
    ``np.asarray`` and 15x faster than ``torch.tensor`` on thousands of floats."""
    try:
        packed = bytearray(struct.pack(f"<{len(values)}f", *values))
    except OverflowError:
        raise SpecError(f"{where}: an entry is beyond float32's range (about 3.4e38)") from None
    except struct.error as err:
        raise SpecError(f"{where}: entries must be numbers ({err})") from None
    if not packed:
        return torch.zeros(0)
    return torch.frombuffer(packed, dtype=torch.float32)


def split_vector_ref(ref: str) -> tuple[Path, str]:
    """``path`` or ``path:key`` -> (file path, tensor key or "")."""
    path_text, _, key = ref.partition(":") if ref.count(":") == 1 and not Path(ref).exists() else (ref, "", "")
    return Path(path_text).expanduser(), key


def read_vector_file(ref: str, where: str = "vector") -> torch.Tensor:
    """The tensor a vector reference names, as float32; a non-real tensor is refused rather than
    cast (casting a complex tensor silently drops its imaginary part)."""
    tensor = _read_tensor(ref, where)
    if not isinstance(tensor, torch.Tensor):
        raise SpecError(f"{where}: {ref} holds a {type(tensor).__name__}, not a tensor")
    if tensor.is_complex() or tensor.dtype == torch.bool:
        kind = str(tensor.dtype).removeprefix("torch.")
        raise SpecError(f"{where}: {ref} holds a {kind} tensor; steering vectors are real numbers")
    return tensor.float()


def _read_tensor(ref: str, where: str) -> torch.Tensor:
    path, key = split_vector_ref(ref)
    if not path.is_file():
        raise SpecError(f"{where}: vector file {str(path)!r} not found")
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
            return _pick(tensors, key, path, where)
        if suffix == ".npy":
            return torch.from_numpy(_load_npy(path, where))
        if suffix in (".pt", ".pth"):
            loaded = _load_pt(path, where)
            if isinstance(loaded, dict):
                return _pick(loaded, key, path, where)
            if not isinstance(loaded, torch.Tensor):
                raise SpecError(f"{where}: {path} holds a {type(loaded).__name__}, not a tensor")
            return loaded
    except SpecError:
        raise
    except Exception as err:  # corrupt files raise many types
        raise SpecError(f"{where}: cannot read {path}: {type(err).__name__}: {err}") from err
    raise SpecError(f"{where}: unsupported vector file type {suffix!r}; use .safetensors, .npy or .pt")


def _load_npy(path: Path, where: str) -> np.ndarray:
    """numpy refuses object arrays under allow_pickle=False; say why, and how to save a loadable file."""
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as err:
        if "allow_pickle" not in str(err):
            raise
        raise SpecError(
            f"{where}: {path} holds Python objects, not numbers; it is refused because loading it would unpickle "
            "(which can run code). Save a plain float array: np.save(path, np.asarray(vector, dtype=np.float32))"
        ) from None


def _load_pt(path: Path, where: str) -> object:
    """torch's weights_only refusal suggests weights_only=False; never that: name the offending type instead."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL (\S+)", str(err))
        what = f"a {found.group(1)} object" if found else "objects that are not tensors"
        raise SpecError(
            f"{where}: {path} stores {what}, so loading it needs full unpickling, which can run arbitrary code; "
            "it is refused. Re-save the bare tensor (torch.save(tensor, path)) or use .safetensors or .npy"
        ) from None


def _pick(tensors: dict[str, torch.Tensor], key: str, path: Path, where: str) -> torch.Tensor:
    if key:
        if key not in tensors:
            raise SpecError(f"{where}: {path} has no tensor {key!r}; it has {sorted(tensors)}")
        return tensors[key]
    if len(tensors) != 1:
        raise SpecError(f"{where}: {path} holds {len(tensors)} tensors {sorted(tensors)}; name one as 'path:key'")
    return next(iter(tensors.values()))


def vector_hash(vector: torch.Tensor) -> str:
    return "sha256:" + hashlib.sha256(vector.numpy().tobytes()).hexdigest()[:32]


def write_vector_file(vectors: dict, path: Path, metadata: dict[str, str]) -> None:
    """The one steering-vector file layout (extract-vector and import-vector both write it): a float32
    tensor per hook point, keyed by the hook's name so that ``path:hook`` picks it, and metadata with
    each hook's layer and norm next to the caller's provenance fields."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    hooks = {h: {"layer": parse_hook_point(h)[0], "norm": float(v.norm())} for h, v in vectors.items()}
    meta = {**metadata, "hooks": json.dumps(hooks)}
    save_file({h: v.contiguous() for h, v in vectors.items()}, str(path), metadata=meta)
