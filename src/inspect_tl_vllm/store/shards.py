"""Shards: many samples per file, for runs of 10^4 to 10^6 samples and for object stores, where one
file (two requests) per sample costs more than the samples themselves (``-M activations_shard_mb=N``).

Inside an activations folder (``store/sample_store.py``)::

    shards/<name>.bin    the samples' safetensors blobs, one after another
    shards/<name>.jsonl  one index line per sample: the per-sample layout's entry, with ``file``
                         naming the shard and ``offset`` / ``length`` the blob in it

A shard's name starts with the UTC time it was begun, so sorting names sorts shards by age (the
last entry per sample and epoch wins, as with per-sample files). A reader lists only the small
``.jsonl`` objects, and reads one sample with one ranged read.

- **Local:** the blob is appended to ``.bin``, then its line to ``.jsonl`` (each one ``write``):
  a crash between the two leaves a blob without a line, which readers never see. Entries appear as
  samples finish, so a killed run loses nothing it reported.
- **Remote:** an object store has no append. A shard is written to a local *spool* in the same
  format and uploaded when it reaches its target size or the eval ends, ``.bin`` first, then
  ``.jsonl``: readers see a shard whole or not at all. Uploads run on a thread of their own, so
  memory stays bounded by one sample and no sample waits on an upload. A process killed before
  uploading leaves its spool: the spool is locked while its writer lives, and the next process
  that reads or carries over from that folder on this machine (``activations.load``,
  ``inspect eval-retry``) uploads it first.
- **Cut short:** a shard whose bytes end before an entry's blob (power lost before the data
  reached the disk, a copy stopped half way) fails that entry with ``StoredFileError`` (readers
  skip it with a warning) while its complete samples and every other shard read.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from inspect_tl_vllm.store.entries import parse_entry
from inspect_tl_vllm.store.folders import SHARDS, Folder, LocalFolder, RemoteFolder, StoredFileError

logger = logging.getLogger(__name__)

SHARD_MB_RANGE = (1, 4096)
"""What ``-M activations_shard_mb`` accepts: a shard's target size in MiB."""
SPOOL_ENV = "TLVLLM_SPOOL_DIR"
"""Where remote shards wait for their upload (default ``~/.cache/inspect_tl_vllm/spool``)."""


def shard_entries(folder: Folder) -> list[dict[str, Any]]:
    """The entries of every shard in ``folder``, oldest shard first; a torn, unreadable or out of
    range line is skipped with a warning (``parse_entry``), and so is a line that names a file other
    than its own shard or no span of it (an index can only point into the shard it describes)."""
    shards = folder.sub(SHARDS)
    names = shards.names(".jsonl")
    found = []
    for name, blob in shards.read_many(names).items():
        where = f"{shards.location}/{name}"
        if not isinstance(blob, bytes):
            warnings.warn(f"{where}: skipping an unreadable shard index ({blob})", stacklevel=3)
            continue
        own = name.removesuffix(".jsonl") + ".bin"  # the one file its lines may name
        for number, line in enumerate(blob.splitlines(), start=1):
            entry = parse_entry(line, f"{where}:{number}") if line.strip() else None
            if entry is None:
                continue
            if entry.get("file") != own or not is_shard_entry(entry):
                warnings.warn(
                    f"{where}:{number}: skipping an entry that does not point into its own shard {own}", stacklevel=3
                )
                continue
            found.append(entry)
    return found


def is_shard_entry(entry: dict[str, Any]) -> bool:
    return "offset" in entry


def shard_index_name(shard: Any) -> str:
    """``<name>.jsonl``, the index of the shard ``<name>.bin``."""
    return f"{str(shard).removesuffix('.bin')}.jsonl"


def check_complete(held: int, entry: dict[str, Any], where: str, location: str) -> None:
    """``StoredFileError`` when the shard holds only ``held`` of ``entry``'s bytes (it ended before
    the blob did); checked before a local read, so that no read asks for more than the shard holds."""
    if held < entry["length"]:
        raise StoredFileError(
            f"{where}: shard {location} is cut short: it holds {held} of this sample's {entry['length']} bytes "
            f"(from offset {entry['offset']}); the run that wrote it stopped before its data reached the store. "
            "The shard's complete samples are read"
        )


_last_ns = 0
_names_lock = threading.Lock()


def new_shard_name() -> str:
    """``<UTC time to the nanosecond>Z-<random>``: later shards of a process sort after earlier
    ones (a retried sample's newer entry must win), and names of two writers never collide."""
    global _last_ns
    with _names_lock:
        _last_ns = max(time.time_ns(), _last_ns + 1)
        stamp = _last_ns
    seconds, nanoseconds = divmod(stamp, 10**9)
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(seconds))}.{nanoseconds:09d}Z-{uuid.uuid4().hex[:12]}"


