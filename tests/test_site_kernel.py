"""The fused Triton kernel behind ``tlvllm::site_hook`` against the torch reference.

CI has no GPU, so the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported, hence a child process).  The interpreter truncates when it
narrows float32 to bfloat16 where the GPU rounds to nearest, so bfloat16 is checked only
where no rounding happens; ``bench/hook_cost.py`` compares both dtypes on the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent(
    """
    import json, torch
    from inspect_tl_vllm.instrument.site_kernel import launch
    from inspect_tl_vllm.instrument.site_op import reference

    torch.manual_seed(0)
    rows, width, stack = 9, 72, 2  # width not a power of two: the masked tail is exercised
    bank = torch.zeros(4, width)
    bank[1:] = torch.randn(3, width)
    bank[3] /= bank[3].norm()
    table = torch.tensor([0.0, 1.0, 0.0, 0.0]).repeat(16, stack, 1)
    table[1, 0] = torch.tensor([1, 1.0, 3.0, 0.0])   # add
    table[2, 0] = torch.tensor([0, 2.5, 0.0, 0.0])   # scale
    table[3, 0] = torch.tensor([2, 0.0, 4.0, 0.0])   # set
    table[4, 1] = torch.tensor([3, 1.0, 0.0, 1.0])   # ablate
    table[5, 0] = torch.tensor([1, 1.0, 2.0, 0.0])   # add, then ablate
    table[5, 1] = torch.tensor([3, 1.0, 0.0, 1.0])
    unsteered = [0, 6, 7, 8]

    def by_hand(x):  # the table's stages written out, in float32: a reference independent of both
        u = bank[3]
        y = x.clone()
        y[1] = x[1] + 3.0 * bank[1]
        y[2] = 2.5 * x[2]
        y[3] = 4.0 * bank[2]
        y[4] = x[4] - (x[4] @ u) * u
        y[5] = x[5] + 2.0 * bank[1]
        y[5] = y[5] - (y[5] @ u) * u
        return y

    def rel(a, b):
        return ((a.float() - b).abs().max() / b.abs().max()).item()

    report = {}
    for dtype in ("float32", "bfloat16"):
        hidden = torch.randn(rows, width).to(getattr(torch, dtype))
        residual = torch.randn(rows, width).to(getattr(torch, dtype))
        for res in (None, residual):
            if dtype == "bfloat16" and res is not None:
                continue  # the sum is rounded: the interpreter rounds differently from the GPU
            results = []
            for fn in (launch, reference):
                staging = torch.full((16, width), 7.0, dtype=hidden.dtype)
                delta, fired = torch.zeros(16), torch.zeros(1, dtype=torch.int64)
                out, res_out = fn(hidden, res, table, bank, staging, delta, fired)
                results.append((out, res_out, staging, delta, fired))
            (out, res_out, staging, delta, fired), (ref, ref_res, _, ref_delta, _) = results
            x = hidden.float() if res is None else (hidden.float() + res.float()).to(hidden.dtype).float()
            want = by_hand(x)
            report[f"{dtype}-{'residual' if res is not None else 'plain'}"] = {
                "unsteered_identical": torch.equal(out[unsteered], ref[unsteered]),
                "unsteered_are_input": torch.equal(out[unsteered].float(), x[unsteered]),
                "kernel_by_hand_error": rel(out, want),
                "reference_by_hand_error": rel(ref, want),
                "max_rel_error": ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
                "staging_is_out": torch.equal(staging[:rows], out),
                "staging_beyond_untouched": bool((staging[rows:] == 7.0).all()),
                "residual_out": list(res_out.shape) == list(ref_res.shape) and not res_out.any().item(),
                "norm_delta_error": (delta - ref_delta).abs().max().item(),
                "fired": fired.item(),
            }
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CASES = ["float32-plain", "float32-residual", "bfloat16-plain"]


@pytest.mark.parametrize("case", CASES)
def test_kernel_and_reference_apply_each_op_as_written(report: dict[str, dict], case: str):
    """Both against the ops written out by hand (add, scale, set, ablate, add then ablate), so
    that a mistake the kernel shares with ``reference`` cannot pass."""
    result = report[case]
    tolerance = 1e-5 if case.startswith("float32") else 1e-2  # bfloat16: one unit in the last place
    assert result["kernel_by_hand_error"] < tolerance
    assert result["reference_by_hand_error"] < tolerance
    assert result["unsteered_are_input"], "rows with no steering must leave as they came in"


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_reference(report: dict[str, dict], case: str):
    result = report[case]
    float32 = case.startswith("float32")
    assert result["unsteered_identical"], "rows with no steering must pass through bit for bit"
    assert result["max_rel_error"] < (1e-6 if float32 else 1e-2)  # bfloat16: one unit in the last place
    assert result["staging_is_out"] and result["staging_beyond_untouched"]
    assert result["residual_out"], "the residual handed on must be zeros (or empty without a residual)"
    assert result["norm_delta_error"] < (1e-4 if float32 else 0.2)
    assert result["fired"] == 1
