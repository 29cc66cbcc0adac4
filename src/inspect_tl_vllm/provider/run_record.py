"""What an eval ran with, kept in its log: the resolved run-wide steering and capture.

``-M steer=FILE`` names a spec file, and the file names vector files: a log that kept only those
paths could not say which steering produced its scores once a file changed.  So at an eval's first
model call, ``run_record`` resolves the model's run-wide spec as it reads it then (per intervention the
hook point, op, coefficient, positions and heads, and the vector's content hash and norm; the
capture; every file's and SAE folder's sha256; the adapter; the engine settings), and at the end of
the task a hook adds that record to the eval log's metadata under ``tlvllm`` (an Inspect log edit,
author ``tl-vllm``; a local ``.eval`` log has only its header rewritten).  Each call's own resolved
spec is in its output's metadata (``metadata["tlvllm"]["applied"]``, hashed as ``spec_sha256``).

Inspect imports this module with the provider, never at start-up: torch loads only inside.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any

from inspect_ai.hooks import Hooks, TaskEnd, hooks
from inspect_ai.log import EvalLog

from inspect_tl_vllm._registry import MODEL_PREFIX, PROVIDER_NAME
from inspect_tl_vllm.provider.model_args import ProviderSettings
from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.store.folders import is_url

logger = logging.getLogger(__name__)
AUTHOR = PROVIDER_NAME
_records: dict[str, dict[str, Any]] = {}
_lock = threading.Lock()


def spec_sha256(applied: dict[str, Any]) -> str:
    """The sha256 of a call's resolved spec (``PreparedRequest.applied``), in canonical JSON."""
    return hashlib.sha256(json.dumps(applied, sort_keys=True, default=str).encode()).hexdigest()


def run_record(settings: ProviderSettings, model_path: str) -> dict[str, Any]:
    """The resolved run-wide spec, engine settings and adapter of one ``tl-vllm`` model."""
    from inspect_tl_vllm.vectors.digests import spec_file_digests

    spec = settings.run_spec
    return {
        "model_path": model_path,
        "fingerprint": settings.fingerprint(model_path),
        "engine_args": settings.engine,
        "instrument": settings.instrument.model_dump(),
        "adapter": settings.adapter.record() if settings.adapter is not None else None,
        "steering": [_intervention(item) for item in spec.interventions],
        "capture": spec.capture.model_dump(exclude_none=True) if spec.capture is not None else None,
        "files": spec_file_digests(spec),
    }


def _intervention(item: Any) -> dict[str, Any]:
    entry = item.model_dump(exclude_none=True, exclude={"vector"})
    if item.vector is None:
        return entry
    import torch

    from inspect_tl_vllm.vectors.files import read_vector_file, vector_hash

    given = isinstance(item.vector, str)
    vector = read_vector_file(item.vector) if given else torch.from_numpy(item.inline_vector)
    vector = vector.to(torch.float32).flatten().contiguous()
    entry.update(
        vector=item.vector if given else "inline",
        vector_hash=vector_hash(vector),
        vector_norm=float(vector.double().norm()),
    )
    return entry


def record_run_once(eval_id: str, settings: ProviderSettings, model_path: str) -> None:
    """Resolve the run record of eval ``eval_id`` at its first model call (files as they are then);
    Inspect may reuse one model instance across evals, whose files may differ."""
    with _lock:
        if eval_id in _records:
            return
        _records[eval_id] = run_record(settings, model_path)


def take_record(eval_id: str) -> dict[str, Any] | None:
    """The record of eval ``eval_id``, forgotten here: it is written to the log once, at task end."""
    with _lock:
        return _records.pop(eval_id, None)


@hooks(name="tl_vllm_run_record", description="Adds the resolved run-wide steering and capture to a tl-vllm eval log")
class RunRecord(Hooks):
    async def on_task_end(self, data: TaskEnd) -> None:
        add_run_record(data.log)


def add_run_record(log: EvalLog) -> bool:
    """Add this process's record of the eval's model to the log file's metadata; True if added.
    Never fails the eval: a log it cannot rewrite keeps its per-call records and gets a warning."""
    from inspect_ai.log import MetadataEdit, ProvenanceData, edit_eval_log, write_eval_log

    if not log.location or not log.eval.model.startswith(MODEL_PREFIX):
        return False
    record = take_record(log.eval.eval_id)
    if record is None:
        return False
    try:
        header_only = _can_write_header_only(log.location)
        written = _log_as_written(log, header_only)
        reason = "the resolved run-wide steering and capture (vector hashes and norms, file digests)"
        edited = edit_eval_log(
            written, [MetadataEdit(metadata_set={TAG: record})], ProvenanceData(author=AUTHOR, reason=reason)
        )
        write_eval_log(edited, log.location, header_only=header_only)
    except Exception as err:  # noqa: BLE001 (the eval has finished; its log stays as Inspect wrote it)
        logger.warning(f"tl-vllm: could not add the run record to {log.location}: {err}")
        return False
    return True


def _can_write_header_only(location: str) -> bool:
    """Whether only the header of the log need be rewritten: a local ``.eval`` log, whose header
    entry Inspect swaps in place, samples untouched.  Rewriting the whole log instead costs seconds
    per thousand samples at every eval's end.  A remote log is rewritten whole: older Inspect
    releases (0.3.221 among them) write a remote log's header alone, without its samples."""
    return location.endswith(".eval") and not is_url(location)


def _log_as_written(log: EvalLog, header_only: bool) -> EvalLog:
    from inspect_ai.log import read_eval_log

    if header_only:
        return read_eval_log(log.location, header_only=True)  # the header as written, without samples
    return log if log.samples is not None else read_eval_log(log.location)  # an eval set's header-only log
