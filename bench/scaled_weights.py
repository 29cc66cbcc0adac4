"""Random weights at the scale a trained model has, for throughput runs (``--weights scaled``).

vLLM's dummy weights are uniform in +-1e-3, RMSNorm weights included, so every layer's
output is nearly zero, the residual stream is almost the token embedding, and greedy
decoding gives nearly the same token for every request (2 distinct ids over 65,536 in the
8B runs).  A GPU may well run such batches of repeated rows faster, at lower power
(``gpu_power.py`` records that), and a variant that changes the outputs (steering) would lose
that edge and look slower than it is (docs/BENCHMARKS.md).  Re-drawing the weights the way a
model is initialised before training (normal, std 0.02; norm weights 1) gives every variant
distinct rows to work on.  Each parameter is seeded by its name, so both engines get the
same weights.

Sent to each worker with ``LLM.collective_rpc``, which pickles the function: the bench sets
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for its own two engines only when asked for this.
Left on in the engine core, it slows every later call that returns nested lists (see
``close_insecure_serialization``), so ``rescale`` turns it off there where it can: with one
GPU the worker runs inside the engine-core process.  Elsewhere (vLLM's CPU build always runs
separate worker processes) it stays on, and ``rescale`` says so.
"""

from __future__ import annotations

import os
import zlib
from typing import Any


def rescale(worker: Any, seed: int = 0, std: float = 0.02) -> dict[str, Any]:
    """Re-draw every floating-point parameter of ``worker``'s model in place.

    Returns how many, and whether insecure serialization was turned off again."""
    import torch

    model = worker.model_runner.model
    generator = torch.Generator(device=next(model.parameters()).device)
    count = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if param.dim() == 1:  # norm weights (Llama has no biases)
                param.fill_(1.0)
            else:  # seeded by name: the same values whatever else either engine's model holds
                param.normal_(0.0, std, generator=generator.manual_seed(seed + zlib.crc32(name.encode())))
            count += 1
    in_engine_core = worker.vllm_config.parallel_config.distributed_executor_backend == "uni"
    if in_engine_core:  # before the engine core encodes this call's answer
        close_insecure_serialization()
    return {"parameters": count, "insecure_serialization_closed": in_engine_core}


def close_insecure_serialization() -> None:
    """Turn ``VLLM_ALLOW_INSECURE_SERIALIZATION`` off again in this (engine-core) process.

    While it is on, vLLM tags every element of a worker call's nested lists with its type and
    converts each one on arrival.  On an H200 that made the fetch of a capture-all run, with
    460,000 positions, take 2 s instead of 0.12 s (docs/BENCHMARKS.md).  The engine core
    caches vLLM's environment after start-up, so the cache is rebuilt.  The front end may
    keep it on: it converts only answers that carry type tags.
    """
    import vllm.envs as envs

    os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION", None)
    if hasattr(envs.__getattr__, "cache_clear"):  # cached (engine core): rebuild from the new environment
        envs.disable_envs_cache()
        envs.enable_envs_cache()
