"""Robustness of the provider on the real CPU engine: eval-retry after an engine death, a full
disk, 500 concurrent mixed samples, and the capture memory cap.

Every failure here is a real one (a killed engine process, a file size limit the kernel
enforces, a request over the configured cap), never a mock.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from inspect_ai import Task, eval, eval_retry
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import Generate, TaskState, generate, solver

from conftest import engine_key, engine_thread_status, provider_model_args

pytestmark = pytest.mark.engine
CAP = 65536
"""capture_bytes_per_request of this module's engine: a few short captures fit, a long one does not."""
QUESTIONS = [
    "Name a colour.",
    "Say something about cats.",
    "Count to three.",
    "What is a river?",
    "Why is the sky blue?",
    "Give me a word.",
    "Hello there.",
    "What is two plus two?",
    "Describe the sea.",
    "Tell me a fact.",
]


@pytest.fixture(scope="module")
def provider_args(vllm_ready, tiny_llama_dir):
    """Engine settings of this module; its engine is shut down at the end, freeing its memory."""
    from inspect_tl_vllm.provider import engine_pool

    with provider_model_args(capture_bytes_per_request=CAP) as args:
        yield args
    engine_pool.shutdown_engines([engine_key(tiny_llama_dir, args)])


def vector(seed: int) -> list[float]:
    torch.manual_seed(seed)
    return torch.randn(64).tolist()


def index_lines(directory: Path) -> list[dict[str, Any]]:
    """Every line of the index (``index.jsonl``, or every shard's ``.jsonl``), each of which must
    parse: a torn line fails the test."""
    indexes = [directory / "index.jsonl", *sorted(directory.glob("shards/*.jsonl"))]
    return [json.loads(line) for index in indexes if index.exists() for line in index.read_text().splitlines()]


def stored_path(directory: Path, entry: dict[str, Any]) -> Path:
    return directory / "shards" / entry["file"] if "offset" in entry else directory / entry["file"]


def assert_folder_consistent(directory: Path) -> None:
    """No temporary files left; every index line names a complete file (or blob of a shard) with
    its checksum."""
    assert not list(directory.glob(".tmp-*")), "a partial file was left behind"
    for entry in index_lines(directory):
        blob = stored_path(directory, entry).read_bytes()
        if "offset" in entry:
            blob = blob[entry["offset"] : entry["offset"] + entry["length"]]
        assert hashlib.sha256(blob).hexdigest() == entry["sha256"], entry["file"]


# -- 1. eval-retry after the engine died mid-eval ------------------------------------------------

RETRY_TASK = '''
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig, get_model
from inspect_ai.scorer import match
from inspect_ai.solver import generate, solver

QUESTIONS = ["Name a colour.", "Count to three.", "What is a river?"]


@solver
def kill_engine_once(victim: str, marker: str):
    """Kill the engine core process of this eval's model before the victim generates, once."""

    async def solve(state, generate):
        if state.sample_id == victim and not Path(marker).exists():
            Path(marker).touch()
            engine = get_model().api.engine_thread
            process = engine._instrumented.llm.engine_core.resources.engine_manager.processes[0]
            process.kill()
            process.join(timeout=30)
        return state

    return solve


@task
def retry_task(marker: str):
    capture = {"capture": {"hooks": ["blocks.2.hook_resid_post"], "reduce": "mean"}}
    samples = [Sample(id=f"s{i}", input=q, target="x", metadata={"tlvllm": capture}) for i, q in enumerate(QUESTIONS)]
    return Task(
        dataset=samples,
        solver=[kill_engine_once("s1", marker), generate()],
        scorer=match(),
        config=GenerateConfig(max_tokens=3, temperature=0.0),
    )
'''


