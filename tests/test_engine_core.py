"""The instrumented engine on vLLM's CPU build: fidelity against transformers, steering,
isolation inside one continuous batch, position scopes and receipts."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import assert_batch_matches_solo, booted_engine, environment
from hf_reference import hf_activations, hf_greedy, load_hf
from inspect_tl_vllm.specs import parse_request_spec

pytestmark = pytest.mark.engine
PROMPTS = ["The quick brown fox jumps over", "Once upon a time", "In a hole in the ground there lived", "1 2 3 4"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


SAME_ROWS = 1e-5
"""Rows of two generate calls are the same rows within this, not bit for bit: the engine core takes
requests one by one, so how many share a step depends on timing, and a CPU GEMM rounds a row
differently in a batch of another size (seen on a loaded machine). Another row would be off by O(1)."""


def test_batch_generation_is_deterministic_with_expected_shapes(tiny_engine):
    first = tiny_engine.generate(PROMPTS, max_tokens=6)
    started = time.perf_counter()
    again = tiny_engine.generate(PROMPTS, max_tokens=6)
    wall = time.perf_counter() - started
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert all(len(g.token_ids) == 6 for g in first)
    assert all(g.receipt == {} and g.activations == {} for g in first)
    phases = tiny_engine.last_timings  # of the second call: consecutive spans of it, none empty
    assert sorted(phases) == ["fetch_s", "generate_s", "prepare_s"]
    assert all(t > 0 for t in phases.values()) and sum(phases.values()) <= wall, (phases, wall)


def test_progress_bar_is_shown_only_when_asked(tiny_engine, capfd):
    tiny_engine.generate(PROMPTS, max_tokens=2)
    assert "Processed prompts" not in capfd.readouterr().err
    tiny_engine.generate(PROMPTS, max_tokens=2, progress=True)
    assert "Processed prompts" in capfd.readouterr().err


def test_finished_requests_leave_the_worker(tiny_engine):
    """Requests that all finish in the same step are reported finished in a step with no
    tokens, which vLLM runs without ``_preprocess``; the worker must still let them go,
    or every later step routes over all requests ever served."""
    spec = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [0.5] * 64}]}
    for _ in range(2):
        tiny_engine.generate(PROMPTS, specs=[spec] * len(PROMPTS), max_tokens=3, ignore_eos=True)
    deadline = time.monotonic() + 10
    while (live := tiny_engine.status()["live_requests"]) and time.monotonic() < deadline:
        time.sleep(0.1)  # the finishing step runs just after the last outputs went out
    assert live == 0


def test_worker_accounts_its_host_time_as_wall_and_cpu_time(tiny_engine):
    """The benchmarks read how many steps the worker ran, how long its routing and harvest
    took, how much of that the thread spent working rather than waiting (each run must add to
    both), how long its process spent in Python's garbage collector, and how the pinned host
    pool grew.  One request alone, so that its steps are known: a prefill, then a decode step
    for each token after the first, of which all but the first repeat the step before (and
    reuse its routing: the fast path a long decode runs on)."""
    before = tiny_engine.status()
    spec = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [0.5] * 64}]}
    tiny_engine.generate(PROMPTS[0], specs=[spec], max_tokens=5, ignore_eos=True)
    after = tiny_engine.status()
    assert after["steps"] - before["steps"] == 5
    kinds = {kind: count - before["step_kinds"][kind] for kind, count in after["step_kinds"].items()}
    assert kinds == {"new_batch": 1, "same_batch": 1, "repeated": 3}
    for phase in ("route", "harvest"):
        wall = after["host_seconds"][phase] - before["host_seconds"][phase]
        cpu = after["host_seconds"][f"{phase}_cpu"] - before["host_seconds"][f"{phase}_cpu"]
        assert wall > 0 and cpu > 0, (phase, wall, cpu)
        assert cpu <= wall + 1e-3, (phase, wall, cpu)  # a thread works at most as long as it runs
    # The garbage collector's time and the pinned pool's counters travel with the status; what
    # they hold is tested where it is known (test_host_timer_reports_..., test_pinned_host_stats_...).
    assert set(after["host_seconds"]) == {"route", "route_cpu", "harvest", "harvest_cpu", "gc"}
    assert set(after["pinned_host"]) == {"blocks_made", "alloc_seconds", "bytes_held"}


def test_captures_equal_transformers_at_every_hook_point(tiny_engine, tiny_llama_dir):
    hf = load_hf(tiny_llama_dir)
    hooks = [name for name in tiny_engine.core.instrumentation.sites]
    out = tiny_engine.generate(PROMPTS[0], max_tokens=5, capture={"hooks": hooks})[0]
    sequence = out.prompt_token_ids + out.token_ids[:-1]  # every token that was an input
    reference = hf_activations(hf, sequence)
    assert set(out.activations) == set(hooks)
    worst = 0.0
    for hook in hooks:
        got = out.activations[hook]
        assert out.positions[hook] == list(range(len(sequence))), hook
        assert got.shape == reference[hook].shape, hook
        worst = max(worst, rel_err(got, reference[hook]))
    assert worst < 1e-4, f"worst relative error {worst}"


@pytest.mark.parametrize(
    ("op", "coef", "edit"),
    [
        ("add", 6.0, lambda h, v: h + 6.0 * v),
        ("scale", 0.25, lambda h, v: h * 0.25),
        ("ablate", 1.0, lambda h, v: h - (h @ (v / v.norm()))[..., None] * (v / v.norm())),
        ("set", 3.0, lambda h, v: (3.0 * v).expand_as(h)),
    ],
)
def test_steering_equals_transformers_forward_hook(tiny_engine, tiny_llama_dir, op, coef, edit):
    hf = load_hf(tiny_llama_dir)
    torch.manual_seed(1)
    vector = torch.randn(64)
    prompt = tiny_engine.tokenize(PROMPTS[1])
    spec = {"hook": "blocks.1.hook_resid_post", "op": op, "coef": coef}
    if op != "scale":
        spec["vector"] = vector.tolist()
    steered = tiny_engine.generate(PROMPTS[1], max_tokens=16, steering=[spec])[0]
    plain = tiny_engine.generate(PROMPTS[1], max_tokens=16)[0]
    expected = hf_greedy(hf, prompt, 16, edit=lambda h: edit(h, vector), layer=1)
    assert steered.token_ids == expected
    assert plain.token_ids == hf_greedy(hf, prompt, 16)
    assert steered.token_ids != plain.token_ids, "steering had no visible effect; the test proves nothing"
    receipt = steered.receipt["interventions"][0]
    assert receipt["rows"] == len(prompt) + 15 and receipt["fired"]


def test_a_vector_steers_alike_as_a_list_an_array_or_a_tensor(tiny_engine):
    """The Python API takes a researcher's tensor or array as it is (no list round trip): each
    form steers one request of the same batch to the same tokens, rows and receipt, and the
    front end keys each form's vector by the same content hash."""
    torch.manual_seed(5)
    vector = torch.randn(64)
    hook, capture = "blocks.1.hook_resid_post", {"hooks": ["blocks.2.hook_resid_post"]}
    forms = [vector.tolist(), vector.numpy().astype(np.float64), vector, vector.unsqueeze(0)]
    specs = [{"interventions": [{"hook": hook, "vector": v, "coef": 6.0}], "capture": capture} for v in forms]
    outs = tiny_engine.generate([PROMPTS[1]] * len(forms), specs=specs, max_tokens=8)
    plain = tiny_engine.generate(PROMPTS[1], max_tokens=8)[0]
    assert outs[0].token_ids != plain.token_ids, "steering had no visible effect; the test proves nothing"
    for out in outs[1:]:
        assert out.token_ids == outs[0].token_ids
        assert torch.equal(out.activations["blocks.2.hook_resid_post"], outs[0].activations["blocks.2.hook_resid_post"])
        assert out.receipt["interventions"] == outs[0].receipt["interventions"]
    front = tiny_engine.core.instrumentation
    keys = [set(front.prepare(parse_request_spec(spec), prompt_len=4, max_tokens=8).vectors) for spec in specs]
    assert all(k == keys[0] for k in keys)


