"""`tl-vllm extract-vector`: contrastive pairs -> mean-difference vectors, via the engine."""

from __future__ import annotations

import json

import pytest
import torch

from inspect_tl_vllm.research.extract import read_pairs
from inspect_tl_vllm.specs import SpecError

PAIRS = [
    {"positive": "I love the sea and its waves.", "negative": "I like the table and the chair."},
    {
        "positive": [{"role": "user", "content": "Talk about the ocean."}],
        "negative": [{"role": "user", "content": "Talk about a pencil."}],
    },
]
HOOKS = ["blocks.1.hook_resid_post", "blocks.2.hook_resid_post"]


@pytest.mark.engine
def test_extract_vector_command_matches_engine_captures(tiny_engine, tiny_llama_dir, tmp_path, capsys):
    from safetensors import safe_open

    from conftest import environment
    from inspect_tl_vllm.cli import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    out = tmp_path / "vec.safetensors"
    args = ["extract-vector", str(pairs), "--model", str(tiny_llama_dir), "--out", str(out), "--dtype", "float32"]
    with environment(TORCH_COMPILE_DISABLE="1"):
        assert main([*args, "--hook", HOOKS[0], "--hook", HOOKS[1]]) == 0
    assert "saved 2 vectors" in capsys.readouterr().out
    with safe_open(str(out), "pt") as handle:
        meta = handle.metadata()
        saved = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    assert meta["count"] == "2" and json.loads(meta["hooks"])[HOOKS[0]]["layer"] == 1
    prompts = [side for pair in PAIRS for side in (pair["positive"], pair["negative"])]
    rows = tiny_engine.generate(prompts, capture={"hooks": HOOKS}, max_tokens=1)
    for hook in HOOKS:
        means = torch.stack([r.activations[hook].mean(0) for r in rows])
        expected = (means[0::2] - means[1::2]).mean(0)
        assert saved[hook].shape == (64,)
        assert float((saved[hook] - expected).norm() / expected.norm()) < 1e-4
    with safe_open(str(tmp_path / "vec.rows.safetensors"), "pt") as handle:  # for the stronger controls
        kept = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    for hook in HOOKS:
        assert kept[hook].shape == (2 * len(PAIRS), 64)
        torch.testing.assert_close((kept[hook][0::2] - kept[hook][1::2]).mean(0), saved[hook], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "no pairs"),
        ("{not json\n", ":1: not valid JSON"),
        ('{"positive": "a"}\n', "needs 'positive' and"),
        ('{"positive": "", "negative": "b"}\n', "'positive' must be a non-empty"),
    ],
)
def test_bad_pair_files_name_the_line(tmp_path, content, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    with pytest.raises(SpecError, match=message):
        read_pairs(path)
