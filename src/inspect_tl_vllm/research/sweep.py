"""Steering sweeps: one eval per (coefficient, layer, control) point, all in one process so
every point reuses the same booted engine, then a report of score against coefficient."""

from __future__ import annotations

import json
import math
import statistics
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inspect_tl_vllm.research.controls import QUESTION_KEY, SEED_KEY, parse_seeds
from inspect_tl_vllm.research.fluency import is_fluency_score
from inspect_tl_vllm.research.stats import (
    SMALL_BOOTSTRAP_N,
    bootstrap_interval,
    control_p_value,
    dose_response,
    holm_adjusted,
    mean_interval,
)
from inspect_tl_vllm.specs import TAG, SpecError

Question = tuple[Any, int]
"""(sample id, epoch): one answer of a sweep point, the unit its paired statistics resample."""


def control_seed(layer: int, coef: float, index: int) -> int:
    """The seed of control direction ``index`` at one (layer, coefficient) point: each point
    draws its own directions, so the controls measure chance over directions, and a point's
    seeds do not depend on which other points the sweep has."""
    return zlib.crc32(f"{layer}:{coef!r}:{index}".encode())


def sweep_points(
    coefs: list[float], layers: list[int], controls: int, kind: str = "gauss", one_eval: bool = False
) -> list[dict[str, Any]]:
    """Every steered point, then ``controls`` control directions of ``kind`` (``controls.KINDS``) at
    each nonzero coefficient; a kind other than ``gauss`` is passed to the task as ``control_kind``.
    With ``one_eval`` a coefficient's directions run in one eval (task argument ``control_seeds``,
    comma-separated), each question once per direction in one continuous batch."""
    extra = {} if kind == "gauss" else {"control_kind": kind}
    points = [{"coef": c, "layer": layer} for layer in layers for c in coefs]
    for layer in layers:
        for c in coefs:
            seeds = [control_seed(layer, c, i) for i in range(controls)] if c != 0 else []
            if one_eval and seeds:
                points.append({"coef": c, "layer": layer, "control_seeds": ",".join(map(str, seeds)), **extra})
            else:
                points += [{"coef": c, "layer": layer, "control_seed": seed, **extra} for seed in seeds]
    return points


def run_sweep(
    task: str,
    points: list[dict[str, Any]],
    *,
    model: str,
    model_args: dict[str, Any],
    log_dir: str,
    limit: int | None = None,
) -> int:
    """Run every point not already done in ``log_dir``; returns how many points' evals did not
    succeed (each is reported).  A point is done when a log there succeeded with the same task
    arguments, model, model arguments and limit: running a sweep again finishes the points that
    failed or never ran, and reruns nothing else."""
    from inspect_ai import eval

    done = finished_points(log_dir, model=model, model_args=model_args)
    failed = 0
    for i, point in enumerate(points, start=1):
        label = ", ".join(f"{k}={v}" for k, v in point.items())
        point_limit = point_sample_limit(point, limit)
        if (_normal(point), point_limit) in done:
            print(f"sweep: point {i}/{len(points)}: {label}: done already (a successful log in {log_dir})", flush=True)
            continue
        print(f"sweep: point {i}/{len(points)}: {label}", flush=True)
        options = {"model": model, "model_args": model_args, "log_dir": log_dir, "display": "none"}
        logs = eval(task, task_args=point, limit=point_limit, **options)
        for log in logs:
            metrics = {
                f"{s.name}/{k}": round(m.value, 3)
                for s in (log.results.scores if log.results else [])
                for k, m in s.metrics.items()
            }
            print(f"sweep:   {log.status} {metrics}", flush=True)
            if log.status != "success":
                failed += 1
                print(f"sweep:   {log.error.message if log.error else 'no error recorded'}", flush=True)
    return failed


def point_sample_limit(point: dict[str, Any], limit: int | None) -> int | None:
    """Inspect's sample limit for one point: ``limit`` questions, times the directions of a point
    that runs many (``control_samples`` lists each question's directions together)."""
    seeds = point.get("control_seeds")
    return limit if limit is None or seeds is None else limit * len(parse_seeds(seeds))


