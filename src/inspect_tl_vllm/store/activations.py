"""Read activations stored by the ``tl-vllm`` provider back, joined with the eval log.

from inspect_tl_vllm import activations
for record in activations.load("logs/2026-...eval"):
    record.sample_id, record.epoch, record.scores, record.activations["blocks.6.hook_resid_post"]
one = activations.read("logs/2026-...eval", sample_id=17, epoch=1)  # one sample, no index read

A record whose file is missing, fails its checksum, does not parse or is named so that it would lead
outside the folder is skipped with a ``SkippedRecordWarning`` (``strict=True`` raises instead).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.extras import require
from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.store.sample_store import (
    STORED_KEYS,
    SampleReader,
    StoredFileError,
    activations_dir_for,
    read_index,
    read_sample,
    recorded_dir,
    unpack_positions,
)
from inspect_tl_vllm.store.shards import upload_spooled


class SkippedRecordWarning(UserWarning):
    """A (sample, epoch) whose stored file could not be used was left out of ``load``'s result."""


@dataclass
class SampleActivations:
    """One model call's captures of one sample and epoch, with the sample's scores.

    ``call`` numbers the sample's model calls that captured, in order (0 first: one record per call
    of an agent loop or a dialogue); ``input_messages`` is how many messages that call's input
    held, which finds its model event in the log."""

    sample_id: Any
    epoch: int
    sample_uuid: str
    scores: dict[str, Any]
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)

    @property
    def call(self) -> int:
        return int(self.index.get("call", 0))

    @property
    def input_messages(self) -> int | None:
        return self.index.get("input_messages")

    @property
    def positions(self) -> dict[str, list[int]]:
        """Sequence position of each stored row, per hook point (per-token captures only)."""
        hooks = self.index.get("hooks", {})
        return {hook: unpack_positions(info["positions"]) for hook, info in hooks.items() if "positions" in info}


def load(
    log: str | Path | Any, activations_dir: str | None = None, verify: bool = True, strict: bool = False
) -> list[SampleActivations]:
    """Per-sample activations of an eval log (path or EvalLog), with its scores, in log order.

    ``activations_dir`` is the ``-M activations_dir`` the eval ran with, if any. One bad file (missing,
    changed, unparsable, or named outside the folder) should not hide every other sample, so by default
    its record is left out with a ``SkippedRecordWarning`` naming the file, the sample and the cause;
    ``strict=True`` raises that ``StoredFileError`` instead, for pipelines that must see every record.
    Every record is in memory at once; ``iter_load`` and ``arrow_reader`` hold one at a time.
    """
    return list(iter_load(log, activations_dir, verify=verify, strict=strict))


def iter_load(
    log: str | Path | Any, activations_dir: str | None = None, verify: bool = True, strict: bool = False
) -> Iterator[SampleActivations]:
    """``load``'s records one at a time, each file read when its record is reached, so that a run
    of any size can be gone through in the memory of one sample."""
    eval_log = _eval_log(log)
    directory = activations_dir_for(eval_log.location, eval_log.eval.eval_id, activations_dir)
    upload_spooled(directory)  # shards a killed run left on this machine
    calls: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for e in read_index(directory):
        calls.setdefault((repr(e["sample_id"]), int(e["epoch"])), {})[int(e.get("call", 0))] = e
    with SampleReader(directory, whole_shards=True) as reader:
        for sample in eval_log.samples or []:
            for _, entry in sorted(calls.get((repr(sample.id), int(sample.epoch)), {}).items()):
                record = _record(directory, entry, sample, reader, verify, strict)
                if record is not None:
                    yield record


def _record(
    directory: Any, entry: dict[str, Any], sample: Any, reader: SampleReader, verify: bool, strict: bool
) -> SampleActivations | None:
    """One index entry's record, joined to its log sample; None when it belongs to an earlier attempt
    of the sample or its file is unusable (a warning, or with ``strict`` the error)."""
    if entry.get("sample_uuid") not in (None, sample.uuid):
        return None  # left by an earlier attempt of this (sample, epoch) that failed
    try:  # errors name the index line: the folder's index, or the sample's shard index
        tensors = read_sample(directory, entry, verify=verify, reader=reader)
    except StoredFileError as err:
        if strict:
            raise
        warnings.warn(f"skipping a record: {err}", SkippedRecordWarning, stacklevel=4)
        return None
    return SampleActivations(
        sample_id=sample.id,
        epoch=sample.epoch,
        sample_uuid=entry["sample_uuid"],
        scores=_scores(sample),
        activations=tensors,
        index=entry,
    )


