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
import fnmatch
import math
import re
import struct
from typing import Annotated, Any, Literal, get_args

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

BLOCK_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
"""The residual-stream-wide hook points of a block (d_model numbers per token)."""
HEAD_HOOKS = ("attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_z")
"""Per-head hook points of a block's attention: [pos, head, d_head] per token, as TransformerLens."""
NEURON_HOOKS = ("mlp.hook_pre", "mlp.hook_post")
"""A dense MLP's neurons: the gate's pre-activation and the input of the down projection, [pos, d_mlp]."""
ROUTER_HOOK = "mlp.hook_router_logits"
"""A mixture-of-experts block's router logits, [pos, experts] (its top-k picks the experts)."""
PATTERN_HOOK = "attn.hook_pattern"
"""A block's attention pattern, captured only: computed from its hook_rot_q and hook_rot_k rows with
the model's scale, causal mask, sliding window and soft-cap, as [query pos, head, key pos]."""
INNER_HOOKS = HEAD_HOOKS + NEURON_HOOKS + (ROUTER_HOOK, PATTERN_HOOK)
"""Every block hook point inside the attention or the MLP (enabled by name or pattern, never by 'all')."""
FINAL_HOOK = "ln_final.hook_normalized"
_PATTERN_CANDIDATES = [
    *(f"blocks.{i}.{hook}" for i in range(128) for hook in BLOCK_HOOKS + INNER_HOOKS),
    FINAL_HOOK,
]  # what an engine pattern ("blocks.*.attn.*") must match one of, for any model up to 128 layers
# ASCII digits, no leading zeros: a name has one spelling, so it finds its site ("blocks.012..." and
# other digit scripts would parse to a layer and then match no instrumented site).
_BLOCK_RE = re.compile(
    r"^blocks\.(0|[1-9][0-9]*)\.(" + "|".join(re.escape(h) for h in BLOCK_HOOKS + INNER_HOOKS) + r")$"
)

MAX_POSITION = 2**31 - 1
"""Largest position index (either sign): far beyond any model's context, well inside the int64 the
worker computes in and the integers vLLM's request serialisation carries."""
MAX_COEF = 1e6
"""Largest ``|coef|``."""
MAX_VECTOR_ENTRY = 1e6
"""Largest ``|entry|`` of a steering vector.  With ``MAX_COEF`` a steered row stays below 1e12 per
entry, so its squared norm (which every RMSNorm computes in float32) stays finite for any hidden
size below 1e14 in float32 and bfloat16 engines.  A float16 engine overflows sooner (65504); the
engine's receipts catch that: a non-finite result fails the request."""
MAX_FEATURE = 2**24 - 1
"""The largest SAE feature index (and d_sae) accepted: 16.7M features, past any released SAE."""
MAX_TOP_K = 4096
"""The most SAE features an SAE capture keeps per row."""
MAX_HEAD = 4095
"""The largest head index an intervention's ``heads`` may name (the engine checks the model's own count)."""

CaptureDtype = Literal["float32", "bfloat16", "float16"]
CAPTURE_DTYPES: tuple[str, ...] = get_args(CaptureDtype)
"""The dtypes a capture can come back in, by name (``instrument/dtypes.py`` maps them to torch's)."""

TAG = "tlvllm"
"""tl-vllm's key wherever its data rides in someone else's dict: a request's spec in
``SamplingParams.extra_args``, the instrumentation settings in vLLM's ``additional_config``,
a sample's spec in ``Sample.metadata`` and its record in ``ModelOutput.metadata``."""


SAE_INDICES, SAE_VALUES = ".sae_indices", ".sae_values"
"""An SAE capture at hook point H comes back (and is stored) as tensors ``H.sae_indices`` and ``H.sae_values``."""


def sae_keys(hook: str) -> tuple[str, str]:
    """The names of an SAE capture's two tensors at ``hook``."""
    return hook + SAE_INDICES, hook + SAE_VALUES


def hook_of_key(key: str) -> str:
    """The hook point a captured tensor's name belongs to (an SAE capture's tensors end in a suffix)."""
    for suffix in (SAE_INDICES, SAE_VALUES):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


class SpecError(ValueError):
    """A steering or capture spec is wrong; the message names the field and the fix."""


