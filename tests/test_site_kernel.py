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
    # width not a power of two: the masked tail is exercised; the bank is wider than this site
    # (a wider site elsewhere in the model), so the site reads the first ``width`` numbers of a row
    rows, width, stack = 13, 72, 2
    bank = torch.zeros(6, 80)
    bank[1:5] = torch.randn(4, 80)
    bank[3] /= bank[3, :width].norm()
    bank[4] /= 4  # an encoder column: feature activations of a few units
    bank[5, 8:24] = 1.0  # the columns of two heads (a 0/1 mask row)
    bank[5, 48:56] = 1.0
    table = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]).repeat(16, stack, 1)

    def stage(*values):
        return torch.tensor([*values, *[0.0] * (9 - len(values))])

    table[1, 0] = stage(1, 1.0, 3.0, 0.0)   # add
    table[2, 0] = stage(0, 2.5, 0.0, 0.0)   # scale
    table[3, 0] = stage(2, 0.0, 4.0, 0.0)   # set
    table[4, 1] = stage(3, 1.0, 0.0, 1.0)   # ablate
    table[5, 0] = stage(1, 1.0, 2.0, 0.0)   # add, then ablate
    table[5, 1] = stage(3, 1.0, 0.0, 1.0)
    table[9, 1] = stage(1, 1.0, 1.5, 0.0, 4, 0.25, 0.0, 1.0)   # clamp feature (W_dec 1, W_enc 4) to 1.5
    table[10, 0] = stage(4, 1.0, 0.5, 0.0, 4, 3.0, 0.3, 0.0)  # add a feature, JumpReLU threshold 0.3
    table[11, 0] = stage(0, 0.0, 0.0, 0.0, 0, 0.0, 0.0, 0.0, 5)  # scale 0 in the masked heads (zero-ablate)
    table[12, 1] = stage(2, 0.0, 2.0, 0.0, 0, 0.0, 0.0, 0.0, 5)  # set the masked heads to 2 * bank[2]
    unsteered = [0, 6, 7, 8]

    def act(pre, threshold):
        return pre if pre > threshold else 0.0

    def by_hand(x):  # the table's stages written out, in float32: a reference independent of both
        bank = full_bank[:, :width]
        heads = bank[5] != 0
        u = bank[3]
        y = x.clone()
        stats = torch.zeros(16, 3)
        y[1] = x[1] + 3.0 * bank[1]
        y[2] = 2.5 * x[2]
        y[3] = 4.0 * bank[2]
        y[4] = x[4] - (x[4] @ u) * u
        y[5] = x[5] + 2.0 * bank[1]
        y[5] = y[5] - (y[5] @ u) * u
        f = act(float(x[9] @ bank[4]) + 0.25, 0.0)
        y[9] = x[9] + (1.5 - f) * bank[1]
        stats[9, 1:] = torch.tensor([f, act(float(y[9] @ bank[4]) + 0.25, 0.0)])
        y[10] = x[10] + 0.5 * bank[4]
        stats[10, 1:] = torch.tensor([act(float(x[10] @ bank[4]) + 3.0, 0.3), act(float(y[10] @ bank[4]) + 3.0, 0.3)])
        y[11] = torch.where(heads, 0.0, x[11])
        y[12] = torch.where(heads, 2.0 * bank[2], x[12])
        return y, stats

    full_bank = bank

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
                delta, fired = torch.zeros(16, 3), torch.zeros(1, dtype=torch.int64)
                out, res_out = fn(hidden, res, table, bank, staging, delta, fired)
                results.append((out, res_out, staging, delta, fired))
            (out, res_out, staging, delta, fired), (ref, ref_res, _, ref_delta, _) = results
            x = hidden.float() if res is None else (hidden.float() + res.float()).to(hidden.dtype).float()
            want, want_stats = by_hand(x)
            report[f"{dtype}-{'residual' if res is not None else 'plain'}"] = {
                "unsteered_identical": torch.equal(out[unsteered], ref[unsteered]),
                "unsteered_are_input": torch.equal(out[unsteered].float(), x[unsteered]),
                "kernel_by_hand_error": rel(out, want),
                "reference_by_hand_error": rel(ref, want),
                "max_rel_error": ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item(),
                "staging_is_out": torch.equal(staging[:rows], out),
                "staging_beyond_untouched": bool((staging[rows:] == 7.0).all()),
                "residual_out": list(res_out.shape) == list(ref_res.shape) and not res_out.any().item(),
                "norm_delta_error": (delta[:, 0] - ref_delta[:, 0]).abs().max().item(),
                "feature_error": (delta[:, 1:] - ref_delta[:, 1:]).abs().max().item(),
                "feature_by_hand_error": (ref_delta[:, 1:] - want_stats[:, 1:]).abs().max().item(),
                "features_seen": [ref_delta[9, 1:].tolist(), ref_delta[10, 1:].tolist()],
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
    """Both against the ops written out by hand (add, scale, set, ablate, add then ablate, an SAE
    feature clamped and one added, with the feature's activation before and after), so that a
    mistake the kernel shares with ``reference`` cannot pass."""
    result = report[case]
    tolerance = 1e-5 if case.startswith("float32") else 1e-2  # bfloat16: one unit in the last place
    assert result["kernel_by_hand_error"] < tolerance
    assert result["reference_by_hand_error"] < tolerance
    if case.startswith("float32"):
        assert result["feature_by_hand_error"] < 1e-4
        (clamped_before, clamped_after), (added_before, added_after) = result["features_seen"]
        assert clamped_before != clamped_after and added_before != added_after, "the test must move both features"
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
    assert result["feature_error"] < (1e-4 if float32 else 0.05)
    assert result["fired"] == 1
