"""What crosses the process boundary between the front end and the workers, defined once.

Three messages travel:

- ``RequestWire``: a request's steering and capture, resolved to site numbers and vector
  hashes (``engine/frontend.py`` builds it), in ``SamplingParams.extra_args["tlvllm"]``; the
  worker turns it into its per-request state (``instrument/request_state.py``).
- ``FetchedResult``: what ``tlvllm_fetch`` answers per request (``engine/worker.py`` builds it,
  the front end decodes it): the ``Receipt``, captured rows as safetensors bytes or hand-off
  file names, and the positions of per-token rows.
- ``WorkerStatus``: one worker's counters (``tlvllm_status``).

vLLM carries these through msgpack (its engine-core messages and utility results) without type
information, so each side sends plain builtins (``encode``) and the other rebuilds the typed
structure (``decode``), which checks every field's type: a malformed message is a
``ValueError`` for that message alone.  The ranges that depend on the engine (site numbers,
stack depth, vector rows) are checked by the worker against its own tables.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

PositionsWire = str | list[int]
"""A position scope as specs.PositionScope writes it: a scope name or a list of positions."""

T = TypeVar("T", bound="Message")


class Message(msgspec.Struct, forbid_unknown_fields=True):
    """A typed message with its plain-builtins form."""

    def encode(self) -> Any:
        return msgspec.to_builtins(self, builtin_types=(bytes,))

    @classmethod
    def decode(cls: type[T], raw: Any) -> T:
        """The message ``raw`` (plain builtins) holds; ``msgspec.ValidationError`` (a ``ValueError``)
        naming the first field of the wrong type."""
        return msgspec.convert(raw, cls)


class EncoderWire(Message):
    """An SAE feature's encoder, for a feature intervention: f = act(x . u + bias), where act
    keeps values above ``threshold`` (0 for ReLU, the JumpReLU threshold) and zeros the rest."""

    vector: str  # content hash of the uploaded encoder column u
    bias: float  # b_enc[i], less b_dec . u when the SAE subtracts b_dec from its input
    threshold: float


class SteerWire(Message):
    label: str  # "interventions[i] op at hook", for receipts and errors
    site: int
    stage: int  # its place among the interventions at the same site
    op: str
    coef: float
    vector: str | None  # content hash of an uploaded vector
    positions: PositionsWire
    encoder: EncoderWire | None = None  # a feature intervention's encoder (reported before/after; clamp)
    mask: str | None = None  # content hash of an uploaded 0/1 row: the columns (heads) the edit touches


class FeaturesWire(Message):
    """A capture of SAE features: the worker encodes the hook point's rows with the SAE at
    ``sae`` (a folder it reads itself, whose files must hash to ``digest``, as the front end read
    them) and keeps the ``top_k`` largest, or the listed ``features``."""

    sae: str
    digest: str
    top_k: int
    features: list[int] | None
    reduce: str  # none | mean | max | last, over the captured rows in feature space

    def kept(self) -> int:
        """Features kept per row: the listed ones, or the top k (the front end keeps ``top_k``
        within the SAE's width)."""
        return len(self.features) if self.features is not None else self.top_k


class CaptureWire(Message):
    hooks: list[tuple[str, int]]  # (hook point, site)
    positions: PositionsWire
    reduce: str
    dtype: str
    max_bytes: int
    handoff: list[str] | None  # the front end's hand-off ticket, for per-token rows (handoff.py)
    features: FeaturesWire | None = None


class RequestWire(Message):
    uid: str
    steer: list[SteerWire]
    capture: CaptureWire | None


class InterventionReceipt(Message):
    index: int  # place in the request's intervention list (pipeline stages' receipts merge by it)
    label: str
    rows: int
    mean_norm_change: float
    fired: bool
    feature_before: float | None = None  # a feature intervention's mean SAE activation before it
    feature_after: float | None = None  # ... and after it


class Receipt(Message):
    interventions: list[InterventionReceipt]
    captures: dict[str, int]  # hook point -> rows captured
    error: str | None
    capture_unreached: bool = False  # a one-token answer to a capture of generated tokens: empty, not an error


class FetchedResult(Message):
    uid: str
    receipt: Receipt
    positions: dict[str, list[int]]  # per-token captures: each hook's positions
    tensors: bytes  # safetensors bytes of the rows that travel with the answer (b"": none)
    files: list[str]  # hand-off files holding the other rows


class WorkerStatus(Message):
    runner: str  # the vLLM model runner instrumented: V1 or V2
    sites: list[str]
    fired: list[int]
    buffer_bytes: int
    vectors: int
    max_requests_steered_in_one_step: int
    pending_results: int
    live_requests: int
    collects: bool  # whether this worker records captures and receipts (tensor-parallel rank 0)
    steps: int
    step_kinds: dict[str, int]  # steps routed, by how much of the last step's routing they reused
    resumed_after_preemption: int
    written_early: int
    host_seconds: dict[str, float]
    pinned_host: dict[str, float]
    sae_held: dict[str, int]  # SAE encoders on the device, and the feature captures' groups, pools, arenas
    attention: dict[str, list[float]]  # layer -> (scale, sliding window, soft-cap; 0: none) where q and k are hooked
