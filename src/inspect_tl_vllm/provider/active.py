"""The one place the provider reads Inspect's private state: the sample being run.

``ModelAPI.generate`` receives messages and a config, not the sample; the provider needs the
sample's id and epoch (to name errors and activation files), its eval id and the log's location
(to store activations beside the log).  Inspect exposes these through no public accessor
(its own providers read the same private function), so the access is isolated here and fails
with a clear message if Inspect moves it.
"""

from __future__ import annotations

from typing import Any


def active_sample() -> Any | None:
    """Inspect's ``ActiveSample`` of the running sample (``.sample``, ``.epoch``, ``.eval_id``,
    ``.sample_uuid``, ``.log_location``), or None outside an eval."""
    try:
        from inspect_ai.log._samples import sample_active
    except ImportError as err:  # pragma: no cover - depends on the installed inspect-ai
        from importlib.metadata import version

        raise RuntimeError(
            f"tl-vllm: inspect-ai {version('inspect-ai')} no longer provides inspect_ai.log._samples.sample_active, "
            "which tl-vllm reads to name samples and place activations; install a supported inspect-ai "
            "(see the README)"
        ) from err
    return sample_active()
