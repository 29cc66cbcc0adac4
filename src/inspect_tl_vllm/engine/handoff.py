"""How captured activations travel from a worker to the front end.

The answer to ``collective_rpc`` crosses vLLM's message queues (worker -> engine core ->
front end) as serialised bytes.  That path manages about 50-200 MB/s, so per-token captures
of every layer (gigabytes for a few hundred prompts) would spend longer in transit than in
the model.  When the worker runs on the front end's host, it instead writes each request's
per-token tensors as a safetensors file into a folder the front end made (in ``/dev/shm``
where it has room, else the temp folder), and the answer only names the file; the front end
maps it into memory (no copy: the tensors it returns are views of the mapping) and deletes
it.  Pooled captures (one row per hook point) always travel as bytes: a file per request
would cost more than the few kilobytes it saves the queue.

A request whose capture ends inside the prompt is written out as soon as its last prompt
rows reach the host, on a worker thread, while it still decodes (``worker.py``); the fetch
then only names the file.

A worker knows it shares the host when it finds the folder's token file with the token the
front end sent (a worker on another node, as with the Ray executor, does not) and falls back
to sending the bytes, as it does when the folder is full.

The folder is removed when its front end goes away, but a front end killed with SIGKILL
runs no clean-up, and ``/dev/shm`` is memory.  So its name carries its owner (pid namespace
and pid), and each new folder first removes the folders of owners that no longer exist.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import struct
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.instrument.dtypes import TORCH_DTYPES

TOKEN_FILE = "TOKEN"
PREFIX = "tlvllm-handoff-"
_OWNER = re.compile(re.escape(PREFIX) + r"(\d+)\.(\d+)-")  # pid namespace, pid
# safetensors' name of each capture dtype: F<bits> for IEEE floats, BF16 for bfloat16; I32 for an SAE
# capture's feature indices
_SAFETENSORS_DTYPES = {
    dtype: ("BF" if name == "bfloat16" else "F") + str(8 * dtype.itemsize) for name, dtype in TORCH_DTYPES.items()
} | {torch.int32: "I32"}
_TORCH_DTYPES = {code: dtype for dtype, code in _SAFETENSORS_DTYPES.items()}
_IOV_MAX = 1024  # buffers one writev takes on Linux


class HandoffFolder:
    """Front-end side: the folder, its token, and reading what workers wrote there."""

    def __init__(self) -> None:
        base = handoff_base()
        sweep_stale(base)
        self.path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_pid_namespace()}.{os.getpid()}-", dir=base))
        self.token = uuid.uuid4().hex
        (self.path / TOKEN_FILE).write_text(self.token)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def ticket(self) -> list[str]:
        """What the fetch RPC carries so that a worker can tell whether it shares the folder."""
        return [str(self.path), self.token]

    def take(self, name: str) -> dict[str, Any]:
        """The tensors of one file a worker wrote, mapped rather than read; the file is deleted."""
        path = self.path / Path(name).name
        try:
            return load_mapped(path)
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._cleanup()


def handoff_base() -> Path:
    """Where hand-off folders are made: ``/dev/shm`` where it can be written, else the temp folder."""
    return Path("/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir())


def sweep_stale_everywhere() -> list[Path]:
    """``sweep_stale`` wherever a front end may have made its folder; an engine process whose front
    end died runs it on its way out."""
    bases = {handoff_base(), Path(tempfile.gettempdir())}
    return [entry for base in sorted(bases) for entry in sweep_stale(base)]


def sweep_stale(base: Path) -> list[Path]:
    """Remove the hand-off folders in ``base`` whose owner process is gone; returns them.

    Only folders of this pid namespace are judged: containers that share ``/dev/shm`` (Docker's
    ``--ipc=host``, which vLLM recommends) each number their processes from 1, so another
    container's live front end can carry a pid that is free here.  A folder whose pid has been
    reused by a live process stays until that process ends too.
    """
    namespace = _pid_namespace()
    removed = []
    for entry in base.glob(f"{PREFIX}*"):
        owner = folder_owner(entry.name)
        if owner is None or owner[0] != namespace or _alive(owner[1]):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    return removed


def folder_owner(name: str) -> tuple[int, int] | None:
    """The pid namespace and pid of the front end that made the hand-off folder ``name``; None
    for a name that is not a hand-off folder's."""
    owner = _OWNER.match(name)
    return None if owner is None else (int(owner[1]), int(owner[2]))


