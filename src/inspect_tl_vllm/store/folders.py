"""Where an eval's activations live: a local folder, or a folder in any fsspec store (S3, GCS,
Azure, ...) beside a log that Inspect writes there.  ``store/sample_store.py`` says what goes in a
folder; this module says how bytes get in and out, with each store's own guarantees:

- **Local** (``LocalFolder``): a file is written under a temporary name and renamed; the index is
  one ``index.jsonl`` that every writer appends to with one ``write`` (appends never interleave);
  a stored file is added from another folder with a hard link (a copy across file systems).
- **Remote** (``RemoteFolder``): an object store has no rename and no append, but writes each
  object whole or not at all.  So a file is one object, and each index entry is one small object
  ``index/<file>.json``, written after the file it names: an entry present means its file was
  complete.  A crash between the two leaves a file without an entry, which readers never see.
  A retried sample overwrites both objects (its names do not change).  A stored file is added from
  another folder of the same store with a server-side copy (S3 ``CopyObject``), else downloaded
  and uploaded.

Names inside a folder come from ``sample_store.py`` or, when read back, from an index or a log; either
way ``Folder.file`` accepts only a plain name that stays in the folder (``UnsafePathError``). Index
lines are parsed and range-checked by ``store/entries.py``. A local file is read only when it is a
regular file (a FIFO would make the reader wait forever), and a remote folder's listings and
existence checks give up after ``REMOTE_TIMEOUT_S``.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import shutil
import stat
import tempfile
import uuid
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from inspect_tl_vllm.specs import SpecError
from inspect_tl_vllm.store.entries import parse_entry

T = TypeVar("T")

INDEX = "index.jsonl"
"""The local index: one JSON line per stored file."""
REMOTE_INDEX = "index"
"""The remote index: a folder of one JSON object per stored file."""
SHARDS = "shards"
"""The folder of shards (``store/shards.py``) inside an activations folder."""
REMOTE_TIMEOUT_S = 60.0
"""How long a remote folder's listing or existence check may take before it is given up on
(``RemoteFolder._bounded``): a store that stopped answering must not hold a reader or eval-retry's
carry-over for its client's own limits (five minutes for HTTP)."""
IN_MEMORY = ("memory",)
"""fsspec stores that keep their files in this process's memory, where no other process (a reader,
``tl-vllm activations``, eval-retry) ever sees them."""

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class StoredFileError(ValueError):
    """A file that an index line or a log names cannot be used: it is missing or unreadable, fails its
    checksum, does not parse, or its name leads outside its folder. One type, so that a reader can
    skip such a record and keep the others."""


class UnsafePathError(StoredFileError):
    """A name read from an index or a log that would lead outside the folder it must stay in."""


def is_url(location: str) -> bool:
    """Whether ``location`` names a remote store (``s3://...``); ``file://`` is local."""
    url = _URL.match(location)
    return bool(url) and url.group(1).lower() != "file"


def in_memory(location: str) -> str | None:
    """The protocol of ``location`` when it names a store that lives in this process's memory
    (``IN_MEMORY``), else ``None``."""
    url = _URL.match(location)
    protocol = url.group(1).lower() if url else None
    return protocol if protocol in IN_MEMORY else None


def local_path(location: str) -> str:
    """``location`` without a ``file://`` prefix."""
    url = _URL.match(location)
    return location[len(url.group(0)) :] if url and url.group(1).lower() == "file" else location


def folder_at(location: str | Path) -> Folder:
    """The folder at a local path, a ``file://`` URL or any fsspec URL."""
    text = str(location)
    return RemoteFolder(text) if is_url(text) else LocalFolder(Path(local_path(text)).expanduser())


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in ("/", "\\", "\0"))


