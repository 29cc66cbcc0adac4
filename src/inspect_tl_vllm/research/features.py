"""Scoring samples by an SAE feature's activation, from the features the provider captured.

Capture the SAE's features (``capture: {sae: DIR, features: [i], reduce: mean, positions:
generated}``, or ``-M capture_sae=DIR``) and score each sample with ``sae_feature(DIR, i)``: the
feature's activation in the stored capture, averaged over the stored rows when the capture kept
one row per token.  A feature that a row's ``top_k`` did not keep counts as 0 in that row; name
the feature in ``features`` to have it exactly.
"""

from __future__ import annotations

from typing import Any

from inspect_ai.scorer import Score, Target, mean, scorer, stderr
from inspect_ai.solver import TaskState

from inspect_tl_vllm.research.scored_activations import stored_activations
from inspect_tl_vllm.specs import MAX_FEATURE, SpecError, sae_keys


@scorer(metrics=[mean(), stderr()])
def sae_feature(sae: str, feature: int) -> Any:
    """Each sample's activation of SAE feature ``feature``, read from its stored SAE capture."""
    from inspect_tl_vllm.vectors.sae import load_sae

    if not (type(feature) is int and 0 <= feature <= MAX_FEATURE):
        raise SpecError(f"sae_feature: feature must be a whole number within 0..{MAX_FEATURE}, got {feature!r}")
    loaded = load_sae(sae, "sae_feature.sae")
    loaded.check_feature(feature, "sae_feature")
    indices_key, values_key = sae_keys(loaded.hook)

    async def score(state: TaskState, target: Target) -> Score:
        tensors = stored_activations(state, "sae_feature", f"capture the features of {sae} (capture.sae)")
        if indices_key not in tensors or values_key not in tensors:
            raise SpecError(
                f"sae_feature: sample {state.sample_id!r} stored {sorted(tensors)}, not the features of the SAE at "
                f"{loaded.hook}; capture them with capture: {{sae: {sae}}}"
            )
        hits = tensors[indices_key] == feature
        rows = hits.shape[0]
        value = float((tensors[values_key].float() * hits).sum() / rows) if rows else 0.0
        return Score(value=value, metadata={"rows": rows, "rows_kept": int(hits.any(dim=1).sum())})

    return score
