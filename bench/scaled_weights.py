"""Random weights at the scale a trained model has, for throughput runs (``--weights scaled``).

vLLM's dummy weights are uniform in +-1e-3, RMSNorm weights included, so every layer's
output is nearly zero, the residual stream is almost the token embedding, and greedy
decoding gives nearly the same token for every request (2 distinct ids over 65,536 in the
8B runs).  A GPU may well run such batches of repeated rows faster, at lower power
(``gpu_power.py`` records that), and a variant that changes the outputs would lose that
edge: round 4 in docs/BENCHMARKS.md points that way for steering.  Re-drawing the weights the way a model is
initialised before training (normal, std 0.02; norm weights 1) gives every variant
distinct rows to work on.  Each parameter is seeded by its name, so both engines get the
same weights.

Sent to each worker with ``LLM.collective_rpc``, which pickles the function: the bench sets
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for its own two engines only when asked for this.
"""

from __future__ import annotations

import zlib
from typing import Any


def rescale(worker: Any, seed: int = 0, std: float = 0.02) -> int:
    """Re-draw every floating-point parameter of ``worker``'s model in place; returns how many."""
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
    return count
