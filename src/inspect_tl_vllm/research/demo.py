"""``tl-vllm demo``: a steered, captured generation on the default model through the engine.

It extracts a steering vector from the engine's own captures (mean residual stream of a
concept prompt minus a neutral one), answers a question unsteered and steered in one batch,
prints both answers with the steering receipt, and saves the captured activations.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

HOOK = "blocks.12.hook_resid_post"
CONCEPT = "The ocean: waves, the sea, salt water, sailing ships, whales and the deep blue sea."
NEUTRAL = "A list of ordinary things: a table, a chair, a pencil, a door and a window."
QUESTION = [{"role": "user", "content": "Tell me about your weekend."}]


def extract_ocean_vector(engine: Any) -> Any:
    """Mean residual stream at HOOK of a concept prompt minus a neutral one, via the engine."""
    capture = {"hooks": [HOOK], "reduce": "mean"}
    concept, neutral = engine.generate([CONCEPT, NEUTRAL], capture=capture, max_tokens=1)
    return (concept.activations[HOOK][0] - neutral.activations[HOOK][0]).float()


def run(
    model: str = "smollm2",
    coef: float = 1.0,
    max_tokens: int = 40,
    out_dir: str = "logs",
    save_vector: str | None = None,
) -> Path:
    from safetensors.torch import save_file

    from inspect_tl_vllm.engine.construct import on_cpu_build
    from inspect_tl_vllm.engine.offline import boot

    on_gpu = not on_cpu_build()
    settings = {} if on_gpu else {"enforce_eager": True, "dtype": "float32", "max_model_len": 1024}
    if not on_gpu:
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")  # CPU: skip minutes of C++ compilation
    print(f"demo: booting {model} on {'GPU (compiled, CUDA graphs)' if on_gpu else 'CPU (eager)'}", flush=True)
    start = time.time()
    engine = boot(model, **settings)
    print(f"demo: engine ready in {time.time() - start:.0f} s", flush=True)

    vector = extract_ocean_vector(engine)
    print(f"demo: steering vector at {HOOK}, norm {vector.norm():.1f}", flush=True)
    if save_vector:
        save_file(
            {"vector": vector.contiguous()},
            save_vector,
            metadata={"model": model, "hook": HOOK, "concept": CONCEPT, "neutral": NEUTRAL},
        )
        print(f"demo: vector saved to {save_vector}")

    steer = [{"hook": HOOK, "op": "add", "vector": vector.tolist(), "coef": coef, "positions": "all"}]
    per_token = {"hooks": [HOOK, "ln_final.hook_normalized"]}
    plain, steered = engine.generate(
        [QUESTION, QUESTION],
        specs=[{"capture": per_token}, {"interventions": steer, "capture": per_token}],
        max_tokens=max_tokens,
    )
    print(f"\nunsteered: {plain.text.strip()!r}\nsteered (+{coef} x ocean vector): {steered.text.strip()!r}")
    receipt = steered.receipt["interventions"][0]
    print(f"receipt: {receipt['rows']} token rows steered, mean norm change {receipt['mean_norm_change']:+.2f}")

    target = Path(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    path = target / "demo-activations.safetensors"
    tensors = {
        f"{name}/{hook}": value.contiguous()
        for name, gen in (("unsteered", plain), ("steered", steered))
        for hook, value in gen.activations.items()
    }
    save_file(tensors, str(path), metadata={"model": model, "question": QUESTION[0]["content"], "coef": str(coef)})
    for key, value in tensors.items():
        print(f"captured {key}: {tuple(value.shape)} {value.dtype}")
    print(f"demo: activations saved to {path}")
    return path
