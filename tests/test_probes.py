"""Linear probes: training recovers a separating direction; bad inputs are named; the scorer reads
only the sample's own folder; cross-validation finds what is there and nothing that is not, and
keeps every held-out fold (labels included) away from the L2 choice, the fit and the baseline."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from inspect_ai.model import ModelName, ModelOutput
from inspect_ai.scorer import Target
from inspect_ai.solver import TaskState

from inspect_tl_vllm.research import probes
from inspect_tl_vllm.research.probes import (
    choose_l2,
    cross_validate,
    load_probe,
    majority_baseline,
    one_hot,
    probe_scorer,
    probe_value,
    sample_metadata,
    save_probe,
    shuffled,
    stratified_folds,
    train_probe,
    training_indices,
)
from inspect_tl_vllm.specs import TAG, SpecError
from inspect_tl_vllm.store.sample_store import UnsafePathError, write_sample


def test_probe_learns_a_planted_direction(tmp_path):
    torch.manual_seed(0)
    direction = torch.randn(32)
    x = torch.randn(400, 32) * 3 + 5.0
    y = (x @ direction > (5.0 * direction.sum())).float()
    weight, bias = train_probe(x, y)
    accuracy = ((x @ weight + bias > 0).float() == y).float().mean()
    assert accuracy > 0.97
    assert torch.nn.functional.cosine_similarity(weight, direction, dim=0) > 0.9
    path = tmp_path / "probe.safetensors"
    save_probe(path, weight, bias, "blocks.1.hook_resid_post")
    w2, b2, hook = load_probe(path)
    assert hook == "blocks.1.hook_resid_post" and torch.equal(w2, weight)
    acts = {hook: x[:3]}
    assert probe_value(acts, w2, b2, hook) == pytest.approx(float(torch.sigmoid(x[:3].mean(0) @ weight + bias)))
    with pytest.raises(SpecError, match="captured"):
        probe_value({"ln_final.hook_normalized": x[:1]}, w2, b2, hook)


def test_probe_needs_both_classes_and_matching_shapes():
    with pytest.raises(SpecError, match="both classes"):
        train_probe(torch.randn(5, 3), torch.ones(5))
    with pytest.raises(SpecError, match="features must be"):
        train_probe(torch.randn(5, 3), torch.ones(4))


def test_probe_scorer_refuses_a_file_name_leading_out_of_the_folder(tmp_path):
    """The output metadata names a valid file (right checksum) outside its folder: only the name check stops it."""
    hook = "blocks.0.hook_resid_post"
    probe = tmp_path / "probe.safetensors"
    save_probe(probe, torch.ones(4), torch.zeros(()), hook)
    folder = tmp_path / "logs" / "x.activations"
    folder.mkdir(parents=True)
    entry = write_sample(
        tmp_path,
        eval_id="E",
        sample_id="s",
        epoch=1,
        sample_uuid="u",
        activations={hook: torch.ones(2, 4)},
        tokens={hook: 2},
    )
    output = ModelOutput.from_content("tl-vllm/tiny", "answer")
    # dir, file, sha256 and hooks, as the provider records them; the file lies two levels above the folder
    recorded = {
        "dir": str(folder),
        "file": f"../../{entry['file']}",
        "sha256": entry["sha256"],
        "hooks": entry["hooks"],
    }
    output.metadata = {TAG: {"activations": recorded}}
    state = TaskState(ModelName("tl-vllm/tiny"), "s", 1, "q", [], output=output)
    with pytest.raises(UnsafePathError, match=r"probe_scorer: sample 's' epoch 1 output metadata: file name '\.\./"):
        asyncio.run(probe_scorer(str(probe))(state, Target("")))


SMALL_GRID = (1e-2, 1.0)  # two strengths keep the inner search quick


def separable(n: int = 120, d: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise features, the first of which carries the label with a wide margin."""
    generator = torch.Generator().manual_seed(seed)
    y = (torch.arange(n) % 2).float()[torch.randperm(n, generator=generator)]
    x = torch.randn(n, d, generator=generator)
    x[:, 0] = (2 * y - 1) * (2 + torch.rand(n, generator=generator))
    return x, y


