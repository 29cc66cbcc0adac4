"""Linear probes: training recovers a separating direction; bad inputs are named; the scorer reads
only the sample's own folder."""

from __future__ import annotations

import asyncio

import pytest
import torch
from inspect_ai.model import ModelName, ModelOutput
from inspect_ai.scorer import Target
from inspect_ai.solver import TaskState

from inspect_tl_vllm.research.probes import load_probe, probe_scorer, probe_value, save_probe, train_probe
from inspect_tl_vllm.specs import TAG, SpecError
from inspect_tl_vllm.store.disk import UnsafePathError, write_sample


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


def test_probe_scorer_refuses_a_file_name_leading_out_of_the_folder(tmp_path):
    """The output metadata names a valid file (right checksum) outside its folder: only the name check stops it."""
    hook = "blocks.0.hook_resid_post"
    probe = tmp_path / "probe.safetensors"
    save_probe(probe, torch.ones(4), torch.zeros(()), hook)
    folder = tmp_path / "logs" / "x.activations"
    folder.mkdir(parents=True)
    entry = write_sample(
        tmp_path,
        eval_id="E",
        sample_id="s",
        epoch=1,
        sample_uuid="u",
        activations={hook: torch.ones(2, 4)},
        tokens={hook: 2},
    )
    output = ModelOutput.from_content("tl-vllm/tiny", "answer")
    # dir, file and sha256, as the provider records them; the file lies two levels above the folder
    recorded = {"dir": str(folder), "file": f"../../{entry['file']}", "sha256": entry["sha256"]}
    output.metadata = {TAG: {"activations": recorded}}
    state = TaskState(ModelName("tl-vllm/tiny"), "s", 1, "q", [], output=output)
    with pytest.raises(UnsafePathError, match=r"probe_scorer: sample 's' epoch 1 output metadata: file name '\.\./"):
        asyncio.run(probe_scorer(str(probe))(state, Target("")))
