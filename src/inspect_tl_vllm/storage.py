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
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

INDEX = "index.jsonl"


def activations_dir_for(log_location: str, eval_id: str, override: str | None) -> Path:
    if override:
        return Path(override).expanduser() / eval_id
    base = log_location
    for suffix in (".eval", ".json"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return Path(base + ".activations")


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
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one sample's activations atomically and append its index line; returns the entry.

    ``tokens`` is how many token rows each hook point's tensor stands for (before any reduction).
    """
    from safetensors.torch import save

    directory.mkdir(parents=True, exist_ok=True)
    name = sample_file_name(sample_id, epoch)
    blob = save({hook: tensor.contiguous() for hook, tensor in activations.items()})
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
        os.replace(tmp, directory / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
            }
            for hook, t in activations.items()
        },
        **(extra or {}),
    }
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(directory / INDEX, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return entry


def read_index(directory: Path) -> list[dict[str, Any]]:
    """Index entries, the last one per (sample id, epoch) winning (retries)."""
    path = directory / INDEX
    if not path.is_file():
        return []
    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            latest[(repr(entry["sample_id"]), int(entry["epoch"]))] = entry
    return list(latest.values())


def read_sample(directory: Path, entry: dict[str, Any], verify: bool = True) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    blob = (directory / entry["file"]).read_bytes()
    if verify and hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise ValueError(f"{directory / entry['file']}: checksum mismatch (file changed or corrupt)")
    return load(blob)
