"""Keep a retried eval's activations folder complete.

``inspect eval-retry`` (and eval sets) write a *new* log, named by a new timestamp and with a new
eval id, and copy into it the samples that completed in the first log without running them
again.  Their activations stay in the first log's ``.activations/`` folder, so the new log's
folder would hold only the samples that ran again.  At task end this hook finds, for each
sample of the finished log, the folder its outputs recorded (``ModelOutput.metadata["tlvllm"]``)
and, where that is another eval's folder, links the file into this eval's folder with an index
line of its own: ``activations.load(<retried log>)`` then returns every sample, and no sample is
generated or stored twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from inspect_ai.hooks import Hooks, TaskEnd, hooks
from inspect_ai.log import EvalLog, EvalSample

from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.storage import activations_dir_for, link_sample, read_index

logger = logging.getLogger(__name__)
PROVIDER = "tl-vllm/"


@hooks(
    name="tl_vllm_activations_carry_over",
    description="Links activations of samples that eval-retry reused from an earlier log into the new log's folder",
)
class CarryOverActivations(Hooks):
    async def on_task_end(self, data: TaskEnd) -> None:
        carry_over(data.log)


def carry_over(log: EvalLog) -> int:
    """Link the activations of ``log``'s samples stored under other evals into its own folder;
    returns how many were linked.  A sample whose file cannot be found is left out with a
    warning (its entry would be missing anyway); the eval itself never fails here."""
    if not log.location or not log.eval.model.startswith(PROVIDER):
        return 0
    directory = activations_dir_for(log.location, log.eval.eval_id, log.eval.model_args.get("activations_dir"))
    own = {(repr(e["sample_id"]), int(e["epoch"])): e.get("sample_uuid") for e in read_index(directory)}
    indexes: dict[Path, dict[str, dict[str, Any]]] = {}
    linked = 0
    for sample in _samples(log):
        key = (repr(sample.id), int(sample.epoch))
        if own.get(key) == sample.uuid:
            continue
        for source in _candidates(_recorded_dirs(sample), directory):
            if source not in indexes:
                indexes[source] = {e["sample_uuid"]: e for e in read_index(source)}
            entry = indexes[source].get(sample.uuid)
            if entry is None or (repr(entry["sample_id"]), int(entry["epoch"])) != key:
                continue
            try:
                link_sample(directory, eval_id=log.eval.eval_id, source=source, entry=entry)
            except OSError as err:
                logger.warning(f"tl-vllm: sample {sample.id!r} epoch {sample.epoch}: {err}")
                break
            own[key] = sample.uuid
            linked += 1
            break
    return linked


def _samples(log: EvalLog) -> Iterable[EvalSample]:
    """The log's samples; eval sets hand hooks a header-only log, so stream them from disk."""
    if log.samples is not None:
        return log.samples
    from inspect_ai.log import read_eval_log_samples

    assert log.location is not None
    return read_eval_log_samples(log.location, all_samples_required=False)


def _candidates(recorded: Iterable[Path], directory: Path) -> Iterator[Path]:
    """Each recorded folder, then a folder of that name beside this one: logs moved together
    (or a relative log dir retried from elsewhere) keep their activations."""
    seen = {directory.resolve()}
    for folder in recorded:
        for candidate in (folder, directory.parent / folder.name):
            if candidate.resolve() not in seen and candidate.is_dir():
                seen.add(candidate.resolve())
                yield candidate


def _recorded_dirs(sample: EvalSample) -> Iterator[Path]:
    """Activations folders named by the sample's final output, then by each model call."""
    outputs = [sample.output, *(getattr(e, "output", None) for e in sample.events if e.event == "model")]
    seen: set[str] = set()
    for output in outputs:
        record = ((output.metadata or {}) if output is not None else {}).get(TAG) or {}
        folder = (record.get("activations") or {}).get("dir")
        if folder and folder not in seen:
            seen.add(folder)
            yield Path(folder)