def noise(n: int = 100, d: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Features unrelated to the labels; as many dimensions as a training fold has samples / 2, so a
    probe that saw its held-out fold would fit it."""
    generator = torch.Generator().manual_seed(seed)
    y = (torch.arange(n) % 2).float()[torch.randperm(n, generator=generator)]
    return torch.randn(n, d, generator=generator), y


def test_stratified_folds_partition_the_samples_and_keep_both_classes_in_each():
    y = torch.tensor([1.0] * 13 + [0.0] * 37)
    folds = stratified_folds(y, 5, seed=0)
    assert sorted(torch.cat(folds).tolist()) == list(range(50))
    assert [len(f) for f in folds] == [10] * 5
    for fold in folds:
        assert 2 <= int(y[fold].sum()) <= 3  # 13 positives dealt over 5 folds
    assert all(torch.equal(a, b) for a, b in zip(folds, stratified_folds(y, 5, seed=0), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(folds, stratified_folds(y, 5, seed=1), strict=True))
    with pytest.raises(SpecError, match="label 1 has 3"):
        stratified_folds(torch.tensor([1.0] * 3 + [0.0] * 20), 5)


def test_cross_validation_finds_a_separating_feature():
    x, y = separable()
    result = cross_validate(x, y, stratified_folds(y, 5), grid=SMALL_GRID)
    assert result.accuracy().estimate >= 0.97
    assert len(result.l2) == 5 and set(result.l2) <= set(SMALL_GRID)


def test_cross_validation_on_noise_is_near_chance_and_its_interval_covers_one_half():
    x, y = noise()
    result = cross_validate(x, y, stratified_folds(y, 5), grid=SMALL_GRID)
    interval = result.accuracy()
    assert interval.low <= 0.5 <= interval.high
    assert abs(interval.estimate - 0.5) < 0.15
    # a probe scored on the samples it was trained on, as a leak would score it, lands far above
    weight, bias = train_probe(x, y, l2=1e-2)
    assert float((probes.predict(x, weight, bias) == y).float().mean()) > interval.high + 0.1


def test_the_l2_choice_and_the_fit_never_see_the_held_out_fold(monkeypatch):
    x, y = noise(n=60, d=6)
    row_of = {tuple(row.tolist()): i for i, row in enumerate(x)}
    folds = stratified_folds(y, 3)
    seen: list[tuple[str, set[int]]] = []  # ("choose" | "inner fit" | "fit", rows)
    choosing = []
    real_choose, real_train = probes.choose_l2, probes.train_probe

    def rows(features: torch.Tensor) -> set[int]:
        return {row_of[tuple(row.tolist())] for row in features}

    def spy_choose(features: torch.Tensor, labels: torch.Tensor, *args, **kwargs) -> float:
        seen.append(("choose", rows(features)))
        choosing.append(True)
        try:
            return real_choose(features, labels, *args, **kwargs)
        finally:
            choosing.pop()

    def spy_train(features: torch.Tensor, labels: torch.Tensor, **kwargs) -> tuple:
        seen.append(("inner fit" if choosing else "fit", rows(features)))
        return real_train(features, labels, **kwargs)

    monkeypatch.setattr(probes, "choose_l2", spy_choose)
    monkeypatch.setattr(probes, "train_probe", spy_train)
    cross_validate(x, y, folds, grid=SMALL_GRID)
    # per fold: one choice, its inner fits, then the fold's fit
    starts = [i for i, (kind, _) in enumerate(seen) if kind == "choose"] + [len(seen)]
    assert len(starts) == 4
    for fold, (start, end) in enumerate(zip(starts, starts[1:], strict=False)):
        held = set(folds[fold].tolist())
        training = set(range(60)) - held
        calls = seen[start:end]
        assert calls[0][1] == training and calls[-1] == ("fit", training)
        inner = [r for kind, r in calls if kind == "inner fit"]
        assert len(inner) == 3 * len(SMALL_GRID)
        assert all(r < training for r in inner)


def test_an_explicit_l2_skips_the_search(monkeypatch):
    x, y = separable(n=40, d=3)

    def refuse(*args, **kwargs) -> float:
        raise AssertionError("choose_l2 called although l2 was given")

    monkeypatch.setattr(probes, "choose_l2", refuse)
    assert cross_validate(x, y, stratified_folds(y, 4), l2=0.5).l2 == (0.5,) * 4


def test_choose_l2_picks_a_strength_that_does_better_out_of_fold():
    """Two features carry the label; many noise features tempt a weak L2 into overfitting."""
    generator = torch.Generator().manual_seed(3)
    y = (torch.arange(40) % 2).float()
    x = torch.randn(40, 60, generator=generator)
    x[:, :2] += (2 * y - 1)[:, None] * 0.8
    assert choose_l2(x, y, grid=(1e-3, 10.0)) == 10.0


def test_the_baseline_predicts_with_the_training_folds_majority():
    """Hand-made folds whose held-out majorities are the opposite of their training majorities."""
    y = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    folds = [torch.arange(0, 4), torch.arange(4, 10)]  # majorities 1 (3 of 4) and 0 (4 of 6)
    result = majority_baseline(y, folds)
    assert result.predictions.tolist() == [0.0] * 4 + [1.0] * 6
    assert result.correct == 1 + 2  # a held-out majority would have scored 3 + 4
    assert result.l2 == ()


def test_the_shuffled_label_control_is_near_chance_on_separable_data():
    x, y = separable()
    permuted = shuffled(y, seed=0)
    assert sorted(permuted.tolist()) == sorted(y.tolist()) and not torch.equal(permuted, y)
    assert torch.equal(permuted, shuffled(y, seed=0))
    interval = cross_validate(x, permuted, stratified_folds(permuted, 5), grid=SMALL_GRID).accuracy()
    assert interval.low <= 0.5 <= interval.high


def test_a_metadata_probe_reads_the_one_hot_category():
    categories = ["arithmetic", "capital", "general", None] * 15
    features, names = one_hot(categories)
    assert names == ["None", "arithmetic", "capital", "general"]
    assert features.sum(1).tolist() == [1.0] * 60 and features[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    y = torch.tensor([float(c == "capital") for c in categories])
    assert cross_validate(features, y, stratified_folds(y, 5), grid=SMALL_GRID).accuracy().estimate == 1.0


def test_sample_metadata_joins_by_sample_id_and_epoch():
    samples = [
        SimpleNamespace(id=1, epoch=1, metadata={"category": "capital"}),
        SimpleNamespace(id="1", epoch=1, metadata={"category": "arithmetic"}),
        SimpleNamespace(id=1, epoch=2, metadata=None),
    ]
    records = [SimpleNamespace(sample_id=i, epoch=e) for i, e in [(1, 2), ("1", 1), (1, 1), (7, 1)]]
    found = sample_metadata(SimpleNamespace(samples=samples), records, "category")
    assert found == [None, "arithmetic", "capital", None]


@pytest.mark.parametrize("l2", [-1.0, float("nan"), 1e7])
def test_train_probe_refuses_an_l2_out_of_range(l2: float) -> None:
    features = torch.randn(8, 3)
    labels = torch.tensor([0.0, 1.0] * 4)
    with pytest.raises(SpecError, match="l2 must be within 0 and 1e6"):
        train_probe(features, labels, l2=l2)


def test_grouped_folds_keep_each_group_on_one_side_and_stay_stratified():
    y = torch.tensor([float(i % 3 == 0) for i in range(60)])
    groups = [i // 2 for i in range(60)]  # two epochs per sample, labels shared within a sample
    y = y[[2 * (i // 2) for i in range(60)]]
    folds = stratified_folds(y, 5, seed=0, groups=groups)
    assert sorted(torch.cat(folds).tolist()) == list(range(60))
    for fold in folds:
        inside = {groups[i] for i in fold.tolist()}
        assert all(groups[i] not in inside for i in training_indices(60, fold).tolist())
        assert 0 < y[fold].mean() < 1
    assert [f.tolist() for f in stratified_folds(y, 5, seed=0, groups=list(range(60)))] == [
        f.tolist() for f in stratified_folds(y, 5, seed=0)
    ]  # one group per record: the record-level folds
    with pytest.raises(SpecError, match="stratified_folds: 3 group keys for 60 samples"):
        stratified_folds(y, 5, groups=[0, 1, 2])
    with pytest.raises(SpecError, match="5 folds need at least 5 groups of each class; label 1 has 4"):
        stratified_folds(torch.tensor([1.0] * 8 + [0.0] * 20), 5, groups=[i // 2 for i in range(28)])


def test_grouped_folds_do_not_score_a_probe_on_the_records_it_was_trained_on():
    """Noise labels, every sample twice (two epochs, identical features): folds over records put
    one copy in training and the other in the held-out fold, and an unregularised probe scores far
    above chance; folds over samples give chance, as they should."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(40, 48, generator=generator)
    y = (torch.rand(40, generator=generator) > 0.5).float()
    x2, y2, groups = x.repeat_interleave(2, 0), y.repeat_interleave(2), [i // 2 for i in range(80)]
    leaky = cross_validate(x2, y2, stratified_folds(y2, 5, seed=0), l2=1e-4).accuracy().estimate
    grouped = cross_validate(x2, y2, stratified_folds(y2, 5, seed=0, groups=groups), l2=1e-4).accuracy().estimate
    assert leaky > 0.85 and grouped < 0.7, (leaky, grouped)


def test_sample_groups_join_epochs_and_identical_inputs():
    from inspect_tl_vllm.research.probes import sample_groups

    samples = [
        SimpleNamespace(id="a", epoch=1, input="What is 3 times 4?"),
        SimpleNamespace(id="a", epoch=2, input="What is 3 times 4?"),
        SimpleNamespace(id="b", epoch=1, input="What is 3 times 4?"),
        SimpleNamespace(id="c", epoch=1, input="Name a colour."),
    ]
    log = SimpleNamespace(samples=samples)
    records = [SimpleNamespace(sample_id=s.id, epoch=s.epoch) for s in samples]
    records.append(SimpleNamespace(sample_id="gone", epoch=1))  # not in the log: its id alone
    keys = sample_groups(log, records)
    assert keys[0] == keys[1] == keys[2] != keys[3] and keys[4] == "id:'gone'"


def test_repeated_cross_validation_uses_new_folds_and_reports_their_mean():
    from inspect_tl_vllm.research.probes import repeated_cv

    x, y = noise(n=60, d=6)
    result = repeated_cv(x, y, folds=5, repeats=4, seed=2, l2=1e-2)
    assert result.seeds == (2, 3, 4, 5) and len(result.runs) == 4
    assert len({tuple(r.predictions.tolist()) for r in result.runs}) > 1  # other folds, other predictions
    assert result.mean == pytest.approx(sum(result.accuracies) / 4)
    direct = cross_validate(x, y, stratified_folds(y, 5, 3), l2=1e-2)
    assert torch.equal(result.runs[1].predictions, direct.predictions)
    with pytest.raises(SpecError, match="repeats must be within 1 and 1000"):
        repeated_cv(x, y, repeats=0)


def test_permutation_test_repeats_the_procedure_on_permuted_labels():
    from inspect_tl_vllm.research.probes import permutation_test

    x, y = separable(n=60)
    observed = cross_validate(x, y, stratified_folds(y, 5, 0), l2=1e-2).accuracy().estimate
    found = permutation_test(x, y, observed, permutations=19, l2=1e-2)
    assert found.p_value == pytest.approx(1 / 20) and len(found.null_accuracies) == 19
    assert abs(sum(found.null_accuracies) / 19 - 0.5) < 0.12  # noise scores about chance
    x, y = noise(n=60, d=6)
    observed = cross_validate(x, y, stratified_folds(y, 5, 0), l2=1e-2).accuracy().estimate
    assert permutation_test(x, y, observed, permutations=19, l2=1e-2).p_value > 0.1


def test_mcnemar_counts_only_the_samples_one_classifier_gets_right():
    from inspect_tl_vllm.research.stats import mcnemar_p_value

    first = [True] * 10 + [False] * 2 + [True] * 30 + [False] * 5  # 10 only first, 2 only second
    second = [False] * 10 + [True] * 2 + [True] * 30 + [False] * 5
    assert mcnemar_p_value(first, second) == pytest.approx(2 * (1 + 12 + 66) / 4096)
    assert mcnemar_p_value(second, first) == mcnemar_p_value(first, second)
    assert mcnemar_p_value([True, False], [True, False]) == 1.0
    with pytest.raises(ValueError, match="same samples"):
        mcnemar_p_value([True], [True, False])


PROBE_TASK_LABELS = [i % 2 for i in range(16)]


@pytest.mark.engine
def test_train_probe_script_on_a_real_log(vllm_ready, tiny_llama_dir, tmp_path):
    """evals/train_probe.py on a log of the tiny model with captures: every row, both tests, the
    saved probe."""
    import subprocess
    import sys
    from pathlib import Path

    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import GenerateConfig
    from inspect_ai.scorer import Score, mean, scorer
    from inspect_ai.solver import generate

    from conftest import PROVIDER_ARGS, environment

    @scorer(metrics=[mean()])
    def label():
        async def score(state, target):
            return Score(value=state.metadata["label"])

        return score

    samples = [
        Sample(id=i, input=("Name a river." if y else "Add 2 and 3.") + f" ({i})", metadata={"label": y,
               "category": "river" if y else "sum"})
        for i, y in enumerate(PROBE_TASK_LABELS)
    ]  # fmt: skip
    task = Task(dataset=samples, solver=generate(), scorer=label(), config=GenerateConfig(max_tokens=2))
    args = {**PROVIDER_ARGS, "capture": "blocks.1.hook_resid_post"}
    with environment(TORCH_COMPILE_DISABLE="1"):
        log = eval(task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path), display="none")[0]
    assert log.status == "success", log.error
    script = Path(__file__).resolve().parents[1] / "evals" / "train_probe.py"
    command = [sys.executable, str(script), log.location, "--hook", "blocks.1.hook_resid_post"]
    command += ["--out", str(tmp_path / "probe.safetensors"), "--folds", "2", "--repeats", "3", "--permutations", "4"]
    done = subprocess.run([*command, "--l2", "0.01"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "16 samples, 8 correct" in out and "3 splits (seeds 0..2)" in out
    for row in ("probe (activations)", "majority baseline", "control: metadata 'category' only"):
        line = next(line for line in out.splitlines() if line.startswith(row))
        assert "/16" in line and "(" in line.split("/16")[1], line  # first split, then the mean (min–max)
    assert "probe against shuffled labels: p = " in out and "4 permutations of the whole procedure" in out
    assert "probe against metadata 'category' only: McNemar p = " in out
    assert load_probe(tmp_path / "probe.safetensors")[2] == "blocks.1.hook_resid_post"
    refused = subprocess.run([*command, "--repeats", "0"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "--repeats 0: give 1 to 1000 splits" in refused.stderr
