"""Train a linear probe on activations logged during an eval, against the eval's own scores, and
measure it with stratified k-fold cross-validation beside a baseline and two controls.

    python evals/train_probe.py LOG.eval --hook blocks.12.hook_resid_post --out probe.safetensors

Features: each sample's stored activations at ``--hook`` (mean over rows); labels: the first
score of the sample (1 = correct).  The folds keep the epochs of a sample and samples with
identical inputs on one side (grouped by input text), so no probe is scored on a record it was
trained on.  Printed, each as accuracy over all out-of-fold predictions with a 95% Wilson interval,
on the same folds:

- probe: L2 strength chosen inside each training fold by an inner cross-validation (or ``--l2``);
- majority baseline: each held-out fold predicted with its training fold's majority class;
- shuffled-label control: the same procedure against the labels permuted once (about chance);
- metadata control: the same procedure on a one-hot of the sample metadata ``--control-metadata``
  alone.  A probe that does no better than this may only be reading the kind of question.

The saved probe is trained on every sample, with the L2 the inner cross-validation chooses on all
of them.  Use it in a later eval with
``inspect_tl_vllm.research.probes.probe_scorer("probe.safetensors")`` next to a capture of that hook.
"""

from __future__ import annotations

import argparse

import torch
from inspect_ai.log import read_eval_log

from inspect_tl_vllm import activations
from inspect_tl_vllm.research.probes import (
    L2_GRID,
    OutOfFold,
    choose_l2,
    cross_validate,
    majority_baseline,
    one_hot,
    sample_groups,
    sample_metadata,
    save_probe,
    shuffled,
    stratified_folds,
    train_probe,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--hook", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--folds", type=int, default=5, help="outer (and inner) cross-validation folds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the folds and of the label permutation")
    parser.add_argument(
        "--l2", type=float, default=None, help="L2 on the standardised weights; default: chosen per fold by inner CV"
    )
    parser.add_argument("--control-metadata", default="category", help="sample metadata field of the control probe")
    args = parser.parse_args()
    if args.l2 is not None and not 0 <= args.l2 <= 1e6:
        parser.error(f"--l2 {args.l2}: give a value within 0 and 1e6")

    eval_log = read_eval_log(args.log)
    records = [r for r in activations.load(eval_log) if args.hook in r.activations and r.scores]
    features = torch.stack([r.activations[args.hook].float().mean(0) for r in records])
    labels = torch.tensor([float(next(iter(r.scores.values())) in (1, 1.0, "C")) for r in records])
    groups = sample_groups(eval_log, records)
    folds = stratified_folds(labels, args.folds, args.seed, groups)

    def cv(x: torch.Tensor, y: torch.Tensor, splits: list[torch.Tensor]) -> OutOfFold:
        return cross_validate(x, y, splits, l2=args.l2, seed=args.seed, groups=groups)

    search = f"--l2 {args.l2:g}" if args.l2 is not None else f"L2 chosen by inner {args.folds}-fold CV over {L2_GRID}"
    print(f"probe: {len(records)} samples, {int(labels.sum())} correct, hook {args.hook}")
    print(
        f"probe: {args.folds}-fold stratified cross-validation over {len(set(groups))} distinct inputs, "
        f"seed {args.seed}; {search}"
    )
    rows = {"probe (activations)": cv(features, labels, folds), "majority baseline": majority_baseline(labels, folds)}
    permuted = shuffled(labels, args.seed)
    rows["control: shuffled labels"] = cv(features, permuted, stratified_folds(permuted, args.folds, args.seed, groups))
    values = sample_metadata(eval_log, records, args.control_metadata)
    if all(v is None for v in values):
        print(f"probe: no sample has metadata {args.control_metadata!r}; the metadata control is left out")
    else:
        meta, names = one_hot(values)
        rows[f"control: metadata {args.control_metadata!r} only"] = cv(meta, labels, folds)
        print(f"probe: metadata {args.control_metadata!r} values: {', '.join(names)}")

    width = max(map(len, rows))
    print(f"\n{'':<{width}}  accuracy [95% Wilson interval]  correct")
    for name, result in rows.items():
        print(f"{name:<{width}}  {str(result.accuracy()):<30}  {result.correct}/{len(result.labels)}")
    print()
    for name, result in rows.items():
        if result.l2:
            print(f"L2 per fold, {name}: {', '.join(f'{v:g}' for v in result.l2)}")

    l2 = args.l2 if args.l2 is not None else choose_l2(features, labels, L2_GRID, args.folds, args.seed, groups)
    weight, bias = train_probe(features, labels, l2=l2)
    save_probe(args.out, weight, bias, args.hook)
    print(f"\nprobe: trained on all {len(records)} samples with L2 {l2:g}, saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
