"""Inspect registry entry point (``inspect_ai`` group): registers the ``tl-vllm`` provider.

Inspect imports every provider's registry at start-up, so nothing heavy is imported here:
torch and vLLM load only when a ``tl-vllm/...`` model is actually used.
"""

from inspect_ai.model import ModelAPI, modelapi


@modelapi(name="tl-vllm")
def tl_vllm() -> type[ModelAPI]:
    from inspect_tl_vllm.provider.api import TLVLLMAPI

    return TLVLLMAPI
