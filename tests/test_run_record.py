"""An eval log says which steering produced its scores, after its vector file changed: the run
record in the log's metadata (vector hash and norm, file digests) and each call's spec hash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.log import read_eval_log
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import generate
from safetensors.torch import save_file

from conftest import PROVIDER_ARGS, environment

pytestmark = pytest.mark.engine
HOOK = "blocks.1.hook_resid_post"


def test_the_log_tells_two_runs_apart_after_the_vector_file_changed(vllm_ready, tiny_llama_dir, tmp_path, capsys):
    from inspect_tl_vllm.store.activations import main as activations_main

    vector_file = tmp_path / "v.safetensors"
    spec = tmp_path / "steer.yaml"
    spec.write_text(f"interventions:\n  - hook: {HOOK}\n    vector: v.safetensors\n    coef: 2\n")
    task = Task(
        dataset=[Sample(id="a", input="Hello"), Sample(id="b", input="Name a colour.")],
        solver=generate(),
        config=GenerateConfig(max_tokens=3, temperature=0.0),
    )
    args = {**PROVIDER_ARGS, "steer": str(spec), "capture": HOOK}
    logs = []
    for seed in (1, 2):  # the same path, other contents
        vector = torch.randn(64, generator=torch.Generator().manual_seed(seed))
        save_file({"vector": vector}, str(vector_file))
        with environment(TORCH_COMPILE_DISABLE="1"):
            log = eval(
                task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path / "logs"), display="none"
            )[0]
        assert log.status == "success", log.error
        logs.append((read_eval_log(log.location), float(vector.norm())))

    records = [log.metadata["tlvllm"] for log, _ in logs]
    for (log, norm), record in zip(logs, records, strict=True):
        assert log.eval.model_args["steer"] == str(spec)  # the path alone cannot tell them apart
        [steering] = record["steering"]
        described = (steering["hook"], steering["op"], steering["coef"], steering["vector"])
        assert described == (HOOK, "add", 2, str(vector_file))  # resolved against the spec file's folder
        assert steering["vector_norm"] == pytest.approx(norm, rel=1e-6)
        assert record["capture"]["hooks"] == [HOOK] and record["model_path"] == str(tiny_llama_dir)
        assert log.log_updates[-1].provenance.author == "tl-vllm"
        assert [sample.id for sample in log.samples] == ["a", "b"]  # the samples outlive the record's edit
        for sample in log.samples:
            meta = sample.output.metadata["tlvllm"]
            assert meta["applied"]["interventions"][0]["vector"] == steering["vector_hash"]
            assert len(meta["spec_sha256"]) == 64
    assert records[0]["steering"][0]["vector_hash"] != records[1]["steering"][0]["vector_hash"]
    assert records[0]["files"] != records[1]["files"] and records[0]["fingerprint"] != records[1]["fingerprint"]
    hashes = [{s.output.metadata["tlvllm"]["spec_sha256"] for s in log.samples} for log, _ in logs]
    assert len(hashes[0]) == len(hashes[1]) == 1 and hashes[0] != hashes[1]

    capsys.readouterr()
    assert activations_main([logs[0][0].location]) == 0
    out = capsys.readouterr().out
    vector_hash = records[0]["steering"][0]["vector_hash"]
    assert f"run: steering {HOOK} add coef 2 positions all vector {vector_file} ({vector_hash}" in out
    assert "run: capture " in out

    # the bench that times this edit (whole log against header only) runs on a log like these
    bench = Path(__file__).parents[1] / "bench" / "log_rewrite_cost.py"
    done = subprocess.run(
        [sys.executable, str(bench), logs[0][0].location, "--samples", "5"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    timed = json.loads(done.stdout.strip().splitlines()[-1])
    assert timed["samples"] == 5 and timed["whole_log_s"] > 0 and timed["header_only_s"] > 0