def finished_points(log_dir: str, *, model: str, model_args: dict[str, Any]) -> list[tuple[str, Any]]:
    """(task arguments, normalised; sample limit) of the points that succeeded in ``log_dir`` under
    this model and model arguments."""
    from inspect_ai.log import list_eval_logs, read_eval_log

    if not Path(log_dir).is_dir():
        return []
    found = []
    for info in list_eval_logs(log_dir):
        header = read_eval_log(info, header_only=True)
        spec = header.eval
        if header.status == "success" and spec.model == model and _normal(spec.model_args) == _normal(model_args):
            found.append((_normal(spec.task_args_passed), spec.config.limit))
    return found


def _normal(args: dict[str, Any]) -> str:
    """Arguments as one comparable text: keys sorted, whole-number floats as floats."""
    return json.dumps({k: float(v) if k == "coef" else v for k, v in args.items()}, sort_keys=True, default=str)


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
    """One eval's scores: the steering vector at a coefficient, or one control direction.
    ``failed`` holds why its evals failed when none succeeded (its scores are then empty)."""

    coef: float
    layer: int | None
    seed: int | None  # the control direction's seed; None for the steering vector
    scores: list[float] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)  # (sample id, epoch) of each score, when known
    specs: set[str] = field(default_factory=set)  # the samples' resolved steering (spec_sha256 of each output)
    fluency: list[float] = field(default_factory=list)
    degenerate: int = 0
    failed: str | None = None

    @property
    def mean(self) -> float:
        return sum(self.scores) / len(self.scores) if self.scores else math.nan

    def by_question(self) -> dict[Question, float]:
        return dict(zip(self.questions, self.scores, strict=True))


@dataclass
class Row:
    """One (layer, coefficient) line of the report: steering against its control directions."""

    layer: int | None
    coef: float
    steering: Point | None
    controls: list[Point]
    control_kind: str = "gauss"  # controls.KINDS

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layer": self.layer, "coef": self.coef}
        if self.steering is not None and self.steering.failed:
            out["steering_failed"] = self.steering.failed
        failed = [{"seed": c.seed, "error": c.failed} for c in self.controls if c.failed]
        if failed:
            out["controls_failed"] = failed
        if self.steering is not None and self.steering.specs:
            out["spec_sha256"] = sorted(self.steering.specs)
        if self.steering is not None and self.steering.scores:
            out["n"] = len(self.steering.scores)
            out["score"] = asdict(mean_interval(self.steering.scores))
            out["degenerate"] = self.steering.degenerate
            if self.steering.fluency:
                out["fluency"] = asdict(bootstrap_interval(self.steering.fluency))
            small = [
                name
                for name, values in (("score", self.steering.scores), ("fluency", self.steering.fluency))
                if name in out
                and out[name]["method"].startswith("percentile bootstrap")
                and len(values) <= SMALL_BOOTSTRAP_N
            ]
            if small:
                out["too_few_for_bootstrap"] = small
        means = [c.mean for c in self.controls if c.scores]
        if means:
            out["controls"] = {
                "kind": self.control_kind,
                "directions": len(means),
                "seeds": [c.seed for c in self.controls if c.scores],
                "scores": means,
                "mean": statistics.fmean(means),
                "sd": statistics.stdev(means) if len(means) > 1 else math.nan,
                "min": min(means),
                "max": max(means),
                "degenerate": sum(c.degenerate for c in self.controls),
                "samples": sum(len(c.scores) for c in self.controls),
            }
            fluency = [f for c in self.controls for f in c.fluency]
            if fluency:
                out["controls"]["fluency"] = statistics.fmean(fluency)
            if "score" in out:
                out["p_value"] = control_p_value(out["score"]["estimate"], means)
            differences = self.paired_differences()
            if differences:
                out["effect"] = {**asdict(bootstrap_interval(differences)), "questions": len(differences)}
                if len(differences) <= SMALL_BOOTSTRAP_N:
                    out.setdefault("too_few_for_bootstrap", []).append("effect")
        return out

    def paired_differences(self) -> list[float]:
        """Per question: the steered score less the mean score of the control directions that
        answered it (questions no control answered are left out)."""
        if self.steering is None or not self.steering.questions:
            return []
        controls = [c.by_question() for c in self.controls if c.questions]
        differences = []
        for question, score in self.steering.by_question().items():
            answered = [c[question] for c in controls if question in c]
            if answered:
                differences.append(score - statistics.fmean(answered))
        return differences


