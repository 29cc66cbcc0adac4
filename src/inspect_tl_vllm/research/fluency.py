"""Fluency of an answer: how likely the unsteered model finds it, token by token.

A steered answer can score on a task while no longer being language (the sweep's steered
answers at high coefficients mention the sea in strings of non-words).  Repetition is easy to
flag (``sweep.is_degenerate``); incoherence is not.  This scorer measures it on the same engine:
the mean log-probability per token of the answer after the same prompt, under the model with no
steering.  Fluent answers of a small chat model sit around -0.3 to -1.5; word salad falls far below.

An answer cut at ``max_tokens`` and one that ended by itself are scored the same way, over the
answer's own tokens: the end-of-turn token of one that ended is kept apart (``end_logprob`` in the
score's metadata, beside ``truncated``), so how often answers hit the limit, which steering
changes, does not move the score.  An empty answer that ended at once has no token but its end:
that is its score.
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
        metadata: dict[str, Any] = {"truncated": not ended}
        if ended:
            metadata["end_logprob"] = logprobs[-1]
            logprobs = logprobs[:-1] or logprobs  # an empty answer: its end-of-turn token alone
        value = sum(logprobs) / len(logprobs)
        return Score(value=value, answer=answer, metadata={"tokens": len(logprobs), "min": min(logprobs), **metadata})

    return score


def is_fluency_score(name: str) -> bool:
    """Whether a scorer name in a log is this scorer's."""
    return name == "fluency" or name.endswith("/fluency")
