"""Reading what users write (spec files, inline JSON, ``KEY=VALUE`` values) strictly.

A spec steers a whole run, so a misread is a silently wrong experiment. PyYAML reads YAML 1.1,
where ``010`` is 8 (octal), ``1:30`` is 90 (base 60), ``1_000`` is 1000, ``on``/``yes``/``off``/
``no`` are booleans and ``2024-01-01`` is a date, while YAML 1.2 and JSON read the same text as
10 or as text; and PyYAML and Python's ``json`` both keep the last of two equal keys without a word.
So these readers:

- refuse a key given twice in one mapping or object (YAML and JSON alike);
- read unquoted YAML scalars by YAML 1.2's core schema (the one JSON agrees with: ``1e-3`` is a
  number, where PyYAML reads text because its floats need a dot);
- refuse an unquoted YAML scalar that YAML 1.1 reads as another value than YAML 1.2 does (and so
  other tools, Inspect's own ``-M``/``-T`` parsing among them, would read differently), and every
  integer with a leading zero; the error gives the spelling that means the number, or quotes for
  text. Quoted scalars are always text; explicit tags (``!!int 010``) are taken as written.

Numbers pass on as written (``.inf`` and ``NaN`` included): their ranges and finiteness are the
specs' own checks (``specs.py``). Every error is a ``SpecError`` naming the file, the line and the fix.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, ScalarNode

from inspect_tl_vllm.specs import SpecError

YAML_SUFFIXES = (".yaml", ".yml")

_STR, _MERGE, _VALUE = "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge", "tag:yaml.org,2002:value"
_AMBIGUOUS = "tag:tlvllm:ambiguous"
"""The tag of an unquoted scalar that YAML 1.1 and 1.2 read differently: its constructor refuses it."""
_CORE_SCHEMA = (  # YAML 1.2.2, section 10.3.2 (tag resolution of the core schema)
    ("tag:yaml.org,2002:null", re.compile(r"~|null|Null|NULL|")),
    ("tag:yaml.org,2002:bool", re.compile(r"true|True|TRUE|false|False|FALSE")),
    ("tag:yaml.org,2002:int", re.compile(r"[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+")),
    (
        "tag:yaml.org,2002:float",
        re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"),
    ),
)
_LEADING_ZERO = re.compile(r"([-+]?)0+([0-9]+)")

Where = Callable[[int], str]
"""The place of line ``n`` (1-based) of the text being read, as an error names it."""


def load_spec_file(path: Path) -> Any:
    """A ``.yaml``/``.yml`` file read as YAML, any other as JSON, strictly (see the module's doc)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(f"{path}: cannot read it: {err}") from None
    if path.suffix.lower() in YAML_SUFFIXES:
        return parse_yaml(text, str(path))
    return parse_json(text, str(path))


def parse_yaml(text: str, source: str) -> Any:
    """One YAML document, strictly; errors name ``source:line``."""
    return _load_yaml(text, lambda line: f"{source}:{line}")


def parse_value(text: str, source: str) -> Any:
    """A one-line YAML value (``KEY=VALUE`` on a command line: ``true``, ``3``, ``0.5``, text, ``[1, 2]``),
    strictly; errors name ``source`` (the value has no lines to count)."""
    return _load_yaml(text, lambda _line: source)


def parse_json(text: str, source: str, *, first_line: int = 1) -> Any:
    """One JSON value with no key given twice in an object; errors name ``source:line``, counting
    from ``first_line`` (a line of a JSONL file)."""
    try:
        return _json_decoder(source, first_line).decode(text)
    except json.JSONDecodeError as err:
        line = err.lineno + first_line - 1
        raise SpecError(f"{source}:{line}: not valid JSON: {err.msg} (column {err.colno})") from None


def _json_decoder(source: str, first_line: int) -> json.JSONDecoder:
    """A decoder whose objects refuse a key given twice. ``object_pairs_hook`` would see the pairs but
    not where they are, so objects are parsed by the standard ``JSONObject`` through a ``scan_once``
    that records where each value starts (hence the pure-Python scanner: the C one parses objects
    itself). It parses a 2,048-number vector in a few milliseconds, once per spec."""
    decoder = json.JSONDecoder()

    def parse_object(
        s_and_end: tuple[str, int],
        strict: bool,
        scan_once: Callable[[str, int], tuple[Any, int]],
        object_hook: object,
        object_pairs_hook: object,
        memo: dict[str, str] | None = None,
    ) -> tuple[dict[str, Any], int]:
        starts: list[int] = []

        def value_at(string: str, index: int) -> tuple[Any, int]:
            starts.append(index)
            return scan_once(string, index)

        pairs, end = json.decoder.JSONObject(s_and_end, strict, value_at, None, list, memo)
        result: dict[str, Any] = {}
        first: dict[str, int] = {}
        for (key, value), start in zip(pairs, starts, strict=True):
            if key in result:
                line, earlier = (s_and_end[0].count("\n", 0, at) + first_line for at in (start, first[key]))
                raise SpecError(
                    f"{source}:{line}: key {key!r} is given twice (first on line {earlier}); "
                    "JSON readers keep only the last, so remove one"
                )
            result[key], first[key] = value, start
        return result, end

    decoder.parse_object = parse_object  # type: ignore[method-assign]
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    return decoder


def _load_yaml(text: str, where: Where) -> Any:
    loader = _StrictLoader(text, where)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = "; ".join(part for part in (err.context, err.problem) if part)
        raise SpecError(f"{where(line)}: not valid YAML: {problem}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{where(1)}: not valid YAML: {err}") from None
    finally:
        loader.dispose()


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's core schema for unquoted scalars, refusing those YAML 1.1
    reads otherwise, and refusing a key given twice in one mapping."""

    def __init__(self, text: str, where: Where) -> None:
        super().__init__(text)
        self.where = where

    def resolve(self, kind: type, value: str, implicit: tuple[bool, bool]) -> str:
        if kind is not ScalarNode or not implicit[0]:  # quoted scalars, mappings, sequences: as YAML 1.1
            return super().resolve(kind, value, implicit)
        yaml11 = super().resolve(kind, value, implicit)
        if yaml11 == _MERGE:  # '<<' merges an anchored mapping; YAML 1.2 dropped it, but it misreads nothing
            return yaml11
        core = next((tag for tag, pattern in _CORE_SCHEMA if pattern.fullmatch(value)), _STR)
        if _LEADING_ZERO.fullmatch(value) or (core == _STR and yaml11 not in (_STR, _VALUE)):
            return _AMBIGUOUS
        return core

    def compose_mapping_node(self, anchor: str | None) -> MappingNode:
        """Checked here, where the node holds its keys as written (constructing a mapping first flattens
        its ``<<`` merges, whose keys the mapping's own may override)."""
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE:
                continue
            line, key = key_node.start_mark.line + 1, (key_node.tag, key_node.value)
            if key in first:
                raise SpecError(
                    f"{self.where(line)}: key {key_node.value!r} is given twice in one mapping (first on line "
                    f"{first[key]}); YAML readers keep only the last, so remove one"
                )
            first[key] = line
        return node


def _refuse_ambiguous(loader: _StrictLoader, node: ScalarNode) -> Any:
    """The error for an unquoted scalar that YAML 1.1 reads otherwise than YAML 1.2 (see ``resolve``)."""
    text = node.value
    where = loader.where(node.start_mark.line + 1)
    zeros = _LEADING_ZERO.fullmatch(text)
    if zeros:
        number = int(zeros.group(1) + zeros.group(2))
        raise SpecError(
            f"{where}: {text!r} has a leading zero, which YAML 1.1 reads as octal (010 is 8) and YAML 1.2 as "
            f"decimal (010 is 10); write {number} for the number, or quote it ('{text}') for text"
        )
    yaml11 = yaml.safe_load(text)
    if isinstance(yaml11, bool):
        reading, fix = str(yaml11).lower(), "write true or false for a boolean, or "
    elif isinstance(yaml11, int | float):
        reading, fix = repr(yaml11), f"write {yaml11!r} for the number, or "
    else:  # a date or a time
        reading, fix = f"a {type(yaml11).__name__} ({yaml11})", ""
    raise SpecError(
        f"{where}: {text!r} is ambiguous: YAML 1.1 reads it as {reading}, YAML 1.2 and JSON as text; "
        f"{fix}quote it ('{text}') for text"
    )


_StrictLoader.add_constructor(_AMBIGUOUS, _refuse_ambiguous)