def parse_hook_point(name: str) -> tuple[int | None, str]:
    """Split a hook point name into (layer, kind); layer is None for ``ln_final``."""
    if name == FINAL_HOOK:
        return None, "ln_final"
    match = _BLOCK_RE.match(name)
    if match:
        return int(match.group(1)), hook_kind(match.group(2))
    digits = re.search(r"\d+", name)  # any script, so that the hint spells the layer canonically
    layer = int(digits.group(0)) if digits else 0
    known = [f"blocks.{layer}.{hook}" for hook in BLOCK_HOOKS + INNER_HOOKS] + [FINAL_HOOK]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise SpecError(
        f"unknown hook point {name!r}.{hint} Valid names: blocks.<layer>.<hook> with <hook> one of "
        f"{', '.join(BLOCK_HOOKS + INNER_HOOKS)}; or {FINAL_HOOK}."
    )


def hook_kind(hook: str) -> str:
    """A block hook's kind: ``hook_resid_pre`` -> ``resid_pre``, ``attn.hook_q`` -> ``attn.q``."""
    module, _, name = hook.rpartition(".")
    kind = name.removeprefix("hook_")
    return f"{module}.{kind}" if module else kind


def is_pattern(name: str) -> bool:
    """Whether a hook point is an attention pattern (computed from the query and key; capture only)."""
    return name.endswith("." + PATTERN_HOOK)


def is_per_head(name: str) -> bool:
    """Whether a hook point's rows are per attention head ([pos, head, d_head])."""
    return any(name.endswith("." + hook) for hook in HEAD_HOOKS)


def _check_scope(value: str | list[int]) -> str | list[int]:
    if isinstance(value, list):
        if not value:
            raise SpecError("positions: an empty list selects no token; use 'all', 'prompt', 'generated' or indices")
        for i, position in enumerate(value):
            if not -MAX_POSITION <= position <= MAX_POSITION:
                raise SpecError(
                    f"positions[{i}]: {position} is out of range; positions lie within +-{MAX_POSITION} "
                    "(and must fall inside the sequence: negative ones count back from the end of the prompt)"
                )
        if len(set(value)) != len(value):
            raise SpecError(f"positions: duplicate indices in {value}")
    return value


StrictNumber = Annotated[float, Field(strict=True)]
"""A number as written: an int or a float, never a string ("1.5") or a bool (true), which lax parsing
would turn into 1.5 or 1.0 without a word (a spec's numbers come from YAML, JSON and Python alike)."""

PositionScope = Annotated[
    Literal["all", "prompt", "generated"] | list[Annotated[int, Field(strict=True)]], AfterValidator(_check_scope)
]
"""Which token rows an intervention or capture covers: a named scope or explicit indices
(checked here, wherever a model declares one)."""


def inline_entries(value: list[float]) -> np.ndarray:
    """An inline list of numbers as the float32 array the engine steers with, each entry checked:
    finite and within +-MAX_VECTOR_ENTRY.  Packed once, here (2,048 entries in about 20 µs);
    the front end steers with this array and never parses the list again."""
    if not value:
        raise SpecError("vector: empty list")
    try:
        packed = struct.pack(f"<{len(value)}f", *value)
    except OverflowError:  # beyond float32: out of range anyway; find the entry in float64
        wide = np.frombuffer(struct.pack(f"<{len(value)}d", *value), dtype=np.float64)
        bad = int(np.argmax(~(np.abs(wide) <= MAX_VECTOR_ENTRY)))
        raise SpecError(
            f"vector: entry {bad} is {value[bad]}; entries lie within +-{MAX_VECTOR_ENTRY:g} "
            "(scale the vector down and raise coef instead)"
        ) from None
    except struct.error as err:  # a list put in place after validation, unchecked
        raise SpecError(f"vector: entries must be numbers ({err})") from None
    entries = np.frombuffer(bytearray(packed), dtype=np.float32)  # writable: torch shares it without a copy
    _check_array_entries(entries, lambda bad: value[bad])
    return entries


def _check_array_entries(entries: np.ndarray, shown: Any) -> None:
    """Every entry finite and within +-MAX_VECTOR_ENTRY; ``shown(i)`` is entry i as the user gave it."""
    finite = np.isfinite(entries)
    if not finite.all():
        bad = int(np.argmin(finite))
        raise SpecError(f"vector: entry {bad} is {shown(bad)}; vectors must be finite (no NaN/inf)")
    too_large = np.abs(entries) > MAX_VECTOR_ENTRY
    if too_large.any():
        bad = int(np.argmax(too_large))
        raise SpecError(
            f"vector: entry {bad} is {shown(bad)}; entries lie within +-{MAX_VECTOR_ENTRY:g} "
            "(scale the vector down and raise coef instead)"
        )