PointKey = tuple[float, int | None, int | None]
"""(coefficient, layer, control seed or None) of one sweep point."""


def collect(log_dir: str) -> list[Row]:
    """Scores per (layer, coefficient) from the logs in ``log_dir``: the steering vector's, and one
    entry per control direction.  A point that ran more than once counts each (sample, epoch) once,
    from its newest successful log; a point none of whose logs succeeded is kept as failed."""
    from inspect_ai.log import list_eval_logs, read_eval_log

    logs = [read_eval_log(info) for info in list_eval_logs(log_dir)]
    logs.sort(key=lambda log: log.eval.created)  # oldest first: a newer log's sample replaces an older's
    answers: dict[PointKey, dict[Question, tuple[float, list[float], bool, str | None]]] = {}
    failures: dict[PointKey, str] = {}
    kinds = {
        (log.eval.task_args or {}).get("control_kind") or "gauss"
        for log in logs
        if any((log.eval.task_args or {}).get(name) is not None for name in ("control_seed", "control_seeds"))
    }
    if len(kinds) > 1:
        raise SpecError(
            f"{log_dir} holds controls of {len(kinds)} kinds ({', '.join(sorted(kinds))}): one report compares the "
            "steering vector with one kind; give each kind's sweep its own --log-dir"
        )
    for log in logs:
        args = log.eval.task_args or {}
        coef, layer = float(args.get("coef", 0.0)), args.get("layer")
        batched = args.get("control_seeds")
        seeds = parse_seeds(batched) if batched is not None else [args.get("control_seed")]
        if log.status != "success":
            why = f"{log.status}: {log.error.message if log.error else 'no error recorded'}"
            for seed in seeds:
                failures[(coef, layer, seed)] = why
            continue
        for seed in seeds:
            answers.setdefault((coef, layer, seed), {})
        for sample in log.samples or []:
            task_scores = {k: v for k, v in (sample.scores or {}).items() if not is_fluency_score(k)}
            if not task_scores:
                continue
            value = next(iter(task_scores.values())).value
            score = float(value) if isinstance(value, int | float) else float(value == "C")
            fluency = [float(v.value) for k, v in sample.scores.items() if is_fluency_score(k)]
            spec = ((sample.output.metadata or {}).get(TAG) or {}).get("spec_sha256")
            seed, question = seeds[0], sample.id
            if batched is not None:  # one eval of many directions: the sample says which, and its question
                seed, question = (sample.metadata or {}).get(SEED_KEY), (sample.metadata or {}).get(QUESTION_KEY)
            kept = answers.setdefault((coef, layer, seed), {})
            kept[(question, sample.epoch)] = (score, fluency, is_degenerate(sample.output.completion), spec)
    points: dict[PointKey, Point] = {}
    for key in answers.keys() | failures.keys():
        point = points[key] = Point(*key)
        for question, (score, fluency, degenerate, spec) in answers.get(key, {}).items():
            point.scores.append(score)
            point.questions.append(question)
            if spec is not None:
                point.specs.add(spec)
            point.fluency += fluency
            point.degenerate += degenerate
        if key not in answers:
            point.failed = failures[key]
    rows: dict[tuple[int | None, float], Row] = {}
    kind = next(iter(kinds), "gauss")
    for (coef, layer, seed), point in sorted(points.items(), key=lambda kv: (kv[0][1] or 0, kv[0][0], kv[0][2] or 0)):
        row = rows.setdefault((layer, coef), Row(layer, coef, None, [], kind))
        if seed is None:
            row.steering = point
        else:
            row.controls.append(point)
    return list(rows.values())


