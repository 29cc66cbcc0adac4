"""Markdown tables for docs/BENCHMARKS.md from the JSON files that ``bench/gpu_run.sh`` writes.

    python bench/tables.py OUTDIR

Prints one section per file found: hook cost, step-router cost, GPU correctness, throughput
(8B shape and SmolLM2, with the engines' KV-cache blocks and buffer memory) and end to end.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGETS = {"plain": 0.99, "steer": 0.97, "capture": 0.95, "capture_all": 0.80}


def hook_cost(data: dict[str, Any]) -> list[str]:
    args = data["args"]
    lines = [
        f"Hook cost inside one CUDA graph: {args['sites']} sites, {args['rows']} rows, width {args['width']}, "
        f"{args['dtype']} ({data['device']})",
        "",
        "| hooks | graph replay (µs) | per site (µs) |",
        "|---|---|---|",
    ]
    for kind in ("none", "inductor", "fused"):
        per_site = data["per_site_us"].get(kind)
        lines.append(f"| {kind} | {data['graph_us'][kind]:.1f} | {'—' if per_site is None else f'{per_site:.2f}'} |")
    lines += [
        "",
        "| fused vs reference | unsteered identical | steered max rel. error | staging = out |",
        "|---|---|---|---|",
    ]
    for dtype, cases in data["correctness"].items():
        for case, c in cases.items():
            lines.append(
                f"| {dtype}, {case} | {c['unsteered_rows_identical']} | {c['steered_max_rel_error']:.2e} "
                f"| {c['staging_equals_out']} |"
            )
    return lines


def router_cost(data: dict[str, Any]) -> list[str]:
    return [
        f"Step router host time per decode step: {data['requests']} requests, {data['sites']} sites, "
        f"width {data['width']} ({data['device']})",
        "",
        "| time per step | nothing requested | each request steered | each request capturing, mean |",
        "|---|---|---|---|",
        *(
            f"| {label} | {data[f'plain{key}']} ms | {data[f'steer{key}']} ms | {data[f'capture_mean{key}']} ms |"
            for label, key in (("wall", "_ms_per_step"), ("thread CPU", "_cpu_ms_per_step"))
            if f"plain{key}" in data  # a file without thread CPU times gets the wall-time row only
        ),
    ]


def _gpu_power(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per variant, medians over its runs of the GPU's SM clock and power (``gpu_power.py``)."""

    def row(variant: str, gpu: list[dict[str, Any]]) -> str:
        clock = _median(g["sm_clock_mhz_median"] for g in gpu)
        lowest = min(g["sm_clock_mhz_min"] for g in gpu)
        power = _median(g["power_w_median"] for g in gpu)
        capped = _median(g["power_capped_share"] for g in gpu)
        return f"| {variant} | {clock:,.0f} / {lowest:,} | {power:.0f} | {capped:.0%} |"

    header = "| variant | SM clock MHz (median / lowest) | power W | share of samples power-capped |"
    return _per_variant_table(runs, "gpu", header, row)


def _pinning(pinning: dict[str, Any] | None) -> str:
    """How the engines' processes were placed on the host's CPUs (``cpu_pinning.py``)."""
    if pinning is None:
        return "CPUs not pinned"
    if not pinning.get("pinned"):
        return f"CPUs not pinned ({pinning.get('why')})"
    layout = pinning["layout"]
    engines = "; ".join(
        f"{name} front end {roles['front_end']}, engine core {roles['engine_core']}"
        for name, roles in layout.items()
        if name != "rest"
    )
    return f"CPUs pinned: {engines}; the rest {layout['rest']}"


