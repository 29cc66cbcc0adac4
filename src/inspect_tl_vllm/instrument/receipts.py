"""Steering receipts accumulated on the device.

A receipt says how many token rows an intervention steered, their mean change in L2 norm,
and whether its site's hook really ran while the request was live.  Reading each step's
norm changes and ``fired`` counters back to the host cost a device-to-host copy, an event and
per-step host arithmetic for every step with steered rows; on an 8B model at 256 requests that
host time showed up one for one in throughput.  So the sums stay on the device, indexed by
the steering item's slot: a step adds its rows' norm changes with one ``index_add_``, and
admission records the site's ``fired`` count.  They are read only when a request retires or
its results are fetched.  Row counts are known on the host and stay there.
"""

from __future__ import annotations

import torch


class ReceiptAccumulators:
    """Per steering-item slot: the sum of norm changes, and the site's ``fired`` count at admission."""

    def __init__(self, device: torch.device, capacity: int = 64) -> None:
        self.device = device
        self.norm_sum = torch.zeros(capacity, dtype=torch.float64, device=device)
        self.fired_at_admission = torch.zeros(capacity, dtype=torch.int64, device=device)

    def ensure(self, slots: int) -> None:
        """Grow (doubling) so that ``slots`` fit; existing values are kept."""
        size = self.norm_sum.shape[0]
        if slots <= size:
            return
        grown = max(slots, 2 * size)
        norm = torch.zeros(grown, dtype=torch.float64, device=self.device)
        fired = torch.zeros(grown, dtype=torch.int64, device=self.device)
        norm[:size] = self.norm_sum
        fired[:size] = self.fired_at_admission
        self.norm_sum, self.fired_at_admission = norm, fired

    def admit(self, slots: torch.Tensor, fired: torch.Tensor) -> None:
        """Start the items of ``slots``; ``fired`` holds each one's site counter now."""
        self.norm_sum.index_fill_(0, slots, 0.0)
        self.fired_at_admission.index_copy_(0, slots, fired)

    def add(self, slots: torch.Tensor, deltas: torch.Tensor) -> None:
        self.norm_sum.index_add_(0, slots, deltas.to(torch.float64))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot ``(norm sum, fired at admission)`` as float64 rows."""
        return torch.stack(
            [self.norm_sum.index_select(0, slots), self.fired_at_admission.index_select(0, slots).double()], 1
        )
