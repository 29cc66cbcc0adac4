"""What a scorer reads: the activations the provider stored for the sample being scored."""

from __future__ import annotations

import torch
from inspect_ai.solver import TaskState

from inspect_tl_vllm.specs import TAG, SpecError


def stored_activations(state: TaskState, scorer: str, advice: str) -> dict[str, torch.Tensor]:
    """The tensors stored for ``state``'s output, read through the file its metadata names
    (kept inside its folder); a SpecError naming ``scorer`` and ``advice`` when it stored none."""
    from inspect_tl_vllm.provider.active import active_sample
    from inspect_tl_vllm.store.sample_store import read_sample, recorded_dir

    stored = (state.output.metadata or {}).get(TAG, {}).get("activations", {})
    if "dir" not in stored:
        raise SpecError(f"{scorer}: sample {state.sample_id!r} has no stored activations; {advice}")
    where = f"{scorer}: sample {state.sample_id!r} epoch {state.epoch} output metadata"
    active = active_sample()  # the folder is recorded relative to the log's folder
    folder = recorded_dir(stored["dir"], active.log_location) if active is not None else stored["dir"]
    return read_sample(folder, stored, where=where)