def open_regular(path: str | Path, where: str) -> int:
    """A read-only descriptor of ``path``, refused (``StoredFileError`` naming ``where``) unless it is
    a regular file: reading a FIFO would wait for a writer forever, and a device or a folder is no
    stored file. The open itself does not wait (``O_NONBLOCK``, which a regular file ignores)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise StoredFileError(f"{where}: cannot read {path} ({err.strerror or err})") from err
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise StoredFileError(
            f"{where}: {path} is not a regular file (a FIFO, a device or a folder), so it holds no stored "
            "activations: restore the file, or delete its index line"
        )
    return descriptor


def _refusal(folder: str, name: Any, where: str) -> UnsafePathError:
    rule = (
        "a stored file name must be a plain file name that resolves directly inside its activations folder "
        "(no '/' or '\\', not '.' or '..', no NUL, no symlink leading out)"
    )
    return UnsafePathError(
        f"{where}: file name {name!r} refused for folder {folder}: {rule}. The index or log was edited "
        "or is corrupt: restore it, or delete that line"
    )


class Folder(ABC):
    """What ``sample_store.py`` needs of a folder; ``LocalFolder`` and ``RemoteFolder`` implement it."""

    location: str
    """The folder as a user would write it: a path or a URL."""

    def __str__(self) -> str:
        return self.location

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Folder) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    @abstractmethod
    def key(self) -> str:
        """One spelling per folder (symlinks and ``..`` resolved), for comparing folders."""

    @property
    def name(self) -> str:
        return posixpath.basename(self.location.rstrip("/"))

    @property
    @abstractmethod
    def index_location(self) -> str:
        """Where the index is, for messages."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether anything was stored here."""

    @abstractmethod
    def sibling(self, name: str) -> Folder:
        """The folder called ``name`` beside this one."""

    @abstractmethod
    def is_below(self, root: str) -> bool:
        """Whether this folder lies strictly below ``root`` (a path or URL of the same store): the
        test a folder read from a log must pass before files are taken from it."""

    @abstractmethod
    def check_writable(self) -> None:
        """Fail before generation if files cannot be written here."""

    @abstractmethod
    def file(self, name: Any, where: str) -> str:
        """The location of the file ``name`` read from an index or a log (``where`` says which line).
        Such names are data, not paths: an edited index must not make a reader read, or ``eval-retry``
        overwrite, a file outside the folder (``UnsafePathError``)."""

    @abstractmethod
    def write(self, name: str, blob: bytes) -> None:
        """Store ``blob`` as ``name``, whole or not at all."""

    @abstractmethod
    def read(self, name: str, where: str) -> bytes:
        """The bytes of ``name`` (``StoredFileError`` naming ``where`` when they cannot be read)."""

    @abstractmethod
    def add_entry(self, entry: dict[str, Any]) -> None:
        """Record an index entry for the stored file ``entry["file"]`` (already written)."""

    @abstractmethod
    def entries(self) -> list[dict[str, Any]]:
        """Every index entry, in the order written; unreadable ones are skipped with a warning."""

    @abstractmethod
    def add_copy(self, source: Folder, name: str, target: str, where: str) -> None:
        """Store ``source``'s file ``name`` here as ``target``, without storing the bytes twice where
        the store allows."""

    @abstractmethod
    def sub(self, name: str) -> Folder:
        """The folder ``name`` inside this one (``shards``)."""

    @abstractmethod
    def names(self, suffix: str) -> list[str]:
        """The names of the files directly in this folder that end with ``suffix``, sorted."""

    @abstractmethod
    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        """The bytes of each of ``names`` (an object store fetches them concurrently), or the error
        reading it raised."""

    def write_error(self, name: str, err: OSError) -> OSError:
        """An OSError (same errno) that names the folder, the file and the cause."""
        cause = err.strerror or str(err)
        return OSError(
            err.errno,
            f"cannot write activations to {self.location} ({name}: {cause}); no partial file or index entry was "
            "kept. Free space or set -M activations_dir=DIR, then finish the failed samples with "
            "`inspect eval-retry <log>`",
        )


