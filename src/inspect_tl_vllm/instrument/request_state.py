"""What a worker keeps for one instrumented request: its steering items, its captures and
their position scopes, resolved from the ``wire.RequestWire`` the front end sent.

The step router (``routing.py``) gives each request and each steering item an integer
*slot*; per-step counters live in the router's arrays under those slots, so a decode step
is a handful of numpy operations over all requests instead of Python work per request.
The numbers are copied back into these objects (``settle``) when results are read.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.instrument.pooling import MODES
from inspect_tl_vllm.instrument.site_op import FEATURE_AFTER, FEATURE_BEFORE, NORM_CHANGE, ROW_STATS
from inspect_tl_vllm.specs import CAPTURE_DTYPES, MAX_COEF, MAX_FEATURE, MAX_POSITION, MAX_TOP_K
from inspect_tl_vllm.wire import FeaturesWire, InterventionReceipt, Receipt, RequestWire

OP_STAGES = {  # op -> (mult, add, proj, gate) as functions of coef (runtime.py: the stage math)
    "add": lambda c: (1.0, c, 0.0, 0.0),
    "scale": lambda c: (c, 0.0, 0.0, 0.0),
    "set": lambda c: (0.0, c, 0.0, 0.0),
    "ablate": lambda c: (1.0, 0.0, c, 0.0),
    "clamp": lambda c: (1.0, c, 0.0, 1.0),
}
SCOPE_CODES = {"all": 0, "prompt": 1, "generated": 2, "listed": 3}


@dataclass
class Scope:
    """A position scope (see specs.PositionScope) resolved against one prompt length."""

    kind: str  # all | prompt | generated | listed
    prompt_len: int
    listed: frozenset[int] = frozenset()

    @classmethod
    def resolve(cls, scope: Any, prompt_len: int) -> Scope:
        """The scope for a request of ``prompt_len`` prompt tokens; ``ValueError`` for anything
        that is not a scope name or a list of positions within ``MAX_POSITION``."""
        if isinstance(scope, str):
            if scope not in SCOPE_CODES or scope == "listed":
                raise ValueError(f"unknown position scope {scope!r}")
            return cls(scope, prompt_len)
        if not isinstance(scope, list) or not all(type(p) is int and -MAX_POSITION <= p <= MAX_POSITION for p in scope):
            raise ValueError(f"positions must be integers within +-{MAX_POSITION}, got {str(scope)[:80]}")
        return cls("listed", prompt_len, frozenset(p + prompt_len if p < 0 else p for p in scope))

    @property
    def code(self) -> int:
        return SCOPE_CODES[self.kind]

    def covers(self, pos: int) -> bool:
        if self.kind == "all":
            return True
        if self.kind == "prompt":
            return pos < self.prompt_len
        if self.kind == "generated":
            return pos >= self.prompt_len
        return pos in self.listed

    @property
    def last_prompt_position(self) -> int | None:
        """The last position the scope covers, when that lies in the prompt: a capture over
        such a scope is complete once that row is in, long before the request ends.  None
        when the scope reaches into generated tokens."""
        if self.kind == "prompt":
            return self.prompt_len - 1
        if self.kind == "listed" and self.listed and max(self.listed) < self.prompt_len:
            return max(self.listed)
        return None

    def reaches(self, max_pos: int) -> bool:
        """Whether the scope covers a position of 0..``max_pos`` (the request's input rows)."""
        if self.kind in ("all", "prompt"):
            return max_pos >= 0
        if self.kind == "generated":
            return max_pos >= self.prompt_len
        return any(p <= max_pos for p in self.listed)

    def mask(self, positions: np.ndarray) -> np.ndarray:
        if self.kind == "all":
            return np.ones(positions.shape, dtype=bool)
        if self.kind == "prompt":
            return positions < self.prompt_len
        if self.kind == "generated":
            return positions >= self.prompt_len
        return np.isin(positions, np.fromiter(self.listed, dtype=np.int64, count=len(self.listed)))


def scopes_cover(kind: np.ndarray, prompt_len: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """``Scope.covers`` for many scopes at once, given their kind codes (``SCOPE_CODES``).

    Listed scopes (and code -1, no scope) give False; callers check listed ones one by one.
    """
    return (
        (kind == SCOPE_CODES["all"])
        | ((kind == SCOPE_CODES["prompt"]) & (pos < prompt_len))
        | ((kind == SCOPE_CODES["generated"]) & (pos >= prompt_len))
    )


@dataclass
class SteerItem:
    index: int  # position in the request's intervention list (receipts merge across ranks by it)
    label: str
    site: int
    stage: int
    stage_row: np.ndarray  # its entry in the site's table (runtime.py), STAGE_WIDTH numbers
    scope: Scope
    feature: bool = False  # an SAE feature's intervention: its receipt reports the feature's activation
    slot: int = -1  # the router's counter slot while the request is live
    rows: int = 0
    sums: np.ndarray = field(default_factory=lambda: np.zeros(ROW_STATS))  # row_stats summed over its rows
    fired: bool = True


@dataclass
class CaptureItem:
    hook: str
    site: int
    blocks: list[tuple[np.ndarray, torch.Tensor]] = field(default_factory=list)  # reduce none: (positions, rows)
    rows_kept: int = 0  # per-token rows appended to blocks (blocks are emptied once written out early)
    pooled: tuple[np.ndarray, float, np.ndarray] | None = None  # read from the device: (reduced, best norm, pending)

    def per_token(self, max_pos: int) -> tuple[list[int], torch.Tensor | None]:
        """Positions (sorted, at most ``max_pos``) and their rows, for ``reduce="none"``."""
        if not self.blocks:
            return [], None
        positions = np.concatenate([p for p, _ in self.blocks])
        order = np.argsort(positions, kind="stable")
        order = order[positions[order] <= max_pos]
        if len(self.blocks) == 1 and np.array_equal(order, np.arange(len(positions))):
            return positions.tolist(), self.blocks[0][1]
        rows = torch.cat([r for _, r in self.blocks])
        return positions[order].tolist(), rows.index_select(0, torch.from_numpy(order))


@dataclass
class RequestState:
    """What the worker keeps for one request until the front end fetches it."""

    uid: str
    prompt_len: int
    steer: list[SteerItem]
    capture: list[CaptureItem]
    req_id: str = ""
    capture_scope: Scope | None = None
    reduce: str = "none"
    dtype: str = "float32"
    max_bytes: int = 1 << 30
    slot: int = -1  # the router's slot while the request is live
    captured: int = 0  # rows captured per hook point (all hook points see the same rows)
    pending_pos: int = -1  # pooled captures: position of the newest row, kept out of the reduction (see pooling.py)
    bytes_used: int = 0
    error: str | None = None
    handoff: list[str] | None = None  # the front end's hand-off ticket (per-token captures; see handoff.py)
    features: FeaturesWire | None = None  # an SAE capture (feature_captures.py)
    encoder: Any = None  # its SAE on the worker's device (the worker attaches it): d_sae, encode(rows)
    feature_rows: tuple[np.ndarray, np.ndarray] | None = None  # per token: positions, [values | indices] rows
    feature_pooled: tuple[np.ndarray, np.ndarray, int, int] | None = None  # reduced, pending, its position, rows
    written: Future[dict[str, Any]] | None = None  # per-token rows being written out early (worker.py)
    unreached: bool = False  # a one-token answer to a capture of generated tokens (packing.py)

    def capture_closes_with(self, positions: np.ndarray) -> bool:
        """Whether per-token rows ending at ``positions`` complete this request's capture
        (its scope ends inside the prompt, and nothing went wrong)."""
        if self.reduce != "none" or self.error is not None or self.capture_scope is None:
            return False
        last = self.capture_scope.last_prompt_position
        return last is not None and int(positions[-1]) >= last

    @property
    def pooled(self) -> bool:
        return bool(self.capture) and self.reduce in MODES

    def receipt(self) -> Receipt:
        return Receipt(
            interventions=[
                InterventionReceipt(
                    index=s.index,
                    label=s.label,
                    rows=s.rows,
                    mean_norm_change=mean[NORM_CHANGE],
                    fired=s.fired,
                    feature_before=mean[FEATURE_BEFORE] if s.feature else None,
                    feature_after=mean[FEATURE_AFTER] if s.feature else None,
                )
                for s in self.steer
                for mean in [(s.sums / s.rows).tolist() if s.rows else [0.0] * ROW_STATS]
            ],
            captures={c.hook: self.captured_rows(c) for c in self.capture},
            error=self.error,
            capture_unreached=self.unreached,
        )

    def captured_rows(self, item: CaptureItem) -> int:
        if self.reduce == "none":
            return item.rows_kept
        return self.captured


def finish_pooled(state: RequestState, max_pos: int) -> dict[str, np.ndarray]:
    """The reduced row of each pooled capture, counting the newest row only if it was an input.

    Under asynchronous scheduling a request that stopped at a step is scheduled once more
    before vLLM knows it stopped; that step's row (the final token fed back) was never an
    input of the answer.  The device keeps each request's newest row apart (``pending``), and
    it joins the reduction here only when its position is at most ``max_pos``.
    """
    keep = 0 <= state.pending_pos <= max_pos
    if state.pending_pos > max_pos:
        state.captured -= 1
        state.pending_pos = -1
    out = {}
    for item in state.capture:
        if item.pooled is None or state.captured == 0:
            continue
        reduced, best_norm, pending = item.pooled
        if state.reduce == "mean":
            row = (reduced + pending) if keep else reduced
            out[item.hook] = row / state.captured
        elif state.reduce == "last":
            out[item.hook] = pending if keep else reduced
        else:
            better = keep and float(np.linalg.norm(pending)) > best_norm
            out[item.hook] = pending if better else reduced
    return out


def plan_request(
    wire: RequestWire,
    prompt_len: int,
    bank_rows: dict[str, int],
    sites: set[int],
    max_stack: int,
    owned_sites: set[int] | None = None,
) -> RequestState:
    """Turn a request's wire spec (built by the front end, its types checked by
    ``RequestWire.decode``) into worker-side state.

    The values are checked again here, against this worker's own tables (``sites``: every hook
    site of the engine; ``max_stack``; the vector bank): whatever reaches the per-step routing
    must be in range, since a failure there would stop every request in the batch.  A bad wire
    raises ``ValueError`` or ``KeyError`` for this request alone.  ``owned_sites`` (pipeline
    parallel) keeps only the items at sites this worker runs.
    """

    def owned(site: int) -> bool:
        return owned_sites is None or site in owned_sites

    steer = []
    for index, item in enumerate(wire.steer):
        site, stage = _site(item.site, sites), item.stage
        if not 0 <= stage < max_stack:
            raise ValueError(f"steering item {index}: stage {stage} is outside 0..{max_stack - 1}")
        if item.op not in OP_STAGES:
            raise ValueError(f"steering item {index}: unknown op {item.op!r}")
        if not abs(item.coef) <= MAX_COEF:
            raise ValueError(f"steering item {index}: coef {item.coef} is not within +-{MAX_COEF:g}")
        encoder = item.encoder
        if (encoder is None and item.op == "clamp") or (encoder is not None and item.op not in ("add", "clamp")):
            raise ValueError(
                f"steering item {index}: only 'clamp' needs an SAE encoder, and only it and 'add' take one"
            )
        for key in (item.vector, encoder.vector if encoder is not None else None, item.mask):
            if key is not None and key not in bank_rows:
                raise KeyError(f"vector {key} was not uploaded to this worker")
        feature = (0.0, 0.0, 0.0)
        if encoder is not None:
            if not (math.isfinite(encoder.bias) and math.isfinite(encoder.threshold)):
                raise ValueError(f"steering item {index}: encoder bias and threshold must be finite")
            feature = (bank_rows[encoder.vector], encoder.bias, encoder.threshold)
        scope = Scope.resolve(item.positions, prompt_len)
        if not owned(site):
            continue
        bank_row = bank_rows[item.vector] if item.vector is not None else 0
        mult, add, proj, gate = OP_STAGES[item.op](item.coef)
        mask_row = bank_rows[item.mask] if item.mask is not None else 0
        stage_row = np.array([bank_row, mult, add, proj, *feature, gate, mask_row], dtype=np.float32)
        steer.append(
            SteerItem(
                index=index,
                label=item.label,
                site=site,
                stage=stage,
                stage_row=stage_row,
                scope=scope,
                feature=encoder is not None,
            )
        )
    state = RequestState(uid=wire.uid, prompt_len=prompt_len, steer=steer, capture=[])
    cap = wire.capture
    if cap is not None:
        hooks = [(name, _site(site, sites)) for name, site in cap.hooks]
        state.capture = [CaptureItem(hook=name, site=site) for name, site in hooks if owned(site)]
        state.capture_scope = Scope.resolve(cap.positions, prompt_len)
        if cap.reduce not in (*MODES, "none") or cap.dtype not in CAPTURE_DTYPES:
            raise ValueError(f"capture: unknown reduce {cap.reduce!r} or dtype {cap.dtype!r}")
        if cap.max_bytes < 0:
            raise ValueError(f"capture: max_bytes {cap.max_bytes} is negative")
        state.reduce = cap.reduce
        state.dtype = cap.dtype
        state.max_bytes = cap.max_bytes
        state.handoff = cap.handoff
        if cap.features is not None:
            _check_features(cap.features, cap.reduce, len(cap.hooks))
            state.features = cap.features
    return state


def _check_features(wire: FeaturesWire, reduce: str, hooks: int) -> None:
    """An SAE capture travels as a capture of one hook point; its own reduce applies in feature space."""
    if reduce != "none" or hooks != 1:
        raise ValueError("capture: an SAE capture is sent as reduce 'none' over its one hook point")
    if wire.reduce not in ("none", "mean", "max", "last") or not 1 <= wire.top_k <= MAX_TOP_K:
        raise ValueError(f"capture: SAE reduce {wire.reduce!r} or top_k {wire.top_k} out of range")
    if wire.features is not None and not (
        0 < len(wire.features) <= MAX_TOP_K and all(0 <= f <= MAX_FEATURE for f in wire.features)
    ):
        raise ValueError("capture: SAE features must be 1..4096 indices within 0..2**24-1")


def _site(site: int, sites: set[int]) -> int:
    if site not in sites:
        raise ValueError(f"hook site {site} does not exist in this engine")
    return site
