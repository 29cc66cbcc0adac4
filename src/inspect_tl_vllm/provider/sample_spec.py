"""Per-sample steering from ``Sample.metadata["tlvllm"]``, made part of Inspect's cache key.

Inspect answers a cache hit before it calls the provider, from a key over the messages, the
``GenerateConfig`` (``extra_body`` included), the tools and the provider's ``base_url``; sample
metadata is not in it.  Read by the provider alone, metadata steering would let ``--cache``
return an answer generated under other steering (or none), looking right.  So this hook copies a
sample's metadata spec into ``GenerateConfig.extra_body[METADATA_KEY]`` before every model call
of that sample, ahead of the cache lookup: the spec is then part of the key, is logged with the
call's config, and is the only way the provider learns of it.

The hook reads the sample from ``active.active_sample`` (Inspect's hook data carries only a
summary of the metadata, which thins large values such as inline vectors).
"""

from __future__ import annotations

from inspect_ai.hooks import BeforeModelGenerate, Hooks, hooks

from inspect_tl_vllm.provider.active import active_sample
from inspect_tl_vllm.specs import TAG

PROVIDER_PREFIX = "tl-vllm/"
METADATA_KEY = "tlvllm_metadata"
"""``extra_body`` key that carries the sample's ``metadata["tlvllm"]`` (``extra_body["tlvllm"]``
stays the solver's and the user's own)."""


@hooks(
    name="tl_vllm_sample_steering",
    description="Puts a sample's metadata steering into the generate config, so Inspect's cache keys on it",
)
class SampleSteering(Hooks):
    async def on_before_model_generate(self, data: BeforeModelGenerate) -> None:
        active = active_sample()
        spec = (active.sample.metadata or {}).get(TAG) if active is not None else None
        if spec is not None and data.model_name.startswith(PROVIDER_PREFIX):
            # a new dict: the config is this call's own copy, its extra_body may be shared
            data.config.extra_body = {**(data.config.extra_body or {}), METADATA_KEY: spec}
