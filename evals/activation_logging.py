"""Activation logging during a benchmark: 120 short questions with exact answers, and each
sample's residual stream stored next to the log, ready for a probe against correctness.

    inspect eval evals/activation_logging.py --model tl-vllm/smollm2 -T hooks=blocks.12.hook_resid_post
    python evals/train_probe.py logs/<that log>.eval --hook blocks.12.hook_resid_post --out probe.safetensors

Each question carries ``metadata.category`` (arithmetic, capital, quantity, general), which
``train_probe.py --control-metadata category`` uses as a control.
"""

from __future__ import annotations

import re
import string
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, match, scorer, stderr
from inspect_ai.solver import TaskState

from inspect_tl_vllm.solvers import steer

HERE = Path(__file__).resolve().parent
NUMBER = re.compile(r"[+-]?\d+(\.\d+)?")


def fold(text: str) -> str:
    """Case and surrounding punctuation folded away, as inspect's ``match`` folds text."""
    return text.casefold().strip(string.whitespace + string.punctuation)


def ends_with_words(answer: str, target: str) -> bool:
    """Whether the answer's last whitespace-separated words are the target's, case and surrounding
    punctuation aside."""
    tail = " ".join(answer.split()[-len(target.split()) :])
    return fold(tail) == fold(target)


@scorer(metrics=[accuracy(), stderr()])
def short_answer() -> Scorer:
    """Correct when the answer ends with a target: the final number for number targets, the final
    word(s) for word targets.

    ``includes`` marked "12 - 6 = 12" correct for 6 (the target appears in the working).  Number
    targets go to inspect's ``match(numeric=True)``, which compares the answer's final number.
    Words are compared whole: ``match`` tests words with ``str.endswith``, which would pass "dice"
    for "ice".
    """
    numeric = match(location="end", numeric=True)

    async def score(state: TaskState, target: Target) -> Score:
        if all(NUMBER.fullmatch(value.strip()) for value in target):
            return await numeric(state, target)
        answer = state.output.completion
        correct = any(ends_with_words(answer, value) for value in target)
        return Score(value=CORRECT if correct else INCORRECT, answer=answer.strip(), explanation=answer)

    return score


@task
def activation_logging(hooks: str = "blocks.12.hook_resid_post", reduce: str = "last", max_tokens: int = 16) -> Task:
    """``hooks``: comma-separated hook points; ``reduce``: none, mean, last or max_norm."""
    capture = {"hooks": [h.strip() for h in hooks.split(",") if h.strip()], "reduce": reduce, "positions": "prompt"}
    return Task(
        dataset=json_dataset(str(HERE / "data" / "short_answers.jsonl")),
        solver=steer(capture=capture),
        scorer=short_answer(),
        config=GenerateConfig(max_tokens=max_tokens, temperature=0.0),
    )
