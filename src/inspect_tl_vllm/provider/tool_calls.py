"""Tool calls read from a completion's text, for models whose chat template renders tools.

vLLM's offline engine returns text; the server's tool parsers are not part of it.  Open-weight
chat models write a tool call in one of a few conventions, all JSON objects with a ``name`` and
``arguments`` (or ``parameters``):

- inside ``<tool_call>...</tool_call>`` tags (Hermes, Qwen, SmolLM2; one object or a list);
- in a fenced ````json`` block;
- as the whole reply, possibly after a marker (Llama 3's ``<|python_tag|>``, Mistral's
  ``[TOOL_CALLS]``; one object or a list).

Text outside the calls stays the message's content.  A call whose JSON does not parse, or that
lacks a name, comes back as a ``ToolCall`` with ``parse_error`` set, which Inspect reports to
the model, as its own providers do.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from inspect_ai.tool import ToolCall, ToolInfo

_TAGGED = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FENCED = re.compile(r"```json\s*(.*?)\s*```", re.DOTALL)
_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")


def parse_tool_calls(text: str, tools: list[ToolInfo]) -> tuple[str, list[ToolCall]]:
    """Split ``text`` into the message content and the tool calls it makes (none: ``(text, [])``)."""
    tagged = _TAGGED.findall(text)
    if tagged:
        return _TAGGED.sub("", text).strip(), [call for block in tagged for call in _calls(block, tools)]
    fenced = [block for block in _FENCED.findall(text) if _looks_like_call(block)]
    if fenced:
        rest = _FENCED.sub(lambda m: "" if _looks_like_call(m.group(1)) else m.group(0), text)
        return rest.strip(), [call for block in fenced for call in _calls(block, tools)]
    bare = text.strip()
    for marker in _MARKERS:
        bare = bare.removeprefix(marker).strip()
    if bare[:1] in "{[" and _looks_like_call(bare):
        try:
            json.loads(bare)
        except ValueError:
            return text, []  # prose that merely starts with a brace
        return "", _calls(bare, tools)
    return text, []


def _looks_like_call(block: str) -> bool:
    return '"name"' in block and ('"arguments"' in block or '"parameters"' in block)


def _calls(block: str, tools: list[ToolInfo]) -> list[ToolCall]:
    try:
        data = json.loads(block)
    except ValueError as err:
        return [_failed(f"tool call is not valid JSON ({err}): {block.strip()[:200]}")]
    items = data if isinstance(data, list) else [data]
    return [_call(item, tools) for item in items]


def _call(item: Any, tools: list[ToolInfo]) -> ToolCall:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return _failed(f"tool call needs a JSON object with a 'name' and 'arguments': {json.dumps(item)[:200]}")
    name = item["name"]
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _string_arguments(arguments, name, tools)
    if not isinstance(arguments, dict):
        return _failed(f"arguments of tool call '{name}' must be a JSON object, got {json.dumps(arguments)[:200]}")
    return ToolCall(id=_call_id(name), function=name, arguments=arguments)


def _string_arguments(arguments: str, name: str, tools: list[ToolInfo]) -> Any:
    """Arguments some models send as a JSON string, or as the bare value of a one-parameter tool."""
    try:
        return json.loads(arguments)
    except ValueError:
        pass
    tool = next((t for t in tools if t.name == name), None)
    params = list(tool.parameters.properties) if tool is not None else []
    return {params[0]: arguments} if len(params) == 1 else arguments


def _failed(message: str) -> ToolCall:
    return ToolCall(id=_call_id("unknown"), function="unknown", arguments={}, parse_error=message)


def _call_id(name: str) -> str:
    return f"{name}_{uuid.uuid4().hex[:12]}"