def read(log: str | Path, sample_id: Any, epoch: int = 1, *, verify: bool = True) -> SampleActivations:
    """One sample's activations, found through the log alone: Inspect reads that one sample of the
    log, and its output names the file, its checksum and each hook's shape, dtype and positions
    (the sample's last model call; ``load`` gives every call).
    No index is read, so this costs the same in a log of ten samples or a million.

    Raises ``StoredFileError`` naming the sample when it stored no activations, or when its file is
    missing, changed, unreadable or named outside its folder; Inspect's own error when the log has
    no such sample."""
    from inspect_ai.log import read_eval_log_sample

    sample = read_eval_log_sample(str(log), sample_id, epoch)
    where = f"{log}: sample {sample_id!r} epoch {epoch}"
    output = sample.output.metadata if sample.output is not None else None
    stored = ((output or {}).get(TAG) or {}).get("activations") or {}
    if not all(isinstance(stored.get(key), str) for key in ("dir", "file", "sha256")):
        raise StoredFileError(f"{where}: its output names no stored activations (it captured nothing)")
    entry = {
        "sample_id": sample.id,
        "epoch": sample.epoch,
        "sample_uuid": sample.uuid,
        **{key: stored[key] for key in STORED_KEYS if key in stored},
        "hooks": stored.get("hooks") or {},
    }
    tensors = read_sample(recorded_dir(stored["dir"], str(log)), entry, verify=verify, where=f"{where} output metadata")
    return SampleActivations(sample.id, sample.epoch, sample.uuid or "", _scores(sample), tensors, entry)


def arrow_reader(
    log: str | Path | Any,
    activations_dir: str | None = None,
    *,
    batch_rows: int = 65_536,
    verify: bool = True,
    strict: bool = False,
) -> Any:
    """The rows ``export_parquet`` writes, as a ``pyarrow.RecordBatchReader`` of batches of about
    ``batch_rows`` rows, read one sample at a time: a probe or SAE trainer, ``datasets``, DuckDB
    (``duckdb.from_arrow(reader)``) or ``pyarrow.parquet`` go through any number of samples in
    bounded memory.  Needs the ``[parquet]`` extra (pyarrow)."""
    require("pyarrow", "the Arrow reader")
    if not 1 <= batch_rows <= 1 << 24:
        raise ValueError(f"arrow_reader: batch_rows must be within 1 and 2**24, got {batch_rows}")
    eval_log = _eval_log(log)
    samples = eval_log.samples or []
    id_type = _arrow_column([sample.id for sample in samples]).type
    score_types = _score_types(_scores(sample) for sample in samples)
    records = iter_load(eval_log, activations_dir, verify=verify, strict=strict)
    return _reader(records, id_type, score_types, batch_rows)


def _eval_log(log: str | Path | Any) -> Any:
    from inspect_ai.log import read_eval_log

    return read_eval_log(str(log)) if isinstance(log, str | Path) else log


def _scores(sample: Any) -> dict[str, Any]:
    return {name: score.value for name, score in (sample.scores or {}).items()}


def export_npz(records: list[SampleActivations], path: str | Path) -> int:
    """Write every record's arrays to one ``.npz`` (keys ``<sample id>/<epoch>/<hook>``, and
    ``<sample id>/<epoch>/call<n>/<hook>`` for a sample's later model calls) plus a ``__scores__``
    JSON string; returns the number of arrays."""
    import json

    import numpy as np

    arrays = {
        f"{r.sample_id}/{r.epoch}/{f'call{r.call}/' if r.call else ''}{hook}": t.float().numpy()
        for r in records
        for hook, t in r.activations.items()
    }
    scores = [{"sample_id": r.sample_id, "epoch": r.epoch, "scores": r.scores} for r in records]
    np.savez(path, __scores__=np.array(json.dumps(scores, default=str)), **arrays)
    return len(arrays)


