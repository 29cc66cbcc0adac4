"""How captured activations travel from a worker to the front end.

The answer to ``collective_rpc`` crosses vLLM's message queues (worker -> engine core ->
front end) as serialised bytes.  That path manages about 50-200 MB/s, so per-token captures
of every layer (gigabytes for a few hundred prompts) would spend longer in transit than in
the model.  When the worker runs on the front end's host, it instead writes each request's
tensors as a safetensors file into a folder the front end made (in ``/dev/shm`` where it
has room, else the temp folder), and the answer only names the file; the front end loads it
and deletes it.

A worker knows it shares the host when it finds the folder's token file with the token the
front end sent (a worker on another node, as with the Ray executor, does not) and falls back
to sending the bytes, as it does when the folder is full.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

TOKEN_FILE = "TOKEN"


class HandoffFolder:
    """Front-end side: the folder, its token, and reading what workers wrote there."""

    def __init__(self) -> None:
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self.path = Path(tempfile.mkdtemp(prefix="tlvllm-handoff-", dir=base))
        self.token = uuid.uuid4().hex
        (self.path / TOKEN_FILE).write_text(self.token)
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def ticket(self) -> list[str]:
        """What the fetch RPC carries so that a worker can tell whether it shares the folder."""
        return [str(self.path), self.token]

    def take(self, name: str) -> dict[str, Any]:
        """Load and delete one file a worker wrote."""
        from safetensors.torch import load_file

        path = self.path / Path(name).name
        try:
            return load_file(str(path))
        finally:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        self._cleanup()


def shared_folder(ticket: list[str] | None) -> Path | None:
    """Worker side: the front end's folder if this worker can see it, else None."""
    if not ticket:
        return None
    path, token = Path(ticket[0]), ticket[1]
    try:
        return path if (path / TOKEN_FILE).read_text() == token else None
    except OSError:
        return None


def write_tensors(folder: Path | None, uid: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """The payload fields for ``tensors``: a file in ``folder`` when possible, else the bytes."""
    from safetensors import SafetensorError
    from safetensors.torch import save, save_file

    if not tensors:
        return {"tensors": b"", "files": []}
    tensors = _unshared(tensors)
    if folder is not None:
        path = folder / f"{uid}-{uuid.uuid4().hex[:8]}.safetensors"  # pipeline stages each write a part
        try:
            save_file(tensors, str(path))
            return {"tensors": b"", "files": [path.name]}
        except (OSError, SafetensorError):  # the folder is full or gone (safetensors wraps I/O errors)
            path.unlink(missing_ok=True)
    return {"tensors": save(tensors), "files": []}


def _unshared(tensors: dict[str, Any]) -> dict[str, Any]:
    """Per-token rows are views of the step's host block; two hook names of one site (an
    alias, such as ``blocks.1.hook_resid_pre`` and ``blocks.0.hook_resid_post``) give two
    views of the same rows, which safetensors refuses to write.  Copy the repeats."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        pointer = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if pointer in seen else tensor
        seen.add(pointer)
    return out
