"""Shared fixtures: the real vLLM CPU engine on a tiny random Llama and on SmolLM2.

Engine tests must not pass quietly where vLLM or the model is missing: under ``CI=true``
a missing prerequisite fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inspect_tl_vllm.engine.plugin import installed_vllm
from inspect_tl_vllm.verify import environment

IN_CI = os.environ.get("CI", "").lower() == "true"
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
}


TINY_MODEL_ARGS_CLI = ["-M", "enforce_eager=true", "-M", "dtype=float32", "-M", "max_model_len=256"]
"""`-M` flags for an eager fp32 engine on the tiny model, as the command lines take them."""
PROVIDER_ARGS = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "seed": 0}
"""Model args of an eager fp32 provider engine on the tiny model (``provider_model_args``)."""
VLLM_VERSION = installed_vllm()
"""The vLLM release under test (scripts/test.sh runs the engine tests on each supported one)."""


def eval_spec(eval_id: str, model_args: dict | None = None):
    """The header of a small tl-vllm eval log, for tests that build logs without running an eval."""
    from inspect_ai.log import EvalConfig, EvalDataset, EvalSpec

    return EvalSpec(
        created="2026-01-01T00:00:00+00:00",
        task="t",
        dataset=EvalDataset(),
        model="tl-vllm/tiny",
        config=EvalConfig(),
        eval_id=eval_id,
        model_args=model_args or {},
    )


def require(condition: bool, why: str) -> None:
    if not condition:
        (pytest.fail if IN_CI else pytest.skip)(why)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from inspect_tl_vllm.model_prep import is_prepared, smollm2_dir

    require(is_prepared(smollm2_dir()), "SmolLM2 not prepared: run scripts/setup.sh")
    return smollm2_dir()


@pytest.fixture(scope="session")
def vllm_ready() -> Iterator[None]:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        require(False, f"vLLM is not installed ({err}): run scripts/setup.sh")
    yield
    # The provider's shared engines, shut down while pytest's output streams are still open: at
    # interpreter exit (the pool's own atexit) vLLM 0.32 logs its shutdown into closed streams.
    pool = sys.modules.get("inspect_tl_vllm.provider.engine_pool")
    if pool is not None:
        pool.shutdown_engines()


def build_tiny_model(architecture: str, config: object, target: Path, tokenizer_dir: Path) -> Path:
    """Save a random-weight model of ``architecture`` with SmolLM2's tokenizer and chat template."""
    import torch
    import transformers

    config.architectures = [architecture]
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    with torch.no_grad():  # larger weights than the default init, so steering moves tokens
        for param in model.parameters():
            if param.ndim == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(target))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, target / name)
    return target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A random-weight Llama (3 layers, width 64, head_dim 32) with SmolLM2's tokenizer."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, **TINY)
    return build_tiny_model("LlamaForCausalLM", config, tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


def boot_engine(model: Path | str, *, compiled: bool = False, **kwargs: object):
    from inspect_tl_vllm import boot

    settings = {"dtype": "float32", "max_model_len": 256, "seed": 0, "enforce_eager": not compiled, **kwargs}
    # Eager engines also skip the sampler's own torch.compile (17 s of C++ builds on CPU).
    with environment(TORCH_COMPILE_DISABLE=None if compiled else "1"):
        return boot(str(model), **settings)


def on_gpu() -> bool:
    from inspect_tl_vllm.engine.construct import on_cpu_build

    return not on_cpu_build()


def gpu_settings() -> dict:
    """``booted_engine`` settings that let a CPU engine test run on a GPU as well: compiled with CUDA
    graphs, a small memory share (engines follow each other), and engine processes spawned (a second
    engine forked from a process that ran one cannot start CUDA).  None on CPU."""
    if not on_gpu():
        return {}
    return {"compiled": True, "gpu_memory_utilization": 0.3, "env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}


def gpu_provider_args() -> dict:
    """Provider model args that let a CPU eval test run on a GPU beside the test's other engines."""
    return {"gpu_memory_utilization": 0.3} if on_gpu() else {}


def tolerance() -> float:
    """Relative error allowed against transformers in float32: 1e-4 on CPU, the compiled GPU engine's own."""
    from inspect_tl_vllm.verify import GPU_FLOAT32_TOLERANCE

    return GPU_FLOAT32_TOLERANCE if on_gpu() else 1e-4


@contextlib.contextmanager
def booted_engine(model: Path | str, *, env: dict[str, str] | None = None, **kwargs: object) -> Iterator[Any]:
    """An engine of one test's own (``boot_engine``'s settings and ``kwargs``), booted with the
    environment variables ``env`` set and shut down when the block ends."""
    with environment(**(env or {})):
        engine = boot_engine(model, **kwargs)
    try:
        yield engine
    finally:
        engine.llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def provider_model_args(**extra: object) -> Iterator[dict[str, Any]]:
    """``PROVIDER_ARGS`` plus ``extra`` for ``eval(model_args=...)``; while the block runs the
    engine, which boots inside the first eval(), skips torch.compile."""
    with environment(TORCH_COMPILE_DISABLE="1"):
        yield {**PROVIDER_ARGS, **extra}


def engine_key(model_dir: Path, args: dict[str, Any]) -> str:
    """The provider's engine pool key for the tiny model under the model args ``args``."""
    from inspect_tl_vllm.aliases import resolve_model
    from inspect_tl_vllm.provider.model_args import parse_model_args

    return parse_model_args(args).engine_key(resolve_model(str(model_dir)))


async def engine_thread_status(engine_thread: Any) -> dict[str, Any]:
    """A provider engine's merged ``tlvllm_status`` (booting it first if need be)."""
    from inspect_tl_vllm.engine.frontend import merge_status

    instrumented = await engine_thread.instrumented()
    return merge_status(await engine_thread.run(lambda: instrumented.llm.collective_rpc("tlvllm_status")))


def cpu_hook_runtime(hidden_size: int, *, sites: tuple[int, ...] = (0,), max_stack: int = 1, max_tokens: int = 16):
    """The hook buffers of ``sites`` on the CPU, for driving the step router without an engine."""
    import torch

    from inspect_tl_vllm.instrument.runtime import HookRuntime

    return HookRuntime(
        site_widths=dict.fromkeys(sites, hidden_size), bank_width=hidden_size, max_tokens=max_tokens,
        max_stack=max_stack, max_vectors=1,
        device=torch.device("cpu"), act_dtype=torch.float32,
    )  # fmt: skip


TINY_ENGINE_INSTRUMENT = {"hook_points": ["all"], "max_stack": 2}
"""The shared ``tiny_engine``'s instrumentation: every hook point, two stages a site."""


@pytest.fixture(scope="session")
def tiny_engine(vllm_ready: None, tiny_llama_dir: Path):
    """Eager fp32 engine on the tiny model with every hook point instrumented."""
    return boot_engine(tiny_llama_dir, instrument=TINY_ENGINE_INSTRUMENT)


def assert_batch_matches_solo(engine, prompts: list, specs: list, max_tokens: int = 8) -> list:
    """Run prompts with their specs in one batch, then each alone: tokens and captures must agree,
    and one step must have carried at least three differently steered requests."""
    engine.status()  # restarts the batch-mixing counter
    together = engine.generate(prompts, specs=specs, max_tokens=max_tokens)
    assert engine.status()["max_requests_steered_in_one_step"] >= 3
    for prompt, spec, joint in zip(prompts, specs, together, strict=True):
        alone = engine.generate([prompt], specs=[spec], max_tokens=max_tokens)[0]
        assert joint.token_ids == alone.token_ids
        assert set(joint.activations) == set(alone.activations)
        for hook, value in alone.activations.items():
            assert float((joint.activations[hook] - value).norm() / value.norm()) < 1e-5, hook
    return together