@pytest.mark.parametrize("layout", ["files", "shards"])
def test_eval_retry_after_engine_death_keeps_one_entry_per_sample(provider_args, tiny_llama_dir, tmp_path, layout):
    """The engine dies while sample s1 is about to generate: the eval stops with s0 done. The
    retry writes a new log (new name, new eval id) and reuses s0 without running it; every
    (sample, epoch) must come back from the retried log exactly once, joined with its score.
    With shards, the first eval's shard is hard-linked whole and indexed for the reused samples."""
    from inspect_tl_vllm import activations

    model_args = {**provider_args, **({"activations_shard_mb": 1} if layout == "shards" else {})}

    task_file = tmp_path / "retry_task.py"
    task_file.write_text(RETRY_TASK)
    first = eval(
        f"{task_file}@retry_task",
        task_args={"marker": str(tmp_path / "killed")},
        model=f"tl-vllm/{tiny_llama_dir}",
        model_args=model_args,
        log_dir=str(tmp_path / "logs"),
        epochs=2,
        max_samples=1,  # one sample at a time: the samples before the victim complete
        display="none",
    )[0]
    assert first.status == "error" and "the vLLM engine died" in first.error.message
    done = {(s.id, s.epoch): s.uuid for s in first.samples if s.error is None}
    assert done, "no sample completed before the engine died: nothing to reuse"
    first_dir = Path(first.location).with_suffix(".activations")
    assert {(e["sample_id"], e["epoch"]) for e in index_lines(first_dir)} == set(done)

    started = time.perf_counter()
    retried = eval_retry(first.location, log_dir=str(tmp_path / "logs"), max_samples=1, display="none")[0]
    print(f"\neval-retry: {time.perf_counter() - started:.1f} s (fresh engine boot included)")
    assert retried.status == "success"
    assert retried.location != first.location and retried.eval.eval_id != first.eval.eval_id
    assert retried.eval.task_id == first.eval.task_id  # Inspect keeps the task id, names a new file
    expected = {(f"s{i}", epoch) for i in range(3) for epoch in (1, 2)}
    assert {(s.id, s.epoch) for s in retried.samples} == expected
    reused = {(s.id, s.epoch) for s in retried.samples if done.get((s.id, s.epoch)) == s.uuid}
    assert reused == set(done), "Inspect ran a completed sample again"

    records = activations.load(retried.location)
    assert sorted((r.sample_id, r.epoch) for r in records) == sorted(expected)
    by_key = {(s.id, s.epoch): s for s in retried.samples}
    for record in records:
        assert record.scores == {"match": by_key[record.sample_id, record.epoch].scores["match"].value}
        assert record.activations["blocks.2.hook_resid_post"].shape == (1, 64)
    retry_dir = Path(retried.location).with_suffix(".activations")
    lines = index_lines(retry_dir)
    assert len(lines) == len(expected), "the retried folder's index holds duplicates"
    assert_folder_consistent(retry_dir)
    assert_folder_consistent(first_dir)
    for line in lines:
        key = (line["sample_id"], line["epoch"])
        assert line["eval_id"] == retried.eval.eval_id
        if key in done:  # reused: linked, not generated or stored twice
            assert line["carried_from"]["eval_id"] == first.eval.eval_id
            assert stored_path(retry_dir, line).stat().st_ino == stored_path(first_dir, line).stat().st_ino
        else:
            assert "carried_from" not in line
        assert ("offset" in line) == (layout == "shards")
    generated = [(e["sample_id"], e["epoch"]) for e in index_lines(first_dir) + lines if "carried_from" not in e]
    assert sorted(generated) == sorted(expected), "every (sample, epoch) is generated exactly once"


# -- 2. disk full: a file size limit the kernel enforces ---------------------------------------------

DISK_FULL_SCRIPT = '''
"""Boot the engine, cap file sizes for this process only, run an eval that overflows, then lift
the cap (space freed) and finish it with eval-retry."""
import json, os, resource, signal, sys
os.environ["TORCH_COMPILE_DISABLE"] = "1"
from inspect_ai import Task, eval, eval_retry, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.solver import generate

CONFIG = GenerateConfig(max_tokens=3, temperature=0.0)


@task
def disk_task():
    samples = [Sample(id="small1", input="Name a colour."), Sample(id="big", input="word " * 200),
               Sample(id="small2", input="Count to three.")]
    return Task(dataset=samples, solver=generate(), config=CONFIG)


def main() -> None:
    model, log_dir, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hooks = ",".join([f"blocks.{i}.hook_{k}" for i in range(3) for k in ("resid_mid", "resid_post", "attn_out",
                                                                             "mlp_out")] + ["ln_final.hook_normalized"])
    args = {"enforce_eager": True, "dtype": "float32", "max_model_len": 256, "seed": 0, "hook_points": "all",
            "capture": hooks, "capture_reduce": "none"}
    # The engine's processes start before the limit, so only this process's writes are capped.
    eval(Task(dataset=[Sample(id="warm", input="Hi")], solver=generate(), config=CONFIG), model=model,
         model_args=args, log_dir=log_dir + "/warm", display="none", log_realtime=False)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    # No realtime sample buffer: its database would be one more file under the limit.
    log = eval(f"{__file__}@disk_task", model=model, model_args=args, log_dir=log_dir, display="none",
               fail_on_error=False, log_realtime=False)[0]
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    retried = eval_retry(log.location, log_dir=log_dir, display="none", log_realtime=False)[0]
    print("RESULT " + json.dumps({"log": log.location, "retried": retried.location}))


if __name__ == "__main__":
    main()
'''


