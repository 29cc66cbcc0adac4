"""Where the step router keeps its live requests: integer slots, and the requests as arrays.

A decode step must cost a few numpy operations over all live requests, not Python work per
request (``routing.py`` says why).  So each request and each steering item gets an integer
slot while it is live, and its per-step counters are entries of growable arrays under that
slot (``Slots``).  The live requests' fixed attributes (slots, capture scopes, prompt lengths,
pooled capture sites) are laid out as arrays too (``Layout``), built only when a request is
admitted or retired, never per step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

from inspect_tl_vllm.instrument.pooling import MODES
from inspect_tl_vllm.instrument.request_state import RequestState


class Slots:
    """Integer slots with a free list, and the growable counter arrays they index."""

    def __init__(self, **arrays: tuple[Any, Any]) -> None:
        self.fill = {name: value for name, (_, value) in arrays.items()}
        self.size = 64
        self.arrays = {name: np.full(self.size, value, dtype=dtype) for name, (dtype, value) in arrays.items()}
        self.free: list[int] = []
        self.next = 0

    def take(self) -> int:
        slot = self.free.pop() if self.free else self.next
        if slot == self.next:
            self.next += 1
        if slot >= self.size:
            for name, array in self.arrays.items():
                grown = np.full(2 * self.size, self.fill[name], dtype=array.dtype)
                grown[: self.size] = array
                self.arrays[name] = grown
            self.size *= 2
        for name, array in self.arrays.items():
            array[slot] = self.fill[name]
        return slot

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]


PooledItems = tuple[tuple[int, int], ...]
"""A request's pooled captures as (site, reduction code) pairs."""

LAYOUT_COLUMNS = {  # what ``Layout`` keeps of each live request, as ``Slots`` arrays
    "steered": (bool, False),
    "capture_kind": (np.int64, -1),  # scope code of the capture, -1 without one
    "prompt_len": (np.int64, 0),
    "pooled": (bool, False),
    "features": (bool, False),
    "per_token": (bool, False),
}


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
    captures: bool  # any live request captures
    # pooled capture items, flattened
    p_state: np.ndarray
    p_site: np.ndarray
    p_mode: np.ndarray

    @staticmethod
    def describe(state: RequestState, columns: Slots) -> PooledItems:
        """Write what the layout keeps of the admitted ``state`` into ``columns`` (a ``Slots``
        with ``LAYOUT_COLUMNS``) under its slot, once; returns the (site, mode) of each of its
        pooled captures."""
        captures = bool(state.capture) and state.capture_scope is not None
        pooled, features = state.pooled, state.encoder is not None
        slot = state.slot
        columns["steered"][slot] = bool(state.steer)
        columns["capture_kind"][slot] = state.capture_scope.code if captures else -1
        columns["prompt_len"][slot] = state.prompt_len
        columns["pooled"][slot] = pooled
        columns["features"][slot] = features
        columns["per_token"][slot] = bool(state.capture) and not pooled and not features
        return tuple((item.site, MODES[state.reduce]) for item in state.capture) if pooled else ()

    @classmethod
    def build(
        cls, states: list[RequestState], slot: np.ndarray, pooled: dict[int, PooledItems], columns: Slots
    ) -> Layout:
        """The layout of ``states`` (in slots ``slot``) from their ``describe``d ``columns``, and
        the pooled captures of those that have any (by slot)."""
        kind = columns["capture_kind"][slot]
        order = np.zeros(int(slot.max(initial=-1)) + 1, dtype=np.int64)
        order[slot] = np.arange(len(slot))
        pooled_slots = np.fromiter(pooled, dtype=np.int64, count=len(pooled))
        counts = np.fromiter(map(len, pooled.values()), dtype=np.int64, count=len(pooled))
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(pooled.values()))  # in C: no Python loop
        items = np.fromiter(flat, dtype=np.int64, count=2 * int(counts.sum())).reshape(-1, 2)
        return cls(
            states=states,
            slot=slot,
            steered=columns["steered"][slot],
            capture_kind=kind,
            prompt_len=columns["prompt_len"][slot],
            pooled=columns["pooled"][slot],
            features=columns["features"][slot],
            per_token=np.nonzero(columns["per_token"][slot])[0].tolist(),
            captures=bool((kind >= 0).any()),
            p_state=np.repeat(order[pooled_slots], counts),
            p_site=items[:, 0].copy(),
            p_mode=items[:, 1].copy(),
        )
