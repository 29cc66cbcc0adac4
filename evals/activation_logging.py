"""Activation logging during a benchmark: 120 short questions with exact answers, and each
sample's residual stream stored next to the log, ready for a probe against correctness.

    inspect eval evals/activation_logging.py --model tl-vllm/smollm2 -T hooks=blocks.12.hook_resid_post
    python evals/train_probe.py logs/<that log>.eval --hook blocks.12.hook_resid_post --out probe.safetensors
"""

from __future__ import annotations

from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import includes

from inspect_tl_vllm.solvers import steer

HERE = Path(__file__).resolve().parent


@task
def activation_logging(hooks: str = "blocks.12.hook_resid_post", reduce: str = "last", max_tokens: int = 16) -> Task:
    """``hooks``: comma-separated hook points; ``reduce``: none, mean, last or max_norm."""
    capture = {"hooks": [h.strip() for h in hooks.split(",") if h.strip()], "reduce": reduce, "positions": "prompt"}
    return Task(
        dataset=json_dataset(str(HERE / "data" / "short_answers.jsonl")),
        solver=steer(capture=capture),
        scorer=includes(),
        config=GenerateConfig(max_tokens=max_tokens, temperature=0.0),
    )