class ShardWriter:
    """Appends samples to a folder's current shard, beginning a new one at the target size.
    Thread-safe: the provider stores samples from worker threads."""

    def __init__(self, folder: Folder, target_bytes: int) -> None:
        self.folder, self.target = folder, target_bytes
        self._lock = threading.Lock()
        self._current: str | None = None
        self._size = 0
        self._spool: Spool | None = Spool.create(folder) if isinstance(folder, RemoteFolder) else None
        self._local = self._spool.folder if self._spool else folder.sub(SHARDS)
        self._uploads = ThreadPoolExecutor(1, thread_name_prefix="tlvllm-shard-upload") if self._spool else None
        self._pending: list[Future[None]] = []

    def add(self, entry: dict[str, Any], blob: bytes) -> dict[str, Any]:
        """Store ``blob`` and its ``entry`` (without ``file``); returns the entry as recorded."""
        assert isinstance(self._local, LocalFolder)
        with self._lock:
            if self._current is None or (self._size and self._size + len(blob) > self.target):
                self._finish_current()
                self._current = new_shard_name()
            name = f"{self._current}.bin"
            offset = self._local.append(name, blob)
            stored = {**entry, "file": name, "offset": offset, "length": len(blob)}
            self._local.append(shard_index_name(name), (json.dumps(stored, sort_keys=True) + "\n").encode())
            self._size = offset + len(blob)
        return stored

    def _finish_current(self) -> None:
        if self._current is not None and self._spool is not None and self._uploads is not None:
            self._pending.append(self._uploads.submit(self._spool.upload, self._current))
        self._current = None

    def close(self) -> None:
        """Upload what is spooled and wait for every upload; the first failure is raised after the
        others finished, its shard left in the spool for the next reader to upload."""
        with self._lock:
            self._finish_current()
            pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        if self._uploads is not None:
            self._uploads.shutdown()
        if self._spool is not None:
            self._spool.release(remove=not any(errors))
        failed = next((err for err in errors if err is not None), None)
        if failed is not None:
            raise OSError(
                f"activations of {self.folder.location}: a shard upload failed ({failed}); it stays spooled on "
                f"this machine in {self._spool.path if self._spool else '?'}, and reading the log here "
                "(activations.load) or `inspect eval-retry` uploads it"
            ) from failed


class Spool:
    """A writer's local folder for the shards of one remote folder, locked (``flock``) while the
    writer lives, so that recovery takes only what a finished or killed process left."""

    def __init__(self, path: Path, lock: int | None) -> None:
        self.path, self._lock = path, lock
        self.folder = LocalFolder(path)
        self.remote: RemoteFolder | None = None

    @staticmethod
    def root_for(folder: Folder) -> Path:
        base = Path(os.environ.get(SPOOL_ENV) or Path.home() / ".cache" / "inspect_tl_vllm" / "spool")
        return base.expanduser() / hashlib.sha256(folder.key.encode()).hexdigest()[:20]

    @classmethod
    def create(cls, folder: RemoteFolder) -> Spool:
        path = cls.root_for(folder) / uuid.uuid4().hex
        try:
            path.mkdir(parents=True)
            (path / "folder").write_text(folder.location)
            lock = os.open(path / "lock", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            raise OSError(
                err.errno,
                f"cannot spool shards for {folder.location} in {path} ({err.strerror or err}); set {SPOOL_ENV} to a "
                "writable local folder",
            ) from err
        spool = cls(path, lock)
        spool.remote = folder
        return spool

    def upload(self, shard: str) -> None:
        """Upload one spooled shard, data before index, then drop it from the spool."""
        assert self.remote is not None
        shards = self.remote.sub(SHARDS)
        assert isinstance(shards, RemoteFolder)
        for suffix in (".bin", ".jsonl"):
            shards.upload(shard + suffix, self.path / (shard + suffix))
        for suffix in (".bin", ".jsonl"):
            (self.path / (shard + suffix)).unlink(missing_ok=True)

    def shards(self) -> list[str]:
        return [name.removesuffix(".jsonl") for name in self.folder.names(".jsonl")]

    def release(self, remove: bool) -> None:
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)  # closing drops the flock
            self._lock = None


def upload_spooled(folder: Folder) -> int:
    """Upload the shards that writers of ``folder`` left in this machine's spool (a killed run, a
    failed upload); returns how many. Spools whose writer still runs are locked and left alone."""
    if not isinstance(folder, RemoteFolder):
        return 0
    root = Spool.root_for(folder)
    uploaded = 0
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            lock = os.open(path / "lock", os.O_RDWR)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by a live writer, or not a spool
            continue
        spool = Spool(path, lock)
        spool.remote = folder
        try:
            for shard in spool.shards():
                spool.upload(shard)
                uploaded += 1
            spool.release(remove=True)
        except OSError as err:
            spool.release(remove=False)
            logger.warning(f"tl-vllm: {err}; the shards stay spooled in {path}")
    if uploaded:
        logger.warning(f"tl-vllm: uploaded {uploaded} shards of {folder.location} that an earlier run left spooled")
    return uploaded


_writers: dict[Folder, ShardWriter] = {}
_writers_lock = threading.Lock()


def writer_for(folder: Folder, shard_mb: int) -> ShardWriter:
    """The one writer of ``folder`` in this process."""
    with _writers_lock:
        writer = _writers.get(folder)
        if writer is None:
            writer = _writers[folder] = ShardWriter(folder, shard_mb << 20)
        return writer


def close_writer(folder: Folder) -> None:
    """Finish ``folder``'s shards (at the end of its eval): upload what is spooled."""
    with _writers_lock:
        writer = _writers.pop(folder, None)
    if writer is not None:
        writer.close()


@atexit.register
def _close_all() -> None:
    with _writers_lock:
        writers = list(_writers.values())
        _writers.clear()
    for writer in writers:
        try:
            writer.close()
        except OSError as err:
            logger.warning(f"tl-vllm: {err}")
