"""What an eval's activations folder holds, wherever it lies (``store/folders.py``: local disk or
any fsspec store): one safetensors file per sample and epoch, plus an index whose entries join them
to eval id, sample id, epoch and sample uuid.

- Default place: ``<log file without extension>.activations`` beside the log, local or remote
  (``-M activations_dir=DIR`` overrides; then ``DIR/<eval id>/``, DIR a path or a URL).
- A file is stored whole or not at all, and its index entry is recorded after it; readers see
  only files with an entry.
- A retried sample overwrites its own file (same name) and records a newer entry; readers keep
  the last entry per (sample id, epoch).
- File names are derived from a hash of the sample id, so ids with ``/``, ``..`` or odd
  characters cannot escape the folder.
- A file name read back (from an index or a log) is trusted only as a plain name that stays
  inside its folder (``Folder.file``): an edited index cannot make a reader or ``eval-retry``
  touch a file elsewhere.
- A write that fails (disk full, file size limit, a store's error) raises an error naming the
  folder and the cause, and leaves neither a partial file nor a partial index entry behind.
- ``link_sample`` adds a file stored for an earlier eval (one that ``eval-retry`` reused a sample
  from) to a later eval's folder (hard link, or server-side copy), with an index entry of its own.
"""

from __future__ import annotations

import hashlib
import posixpath
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.specs import SpecError
from inspect_tl_vllm.store.folders import (
    INDEX,
    Folder,
    StoredFileError,
    UnsafePathError,
    folder_at,
    is_url,
    local_path,
)

__all__ = ["INDEX", "StoredFileError", "UnsafePathError"]  # what readers of a folder expect to find here