def test_mixed_batch_gives_each_request_its_solo_result(tiny_engine):
    torch.manual_seed(2)
    v1, v2 = torch.randn(64).tolist(), torch.randn(64).tolist()
    capture = {"hooks": ["blocks.2.hook_resid_post", "blocks.0.hook_mlp_out"]}
    specs = [
        {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": v1, "coef": 5.0}], "capture": capture},
        {"interventions": [{"hook": "blocks.0.hook_attn_out", "vector": v2, "coef": 5.0}], "capture": capture},
        None,
        {"capture": capture},
        {
            "interventions": [
                {"hook": "blocks.1.hook_resid_post", "vector": v2, "coef": -4.0},
                {"hook": "blocks.1.hook_resid_post", "op": "scale", "coef": 0.5},
            ]
        },
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[0]]
    together = assert_batch_matches_solo(tiny_engine, prompts, specs)
    assert together[0].token_ids != together[4].token_ids


def test_position_scopes_touch_exactly_the_rows_asked_for(tiny_engine):
    vector = [0.1] * 64
    prompt_len = len(tiny_engine.tokenize(PROMPTS[2]))
    scopes = {"prompt": prompt_len, "generated": 5, "all": prompt_len + 5, "[-1, 0]": 2}
    for scope, rows in scopes.items():
        positions = [-1, 0] if scope == "[-1, 0]" else scope
        out = tiny_engine.generate(
            PROMPTS[2],
            max_tokens=6,
            steering=[{"hook": "blocks.0.hook_resid_pre", "vector": vector, "positions": positions}],
            capture={"hooks": ["blocks.0.hook_resid_pre"], "positions": positions},
        )[0]
        assert out.receipt["interventions"][0]["rows"] == rows, scope
        assert len(out.positions["blocks.0.hook_resid_pre"]) == rows, scope


def test_prompt_captures_are_written_out_early_and_equal_the_full_capture(tiny_engine):
    """A capture whose scope ends in the prompt is written out while the request still
    decodes (``ResultPacker.write_early``); its rows must be those of a capture of every row."""
    hooks = ["blocks.0.hook_resid_pre", "blocks.1.hook_resid_post", "blocks.2.hook_resid_pre"]  # one alias pair
    before = tiny_engine.status()["written_early"]
    full = tiny_engine.generate(PROMPTS, max_tokens=6, capture={"hooks": hooks})
    prompt = tiny_engine.generate(PROMPTS, max_tokens=6, capture={"hooks": hooks, "positions": "prompt"})
    listed = tiny_engine.generate(PROMPTS, max_tokens=6, capture={"hooks": hooks, "positions": [0, -1]})
    assert tiny_engine.status()["written_early"] - before == 2 * len(PROMPTS)
    for whole, early, pair in zip(full, prompt, listed, strict=True):
        n = len(whole.prompt_token_ids)
        assert early.token_ids == whole.token_ids
        for hook in hooks:
            assert early.positions[hook] == list(range(n)) and early.receipt["captures"][hook] == n
            assert rel_err(early.activations[hook], whole.activations[hook][:n]) < SAME_ROWS, hook
            assert pair.positions[hook] == [0, n - 1]
            assert rel_err(pair.activations[hook], whole.activations[hook][[0, n - 1]]) < SAME_ROWS, hook
    assert not list(tiny_engine.core.instrumentation.handoff.path.glob("*.safetensors"))  # every file was taken


def test_late_writes_switch_keeps_prompt_captures_in_memory_with_the_same_rows(vllm_ready, tiny_llama_dir, tiny_engine):
    """``TLVLLM_EARLY_WRITES=0`` (a benchmark switch) must change only when prompt captures
    leave the worker, not what they hold."""
    hooks = ["blocks.0.hook_resid_pre", "blocks.2.hook_resid_post"]
    spec = {"capture": {"hooks": hooks, "positions": "prompt"}}
    with booted_engine(tiny_llama_dir, env={"TLVLLM_EARLY_WRITES": "0"}, instrument={"hook_points": ["all"]}) as late:
        got = late.generate(PROMPTS, specs=[spec] * len(PROMPTS), max_tokens=6)
        assert late.status()["written_early"] == 0
        want = tiny_engine.generate(PROMPTS, specs=[spec] * len(PROMPTS), max_tokens=6)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids and a.positions == b.positions
            for hook in hooks:
                assert rel_err(a.activations[hook], b.activations[hook]) < SAME_ROWS, hook


def test_reductions_match_per_token_rows(tiny_engine):
    hook = "blocks.1.hook_resid_mid"
    rows = tiny_engine.generate(PROMPTS[0], max_tokens=4, capture={"hooks": [hook]})[0].activations[hook]
    norms = rows.norm(dim=-1)
    expected = {"mean": rows.mean(0), "last": rows[-1], "max_norm": rows[norms.argmax()]}
    for reduce, want in expected.items():
        got = tiny_engine.generate(PROMPTS[0], max_tokens=4, capture={"hooks": [hook], "reduce": reduce})[0]
        assert got.activations[hook].shape == (1, 64)
        assert rel_err(got.activations[hook][0], want) < 1e-5, reduce
    bf16 = tiny_engine.generate(PROMPTS[0], max_tokens=4, capture={"hooks": [hook], "dtype": "bfloat16"})[0]
    assert bf16.activations[hook].dtype == torch.bfloat16


def test_steering_at_positions_the_request_cannot_reach_is_refused(tiny_engine):
    from inspect_tl_vllm import SpecError

    with pytest.raises(SpecError, match=r"interventions\[0\].positions: none of \[200\] lies in this request's rows"):
        tiny_engine.generate(
            PROMPTS[3],
            max_tokens=2,
            steering=[{"hook": "blocks.0.hook_resid_pre", "vector": [1.0] * 64, "positions": [200]}],
        )


def test_prefix_cache_never_leaks_steering_into_a_later_plain_request(tiny_engine):
    long_prompt = " ".join(["word"] * 60)
    plain_first = tiny_engine.generate(long_prompt, max_tokens=6)[0]
    tiny_engine.generate(
        long_prompt, max_tokens=6, steering=[{"hook": "blocks.1.hook_resid_post", "vector": [0.5] * 64, "coef": 8.0}]
    )
    plain_after = tiny_engine.generate(long_prompt, max_tokens=6)[0]
    assert plain_after.token_ids == plain_first.token_ids
    captured = tiny_engine.generate(long_prompt, max_tokens=2, capture={"hooks": ["blocks.2.hook_resid_post"]})[0]
    assert len(captured.positions["blocks.2.hook_resid_post"]) == len(captured.prompt_token_ids) + 1


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"steering": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0] * 63}]}, "hidden size is 64"),
        ({"steering": [{"hook": "blocks.7.hook_resid_post", "vector": [1.0] * 64}]}, "layer 7 does not exist"),
        ({"steering": [{"hook": "blocks.1.hook_resid_post", "vector": [1.0] * 64}] * 3}, "max_stack=2"),
        (
            {"capture": {"hooks": ["blocks.0.hook_resid_post"], "positions": "all"}, "max_tokens": 10**7},
            "capture_bytes_per_request",
        ),
    ],
)
def test_bad_requests_fail_before_any_generation(tiny_engine, kwargs, fragment):
    from inspect_tl_vllm import SpecError

    pending = tiny_engine.status()["pending_results"]
    with pytest.raises(SpecError, match=fragment):
        tiny_engine.generate(PROMPTS[0], **{"max_tokens": 2, **kwargs})
    assert tiny_engine.status()["pending_results"] == pending


