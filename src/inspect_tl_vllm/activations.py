"""Read activations stored by the ``tl-vllm`` provider back, joined with the eval log.

from inspect_tl_vllm import activations
for record in activations.load("logs/2026-...eval"):
    record.sample_id, record.epoch, record.scores, record.activations["blocks.6.hook_resid_post"]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.storage import activations_dir_for, read_index, read_sample


@dataclass
class SampleActivations:
    sample_id: Any
    epoch: int
    sample_uuid: str
    scores: dict[str, Any]
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    index: dict[str, Any] = field(default_factory=dict)


def load(log: str | Path | Any, activations_dir: str | None = None, verify: bool = True) -> list[SampleActivations]:
    """Per-sample activations of an eval log (path or EvalLog), with its scores, in log order.

    ``activations_dir`` is the ``-M activations_dir`` the eval ran with, if any.
    """
    from inspect_ai.log import read_eval_log

    eval_log = read_eval_log(str(log)) if isinstance(log, str | Path) else log
    directory = activations_dir_for(eval_log.location, eval_log.eval.eval_id, activations_dir)
    entries = {(repr(e["sample_id"]), int(e["epoch"])): e for e in read_index(directory)}
    records = []
    for sample in eval_log.samples or []:
        entry = entries.get((repr(sample.id), int(sample.epoch)))
        if entry is None:
            continue
        scores = {name: score.value for name, score in (sample.scores or {}).items()}
        records.append(
            SampleActivations(
                sample_id=sample.id,
                epoch=sample.epoch,
                sample_uuid=entry["sample_uuid"],
                scores=scores,
                activations=read_sample(directory, entry, verify=verify),
                index=entry,
            )
        )
    return records


def export_npz(records: list[SampleActivations], path: str | Path) -> int:
    """Write every record's arrays to one ``.npz`` (keys ``<sample id>/<epoch>/<hook>``) plus a
    ``__scores__`` JSON string; returns the number of arrays."""
    import json

    import numpy as np

    arrays = {
        f"{r.sample_id}/{r.epoch}/{hook}": t.float().numpy() for r in records for hook, t in r.activations.items()
    }
    scores = [{"sample_id": r.sample_id, "epoch": r.epoch, "scores": r.scores} for r in records]
    np.savez(path, __scores__=np.array(json.dumps(scores, default=str)), **arrays)
    return len(arrays)


def main(argv: list[str] | None = None) -> int:
    """List (or export) the activations an eval log's samples captured."""
    import argparse

    parser = argparse.ArgumentParser(prog="tl-vllm activations", description=main.__doc__)
    parser.add_argument("log")
    parser.add_argument("--activations-dir", default=None)
    parser.add_argument("--export", default=None, help="write all arrays and scores to this .npz file")
    args = parser.parse_args(argv)
    records = load(args.log, args.activations_dir)
    for record in records:
        shapes = ", ".join(f"{hook} {tuple(t.shape)}" for hook, t in record.activations.items())
        print(f"sample {record.sample_id!r} epoch {record.epoch} scores {record.scores}: {shapes}")
    print(f"{len(records)} samples with activations")
    if args.export:
        count = export_npz(records, args.export)
        print(f"exported {count} arrays to {args.export}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
