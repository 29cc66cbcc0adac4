"""inspect-tl-vllm: steering and activation capture for Inspect evals on an instrumented vLLM.

Heavy modules (torch, vLLM) load on first use, so ``import inspect_tl_vllm`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from inspect_tl_vllm.specs import Capture, InstrumentConfig, Intervention, RequestSpec, SpecError

__all__ = [
    "Capture",
    "InstrumentConfig",
    "Intervention",
    "RequestSpec",
    "SpecError",
    "activations",
    "boot",
    "construct_instrumented_llm",
]


def __getattr__(name: str) -> Any:
    if name == "activations":  # `from inspect_tl_vllm import activations`: reading stored activations
        from inspect_tl_vllm.store import activations

        return activations
    if name == "boot":
        from inspect_tl_vllm.engine.offline import boot

        return boot
    if name == "construct_instrumented_llm":
        from inspect_tl_vllm.engine.construct import construct_instrumented_llm

        return construct_instrumented_llm
    raise AttributeError(name)