def test_requests_added_in_chunks_keep_their_order_and_their_own_vectors(tiny_engine):
    """generate() adds requests in growing chunks (8, 16, ...) while it prepares the next ones;
    each of 30 prompts, spread over three chunks, must come back in its place with its own steering."""
    torch.manual_seed(11)
    prompts = [f"Count with me: {' '.join(str(n) for n in range(i + 1))}" for i in range(30)]
    vectors = [torch.randn(64).tolist() for _ in prompts]
    specs = [
        {
            "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": v, "coef": 4.0}],
            "capture": {"hooks": ["blocks.2.hook_resid_post"], "reduce": "mean"},
        }
        for v in vectors
    ]
    together = tiny_engine.generate(prompts, specs=specs, max_tokens=4, ignore_eos=True)
    assert [g.prompt_token_ids for g in together] == [tiny_engine.tokenize(p) for p in prompts]
    for i in (0, 7, 8, 23, 24, 29):  # first and last of each chunk
        alone = tiny_engine.generate([prompts[i]], specs=[specs[i]], max_tokens=4, ignore_eos=True)[0]
        assert together[i].token_ids == alone.token_ids
        hook = "blocks.2.hook_resid_post"
        assert torch.allclose(together[i].activations[hook], alone.activations[hook], atol=1e-5, rtol=1e-5)


