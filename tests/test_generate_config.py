"""GenerateConfig fields on the real CPU engine: each one Inspect's ``vllm/`` provider sends to vLLM
means the same on ``tl-vllm``, plain and instrumented, or is refused by name before generation."""

from __future__ import annotations

import asyncio
import json
import math
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch
from inspect_ai.model import ChatMessageUser, GenerateConfig, ModelOutput, ResponseSchema
from inspect_ai.util import JSONSchema

from conftest import provider_model_args
from inspect_tl_vllm.specs import SpecError

pytestmark = pytest.mark.engine
QUESTION = "Say something about cats."
HOOK = "blocks.2.hook_resid_post"


def _steer_spec(capture: bool = True) -> dict[str, Any]:
    torch.manual_seed(3)
    spec: dict[str, Any] = {
        "interventions": [{"hook": "blocks.1.hook_resid_post", "vector": torch.randn(64).tolist(), "coef": 8.0}]
    }
    if capture:
        spec["capture"] = {"hooks": [HOOK], "reduce": "none"}
    return spec


STEER = _steer_spec()


@pytest.fixture(scope="module")
def api(vllm_ready, tiny_llama_dir):
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    with provider_model_args() as args:
        yield TLVLLMAPI(str(tiny_llama_dir), **args)


def generate(api: Any, question: str = QUESTION, **config: Any) -> ModelOutput:
    output, _ = asyncio.run(api.generate([ChatMessageUser(content=question)], [], "none", GenerateConfig(**config)))
    return output


def steered(api: Any, **config: Any) -> ModelOutput:
    """A steered and capturing request: every choice's receipt says the steering touched rows."""
    extra = {**config.pop("extra_body", {}), "tlvllm": STEER}
    output = generate(api, extra_body=extra, **config)
    record = output.metadata["tlvllm"]
    assert record["receipt"]["interventions"][0]["rows"] > 0
    assert record["activations"]["hooks"][HOOK]["shape"][0] > 0
    return output