def test_disk_full_fails_only_the_sample_that_overflows(vllm_ready, tiny_llama_dir, tiny_engine, tmp_path):
    """A 512 KiB file size limit (RLIMIT_FSIZE, enforced by the kernel) on 13 captured hook points:
    the long sample's activations (about 680 KiB) cannot be written, the short ones' (about 130
    KiB) can, and the eval log itself stays well below the limit (a limit near the log's own size
    made the log lose samples, which is not what this test is about). Once the
    limit is lifted, eval-retry reruns only the long sample and its log has all three."""
    from inspect_ai.log import read_eval_log

    from inspect_tl_vllm import activations
    from inspect_tl_vllm.store.sample_store import sample_file_name

    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL_SCRIPT)
    cmd = [sys.executable, str(script), f"tl-vllm/{tiny_llama_dir}", str(tmp_path / "logs"), str(512 * 1024)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    locations = json.loads(result.stdout.split("RESULT ", 1)[1].splitlines()[0])
    log = read_eval_log(locations["log"])
    directory = Path(log.location).with_suffix(".activations")
    errors = {s.id: s.error for s in log.samples}
    assert errors["small1"] is None and errors["small2"] is None
    message = errors["big"].message
    assert "big" in message and str(directory) in message and "File too large" in message, message
    assert not (directory / sample_file_name("big", 1)).exists()
    assert_folder_consistent(directory)
    assert sorted(e["sample_id"] for e in index_lines(directory)) == ["small1", "small2"]
    hooks = [f"blocks.{i}.hook_{k}" for i in range(3) for k in ("resid_mid", "resid_post", "attn_out", "mlp_out")]
    hooks.append("ln_final.hook_normalized")
    stored = {r.sample_id: r for r in activations.load(log)}
    for sample in log.samples:
        if sample.id == "big":
            continue
        chat = [{"role": "user", "content": sample.input}]
        alone = tiny_engine.generate([chat], specs=[{"capture": {"hooks": hooks}}], max_tokens=3)[0]
        assert sample.output.completion == alone.text
        for hook in hooks:
            assert torch.allclose(stored[sample.id].activations[hook], alone.activations[hook], rtol=1e-4, atol=1e-5)

    retried = read_eval_log(locations["retried"])
    assert retried.status == "success" and all(s.error is None for s in retried.samples)
    records = {r.sample_id: r for r in activations.load(retried)}
    assert sorted(records) == ["big", "small1", "small2"]
    assert records["big"].activations[hooks[0]].shape[0] > 200  # every row of the long prompt
    for sample_id in ("small1", "small2"):
        assert torch.equal(records[sample_id].activations[hooks[0]], stored[sample_id].activations[hooks[0]])
    assert_folder_consistent(Path(retried.location).with_suffix(".activations"))


INDEX_LIMIT_SCRIPT = """
import json, os, resource, signal, sys
from pathlib import Path
import torch
from inspect_tl_vllm.store.sample_store import INDEX, read_index, write_sample

directory, limit = Path(sys.argv[1]), int(sys.argv[2])
directory.mkdir()
first = {"eval_id": "E", "sample_id": "pad", "epoch": 1, "file": "none", "sha256": "0" * 64, "hooks": {}, "pad": ""}
first["pad"] = "x" * (limit - 40 - len(json.dumps(first, sort_keys=True)))
(directory / INDEX).write_text(json.dumps(first, sort_keys=True) + "\\n")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    write_sample(directory, eval_id="E", sample_id="s", epoch=1, sample_uuid="u",
                 activations={"h": torch.zeros(2, 4)}, tokens={"h": 2})
except OSError as err:
    print("ERROR " + str(err))
print("ENTRIES " + json.dumps([e["sample_id"] for e in read_index(directory)]))
"""


def test_index_line_is_never_left_partial_when_the_disk_fills(tmp_path):
    """The index append itself hits the limit after writing part of its line (a short write):
    the partial line must be cut off again, so the index stays readable."""
    directory = tmp_path / "acts"
    script = tmp_path / "index_limit.py"
    script.write_text(INDEX_LIMIT_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(directory), "4096"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ERROR [Errno 27] cannot write activations to {directory} (index.jsonl:" in result.stdout
    assert 'ENTRIES ["pad"]' in result.stdout
    assert (directory / "index.jsonl").read_bytes().endswith(b"\n")
    assert len(index_lines(directory)) == 1


def test_a_torn_index_line_hides_no_other_entry(tmp_path):
    """A line torn by a power loss mid-append: the reader warns and keeps every other entry."""
    from inspect_tl_vllm.store.sample_store import INDEX, read_index, write_sample

    def write(sample_id: str) -> None:
        tensors = {"h": torch.zeros(1, 4)}
        write_sample(
            tmp_path, eval_id="E", sample_id=sample_id, epoch=1, sample_uuid="u", activations=tensors, tokens={}
        )

    write("a")
    with open(tmp_path / INDEX, "ab") as handle:
        handle.write(b'{"eval_id": "E", "sample_id": "lost", "ep\n')
    write("b")
    with pytest.warns(UserWarning, match="index.jsonl:2: skipping an unreadable index entry"):
        assert sorted(e["sample_id"] for e in read_index(tmp_path)) == ["a", "b"]


# -- 3. load: 500 concurrent samples with mixed specs ------------------------------------------------

HOOK = "blocks.2.hook_resid_post"
SPECS: list[dict[str, Any] | None] = [
    None,
    {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": vector(1), "coef": 8.0}]},
    {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "scale", "coef": 3.0, "positions": "prompt"}]},
    {"capture": {"hooks": [HOOK], "reduce": "none"}},
    {
        "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": vector(2), "coef": 6.0}],
        "capture": {"hooks": [HOOK, "ln_final.hook_normalized"], "reduce": "mean"},
    },
    {
        "interventions": [{"hook": "blocks.1.hook_resid_post", "op": "ablate", "vector": vector(3)}],
        "capture": {"hooks": ["blocks.1.hook_resid_post"], "reduce": "last"},
    },
]


