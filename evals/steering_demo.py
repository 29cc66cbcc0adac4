"""A steered, captured eval on the default model: the README's main job.

    inspect eval evals/steering_demo.py --model tl-vllm/smollm2 \
        -M steer=evals/steer_ocean.yaml -M capture=blocks.12.hook_resid_post -M capture_reduce=mean

Each sample asks a short everyday question; the scorer checks whether the answer talks about
the sea.  Without steering few answers do; with the ocean vector added at layer 12 most do.
The vector (evals/vectors/smollm2_ocean_l12.safetensors) comes from `tl-vllm demo --save-vector`.
"""

from __future__ import annotations

import re

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate

OCEAN = re.compile(r"\b(ocean|sea|seas|waves?|beach|sail\w*|water|whales?|fish|coast\w*|tides?|marine)\b")
QUESTIONS = [
    "Tell me about your weekend.",
    "What should I cook for dinner?",
    "Describe your favourite place.",
    "What is a good hobby?",
    "Write one sentence about a city.",
    "What did you dream about?",
]


@scorer(metrics=[accuracy()])
def mentions_ocean():
    async def score(state: TaskState, target: Target) -> Score:
        text = state.output.completion.lower()
        hit = OCEAN.search(text) is not None
        return Score(value=1 if hit else 0, answer=state.output.completion)

    return score


@task
def steering_demo(max_tokens: int = 40) -> Task:
    samples = [Sample(id=f"q{i}", input=q) for i, q in enumerate(QUESTIONS)]
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0)
    return Task(dataset=samples, solver=generate(), scorer=mentions_ocean(), config=config)
