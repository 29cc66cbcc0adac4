"""What an index entry may hold, checked before anything uses it.

An index line (a line of a local ``index.jsonl``, a remote ``index/<file>.json`` object, a line of
a shard's ``.jsonl``) is data that can be edited or corrupt, and Python's JSON parser takes
``Infinity``, ``NaN`` and ``1e400`` (an infinite float), raises ``RecursionError`` on deep nesting,
and hands back any type in any field. So every reader parses index lines with ``parse_entry`` alone:
a line that does not parse, or whose fields are not of their type and range, is skipped with a
warning naming its file and line, and no later ``int()``, ``pread`` or ``range()`` sees a value that
raises or allocates without bound. ``stored_problem`` is the part that describes the stored bytes
(file, checksum, shard span, hooks); ``read_sample`` applies it to a log's record of an entry too.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
import warnings
from typing import Any

MAX_BYTES = 1 << 62
"""Bound on an offset, a length, a dimension or a row count (an offset plus a length stays within a
signed 64-bit file offset)."""
MAX_EPOCH = 1 << 31
MAX_POSITION = 1 << 31
"""Bound on a token position: no model's context comes near it."""
MAX_SAMPLE_ID = 1 << 63
"""Bound on a whole-number sample id (either sign)."""
MAX_DEPTH = 8
"""How deeply an entry may nest objects and lists (the provider writes 4 levels: entry, hooks, a
hook, its positions); anything deeper is refused before it is walked or written again."""

_SHA256 = re.compile(r"[0-9a-f]{64}")


def parse_entry(blob: bytes, where: str) -> dict[str, Any] | None:
    """The entry of one index line (``blob``), or ``None`` after a warning that names ``where`` (its
    file and line) and what is wrong: a torn line (power lost mid-append) or an edited one must hide
    only itself, never every other sample's entry."""
    try:
        entry = json.loads(blob, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        problem = "nested too deeply to parse"
    except ValueError as err:  # not JSON, not UTF-8, a non-finite number, an integer of over 4300 digits
        problem = f"not JSON: {err}"
    else:
        problem = entry_problem(entry)
    if problem is None:
        return entry
    warnings.warn(f"{where}: skipping an unreadable index entry ({problem})", stacklevel=4)
    return None


def entry_problem(entry: Any) -> str | None:
    """What makes a parsed index line unusable, or ``None``: it joins its bytes to a sample (id and
    epoch) and describes them (``stored_problem``)."""
    if not isinstance(entry, dict):
        return "not a JSON object"
    if _deeper_than(entry, MAX_DEPTH):
        return f"nested more than {MAX_DEPTH} levels deep"
    sample_id = entry.get("sample_id")
    if not (isinstance(sample_id, str) or _whole(sample_id, -MAX_SAMPLE_ID, MAX_SAMPLE_ID)):
        return f"sample_id must be a string or a whole number within ±2**63, got {_shown(sample_id)}"
    if not _whole(entry.get("epoch"), 1, MAX_EPOCH):
        return f"epoch must be a whole number from 1 to below 2**31, got {_shown(entry.get('epoch'))}"
    for key in ("call", "input_messages"):  # the sample's model call it holds (0 first), and its input's length
        if key in entry and not _whole(entry[key], 0, MAX_EPOCH):
            return f"{key} must be a whole number from 0 to below 2**31, got {_shown(entry[key])}"
    for key in ("eval_id", "sample_uuid", "model", "reduce"):
        if entry.get(key) is not None and not isinstance(entry[key], str):
            return f"{key} must be a string, got {_shown(entry[key])}"
    if not isinstance(entry.get("carried_from", {}), dict):
        return f"carried_from must be an object, got {_shown(entry['carried_from'])}"
    return stored_problem(entry)


def stored_problem(entry: dict[str, Any]) -> str | None:
    """What makes an entry's description of its stored bytes unusable, or ``None``: ``file`` a
    string (``Folder.file`` then checks the name), ``sha256`` a hex digest, a shard's ``offset`` and
    ``length`` byte counts, and ``hooks`` each tensor's shape and dtype (the bytes read must hold
    exactly those: ``layout.read_sample``), its row count and one position per row."""
    if not isinstance(entry.get("file"), str):
        return f"file must be a file name, got {_shown(entry.get('file'))}"
    if not (isinstance(entry.get("sha256"), str) and _SHA256.fullmatch(entry["sha256"])):
        return f"sha256 must be 64 lowercase hexadecimal digits, got {_shown(entry.get('sha256'))}"
    if "offset" in entry or "length" in entry:  # a shard's entry
        for key in ("offset", "length"):
            if not _whole(entry.get(key), 0, MAX_BYTES):
                return f"{key} must be a whole number of bytes from 0 to below 2**62, got {_shown(entry.get(key))}"
    hooks = entry.get("hooks")
    if not isinstance(hooks, dict):
        return f"hooks must map each hook point to its shape and dtype, got {_shown(hooks)}"
    for hook, info in hooks.items():
        problem = _hook_problem(info)
        if problem is not None:
            return f"hooks[{_shown(hook)}]: {problem}"
    return None


def _hook_problem(info: Any) -> str | None:
    if not isinstance(info, dict):
        return f"must be an object with shape and dtype, got {_shown(info)}"
    shape = info.get("shape")
    if not (isinstance(shape, list) and all(_whole(size, 0, MAX_BYTES) for size in shape)):
        return f"shape must be a list of whole numbers from 0 to below 2**62, got {_shown(shape)}"
    if not isinstance(info.get("dtype"), str):
        return f"dtype must be a dtype's name, got {_shown(info.get('dtype'))}"
    if "tokens" in info and not _whole(info["tokens"], 0, MAX_BYTES):
        return f"tokens must be a whole number from 0 to below 2**62, got {_shown(info['tokens'])}"
    if "positions" in info and shape[:1] != [_positions_count(info["positions"])]:
        return (
            f"positions must give one position from 0 to below 2**31 for each of the shape's rows "
            f"({_shown(shape)}), got {_shown(info['positions'])}"
        )
    return None


def _positions_count(packed: Any) -> int | None:
    """How many positions ``layout.pack_positions``' form holds, or ``None`` when it is not that form
    or a position is out of range."""
    if isinstance(packed, dict):
        start, stop = packed.get("start"), packed.get("stop")
        if _whole(start, 0, MAX_POSITION) and _whole(stop, 0, MAX_POSITION + 1) and start <= stop:
            return stop - start
        return None
    if isinstance(packed, list) and all(_whole(position, 0, MAX_POSITION) for position in packed):
        return len(packed)
    return None


def _whole(value: Any, low: int, high: int) -> bool:
    """Whether ``value`` is an int (not a bool, not a float such as ``1.0``) with ``low <= value < high``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


def _deeper_than(value: Any, levels: int) -> bool:
    """Whether ``value`` nests objects and lists more than ``levels`` deep; the walk stops at the
    limit, so it never recurses further than that."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None:
        return False
    return levels == 0 or any(_deeper_than(child, levels - 1) for child in children)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def _shown(value: Any) -> str:
    """``value`` for a message, cut short (a line may hold megabytes)."""
    return reprlib.repr(value)