def activations_dir_for(log_location: str, eval_id: str, override: str | None) -> Folder:
    """The folder of an eval's activations: ``<log name>.activations`` beside the log, wherever
    the log is (a path, ``file://``, ``s3://``, ...), or ``override/<eval id>``."""
    if override:
        root = override.rstrip("/") if is_url(override) else str(Path(local_path(override)).expanduser())
        return folder_at(f"{root}/{eval_id}")
    base = log_location
    for suffix in (".eval", ".json"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    if not base or base.endswith("/"):
        raise SpecError(f"cannot place activations beside the log {log_location!r}: it has no file name")
    return folder_at(base + ".activations")


def record_dir(folder: Folder, log_location: str) -> str:
    """How output metadata names an activations folder: relative to the log's folder when it lies
    there (the default), so that the log and its folder can move together; else its full location."""
    parent = folder_at(log_parent(log_location))
    if folder.is_below(parent.location):
        return posixpath.relpath(folder.key, parent.key)
    return folder.location if is_url(folder.location) else folder.key


def recorded_dir(recorded: str, log_location: str) -> Folder:
    """The folder that ``record_dir`` named, for the log at ``log_location``."""
    if is_url(recorded) or Path(recorded).is_absolute():
        return folder_at(recorded)
    return folder_at(posixpath.join(log_parent(log_location), recorded))


def log_parent(log_location: str) -> str:
    """The folder holding the log, as a path or a URL."""
    location = local_path(log_location)
    return posixpath.dirname(location) if is_url(location) else str(Path(location).absolute().parent)


def as_folder(folder: Folder | Path | str) -> Folder:
    """A ``Folder`` from a folder, a path or a URL."""
    return folder if isinstance(folder, Folder) else folder_at(folder)


def sample_file_name(sample_id: Any, epoch: int) -> str:
    digest = hashlib.sha256(repr(sample_id).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(sample_id))[:40]
    return f"{safe}-{digest}-e{epoch}.safetensors"


def write_sample(
    directory: Folder | Path | str,
    *,
    eval_id: str,
    sample_id: Any,
    epoch: int,
    sample_uuid: str,
    activations: dict[str, torch.Tensor],
    tokens: dict[str, int],
    positions: dict[str, list[int]] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Store one sample's activations, whole or not at all, then its index entry; returns the entry.

    ``tokens`` is how many token rows each hook point's tensor stands for (before any reduction);
    ``positions`` gives, for per-token captures, the sequence position of each stored row.
    """
    from safetensors.torch import save

    folder = as_folder(directory)
    name = sample_file_name(sample_id, epoch)
    blob = save({hook: tensor.contiguous() for hook, tensor in activations.items()})
    folder.write(name, blob)
    entry = {
        "eval_id": eval_id,
        "sample_id": sample_id,
        "epoch": epoch,
        "sample_uuid": sample_uuid,
        "file": name,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "hooks": {
            hook: {
                "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."),
                "tokens": tokens.get(hook, 0),
                **({"positions": pack_positions(positions[hook])} if positions and hook in positions else {}),
            }
            for hook, t in activations.items()
        },
        **(extra or {}),
    }
    folder.add_entry(entry)
    return entry


def pack_positions(positions: list[int]) -> dict[str, int] | list[int]:
    """A run of consecutive positions (the usual case) as ``{"start", "stop"}``, else the list,
    so that index lines stay short for long captures."""
    if positions and positions == list(range(positions[0], positions[0] + len(positions))):
        return {"start": positions[0], "stop": positions[0] + len(positions)}
    return list(positions)


def unpack_positions(packed: dict[str, int] | list[int]) -> list[int]:
    if isinstance(packed, dict):
        return list(range(packed["start"], packed["stop"]))
    return list(packed)


def link_sample(
    directory: Folder | Path | str,
    *,
    eval_id: str,
    source: Folder | Path | str,
    entry: dict[str, Any],
    sample: tuple[Any, int, str] | None = None,
) -> dict[str, Any]:
    """Add a sample file that ``source`` (an earlier eval's folder) holds to ``directory``.

    ``eval-retry`` copies completed samples into the new log without running them, and Inspect's
    cache answers a sample with an output generated earlier, so their activations exist only in
    the earlier log's folder. A hard link, or a server-side copy in an object store, makes the new
    folder complete (a plain copy where neither works); the new index entry names the new eval and
    where the file came from. ``sample`` (id, epoch, uuid) files it under the sample that reused it,
    when that is not the one that produced it (a cache hit). ``entry`` comes from ``source``'s
    index, so its file name must stay inside both folders (``UnsafePathError`` otherwise, before
    anything is written).
    """
    folder, origin = as_folder(directory), as_folder(source)
    where = f"{origin.index_location}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"
    origin.file(entry.get("file"), where)
    owner: dict[str, Any] = {}
    if sample is not None:
        sample_id, epoch, sample_uuid = sample
        owner = {"sample_id": sample_id, "epoch": epoch, "sample_uuid": sample_uuid}
        owner["file"] = sample_file_name(sample_id, epoch)
    target = owner.get("file", entry["file"])
    folder.add_copy(origin, entry["file"], target, where)
    carried_from = {"eval_id": entry.get("eval_id"), "dir": origin.location, "file": entry["file"]}
    carried = {**entry, **owner, "eval_id": eval_id, "carried_from": carried_from}
    folder.add_entry(carried)
    return carried


def read_index(directory: Folder | Path | str) -> list[dict[str, Any]]:
    """Index entries, the last one per (sample id, epoch) winning (retries)."""
    latest = {(repr(entry["sample_id"]), int(entry["epoch"])): entry for entry in as_folder(directory).entries()}
    return list(latest.values())


def read_sample(
    directory: Folder | Path | str, entry: dict[str, Any], verify: bool = True, where: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the file ``entry`` (an index line, or a log's record of one) names in ``directory``.

    Raises ``StoredFileError`` naming the file and ``where`` (which index line or sample, default the
    folder's index) when the name leads outside the folder, or the file is missing, changed or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    folder = as_folder(directory)
    where = where or f"{folder.index_location}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"
    path = folder.file(entry.get("file"), where)
    blob = folder.read(entry["file"], where)
    if verify and hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
        raise StoredFileError(f"{where}: {path}: checksum mismatch (file changed or corrupt)")
    try:
        tensors = load(blob)
    except SafetensorError as err:
        raise StoredFileError(f"{where}: {path} is not a readable safetensors file ({err})") from err
    # safetensors returns the tensors in no fixed order: give them in the index's (capture) order
    recorded = [hook for hook in entry.get("hooks") or {} if hook in tensors]
    return {hook: tensors[hook] for hook in recorded + sorted(set(tensors) - set(recorded))}
