"""``construct_instrumented_llm``: the one place an instrumented vLLM engine is built.

It owns everything capture correctness depends on: the instrumentation settings inside
vLLM's config (``additional_config``), the worker extension, the settings that would break
the per-token bookkeeping (refused by name), and the front-end hook table that must match
the workers'.  The Python API and the Inspect provider both call it.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from inspect_tl_vllm.aliases import model_config, resolve_model
from inspect_tl_vllm.engine.adapters import Adapter, check_lora_args, check_lora_dtype, read_adapter
from inspect_tl_vllm.engine.config import additional_config
from inspect_tl_vllm.engine.frontend import Instrumentation, adopt_worker_status, merge_status
from inspect_tl_vllm.specs import TAG, InstrumentConfig, SpecError

EXTENSION = "inspect_tl_vllm.engine.worker.TLWorkerExtension"

REFUSED = {
    "speculative_config": "speculative decoding runs draft tokens and a second model through the step",
    "enable_dbo": "dual-batch overlap splits each step into micro-batches with their own token order",
    "ubatch_size": "micro-batching splits each step with its own token order",
    "kv_sharing_fast_prefill": "fast prefill skips rows of some layers, so captures would come back short",
    "prefill_context_parallel_size": "prefill context parallelism splits a step's rows between ranks",
    "worker_extension_cls": "tl-vllm installs its own worker extension",
    "data_parallel_size": (
        "vLLM's data-parallel client returns a worker call's answer from the first replica only, so "
        "captures of requests another replica served could not be fetched; run one eval per replica "
        "(or tensor/pipeline parallel) instead"
    ),
}
ONE_IS_FINE = {"ubatch_size", "data_parallel_size", "prefill_context_parallel_size"}


@dataclass
class InstrumentedLLM:
    """An instrumented engine with its front-end hook table."""

    llm: Any  # vllm.LLM, or AsyncLLM with async_engine=True
    instrumentation: Instrumentation
    model_path: str
    is_async: bool
    adapter: Adapter | None = None
    lora_request: Any = None  # the adapter's vllm LoRARequest, given with every request


@functools.cache
def _warn_once(message: str) -> None:
    """A warning logged once per process, not at every engine an eval builds."""
    logging.getLogger(__name__).warning(message)


def on_cpu_build() -> bool:
    """Whether vLLM runs on its CPU platform.

    Asks vLLM's platform detection (NVML) rather than ``torch.cuda.is_available()``: the latter
    initialises the CUDA driver in this process, and vLLM then forks its engine core into a
    process where CUDA cannot start ("Cannot re-initialize CUDA in forked subprocess").
    """
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


CPU_KV_CACHE_CAP = 1 << 30
"""The most KV cache the CPU build reserves by default (it would otherwise take a share of RAM)."""
CPU_MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs`` on its CPU platform."""


