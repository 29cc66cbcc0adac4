"""Linear probes: training recovers a separating direction; bad inputs are named."""

from __future__ import annotations

import pytest
import torch

from inspect_tl_vllm.probes import load_probe, probe_value, save_probe, train_probe
from inspect_tl_vllm.specs import SpecError


def test_probe_learns_a_planted_direction(tmp_path):
    torch.manual_seed(0)
    direction = torch.randn(32)
    x = torch.randn(400, 32) * 3 + 5.0
    y = (x @ direction > (5.0 * direction.sum())).float()
    weight, bias = train_probe(x, y)
    accuracy = ((x @ weight + bias > 0).float() == y).float().mean()
    assert accuracy > 0.97
    assert torch.nn.functional.cosine_similarity(weight, direction, dim=0) > 0.9
    path = tmp_path / "probe.safetensors"
    save_probe(path, weight, bias, "blocks.1.hook_resid_post")
    w2, b2, hook = load_probe(path)
    assert hook == "blocks.1.hook_resid_post" and torch.equal(w2, weight)
    acts = {hook: x[:3]}
    assert probe_value(acts, w2, b2, hook) == pytest.approx(float(torch.sigmoid(x[:3].mean(0) @ weight + bias)))
    with pytest.raises(SpecError, match="captured"):
        probe_value({"ln_final.hook_normalized": x[:1]}, w2, b2, hook)


def test_probe_needs_both_classes_and_matching_shapes():
    with pytest.raises(SpecError, match="both classes"):
        train_probe(torch.randn(5, 3), torch.ones(5))
    with pytest.raises(SpecError, match="features must be"):
        train_probe(torch.randn(5, 3), torch.ones(4))