def test_a_bad_spec_in_a_later_chunk_aborts_the_requests_already_added(tiny_engine):
    from inspect_tl_vllm import SpecError

    good = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [0.5] * 64}]}
    bad = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": [0.5] * 63}]}
    capture = {"capture": {"hooks": ["blocks.0.hook_resid_post"], "positions": "prompt"}}  # written out early
    specs = [good] * 20 + [capture] * 6 + [bad] + [good] * 3  # the third chunk fails after 24 requests went in
    pending = tiny_engine.status()["pending_results"]
    with pytest.raises(SpecError, match="prompt 26: interventions\\[0\\].vector: vector has 63 entries"):
        tiny_engine.generate([PROMPTS[0]] * 30, specs=specs, max_tokens=50)
    assert not tiny_engine.llm.llm_engine.has_unfinished_requests()
    assert tiny_engine.status()["pending_results"] == pending  # the worker holds nothing of the aborted requests
    assert not list(tiny_engine.core.instrumentation.handoff.path.glob("*.safetensors"))  # nor files
    after = tiny_engine.generate(PROMPTS, max_tokens=3)  # nothing of the failed call comes back here
    assert [g.prompt_token_ids for g in after] == [tiny_engine.tokenize(p) for p in PROMPTS]


def test_refused_engine_settings_are_named():
    from inspect_tl_vllm import SpecError
    from inspect_tl_vllm.engine.construct import check_engine_args

    with pytest.raises(SpecError, match="speculative_config"):
        check_engine_args({"speculative_config": {"method": "ngram"}})
    with pytest.raises(SpecError, match="additional_config"):
        check_engine_args({"additional_config": {"tlvllm": {}}})
    with pytest.raises(SpecError, match="data_parallel_size=2 .* first replica only"):
        check_engine_args({"data_parallel_size": 2})
    check_engine_args({"data_parallel_size": 1, "ubatch_size": 1})  # the defaults spelled out are fine


