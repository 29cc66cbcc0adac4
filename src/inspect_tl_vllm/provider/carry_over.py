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
must resolve below the folder holding the log or below the ``-M activations_dir`` root (checked
before anything contacts it: a log may name any host), and file names from its index must stay
inside their folders (``Folder.file``). Anything else is skipped with a warning; so is a folder
whose store fails or stops answering (``folders.REMOTE_TIMEOUT_S``). Carrying over never fails the
eval, and a sample it cannot carry over is named in a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from inspect_ai.hooks import Hooks, TaskEnd, hooks
from inspect_ai.log import EvalLog, EvalSample

from inspect_tl_vllm._registry import MODEL_PREFIX
from inspect_tl_vllm.specs import TAG, SpecError
from inspect_tl_vllm.store.folders import Folder, is_url, local_path
from inspect_tl_vllm.store.sample_store import (
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
T = TypeVar("T")


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
    if not log.location or not log.eval.model.startswith(MODEL_PREFIX):
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
    if not log.location or not log.eval.model.startswith(MODEL_PREFIX):
        return 0
    override = log.eval.model_args.get("activations_dir")
    directory = activations_dir_for(log.location, log.eval.eval_id, override)
    roots = _allowed_roots(log.location, override)
    try:
        own = {(repr(e["sample_id"]), int(e["epoch"])): e.get("sample_uuid") for e in read_index(directory)}
    except OSError as err:  # its store failed or does not answer: name every sample that may need its file
        reused = [s for s in _samples(log) if any(f != directory for f, _ in _recorded_files(s, log.location))]
        why = f"this eval's index could not be read ({err}); they stay in the earlier eval's folder, where "
        _warn_left_out([_named(s) for s in reused], directory, why + "activations.load(<earlier log>) reads them")
        return 0
    candidates: dict[Folder, tuple[list[Folder], list[Folder]]] = {}
    indexes: dict[Folder, dict[tuple[Any, Any], dict[str, Any]]] = {}
    refused: set[Folder] = set()
    missing: list[str] = []
    sharded: dict[tuple[Folder, str], list[tuple[dict[str, Any], tuple[Any, int, str]]]] = {}
    linked = 0
    for sample in _samples(log):
        key = (repr(sample.id), int(sample.epoch))
        if key in own and own[key] in (None, sample.uuid):  # None: recorded where Inspect gave no uuid
            continue
        recorded = _recorded_files(sample, log.location)
        found = _find_stored(sample, recorded, directory, roots, candidates, indexes, refused)
        if found is None:
            missing += [_named(sample)] if recorded else []
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
            logger.warning(f"tl-vllm: {_named(sample)}: {err}")
            continue
        own[key] = sample.uuid
        linked += 1
    for (source, _), samples in sharded.items():
        try:
            linked += len(link_shard(directory, eval_id=log.eval.eval_id, source=source, samples=samples))
        except (OSError, StoredFileError) as err:
            first = samples[0][1]
            logger.warning(f"tl-vllm: {len(samples)} samples from sample {first[0]!r} epoch {first[1]} on: {err}")
    why = "their activations were not found where this log allows. Keep the logs of runs that reuse each other "
    _warn_left_out(missing, directory, why + "in one log dir, or use one -M activations_dir")
    return linked


def _named(sample: EvalSample) -> str:
    return f"sample {sample.id!r} epoch {sample.epoch}"


def _warn_left_out(samples: list[str], directory: Folder, why: str) -> None:
    """One warning naming the samples (the first three) answered from an earlier eval whose
    activations are not carried into ``directory``, and why."""
    if samples:
        logger.warning(
            f"tl-vllm: {len(samples)} samples answered from an earlier eval (eval-retry or the cache) are left out "
            f"of {directory} ({', '.join(samples[:3])}{', ...' if len(samples) > 3 else ''}): {why}"
        )


def _find_stored(
    sample: EvalSample,
    recorded: list[tuple[Folder, tuple[str, str]]],
    directory: Folder,
    roots: list[str],
    candidates: dict[Folder, tuple[list[Folder], list[Folder]]],
    indexes: dict[Folder, dict[tuple[Any, Any], dict[str, Any]]],
    refused: set[Folder],
) -> tuple[Folder, dict[str, Any]] | None:
    """The folder and index entry of a file the sample's outputs name (``recorded``), in an allowed
    folder; when there is none, each folder refused for it is named in a warning. ``candidates``
    and ``indexes`` keep, across the samples of one carry-over, each recorded folder's candidates
    (checked and found, and their spools uploaded, once) and each source's index."""
    outside: list[Folder] = []
    for folder, stored in recorded:
        if folder not in candidates:
            candidates[folder] = _candidates(folder, directory, roots)
        found, not_allowed = candidates[folder]
        outside += not_allowed
        for source in found:
            if source not in indexes:
                indexes[source] = _or_warn(source, _index_by_file, {})
            entry = indexes[source].get(stored)
            if entry is not None:
                return source, entry
    for folder in outside:
        _warn_refused(sample, folder, roots, refused)
    return None


def _index_by_file(source: Folder) -> dict[tuple[Any, Any], dict[str, Any]]:
    return {(e.get("file"), e.get("sha256")): e for e in read_index(source)}


def _or_warn(folder: Folder, look: Callable[[Folder], T], fallback: T) -> T:
    """``look(folder)``, or ``fallback`` after a warning when ``folder``'s store fails or does not
    answer: its samples then count as not found, and are named in the warning of those left out."""
    try:
        return look(folder)
    except OSError as err:
        logger.warning(f"tl-vllm: cannot look for activations in {folder} ({err}); passing over it")
        return fallback


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
        f"tl-vllm: {_named(sample)}: not carrying activations over from {folder}: "
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


def _candidates(folder: Folder, directory: Folder, roots: list[str]) -> tuple[list[Folder], list[Folder]]:
    """The folders that may hold a recorded folder's files, and those refused: the recorded folder,
    then a folder of that name beside this one (logs moved together, or a relative log dir retried
    from elsewhere, keep their activations). Each is checked against ``roots`` before anything
    contacts it: a log may name any host, which must not be asked even whether the folder exists.
    A name that is empty or ``..`` names no folder beside this one, so it gives no second candidate."""
    beside = [] if folder.name in ("", ".", "..") else [directory.sibling(folder.name)]
    found: list[Folder] = []
    outside: list[Folder] = []
    for candidate in (folder, *beside):
        if not any(candidate.is_below(root) for root in roots):  # is_below first: a symlink loop is below nothing
            outside.append(candidate)
        elif candidate not in (directory, *found) and _or_warn(candidate, _holds_files, False):
            found.append(candidate)
    return found, outside


def _holds_files(candidate: Folder) -> bool:
    upload_spooled(candidate)  # shards the run that wrote them (killed) left on this machine
    return candidate.exists()


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
            try:
                files.append((recorded_dir(folder, log_location), (file, digest)))
            except SpecError as err:  # a store fsspec cannot open
                logger.warning(f"tl-vllm: {_named(sample)}: not carrying activations over from {folder!r}: {err}")
    return files
