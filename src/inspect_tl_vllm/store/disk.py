"""Activations on disk, next to the eval log: one safetensors file per sample and epoch,
plus ``index.jsonl`` that joins them to eval id, sample id, epoch and sample uuid.

- Default place: ``<log file without extension>.activations/`` beside the log
  (``-M activations_dir=DIR`` overrides; then ``DIR/<eval id>/``).
- Writes are atomic: each file is written to a temporary name and renamed; each index line
  is one ``write`` to a file opened in append mode, so concurrent writers never interleave.
- A retried sample overwrites its own file (same name) and appends a newer index line;
  readers keep the last line per (sample id, epoch).
- File names are derived from a hash of the sample id, so ids with ``/``, ``..`` or odd
  characters cannot escape the directory.
- A file name read back (from an index line or a log) is trusted only as a plain name that
  resolves inside its folder (``contained_file``): an edited index cannot make a reader or
  ``eval-retry`` touch a file elsewhere.
- A write that fails (disk full, file size limit) raises an error naming the folder and the cause,
  and leaves neither a partial file nor a partial index line behind.
- ``link_sample`` adds a file stored for an earlier eval (one that ``eval-retry`` reused a sample
  from) to a later eval's folder, with a hard link and an index line of its own.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.specs import SpecError

INDEX = "index.jsonl"


class StoredFileError(ValueError):
    """A file that an index line or a log names cannot be used: it is missing or unreadable, fails its
    checksum, does not parse, or its name leads outside its folder. One type, so that a reader can
    skip such a record and keep the others."""


class UnsafePathError(StoredFileError):
    """A name read from an index or a log that would lead outside the folder it must stay in."""


def contained_file(directory: Path, name: Any, where: str) -> Path:
    """``directory / name`` for a file name read from an index or a log (``where`` says which line).

    Such names are data, not paths: an edited ``index.jsonl`` must not make a reader read, or
    ``eval-retry`` hard-link over, a file outside the folder. So the name must be a plain file name
    (no path separator, not ``.`` or ``..``, no NUL) and, symlinks followed, stay directly in the folder.
    """
    rule = (
        "a stored file name must be a plain file name that resolves directly inside its activations folder "
        "(no '/' or '\\', not '.' or '..', no NUL, no symlink leading out)"
    )
    refusal = UnsafePathError(
        f"{where}: file name {name!r} refused for folder {directory}: {rule}. The index or log was edited "
        "or is corrupt: restore it, or delete that line"
    )
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in ("/", "\\", "\0")):
        raise refusal
    path = directory / name
    try:
        inside = path.resolve().parent == directory.resolve()
    except (OSError, RuntimeError, ValueError) as err:  # a symlink loop (RuntimeError before 3.13), a NUL
        raise refusal from err
    if not inside:
        raise refusal
    return path


def is_below(folder: Path, root: Path) -> bool:
    """Whether ``folder`` resolves (symlinks followed) strictly below ``root``: the test a folder read
    from a log must pass before files are taken from it."""
    try:
        resolved, base = folder.resolve(), root.resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop (RuntimeError before 3.13), a NUL
        return False
    return resolved != base and resolved.is_relative_to(base)


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def activations_dir_for(log_location: str, eval_id: str, override: str | None) -> Path:
    """The folder of an eval's activations: ``<log name>.activations`` beside a local log, or
    ``override/<eval id>``.  Activations are written to local disk only, so a log that goes to
    an fsspec location (``--log-dir s3://...``) needs ``-M activations_dir``; without it the
    remote path would turn into a local folder named after it."""
    if override:
        return Path(override).expanduser() / eval_id
    base = log_location
    url = _URL.match(base)
    if url and url.group(1).lower() == "file":
        base = base[len(url.group(0)) :]
    elif url:
        raise SpecError(
            f"the eval log goes to {log_location}, and activations are stored on local disk only: pass "
            "-M activations_dir=LOCAL_DIR (they go to LOCAL_DIR/<eval id>/, joined to the log by eval id) "
            "or use a local --log-dir"
        )
    for suffix in (".eval", ".json"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return Path(base + ".activations")


def record_dir(directory: Path, log_location: str) -> str:
    """How output metadata names an activations folder: relative to the log's folder when it lies
    there (the default), so that the log and its folder can move together; else absolute."""
    folder, base = directory.resolve(), Path(log_location).resolve().parent
    return str(folder.relative_to(base)) if folder.is_relative_to(base) else str(folder)


def recorded_dir(recorded: str, log_location: str) -> Path:
    """The folder that ``record_dir`` named, for the log at ``log_location``."""
    folder = Path(recorded)
    return folder if folder.is_absolute() else Path(log_location).parent / folder


def sample_file_name(sample_id: Any, epoch: int) -> str:
    digest = hashlib.sha256(repr(sample_id).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(sample_id))[:40]
    return f"{safe}-{digest}-e{epoch}.safetensors"


def check_writable(directory: Path) -> None:
    """Fail before generation if activations cannot be written there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as err:
        raise OSError(f"activations directory {directory} is not writable ({err}); set -M activations_dir=DIR") from err


def write_sample(
    directory: Path,
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
    """Write one sample's activations atomically and append its index line; returns the entry.

    ``tokens`` is how many token rows each hook point's tensor stands for (before any reduction);
    ``positions`` gives, for per-token captures, the sequence position of each stored row.
    """
    from safetensors.torch import save

    name = sample_file_name(sample_id, epoch)
    blob = save({hook: tensor.contiguous() for hook, tensor in activations.items()})
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the group, unlike the index
            with os.fdopen(fd, "wb") as handle:
                handle.write(blob)
            os.replace(tmp, directory / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as err:
        raise _write_error(directory, name, err) from err
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
    _append_index(directory, entry)
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
    directory: Path, *, eval_id: str, source: Path, entry: dict[str, Any], sample: tuple[Any, int, str] | None = None
) -> dict[str, Any]:
    """Add a sample file that ``source`` (an earlier eval's folder) holds to ``directory``.

    ``eval-retry`` copies completed samples into the new log without running them, and Inspect's
    cache answers a sample with an output generated earlier, so their activations exist only in
    the earlier log's folder. A hard link (a copy across file systems) makes the new folder
    complete without storing the bytes twice; the new index line names the new eval and where
    the file came from. ``sample`` (id, epoch, uuid) files it under the sample that reused it,
    when that is not the one that produced it (a cache hit). ``entry`` comes from ``source``'s
    index, so its file name must stay inside both folders (``UnsafePathError`` otherwise, before
    anything is written).
    """
    where = f"{source / INDEX}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"
    origin = contained_file(source, entry.get("file"), where)
    owner: dict[str, Any] = {}
    if sample is not None:
        sample_id, epoch, sample_uuid = sample
        owner = {"sample_id": sample_id, "epoch": epoch, "sample_uuid": sample_uuid}
        owner["file"] = sample_file_name(sample_id, epoch)
    target = contained_file(directory, owner.get("file", entry["file"]), where)
    tmp = directory / f".tmp-{uuid.uuid4().hex}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            os.link(origin, tmp)
        except OSError:
            shutil.copyfile(origin, tmp)
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _write_error(directory, target.name, err) from err
    carried_from = {"eval_id": entry.get("eval_id"), "dir": str(source), "file": entry["file"]}
    carried = {**entry, **owner, "eval_id": eval_id, "carried_from": carried_from}
    _append_index(directory, carried)
    return carried


def _append_index(directory: Path, entry: dict[str, Any]) -> None:
    """Append one index line with a single ``write`` (appends of concurrent writers never
    interleave). After a short write (disk full, file size limit) the rest is written or, when
    that fails, the part already written is cut off and the cause raised: the index never holds
    a partial line."""
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    path = directory / INDEX
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)
            start = os.lseek(fd, 0, os.SEEK_CUR) - written  # where this line began (O_APPEND)
            try:
                while written < len(line):  # a short write: writing the rest fails with the cause
                    more = os.write(fd, line[written:])
                    if more == 0:
                        raise OSError(errno.EIO, "the index line could not be written")
                    written += more
            except OSError:
                os.ftruncate(fd, start)
                raise
        finally:
            os.close(fd)
    except OSError as err:
        raise _write_error(directory, INDEX, err) from err


def _write_error(directory: Path, name: str, err: OSError) -> OSError:
    """An OSError (same errno) that names the folder, the file and the cause."""
    cause = err.strerror or str(err)
    return OSError(
        err.errno,
        f"cannot write activations to {directory} ({name}: {cause}); no partial file or index line was kept. "
        "Free disk space or set -M activations_dir=DIR, then finish the failed samples with `inspect eval-retry <log>`",
    )


def read_index(directory: Path) -> list[dict[str, Any]]:
    """Index entries, the last one per (sample id, epoch) winning (retries)."""
    path = directory / INDEX
    if not path.is_file():
        return []
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            key = (repr(entry["sample_id"]), int(entry["epoch"]))
        except (ValueError, KeyError, TypeError):
            # A torn line (power loss mid-append) must not hide every other sample's entry.
            warnings.warn(f"{path}:{number}: skipping an unreadable index line", stacklevel=2)
            continue
        latest[key] = entry
    return list(latest.values())


def read_sample(
    directory: Path, entry: dict[str, Any], verify: bool = True, where: str | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the file ``entry`` (an index line, or a log's record of one) names in ``directory``.

    Raises ``StoredFileError`` naming the file and ``where`` (which index line or sample, default the
    folder's index) when the name leads outside the folder, or the file is missing, changed or unreadable.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    where = where or f"{directory / INDEX}, sample {entry.get('sample_id')!r} epoch {entry.get('epoch')}"
    path = contained_file(directory, entry.get("file"), where)
    try:
        blob = path.read_bytes()
    except OSError as err:
        raise StoredFileError(f"{where}: cannot read {path} ({err.strerror or err})") from err
    if verify and hashlib.sha256(blob).hexdigest() != entry.get("sha256"):
        raise StoredFileError(f"{where}: {path}: checksum mismatch (file changed or corrupt)")
    try:
        tensors = load(blob)
    except SafetensorError as err:
        raise StoredFileError(f"{where}: {path} is not a readable safetensors file ({err})") from err
    # safetensors returns the tensors in no fixed order: give them in the index's (capture) order
    recorded = [hook for hook in entry.get("hooks") or {} if hook in tensors]
    return {hook: tensors[hook] for hook in recorded + sorted(set(tensors) - set(recorded))}
