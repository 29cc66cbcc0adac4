"""Loading and checking steering vectors; never unpickles user files.

Accepted: inline lists, ``.safetensors`` (``path`` with one tensor, or ``path:key``),
``.npy`` (``allow_pickle=False``) and ``.pt`` via ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import stat
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from inspect_tl_vllm.specs import MAX_VECTOR_ENTRY, SpecError, parse_hook_point
from inspect_tl_vllm.vectors.versions import FileVersion, file_version


def load_vector(
    ref: np.ndarray | str,
    width: int,
    *,
    where: str = "vector",
    width_of: str = "the model's hidden size",
) -> torch.Tensor:
    """A 1-D float32 vector of ``width`` finite entries within ``MAX_VECTOR_ENTRY``, or a SpecError
    naming ``where`` (and ``width_of``, what sets the width).  ``ref``: an inline vector's entries
    (``Intervention.inline_vector``, shared, not copied) or a file."""
    vector = torch.from_numpy(ref) if isinstance(ref, np.ndarray) else read_vector_file(ref, where)
    vector = vector.squeeze()
    if vector.ndim != 1:
        raise SpecError(f"{where}: expected a 1-D vector, got shape {tuple(vector.shape)}")
    if vector.numel() != width:
        raise SpecError(
            f"{where}: vector has {vector.numel()} entries but {width_of} is {width}; "
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


def split_vector_ref(ref: str) -> tuple[Path, str]:
    """``path`` or ``path:key`` -> (file path, tensor key or "")."""
    path_text, _, key = ref.partition(":") if ref.count(":") == 1 and not Path(ref).exists() else (ref, "", "")
    return Path(path_text).expanduser(), key


VECTOR_CACHE_BYTES = 256 << 20
"""How many bytes of vectors read from files stay in memory (least recently used first out)."""


class _VectorCache:
    """Vectors read from files, by (resolved path, key), each with the ``stat`` of its file when it was
    read: a request naming the same vector costs a ``stat`` and a copy, not a read of the file, and a
    file rewritten in any way (a new inode, size, mtime, or ctime, which even a rewrite that restores
    its size and mtime changes) is read anew. Bounded by ``VECTOR_CACHE_BYTES``; locked, as requests
    may be prepared on more than one thread."""

    def __init__(self) -> None:
        self._items: OrderedDict[tuple[str, str], tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, name: tuple[str, str], version: FileVersion) -> torch.Tensor | None:
        with self._lock:
            found = self._items.get(name)
            if found is None or found[0] != version:
                return None
            self._items.move_to_end(name)
            return found[1]

    def put(self, name: tuple[str, str], version: FileVersion, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            old = self._items.pop(name, None)
            if old is not None:
                self._bytes -= old[1].numel() * old[1].element_size()
            if size > VECTOR_CACHE_BYTES:
                return
            self._items[name] = (version, tensor)
            self._bytes += size
            while self._bytes > VECTOR_CACHE_BYTES:
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()


_CACHE = _VectorCache()


def read_vector_file(ref: str, where: str = "vector") -> torch.Tensor:
    """The tensor a vector reference names, as a float32 tensor of the caller's own (changing it changes
    no cached copy); a non-real tensor is refused rather than cast (casting a complex tensor silently
    drops its imaginary part). Read once per version of the file (``_VectorCache``)."""
    path, key = split_vector_ref(ref)
    try:
        resolved = path.resolve()
        info = resolved.stat()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop
        info = None
    if info is None or not stat.S_ISREG(info.st_mode):
        raise SpecError(f"{where}: vector file {str(path)!r} not found")
    name = (str(resolved), key)
    version = file_version(info)
    cached = _CACHE.get(name, version)
    if cached is None:  # stat first, then read: what is cached is never older than the stat it is filed under
        tensor = _read_tensor(path, key, where)
        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"{where}: {ref} holds a {type(tensor).__name__}, not a tensor")
        if tensor.is_complex() or tensor.dtype == torch.bool:
            kind = str(tensor.dtype).removeprefix("torch.")
            raise SpecError(f"{where}: {ref} holds a {kind} tensor; steering vectors are real numbers")
        # a copy of its own: safetensors' tensors are views of the file's mapping (they would change with
        # the file, and a truncated file would end the process), and a tensor picked from a .pt file may
        # share one storage with the rest of the file's tensors
        cached = tensor.to(torch.float32, copy=True)
        _CACHE.put(name, version, cached)
    return cached.clone()


def _read_tensor(path: Path, key: str, where: str) -> torch.Tensor:
    """The tensor ``key`` names in ``path``. From a safetensors file only that tensor is read, however
    large the file (a vector may be one tensor of a whole checkpoint)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(_pick(list(handle.keys()), key, path, where))
        if suffix == ".npy":
            return torch.from_numpy(_load_npy(path, where))
        if suffix in (".pt", ".pth"):
            loaded = _load_pt(path, where)
            if isinstance(loaded, dict):
                return loaded[_pick(list(loaded), key, path, where)]
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


def _pick(keys: list[str], key: str, path: Path, where: str) -> str:
    """The key to read: ``key`` if the file has it, else the file's only one."""
    if key:
        if key not in keys:
            raise SpecError(f"{where}: {path} has no tensor {key!r}; it has {_some(keys)}")
        return key
    if len(keys) != 1:
        raise SpecError(f"{where}: {path} holds {len(keys)} tensors {_some(keys)}; name one as 'path:key'")
    return keys[0]


def _some(keys: list[str], shown: int = 20) -> str:
    """A checkpoint's keys for a message: a whole model's hundreds would bury the error."""
    names = sorted(keys)
    return str(names) if len(names) <= shown else f"{names[:shown]} and {len(names) - shown} more"


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
