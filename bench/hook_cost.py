"""What the hooks cost inside a CUDA graph, and whether the fused kernel equals the reference.

    python bench/hook_cost.py --width 4096 --sites 34 --rows 256 --out hook_cost.json

A chain of ``--sites`` hooked "layers" (each: the site's hook on ``(hidden, residual)``, then a
cheap stand-in for the layer) is compiled with torch.compile, captured in one CUDA graph and
replayed; the same chain without hooks is the baseline.  Two hook implementations are timed:

- ``inductor``: the hook math as torch ops that Inductor compiles (``site_op.reference``
  inlined: what ``TLVLLM_FUSED_HOOK=0`` runs),
- ``fused``: ``torch.ops.tlvllm.site_hook``, one Triton kernel per site.

The correctness part runs the kernel and the reference on the same random rows (unsteered,
added, scaled, set and ablated stages) and reports how far apart they are: unsteered rows
must be bit-identical, steered ones within float32 rounding.  Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.instrument.runtime import HookRuntime
from inspect_tl_vllm.instrument.site_op import reference

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def make_runtime(args: argparse.Namespace, dtype: torch.dtype) -> HookRuntime:
    return HookRuntime(
        site_widths=dict.fromkeys(range(args.sites), args.width),
        bank_width=args.width,
        max_tokens=max(args.rows, 8192),  # as large as vLLM's batch buffers, so a copy of them would show
        max_stack=2,
        max_vectors=8,
        device=torch.device("cuda"),
        act_dtype=dtype,
    )


def chain(runtime: HookRuntime, kind: str) -> Any:
    def run(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        for buffers in runtime.sites.values():
            if kind == "fused":
                hidden, residual = runtime.apply(buffers, hidden, residual)
            elif kind == "inductor":
                hidden, residual = reference(
                    hidden, residual, buffers.table, runtime.bank, buffers.staging, buffers.row_stats, buffers.fired
                )
            hidden = hidden * 0.5  # stands in for the layer between two sites
        return hidden + residual

    return run


def time_graph(fn: Any, hidden: torch.Tensor, residual: torch.Tensor, replays: int) -> float:
    """Microseconds per replay of ``fn`` captured in one CUDA graph."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            compiled(hidden, residual)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(hidden, residual)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / replays


def timings(args: argparse.Namespace) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    runtime = make_runtime(args, dtype)
    hidden = torch.randn(args.rows, args.width, dtype=dtype, device="cuda")
    residual = torch.randn_like(hidden)
    result = {
        kind: time_graph(chain(runtime, kind), hidden, residual, args.replays) for kind in ("none", "inductor", "fused")
    }
    per_site = {kind: (result[kind] - result["none"]) / args.sites for kind in ("inductor", "fused")}
    return {"graph_us": result, "per_site_us": per_site}


def correctness(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """Kernel against reference on the same rows; each row gets a different stage mix."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows, width = args.rows, args.width
    runtime = make_runtime(args, dtype)
    runtime.bank[1:] = torch.randn(8, width, generator=generator, device="cuda")
    table = runtime.sites[0].table
    kinds = ("none", "add", "scale", "set", "ablate", "add+ablate", "clamp", "jumprelu clamp")

    def stage(*values: float) -> torch.Tensor:  # padded to the table's width with the identity's zeros
        return torch.tensor([*values, *[0.0] * (table.shape[-1] - len(values))])

    for row in range(rows):
        kind = kinds[row % len(kinds)]
        vector = 1 + row % 8
        if kind in ("add", "add+ablate"):
            table[row, 0] = stage(vector, 1.0, 3.0, 0.0)
        if kind == "scale":
            table[row, 0] = stage(0, 2.5, 0.0, 0.0)
        if kind == "set":
            table[row, 0] = stage(vector, 0.0, 4.0, 0.0)
        if kind in ("ablate", "add+ablate"):
            unit = runtime.bank[vector] / runtime.bank[vector].norm()
            runtime.bank[vector] = unit
            table[row, 1] = stage(vector, 1.0, 0.0, 1.0)
        if kind.endswith("clamp"):  # decoder row `vector`, encoder row the next one
            threshold = 0.5 if kind.startswith("jumprelu") else 0.0
            table[row, 0] = stage(vector, 1.0, 2.0, 0.0, 1 + (vector % 8), 0.1, threshold, 1.0)
    hidden = torch.randn(rows, width, generator=generator, device="cuda").to(dtype)
    residual = torch.randn(rows, width, generator=generator, device="cuda").to(dtype)
    report: dict[str, Any] = {}
    for with_residual in (False, True):
        res = residual if with_residual else None
        outputs = []
        for fn in (torch.ops.tlvllm.site_hook, reference):
            buffers = runtime.sites[0]
            out, res_out = fn(hidden, res, table, runtime.bank, buffers.staging, buffers.row_stats, buffers.fired)
            outputs.append(
                (out.clone(), res_out.clone(), buffers.staging[:rows].clone(), buffers.row_stats[:rows].clone())
            )
        (out_k, zero_k, stage_k, delta_k), (out_r, zero_r, _, delta_r) = outputs
        plain = torch.arange(rows, device="cuda") % len(kinds) == 0
        diff = (out_k.float() - out_r.float()).abs().max(dim=-1).values / out_r.float().abs().max(
            dim=-1
        ).values.clamp_min(1e-6)
        report["residual" if with_residual else "no_residual"] = {
            "unsteered_rows_identical": bool(torch.equal(out_k[plain], out_r[plain])),
            "steered_max_rel_error": float(diff[~plain].max()),
            "staging_equals_out": bool(torch.equal(stage_k, out_k)),
            "residual_out_is_zeros": bool(zero_k.shape == zero_r.shape and not zero_k.any()),
            "row_stats_max_abs_error": float((delta_k - delta_r).abs().max()),
        }
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--sites", type=int, default=34)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("hook_cost needs a CUDA GPU", file=sys.stderr)
        return 2
    summary: dict[str, Any] = {"args": vars(args), "device": torch.cuda.get_device_name()}
    summary["correctness"] = {name: correctness(args, dtype) for name, dtype in DTYPES.items()}
    summary.update(timings(args))
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    checks = [c for by_dtype in summary["correctness"].values() for c in by_dtype.values()]
    exact = all(
        c["unsteered_rows_identical"] and c["staging_equals_out"] and c["residual_out_is_zeros"] for c in checks
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
