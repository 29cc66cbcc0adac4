"""Train a linear probe on activations logged during an eval, against the eval's own scores, and
measure it with stratified k-fold cross-validation beside a baseline and controls.

    python evals/train_probe.py LOG.eval --hook blocks.12.hook_resid_post --out probe.safetensors

Features: each sample's stored activations at ``--hook`` (mean over rows); labels: the first
score of the sample (1 = correct).  The folds keep the epochs of a sample and samples with
identical inputs on one side (grouped by input text), so no probe is scored on a record it was
trained on.  One split of a few dozen samples moves by several points with its seed, so each row
is measured on ``--repeats`` splits: the first split's accuracy with its 95% Wilson interval, and
the mean (min–max) over all of them.  Rows, on the same folds:

- probe: L2 strength chosen inside each training fold by an inner cross-validation (or ``--l2``);
- majority baseline: each held-out fold predicted with its training fold's majority class;
- metadata control: the same procedure on a one-hot of the sample metadata ``--control-metadata``
  alone.  A probe that does no better than this may only be reading the kind of question.

Then two tests: the probe against ``--permutations`` runs of the whole procedure on permuted labels
(a one-sided permutation p-value, and what noise scores on average), and the probe against the
metadata control on the same samples (exact McNemar test on the first split).

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
    RepeatedCV,
    choose_l2,
    majority_baseline,
    one_hot,
    permutation_test,
    repeated_cv,
    sample_groups,
    sample_metadata,
    save_probe,
    stratified_folds,
    train_probe,
)
from inspect_tl_vllm.research.stats import mcnemar_p_value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--hook", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--folds", type=int, default=5, help="outer (and inner) cross-validation folds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first split (then seed+1, ...)")
    parser.add_argument("--repeats", type=int, default=10, help="cross-validations on new splits (1-1000)")
    parser.add_argument("--permutations", type=int, default=99, help="label permutations of the test (1-100000)")
    parser.add_argument(
        "--l2", type=float, default=None, help="L2 on the standardised weights; default: chosen per fold by inner CV"
    )
    parser.add_argument("--control-metadata", default="category", help="sample metadata field of the control probe")
    args = parser.parse_args()
    if args.l2 is not None and not 0 <= args.l2 <= 1e6:
        parser.error(f"--l2 {args.l2}: give a value within 0 and 1e6")
    if not 1 <= args.repeats <= 1000:
        parser.error(f"--repeats {args.repeats}: give 1 to 1000 splits")
    if not 1 <= args.permutations <= 100_000:
        parser.error(f"--permutations {args.permutations}: give 1 to 100000 permutations")

    eval_log = read_eval_log(args.log)
    records = [r for r in activations.load(eval_log) if args.hook in r.activations and r.scores]
    features = torch.stack([r.activations[args.hook].float().mean(0) for r in records])
    labels = torch.tensor([float(next(iter(r.scores.values())) in (1, 1.0, "C")) for r in records])
    groups = sample_groups(eval_log, records)
    seeds = range(args.seed, args.seed + args.repeats)

    def cv(x: torch.Tensor) -> RepeatedCV:
        return repeated_cv(x, labels, folds=args.folds, repeats=args.repeats, seed=args.seed, l2=args.l2, groups=groups)

    search = f"--l2 {args.l2:g}" if args.l2 is not None else f"L2 chosen by inner {args.folds}-fold CV over {L2_GRID}"
    print(f"probe: {len(records)} samples, {int(labels.sum())} correct, hook {args.hook}")
    print(
        f"probe: {args.folds}-fold stratified cross-validation over {len(set(groups))} distinct inputs, "
        f"{args.repeats} splits (seeds {args.seed}..{args.seed + args.repeats - 1}); {search}"
    )
    splits = [stratified_folds(labels, args.folds, s, groups) for s in seeds]
    rows = {
        "probe (activations)": cv(features),
        "majority baseline": RepeatedCV(tuple(majority_baseline(labels, f) for f in splits), tuple(seeds)),
    }
    metadata_row = f"control: metadata {args.control_metadata!r} only"
    values = sample_metadata(eval_log, records, args.control_metadata)
    if all(v is None for v in values):
        print(f"probe: no sample has metadata {args.control_metadata!r}; the metadata control is left out")
    else:
        meta, names = one_hot(values)
        rows[metadata_row] = cv(meta)
        print(f"probe: metadata {args.control_metadata!r} values: {', '.join(names)}")

    width = max(map(len, rows))
    print(f"\n{'':<{width}}  first split [95% Wilson]  correct  mean over {args.repeats} splits (min–max)")
    for name, result in rows.items():
        first = result.runs[0]
        spread = f"{result.mean:.3f} ({min(result.accuracies):.3f}–{max(result.accuracies):.3f})"
        print(f"{name:<{width}}  {str(first.accuracy()):<24}  {first.correct:>3}/{len(first.labels):<3}  {spread}")

    probe = rows["probe (activations)"]
    observed = probe.runs[0].accuracy().estimate
    test = permutation_test(
        features, labels, observed, folds=args.folds, permutations=args.permutations, seed=args.seed, l2=args.l2,
        groups=groups,
    )  # fmt: skip
    noise = sum(test.null_accuracies) / len(test.null_accuracies)
    print(
        f"\nprobe against shuffled labels: p = {test.p_value:.3f} (first split, {args.permutations} permutations of "
        f"the whole procedure; their mean accuracy {noise:.3f})"
    )
    if metadata_row in rows:
        mine = (probe.runs[0].predictions == labels).tolist()
        theirs = (rows[metadata_row].runs[0].predictions == labels).tolist()
        only_probe = sum(a and not b for a, b in zip(mine, theirs, strict=True))
        only_meta = sum(b and not a for a, b in zip(mine, theirs, strict=True))
        difference = probe.mean - rows[metadata_row].mean
        print(
            f"probe against metadata {args.control_metadata!r} only: McNemar p = {mcnemar_p_value(mine, theirs):.3f} "
            f"(first split: only the probe right on {only_probe}, only the metadata on {only_meta}); "
            f"mean accuracy difference over {args.repeats} splits {difference:+.3f}"
        )
    print()
    for name, result in rows.items():
        if result.runs[0].l2:
            print(f"L2 per fold, {name}, first split: {', '.join(f'{v:g}' for v in result.runs[0].l2)}")

    l2 = args.l2 if args.l2 is not None else choose_l2(features, labels, L2_GRID, args.folds, args.seed, groups)
    weight, bias = train_probe(features, labels, l2=l2)
    save_probe(args.out, weight, bias, args.hook)
    print(f"\nprobe: trained on all {len(records)} samples with L2 {l2:g}, saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
