"""The one place the provider reads Inspect's private state: the sample being run.

``ModelAPI.generate`` receives messages and a config, not the sample; the provider needs the
sample's metadata (steering), id and epoch (to name errors and activation files), its eval id
and the log's location (to store activations beside the log).  Inspect exposes these through no
public accessor (its own providers read the same private function), so the access is isolated
in ``active_sample`` and fails with a message naming the supported inspect-ai range if Inspect
moves it (the test suite runs at both ends of that range).  Everything else reads the
``ActiveSample`` view defined here.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import requires, version
from typing import Any


@dataclass(frozen=True)
class ActiveSample:
    """What the provider needs of the running sample."""

    sample: Any  # inspect_ai.dataset.Sample: .id, .metadata
    epoch: int
    eval_id: str
    log_location: str
    sample_uuid: str | None
    """The logged sample's uuid; None on inspect-ai releases that do not expose it while running
    (activation files are then joined to their samples by id and epoch alone)."""


def active_sample() -> ActiveSample | None:
    """The running sample, or None outside an eval."""
    try:
        from inspect_ai.log._samples import sample_active

        active = sample_active()
        if active is None:
            return None
        return ActiveSample(
            sample=active.sample,
            epoch=active.epoch,
            eval_id=active.eval_id,
            log_location=active.log_location,
            sample_uuid=getattr(active, "sample_uuid", None),
        )
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            f"tl-vllm: inspect-ai {version('inspect-ai')} no longer provides the running sample where "
            f"tl-vllm reads it (inspect_ai.log._samples.sample_active: {err}); tl-vllm supports "
            f"{supported_inspect()}: install a release in that range"
        ) from err


def supported_inspect() -> str:
    """The inspect-ai range this installed tl-vllm declares, e.g. ``inspect-ai>=0.3.221,<0.4``."""
    for requirement in requires("inspect-tl-vllm") or []:
        if requirement.replace("_", "-").lower().startswith("inspect-ai") and "extra ==" not in requirement:
            return requirement.split(";")[0].strip()
    return "inspect-ai (see docs/INSTALL.md)"
