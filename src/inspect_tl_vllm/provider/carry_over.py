"""Keep an eval's activations folder complete when samples were answered without generating.

``inspect eval-retry`` (and eval sets) write a *new* log, named by a new timestamp and with a new
eval id, and copy into it the samples that completed in the first log without running them
again; with ``--cache``, Inspect answers a model call with an output stored by an earlier eval
without calling the provider.  Either way the activations stay in the earlier log's
``.activations`` folder, so the new log's folder would lack them.  At task end this hook finds,
for each sample of the finished log without a file of its own, the file its outputs recorded
(``ModelOutput.metadata["tlvllm"]["activations"]``: folder, file, sha256) and adds it to this
eval's folder under this sample (a hard link on disk, a server-side copy in an object store), with
an index entry of its own: ``activations.load(<new log>)`` then returns every sample once, and no
sample is generated or stored twice.

A log is data that can be edited, so what it names is trusted only within bounds: a recorded folder
must resolve below the folder holding the log or below the ``-M activations_dir`` root, and file
names from its index must stay inside their folders (``Folder.file``). Anything else is
skipped with a warning; carrying over never fails the eval.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from inspect_ai.hooks import Hooks, TaskEnd, hooks
from inspect_ai.log import EvalLog, EvalSample

from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.store.folders import Folder, is_url, local_path
from inspect_tl_vllm.store.layout import (
    StoredFileError,
    activations_dir_for,
    link_sample,
    link_shard,
    log_parent,
    read_index,
    recorded_dir,
)
from inspect_tl_vllm.store.shards import close_writer, is_shard_entry, upload_spooled

logger = logging.getLogger(__name__)
PROVIDER = "tl-vllm/"


@hooks(
    name="tl_vllm_activations_carry_over",
    description="Links activations of samples answered by eval-retry or the cache from an earlier log's folder",
)
class CarryOverActivations(Hooks):
    async def on_task_end(self, data: TaskEnd) -> None:
        # In the event loop's thread: a log in an object store loads its samples lazily, through
        # Inspect's client of this loop.
        finish(data.log)


def finish(log: EvalLog) -> None:
    """At the end of an eval: upload its spooled shards, then carry activations over."""
    if not log.location or not log.eval.model.startswith(PROVIDER):
        return
    directory = activations_dir_for(log.location, log.eval.eval_id, log.eval.model_args.get("activations_dir"))
    try:
        close_writer(directory)
    except OSError as err:
        logger.warning(f"tl-vllm: {err}")
    carry_over(log)


def carry_over(log: EvalLog) -> int:
    """Link the activations of ``log``'s samples stored under other evals into its own folder;
    returns how many were linked.  A sample's output names the file that holds its activations
    (folder, file name and checksum); the index line of that file in the folder named is linked,
    under this sample.  A sample whose file cannot be found, or whose recorded folder or file name
    is refused, is left out with a warning (its entry would be missing anyway); the eval itself
    never fails here."""
    if not log.location or not log.eval.model.startswith(PROVIDER):
        return 0
    override = log.eval.model_args.get("activations_dir")
    directory = activations_dir_for(log.location, log.eval.eval_id, override)
    roots = _allowed_roots(log.location, override)
    own = {(repr(e["sample_id"]), int(e["epoch"])): e.get("sample_uuid") for e in read_index(directory)}
    candidates: dict[Folder, list[Folder]] = {}
    indexes: dict[Folder, dict[tuple[Any, Any], dict[str, Any]]] = {}
    refused: set[Folder] = set()
    missing: list[str] = []
    sharded: dict[tuple[Folder, str], list[tuple[dict[str, Any], tuple[Any, int, str]]]] = {}
    linked = 0
    for sample in _samples(log):
        key = (repr(sample.id), int(sample.epoch))
        if key in own and own[key] in (None, sample.uuid):  # None: recorded where Inspect gave no uuid
            continue
        found = _find_stored(sample, log.location, directory, roots, candidates, indexes, refused)
        if found is None:
            missing += [f"sample {sample.id!r} epoch {sample.epoch}"] if _recorded_files(sample, log.location) else []
            continue
        source, entry = found
        owner = (sample.id, sample.epoch, sample.uuid)
        if is_shard_entry(entry):  # linked shard by shard, below
            sharded.setdefault((source, entry["file"]), []).append((entry, owner))
            own[key] = sample.uuid
            continue
        try:
            link_sample(directory, eval_id=log.eval.eval_id, source=source, entry=entry, sample=owner)
        except (OSError, StoredFileError) as err:
            logger.warning(f"tl-vllm: sample {sample.id!r} epoch {sample.epoch}: {err}")
            continue
        own[key] = sample.uuid
        linked += 1
    for (source, _), samples in sharded.items():
        try:
            linked += len(link_shard(directory, eval_id=log.eval.eval_id, source=source, samples=samples))
        except (OSError, StoredFileError) as err:
            first = samples[0][1]
            logger.warning(f"tl-vllm: {len(samples)} samples from sample {first[0]!r} epoch {first[1]} on: {err}")
    if missing:
        logger.warning(
            f"tl-vllm: {len(missing)} samples answered from an earlier eval (eval-retry or the cache) name "
            f"activations that were not found where this log allows ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); they are left out of {directory}. Keep the logs of runs "
            "that reuse each other in one log dir, or use one -M activations_dir"
        )
    return linked


def _find_stored(
    sample: EvalSample,
    log_location: str,
    directory: Folder,
    roots: list[str],
    candidates: dict[Folder, list[Folder]],
    indexes: dict[Folder, dict[tuple[Any, Any], dict[str, Any]]],
    refused: set[Folder],
) -> tuple[Folder, dict[str, Any]] | None:
    """The folder and index entry of the file the sample's outputs name, in an allowed folder.
    ``candidates`` and ``indexes`` keep, across the samples of one carry-over, each recorded
    folder's candidates (found, and their spools uploaded, once) and each source's index."""
    for folder, stored in _recorded_files(sample, log_location):
        if folder not in candidates:
            candidates[folder] = _candidates(folder, directory)
        for source in candidates[folder]:
            if not any(source.is_below(root) for root in roots):
                _warn_refused(sample, source, roots, refused)
                continue
            if source not in indexes:
                indexes[source] = {(e.get("file"), e.get("sha256")): e for e in read_index(source)}
            entry = indexes[source].get(stored)
            if entry is not None:
                return source, entry
    return None


def _allowed_roots(location: str, override: str | None) -> list[str]:
    """Where a folder named by the log may lie: beside the log (the default place, and where logs
    moved together keep their folders) or under the ``-M activations_dir`` root the eval ran with."""
    roots = [log_parent(location)]
    if override:
        roots.append(override if is_url(override) else local_path(override))
    return roots


def _warn_refused(sample: EvalSample, folder: Folder, roots: list[str], refused: set[Folder]) -> None:
    """Warn once per refused folder (many samples record the same one), naming the first sample."""
    if folder in refused:
        return
    refused.add(folder)
    allowed = " or ".join(roots)
    logger.warning(
        f"tl-vllm: sample {sample.id!r} epoch {sample.epoch}: not carrying activations over from {folder}: "
        f"a folder recorded in the log must resolve below {allowed} (other samples naming it are skipped too); "
        "to carry them over, keep the earlier log's .activations folder beside the retried log or under that root"
    )


def _samples(log: EvalLog) -> Iterable[EvalSample]:
    """The log's samples; eval sets hand hooks a header-only log, so stream them from disk."""
    if log.samples is not None:
        return log.samples
    from inspect_ai.log import read_eval_log_samples

    assert log.location is not None
    return read_eval_log_samples(log.location, all_samples_required=False)