def vanilla(api: Any, question: str = QUESTION, **sampling: Any) -> Any:
    """vLLM's own answer on the same engine, with ``SamplingParams`` built as vLLM's OpenAI server
    builds them (``from_optional``) for Inspect's ``vllm/`` provider: no tl-vllm code in between."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams.from_optional(output_kind=RequestOutputKind.FINAL_ONLY, **sampling)
    ids = api._prompt_ids([ChatMessageUser(content=question)], [])

    async def run() -> Any:
        instrumented = await api.engine_thread.instrumented()
        final, _ = await api.engine_thread.run(lambda: api._run(instrumented, ids, params, None))
        return final

    return asyncio.run(run())


def token_id(api: Any, text: str) -> int:
    ids = api.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, ids
    return ids[0]


# -- logit_bias ---------------------------------------------------------------------------------
def test_logit_bias_acts_as_in_vllm_plain_and_steered_and_bad_entries_are_named(api):
    cats = token_id(api, " cats")
    forced = generate(api, temperature=0.0, max_tokens=5, logit_bias={cats: 100.0})
    assert forced.completion == " cats" * 5 and forced.usage.output_tokens == 5

    # a ban and a boost together, token for token what vLLM's server makes of the same request
    plain = vanilla(api, temperature=0.0, max_tokens=6).outputs[0]
    bias = {plain.token_ids[0]: -100.0, plain.token_ids[1]: 7.5}
    expected = vanilla(api, temperature=0.0, max_tokens=6, logit_bias=bias).outputs[0]
    assert expected.token_ids != plain.token_ids and expected.token_ids[0] != plain.token_ids[0]
    biased = generate(api, temperature=0.0, max_tokens=6, logit_bias=bias)
    assert biased.completion == expected.text

    # the instrumented path: steered and captured, the bias still decides every token
    forced = steered(api, temperature=0.0, max_tokens=5, logit_bias={cats: 100.0}, num_choices=1)
    assert forced.completion == " cats" * 5

    vocab = 49152
    for bias, words in [
        ({vocab: 1.0}, ["logit_bias", str(vocab), "vocabulary"]),
        ({-1: 1.0}, ["logit_bias", "-1"]),
        ({cats: 100.5}, ["logit_bias", "100.5", "-100"]),
        ({cats: -1000.0}, ["logit_bias", "-1000"]),
        ({cats: math.nan}, ["logit_bias", "nan"]),
        ({cats: math.inf}, ["logit_bias", "inf"]),
    ]:
        with pytest.raises(SpecError) as caught:
            generate(api, max_tokens=2, logit_bias=bias)
        assert all(word in str(caught.value) for word in words), str(caught.value)


# -- prompt_logprobs ----------------------------------------------------------------------------
def _as_served(prompt_logprobs: list[Any]) -> list[Any]:
    """vLLM's ``prompt_logprobs`` as its OpenAI server sends them (JSON, -inf clamped to -9999)."""
    served = [
        None
        if entry is None
        else {
            str(token): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for token, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
    return json.loads(json.dumps(served))


def test_prompt_logprobs_are_reported_as_inspects_vllm_provider_reports_them(api, tiny_llama_dir, tmp_path):
    from inspect_ai.model._openai import parse_vllm_prompt_logprobs_raw

    plain = generate(api, temperature=0.0, max_tokens=3)  # the prompt is now in the prefix cache
    assert plain.choices[0].prompt_logprobs is None

    output = generate(api, temperature=0.0, max_tokens=3, prompt_logprobs=2)
    reference = vanilla(api, temperature=0.0, max_tokens=3, prompt_logprobs=2)
    expected = parse_vllm_prompt_logprobs_raw(_as_served(reference.prompt_logprobs))
    got = output.choices[0].prompt_logprobs
    assert got is not None and expected is not None
    # every prompt token but the first (which has no context), cached prefix or not
    assert len(got.content) == output.usage.input_tokens - 1 == len(reference.prompt_token_ids) - 1
    assert got.model_dump() == expected.model_dump()
    prompt_ids = reference.prompt_token_ids
    assert [entry.token for entry in got.content] == [api.tokenizer.decode([t]) for t in prompt_ids[1:]]
    assert all(entry.top_logprobs is None or len(entry.top_logprobs) <= 2 for entry in got.content)

    # several choices: each carries the prompt's logprobs, as vLLM's server puts them on the response
    several = generate(api, temperature=1.0, seed=5, max_tokens=3, num_choices=2, prompt_logprobs=1)
    assert len(several.choices) == 2
    assert several.choices[0].prompt_logprobs == several.choices[1].prompt_logprobs is not None

    # steered: the steered model's prompt logprobs (steering at layer 1 moves them), every row
    steered_out = steered(api, temperature=0.0, max_tokens=3, prompt_logprobs=2)
    moved = steered_out.choices[0].prompt_logprobs
    assert moved is not None and len(moved.content) == len(got.content)
    assert [e.token for e in moved.content] == [e.token for e in got.content]
    assert [e.logprob for e in moved.content] != [e.logprob for e in got.content]

    # through Inspect's eval(): the log keeps them
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import generate as generate_solver

    with provider_model_args() as args:
        task = Task(dataset=[Sample(input=QUESTION)], solver=generate_solver())
        log = eval(
            task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path), display="none",
            max_tokens=3, temperature=0.0, prompt_logprobs=1,
        )[0]  # fmt: skip
    assert log.status == "success", log.error
    logged = log.samples[0].output.choices[0].prompt_logprobs
    assert logged is not None and len(logged.content) == len(got.content)


# -- best_of ------------------------------------------------------------------------------------
def test_best_of_is_refused_by_name_before_generation(api, monkeypatch):
    async def never(*args: Any) -> Any:
        raise AssertionError("best_of reached the engine")

    monkeypatch.setattr(api, "_run_all", never)
    with pytest.raises(SpecError, match=r"best_of=3 is not supported by vLLM's V1 engine.*num_choices"):
        generate(api, best_of=3)
    with pytest.raises(SpecError, match="best_of"):
        generate(api, best_of=2, extra_body={"tlvllm": STEER})
    monkeypatch.undo()
    assert generate(api, best_of=1, max_tokens=2, temperature=0.0).usage.output_tokens == 2  # best of one: the one


# -- response_schema ----------------------------------------------------------------------------
SCHEMA = ResponseSchema(
    name="verdict",
    json_schema=JSONSchema(
        type="object",
        properties={"answer": JSONSchema(type="string", enum=["yes", "no"]), "sure": JSONSchema(type="boolean")},
        required=["answer", "sure"],
        additionalProperties=False,
    ),
)


def test_response_schema_constrains_the_completion_to_json_that_matches_it(api):
    """vLLM's structured outputs (xgrammar on the CPU build), as its server applies ``response_format``.
    vLLM's default grammar lets whitespace in between; the random model would fill the answer with
    it, so the test bans whitespace tokens with logit_bias."""
    tokenizer = api.tokenizer
    eos = tokenizer.eos_token_id
    no_space = {i: -100.0 for i in range(len(tokenizer)) if i != eos and tokenizer.decode([i]).strip() == ""}
    schema = SCHEMA.json_schema.model_dump(exclude_none=True)
    config = {"temperature": 0.0, "max_tokens": 40, "logit_bias": no_space, "response_schema": SCHEMA}

    unconstrained = generate(api, temperature=0.0, max_tokens=40, logit_bias=no_space)
    with pytest.raises(ValueError):
        json.loads(unconstrained.completion)

    output = generate(api, **config)
    assert output.choices[0].stop_reason == "stop", output.completion
    jsonschema.validate(json.loads(output.completion), schema)
    from vllm.sampling_params import StructuredOutputsParams

    structured = StructuredOutputsParams(json=schema)
    reference = vanilla(api, temperature=0.0, max_tokens=40, logit_bias=no_space, structured_outputs=structured)
    assert output.completion == reference.outputs[0].text

    constrained = steered(api, **config, num_choices=2)  # two requests, each with its own grammar
    assert len(constrained.choices) == 2
    for choice in constrained.choices:
        assert choice.stop_reason == "stop", choice.message.text
        jsonschema.validate(json.loads(choice.message.text), schema)

    several = generate(api, **{**config, "temperature": 1.0, "seed": 2, "num_choices": 2})
    for choice in several.choices:
        jsonschema.validate(json.loads(choice.message.text), schema)


# -- the other fields ---------------------------------------------------------------------------
def test_parallel_tool_calls_false_keeps_only_the_first_call_as_vllms_server_does(api):
    from inspect_ai.tool import ToolInfo, ToolParam, ToolParams

    add = ToolInfo(name="add", description="Add", parameters=ToolParams(properties={"x": ToolParam(type="integer")}))
    text = (
        '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "add", "arguments": {"x": 2}}</tool_call>'
    )
    completion = SimpleNamespace(text=text, token_ids=[1, 2, 3], finish_reason="stop", logprobs=None)
    final = SimpleNamespace(outputs=[completion], prompt_logprobs=None)
    for parallel, calls in [(None, 2), (True, 2), (False, 1)]:
        output = api._model_output([final], 10, [add], GenerateConfig(parallel_tool_calls=parallel))
        tool_calls = output.choices[0].message.tool_calls
        assert [call.arguments["x"] for call in tool_calls] == [1, 2][:calls]


def test_reasoning_effort_means_what_it_means_on_vllm_or_is_refused(api, monkeypatch):
    """Inspect's vllm/ passes reasoning_effort to the chat template: with a template that does not
    read it, the same answer (Inspect's agent bridge sets it from an agent's requests); with one
    that does, which tl-vllm renders without it, refused by name."""
    plain = generate(api, temperature=0.0, max_tokens=4)
    assert generate(api, temperature=0.0, max_tokens=4, reasoning_effort="high").completion == plain.completion

    async def never(*args: Any) -> Any:
        raise AssertionError("reasoning_effort reached the engine")

    monkeypatch.setattr(api, "_run_all", never)
    template = "{% if reasoning_effort %}effort: {{ reasoning_effort }}{% endif %}" + api.tokenizer.chat_template
    monkeypatch.setattr(api, "chat_template", template)
    with pytest.raises(SpecError, match=r"reasoning_effort='high'.*chat template reads"):
        generate(api, reasoning_effort="high")


def test_output_modalities_are_refused_by_name(api, monkeypatch):
    async def never(*args: Any) -> Any:
        raise AssertionError("modalities reached the engine")

    monkeypatch.setattr(api, "_run_all", never)
    with pytest.raises(SpecError, match=r"modalities=\['image'\]: vLLM generates text only"):
        generate(api, modalities=["image"])
