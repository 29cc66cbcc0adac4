"""Solvers that attach steering and capture to a sample's generation."""

from __future__ import annotations

from typing import Any

from inspect_ai.model import CachePolicy
from inspect_ai.solver import Generate, Solver, TaskState, solver

from inspect_tl_vllm.specs import TAG, parse_request_spec


@solver
def steer(
    interventions: list[dict[str, Any]] | None = None,
    capture: dict[str, Any] | None = None,
    cache: bool | CachePolicy = False,
) -> Solver:
    """Generate with these interventions and capture (on top of run-wide model args); ``cache``
    as Inspect's ``generate(cache=...)`` (the cache keys on the spec and on the contents of the
    vector files and SAEs it names).

    The spec is validated when the task is built, so a bad spec fails before any sample runs.
    """
    spec = parse_request_spec({"interventions": interventions or [], "capture": capture}, "steer()")
    body = {TAG: spec.model_dump()}

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        return await generate(state, cache=cache, extra_body=body)

    return solve
