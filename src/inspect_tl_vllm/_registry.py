"""Inspect registry entry point (``inspect_ai`` group): registers the ``tl-vllm`` provider.

Inspect imports every provider's registry at start-up, so nothing heavy is imported here:
torch and vLLM load only when a ``tl-vllm/...`` model is actually used.
"""

from inspect_ai.model import ModelAPI, modelapi

PROVIDER_NAME = "tl-vllm"
MODEL_PREFIX = f"{PROVIDER_NAME}/"
"""How Inspect names a model of this provider: ``tl-vllm/<model>``."""


@modelapi(name=PROVIDER_NAME)
def tl_vllm() -> type[ModelAPI]:
    from inspect_tl_vllm.provider.model_api import TLVLLMAPI

    return TLVLLMAPI