def test_chunked_prefill_captures_every_row_like_one_pass(tiny_engine, tiny_llama_dir):
    settings = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "instrument": {"hook_points": ["all"]}}
    with booted_engine(tiny_llama_dir, **settings) as chunked:
        prompt = " ".join(f"item {i}," for i in range(40))  # ~120 tokens: four or more prefill chunks
        spec = {
            "interventions": [{"hook": "blocks.1.hook_resid_mid", "vector": [0.3] * 64, "coef": 2.0}],
            "capture": {"hooks": ["blocks.2.hook_resid_post", "blocks.0.hook_attn_out"]},
        }
        got = chunked.generate([prompt, PROMPTS[0]], specs=[spec, spec], max_tokens=5)
        want = tiny_engine.generate([prompt, PROMPTS[0]], specs=[spec, spec], max_tokens=5)
        assert len(got[0].prompt_token_ids) > 3 * 32
        for g, w in zip(got, want, strict=True):
            assert g.token_ids == w.token_ids
            assert g.receipt["interventions"][0]["rows"] == w.receipt["interventions"][0]["rows"]
            for hook, value in w.activations.items():
                assert g.positions[hook] == w.positions[hook]
                assert rel_err(g.activations[hook], value) < 1e-5
        # a prompt capture over several chunks is written out once its last chunk is in
        prompt_only = {**spec, "capture": {**spec["capture"], "positions": "prompt"}}
        early = chunked.generate([prompt, PROMPTS[0]], specs=[prompt_only] * 2, max_tokens=5)
        assert chunked.status()["written_early"] == 2
        for e, w in zip(early, want, strict=True):
            n = len(w.prompt_token_ids)
            for hook, value in w.activations.items():
                assert e.positions[hook] == list(range(n))
                assert rel_err(e.activations[hook], value[:n]) < 1e-5