def _candidates(folder: Folder, directory: Folder) -> list[Folder]:
    """The recorded folder, then a folder of that name beside this one: logs moved together (or a
    relative log dir retried from elsewhere) keep their activations. A name that is empty or ``..``
    names no folder beside this one, so it gives no second candidate."""
    beside = [] if folder.name in ("", ".", "..") else [directory.sibling(folder.name)]
    found: list[Folder] = []
    for candidate in (folder, *beside):
        upload_spooled(candidate)  # shards the run that wrote them (killed) left on this machine
        if candidate.exists() and candidate not in (directory, *found):  # exists first: a symlink loop is no folder
            found.append(candidate)
    return found


def _recorded_files(sample: EvalSample, log_location: str) -> list[tuple[Folder, tuple[str, str]]]:
    """(folder, (file, sha256)) of each activations file named by the sample's final output, then
    by each of its model calls (a cached call's output names the file of the eval that made it)."""
    outputs = [sample.output, *(getattr(e, "output", None) for e in sample.events if e.event == "model")]
    seen: set[tuple[str, str, str]] = set()
    files = []
    for output in outputs:
        record = ((output.metadata or {}) if output is not None else {}).get(TAG) or {}
        stored = record.get("activations") or {}
        folder, file, digest = stored.get("dir"), stored.get("file"), stored.get("sha256")
        if not all(isinstance(part, str) and part for part in (folder, file, digest)):
            continue  # a log can hold anything here
        if (folder, file, digest) not in seen:
            seen.add((folder, file, digest))
            files.append((recorded_dir(folder, log_location), (file, digest)))
    return files
