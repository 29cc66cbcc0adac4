"""Steering by an SAE feature and logging SAE features per sample, on the default model.

    inspect eval evals/sae_features.py --model tl-vllm/smollm2 --limit 6

    tl-vllm sweep evals/sae_features.py --coef 0,1,2 --controls 2 --log-dir logs/sae-sweep
    tl-vllm report logs/sae-sweep

Each sample asks an everyday question with feature 0 of the SAE added at its hook point
(``blocks.12.hook_resid_post``), and stores the top 8 features of the answer (their mean over the
generated tokens) beside the log.  Scored by whether the answer talks about the sea and by the
feature's own activation over the answer (``sae_feature``).  The shipped SAE
(``saes/smollm2_l12_demo``, made by ``saes/make_demo_sae.py``) is a 64-feature demonstration,
not a trained SAE: its feature 0 is the ocean steering direction.  Point ``sae`` at a trained
one (SAELens' format) for real work.
"""

from __future__ import annotations

from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.model import GenerateConfig
from steering_demo import mentions_ocean, questions

from inspect_tl_vllm.research.features import sae_feature
from inspect_tl_vllm.solvers import steer

HERE = Path(__file__).resolve().parent
SAE = HERE / "saes" / "smollm2_l12_demo"


@task
def sae_features(
    coef: float = 1.0,
    feature: int = 0,
    op: str = "add",
    control_seed: int | None = None,
    control_kind: str = "gauss",
    layer: int | None = None,
    sae: str = str(SAE),
    top_k: int = 8,
    max_tokens: int = 40,
) -> Task:
    """One point: feature ``feature`` of ``sae`` steered with ``op`` (add or clamp) and ``coef``,
    or with ``control_seed`` a random direction of its decoder row's norm added instead.  ``layer``
    is taken for ``tl-vllm sweep`` and must be the SAE's own.  A feature has no contrastive pairs, so
    its controls are uniformly random directions only (``control_kind`` gauss)."""
    from inspect_tl_vllm.research.controls import random_like_vector
    from inspect_tl_vllm.specs import SpecError, parse_hook_point
    from inspect_tl_vllm.vectors.sae import load_sae

    sae = str(Path(sae).resolve())  # Inspect builds tasks in this file's folder
    loaded = load_sae(sae, "sae_features: sae")
    sae_layer, _ = parse_hook_point(loaded.hook)
    if layer is not None and layer != sae_layer:
        raise SpecError(f"sae_features: layer {layer} is not the SAE's ({loaded.hook}); sweep with --layer {sae_layer}")
    if control_kind != "gauss":
        raise SpecError(f"sae_features: control kind {control_kind!r}: an SAE feature's controls are 'gauss' only")
    if control_seed is not None:
        direction = random_like_vector(loaded.decoder_row(feature, "sae_features: feature"), control_seed)
        intervention = {"hook": loaded.hook, "vector": direction, "coef": coef}
    else:
        intervention = {"hook": loaded.hook, "op": op, "sae": sae, "feature": feature, "coef": coef}
    capture = {"sae": sae, "top_k": top_k, "reduce": "mean", "positions": "generated"}
    return Task(
        dataset=questions(),
        solver=steer(interventions=[intervention] if coef or op == "clamp" else [], capture=capture),
        scorer=[mentions_ocean(), sae_feature(sae, feature)],
        config=GenerateConfig(max_tokens=max_tokens, temperature=0.0),
    )
