"""Inspect's cache keys on the contents of the vector files a spec names, not on their paths.

For each way a spec reaches a sample (its metadata, the task's ``extra_body``, the ``steer()``
solver, the run-wide ``-M steer``): a run fills the cache, the vector file is overwritten with
another direction (same path, same coef), and the next run must generate anew, answer as a run
steered by the new direction does, and say in its log which vector it applied.  An unchanged
file is answered from the cache.
"""

from __future__ import annotations

import pytest
import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import generate
from safetensors.torch import save_file

from conftest import provider_model_args

pytestmark = pytest.mark.engine
QUESTIONS = ["Name a colour.", "Say something about cats."]
HOOK = "blocks.1.hook_resid_post"


def write_direction(path, seed: int) -> None:
    save_file({"v": torch.randn(64, generator=torch.Generator().manual_seed(seed))}, str(path))


def task_for(way: str, vector: str) -> Task:
    from inspect_tl_vllm.solvers import steer

    spec = {"interventions": [{"hook": HOOK, "vector": vector, "coef": 8.0}]}
    config = GenerateConfig(max_tokens=8, temperature=0.0)
    metadata = {"tlvllm": spec} if way == "metadata" else None
    solver = generate(cache=True)
    if way == "extra_body":
        config = GenerateConfig(max_tokens=8, temperature=0.0, extra_body={"tlvllm": spec})
    elif way == "solver":
        solver = steer(spec["interventions"], cache=True)
    samples = [Sample(id=f"s{i}", input=q, metadata=metadata) for i, q in enumerate(QUESTIONS)]
    return Task(dataset=samples, solver=solver, config=config)


def run(way: str, vector: str, model_dir, log_dir):
    with provider_model_args() as args:
        if way == "run-wide":
            args["steer"] = f'{{"interventions": [{{"hook": "{HOOK}", "vector": "{vector}", "coef": 8.0}}]}}'
        log = eval(task_for(way, vector), model=f"tl-vllm/{model_dir}", model_args=args, log_dir=str(log_dir),
                   display="none")[0]  # fmt: skip
    assert log.status == "success", log.error
    modes = [event.cache for sample in log.samples for event in sample.events if event.event == "model"]
    texts = {sample.id: sample.output.completion for sample in log.samples}
    applied = {sample.output.metadata["tlvllm"]["applied"]["interventions"][0]["vector"] for sample in log.samples}
    return modes, texts, applied


@pytest.mark.parametrize("way", ["metadata", "extra_body", "solver", "run-wide"])
def test_an_overwritten_vector_file_is_never_answered_from_the_cache(
    vllm_ready, tiny_llama_dir, tmp_path, monkeypatch, way
):
    monkeypatch.setenv("INSPECT_CACHE_DIR", str(tmp_path / "cache"))
    vector, fresh = tmp_path / "v.safetensors", tmp_path / "fresh.safetensors"
    write_direction(vector, 1)
    modes, first, [first_vector] = run(way, f"{vector}:v", tiny_llama_dir, tmp_path / "logs")
    assert modes == ["write"] * len(QUESTIONS)
    modes, again, _ = run(way, f"{vector}:v", tiny_llama_dir, tmp_path / "logs")
    assert modes == ["read"] * len(QUESTIONS) and again == first

    write_direction(vector, 2)  # another direction at the same path, same coef
    write_direction(fresh, 2)
    modes, overwritten, [new_vector] = run(way, f"{vector}:v", tiny_llama_dir, tmp_path / "logs")
    assert modes == ["write"] * len(QUESTIONS), "the old steered answer came from the cache"
    _, expected, [expected_vector] = run(way, f"{fresh}:v", tiny_llama_dir, tmp_path / "logs")
    assert overwritten == expected and overwritten != first
    assert new_vector == expected_vector != first_vector  # the log tells the two runs apart