def gpu_check(data: dict[str, Any]) -> list[str]:
    skip = {"steered_text", "device"}
    lines = [f"GPU check ({data.get('dtype')}, {data.get('device')})", "", "| check | result |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in data.items() if key not in skip]
    return lines


def throughput(data: dict[str, Any]) -> list[str]:
    runs = data.get("runs", {})
    lines = [
        f"Throughput, {data['model']}: {data['prompts']} prompts x {data['new_tokens']} new tokens, "
        f"{data['rounds_done']} rounds, detokenize={data.get('detokenize', True)}, "
        f"weights={data.get('weights', 'as-loaded')}, {_pinning(data.get('cpu_pinning'))}",
        "",
        "| variant | median tok/s | min–max | ratio to vanilla | target | median s | worker host: route / harvest s "
        "| worker steps (repeated) | prepare / generate / fetch s | distinct ids / unknown to tokenizer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["table"]:
        variant = row["variant"]
        seconds = sorted(r["seconds"] for r in runs.get(variant, []))
        host = [r.get("worker_host_s") for r in runs.get(variant, []) if r.get("worker_host_s")]
        host_text = "—"
        if host:
            host_text = f"{_median(h['route'] for h in host):.2f} / {_median(h['harvest'] for h in host):.2f}"
            if all("route_cpu" in h for h in host):  # the thread's CPU time within them, where recorded
                host_text += f" (CPU {_median(h['route_cpu'] for h in host):.2f} / "
                host_text += f"{_median(h['harvest_cpu'] for h in host):.2f})"
        steps = [r for r in runs.get(variant, []) if "worker_steps" in r]
        steps_text = "—"
        if steps:  # and how many reused the last step's routing, where recorded
            steps_text = f"{_median(r['worker_steps'] for r in steps):.0f}"
            if all("worker_step_kinds" in r for r in steps):
                steps_text += f" ({_median(r['worker_step_kinds']['repeated'] for r in steps):.0f})"
        phases = [r["phases_s"] for r in runs.get(variant, []) if r.get("phases_s")]
        phase_text = "—"
        if phases:
            phase_text = " / ".join(
                f"{_median(p[k] for p in phases):.2f}" for k in ("prepare_s", "generate_s", "fetch_s")
            )
        tokens = [r for r in runs.get(variant, []) if "unknown_token_share" in r]
        token_text = "—"
        if tokens:
            token_text = f"{tokens[-1]['distinct_tokens']} / {_median(r['unknown_token_share'] for r in tokens):.0%}"
        target = TARGETS.get(variant)
        lines.append(
            f"| {variant} | {row['median_tok_s']:,.0f} | {row['min_tok_s']:,.0f}–{row['max_tok_s']:,.0f} "
            f"| {row['ratio_to_vanilla']} | {'—' if target is None else f'≥ {target}'} "
            f"| {seconds[len(seconds) // 2]:.2f} | {host_text} | {steps_text} | {phase_text} | {token_text} |"
        )
    lines += [
        "",
        "| engine | boot s | KV-cache blocks | hook buffers (GB) | sites | modes |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("vanilla", "instrumented"):
        info = data.get(f"{kind}_engine")
        if info:
            buffers = info.get("buffer_bytes")
            lines.append(
                f"| {kind} | {info['boot_s']} | {info['kv_cache_blocks']:,} "
                f"| {'—' if buffers is None else f'{buffers / 1e9:.2f}'} | {info.get('sites', '—')} "
                f"| {info['compilation_mode']}, {info['cudagraph_mode']}, async={info['async_scheduling']} |"
            )
    lines += _pinned_host(runs)
    lines += _host_cpu(runs)
    lines += _gpu_power(runs)
    if data.get("errors"):
        lines += ["", f"Errors: {data['errors']}"]
    return lines


def _pinned_host(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per run of each instrumented variant: pinned host blocks made, the time spent making
    them, and the pinned memory held after it (nothing for files without these counters)."""

    def row(variant: str, pinned: list[dict[str, Any]]) -> str:
        made = ", ".join(str(p["blocks_made"]) for p in pinned)
        seconds = ", ".join(f"{p['alloc_s']:.3f}" for p in pinned)
        return f"| {variant} | {made} | {seconds} | {pinned[-1]['gb_held']} |"

    header = "| variant | pinned blocks made, per run | time making them s | pinned GB held after |"
    return _per_variant_table(runs, "pinned_host", header, row)


def _host_cpu(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per variant: tok/s of each run in order, and medians of the host CPU seconds used by
    the busiest engine-core process (all threads, kernel time, its busiest thread) and by
    the busiest other Python process, the engine's front end (``proc_stats.py``)."""

    def row(variant: str, procs: list[dict[str, Any]]) -> str:
        cores = [next((p for p in run["top"] if "EngineCore" in p["name"]), None) for run in procs]
        fronts = [next((p for p in run["top"] if p["name"].startswith("python")), None) for run in procs]
        core = [c for c in cores if c]
        front = [f["cpu_s"] for f in fronts if f]
        speeds = ", ".join(f"{r['tok_s']:,.0f}" for r in runs[variant])
        core_text = " / ".join(
            f"{_median(value):.2f}"
            for value in (
                [c["cpu_s"] for c in core],
                [c["sys_s"] for c in core],
                [c["busiest_threads"][0]["cpu_s"] for c in core],
            )
        )
        return (
            f"| {variant} | {speeds} | {core_text} | {_median(front):.2f} "
            f"| {_median(p['busy_cores'] for p in procs):.1f} |"
        )

    header = (
        "| variant | tok/s per run, in order | engine core CPU s: all / kernel / busiest thread | front end CPU s "
        "| busy cores |"
    )
    return _per_variant_table(runs, "procs", header, row)


def _per_variant_table(
    runs: dict[str, list[dict[str, Any]]], key: str, header: str, row: Callable[[str, list[Any]], str]
) -> list[str]:
    """A table of one row per variant that recorded ``key`` (none at all: no table)."""
    rows = _recorded(runs, key)
    if not rows:
        return []
    separator = "|" + "---|" * (header.count("|") - 1)  # one per column
    return ["", header, separator, *(row(variant, values) for variant, values in rows)]


def _recorded(runs: dict[str, list[dict[str, Any]]], key: str) -> list[tuple[str, list[Any]]]:
    """Per variant, ``key``'s value in each of its runs that recorded it; variants without any left out."""
    rows = [(variant, [r[key] for r in rs if key in r]) for variant, rs in runs.items()]
    return [(variant, values) for variant, values in rows if values]


def _median(values: Any) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def e2e(data: dict[str, Any]) -> list[str]:
    """The variants side by side; files written before ``--ignore-eos`` lack some columns (shown as —)."""
    length = "exactly" if data.get("ignore_eos") else "up to"
    lines = [
        f"End to end, {data['model']}: {data['samples']} samples, {length} {data['max_tokens']} tokens, "
        f"warm-up={data.get('warm_up', '—')}, equal work={data.get('equal_work', '—')}",
        "",
        "| variant | wall s | to first call s | generation s | output tokens | tok/s wall | tok/s generation "
        "| accuracy | wall / vllm | first call / vllm | generation / vllm | tok/s wall / vllm "
        "| tok/s generation / vllm | completions identical to vllm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "wall_s",
        "to_first_call_s",
        "generation_s",
        "output_tokens",
        "output_tok_s_wall",
        "output_tok_s_generation",
        "accuracy",
        "wall_ratio_to_vllm",
        "to_first_call_ratio_to_vllm",
        "generation_ratio_to_vllm",
        "output_tok_s_wall_ratio_to_vllm",
        "output_tok_s_generation_ratio_to_vllm",
    )
    for r in data["results"]:
        same = r.get("identical_completions_to_vllm")
        cells = ["—" if r.get(key) is None else str(r[key]) for key in keys]
        cells.append(f"{same['identical']} / {same['total']}" if same else "—")
        lines.append(f"| {r['variant']} | {' | '.join(cells)} |")
    if data.get("rounds"):
        lines += ["", f"Medians of {data['rounds']} interleaved rounds; min–max of each:", ""]
        lines += ["| variant | wall s | to first call s | generation s | after last call s | failed rounds |"]
        lines += ["|---|---|---|---|---|---|"]
        for r in data["results"]:
            spread = r.get("spread", {})
            cells = [
                "–".join(str(v) for v in spread[key]) if key in spread else "—"
                for key in ("wall_s", "to_first_call_s", "generation_s", "after_last_call_s")
            ]
            lines.append(f"| {r['variant']} | {' | '.join(cells)} | {r.get('rounds_failed', 0)} |")
    for r in data["results"]:
        if "server_start_s" in r:
            stop = f", took {r['server_stop_s']} s to stop" if "server_stop_s" in r else ""
            lines += [
                "",
                f"{r['variant']}: the server wrote its first output {r.get('first_output_s', '—')} s after its start, "
                f"answered /health after {r['server_start_s']} s{stop}.",
            ]
        if "timeline_s" in r:
            lines += ["", f"{r['variant']}, start-up (seconds since the process started):", ""]
            lines += ["| step | s |", "|---|---|"] + [f"| {step} | {at} |" for step, at in r["timeline_s"].items()]
    return lines


RENDER = {
    "hook_cost": hook_cost,
    "router_cost": router_cost,
    "gpu_check": gpu_check,
    "throughput": throughput,
    "e2e": e2e,
}


def main() -> int:
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for path in sorted(folder.glob("*.json")):
        kind = next((k for k in RENDER if path.stem.startswith(k)), None)
        if kind is None:
            continue
        print(f"### {path.name}\n")
        print("\n".join(RENDER[kind](json.loads(path.read_text()))), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
