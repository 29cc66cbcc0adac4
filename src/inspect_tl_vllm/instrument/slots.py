"""Where the step router keeps its live requests: integer slots, and the requests as arrays.

A decode step must cost a few numpy operations over all live requests, not Python work per
request (``routing.py`` says why).  So each request and each steering item gets an integer
slot while it is live, and its per-step counters are entries of growable arrays under that
slot (``Slots``).  The live requests' fixed attributes (slots, scopes, prompt lengths,
steering rows, pooled capture sites) are laid out as arrays too (``Layout``), built only
when a request is admitted or retired, never per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from inspect_tl_vllm.instrument.plans import RequestState, SteerItem
from inspect_tl_vllm.instrument.pooling import MODES
from inspect_tl_vllm.instrument.site_op import STAGE_WIDTH


class Slots:
    """Integer slots with a free list, and the growable counter arrays they index."""

    def __init__(self, **arrays: tuple[Any, Any]) -> None:
        self.fill = {name: value for name, (_, value) in arrays.items()}
        self.arrays = {name: np.full(64, value, dtype=dtype) for name, (dtype, value) in arrays.items()}
        self.free: list[int] = []
        self.next = 0

    def take(self) -> int:
        slot = self.free.pop() if self.free else self.next
        if slot == self.next:
            self.next += 1
        size = len(next(iter(self.arrays.values())))
        if slot >= size:
            for name, array in self.arrays.items():
                grown = np.full(2 * size, self.fill[name], dtype=array.dtype)
                grown[:size] = array
                self.arrays[name] = grown
        for name, array in self.arrays.items():
            array[slot] = self.fill[name]
        return slot

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


@dataclass
class Layout:
    """The live requests as arrays; index ``k`` is the k-th live state."""

    states: list[RequestState]
    slot: np.ndarray  # request slot
    steered: np.ndarray  # bool
    capture_kind: np.ndarray  # scope code of the capture, -1 without one
    prompt_len: np.ndarray
    pooled: np.ndarray  # bool: pooled captures (reduced on the device)
    features: np.ndarray  # bool: SAE captures (encoded on the device, feature_captures.py)
    per_token: list[int]  # states with per-token captures (host path)
    # steering items, flattened over the live requests
    s_state: np.ndarray
    s_slot: np.ndarray
    s_site: np.ndarray
    s_table: np.ndarray  # index of the site's host table
    s_stage: np.ndarray
    s_row: np.ndarray  # (n, STAGE_WIDTH) stage parameters
    s_kind: np.ndarray
    s_items: list[SteerItem]
    s_listed: list[int]  # item indices whose scope lists positions
    # pooled capture items, flattened
    p_state: np.ndarray
    p_site: np.ndarray
    p_mode: np.ndarray

    @classmethod
    def build(cls, states: list[RequestState], table_of_site: dict[int, int]) -> Layout:
        steer = [(k, item) for k, state in enumerate(states) for item in state.steer]
        pooled = [
            (k, item.site, MODES[state.reduce])
            for k, state in enumerate(states)
            if state.pooled
            for item in state.capture
        ]
        capture_kind = [s.capture_scope.code if s.capture and s.capture_scope else -1 for s in states]
        return cls(
            states=states,
            slot=np.array([s.slot for s in states], dtype=np.int64),
            steered=np.array([bool(s.steer) for s in states], dtype=bool),
            capture_kind=np.array(capture_kind, dtype=np.int64),
            prompt_len=np.array([s.prompt_len for s in states], dtype=np.int64),
            pooled=np.array([s.pooled for s in states], dtype=bool),
            features=np.array([s.encoder is not None for s in states], dtype=bool),
            per_token=[k for k, s in enumerate(states) if s.capture and not s.pooled and s.encoder is None],
            s_state=np.array([k for k, _ in steer], dtype=np.int64),
            s_slot=np.array([item.slot for _, item in steer], dtype=np.int64),
            s_site=np.array([item.site for _, item in steer], dtype=np.int64),
            s_table=np.array([table_of_site[item.site] for _, item in steer], dtype=np.int64),
            s_stage=np.array([item.stage for _, item in steer], dtype=np.int64),
            s_row=np.array([item.stage_row for _, item in steer], dtype=np.float32).reshape(-1, STAGE_WIDTH),
            s_kind=np.array([item.scope.code for _, item in steer], dtype=np.int64),
            s_items=[item for _, item in steer],
            s_listed=[m for m, (_, item) in enumerate(steer) if item.scope.kind == "listed"],
            p_state=np.array([k for k, _, _ in pooled], dtype=np.int64),
            p_site=np.array([site for _, site, _ in pooled], dtype=np.int64),
            p_mode=np.array([mode for _, _, mode in pooled], dtype=np.int64),
        )
