"""Linear probes on captured activations: train one, and score samples with it in Inspect.

A probe file is safetensors with ``weight`` (hidden size) and ``bias`` (scalar) and metadata
``hook`` (the hook point it reads).  The scorer reads the sample's stored activations at that
hook point (mean over rows if per token) and scores ``sigmoid(weight . x + bias)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import TaskState

from inspect_tl_vllm.specs import TAG, SpecError


def train_probe(features: torch.Tensor, labels: torch.Tensor, steps: int = 300, l2: float = 1e-3) -> tuple:
    """Logistic regression (full-batch LBFGS, standardised inputs folded back into the weights)."""
    x = features.float()
    y = labels.float()
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise SpecError(f"train_probe: features must be [N, d] and labels [N], got {tuple(x.shape)}, {tuple(y.shape)}")
    if y.min() == y.max():
        raise SpecError("train_probe: labels are all the same; a probe needs both classes")
    mu, sd = x.mean(0), x.std(0).clamp_min(1e-6)
    z = (x - mu) / sd
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y) + l2 * (w @ w)
        loss.backward()
        return loss

    opt.step(closure)
    weight = (w / sd).detach()
    bias = (b - (mu / sd) @ w).detach()
    return weight, bias


def save_probe(path: str | Path, weight: torch.Tensor, bias: torch.Tensor, hook: str) -> None:
    from safetensors.torch import save_file

    save_file({"weight": weight.contiguous(), "bias": bias.reshape(())}, str(path), metadata={"hook": hook})


def load_probe(path: str | Path) -> tuple[torch.Tensor, torch.Tensor, str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as handle:
        hook = (handle.metadata() or {}).get("hook")
        if not hook:
            raise SpecError(f"probe {path}: metadata 'hook' missing (save it with save_probe)")
        return handle.get_tensor("weight"), handle.get_tensor("bias"), hook


def probe_value(activations: dict[str, torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, hook: str) -> float:
    if hook not in activations:
        raise SpecError(f"probe reads {hook!r} but the sample captured {sorted(activations)}; add it to capture")
    x = activations[hook].float().mean(dim=0)
    return float(torch.sigmoid(x @ weight.float() + bias.float()))


@scorer(metrics=[mean()])
def probe_scorer(probe: str) -> Any:
    """Score each sample with a saved linear probe applied to its captured activations."""
    weight, bias, hook = load_probe(probe)

    async def score(state: TaskState, target: Target) -> Score:
        from inspect_tl_vllm.provider.active import active_sample
        from inspect_tl_vllm.store.disk import read_sample, recorded_dir

        stored = (state.output.metadata or {}).get(TAG, {}).get("activations", {})
        if "dir" not in stored:
            raise SpecError(f"probe_scorer: sample {state.sample_id!r} has no stored activations; capture {hook}")
        # The file name is data from the output's metadata: read_sample keeps it inside the folder.
        where = f"probe_scorer: sample {state.sample_id!r} epoch {state.epoch} output metadata"
        active = active_sample()  # the folder is recorded relative to the log's folder
        folder = recorded_dir(stored["dir"], active.log_location) if active is not None else Path(stored["dir"])
        tensors = read_sample(folder, stored, where=where)
        return Score(value=probe_value(tensors, weight, bias, hook))

    return score
