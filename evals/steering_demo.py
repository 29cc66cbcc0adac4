"""Steering tasks on the default model: the README's main job and the coefficient sweep.

    inspect eval evals/steering_demo.py@steering_demo --model tl-vllm/smollm2 \
        -M steer=evals/steer_ocean.yaml -M capture=blocks.12.hook_resid_post -M capture_reduce=mean

    tl-vllm sweep evals/steering_demo.py@steering_sweep --coef 0,0.5,1,2 --controls 2 --log-dir logs/sweep
    tl-vllm report logs/sweep

Each sample asks an everyday question; the scorer checks whether the answer talks about the
sea.  The vector (evals/vectors/smollm2_ocean_l12.safetensors) is the mean residual stream
at layer 12 of an ocean prompt minus a neutral one (`tl-vllm demo --save-vector`).
"""

from __future__ import annotations

import re
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import Score, Target, accuracy, scorer, stderr
from inspect_ai.solver import TaskState, generate

from inspect_tl_vllm.research.fluency import fluency
from inspect_tl_vllm.solvers import steer

HERE = Path(__file__).resolve().parent
VECTOR = HERE / "vectors" / "smollm2_ocean_l12.safetensors"
OCEAN = re.compile(r"\b(ocean|oceans|sea|seas|waves?|beach\w*|sail\w*|water|whales?|fish|coast\w*|tides?|marine)\b")


@scorer(metrics=[accuracy(), stderr()])
def mentions_ocean():
    async def score(state: TaskState, target: Target) -> Score:
        text = state.output.completion
        return Score(value=1 if OCEAN.search(text.lower()) else 0, answer=text)

    return score


def questions(limit: int | None = None):
    return json_dataset(str(HERE / "data" / "everyday_questions.jsonl"), limit=limit)


@task
def steering_demo(max_tokens: int = 40) -> Task:
    """Six questions; steering and capture come from the model args (-M steer, -M capture)."""
    return Task(
        dataset=questions(limit=6),
        solver=generate(),
        scorer=mentions_ocean(),
        config=GenerateConfig(max_tokens=max_tokens, temperature=0.0),
    )


@task
def steering_sweep(
    coef: float = 1.0,
    layer: int = 12,
    control_seed: int | None = None,
    control_kind: str = "gauss",
    control_seeds: str | None = None,
    vector: str = str(VECTOR),
    max_tokens: int = 40,
) -> Task:
    """One point of a sweep: the vector (or, with control_seed, a control direction of the same norm,
    of ``control_kind``: see ``research/controls.py``) added at blocks.{layer}.hook_resid_post
    with coefficient ``coef``.  ``control_seeds`` (comma-separated) runs one control direction per
    seed in this one eval, each question once per direction
    (``tl-vllm sweep --controls-in-one-eval``).  Scored twice: does the answer talk about the sea,
    and how fluent is it to the unsteered model.  ``vector`` is a file (``path`` or ``path:key``)
    relative to this file's folder, as Inspect resolves task files."""
    from inspect_tl_vllm.research.controls import control_samples, parse_seeds, random_like

    # Inspect builds tasks inside the task file's folder: relative paths are relative to it.
    vector = str(Path(vector).resolve())
    hook = f"blocks.{layer}.hook_resid_post"
    if control_seeds is not None:
        seeds = parse_seeds(control_seeds)
        dataset = control_samples(list(questions()), vector, seeds, hook=hook, coef=coef, kind=control_kind)
        solver = generate()
    else:
        path = random_like(vector, control_seed, control_kind) if control_seed is not None else vector
        dataset = questions()
        solver = steer(interventions=[{"hook": hook, "vector": path, "coef": coef}]) if coef else generate()
    return Task(
        dataset=dataset,
        solver=solver,
        scorer=[mentions_ocean(), fluency()],
        config=GenerateConfig(max_tokens=max_tokens, temperature=0.0),
    )