METHOD = (
    "Intervals are 95%: Wilson score intervals for 0/1 scores, percentile bootstrap (10,000 resamples, seed "
    "0) of the mean otherwise. Controls are directions with the vector's norm, drawn independently at each "
    "coefficient (an eval each, or all of a coefficient's in one eval; seeds and kind in report.json): "
    "uniformly at random (gauss), from the "
    "covariance of the activations the vector was extracted from (covariance), or the vector extracted again "
    "from its pairs with their labels flipped at random (relabel); the "
    "control columns give the spread of their mean scores over directions, and p is the one-sided Monte Carlo"
    " p-value (1 + #directions scoring >= steering) / (directions + 1), whose smallest value is 1 / "
    "(directions + 1). Fluency is the unsteered model's mean log-probability per answer token (the fluency() "
    "scorer); degenerate counts repetitive answers. A point that ran more than once counts each (sample, "
    "epoch) once, from its newest successful log; points whose evals all failed are listed and left out (the "
    "control count and p-value use the directions that ran). The last column adjusts p over every tested "
    "(layer, coefficient) row by Holm's step-down method, which bounds the chance of any false positive "
    "among them. Steering − controls is the mean over questions of the steered score less the control "
    "directions' mean score on the same question, with a paired percentile bootstrap over questions "
    "(10,000 resamples, seed 0). The dose-response test is the sweep's one pre-specified test per layer: "
    "the least-squares slope of score on coefficient over the questions answered at every coefficient, "
    "one-sided, against 9,999 permutations of each question's scores across the coefficients (seed 0). "
    "report.json names the steering each row's answers ran with: the sha256 of each call's resolved spec "
    "(vector hashes and norms, coefficient, positions), as its output's metadata records it."
)