@solver
def generate_with_own_length():
    """Each sample's own max_tokens (2-4), so requests finish at different steps of the batch."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        return await generate(state, max_tokens=state.metadata["max_tokens"])

    return solve


def peak_rss_mib(pid: int) -> float:
    """Peak resident set size of a live process (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_500_concurrent_mixed_samples_match_their_solo_runs(provider_args, tiny_llama_dir, tiny_engine, tmp_path):
    """500 samples at once (6 specs x 10 prompts x 2-4 tokens, about 8 copies each): every
    sample's text and activations must equal its (prompt, spec) run alone."""
    import psutil

    from inspect_tl_vllm import activations
    from inspect_tl_vllm.provider import engine_pool

    samples = []
    for i in range(500):
        prompt, spec = i % len(QUESTIONS), (i // len(QUESTIONS)) % len(SPECS)
        meta: dict[str, Any] = {"prompt": prompt, "spec": spec, "max_tokens": 2 + prompt % 3}
        if SPECS[spec] is not None:
            meta["tlvllm"] = SPECS[spec]
        samples.append(Sample(id=i, input=QUESTIONS[prompt], metadata=meta))
    task = Task(dataset=samples, solver=generate_with_own_length(), config=GenerateConfig(temperature=0.0))
    started = time.perf_counter()
    log = eval(
        task,
        model=f"tl-vllm/{tiny_llama_dir}",
        model_args=provider_args,
        log_dir=str(tmp_path),
        max_connections=500,
        max_samples=500,
        display="none",
    )[0]
    seconds = time.perf_counter() - started
    assert log.status == "success", log.error
    assert all(s.error is None for s in log.samples)

    engine = engine_pool.engines()[engine_key(tiny_llama_dir, provider_args)]
    status = asyncio.run(engine_thread_status(engine))
    assert status["pending_results"] == 0, "the workers kept per-request state after the eval"
    # the batch really mixed specs (how many share a step depends on how fast Inspect submits them)
    assert status["max_requests_steered_in_one_step"] >= 10, status

    solo: dict[tuple[int, int], Any] = {}
    for prompt, question in enumerate(QUESTIONS):
        for spec_index, spec in enumerate(SPECS):
            chat = [{"role": "user", "content": question}]
            solo[prompt, spec_index] = tiny_engine.generate([chat], specs=[spec], max_tokens=2 + prompt % 3)[0]
    assert any(solo[p, 1].text != solo[p, 0].text for p in range(len(QUESTIONS))), "steering changed nothing"

    stored = {r.sample_id: r for r in activations.load(log)}
    captures = {i for i, s in enumerate(SPECS) if s and "capture" in s}
    worst = 0.0
    for sample in log.samples:
        key = (sample.metadata["prompt"], sample.metadata["spec"])
        assert sample.output.completion == solo[key].text, (sample.id, key)
        assert (sample.id in stored) == (key[1] in captures)
        for hook, alone in solo[key].activations.items():
            error = float((stored[sample.id].activations[hook] - alone).norm() / alone.norm())
            worst = max(worst, error)
    assert worst < 1e-4, worst
    directory = Path(log.location).with_suffix(".activations")
    assert len(index_lines(directory)) == len(stored) == sum(1 for s in log.samples if s.metadata["spec"] in captures)
    assert_folder_consistent(directory)

    core = engine._instrumented.llm.engine_core.resources.engine_manager.processes[0].pid
    engine_peak = {p.pid: peak_rss_mib(p.pid) for p in [psutil.Process(core), *psutil.Process(core).children(True)]}
    test_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"\n500 samples: {seconds:.1f} s, {len(stored)} with activations, worst relative error {worst:.2e}, "
        f"up to {status['max_requests_steered_in_one_step']} steered requests in one step; "
        f"peak RSS: test process {test_peak:.0f} MiB, engine processes "
        + ", ".join(f"{v:.0f}" for v in engine_peak.values())
        + " MiB"
    )
    assert test_peak < 8192 and sum(engine_peak.values()) < 8192


# -- 4. the capture memory cap ----------------------------------------------------------------------


def test_capture_over_the_memory_cap_fails_only_its_sample(provider_args, tiny_llama_dir, tmp_path):
    """A capture that could outgrow capture_bytes_per_request is refused for its sample alone,
    before it takes any engine memory; the samples around it keep their outputs and activations."""
    from inspect_tl_vllm import activations

    every_row = {"capture": {"hooks": [f"blocks.{i}.hook_resid_post" for i in range(3)], "reduce": "none"}}
    samples = [
        Sample(id="ok1", input=QUESTIONS[0], metadata={"tlvllm": {"capture": {"hooks": [HOOK]}}}),
        Sample(id="huge", input="word " * 120, metadata={"tlvllm": every_row}),
        Sample(id="ok2", input=QUESTIONS[1], metadata={"tlvllm": SPECS[4]}),
    ]
    task = Task(dataset=samples, solver=generate(), config=GenerateConfig(max_tokens=3, temperature=0.0))
    log = eval(
        task,
        model=f"tl-vllm/{tiny_llama_dir}",
        model_args=provider_args,
        log_dir=str(tmp_path),
        fail_on_error=False,
        display="none",
    )[0]
    errors = {s.id: s.error for s in log.samples}
    assert errors["ok1"] is None and errors["ok2"] is None
    message = errors["huge"].message
    assert "huge" in message and f"capture_bytes_per_request={CAP}" in message, message
    assert sorted(r.sample_id for r in activations.load(log)) == ["ok1", "ok2"]
    assert all(s.output.completion for s in log.samples if s.id != "huge")