class LocalFolder(Folder):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)

    @property
    def key(self) -> str:
        try:
            return str(self.path.resolve())
        except (OSError, RuntimeError, ValueError):  # a symlink loop (RuntimeError before 3.13), a NUL
            return str(self.path.absolute())

    @property
    def index_location(self) -> str:
        return str(self.path / INDEX)

    def exists(self) -> bool:
        return self.path.is_dir()  # is_dir first: a symlink loop is no dir

    def sibling(self, name: str) -> Folder:
        return LocalFolder(self.path.parent / name)

    def is_below(self, root: str) -> bool:
        if is_url(root):
            return False
        try:
            resolved, base = self.path.resolve(), Path(local_path(root)).expanduser().resolve()
        except (OSError, RuntimeError, ValueError):
            return False
        return resolved != base and resolved.is_relative_to(base)

    def check_writable(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".probe-"):
                pass
        except OSError as err:
            raise OSError(
                f"activations directory {self.path} is not writable ({err}); set -M activations_dir=DIR"
            ) from err

    def file(self, name: Any, where: str) -> str:
        """Symlinks followed, the file must stay directly in the folder."""
        if not _plain_name(name):
            raise _refusal(self.location, name, where)
        path = self.path / name
        try:
            inside = path.resolve().parent == self.path.resolve()
        except (OSError, RuntimeError, ValueError) as err:
            raise _refusal(self.location, name, where) from err
        if not inside:
            raise _refusal(self.location, name, where)
        return str(path)

    def write(self, name: str, blob: bytes) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
            try:
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the group, unlike the index
                with os.fdopen(fd, "wb") as handle:
                    handle.write(blob)
                os.replace(tmp, self.path / name)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as err:
            raise self.write_error(name, err) from err

    def read(self, name: str, where: str) -> bytes:
        path = self.file(name, where)
        try:
            with os.fdopen(open_regular(path, where), "rb") as handle:
                return handle.read()
        except OSError as err:
            raise StoredFileError(f"{where}: cannot read {path} ({err.strerror or err})") from err

    def add_entry(self, entry: dict[str, Any]) -> None:
        """One appended line (``append``): the index never holds a partial line."""
        self.append(INDEX, (json.dumps(entry, sort_keys=True) + "\n").encode())

    def append(self, name: str, blob: bytes) -> int:
        """Append ``blob`` to ``name`` with one ``write`` (appends of concurrent writers never
        interleave); returns the offset it starts at. After a short write (disk full, file size
        limit) the rest is written or, when that fails, the part already written is cut off and the
        cause raised: the file never ends in a partial blob."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                written = os.write(fd, blob)
                start = os.lseek(fd, 0, os.SEEK_CUR) - written  # where this blob began (O_APPEND)
                try:
                    while written < len(blob):  # a short write: writing the rest fails with the cause
                        more = os.write(fd, blob[written:])
                        if more == 0:
                            raise OSError(errno.EIO, f"{name} could not be appended to")
                        written += more
                except OSError:
                    os.ftruncate(fd, start)
                    raise
            finally:
                os.close(fd)
        except OSError as err:
            raise self.write_error(name, err) from err
        return start

    def entries(self) -> list[dict[str, Any]]:
        path = self.path / INDEX
        if not os.path.lexists(path):
            return []
        try:
            blob = self.read(INDEX, self.location)
        except StoredFileError as err:
            warnings.warn(f"skipping an unreadable index: {err}", stacklevel=3)
            return []
        found = []
        for number, line in enumerate(blob.splitlines(), start=1):
            if line.strip():
                # A torn line (power loss mid-append) must not hide every other sample's entry.
                entry = parse_entry(line, f"{path}:{number}")
                if entry is not None:
                    found.append(entry)
        return found

    def add_copy(self, source: Folder, name: str, target: str, where: str) -> None:
        destination = self.file(target, where)
        tmp = self.path / f".tmp-{uuid.uuid4().hex}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            if isinstance(source, LocalFolder):
                origin = source.file(name, where)
                os.close(open_regular(origin, where))  # a FIFO or device carried over would fail every reader
                try:
                    os.link(origin, tmp)
                except OSError:
                    shutil.copyfile(origin, tmp)
            else:
                tmp.write_bytes(source.read(name, where))
            os.replace(tmp, destination)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise self.write_error(target, err) from err

    def sub(self, name: str) -> Folder:
        return LocalFolder(self.path / name)

    def names(self, suffix: str) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(p.name for p in self.path.iterdir() if p.name.endswith(suffix) and p.is_file())

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        found: dict[str, bytes | Exception] = {}
        for name in names:
            try:
                found[name] = self.read(name, self.location)
            except StoredFileError as err:
                found[name] = err
        return found


class RemoteFolder(Folder):
    def __init__(self, url: str) -> None:
        from fsspec.core import url_to_fs

        self.location = url.rstrip("/")
        try:
            self.fs, root = url_to_fs(self.location)
        except (ImportError, ValueError) as err:  # no such protocol, or its package is not installed
            raise SpecError(
                f"activations folder {self.location}: fsspec cannot open it ({err}). Install the store's fsspec "
                "package (s3fs, gcsfs, adlfs, ...) or pass -M activations_dir=LOCAL_DIR"
            ) from err
        self.root = root.rstrip("/")

    @property
    def key(self) -> str:
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{protocol}://{posixpath.normpath(self.root)}"

    @property
    def index_location(self) -> str:
        return f"{self.location}/{REMOTE_INDEX}/"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _bounded(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, a method of the store that moves no sample data, given up on
        after ``REMOTE_TIMEOUT_S`` with a ``TimeoutError`` naming the folder. fsspec bounds the calls
        of its asynchronous stores (S3, GCS, Azure, HTTP); a synchronous store's call is made as is."""
        from fsspec.exceptions import FSTimeoutError

        if not self.fs.async_impl:
            return call(*args, **kwargs)
        try:
            return call(*args, timeout=REMOTE_TIMEOUT_S, **kwargs)
        except FSTimeoutError as err:
            raise TimeoutError(
                f"activations folder {self.location}: the store did not answer within {REMOTE_TIMEOUT_S:g} s"
            ) from err

    def exists(self) -> bool:
        self.fs.invalidate_cache(self.root)
        return any(self._bounded(self.fs.exists, self._path(part)) for part in (REMOTE_INDEX, SHARDS))

    def sibling(self, name: str) -> Folder:
        return RemoteFolder(posixpath.join(posixpath.dirname(self.location), name))

    def is_below(self, root: str) -> bool:
        if not is_url(root):
            return False
        other = RemoteFolder(root)
        return other.fs.protocol == self.fs.protocol and self.key.startswith(other.key.rstrip("/") + "/")

    def check_writable(self) -> None:
        probe = self._path(f".probe-{uuid.uuid4().hex}")
        try:
            self.fs.pipe_file(probe, b"")
            self.fs.rm_file(probe)
        except Exception as err:  # noqa: BLE001 (each store raises its own errors: name them all)
            raise OSError(
                f"activations folder {self.location} is not writable ({type(err).__name__}: {err}); check the "
                "store's credentials, or set -M activations_dir=DIR"
            ) from err

    def file(self, name: Any, where: str) -> str:
        """An object store has no symlinks: a plain name stays in the folder."""
        if not _plain_name(name):
            raise _refusal(self.location, name, where)
        return f"{self.location}/{name}"

    def write(self, name: str, blob: bytes) -> None:
        try:
            self.fs.pipe_file(self._path(name), blob)
        except Exception as err:  # noqa: BLE001
            raise self.write_error(name, _as_os_error(err)) from err

    def read(self, name: str, where: str) -> bytes:
        location = self.file(name, where)
        try:
            # start=0: one GET (without a range, s3fs first asks the object's size with a HEAD)
            return self.fs.cat_file(self._path(name), start=0)
        except Exception as err:  # noqa: BLE001
            raise StoredFileError(f"{where}: cannot read {location} ({type(err).__name__}: {err})") from err

    def add_entry(self, entry: dict[str, Any]) -> None:
        name = f"{REMOTE_INDEX}/{entry['file']}.json"
        self.write(name, json.dumps(entry, sort_keys=True).encode())

    def entries(self) -> list[dict[str, Any]]:
        folder = self._path(REMOTE_INDEX)
        self.fs.invalidate_cache(folder)
        try:
            paths = sorted(p for p in self._bounded(self.fs.find, folder) if p.endswith(".json"))
        except FileNotFoundError:
            return []
        blobs = self.fs.cat(paths, on_error="return") if paths else {}  # a list: one dict, fetched concurrently
        found = []
        for path in paths:
            blob = blobs.get(path)
            if not isinstance(blob, bytes):  # the error it raised, or nothing
                warnings.warn(f"{path}: skipping an unreadable index entry ({blob})", stacklevel=3)
                continue
            entry = parse_entry(blob, path)
            if entry is not None:
                found.append(entry)
        return found

    def add_copy(self, source: Folder, name: str, target: str, where: str) -> None:
        self.file(target, where)
        if isinstance(source, RemoteFolder) and source.fs.protocol == self.fs.protocol:
            source.file(name, where)
            try:
                # server-side where the store has it (S3 CopyObject); cp_file, not copy, which lists
                # both sides first to tell files from folders
                self.fs.cp_file(source._path(name), self._path(target))
                return
            except FileNotFoundError as err:
                raise StoredFileError(f"{where}: cannot read {source.file(name, where)} ({err})") from err
            except Exception as err:  # noqa: BLE001
                raise self.write_error(target, _as_os_error(err)) from err
        self.write(target, source.read(name, where))

    def sub(self, name: str) -> Folder:
        return RemoteFolder(f"{self.location}/{name}")

    def names(self, suffix: str) -> list[str]:
        self.fs.invalidate_cache(self.root)
        try:
            found = self._bounded(self.fs.ls, self.root, detail=False)
        except FileNotFoundError:
            return []
        return sorted(n for n in (posixpath.basename(p.rstrip("/")) for p in found) if n.endswith(suffix))

    def read_range(self, name: str, start: int, length: int, where: str) -> bytes:
        """``length`` bytes of ``name`` from ``start`` (one ranged GET); fewer when the object ends
        before (a shard cut short). Local shards are read with ``pread`` (``layout.SampleReader``)."""
        location = self.file(name, where)
        try:
            return self.fs.cat_file(self._path(name), start=start, end=start + length)
        except Exception as err:  # noqa: BLE001
            raise StoredFileError(f"{where}: cannot read {location} ({type(err).__name__}: {err})") from err

    def read_many(self, names: list[str]) -> dict[str, bytes | Exception]:
        if not names:
            return {}
        paths = {self._path(name): name for name in names}
        blobs = self.fs.cat(list(paths), on_error="return")  # a list: one dict, fetched concurrently
        return {name: blobs.get(path, FileNotFoundError(path)) for path, name in paths.items()}

    def download(self, name: str, path: Path, where: str) -> None:
        """Copy ``name`` to the local file ``path`` (streamed, not held in memory)."""
        location = self.file(name, where)
        try:
            self.fs.get_file(self._path(name), str(path))
        except Exception as err:  # noqa: BLE001
            raise StoredFileError(f"{where}: cannot read {location} ({type(err).__name__}: {err})") from err

    def upload(self, name: str, path: Path) -> None:
        """Store the local file ``path`` as ``name`` (streamed; a multipart upload where the store has it)."""
        try:
            self.fs.put_file(str(path), self._path(name))
        except Exception as err:  # noqa: BLE001
            raise self.write_error(name, _as_os_error(err)) from err


def _as_os_error(err: Exception) -> OSError:
    return err if isinstance(err, OSError) else OSError(errno.EIO, f"{type(err).__name__}: {err}")
