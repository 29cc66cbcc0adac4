"""Linear probes on captured activations: train one, measure it honestly, and score samples with it in Inspect.

A probe file is safetensors with ``weight`` (hidden size) and ``bias`` (scalar) and metadata
``hook`` (the hook point it reads).  The scorer reads the sample's stored activations at that
hook point (mean over rows if per token) and scores ``sigmoid(weight . x + bias)``.

Measuring a probe: ``cross_validate`` gives every sample a prediction from a probe that never
saw it, over stratified folds that keep a sample's epochs and identical inputs together
(``stratified_folds`` with ``groups``), with the L2 strength chosen inside each training fold (an inner
cross-validation, ``choose_l2``), so that neither the weights nor the L2 choice has seen the
held-out fold.  Beside it, ``majority_baseline`` (each fold predicted with its training fold's
majority class), a probe on permuted labels (``shuffled``: what the procedure finds in noise)
and a probe on a one-hot of sample metadata (``one_hot``: what the question's kind alone predicts).

One split of a few dozen samples gives an accuracy that moves by several points with the seed, so
``repeated_cv`` reports the mean over repetitions with new folds; ``permutation_test`` repeats the
whole procedure on permuted labels (how often noise does as well), and ``stats.mcnemar_p_value``
compares two procedures on the same samples, paired.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import TaskState

from inspect_tl_vllm.research.scored_activations import stored_activations
from inspect_tl_vllm.research.stats import Interval, wilson_interval
from inspect_tl_vllm.specs import SpecError

L2_GRID = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
"""The L2 strengths ``choose_l2`` tries: decades, from nearly none to strong."""


def train_probe(features: torch.Tensor, labels: torch.Tensor, steps: int = 300, l2: float = 1e-3) -> tuple:
    """Logistic regression (full-batch LBFGS, standardised inputs folded back into the weights)."""
    x = features.float()
    y = labels.float()
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise SpecError(f"train_probe: features must be [N, d] and labels [N], got {tuple(x.shape)}, {tuple(y.shape)}")
    if y.min() == y.max():
        raise SpecError("train_probe: labels are all the same; a probe needs both classes")
    if not 0 <= l2 <= 1e6:  # NaN fails this too
        raise SpecError(f"train_probe: l2 must be within 0 and 1e6, got {l2}")
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    weight = (w / sd).detach()
    bias = (b - (mu / sd) @ w).detach()
    return weight, bias


@dataclass(frozen=True)
class OutOfFold:
    """0/1 predictions for every sample, each from a model that did not see that sample, and the
    labels they are scored against."""

    predictions: torch.Tensor
    labels: torch.Tensor
    l2: tuple[float, ...] = ()
    """The L2 strength used in each fold, in fold order (empty for the majority baseline)."""

    @property
    def correct(self) -> int:
        """How many predictions equal their label."""
        return int((self.predictions == self.labels).sum())

    def accuracy(self) -> Interval:
        """Accuracy over all out-of-fold predictions, with its 95% Wilson interval."""
        return wilson_interval(self.correct, len(self.labels))


def stratified_folds(
    labels: torch.Tensor, k: int = 5, seed: int = 0, groups: Sequence[Hashable] | None = None
) -> list[torch.Tensor]:
    """``k`` held-out index sets that partition the samples, each with about the same share of
    each class: every class is shuffled with ``seed`` and the classes, one after the other, are
    dealt to the folds in turn.  Each class needs at least ``k`` samples, so that every fold holds
    both classes and every training fold can fit a probe.

    With ``groups`` (one key per sample) the groups are dealt instead, whole: records that share a
    key (epochs of one sample, samples with identical inputs) never sit on both sides of a split,
    where a probe would be scored on what it was trained on.  A group's class is its majority label."""
    y = labels.float()
    if k < 2:
        raise SpecError(f"stratified_folds: need at least 2 folds, got {k}")
    keys = list(range(len(y))) if groups is None else list(groups)
    if len(keys) != len(y):
        raise SpecError(f"stratified_folds: {len(keys)} group keys for {len(y)} samples")
    members: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        members.setdefault(key, []).append(index)
    units = list(members.values())
    unit_label = torch.tensor([float(y[unit].mean() >= 0.5) for unit in units])
    what = "samples" if groups is None else "groups"
    generator = torch.Generator().manual_seed(seed)
    order = []
    for value in (0.0, 1.0):
        chosen = torch.nonzero(unit_label == value).flatten()
        if len(chosen) < k:
            raise SpecError(
                f"stratified_folds: {k} folds need at least {k} {what} of each class; "
                f"label {int(value)} has {len(chosen)}"
            )
        order.append(chosen[torch.randperm(len(chosen), generator=generator)])
    dealt = torch.cat(order).tolist()
    return [torch.tensor(sorted(i for u in dealt[f::k] for i in units[u]), dtype=torch.long) for f in range(k)]


