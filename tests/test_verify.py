"""`tl-vllm verify` on vLLM's CPU build: a passing run of the command, a failure it reports, bad arguments."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inspect_tl_vllm import verify

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ["environment", "hooks_fire", "isolation", "steering", "fidelity"]


def command(*args: str) -> list[str]:
    """The installed console script ``tl-vllm verify``, else the CLI module."""
    script = Path(sys.executable).parent / "tl-vllm"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "inspect_tl_vllm.cli"]
    return [*head, "verify", *args]


def check_lines(output: str) -> dict[str, str]:
    """{check name: PASS or FAIL} from the command's output."""
    return {m[2]: m[1] for m in re.finditer(r"^(PASS|FAIL) (\w+): ", output, flags=re.MULTILINE)}


@pytest.mark.engine
def test_verify_passes_on_the_cpu(vllm_ready, smollm2_dir):
    done = subprocess.run(
        command("--requests", "4", "--max-tokens", "6"), cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    output = done.stdout
    assert done.returncode == 0, output + done.stderr[-3000:]
    assert check_lines(output) == dict.fromkeys(CHECKS, "PASS"), output
    assert "4 concurrent requests" in output and "eager engine" in output
    assert "model runner V1" in output and "CUDA graphs NONE" in output
    assert "4/4 concurrent requests gave their solo run's tokens" in output
    assert "6/6 greedy tokens agree" in output
    assert "verify: all 5 checks passed" in output


@pytest.fixture
def quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``verify.run`` sets in the environment, set here so that it is undone after the test."""
    quiet = {"VLLM_LOGGING_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    for name, value in quiet.items():
        monkeypatch.setenv(name, value)


@pytest.mark.engine
def test_verify_reports_a_reference_that_differs(vllm_ready, tiny_llama_dir, quiet, monkeypatch, capsys):
    """transformers' final norm scaled by 1.05: fidelity and steering fail at ln_final, naming
    it; the engine's own checks still pass; the exit code is 1."""
    load = verify.load_reference_model

    def broken(path: str, dtype: str, device: str):
        model = load(path, dtype, device)
        with torch.no_grad():
            model.get_decoder().norm.weight.mul_(1.05)
        return model

    monkeypatch.setattr(verify, "load_reference_model", broken)
    code = verify.main(["--model", str(tiny_llama_dir), "--requests", "3", "--max-tokens", "4"])
    output = capsys.readouterr().out
    assert code == 1, output
    lines = check_lines(output)
    assert lines == {**dict.fromkeys(CHECKS, "PASS"), "steering": "FAIL", "fidelity": "FAIL"}, output
    fidelity = next(line for line in output.splitlines() if line.startswith("FAIL fidelity"))
    assert "ln_final: 4.8e-02 above 0.001" in fidelity, fidelity  # 0.05 / 1.05
    assert "resid_post 1: " in fidelity  # the layers before the norm still agree, and are listed
    assert "verify: 2 of 5 checks FAILED (steering, fidelity)" in output


def test_an_engine_that_does_not_boot_fails_every_check(vllm_ready, tmp_path, quiet, monkeypatch, capsys):
    (tmp_path / "config.json").write_text("{}")

    def no_boot(self, compiled: bool):
        raise RuntimeError("no room on the device")

    monkeypatch.setattr(verify.Verifier, "boot", no_boot)
    assert verify.main(["--model", str(tmp_path)]) == 1
    output = capsys.readouterr().out
    assert "FAIL environment: vLLM " in output and "did not boot: RuntimeError: no room on the device" in output
    assert check_lines(output) == dict.fromkeys(CHECKS, "FAIL"), output
    assert "verify: 5 of 5 checks FAILED" in output


def generation(tokens: list[int], rows: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, prompt_token_ids=[1, 2, 3], activations={verify.FINAL: rows})


def test_checks_fail_on_mismatching_data():
    stuck = verify.check_hooks_fired(["a", "b"], [0, 5], [8, 5], 8, "(eager)")
    assert not stuck.ok and "1 of 2 sites" in stuck.detail and "b (+0)" in stuck.detail
    assert verify.check_hooks_fired(["a", "b"], [0, 5], [8, 13], 8, "(eager)").ok

    rows = torch.randn(6, 8)
    alone = [generation([4, 5, 6], rows), generation([4, 5, 6], rows)]
    same = [generation([4, 5, 6], rows.clone()), generation([4, 5, 6], rows.clone())]
    assert verify.check_isolation(same, alone, verify.FINAL, 1e-3, 2, strict_tokens=True).ok
    # rows after the first differing token are not compared; rows before it are
    late = rows.clone()
    late[5] += 1.0
    assert verify.check_isolation([same[0], generation([4, 9, 6], late)], alone, verify.FINAL, 1e-3, 2,
                                  strict_tokens=False).ok  # fmt: skip
    early = rows.clone()
    early[1] += 1.0
    leaked = verify.check_isolation([same[0], generation([4, 5, 6], early)], alone, verify.FINAL, 1e-3, 2,
                                    strict_tokens=True)  # fmt: skip
    assert not leaked.ok and "captured rows differ" in leaked.detail and "(request 1)" in leaked.detail
    # batched-vs-solo kernel drift as seen on an H100 (1.1e-3) passes the isolation tolerance, a leak does not
    drift = rows * (1 + 1.1e-3 * torch.sign(torch.randn(6, 8)))
    drifted = [same[0], generation([4, 5, 6], drift)]
    isolation_tolerance = verify.ISOLATION_TOLERANCE["float32"]
    assert not verify.check_isolation(drifted, alone, verify.FINAL, verify.TOLERANCE["float32"], 2,
                                      strict_tokens=True).ok  # fmt: skip
    assert verify.check_isolation(drifted, alone, verify.FINAL, isolation_tolerance, 2, strict_tokens=True).ok
    assert not verify.check_isolation([same[0], generation([4, 5, 6], early)], alone, verify.FINAL,
                                      isolation_tolerance, 2, strict_tokens=True).ok  # fmt: skip
    alone_only = verify.check_isolation(same, alone, verify.FINAL, 1e-3, 1, strict_tokens=True)
    assert not alone_only.ok and "no step carried 2 differently steered requests" in alone_only.detail

    logits = torch.zeros(5, 10)
    logits[2, 7], logits[3, 1] = 3.0, 3.0
    assert verify.greedy_agreement([7, 1], 3, logits, 1e-3) == (2, 2)
    assert verify.greedy_agreement([7, 2], 3, logits, 1e-3) == (1, 2)
    missed = verify.check_against_reference(
        "steering", {verify.FINAL: 0.2}, (2, 2), 1e-3, strict_tokens=True, what="x", effect=1e-4
    )
    assert not missed.ok and "ln_final: 2.0e-01 above 0.001" in missed.detail and "did not act" in missed.detail


@pytest.mark.parametrize(("dtype", "on_cpu", "tolerance"), [("float32", True, 1e-3), ("float32", False, 5e-3),
                                                          ("bfloat16", False, 5e-2)])  # fmt: skip
def test_float32_on_a_gpu_compares_at_the_gpu_kernels_tolerance(dtype, on_cpu, tolerance):
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    args = parser.parse_args(["--dtype", dtype])
    checker = verify.Verifier(args, "unused", on_cpu=on_cpu)
    assert checker.tolerance == tolerance and checker.isolation_tolerance == verify.ISOLATION_TOLERANCE[dtype]


def test_environment_check_names_what_is_wrong():
    facts = dict(release="0.20.2", unsupported=None, platform="CPU", runner="V1", compilation="NONE",
                 cudagraphs="NONE", async_scheduling=False, want_compiled=False, on_cpu=True)  # fmt: skip
    assert verify.check_environment(**facts).ok
    old = verify.check_environment(**{**facts, "release": "0.9.0", "unsupported": "vLLM 0.9.0 is not supported"})
    assert not old.ok and old.detail.startswith("vLLM 0.9.0 is not supported")
    gpu = {**facts, "platform": "CUDA (H100)", "on_cpu": False, "want_compiled": True, "compilation": "VLLM_COMPILE"}
    assert not verify.check_environment(**gpu).ok  # CUDA graphs off
    assert verify.check_environment(**{**gpu, "cudagraphs": "FULL_AND_PIECEWISE"}).ok


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--requests", "0"], "argument --requests: 0 is out of range; give 2 to 1024 requests"),
        (["--requests", "100000"], "argument --requests: 100000 is out of range; give 2 to 1024 requests"),
        (["--max-tokens", "1"], "argument --max-tokens: 1 is out of range; give 2 to 256 tokens"),
        (["--eager", "--compiled"], "not allowed with argument"),
        (["--model", "no-such-model-xyz"], "verify: unknown model 'no-such-model-xyz'"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(args, message):
    module = args[:2] == ["--requests", "100000"]  # one through `python -m inspect_tl_vllm.verify`
    cmd = [sys.executable, "-m", "inspect_tl_vllm.verify", *args] if module else command(*args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
    assert "PASS" not in done.stdout and "booting" not in done.stdout
