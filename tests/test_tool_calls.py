"""Tool calls parsed from completion text in the conventions open-weight models use."""

from __future__ import annotations

import json

import pytest
from inspect_ai.tool import ToolInfo, ToolParam, ToolParams

from inspect_tl_vllm.provider.tool_calls import parse_tool_calls

ADD = ToolInfo(
    name="add",
    description="Add two numbers",
    parameters=ToolParams(properties={"x": ToolParam(type="integer"), "y": ToolParam(type="integer")}),
)
SEARCH = ToolInfo(
    name="search", description="Search", parameters=ToolParams(properties={"query": ToolParam(type="string")})
)
TOOLS = [ADD, SEARCH]


def test_tagged_calls_keep_the_surrounding_text():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"x": 1, "y": 2}}</tool_call>'
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me add."
    assert [(c.function, c.arguments, c.parse_error) for c in calls] == [("add", {"x": 1, "y": 2}, None)]


def test_a_tagged_list_and_several_tags_give_every_call_with_distinct_ids():
    text = (
        '<tool_call>[{"name": "add", "arguments": {"x": 1, "y": 2}}, {"name": "search", "arguments": {"query": "a"}}]'
        '</tool_call>\n<tool_call>{"name": "add", "parameters": {"x": 3, "y": 4}}</tool_call>'
    )
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == ""
    assert [c.function for c in calls] == ["add", "search", "add"]
    assert calls[2].arguments == {"x": 3, "y": 4}
    assert len({c.id for c in calls}) == 3


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "parameters": {"x": 5, "y": 6}}',
        '<|python_tag|>{"name": "add", "arguments": {"x": 5, "y": 6}}',
        '[TOOL_CALLS][{"name": "add", "arguments": {"x": 5, "y": 6}}]',
        'Sure:\n```json\n{"name": "add", "arguments": {"x": 5, "y": 6}}\n```',
    ],
)
def test_bare_marked_and_fenced_calls(text):
    content, calls = parse_tool_calls(text, TOOLS)
    assert [(c.function, c.arguments) for c in calls] == [("add", {"x": 5, "y": 6})]
    assert content in ("", "Sure:")


def test_string_arguments_are_decoded_or_given_to_the_only_parameter():
    encoded = json.dumps({"name": "add", "arguments": json.dumps({"x": 1, "y": 2})})
    assert parse_tool_calls(f"<tool_call>{encoded}</tool_call>", TOOLS)[1][0].arguments == {"x": 1, "y": 2}
    plain = '<tool_call>{"name": "search", "arguments": "capital of France"}</tool_call>'
    assert parse_tool_calls(plain, TOOLS)[1][0].arguments == {"query": "capital of France"}
    ambiguous = '<tool_call>{"name": "add", "arguments": "one and two"}</tool_call>'
    (call,) = parse_tool_calls(ambiguous, TOOLS)[1]
    assert call.parse_error and "must be a JSON object" in call.parse_error


@pytest.mark.parametrize(
    "block, message",
    [
        ('{"name": "add", "arguments": {"x": 1', "not valid JSON"),
        ('{"arguments": {"x": 1}}', "needs a JSON object with a 'name'"),
        ('"add"', "needs a JSON object with a 'name'"),
    ],
)
def test_malformed_calls_come_back_with_a_parse_error_for_the_model(block, message):
    content, calls = parse_tool_calls(f"ok <tool_call>{block}</tool_call>", TOOLS)
    assert content == "ok"
    assert len(calls) == 1 and calls[0].function == "unknown" and message in (calls[0].parse_error or "")


@pytest.mark.parametrize(
    "text",
    [
        "The capital of France is Paris.",
        '{"answer": 4}',
        '{"name": "add", "arguments": not json',
        'Use ```json\n{"x": 1}\n``` for config.',
    ],
)
def test_replies_without_a_call_are_left_alone(text):
    assert parse_tool_calls(text, TOOLS) == (text, [])