def export_parquet(records: list[SampleActivations], path: str | Path) -> int:
    """Write one row per (sample, epoch, hook, position) to Parquet, so the activations can be queried
    with pandas/polars/DuckDB next to their scores; returns the number of rows.

    Columns: ``sample_id``, ``epoch``, ``call`` (the sample's model call, 0 first), ``hook``,
    ``position`` (the token's position in the sequence; for files written before positions were
    stored, the row's index within the capture; null for captures reduced per sample), one
    ``score_<name>`` column per scorer, and ``vector`` (fixed-size list of float32).  Written in row
    groups, batch by batch (``arrow_reader`` streams the same rows)."""
    require("pyarrow", "the Parquet export")
    pq = require("pyarrow.parquet", "the Parquet export")

    id_type = _arrow_column([r.sample_id for r in records]).type
    reader = _reader(iter(records), id_type, _score_types(r.scores for r in records), 65_536)
    rows = 0
    with pq.ParquetWriter(str(path), reader.schema) as writer:
        for batch in reader:
            writer.write_batch(batch)
            rows += batch.num_rows
    return rows


def _reader(records: Iterator[SampleActivations], id_type: Any, score_types: dict[str, Any], batch_rows: int) -> Any:
    """A RecordBatchReader over ``records``: the sample ids' and scores' Arrow types are given (one
    schema for every batch), the vector width is the first record's."""
    pa = require("pyarrow", "the Arrow reader")

    blocks = _parquet_blocks(records)
    first = next(blocks, None)
    if first is None:
        raise ValueError("export: a Parquet file holds vectors of one width; found no activations")
    width = first[2].shape[1]
    scorers = sorted(score_types)
    schema = pa.schema(
        [
            ("sample_id", id_type),
            ("epoch", pa.int32()),
            ("call", pa.int32()),
            ("hook", pa.string()),
            ("position", pa.int64()),
            *((f"score_{name}", score_types[name]) for name in scorers),
            ("vector", pa.list_(pa.float32(), width)),
        ]
    )

    def batches() -> Iterator[Any]:
        pending, count = [first], len(first[2])
        for block in blocks:
            if block[2].shape[1] != width:
                raise ValueError(
                    f"export: a Parquet file holds vectors of one width; found {width} and {block[2].shape[1]}"
                )
            if count >= batch_rows:
                yield _batch(pending, schema, scorers)
                pending, count = [], 0
            pending.append(block)
            count += len(block[2])
        yield _batch(pending, schema, scorers)

    return pa.RecordBatchReader.from_batches(schema, batches())


def _batch(
    blocks: list[tuple[SampleActivations, str, np.ndarray, list[int | None]]], schema: Any, scorers: list[str]
) -> Any:
    """One RecordBatch of ``blocks``' rows."""
    pa = require("pyarrow", "the Arrow reader")

    expand = [i for i, (_, _, rows, _) in enumerate(blocks) for _ in range(len(rows))]
    columns = [
        _arrow_column([blocks[i][0].sample_id for i in expand], schema.field("sample_id").type),
        pa.array([blocks[i][0].epoch for i in expand], pa.int32()),
        pa.array([blocks[i][0].call for i in expand], pa.int32()),
        pa.array([blocks[i][1] for i in expand], pa.string()),
        pa.array([p for *_, positions in blocks for p in positions], pa.int64()),
        *(
            _arrow_column([blocks[i][0].scores.get(name) for i in expand], schema.field(f"score_{name}").type)
            for name in scorers
        ),
    ]
    flat = np.concatenate([rows.reshape(-1) for _, _, rows, _ in blocks])
    width = schema.field("vector").type.list_size
    columns.append(pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), width))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _score_types(score_dicts: Any) -> dict[str, Any]:
    """The Arrow type of each scorer's column, from every value it has in the log (so that every
    batch has the same schema); mixed kinds (say 'C' and 0.5) are JSON text."""
    values: dict[str, list[Any]] = {}
    for scores in score_dicts:
        for name, value in scores.items():
            values.setdefault(name, []).append(value)
    return {name: _arrow_column(found).type for name, found in values.items()}


