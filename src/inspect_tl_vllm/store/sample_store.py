"""What an eval's activations folder holds, wherever it lies (``store/folders.py``: local disk or
any fsspec store): one safetensors file per sample and epoch, plus an index whose entries join them
to eval id, sample id, epoch and sample uuid; or, with ``-M activations_shard_mb``, the same
safetensors blobs packed many to a shard with an index per shard (``store/shards.py``). Readers
take both, in one folder too.

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
  touch a file elsewhere. Every other field is type- and range-checked (``store/entries.py``), and
  the bytes read must hold exactly the hooks, shapes and dtypes the entry records: an entry that
  names another sample's bytes is refused.
- A write that fails (disk full, file size limit, a store's error) raises an error naming the
  folder and the cause, and leaves neither a partial file nor a partial index entry behind.
- ``link_sample`` adds a file stored for an earlier eval (one that ``eval-retry`` reused a sample
  from) to a later eval's folder (hard link, or server-side copy), with an index entry of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.specs import SpecError
from inspect_tl_vllm.store.entries import stored_problem
from inspect_tl_vllm.store.folders import (
    INDEX,
    SHARDS,
    Folder,
    RemoteFolder,
    StoredFileError,
    UnsafePathError,
    folder_at,
    is_url,
    local_path,
    open_regular,
)
from inspect_tl_vllm.store.shards import (
    ShardWriter,
    check_complete,
    is_shard_entry,
    shard_entries,
    shard_index_name,
)

__all__ = ["INDEX", "StoredFileError", "UnsafePathError"]  # what readers of a folder expect to find here

STORED_KEYS = ("file", "sha256", "offset", "length", "call")
"""What a log's output records of an entry (beside the folder) to find and check its blob."""


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