def training_indices(n: int, held_out: torch.Tensor) -> torch.Tensor:
    """The indices in ``range(n)`` that ``held_out`` leaves: a fold's training samples."""
    keep = torch.ones(n, dtype=torch.bool)
    keep[held_out] = False
    return torch.nonzero(keep).flatten()


def predict(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """0/1 predictions of a probe: 1 where ``weight . x + bias > 0``."""
    return (features.float() @ weight + bias > 0).float()


def choose_l2(
    features: torch.Tensor,
    labels: torch.Tensor,
    grid: Sequence[float] = L2_GRID,
    folds: int = 5,
    seed: int = 0,
    groups: Sequence[Hashable] | None = None,
) -> float:
    """The L2 strength in ``grid`` with the best cross-validated accuracy on these samples alone
    (inner folds grouped by ``groups`` as the outer ones are).

    Called with a training fold only, it keeps the held-out fold out of the choice.  Ties go to
    the stronger L2, the simpler probe."""
    splits = stratified_folds(labels, folds, seed, groups)
    scores = {l2: cross_validate(features, labels, splits, l2=l2).accuracy().estimate for l2 in grid}
    return max(sorted(grid, reverse=True), key=lambda l2: scores[l2])


def cross_validate(
    features: torch.Tensor,
    labels: torch.Tensor,
    folds: list[torch.Tensor],
    l2: float | None = None,
    grid: Sequence[float] = L2_GRID,
    seed: int = 0,
    groups: Sequence[Hashable] | None = None,
) -> OutOfFold:
    """Out-of-fold predictions of a logistic probe: for each held-out fold, a probe trained on the
    other folds.  ``l2=None`` chooses the L2 strength per fold with ``choose_l2`` on that fold's
    training samples (inner folds as many as the outer ones, ``seed`` for their shuffle, grouped
    by the training samples' ``groups``)."""
    x, y = features.float(), labels.float()
    predictions = torch.full_like(y, float("nan"))
    chosen = []
    for held in folds:
        train = training_indices(len(y), held)
        inner = None if groups is None else [groups[i] for i in train.tolist()]
        strength = choose_l2(x[train], y[train], grid, len(folds), seed, inner) if l2 is None else l2
        weight, bias = train_probe(x[train], y[train], l2=strength)
        predictions[held] = predict(x[held], weight, bias)
        chosen.append(strength)
    if predictions.isnan().any():
        raise SpecError("cross_validate: the folds must cover every sample")
    return OutOfFold(predictions, y, tuple(chosen))


@dataclass(frozen=True)
class RepeatedCV:
    """Cross-validation repeated with new folds (seeds ``seed``, ``seed + 1``, ...)."""

    runs: tuple[OutOfFold, ...]
    seeds: tuple[int, ...]

    @property
    def accuracies(self) -> list[float]:
        return [run.accuracy().estimate for run in self.runs]

    @property
    def mean(self) -> float:
        return sum(self.accuracies) / len(self.runs)


def repeated_cv(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    folds: int = 5,
    repeats: int = 10,
    seed: int = 0,
    l2: float | None = None,
    groups: Sequence[Hashable] | None = None,
) -> RepeatedCV:
    """``cross_validate`` on ``repeats`` different stratified, grouped splits."""
    if not 1 <= repeats <= 1000:
        raise SpecError(f"repeated_cv: repeats must be within 1 and 1000, got {repeats}")
    seeds = tuple(range(seed, seed + repeats))
    runs = tuple(
        cross_validate(features, labels, stratified_folds(labels, folds, s, groups), l2=l2, seed=s, groups=groups)
        for s in seeds
    )
    return RepeatedCV(runs, seeds)


@dataclass(frozen=True)
class PermutationTest:
    p_value: float
    null_accuracies: tuple[float, ...]
    """The accuracy of each permutation: what the procedure finds in noise."""


def permutation_test(
    features: torch.Tensor,
    labels: torch.Tensor,
    observed: float,
    *,
    folds: int = 5,
    permutations: int = 99,
    seed: int = 0,
    l2: float | None = None,
    groups: Sequence[Hashable] | None = None,
) -> PermutationTest:
    """One-sided permutation test of a cross-validated accuracy ``observed`` (of the split with
    ``seed``): p = ``(1 + #{permutations scoring >= observed}) / (permutations + 1)``, each
    permutation the whole procedure (folds, L2 choice, fit) on the labels permuted with its own seed."""
    if not 1 <= permutations <= 100_000:
        raise SpecError(f"permutation_test: permutations must be within 1 and 100000, got {permutations}")
    null = []
    for index in range(permutations):
        permuted = shuffled(labels, seed + 1 + index)
        splits = stratified_folds(permuted, folds, seed, groups)
        null.append(cross_validate(features, permuted, splits, l2=l2, seed=seed, groups=groups).accuracy().estimate)
    return PermutationTest((1 + sum(a >= observed for a in null)) / (permutations + 1), tuple(null))


def majority_baseline(labels: torch.Tensor, folds: list[torch.Tensor]) -> OutOfFold:
    """Each held-out fold predicted with the majority class of its training fold (a tie predicts 0).

    The training fold's majority, not the held-out fold's: the baseline must not see the labels it
    is scored against any more than the probe does."""
    y = labels.float()
    predictions = torch.full_like(y, float("nan"))
    for held in folds:
        predictions[held] = float(y[training_indices(len(y), held)].mean() > 0.5)
    if predictions.isnan().any():
        raise SpecError("majority_baseline: the folds must cover every sample")
    return OutOfFold(predictions, y)


def shuffled(labels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The labels permuted once with ``seed``: a control target that no feature can predict, so
    a probe's accuracy on it shows what the procedure finds in noise (about chance)."""
    return labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))]


