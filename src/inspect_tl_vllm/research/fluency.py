"""Fluency of an answer: how likely the unsteered model finds it, token by token.

A steered answer can score on a task while no longer being language (the sweep's steered
answers at high coefficients mention the sea in strings of non-words).  Repetition is easy to
flag (``sweep.is_degenerate``); incoherence is not.  This scorer measures it on the same engine:
the mean log-probability per token of the answer (and its end-of-turn token, when it ended by
itself) after the same prompt, under the model with no steering.  Fluent answers of a small chat
model sit around -0.3 to -1.5; word salad falls far below.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.model import get_model
from inspect_ai.scorer import Score, Target, mean, scorer, stderr
from inspect_ai.solver import TaskState

from inspect_tl_vllm.specs import SpecError


@scorer(metrics=[mean(), stderr()])
def fluency() -> Any:
    """Mean log-probability per answer token under the unsteered model (a ``tl-vllm`` model)."""

    async def score(state: TaskState, target: Target) -> Score:
        api = get_model().api
        if not hasattr(api, "answer_logprobs"):
            raise SpecError(f"fluency() scores with a tl-vllm model; this task's model is {api.model_name!r}")
        prompt = state.messages[:-1] if state.messages and state.messages[-1].role == "assistant" else state.messages
        answer = state.output.completion
        ended = state.output.stop_reason == "stop"
        logprobs = await api.answer_logprobs(prompt, answer, ended=ended)
        value = sum(logprobs) / len(logprobs)
        return Score(value=value, answer=answer, metadata={"tokens": len(logprobs), "min": min(logprobs)})

    return score


def is_fluency_score(name: str) -> bool:
    """Whether a scorer name in a log is this scorer's."""
    return name == "fluency" or name.endswith("/fluency")