def _pid_namespace() -> int:
    """This process's pid namespace (its inode number), or 0 where ``/proc`` does not tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def shared_folder(ticket: list[str] | None) -> Path | None:
    """Worker side: the front end's folder if this worker can see it, else None."""
    if not ticket:
        return None
    path, token = Path(ticket[0]), ticket[1]
    try:
        return path if (path / TOKEN_FILE).read_text() == token else None
    except OSError:
        return None


def write_tensors(folder: Path | None, uid: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The payload fields for ``tensors``: a file in ``folder`` when possible, else the bytes."""
    from safetensors.torch import save

    if not tensors:
        return {"tensors": b"", "files": []}
    if folder is not None:
        path = folder / f"{uid}-{uuid.uuid4().hex[:8]}.safetensors"  # pipeline stages each write a part
        try:
            save_file(tensors, path)
            return {"tensors": b"", "files": [path.name]}
        except OSError:  # the folder is full or gone
            path.unlink(missing_ok=True)
    return {"tensors": save(_unshared(tensors)), "files": []}


def save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` in the safetensors format, copying each tensor's memory once.

    ``safetensors.torch.save_file`` first copies every tensor into a ``bytes`` object and
    then writes that; for captures of every layer (gigabytes) the extra copy costs as much
    as the write.  The file is the same: a little-endian u64 header length, the JSON header
    (padded with spaces to 8 bytes), then the tensors' bytes back to back.  Views that share
    memory (two names of one site) are simply written twice.

    This runs on the worker's writer threads while the step loop runs, and each time a
    writer takes the GIL back the step loop may have to wait for it; so the file goes out in
    one ``writev`` (one release of the GIL) and each tensor costs three torch calls.
    """
    header: dict[str, Any] = {}
    buffers = []
    offset = 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy()  # its bytes, no copy
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        offset += data.nbytes
        if data.nbytes:
            buffers.append(data)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, [header_bytes(header), *buffers])
    finally:
        os.close(fd)


def _write_all(fd: int, parts: list[Any]) -> None:
    """``os.writev`` until every byte of ``parts`` is written (a write may stop short)."""
    views = [memoryview(part).cast("B") for part in parts]
    while views:
        written = os.writev(fd, views[:_IOV_MAX])
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def header_bytes(header: dict[str, Any]) -> bytes:
    """A safetensors file's start: the u64 length, then the JSON header padded to 8 bytes."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def load_mapped(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a file ``save_file`` wrote, as views of a private memory map of it.

    ``safetensors.torch.load_file`` maps the file too, but builds each tensor on its own, which
    adds up over a request's dozens of hook points; views of one map cost a fraction of that.
    The map is copy-on-write, so the tensors can be changed without touching the file, and it
    lives as long as any of them (deleting the file does not end it).
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        header_len = struct.unpack("<Q", file.read(8))[0] if size >= 8 else size
        if not 8 + header_len <= size:
            raise ValueError(f"{path.name}: not a safetensors file (header of {header_len} bytes in {size})")
        header = json.loads(file.read(header_len))
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = _TORCH_DTYPES[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= size - start:
            raise ValueError(f"{path.name}: tensor {name!r} lies outside the file")
        count = (end - begin) // dtype.itemsize
        if count == 0:
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin).view(shape)
    return tensors


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-token rows are views of the step's host block; two hook names of one site (an
    alias, such as ``blocks.1.hook_resid_pre`` and ``blocks.0.hook_resid_post``) give two
    views of the same rows, which ``safetensors.torch.save`` refuses.  Copy the repeats."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out
