"""The shipped short-answer questions and their scorer: every instruction asks for the kind of
answer its target is, every question has a category (the probe's metadata control), and the
scorer grades the answer, not the working ("12 - 6 = 12" is wrong for 6)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from inspect_ai.dataset import json_dataset
from inspect_ai.model import ModelName, ModelOutput
from inspect_ai.scorer import CORRECT, INCORRECT, Target
from inspect_ai.solver import TaskState

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "evals" / "data" / "short_answers.jsonl"
CATEGORIES = {"arithmetic", "capital", "quantity", "general"}


@cache
def task_module() -> ModuleType:
    """evals/activation_logging.py, which is a task file rather than part of the package."""
    spec = importlib.util.spec_from_file_location("activation_logging", ROOT / "evals" / "activation_logging.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grade(answer: str, target: str | list[str]) -> str:
    state = TaskState(
        ModelName("tl-vllm/tiny"), "s", 1, "q", [], output=ModelOutput.from_content("tl-vllm/tiny", answer)
    )
    return asyncio.run(task_module().short_answer()(state, Target(target))).value


@pytest.mark.parametrize(
    ("answer", "target", "expected"),
    [
        ("12 - 6 = 12", "6", INCORRECT),  # includes() passed this: the target is in the working
        ("6", "6", CORRECT),
        ("The answer is 6.", "6", CORRECT),
        ("12 - 6 = 6", "6", CORRECT),
        ("16", "6", INCORRECT),
        ("3 - 4 = -1", "-1", CORRECT),
        ("The boiling point of water in Celsius is 100.000", "100", CORRECT),
        ("Paris.", "Paris", CORRECT),
        ("The capital of France is Paris.", "Paris", CORRECT),
        ("Lyon", "Paris", INCORRECT),
        ("Paris is the capital of France.", "Paris", INCORRECT),  # the answer must end with it
        ("The answer is dice.", "ice", INCORRECT),  # match()'s endswith would pass this
        ('The answer is "green"', "green", CORRECT),
        ("", "green", INCORRECT),
        ("It is the Pacific Ocean.", ["Pacific", "Pacific Ocean"], CORRECT),
    ],
)
def test_the_scorer_grades_the_final_answer(answer, target, expected):
    assert grade(answer, target) == expected


def rows() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def test_every_instruction_asks_for_the_kind_of_answer_its_target_is():
    data = rows()
    assert len(data) == 120 and len({r["id"] for r in data}) == 120  # bench/ reads the inputs and their count
    for row in data:
        targets = row["target"] if isinstance(row["target"], list) else [row["target"]]
        first = targets[0]
        instruction = re.search(r"Answer with [^.]*\.$", row["input"])
        assert instruction, row
        kind = instruction.group(0)
        if re.fullmatch(r"-?\d+", first):
            assert kind == "Answer with the number only.", row
        elif kind == "Answer with one letter.":
            assert len(first) == 1 and first.isalpha(), row
        elif kind == "Answer with the symbol only.":
            assert first.isalpha() and len(first) <= 3 and first[0].isupper(), row
        else:
            assert kind == "Answer with one word." and first.isalpha() and len(first) > 1, row
        assert all(grade(f"The answer is {t}.", row["target"]) == CORRECT for t in targets), row


def test_every_question_has_a_category_that_inspect_reads_into_the_sample_metadata():
    data = rows()
    assert {r["metadata"]["category"] for r in data} == CATEGORIES
    for row in data:
        assert (row["metadata"]["category"] == "capital") == ("capital" in row["input"]), row
        if row["metadata"]["category"] == "arithmetic":
            assert re.fullmatch(r"-?\d+", row["target"]), row
    samples = json_dataset(str(DATA))
    assert [s.metadata["category"] for s in samples] == [r["metadata"]["category"] for r in data]


def test_no_two_questions_share_an_input():
    """A repeated question would sit in a probe's training and held-out folds at once."""
    inputs = [row["input"] for row in rows()]
    assert len(set(inputs)) == len(inputs), sorted({q for q in inputs if inputs.count(q) > 1})


def test_the_shipped_pair_rows_are_the_rows_of_the_shipped_vector():
    """The rows behind evals/vectors/smollm2_ocean_pairs_l12 (for covariance and relabel controls) give
    back the vector: the mean of each pair's positive row less its negative row."""
    from safetensors.torch import load_file

    vectors = Path(__file__).resolve().parents[1] / "evals" / "vectors"
    hook = "blocks.12.hook_resid_post"
    vector = load_file(str(vectors / "smollm2_ocean_pairs_l12.safetensors"))[hook]
    rows = load_file(str(vectors / "smollm2_ocean_pairs_l12.rows.safetensors"))[hook]
    pairs = [line for line in (vectors.parent / "data" / "ocean_pairs.jsonl").read_text().splitlines() if line.strip()]
    assert rows.shape == (2 * len(pairs), vector.numel())
    assert float(((rows[0::2] - rows[1::2]).mean(0) - vector).abs().max()) < 1e-4