def _as_array(value: Any) -> Any:
    """A numpy array or a tensor (torch, on any device, in any float dtype) as a float32 copy;
    lists, strings and None pass on to the field's other types.  Duck-typed, so that this module
    needs no torch: a researcher's tensor is steered with as it is, never as a list."""
    if value is None or isinstance(value, list | tuple | str):
        return value
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        if value.is_complex():
            raise SpecError(f"vector: a {value.dtype} tensor; steering vectors are real numbers")
        value = value.detach().float().cpu().numpy()
    elif not isinstance(value, np.ndarray):
        if not hasattr(value, "__array__"):
            raise SpecError(f"vector: a list of numbers, an array, a tensor or a file path, got {type(value).__name__}")
        value = np.asarray(value)
    if value.dtype.kind not in "fiu":
        raise SpecError(f"vector: an array of {value.dtype}; steering vectors are real numbers")
    squeezed = value.squeeze()
    if squeezed.ndim != 1 or squeezed.size == 0:
        raise SpecError(f"vector: expected a 1-D array of numbers, got shape {tuple(value.shape)}")
    _check_array_entries(squeezed, lambda bad: squeezed[bad].item())
    return np.array(squeezed, dtype=np.float32)  # a copy: changing the caller's array later changes nothing


def _float32_array(value: Any) -> np.ndarray:
    if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim == 1):
        raise ValueError("expected a 1-D float32 array")
    return value


InlineArray = Annotated[
    np.ndarray,
    PlainValidator(_float32_array),
    PlainSerializer(lambda array: array.tolist(), return_type=list[float]),
    WithJsonSchema({"type": "array", "items": {"type": "number"}}),
]
"""An inline vector given as an array or tensor, kept as float32 (dumped as a list of numbers)."""


