"""Steering and capture specifications: the one vocabulary every layer speaks.

Pure pydantic (no torch, no vLLM) so that Inspect can validate sample metadata and task
arguments cheaply, and so the same objects travel to vLLM workers as plain JSON inside
``SamplingParams.extra_args``.

Positions: row ``p`` of a capture, and position ``p`` of an intervention, is the forward
pass whose *input* token is token ``p`` of the sequence (prompt tokens ``0..P-1``, then the
generated tokens).  Negative indices count from the end of the prompt (``-1`` is ``P-1``).
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

BLOCK_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
FINAL_HOOK = "ln_final.hook_normalized"
_BLOCK_RE = re.compile(r"^blocks\.(\d+)\.(" + "|".join(BLOCK_HOOKS) + r")$")

PositionScope = Literal["all", "prompt", "generated"] | list[int]
"""Which token rows an intervention or capture covers: a named scope or explicit indices."""

TAG = "tlvllm"
"""Key under which a request's spec travels in ``SamplingParams.extra_args``."""


class SpecError(ValueError):
    """A steering or capture spec is wrong; the message names the field and the fix."""


def parse_hook_point(name: str) -> tuple[int | None, str]:
    """Split a hook point name into (layer, kind); layer is None for ``ln_final``."""
    if name == FINAL_HOOK:
        return None, "ln_final"
    match = _BLOCK_RE.match(name)
    if match:
        return int(match.group(1)), match.group(2)[len("hook_") :]
    layer = re.search(r"\d+", name)
    known = [f"blocks.{layer.group(0) if layer else 0}.{hook}" for hook in BLOCK_HOOKS] + [FINAL_HOOK]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise SpecError(
        f"unknown hook point {name!r}.{hint} Valid names: blocks.<layer>.<hook> with <hook> one of "
        f"{', '.join(BLOCK_HOOKS)}; or {FINAL_HOOK}."
    )


def _check_scope(value: PositionScope) -> PositionScope:
    if isinstance(value, list):
        if not value:
            raise SpecError("positions: an empty list selects no token; use 'all', 'prompt', 'generated' or indices")
        if len(set(value)) != len(value):
            raise SpecError(f"positions: duplicate indices in {value}")
    return value


class Intervention(BaseModel):
    """One edit of the activations at one hook point.

    - ``add``:    h + coef * v
    - ``scale``:  h * coef
    - ``set``:    coef * v (replaces the activation)
    - ``ablate``: h - coef * (h . u) u with u = v / |v| (coef 1 projects the direction out)
    """

    model_config = ConfigDict(extra="forbid")

    hook: str = Field(description="Hook point, e.g. blocks.6.hook_resid_post")
    op: Literal["add", "scale", "set", "ablate"] = "add"
    vector: list[float] | str | None = Field(
        default=None,
        description="Inline numbers, a file (.safetensors, .npy, .pt) as 'path' or 'path:key', "
        "or 'sha256:<hex>' of a vector already uploaded.",
    )
    coef: float = 1.0
    positions: PositionScope = "all"

    @field_validator("hook")
    @classmethod
    def _hook(cls, value: str) -> str:
        parse_hook_point(value)
        return value

    @field_validator("coef")
    @classmethod
    def _coef(cls, value: float) -> float:
        if not math.isfinite(value):
            raise SpecError(f"coef: must be a finite number, got {value}")
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: PositionScope) -> PositionScope:
        return _check_scope(value)

    @field_validator("vector")
    @classmethod
    def _vector(cls, value: list[float] | str | None) -> list[float] | str | None:
        if isinstance(value, list):
            if not value:
                raise SpecError("vector: empty list")
            # A NaN or inf entry makes the sum NaN or inf; a finite sum clears every entry at once
            # (5x faster than testing each of thousands); an overflowing sum gets the slow look.
            if not math.isfinite(sum(value)):
                bad = next((i for i, x in enumerate(value) if not math.isfinite(x)), None)
                if bad is not None:
                    raise SpecError(f"vector: entry {bad} is {value[bad]}; vectors must be finite (no NaN/inf)")
        return value

    @model_validator(mode="after")
    def _needs_vector(self) -> Intervention:
        if self.op == "scale" and self.vector is not None:
            raise SpecError("vector: op 'scale' takes no vector (it multiplies by coef)")
        if self.op != "scale" and self.vector is None:
            raise SpecError(f"vector: op {self.op!r} needs a vector (inline list or file path)")
        return self


class Capture(BaseModel):
    """Which activations to bring back for a request, and how to reduce them."""

    model_config = ConfigDict(extra="forbid")

    hooks: list[str] = Field(min_length=1, description="Hook points to record")
    positions: PositionScope = "all"
    reduce: Literal["none", "mean", "last", "max_norm"] = Field(
        default="none",
        description="none: one row per token; mean / last / max_norm (row of largest L2 norm): one row per sample",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"

    @field_validator("hooks")
    @classmethod
    def _hooks(cls, value: list[str]) -> list[str]:
        for name in value:
            parse_hook_point(name)
        if len(set(value)) != len(value):
            raise SpecError(f"hooks: duplicate hook points in {value}")
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: PositionScope) -> PositionScope:
        return _check_scope(value)


class RequestSpec(BaseModel):
    """Everything one request (one sample's generation) asks of the instrumentation."""

    model_config = ConfigDict(extra="forbid")

    interventions: list[Intervention] = Field(default_factory=list)
    capture: Capture | None = None

    @property
    def empty(self) -> bool:
        return not self.interventions and self.capture is None

    def merged(self, other: RequestSpec | None) -> RequestSpec:
        """Run-wide spec plus a per-sample one: interventions stack, the sample's capture wins."""
        if other is None:
            return self
        return RequestSpec(
            interventions=[*self.interventions, *other.interventions],
            capture=other.capture if other.capture is not None else self.capture,
        )


DEFAULT_HOOK_POINTS = ("blocks.*.hook_resid_pre", "blocks.*.hook_resid_post", FINAL_HOOK)


class InstrumentConfig(BaseModel):
    """Engine-wide settings, fixed at boot: they shape the buffers that torch.compile sees."""

    model_config = ConfigDict(extra="forbid")

    hook_points: list[str] = Field(
        default_factory=lambda: list(DEFAULT_HOOK_POINTS),
        description="Hook points that requests may steer or capture; '*' stands for every layer, "
        "'all' for every hook point of every layer.",
    )
    max_stack: Annotated[int, Field(ge=1, le=8)] = Field(
        default=2, description="How many interventions one request may stack at one hook point"
    )
    max_vectors: Annotated[int, Field(ge=1)] = Field(default=256, description="Capacity of the worker's vector bank")
    capture_bytes_per_request: Annotated[int, Field(ge=1)] = Field(
        default=1 << 30, description="Largest capture one request may produce"
    )

    @field_validator("hook_points")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for name in value:
            if name != "all":
                parse_hook_point(name.replace("*", "0"))
        return value


def parse_request_spec(raw: Any, where: str = "spec") -> RequestSpec:
    """Validate user input into a RequestSpec; errors name ``where`` and the failing field."""
    if isinstance(raw, RequestSpec):
        return raw
    try:
        return RequestSpec.model_validate(raw)
    except SpecError as err:
        raise SpecError(f"{where}: {err}") from None
    except ValueError as err:  # pydantic.ValidationError
        raise SpecError(f"{where}: {_readable(err)}") from None


def _readable(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    parts = []
    for item in errors():
        loc = ".".join(str(x) for x in item.get("loc", ()))
        msg = str(item.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