def sample_file_name(sample_id: Any, epoch: int, call: int = 0) -> str:
    """A sample's file: its first model call's keeps the name it had before calls were counted."""
    digest = hashlib.sha256(repr(sample_id).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(sample_id))[:40]
    return f"{safe}-{digest}-e{epoch}{f'-c{call}' if call else ''}.safetensors"


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
    shards: ShardWriter | None = None,
    call: int = 0,
) -> dict[str, Any]:
    """Store one sample's activations, whole or not at all, then its index entry; returns the entry.

    ``call`` numbers the sample's model calls that captured (0 first): an agent loop or a dialogue
    keeps one record per call.

    ``tokens`` is how many token rows each hook point's tensor stands for (before any reduction);
    ``positions`` gives, for per-token captures, the sequence position of each stored row.
    ``shards`` (the folder's ``ShardWriter``) packs the sample into a shard instead of a file of its own.
    """
    from safetensors.torch import save

    folder = as_folder(directory)
    blob = save({hook: tensor.contiguous() for hook, tensor in activations.items()})
    entry = {
        "eval_id": eval_id,
        "sample_id": sample_id,
        "epoch": epoch,
        "sample_uuid": sample_uuid,
        "call": call,
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
    if shards is not None:
        return shards.add(entry, blob)
    entry["file"] = sample_file_name(sample_id, epoch, call)
    folder.write(entry["file"], blob)
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
    anything is written). Samples stored in shards go through ``link_shard``.
    """
    folder, origin = as_folder(directory), as_folder(source)
    where = f"{origin.index_location}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"
    origin.file(entry.get("file"), where)
    carried = _carried(entry, eval_id, origin, sample)
    if sample is not None:
        carried["file"] = sample_file_name(sample[0], sample[1])
    folder.add_copy(origin, entry["file"], carried["file"], where)
    folder.add_entry(carried)
    return carried


def link_shard(
    directory: Folder | Path | str,
    *,
    eval_id: str,
    source: Folder | Path | str,
    samples: list[tuple[dict[str, Any], tuple[Any, int, str] | None]],
) -> list[dict[str, Any]]:
    """``link_sample`` for samples that one shard of ``source`` holds: the shard is added whole
    (hard link, server-side copy), with an index of its own listing just ``samples`` (entry from
    ``source``'s shard index, and the sample that reused it, as for ``link_sample``). Blobs of the
    shard that no carried sample names stay in it, unseen."""
    earlier = as_folder(source)
    folder, origin = as_folder(directory).sub(SHARDS), earlier.sub(SHARDS)
    name = samples[0][0].get("file")
    where = f"{origin.location}, sample {samples[0][0].get('sample_id')!r} epoch {samples[0][0].get('epoch')}"
    origin.file(name, where)
    if any(entry.get("file") != name for entry, _ in samples):
        raise ValueError("link_shard: every sample must come from the same shard")
    carried = [_carried(entry, eval_id, earlier, sample) for entry, sample in samples]
    folder.add_copy(origin, name, name, where)
    lines = "".join(json.dumps(entry, sort_keys=True) + "\n" for entry in carried)
    folder.write(shard_index_name(name), lines.encode())
    return carried


def _carried(
    entry: dict[str, Any], eval_id: str, origin: Folder, sample: tuple[Any, int, str] | None
) -> dict[str, Any]:
    """``entry`` as the later eval records it: its eval id, where it came from, its own sample."""
    owner = {"sample_id": sample[0], "epoch": sample[1], "sample_uuid": sample[2]} if sample is not None else {}
    carried_from = {"eval_id": entry.get("eval_id"), "dir": origin.location, "file": entry["file"]}
    return {**entry, **owner, "eval_id": eval_id, "carried_from": carried_from}


def read_index(directory: Folder | Path | str) -> list[dict[str, Any]]:
    """Index entries, per-sample files' then shards', the last one per (sample id, epoch, model call)
    winning (retries)."""
    folder = as_folder(directory)
    entries = folder.entries() + shard_entries(folder)
    latest = {(repr(entry["sample_id"]), int(entry["epoch"]), int(entry.get("call", 0))): entry for entry in entries}
    return list(latest.values())


def read_sample(
    directory: Folder | Path | str,
    entry: dict[str, Any],
    verify: bool = True,
    where: str | None = None,
    reader: SampleReader | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the file or shard blob ``entry`` (an index line, or a log's record of one) names
    in ``directory``; pass ``reader`` (a ``SampleReader`` of that folder) when reading many.

    Raises ``StoredFileError`` naming the file and ``where`` (which index line or sample, default the
    folder's index) when the entry's fields are out of range (a log's record is checked here as an
    index line is when read), the name leads outside the folder, the file is missing, changed, cut
    short or unreadable, or its tensors are not the hooks, shapes and dtypes the entry records.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    if reader is None:
        with SampleReader(directory) as own:
            return read_sample(directory, entry, verify, where, own)
    where = where or reader.where(entry)
    problem = stored_problem(entry)
    if problem is not None:
        raise StoredFileError(f"{where}: {problem}")
    blob, location = reader.blob(entry, where)
    if verify and hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
        raise StoredFileError(f"{where}: {location}: checksum mismatch (file changed or corrupt)")
    try:
        tensors = load(blob)
    except SafetensorError as err:
        raise StoredFileError(f"{where}: {location} is not a readable safetensors file ({err})") from err
    found, recorded = _layout(tensors), {hook: (info["shape"], info["dtype"]) for hook, info in entry["hooks"].items()}
    if found != recorded:  # the checksum only says the bytes are whole, not that they are this sample's
        raise StoredFileError(
            f"{where}: {location} holds {_described(found)} where the entry records {_described(recorded)}: it "
            "names another sample's bytes, or was edited"
        )
    # safetensors returns the tensors in no fixed order: give them in the index's (capture) order
    return {hook: tensors[hook] for hook in recorded}


def _layout(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str]]:
    """Each tensor's shape and dtype, as an index entry records them (``write_sample``)."""
    return {hook: (list(t.shape), str(t.dtype).removeprefix("torch.")) for hook, t in tensors.items()}


def _described(layout: dict[str, tuple[list[int], str]]) -> str:
    return ", ".join(f"{hook} {tuple(shape)} {dtype}" for hook, (shape, dtype) in sorted(layout.items())) or "no tensor"


class SampleReader:
    """Reads the blobs of one folder's samples. A shard's name is checked (``Folder.file``) and the
    shard opened once, then each sample is one ``pread``. A remote shard is fetched with one ranged
    request per sample or, with ``whole_shards`` (reading many samples), downloaded once to a
    temporary folder that ``close`` removes."""

    def __init__(self, directory: Folder | Path | str, whole_shards: bool = False) -> None:
        self.folder = as_folder(directory)
        self.shards = self.folder.sub(SHARDS)
        self._whole = whole_shards and isinstance(self.shards, RemoteFolder)
        self._copies: Path | None = None
        self._open: dict[str, int] = {}  # shard name -> file descriptor (local shards, downloaded copies)

    def where(self, entry: dict[str, Any]) -> str:
        """Which index line an entry is, for messages."""
        index = (
            f"{self.shards.location}/{shard_index_name(entry.get('file'))}"
            if is_shard_entry(entry)
            else self.folder.index_location
        )
        return f"{index}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"

    def blob(self, entry: dict[str, Any], where: str) -> tuple[bytes, str]:
        """The entry's bytes, and where they were read (for messages)."""
        name = entry.get("file")
        if not is_shard_entry(entry):
            return self.folder.read(name, where), self.folder.file(name, where)
        offset, length = entry["offset"], entry["length"]  # whole numbers below 2**62 (read_sample checked)
        location = self.shards.file(name, where) if name not in self._open else f"{self.shards.location}/{name}"
        if isinstance(self.shards, RemoteFolder) and not self._whole:
            blob = self.shards.read_range(name, offset, length, where)
            check_complete(len(blob), entry, where, location)
            return blob, location
        descriptor = self._open.get(name)
        if descriptor is None:
            descriptor = self._open[name] = self._opened(name, location, where)
        try:
            check_complete(max(0, os.fstat(descriptor).st_size - offset), entry, where, location)
            blob = os.pread(descriptor, length, offset)
        except OSError as err:
            raise StoredFileError(f"{where}: cannot read {location} ({err.strerror or err})") from err
        return blob, location

    def _opened(self, name: str, location: str, where: str) -> int:
        path = Path(location)
        if self._whole:
            assert isinstance(self.shards, RemoteFolder)
            if self._copies is None:
                self._copies = Path(tempfile.mkdtemp(prefix="tlvllm-shards-"))
            path = self._copies / name
            self.shards.download(name, path, where)
        return open_regular(path, where)

    def close(self) -> None:
        for descriptor in self._open.values():
            os.close(descriptor)
        self._open.clear()
        if self._copies is not None:
            shutil.rmtree(self._copies, ignore_errors=True)
            self._copies = None

    def __enter__(self) -> SampleReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
