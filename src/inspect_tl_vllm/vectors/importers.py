"""Steering vectors made by other tools, converted to this project's safetensors layout.

Single vectors (``.npy``, ``.pt``/``.pth``, ``.safetensors``, optionally ``FILE:KEY``) are read by the
same pickle-free readers as steering specs (:mod:`inspect_tl_vllm.vectors.files`) and carry no
hook point, so the caller names one.

llama.cpp / repeng control vectors (``.gguf``, ``general.architecture = "controlvector"``) hold one
F32 tensor ``direction.N`` of width n_embd per layer N. **``direction.N`` is
``blocks.N.hook_resid_post``**: the output of decoder layer N, counted from 0 (the same tensor as
``blocks.{N+1}.hook_resid_pre``). Where that comes from:

- llama.cpp: ``common_control_vector_load_one`` (common/common.cpp) stores ``direction.N`` in slot N
  and rejects N = 0; ``llama_control_vector_apply`` (src/llama-adapter.cpp) hands slot ``il`` to
  ``build_cvec(cur, il)``, which each model graph calls in its ``for il = 0 .. n_layer-1`` loop right
  after the feed-forward residual add, on the tensor it names ``l_out`` (the layer's output), for
  every token, prompt included.
- repeng: ``read_representations`` (repeng/extract.py) fits direction N on transformers'
  ``hidden_states[N + 1]``, the output of ``model.layers[N]``; ``ControlModule`` (repeng/control.py)
  adds it to that layer's output; ``export_gguf`` writes it as ``direction.N``.

So ``llama-cli --control-vector-scaled FILE S`` is an ``add`` with ``coef = S`` at each imported hook
point, over all positions. repeng may write ``direction.0``; it maps to ``blocks.0.hook_resid_post``.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.specs import SpecError, parse_hook_point
from inspect_tl_vllm.vectors.files import read_vector_file, split_vector_ref, write_vector_file

GGUF_FORMAT = "gguf-controlvector"
FORMATS = {".npy": "npy", ".pt": "pt", ".pth": "pt", ".safetensors": "safetensors", ".gguf": GGUF_FORMAT}
READABLE = ".npy, .pt/.pth, .safetensors or a llama.cpp/repeng control-vector .gguf"
HOOK_EXAMPLE = "blocks.12.hook_resid_post"


@dataclass
class ImportedVectors:
    """What one source file became: its vectors by hook point and the provenance to store with them."""

    vectors: dict[str, torch.Tensor]  # hook point -> 1-D float32 vector
    metadata: dict[str, str]


def import_vector_file(src: str, out: Path, *, hook: str | None = None, model: str | None = None) -> ImportedVectors:
    """Convert ``src`` and write it to ``out``; every check runs before anything is written."""
    if out.suffix.lower() != ".safetensors":
        raise SpecError(f"--out {out}: the output must be a .safetensors file, e.g. --out vector.safetensors")
    if out.resolve() == split_vector_ref(src)[0].resolve():
        raise SpecError(f"--out {out} would overwrite the source file; choose another output path")
    imported = import_vectors(src, hook=hook, model=model)
    write_vector_file(imported.vectors, out, imported.metadata)
    return imported


def import_vectors(src: str, *, hook: str | None = None, model: str | None = None) -> ImportedVectors:
    """Vectors keyed by hook point plus provenance metadata, or a SpecError naming the file and the fix."""
    path, key = split_vector_ref(src)
    fmt = _format_of(path)
    hint = ""
    if fmt == GGUF_FORMAT:
        if hook or key:
            raise SpecError(
                f"{path}: a control-vector GGUF is imported whole, direction.N as blocks.N.hook_resid_post; "
                "drop --hook and ':KEY'"
            )
        directions, hint = read_control_vector_gguf(path)
        raw = {f"blocks.{n}.hook_resid_post": v for n, v in sorted(directions.items())}
    else:
        raw = {_required_hook(hook, path): read_vector_file(src, "source")}
    vectors = {name: _checked(vector, path, name) for name, vector in raw.items()}
    metadata = {
        "model": model or "",
        "model_hint": hint,
        "source": str(path.resolve()),
        "source_key": key,
        "source_sha256": _sha256(path),
        "format": fmt,
    }
    return ImportedVectors(vectors, {k: v for k, v in metadata.items() if v})


def read_control_vector_gguf(path: Path) -> tuple[dict[int, torch.Tensor], str]:
    """``{N: direction.N}`` and the ``controlvector.model_hint`` ("" if absent).

    Refuses what llama.cpp refuses (other tensor names, non-F32, non-1-D, mixed widths), so a file
    accepted here is one llama.cpp would also load, except that ``direction.0`` is allowed (repeng)."""
    import gguf

    reader = _open_gguf(path)
    arch = _gguf_text(reader, "general.architecture")
    if arch not in ("", "controlvector"):
        raise SpecError(
            f"{path}: general.architecture is {arch!r}, so this GGUF is a model or adapter, not a control vector; "
            "import-vector reads llama.cpp/repeng control vectors (architecture 'controlvector', tensors direction.N)"
        )
    directions: dict[int, torch.Tensor] = {}
    for tensor in reader.tensors:
        layer = _direction_layer(tensor.name, path)
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            raise SpecError(
                f"{path}: {tensor.name} is {tensor.tensor_type.name}; control vectors store F32 directions "
                "(llama.cpp loads nothing else), so re-export it as float32"
            )
        if len(tensor.shape) != 1:
            raise SpecError(
                f"{path}: {tensor.name} has shape {tuple(tensor.data.shape)}; each direction must be 1-D "
                "(one vector of the model's hidden size)"
            )
        directions[layer] = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    if not directions:
        raise SpecError(f"{path}: no direction.N tensors, so this is not a control vector")
    widths = sorted({v.numel() for v in directions.values()})
    if len(widths) > 1:
        raise SpecError(f"{path}: directions have different widths {widths}; one control vector has one width")
    return directions, _gguf_text(reader, "controlvector.model_hint")


def _format_of(path: Path) -> str:
    if not path.is_file():
        raise SpecError(f"{path}: file not found; check the path (SRC is FILE or FILE:KEY)")
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise SpecError(f"{path}: unsupported file type {path.suffix!r}; import-vector reads {READABLE}")
    return fmt


def _required_hook(hook: str | None, path: Path) -> str:
    """Single-vector formats say nothing about where the vector belongs, so the caller must."""
    if not hook:
        raise SpecError(
            f"{path} holds one vector and no hook point; name where it goes with --hook, e.g. --hook {HOOK_EXAMPLE}"
        )
    parse_hook_point(hook)
    return hook


def _checked(vector: torch.Tensor, path: Path, name: str) -> torch.Tensor:
    vector = vector.squeeze()
    if vector.ndim != 1 or vector.numel() == 0:
        raise SpecError(
            f"{path}: {name}: expected one vector (a 1-D tensor), got shape {tuple(vector.shape)}; "
            "save a single row of the model's hidden size"
        )
    bad = int((~torch.isfinite(vector)).sum())
    if bad:
        raise SpecError(f"{path}: {name}: {bad} of {vector.numel()} entries are NaN or inf; fix the source vector")
    return vector.to(torch.float32).contiguous()


def _open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises many types on foreign or truncated files
        raise SpecError(
            f"{path}: not a readable GGUF file ({type(err).__name__}: {err}); "
            "import-vector expects a llama.cpp/repeng control vector"
        ) from err


def _gguf_text(reader: Any, key: str) -> str:
    field = reader.get_field(key)
    return "" if field is None else str(field.contents())


def _direction_layer(name: str, path: Path) -> int:
    match = re.fullmatch(r"direction\.(\d+)", name)
    if match is None:
        raise SpecError(
            f"{path}: tensor {name!r} is not named direction.N, so this is not a llama.cpp/repeng control vector"
        )
    return int(match.group(1))


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
