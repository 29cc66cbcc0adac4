"""The Inspect provider on the real CPU engine: `inspect_ai.eval()` and the `inspect eval` CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import exact
from inspect_ai.solver import generate

from conftest import TINY_MODEL_ARGS_CLI, engine_key, engine_thread_status, provider_model_args

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Name a colour.", "Say something about cats.", "Count to three.", "What is a river?"]
HOOK = "blocks.2.hook_resid_post"


@pytest.fixture(scope="module")
def provider_args(vllm_ready, tiny_llama_dir):
    with provider_model_args(capture=HOOK, capture_reduce="none") as args:
        yield args


def run_eval(tiny_llama_dir, args, samples, log_dir, **kwargs):
    task = Task(
        dataset=samples, solver=generate(), scorer=exact(), config=GenerateConfig(max_tokens=8, temperature=0.0)
    )
    logs = eval(
        task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(log_dir), display="none", **kwargs
    )
    return logs[0]


def steer_meta(seed: int, coef: float = 8.0) -> dict:
    torch.manual_seed(seed)
    return {
        "tlvllm": {
            "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": torch.randn(64).tolist(), "coef": coef}]
        }
    }


def test_eval_steers_only_where_asked_and_stores_matching_activations(
    provider_args, tiny_llama_dir, tiny_engine, tmp_path
):
    from inspect_tl_vllm import activations

    metas = [None, steer_meta(1), steer_meta(2), None]
    samples = [Sample(id=f"s{i}", input=q, metadata=m) for i, (q, m) in enumerate(zip(QUESTIONS, metas, strict=True))]
    log = run_eval(tiny_llama_dir, provider_args, samples, tmp_path, max_connections=4)
    assert log.status == "success", log.error
    records = {r.sample_id: r for r in activations.load(log)}
    assert set(records) == {"s0", "s1", "s2", "s3"}
    by_id = {s.id: s for s in log.samples}
    for i, question in enumerate(QUESTIONS):
        chat = [{"role": "user", "content": question}]
        spec = {
            "capture": {"hooks": [HOOK]},
            **({"interventions": metas[i]["tlvllm"]["interventions"]} if metas[i] else {}),
        }
        direct = tiny_engine.generate([chat], specs=[spec], max_tokens=8)[0]
        sample = by_id[f"s{i}"]
        assert sample.output.completion == direct.text
        stored = records[f"s{i}"].activations[HOOK]
        assert stored.shape == direct.activations[HOOK].shape
        assert float((stored - direct.activations[HOOK]).norm() / direct.activations[HOOK].norm()) < 1e-5
        assert records[f"s{i}"].positions[HOOK] == direct.positions[HOOK]  # each row's token position
        one = activations.read(log.location, f"s{i}", 1)  # through the log alone, no index
        assert torch.equal(one.activations[HOOK], stored) and one.positions == records[f"s{i}"].positions
        assert one.scores == records[f"s{i}"].scores
        meta = sample.output.metadata["tlvllm"]
        assert meta["activations"]["hooks"][HOOK]["shape"] == list(stored.shape)
        steered_rows = [x["rows"] for x in meta["receipt"]["interventions"]]
        assert steered_rows == ([] if metas[i] is None else [stored.shape[0]])
        if metas[i] is not None:
            plain = tiny_engine.generate([chat], max_tokens=8)[0]
            assert plain.text != direct.text, "steering changed nothing: the test would prove nothing"


def test_logprobs_stop_sequences_and_engine_reuse(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm.provider import engine_pool

    plain = run_eval(tiny_llama_dir, provider_args, [Sample(id="a", input=QUESTIONS[0])], tmp_path / "a")
    text = plain.samples[0].output.completion
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"completion too short to cut: {text!r}"
    task_args = {"logprobs": True, "top_logprobs": 2, "stop_seqs": [stop]}
    log = run_eval(tiny_llama_dir, provider_args, [Sample(id="a", input=QUESTIONS[0])], tmp_path / "b", **task_args)
    choice = log.samples[0].output.choices[0]
    assert stop not in choice.message.text and text.startswith(choice.message.text)
    assert choice.stop_reason == "stop"
    assert choice.logprobs is not None and len(choice.logprobs.content[0].top_logprobs) >= 2
    booted = [key for key, engine in engine_pool.engines().items() if engine.booted]
    assert len(booted) == 1, "successive evals with the same settings must share one engine"


def test_overlong_prompt_fails_only_its_sample(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm import activations

    samples = [
        Sample(id="ok1", input=QUESTIONS[1]),
        Sample(id="long", input="word " * 400),
        Sample(id="ok2", input=QUESTIONS[2]),
    ]
    log = run_eval(tiny_llama_dir, provider_args, samples, tmp_path, fail_on_error=False)
    errors = {s.id: s.error for s in log.samples}
    assert errors["long"] is not None and "max_model_len" in errors["long"].message
    assert errors["ok1"] is None and errors["ok2"] is None
    assert {r.sample_id for r in activations.load(log)} == {"ok1", "ok2"}


def test_vllm_sampling_fields_in_extra_body_reach_the_engine_and_others_are_refused(
    provider_args, tiny_llama_dir, tiny_engine, tmp_path
):
    """extra_body means what it means on Inspect's vllm/ provider (vLLM's server reads its sampling
    fields from it): a stop token id ends the answer there; an unknown key or a NaN fails the sample."""
    chat = [{"role": "user", "content": QUESTIONS[1]}]
    plain = tiny_engine.generate([chat], max_tokens=8)[0]
    assert len(plain.token_ids) == 8 and len(set(plain.token_ids[:3])) == 3, plain.token_ids
    stop_at = plain.token_ids[2]
    samples = [Sample(id="a", input=QUESTIONS[1])]
    log = run_eval(tiny_llama_dir, provider_args, samples, tmp_path / "a", extra_body={"stop_token_ids": [stop_at]})
    assert log.status == "success", log.error
    assert log.samples[0].output.usage.output_tokens == 3  # two tokens, then the stop token
    assert log.samples[0].output.choices[0].stop_reason == "stop"
    for extra, words in [
        ({"best_of": 2}, ["'best_of'", "ignore_eos"]),
        ({"min_p": float("nan")}, ["extra_body", "min_p"]),
        ({"min_tokens": -1}, ["extra_body", "min_tokens", "greater than or equal to 0"]),
    ]:
        log = run_eval(tiny_llama_dir, provider_args, samples, tmp_path / "bad", extra_body=extra, fail_on_error=False)
        message = log.samples[0].error.message
        assert all(word in message for word in words), message


def test_bad_sample_spec_names_the_sample(provider_args, tiny_llama_dir, tmp_path):
    bad = {"tlvllm": {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0] * 5}]}}
    log = run_eval(
        tiny_llama_dir, provider_args, [Sample(id="bad-one", input="hi", metadata=bad)], tmp_path, fail_on_error=False
    )
    message = log.samples[0].error.message
    assert "bad-one" in message and "hidden size is 64" in message


def test_hostile_sample_specs_fail_alone_and_the_engine_keeps_serving(provider_args, tiny_llama_dir, tmp_path):
    """Values that once killed the shared engine (an int64 overflow in the worker), wedged it (an
    integer too large to serialise) or gave silently non-finite steering: each fails its own
    sample with an error naming the sample and the field; the other samples finish."""
    steer = "blocks.1.hook_resid_post"
    hostile = {
        "overflow": {"interventions": [{"hook": steer, "op": "scale", "positions": [2**63]}]},
        "too-big": {"interventions": [{"hook": steer, "op": "scale", "positions": [10**30]}]},
        "set-1e30": {"interventions": [{"hook": steer, "op": "set", "vector": [1.0] * 64, "coef": 1e30}]},
        "ablate-huge": {"interventions": [{"hook": steer, "op": "ablate", "vector": [1e20] * 64}]},
        "nowhere": {"capture": {"hooks": [HOOK], "positions": [5000]}},
    }
    fields = {"overflow": "positions[0]", "too-big": "positions[0]", "set-1e30": "coef", "ablate-huge": "vector"}
    samples = [Sample(id=name, input=QUESTIONS[0], metadata={"tlvllm": spec}) for name, spec in hostile.items()]
    samples += [Sample(id=f"ok{i}", input=q) for i, q in enumerate(QUESTIONS)]
    log = run_eval(tiny_llama_dir, provider_args, samples, tmp_path, fail_on_error=False)
    errors = {s.id: s.error.message if s.error else None for s in log.samples}
    for name in hostile:
        assert errors[name] is not None and f"sample '{name}'" in errors[name], errors[name]
        assert fields.get(name, "capture.positions: none of [5000]") in errors[name], errors[name]
    assert all(errors[f"ok{i}"] is None for i in range(len(QUESTIONS)))
    again = run_eval(tiny_llama_dir, provider_args, [Sample(id="after", input=QUESTIONS[1])], tmp_path / "again")
    assert again.status == "success" and again.samples[0].output.completion


def test_cache_key_names_the_run_wide_steering(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    vector = tmp_path / "v.npy"
    import numpy as np

    np.save(vector, np.ones(64, dtype=np.float32))
    spec = f'{{"interventions": [{{"hook": "blocks.1.hook_resid_post", "vector": "{vector}"}}]}}'
    plain = TLVLLMAPI(str(tiny_llama_dir), **provider_args)
    steered = TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "steer": spec})
    before = steered.base_url
    assert plain.base_url != before and steered.base_url == before
    np.save(vector, np.full(64, 2.0, dtype=np.float32))
    # the same model instance: base_url is derived at every call, from the file as it is now
    assert steered.base_url != before
    assert TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "steer": spec}).base_url == steered.base_url


def test_inspect_eval_command_line(vllm_ready, tiny_llama_dir, tmp_path):
    task = tmp_path / "task.py"
    task.write_text(
        "from inspect_ai import Task, task\nfrom inspect_ai.dataset import Sample\n"
        "from inspect_ai.solver import generate\n"
        "@task\ndef t():\n    return Task(dataset=[Sample(id=1, input='Hello'), Sample(id=2, input='Bye')],"
        " solver=generate())\n"
    )
    cmd = [
        sys.executable,
        "-m",
        "inspect_ai",
        "eval",
        "task.py",
        "--model",
        f"tl-vllm/{tiny_llama_dir}",
        *TINY_MODEL_ARGS_CLI,
        "-M",
        f"capture={HOOK}",
        "-M",
        "capture_reduce=mean",
        "--max-tokens",
        "4",
        "--log-dir",
        "logs",
        "--display",
        "plain",
    ]
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1"}
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    printed = result.stdout + result.stderr  # the noise that was this package's is gone (README)
    assert "Found no NVIDIA driver" not in printed and "Passing raw prompts" not in printed
    logs = list((tmp_path / "logs").glob("*.eval"))
    assert len(logs) == 1
    from inspect_tl_vllm import activations

    records = activations.load(logs[0])
    assert sorted(r.sample_id for r in records) == [1, 2]
    assert all(r.activations[HOOK].shape == (1, 64) for r in records)
    from inspect_tl_vllm.cli import main

    assert main(["activations", str(logs[0]), "--export", str(tmp_path / "acts.npz")]) == 0
    import numpy as np

    exported = np.load(tmp_path / "acts.npz")
    assert exported[f"1/1/{HOOK}"].shape == (1, 64) and "__scores__" in exported


def test_chat_rendering_continues_a_final_assistant_message_and_refuses_tools(provider_args, tiny_llama_dir, tmp_path):
    from inspect_ai.model import ChatMessageAssistant, ChatMessageSystem, ChatMessageUser
    from inspect_ai.tool import ToolInfo, ToolParams

    from inspect_tl_vllm import SpecError
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    api = TLVLLMAPI(str(tiny_llama_dir), **provider_args)
    messages = [
        ChatMessageSystem(content="Be brief."),
        ChatMessageUser(content="Capital of France?"),
        ChatMessageAssistant(content="The answer is"),
    ]
    text = api.tokenizer.decode(api._prompt_ids(messages, []))
    assert text.endswith("The answer is") and "Be brief." in text
    fresh = api.tokenizer.decode(api._prompt_ids(messages[:2], []))
    assert fresh.endswith("<|im_start|>assistant\n")
    tool = ToolInfo(name="add", description="Add two numbers", parameters=ToolParams())
    with pytest.raises(SpecError, match="does not render tool definitions"):
        api._prompt_ids(messages[:2], [tool])
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    custom = TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "chat_template": str(template)})
    assert custom.tokenizer.decode(custom._prompt_ids(messages[1:2], [])) == "[user] Capital of France?\n"


def test_tools_a_chat_template_cannot_render_fail_before_the_engine_boots(provider_args, tiny_llama_dir, tmp_path):
    from inspect_ai.solver import use_tools
    from inspect_ai.tool import tool

    from inspect_tl_vllm.provider import engine_pool

    @tool
    def add():
        async def execute(x: int, y: int) -> int:
            """Add two numbers.

            Args:
                x: The first number.
                y: The second number.
            """
            return x + y

        return execute

    args = {**provider_args, "max_num_seqs": 7}  # an engine of this test's own: its boots are counted
    task = Task(dataset=[Sample(id="t", input=QUESTIONS[0])], solver=[use_tools(add()), generate()])
    log = eval(task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path), display="none")[0]
    assert log.status == "error" and "does not render tool definitions" in log.error.message
    assert engine_pool.engines()[engine_key(tiny_llama_dir, args)].boots == 0


def test_unknown_model_arg_is_named(tiny_llama_dir):
    from inspect_tl_vllm import SpecError
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    with pytest.raises(SpecError, match="unknown model args \\['max_len'\\]"):
        TLVLLMAPI(str(tiny_llama_dir), max_len=5)


def test_concurrent_first_requests_boot_one_engine(provider_args, tiny_llama_dir, tmp_path):
    """With boot=background the model starts its engine and returns at once; four samples whose
    first requests arrive while it boots all wait for that one engine."""
    from inspect_tl_vllm.provider import engine_pool
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    # settings no other test boots (the tool test above refuses before booting): this eval boots the engine
    args = {**provider_args, "max_num_seqs": 7, "boot": "background"}
    built = TLVLLMAPI(str(tiny_llama_dir), **args)
    assert not built.engine_thread.booted  # the constructor did not wait for the boot
    samples = [Sample(id=f"c{i}", input=q) for i, q in enumerate(QUESTIONS)]
    log = run_eval(tiny_llama_dir, args, samples, tmp_path, max_connections=4)
    assert log.status == "success"
    engine = engine_pool.engines()[engine_key(tiny_llama_dir, args)]
    assert engine is built.engine_thread and engine.boots == 1, f"{engine.boots} engines booted for one set of settings"


def test_a_background_boot_that_fails_fails_the_first_request_with_its_error(provider_args, tiny_llama_dir):
    import asyncio

    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    args = {**provider_args, "max_model_len": 1 << 20, "boot": "background"}  # beyond the model's context
    model = TLVLLMAPI(str(tiny_llama_dir), **args)  # returns: the boot fails on the engine's thread
    engine = model.engine_thread
    with pytest.raises(Exception, match="max_model_len"):
        asyncio.run(engine.instrumented())  # the first request gets the background boot's own error
    assert engine.boots == 1 and not engine.booted
    with pytest.raises(Exception, match="max_model_len"):
        asyncio.run(engine.instrumented())  # a later request boots afresh, as after a failed lazy boot
    assert engine.boots == 2


def test_eager_boot_starts_the_engine_before_any_request(provider_args, tiny_llama_dir):
    from inspect_tl_vllm import SpecError
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    with pytest.raises(SpecError, match="-M boot='soon': use lazy .*, background .* or eager"):
        TLVLLMAPI(str(tiny_llama_dir), boot="soon")
    lazy = TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "max_num_seqs": 3})
    assert not lazy.engine_thread.booted  # a model Inspect constructs but never calls costs nothing
    eager = TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "max_num_seqs": 3, "boot": "eager"})
    assert eager.engine_thread is lazy.engine_thread and eager.engine_thread.booted


def test_a_cancelled_request_leaves_nothing_in_the_worker(provider_args, tiny_llama_dir):
    """A sample cancelled mid-generation (a time limit, a failed eval) is aborted by vLLM; the
    provider must also take back its receipt and captured rows, which the worker keeps until fetched."""
    import asyncio

    from inspect_ai.model import ChatMessageUser

    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    model = TLVLLMAPI(str(tiny_llama_dir), **{**provider_args, "max_num_seqs": 5, "boot": "eager"})

    async def status() -> dict:
        return await engine_thread_status(model.engine_thread)

    async def scenario() -> tuple[int, int]:
        pending = (await status())["pending_results"]
        config = GenerateConfig(max_tokens=200, temperature=0.0)
        request = asyncio.create_task(model.generate([ChatMessageUser(content="Tell a story.")], [], "none", config))
        while (await status())["live_requests"] == 0:  # the worker has admitted it: it is generating
            await asyncio.sleep(0.002)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(500):  # the provider takes the results back in the background
            if (await status())["pending_results"] == pending:
                break
            await asyncio.sleep(0.01)
        return pending, (await status())["pending_results"]

    before, after = asyncio.run(scenario())
    assert after == before


def test_probe_scorer_reads_the_stored_activations(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm import activations
    from inspect_tl_vllm.research.probes import probe_scorer, probe_value, save_probe

    torch.manual_seed(5)
    weight, bias = torch.randn(64) * 0.1, torch.tensor(0.2)
    probe = tmp_path / "probe.safetensors"
    save_probe(probe, weight, bias, HOOK)
    task = Task(
        dataset=[Sample(id=i, input=q) for i, q in enumerate(QUESTIONS[:2])],
        solver=generate(),
        scorer=probe_scorer(str(probe)),
        config=GenerateConfig(max_tokens=4, temperature=0.0),
    )
    log = eval(
        task, model=f"tl-vllm/{tiny_llama_dir}", model_args=provider_args, log_dir=str(tmp_path), display="none"
    )[0]
    stored = {r.sample_id: r.activations for r in activations.load(log)}
    for sample in log.samples:
        assert sample.scores["probe_scorer"].value == pytest.approx(probe_value(stored[sample.id], weight, bias, HOOK))


def test_activation_logging_task_stores_prompt_last_rows(provider_args, tiny_llama_dir, tmp_path, monkeypatch):
    from inspect_tl_vllm import activations

    monkeypatch.chdir(ROOT)
    log = eval(
        "evals/activation_logging.py",
        task_args={"hooks": HOOK},
        model=f"tl-vllm/{tiny_llama_dir}",
        model_args=provider_args,
        log_dir=str(tmp_path),
        limit=3,
        display="none",
    )[0]
    assert log.status == "success" and len(log.samples) == 3
    records = activations.load(log)
    assert len(records) == 3 and all(r.activations[HOOK].shape == (1, 64) for r in records)
    assert all(r.index["hooks"][HOOK]["tokens"] > 5 for r in records)  # the whole prompt was seen


def test_engine_death_fails_samples_clearly_and_the_next_eval_recovers(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm import activations
    from inspect_tl_vllm.provider import engine_pool

    first = run_eval(tiny_llama_dir, provider_args, [Sample(id="before", input=QUESTIONS[0])], tmp_path / "a")
    assert first.status == "success"
    pool_entry = engine_pool.engines()[engine_key(tiny_llama_dir, provider_args)]
    process = pool_entry._instrumented.llm.engine_core.resources.engine_manager.processes[0]
    process.kill()
    process.join(timeout=30)
    samples = [Sample(id=f"during{i}", input=q) for i, q in enumerate(QUESTIONS[:2])]
    during = run_eval(tiny_llama_dir, provider_args, samples, tmp_path / "b", fail_on_error=False)
    assert all(s.error is not None and "the vLLM engine died" in s.error.message for s in during.samples)
    assert all("was killed by SIGKILL" in s.error.message and "dmesg" in s.error.message for s in during.samples)
    assert [r.sample_id for r in activations.load(first)] == ["before"]  # completed work stays on disk
    after = run_eval(tiny_llama_dir, provider_args, [Sample(id="after", input=QUESTIONS[1])], tmp_path / "c")
    assert after.status == "success" and after.samples[0].output.completion


def test_cache_keys_on_metadata_steering_and_keeps_activations(provider_args, tiny_llama_dir, tmp_path, monkeypatch):
    """Inspect answers a cache hit before the provider is called.  An unsteered run fills the cache;
    the same samples with metadata steering must not be answered from it, and every run, served
    from the cache or not, has each sample's activations in its own log's folder (the runs share
    a log dir, as a user's runs do: a cached output names its file relative to that folder)."""
    from inspect_tl_vllm import activations

    monkeypatch.setenv("INSPECT_CACHE_DIR", str(tmp_path / "cache"))
    questions = QUESTIONS[:3]

    def run(meta: dict | None):
        task = Task(
            dataset=[Sample(id=f"s{i}", input=q, metadata=meta) for i, q in enumerate(questions)],
            solver=generate(cache=True),
            config=GenerateConfig(max_tokens=8, temperature=0.0),
        )
        log = eval(
            task,
            model=f"tl-vllm/{tiny_llama_dir}",
            model_args=provider_args,
            log_dir=str(tmp_path / "logs"),
            display="none",
        )[0]
        assert log.status == "success", log.error
        modes = {s.id: [e.cache for e in s.events if e.event == "model"] for s in log.samples}
        stored = {r.sample_id: r.activations[HOOK] for r in activations.load(log)}
        assert sorted(stored) == [f"s{i}" for i in range(len(questions))], "a sample's activations are missing"
        return log, modes, stored

    plain, modes, plain_rows = run(None)
    assert all(mode == ["write"] for mode in modes.values())
    texts = {s.id: s.output.completion for s in plain.samples}
    for attempt in (1, 2):
        steered, modes, rows = run(steer_meta(1))
        assert all(mode == ["write" if attempt == 1 else "read"] for mode in modes.values()), modes
        for sample in steered.samples:
            assert sample.output.metadata["tlvllm"]["receipt"]["interventions"][0]["rows"] > 0
            assert sample.output.completion != texts[sample.id], "a steered sample got the unsteered answer"
        if attempt == 1:
            first_steered = rows
        assert all(torch.equal(rows[key], first_steered[key]) for key in rows)
    for _ in range(2):  # the unsteered run again: answered from the cache, activations still complete
        again, modes, rows = run(None)
        assert all(mode == ["read"] for mode in modes.values())
        assert {s.id: s.output.completion for s in again.samples} == texts
        assert all(torch.equal(rows[key], plain_rows[key]) for key in rows)
        directory = Path(again.location).with_suffix(".activations")
        lines = (directory / "index.jsonl").read_text().splitlines()
        assert len(lines) == len(questions)  # linked once each, not generated
        assert all('"carried_from"' in line for line in lines)


def test_num_choices_returns_every_choice_with_and_without_instrumentation(provider_args, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm import activations

    plain_args = {k: v for k, v in provider_args.items() if not k.startswith("capture")}
    sampling = {"num_choices": 3, "temperature": 1.0, "seed": 7, "logprobs": True}
    log = run_eval(tiny_llama_dir, plain_args, [Sample(id="a", input=QUESTIONS[0])], tmp_path / "plain", **sampling)
    output = log.samples[0].output
    assert len(output.choices) == 3
    assert len({choice.message.text for choice in output.choices}) > 1, "the choices are not independent samples"
    for choice in output.choices:
        assert choice.stop_reason in ("stop", "max_tokens") and choice.logprobs is not None
    assert output.usage.output_tokens == sum(len(c.logprobs.content) for c in output.choices)

    sample = Sample(id="b", input=QUESTIONS[0], metadata=steer_meta(3))
    log = run_eval(tiny_llama_dir, provider_args, [sample], tmp_path / "steered", **{**sampling, "num_choices": 2})
    output = log.samples[0].output
    assert len(output.choices) == 2
    receipts = output.metadata["tlvllm"]["choices"]
    assert len(receipts) == 2 and all(r["interventions"][0]["rows"] > 0 for r in receipts)
    records = activations.load(log)
    assert len(records) == 1 and records[0].activations[HOOK].shape[0] == len(records[0].positions[HOOK])


def test_logprobs_have_exactly_top_logprobs_entries_as_vllm_serves_them(provider_args, tiny_llama_dir, tmp_path):
    """As Inspect's vllm/ provider reports them (vLLM's OpenAI server): top_logprobs=k gives k
    entries per token, the sampled token first, even at temperature 1 where it is often not among
    the k most likely; logprobs without top_logprobs gives none."""
    plain_args = {k: v for k, v in provider_args.items() if not k.startswith("capture")}
    question = [Sample(id="a", input=QUESTIONS[1])]
    config = {"temperature": 1.0, "seed": 11, "max_tokens": 8, "logprobs": True}
    log = run_eval(tiny_llama_dir, plain_args, question, tmp_path / "top3", **config, top_logprobs=3)
    content = log.samples[0].output.choices[0].logprobs.content
    assert content and all(len(token.top_logprobs) == 3 for token in content)
    assert all(token.top_logprobs[0].token == token.token for token in content)
    assert all(token.bytes == list(token.token.encode()) for token in content)
    log = run_eval(tiny_llama_dir, plain_args, question, tmp_path / "none", **config)
    content = log.samples[0].output.choices[0].logprobs.content
    assert content and all(token.top_logprobs == [] for token in content)


def test_sample_times_exclude_a_lazy_boot_and_many_samples_run_at_once(provider_args, tiny_llama_dir, tmp_path):
    """The first samples of a lazily booted engine waited for the boot; their ModelOutput.time is
    their own generation (the log's model call records it).  Unless told otherwise, the provider
    runs DEFAULT_CONNECTIONS samples at once instead of Inspect's adaptive 20 to 100."""
    from inspect_ai.model import get_model

    from inspect_tl_vllm.provider import engine_pool
    from inspect_tl_vllm.provider.model_api import DEFAULT_CONNECTIONS

    args = {**provider_args, "max_num_seqs": 5}  # an engine of its own, booted by the eval
    assert get_model(f"tl-vllm/{tiny_llama_dir}", **args).config.max_connections == DEFAULT_CONNECTIONS
    chosen = get_model(f"tl-vllm/{tiny_llama_dir}", config=GenerateConfig(max_connections=3), **args)
    assert chosen.config.max_connections == 3
    log = run_eval(tiny_llama_dir, args, [Sample(id=f"s{i}", input=q) for i, q in enumerate(QUESTIONS)], tmp_path)
    key = engine_key(tiny_llama_dir, args)
    engine = engine_pool.engines()[key]
    try:
        assert engine.boot_seconds > 1.0
        for sample in log.samples:
            assert sample.output.time < engine.boot_seconds / 2, (sample.output.time, engine.boot_seconds)
            call = next(e for e in sample.events if e.event == "model").call
            assert call is not None and call.time == sample.output.time and call.request["prompt_tokens"] > 0
    finally:
        engine_pool.shutdown_engines([key])


def test_the_provider_turns_a_tool_call_reply_into_an_assistant_message(provider_args, tiny_llama_dir):
    from inspect_ai.tool import ToolInfo, ToolParam, ToolParams

    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    add = ToolInfo(name="add", description="Add", parameters=ToolParams(properties={"x": ToolParam(type="integer")}))
    api = TLVLLMAPI(str(tiny_llama_dir), **provider_args)
    message = api._assistant_message('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', [add])
    assert message.tool_calls and message.tool_calls[0].function == "add" and message.text == ""
    plain = api._assistant_message("Paris.", [add])
    assert plain.tool_calls is None and plain.text == "Paris."


def test_a_samples_capture_replaces_the_run_wide_one_and_interventions_stack(provider_args, tiny_llama_dir, tmp_path):
    """Run-wide capture of HOOK and steering at layer 0; one sample asks for its own capture and adds
    its own steering: that sample stores only its hook point and applies both interventions, the
    other sample the run-wide ones alone."""
    from inspect_tl_vllm import activations

    run_wide = {"interventions": [{"hook": "blocks.0.hook_resid_post", "op": "scale", "coef": 1.5}]}
    own = steer_meta(3)
    own["tlvllm"]["capture"] = {"hooks": ["blocks.0.hook_resid_pre"], "reduce": "none"}
    samples = [Sample(id="own", input=QUESTIONS[0], metadata=own), Sample(id="run", input=QUESTIONS[1])]
    args = {**provider_args, "steer": json.dumps(run_wide)}
    log = run_eval(tiny_llama_dir, args, samples, tmp_path)
    assert log.status == "success", log.error
    records = {r.sample_id: r for r in activations.load(log)}
    assert set(records["own"].activations) == {"blocks.0.hook_resid_pre"}
    assert set(records["run"].activations) == {HOOK}
    applied = {s.id: s.output.metadata["tlvllm"]["applied"]["interventions"] for s in log.samples}
    assert [i["coef"] for i in applied["own"]] == [1.5, 8.0] and [i["coef"] for i in applied["run"]] == [1.5]