def cpu_defaults(engine_kwargs: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """Engine settings that make vLLM's CPU build practical, unless given: a KV cache sized to the
    run (``cpu_kv_cache_bytes``) and eager mode (compiling costs a minute and gains little)."""
    if not on_cpu_build():
        return engine_kwargs
    defaults: dict[str, Any] = {"enforce_eager": True}
    if "kv_cache_memory_bytes" not in engine_kwargs:
        defaults["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(model, engine_kwargs)
    return {**defaults, **engine_kwargs}


def cpu_kv_cache_bytes(model: str | None, engine_kwargs: dict[str, Any]) -> int:
    """Room for ``max_num_seqs`` sequences of ``max_model_len`` tokens (vLLM's defaults where unset:
    256, the model's context), at least one whole sequence, at most ``CPU_KV_CACHE_CAP``: a 135M model
    with max_model_len 256 needs megabytes, not the gigabyte a large context takes."""
    if model is None:
        return CPU_KV_CACHE_CAP
    from inspect_tl_vllm.instrument.hookpoints import ModelShape

    config = model_config(resolve_model(model), model)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = ModelShape.of(text)
    dtype = str(engine_kwargs.get("dtype") or "auto")
    if dtype == "auto":
        dtype = str(getattr(text, "dtype", None) or getattr(text, "torch_dtype", None) or "bfloat16")
    element = 4 if "float32" in dtype else 2
    per_token = 2 * shape.num_layers * shape.n_kv_heads * shape.d_head * element  # a key and a value per layer
    tokens = int(engine_kwargs.get("max_model_len") or getattr(text, "max_position_embeddings", None) or 8192)
    sequences = int(engine_kwargs.get("max_num_seqs") or CPU_MAX_NUM_SEQS)
    one_sequence = per_token * (tokens + 256)  # vLLM must fit one whole sequence; a few blocks spare
    return int(min(max(per_token * tokens * sequences, one_sequence), max(CPU_KV_CACHE_CAP, one_sequence)))


def check_engine_args(engine_kwargs: dict[str, Any]) -> None:
    """Refuse, by name, engine settings under which captures or steering would be wrong."""
    for name, why in REFUSED.items():
        value = engine_kwargs.get(name)
        if value and not (name in ONE_IS_FINE and value == 1):
            raise SpecError(f"engine argument {name}={value!r} is not supported with instrumentation: {why}")
    extra = engine_kwargs.get("additional_config") or {}
    if TAG in extra:
        raise SpecError(
            f"additional_config[{TAG!r}] is set by tl-vllm; give the instrumentation settings as "
            "instrument=InstrumentConfig(...) (Python) or -M hook_points/max_stack/max_vectors/"
            "capture_bytes_per_request (Inspect) instead"
        )
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "inspect_tl_vllm" not in plugins.split(","):
        raise SpecError(f"VLLM_PLUGINS={plugins!r} excludes 'inspect_tl_vllm', so workers would not be instrumented")


def check_sharded_sites(instrumentation: Instrumentation, engine_kwargs: dict[str, Any]) -> None:
    """Refuse per-head and neuron hook points under tensor parallelism: each rank holds a slice
    of the heads and neurons, and captures are read from rank 0 alone."""
    tp = int(engine_kwargs.get("tensor_parallel_size") or 1)
    names = {site.name for site in instrumentation.sites.values()}
    inner = sorted(name for name in names if ".attn." in name or ".mlp." in name)
    if tp > 1 and inner:
        raise SpecError(
            f"hook_points: {inner[0]} (per head or per neuron) is not supported with tensor_parallel_size={tp}: "
            "each rank holds only some heads and neurons; use pipeline_parallel_size, or residual-stream hook points"
        )


def construct_instrumented_llm(
    model: str,
    *,
    instrument: InstrumentConfig | dict[str, Any] | None = None,
    async_engine: bool = False,
    lora: str | None = None,
    **engine_kwargs: Any,
) -> InstrumentedLLM:
    """Build an instrumented vLLM engine.

    ``model`` is an alias (``smollm2``), a local directory or a Hugging Face id;
    ``instrument`` fixes which hook points exist and the buffer sizes; the remaining keyword
    arguments go to vLLM's ``EngineArgs`` (the ones listed in ``REFUSED`` are refused).
    With ``async_engine=True`` the engine is an ``AsyncLLM`` (bound to the running loop's
    thread), otherwise an offline ``vllm.LLM``.  ``lora`` names a PEFT LoRA adapter's folder that
    every request runs with (``engine/adapters.py``); the offline engine loads it here, the async
    one when its owner awaits ``load_adapter``.
    """
    from inspect_tl_vllm.engine.plugin import unsupported_vllm, untested_vllm

    reason = unsupported_vllm()
    if reason is not None:
        raise RuntimeError(reason)
    note = untested_vllm()
    if note is not None:
        _warn_once(note)
    settings = instrument if isinstance(instrument, InstrumentConfig) else InstrumentConfig(**(instrument or {}))
    check_engine_args(engine_kwargs)
    adapter = read_adapter(lora) if lora is not None else None
    check_lora_args(adapter, engine_kwargs)
    check_lora_dtype(adapter, engine_kwargs, on_gpu=not on_cpu_build())
    model_path = resolve_model(model)
    instrumentation = Instrumentation(model_config(model_path, model), settings)
    check_sharded_sites(instrumentation, engine_kwargs)
    extra = {**(engine_kwargs.pop("additional_config", None) or {}), **additional_config(settings)}
    kwargs = {"model": model_path, "additional_config": extra, "worker_extension_cls": EXTENSION, **engine_kwargs}
    if adapter is not None:
        kwargs.update(adapter.engine_args())
    request = adapter.request() if adapter is not None else None
    if async_engine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    else:
        from vllm import LLM

        engine = LLM(**kwargs)
        adopt_worker_status(instrumentation, merge_status(engine.collective_rpc("tlvllm_status")))
        if request is not None:
            _check_loaded(engine.llm_engine.add_lora(request), adapter)
    return InstrumentedLLM(engine, instrumentation, model_path, async_engine, adapter, request)


def import_engine_classes() -> None:
    """Import vLLM's async engine classes now, on the calling thread, before a boot in another
    thread needs them.  That thread would otherwise import them while this one imports packages
    they share (Inspect imports the OpenAI and Anthropic SDKs at a sample's start; vLLM's config
    imports OpenAI's): two threads inside one package's circular imports can see a module half
    initialised (``KeyError`` on ``openai.types.responses``, seen on the CPU machine)."""
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401


async def load_adapter(instrumented: InstrumentedLLM) -> None:
    """Load an async engine's adapter into its workers (the offline engine's is loaded at construction)."""
    if instrumented.lora_request is not None:
        _check_loaded(await instrumented.llm.add_lora(instrumented.lora_request), instrumented.adapter)


def _check_loaded(loaded: bool, adapter: Adapter | None) -> None:
    if not loaded:
        raise SpecError(f"lora: vLLM did not load the adapter {adapter.path if adapter else ''}")
