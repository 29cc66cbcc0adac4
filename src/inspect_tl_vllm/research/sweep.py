"""Steering sweeps: one eval per (coefficient, layer, control) point, all in one process so
every point reuses the same booted engine, then a report of score against coefficient."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def sweep_points(coefs: list[float], layers: list[int], controls: int) -> list[dict[str, Any]]:
    points = [{"coef": c, "layer": layer} for layer in layers for c in coefs]
    points += [
        {"coef": c, "layer": layer, "control_seed": seed}
        for layer in layers
        for c in coefs
        if c != 0
        for seed in range(controls)
    ]
    return points


def run_sweep(
    task: str,
    points: list[dict[str, Any]],
    *,
    model: str,
    model_args: dict[str, Any],
    log_dir: str,
    limit: int | None = None,
) -> None:
    from inspect_ai import eval

    for i, point in enumerate(points, start=1):
        label = ", ".join(f"{k}={v}" for k, v in point.items())
        print(f"sweep: point {i}/{len(points)}: {label}", flush=True)
        logs = eval(
            task, task_args=point, model=model, model_args=model_args, log_dir=log_dir, display="none", limit=limit
        )
        for log in logs:
            metrics = {
                k: round(m.value, 3) for s in (log.results.scores if log.results else []) for k, m in s.metrics.items()
            }
            print(f"sweep:   {log.status} {metrics}", flush=True)


def is_degenerate(text: str) -> bool:
    """Repetitive output: it compresses far better than language does, or a repeated word,
    pair or triple of words makes up most of it."""
    if len(text) < 40:
        return False
    if len(zlib.compress(text.encode())) / len(text.encode()) < 0.3:
        return True
    words = text.lower().split()
    for n in (1, 2, 3):
        grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
        if grams:
            top = max(grams.count(g) for g in set(grams))
            if top >= 4 and top * n > len(words) / 2:
                return True
    return False


@dataclass
class Point:
    coef: float
    layer: int | None
    control: bool
    scores: list[float] = field(default_factory=list)
    degenerate: int = 0

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else math.nan

    @property
    def ci95(self) -> float:
        n = len(self.scores)
        if n < 2:
            return math.nan
        var = sum((s - self.mean) ** 2 for s in self.scores) / (n - 1)
        return 1.96 * math.sqrt(var / n)


def collect(log_dir: str) -> list[Point]:
    """Score per point from every log in ``log_dir``; control seeds of one point are pooled."""
    from inspect_ai.log import list_eval_logs, read_eval_log

    points: dict[tuple[float, int | None, bool], Point] = {}
    for info in list_eval_logs(log_dir):
        log = read_eval_log(info)
        if log.status != "success" or not log.samples:
            continue
        args = log.eval.task_args or {}
        key = (float(args.get("coef", 0.0)), args.get("layer"), args.get("control_seed") is not None)
        point = points.setdefault(key, Point(*key))
        for sample in log.samples:
            if not sample.scores:
                continue
            value = next(iter(sample.scores.values())).value
            point.scores.append(float(value) if isinstance(value, int | float) else float(value == "C"))
            point.degenerate += is_degenerate(sample.output.completion)
    return sorted(points.values(), key=lambda p: (p.control, p.layer or 0, p.coef))


def report(log_dir: str) -> tuple[str, Path]:
    """Markdown table and PNG plot of score against coefficient; returns (table, png path)."""
    points = collect(log_dir)
    if not points:
        raise FileNotFoundError(f"no successful eval logs in {log_dir}")
    lines = ["| layer | coef | vector | n | score | 95% CI | degenerate |", "|---|---|---|---|---|---|---|"]
    for p in points:
        kind = "random control" if p.control else "steering"
        lines.append(
            f"| {p.layer} | {p.coef:g} | {kind} | {len(p.scores)} | {p.mean:.3f} | ±{p.ci95:.3f} | "
            f"{p.degenerate}/{len(p.scores)} |"
        )
    table = "\n".join(lines)
    png = Path(log_dir) / "report.png"
    _plot(points, png)
    (Path(log_dir) / "report.md").write_text(table + "\n")
    (Path(log_dir) / "report.json").write_text(json.dumps([p.__dict__ for p in points], indent=1))
    return table, png


def _plot(points: list[Point], path: Path) -> None:
    from inspect_tl_vllm.extras import require

    require("matplotlib", "the sweep report's plot").use("Agg")
    plt = require("matplotlib.pyplot", "the sweep report's plot")

    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple[int | None, bool], list[Point]] = {}
    for p in points:
        series.setdefault((p.layer, p.control), []).append(p)
    zero = {p.layer: p for p in points if p.coef == 0 and not p.control}
    for (layer, control), items in sorted(series.items(), key=lambda kv: (kv[0][1], kv[0][0] or 0)):
        if control and layer in zero:  # controls share the unsteered point at coef 0
            items = [zero[layer], *items]
        items.sort(key=lambda p: p.coef)
        label = f"layer {layer} {'random control' if control else 'steering'}"
        ax.errorbar(
            [p.coef for p in items],
            [p.mean for p in items],
            yerr=[0 if math.isnan(p.ci95) else p.ci95 for p in items],
            marker="o",
            linestyle="--" if control else "-",
            capsize=3,
            label=label,
        )
        for p in items:
            if p.degenerate:
                ax.annotate(
                    f"{p.degenerate} degenerate",
                    (p.coef, p.mean),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(4, 4),
                )
    ax.set_xlabel("steering coefficient")
    ax.set_ylabel("score")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