def report(log_dir: str) -> tuple[str, Path]:
    """Markdown table and PNG plot of score (and fluency) against coefficient; returns (table, png)."""
    rows = collect(log_dir)
    if not rows:
        raise FileNotFoundError(f"no successful eval logs in {log_dir}")
    summaries = [row.summary() for row in rows]
    tested = [s for s in summaries if "p_value" in s]
    for s, adjusted in zip(tested, holm_adjusted([s["p_value"] for s in tested]), strict=True):
        s["p_holm"] = adjusted
    lines = [
        "| layer | coef | n | steering score [95% CI] | fluency [95% CI] | degenerate | "
        f"controls ({rows[0].control_kind}): directions, mean score (min–max) | control fluency | "
        "steering − controls, paired [95% CI] | "
        f"p | p, Holm over {len(tested)} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        score = _interval(s.get("score"))
        fluency = _interval(s.get("fluency"))
        degenerate = f"{s['degenerate']}/{s['n']}" if "n" in s else "—"
        controls = s.get("controls")
        failed = f" (+{len(s['controls_failed'])} failed)" if "controls_failed" in s else ""
        if controls:
            low, high = controls["min"], controls["max"]
            spread = f"{controls['directions']}{failed}, {controls['mean']:.3f} ({low:.3f}–{high:.3f})"
            control_fluency = f"{controls['fluency']:.2f}" if "fluency" in controls else "—"
        else:
            spread, control_fluency = f"—{failed}", "—"
        if "steering_failed" in s:
            score = "failed"
        p = f"{s['p_value']:.3f}" if "p_value" in s else "—"
        holm = f"{s['p_holm']:.3f}" if "p_holm" in s else "—"
        lines.append(
            f"| {s['layer']} | {s['coef']:g} | {s.get('n', '—')} | {score} | {fluency} | {degenerate} | "
            f"{spread} | {control_fluency} | {_interval(s.get('effect'))} | {p} | {holm} |"
        )
    failed = [
        f"- layer {s['layer']}, coef {s['coef']:g}, {what}: {error}"
        for s in summaries
        for what, error in [("steering vector", s.get("steering_failed"))]
        + [(f"control seed {c['seed']}", c["error"]) for c in s.get("controls_failed", [])]
        if error
    ]
    doses = dose_responses(rows)
    if doses:
        lines += ["", "Dose-response (the pre-specified test: does the score rise with the coefficient?):"]
        lines += [
            f"- layer {d['layer']}: slope {d['slope']:.4f} per unit of coefficient over {d['questions']} questions "
            f"answered at every coefficient ({', '.join(f'{c:g}' for c in d['coefs'])}), p = {d['p_value']:.4f}"
            for d in doses
        ]
    small = [f"layer {s['layer']}, coef {s['coef']:g}" for s in summaries if "too_few_for_bootstrap" in s]
    if small:
        lines += [
            "",
            f"Bootstrap intervals of {SMALL_BOOTSTRAP_N} or fewer values are too narrow (they cover the mean less "
            f"often than 95%); run more samples for: {'; '.join(small)}.",
        ]
    if failed:
        lines += [
            "",
            "Points whose evals all failed, left out of the rows above (rerun them with the same "
            "`tl-vllm sweep` command, or `inspect eval-retry` on their logs, then report again):",
            *failed,
        ]
    table = "\n".join(lines) + "\n\n" + METHOD
    png = Path(log_dir) / "report.png"
    _plot(summaries, png, title=f"Steering sweep: {Path(log_dir).name}")
    (Path(log_dir) / "report.md").write_text(table + "\n")
    saved = {"method": METHOD, "rows": summaries, "dose_response": doses}
    (Path(log_dir) / "report.json").write_text(json.dumps(saved, indent=1))
    return table, png


def dose_responses(rows: list[Row]) -> list[dict[str, Any]]:
    """The dose-response test of each layer whose steering vector ran at two coefficients or more
    (coefficient 0, the unsteered model, included)."""
    by_layer: dict[int | None, dict[Question, dict[float, float]]] = {}
    for row in rows:
        if row.steering is not None and row.steering.questions:
            table = by_layer.setdefault(row.layer, {})
            for question, score in row.steering.by_question().items():
                table.setdefault(question, {})[row.coef] = score
    tests = []
    for layer, table in by_layer.items():
        try:
            tests.append({"layer": layer, **asdict(dose_response(table))})
        except ValueError:  # one coefficient, or no question answered at every one
            continue
    return tests


def _interval(value: dict[str, Any] | None) -> str:
    return "—" if value is None else f"{value['estimate']:.3f} [{value['low']:.3f}, {value['high']:.3f}]"


def _plot(summaries: list[dict[str, Any]], path: Path, title: str) -> None:
    """Score (top) and fluency (bottom) against coefficient, per layer: the steering vector with
    its intervals, the control directions' mean with their min–max band."""
    from inspect_tl_vllm.extras import require

    require("matplotlib", "the sweep report's plot").use("Agg")
    plt = require("matplotlib.pyplot", "the sweep report's plot")

    has_fluency = any("fluency" in s for s in summaries)
    fig, axes = plt.subplots(2 if has_fluency else 1, 1, figsize=(7, 7 if has_fluency else 4.2), sharex=True)
    axes = list(axes) if has_fluency else [axes]
    layers = sorted({s["layer"] for s in summaries}, key=lambda x: x or 0)
    for layer in layers:
        mine = sorted((s for s in summaries if s["layer"] == layer), key=lambda s: s["coef"])
        steered = [s for s in mine if "score" in s]
        controlled = [s for s in mine if "controls" in s]
        for ax, key in zip(axes, ("score", "fluency"), strict=False):
            with_key = [s for s in steered if key in s]
            if with_key:
                est = [s[key]["estimate"] for s in with_key]
                ax.errorbar(
                    [s["coef"] for s in with_key],
                    est,
                    yerr=[
                        [max(0.0, e - s[key]["low"]) for e, s in zip(est, with_key, strict=True)],
                        [max(0.0, s[key]["high"] - e) for e, s in zip(est, with_key, strict=True)],
                    ],
                    marker="o",
                    capsize=3,
                    label=f"layer {layer}: steering vector (95% CI)",
                )
            if key == "score" and controlled:
                xs = [s["coef"] for s in controlled]
                ax.plot(xs, [s["controls"]["mean"] for s in controlled], "k--", marker="s", markersize=4,
                        label=f"layer {layer}: random directions, mean")  # fmt: skip
                ax.fill_between(xs, [s["controls"]["min"] for s in controlled],
                                [s["controls"]["max"] for s in controlled], color="grey", alpha=0.25,
                                label=f"layer {layer}: random directions, min–max")  # fmt: skip
            if key == "fluency":
                with_control = [s for s in controlled if "fluency" in s["controls"]]
                if with_control:
                    ax.plot([s["coef"] for s in with_control], [s["controls"]["fluency"] for s in with_control],
                            "k--", marker="s", markersize=4, label=f"layer {layer}: random directions")  # fmt: skip
    axes[0].set_title(title)
    axes[0].set_ylabel("task score (mean over samples)")
    if has_fluency:
        axes[1].set_ylabel("fluency: unsteered log-prob per token")
    for ax in axes:
        ax.margins(y=0.08)  # limits follow the data, error bars included, so nothing is clipped
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("steering coefficient")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