def _parquet_blocks(
    records: list[SampleActivations],
) -> Iterator[tuple[SampleActivations, str, np.ndarray, list[int | None]]]:
    """(record, hook, float32 rows, positions) per stored tensor; a reduced capture is one row, position None."""
    for record in records:
        reduced = record.index.get("reduce") not in (None, "none")
        stored = record.positions
        for hook, tensor in record.activations.items():
            # one row per position: a per-head capture's [pos, head, d_head] row is heads x d_head long
            flat = tensor.reshape(tensor.shape[0], -1) if tensor.ndim > 2 else tensor.reshape(-1, tensor.shape[-1])
            rows = flat.float().numpy()
            if reduced:
                yield record, hook, rows, [None] * len(rows)
            else:
                yield record, hook, rows, stored.get(hook) or list(range(len(rows)))


def _arrow_column(values: list[Any], kind: Any = None) -> Any:
    """Values of one kind keep their Arrow type; mixed kinds (say 'C' and 0.5) become JSON text."""
    import json

    pa = require("pyarrow", "the Parquet export")
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([v if v is None or isinstance(v, str) else json.dumps(v, default=str) for v in values])


def describe_run(log_file: str) -> list[str]:
    """What the eval ran with, from the run record in its log's metadata (``provider/run_record.py``):
    one line per run-wide intervention with its vector's hash and norm, and the capture."""
    from inspect_ai.log import read_eval_log

    record = (read_eval_log(log_file, header_only=True).metadata or {}).get(TAG)
    if not isinstance(record, dict):
        return ["run: no tl-vllm run record in the log (an eval not run through tl-vllm, or an older log)"]
    lines = [f"run: model {record.get('model_path')}, fingerprint {record.get('fingerprint')}"]
    for item in record.get("steering") or []:
        op, coef = item.get("op", "add"), item.get("coef", 1.0)
        where = f"{item.get('hook')} {op} coef {coef:g} positions {item.get('positions')}"
        if "vector" in item:
            where += f" vector {item['vector']} ({item.get('vector_hash')}, norm {item.get('vector_norm', 0):.4g})"
        lines.append(f"run: steering {where}")
    if record.get("capture"):
        lines.append(f"run: capture {json.dumps(record['capture'], sort_keys=True)}")
    if record.get("adapter"):
        lines.append(f"run: LoRA adapter {record['adapter'].get('path')} (sha256 {record['adapter'].get('sha256')})")
    return lines


def main(argv: list[str] | None = None) -> int:
    """List (or export) the activations an eval log's samples captured."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="tl-vllm activations", description=main.__doc__)
    parser.add_argument("log")
    parser.add_argument("--activations-dir", default=None)
    parser.add_argument("--export", default=None, help="write all arrays and scores to this .npz or .parquet file")
    parser.add_argument("--strict", action="store_true", help="fail on the first unusable file instead of skipping it")
    args = parser.parse_args(argv)
    exporters = {".npz": (export_npz, "arrays"), ".parquet": (export_parquet, "rows")}
    suffix = Path(args.export).suffix.lower() if args.export else None
    if suffix is not None and suffix not in exporters:
        parser.error(f"--export {args.export}: name a .npz or .parquet file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SkippedRecordWarning)  # one line per record, even a repeated message
        try:
            records = load(args.log, args.activations_dir, strict=args.strict)
        except StoredFileError as err:
            parser.exit(1, f"error: {err}\n")
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    for line in describe_run(args.log):
        print(line)
    for record in records:
        shapes = ", ".join(f"{hook} {tuple(t.shape)}" for hook, t in record.activations.items())
        print(f"sample {record.sample_id!r} epoch {record.epoch} scores {record.scores}: {shapes}")
    skipped = sum(issubclass(w.category, SkippedRecordWarning) for w in caught)
    print(f"{len(records)} samples with activations, {skipped} skipped (unusable file; --strict fails instead)")
    if suffix is not None:
        export, unit = exporters[suffix]
        print(f"exported {export(records, args.export)} {unit} to {args.export}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