def one_hot(values: Sequence[Any]) -> tuple[torch.Tensor, list[str]]:
    """Features of one column per distinct value (compared as text; None is a value of its own),
    and the column names: the input of a probe that knows only the sample's metadata."""
    names = sorted({str(v) for v in values})
    column = {name: i for i, name in enumerate(names)}
    features = torch.zeros(len(values), len(names))
    for row, value in enumerate(values):
        features[row, column[str(value)]] = 1.0
    return features, names


def sample_groups(eval_log: Any, records: Sequence[Any]) -> list[str]:
    """One fold-grouping key per record: its sample's input text, so that the epochs of a sample
    and samples with identical inputs land in the same fold (the sample id where the log lacks it)."""
    inputs = {(repr(s.id), int(s.epoch)): s.input for s in eval_log.samples or []}
    keys = []
    for record in records:
        value = inputs.get((repr(record.sample_id), int(record.epoch)))
        if value is None:
            keys.append(f"id:{record.sample_id!r}")
        else:
            text = value if isinstance(value, str) else json.dumps([m.model_dump() for m in value], sort_keys=True)
            keys.append(f"input:{text}")
    return keys


def sample_metadata(eval_log: Any, records: Sequence[Any], field: str) -> list[Any]:
    """The metadata ``field`` of each record's sample (None where absent), joined by sample id and
    epoch with the eval log's samples: the stored activations do not carry sample metadata."""
    by_sample = {(repr(s.id), int(s.epoch)): s.metadata or {} for s in eval_log.samples or []}
    return [by_sample.get((repr(r.sample_id), int(r.epoch)), {}).get(field) for r in records]


def save_probe(path: str | Path, weight: torch.Tensor, bias: torch.Tensor, hook: str) -> None:
    from safetensors.torch import save_file

    save_file({"weight": weight.contiguous(), "bias": bias.reshape(())}, str(path), metadata={"hook": hook})


def load_probe(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        hook = (handle.metadata() or {}).get("hook")
        if not hook:
            raise SpecError(f"probe {path}: metadata 'hook' missing (save it with save_probe)")
        return handle.get_tensor("weight"), handle.get_tensor("bias"), hook


def probe_value(activations: dict[str, torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, hook: str) -> float:
    if hook not in activations:
        raise SpecError(f"probe reads {hook!r} but the sample captured {sorted(activations)}; add it to capture")
    x = activations[hook].float().mean(dim=0)
    return float(torch.sigmoid(x @ weight.float() + bias.float()))


@scorer(metrics=[mean()])
def probe_scorer(probe: str) -> Any:
    """Score each sample with a saved linear probe applied to its captured activations."""
    weight, bias, hook = load_probe(probe)

    async def score(state: TaskState, target: Target) -> Score:
        tensors = stored_activations(state, "probe_scorer", f"capture {hook}")
        return Score(value=probe_value(tensors, weight, bias, hook))

    return score
