"""The contents of the files a spec names, as sha256 digests: what Inspect's cache keys on.

A spec names vector files (``vector: "dir/v.safetensors:key"``) and SAE folders (``sae: DIR``) by
path.  Keyed on the path, Inspect's ``--cache`` would return an answer steered by a vector that
has since been overwritten; keyed on these digests, recomputed for every call, it cannot.  A
file's digest is computed once per version of it (``versions.file_version``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from inspect_tl_vllm.specs import RequestSpec
from inspect_tl_vllm.vectors.files import split_vector_ref
from inspect_tl_vllm.vectors.sae import CONFIG, WEIGHTS
from inspect_tl_vllm.vectors.versions import FileVersion, file_version

MAX_REMEMBERED = 4096
"""Digests remembered (a few hundred bytes each); the least recently used go first."""

_digests: OrderedDict[tuple[str, FileVersion], str] = OrderedDict()
_lock = threading.Lock()


def file_digest(path: Path) -> str | None:
    """The sha256 of a regular file's bytes, or None when ``path`` is not a regular file (the
    spec's own checks then name what is wrong when the request is prepared)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    if not os.path.isfile(path):
        return None
    key = (str(Path(path).resolve()), file_version(stat))
    with _lock:
        digest = _digests.get(key)
        if digest is not None:
            _digests.move_to_end(key)
            return digest
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            while chunk := file.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    with _lock:
        _digests[key] = digest.hexdigest()
        while len(_digests) > MAX_REMEMBERED:
            _digests.popitem(last=False)
    return digest.hexdigest()


def spec_file_digests(spec: RequestSpec) -> dict[str, Any]:
    """Per field of ``spec`` that names a file or folder, the digests of what it names:
    ``{"interventions[0].vector": digest, "capture.sae": [cfg digest, weights digest], ...}``."""
    digests: dict[str, Any] = {}
    for index, item in enumerate(spec.interventions):
        if isinstance(item.vector, str):
            digests[f"interventions[{index}].vector"] = file_digest(split_vector_ref(item.vector)[0])
        if item.sae is not None:
            folder = Path(item.sae).expanduser()
            digests[f"interventions[{index}].sae"] = [file_digest(folder / CONFIG), file_digest(folder / WEIGHTS)]
    if spec.capture is not None and spec.capture.sae is not None:
        folder = Path(spec.capture.sae).expanduser()
        digests["capture.sae"] = [file_digest(folder / CONFIG), file_digest(folder / WEIGHTS)]
    return digests