def test_plugin_leaves_plain_engines_alone(vllm_ready, tiny_llama_dir):
    from vllm import LLM, SamplingParams

    from inspect_tl_vllm.engine.construct import EXTENSION

    with environment(TORCH_COMPILE_DISABLE="1"):
        plain = LLM(
            model=str(tiny_llama_dir),
            enforce_eager=True,
            dtype="float32",
            max_model_len=128,
            kv_cache_memory_bytes=64 << 20,
            worker_extension_cls=EXTENSION,
        )
    try:
        assert len(plain.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
        with pytest.raises(Exception, match="not instrumented"):
            plain.collective_rpc("tlvllm_status")
    finally:
        plain.llm_engine.engine_core.shutdown()


def test_a_hook_that_never_ran_fails_boot_loudly():
    from types import SimpleNamespace

    from inspect_tl_vllm.engine.worker import verify_hooks_fired

    # Stand-in for a worker whose compiled graph lost its hooks (cannot be provoked for real).
    controller = SimpleNamespace(
        runtime=SimpleNamespace(fired=lambda: {0: 3, 1: 0}),
        sites=[
            SimpleNamespace(index=0, name="blocks.0.hook_resid_pre"),
            SimpleNamespace(index=1, name="blocks.0.hook_resid_post"),
        ],
    )
    with pytest.raises(RuntimeError, match=r"never ran during warm-up at \['blocks.0.hook_resid_post'\]"):
        verify_hooks_fired(SimpleNamespace(_tlvllm=controller))


def test_preempted_requests_capture_each_position_once_and_match_their_solo_runs(vllm_ready, tiny_llama_dir):
    # KV cache for 512 tokens (768 bytes per token on the tiny model), four CPU blocks of 128: the
    # requests outgrow their first block together and vLLM preempts some, recomputing their rows later.
    torch.manual_seed(5)
    vector = torch.randn(64).tolist()
    hooks = ["blocks.0.hook_resid_post", "ln_final.hook_normalized"]
    specs = [
        {
            "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": vector, "coef": c}],
            "capture": {"hooks": hooks},
        }
        for c in (0.0, 2.0, 4.0)
    ] * 2
    prompts = [f"Tell me a long story about the number {i}" for i in range(6)]
    with booted_engine(tiny_llama_dir, instrument={"hook_points": ["all"]}, kv_cache_memory_bytes=512 * 768) as engine:
        together = engine.generate(prompts, specs=specs, max_tokens=150, ignore_eos=True)
        assert engine.status()["resumed_after_preemption"] > 0
        for prompt, spec, joint in zip(prompts, specs, together, strict=True):
            alone = engine.generate([prompt], specs=[spec], max_tokens=150, ignore_eos=True)[0]
            assert joint.token_ids == alone.token_ids
            assert joint.positions == alone.positions  # every position once, none twice
            assert joint.positions[hooks[0]] == list(range(len(joint.prompt_token_ids) + 149))
            for hook in hooks:
                assert torch.allclose(joint.activations[hook], alone.activations[hook], atol=1e-5, rtol=1e-5)


def test_gc_timer_counts_collections() -> None:
    import gc

    from inspect_tl_vllm.engine.telemetry import _GcTimer

    timer = _GcTimer()
    timer.install()
    timer.install()  # once per process, however many engines boot in it
    try:
        assert gc.callbacks.count(timer._on_collection) == 1
        gc.collect()
        assert timer.seconds > 0
    finally:
        gc.callbacks.remove(timer._on_collection)


def test_host_timer_reports_each_phase_and_the_process_gc_time(monkeypatch) -> None:
    from inspect_tl_vllm.engine import telemetry

    monkeypatch.setattr(telemetry.GC_TIMER, "seconds", 1.25)
    timer = telemetry.HostTimer("route", "harvest")
    started = timer.start()
    time.sleep(0.02)  # waiting: wall time without CPU time
    timer.add("route", started)
    report = timer.report()
    assert sorted(report) == ["gc", "harvest", "harvest_cpu", "route", "route_cpu"]
    assert report["gc"] == 1.25
    assert report["harvest"] == report["harvest_cpu"] == 0.0
    assert report["route"] >= 0.02 and report["route_cpu"] < 0.01, report


def test_pinned_host_stats_read_torchs_pinned_pool(monkeypatch) -> None:
    """Zeros without CUDA; with it, torch's pool counters (its time in microseconds) renamed."""
    from inspect_tl_vllm.engine.telemetry import pinned_host_stats

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pinned_host_stats() == {"blocks_made": 0, "alloc_seconds": 0.0, "bytes_held": 0}
    stats = {"num_host_alloc": 66, "host_alloc_time.total": 2_600_000, "allocated_bytes.current": 1 << 27}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {**stats, "num_host_free": 3})
    assert pinned_host_stats() == {"blocks_made": 66, "alloc_seconds": 2.6, "bytes_held": 1 << 27}