class Intervention(BaseModel):
    """One edit of the activations at one hook point.

    - ``add``:    h + coef * v
    - ``scale``:  h * coef
    - ``set``:    coef * v (replaces the activation)
    - ``ablate``: h - coef * (h . u) u with u = v / |v| (coef 1 projects the direction out)

    At a per-head hook point (``attn.hook_q``, ``hook_k``, ``hook_v``, ``hook_rot_q``, ``hook_rot_k``,
    ``hook_z``) the vector has the hook's full width (heads x d_head, flattened head by head) and
    ``heads`` restricts the edit to those heads: the other heads' numbers pass unchanged, and an
    ``ablate`` direction is taken within the chosen heads.  Zero-ablating head 3 is
    ``op: scale, coef: 0, heads: [3]``; mean-ablating it is ``op: set`` with the mean as vector.

    A sparse autoencoder's feature can stand in for the vector: ``sae`` (a folder in SAELens'
    format, trained on this hook point) and ``feature`` (its index ``i``), with op

    - ``add``:    h + coef * W_dec[i]
    - ``clamp``:  h + (coef - f_i(h)) * W_dec[i], which sets the feature's activation f_i to coef
      and keeps the SAE's reconstruction error (ReLU and JumpReLU SAEs: a TopK feature's
      activation depends on every other feature)

    The receipt of a feature intervention reports f_i before and after it, averaged over the
    rows it steered.
    """

    model_config = ConfigDict(extra="forbid")

    hook: str = Field(description="Hook point, e.g. blocks.6.hook_resid_post")
    op: Literal["add", "scale", "set", "ablate", "clamp"] = "add"
    vector: Annotated[InlineArray | list[StrictNumber] | str | None, BeforeValidator(_as_array)] = Field(
        default=None,
        description=f"Inline numbers (a list, a numpy array or a torch tensor) or a file (.safetensors, .npy, "
        f".pt) as 'path' or 'path:key'; entries finite and within +-{MAX_VECTOR_ENTRY:g}",
    )
    sae: str | None = Field(
        default=None, description="With op 'add' or 'clamp': an SAE folder (cfg.json, sae_weights.safetensors)"
    )
    feature: int | None = Field(
        default=None, ge=0, le=MAX_FEATURE, strict=True, description=f"The SAE feature to steer, 0..{MAX_FEATURE}"
    )
    coef: StrictNumber = Field(default=1.0, description=f"Finite, within +-{MAX_COEF:g}")
    positions: PositionScope = Field(
        default="all", description=f"'all', 'prompt', 'generated', or indices within +-{MAX_POSITION}"
    )
    heads: list[Annotated[int, Field(ge=0, le=MAX_HEAD, strict=True)]] | None = Field(
        default=None,
        min_length=1,
        description="At a per-head hook point (attn.hook_*): edit only these heads; default every head",
    )

    @field_validator("hook")
    @classmethod
    def _hook(cls, value: str) -> str:
        parse_hook_point(value)
        if is_pattern(value):
            raise SpecError(
                f"hook: {value} is computed from the query and key, so it is captured only; steer the pattern "
                "through attn.hook_rot_q, attn.hook_rot_k or attn.hook_z"
            )
        return value

    @field_validator("heads")
    @classmethod
    def _heads(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(set(value)) != len(value):
            raise SpecError(f"heads: each head once, got {value}")
        return value

    @field_validator("coef")
    @classmethod
    def _coef(cls, value: float) -> float:
        if not math.isfinite(value):
            raise SpecError(f"coef: must be a finite number, got {value}")
        if abs(value) > MAX_COEF:
            raise SpecError(f"coef: {value} is out of range; |coef| is at most {MAX_COEF:g}")
        return value

    _packed: tuple[list[float], np.ndarray] | None = PrivateAttr(default=None)  # an inline list and its entries

    @property
    def inline_vector(self) -> np.ndarray | None:
        """An inline vector's float32 entries, None for a file or no vector.  A list is packed and
        checked once, when the spec is validated (again only if another list replaced it since)."""
        if isinstance(self.vector, np.ndarray):
            return self.vector
        if not isinstance(self.vector, list):
            return None
        if self._packed is None or self._packed[0] is not self.vector:
            self._packed = (self.vector, inline_entries(self.vector))
        return self._packed[1]

    def __eq__(self, other: object) -> bool:
        """Field by field, an inline array by its entries (numpy's ``==`` gives no single answer)."""
        if not isinstance(other, Intervention):
            return NotImplemented
        mine, theirs = dict(self), dict(other)
        a, b = mine.pop("vector"), theirs.pop("vector")
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = not isinstance(a, str | None) and not isinstance(b, str | None) and bool(np.array_equal(a, b))
        else:
            same = a == b
        return same and mine == theirs

    @model_validator(mode="after")
    def _needs_vector(self) -> Intervention:
        self.inline_vector  # noqa: B018 (packs and checks an inline list)
        if (self.sae is None) != (self.feature is None):
            raise SpecError("sae, feature: steering by an SAE feature needs both the SAE folder and the feature index")
        if self.sae is not None and (self.op not in ("add", "clamp") or self.vector is not None):
            raise SpecError(
                f"sae: an SAE feature is steered with op 'add' or 'clamp' and no vector (got op {self.op!r})"
            )
        if self.op == "clamp" and self.sae is None:
            raise SpecError("op: 'clamp' sets an SAE feature's activation; give sae and feature")
        if self.op == "scale" and self.vector is not None:
            raise SpecError("vector: op 'scale' takes no vector (it multiplies by coef)")
        if self.op != "scale" and self.vector is None and self.sae is None:
            raise SpecError(f"vector: op {self.op!r} needs a vector (inline list or file path)")
        if self.heads is not None and not is_per_head(self.hook):
            raise SpecError(
                f"heads: {self.hook} is not a per-head hook point; heads apply at blocks.<layer>.attn.hook_q, "
                "hook_k, hook_v, hook_rot_q, hook_rot_k or hook_z"
            )
        if self.heads is not None and self.sae is not None:
            raise SpecError("heads: an SAE feature is steered over the whole hook point; omit heads")
        return self


class Capture(BaseModel):
    """Which activations to bring back for a request, and how to reduce them.

    With ``sae`` (a folder in SAELens' format) the capture brings back that SAE's feature
    activations at its hook point instead of the rows themselves: encoded in the worker, on its
    device, and kept sparse, as ``<hook>.sae_indices`` (int32) and ``<hook>.sae_values`` with
    the ``top_k`` largest features per row, or the listed ``features`` only.  ``reduce`` then
    works in feature space (``mean``, ``max`` per feature, ``last``) before the top ``top_k``
    are kept, so a pooled row is exact.
    """

    model_config = ConfigDict(extra="forbid")

    hooks: list[str] = Field(
        default_factory=list, description="Hook points to record (with sae: omit, or name the SAE's own)"
    )
    positions: PositionScope = "all"
    reduce: Literal["none", "mean", "last", "max_norm", "max"] = Field(
        default="none",
        description="none: one row per token; mean / last / max_norm (row of largest L2 norm): one row per "
        "sample; with sae: none, mean, last or max (per feature)",
    )
    dtype: CaptureDtype = "float32"
    sae: str | None = Field(default=None, description="An SAE folder (cfg.json, sae_weights.safetensors)")
    top_k: Annotated[int, Field(ge=1, le=MAX_TOP_K, strict=True)] = Field(
        default=32, description=f"With sae: how many of the largest features each row keeps, 1..{MAX_TOP_K}"
    )
    features: list[Annotated[int, Field(ge=0, le=MAX_FEATURE, strict=True)]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TOP_K,
        description=f"With sae: keep these features (up to {MAX_TOP_K}) instead of the top_k",
    )

    @field_validator("hooks")
    @classmethod
    def _hooks(cls, value: list[str]) -> list[str]:
        for name in value:
            parse_hook_point(name)
        if len(set(value)) != len(value):
            raise SpecError(f"hooks: duplicate hook points in {value}")
        return value

    @model_validator(mode="after")
    def _sae_fields(self) -> Capture:
        patterns = [name for name in self.hooks if is_pattern(name)]
        if patterns and (self.reduce != "none" or self.positions not in ("all", "prompt")):
            raise SpecError(
                f"hooks: {patterns[0]} needs every key row before each query: capture it with reduce 'none' and "
                f"positions 'all' or 'prompt' (got reduce {self.reduce!r}, positions {self.positions!r})"
            )
        if self.sae is None:
            if not self.hooks:
                raise SpecError("hooks: name at least one hook point to capture (or give sae to capture its features)")
            # values, not fields set: a dumped spec (model_dump) carries every default back in
            default_top_k = type(self).model_fields["top_k"].default
            extra = [
                name
                for name, off in (("top_k", self.top_k == default_top_k), ("features", self.features is None))
                if not off
            ]
            if extra:
                raise SpecError(f"{', '.join(extra)}: only an SAE capture takes these; give sae")
            if self.reduce == "max":
                raise SpecError("reduce: 'max' is per SAE feature (give sae); for rows use 'max_norm'")
            return self
        if len(self.hooks) > 1:
            raise SpecError("hooks: an SAE capture reads its SAE's own hook point; name it alone, or omit hooks")
        if self.reduce == "max_norm":
            raise SpecError("reduce: an SAE capture reduces per feature: none, mean, last or max")
        if self.features is not None and len(set(self.features)) != len(self.features):
            raise SpecError("features: each feature once")
        return self


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
    max_stack: Annotated[int, Field(ge=1, le=8, strict=True)] = Field(
        default=2, description="How many interventions one request may stack at one hook point"
    )
    max_vectors: Annotated[int, Field(ge=1, le=1 << 16, strict=True)] = Field(
        default=256,
        description="Capacity of the worker's vector bank (1..65536 rows of hidden size); vectors no live "
        "request uses are evicted to make room",
    )
    capture_bytes_per_request: Annotated[int, Field(ge=1, le=1 << 40, strict=True)] = Field(
        default=1 << 30, description="Largest capture one request may produce (1 byte .. 1 TiB)"
    )

    @field_validator("hook_points")
    @classmethod
    def _patterns(cls, value: list[str]) -> list[str]:
        for name in value:
            if name == "all":
                continue
            if "*" not in name:
                parse_hook_point(name)
            elif not fnmatch.filter(_PATTERN_CANDIDATES, name):
                parse_hook_point(name.replace("*", "0"))  # a precise error where the name itself is wrong
                raise SpecError(f"hook_points: pattern {name!r} matches no hook point")
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
        raise SpecError(f"{where}: {readable_error(err)}") from None


def readable_error(err: ValueError) -> str:
    errors = getattr(err, "errors", None)
    if not callable(errors):
        return str(err)
    parts = []
    for item in errors():
        loc = ".".join(str(x) for x in item.get("loc", ()))
        msg = str(item.get("msg", "")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)
