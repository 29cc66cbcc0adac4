"""Per-sample steering from ``Sample.metadata["tlvllm"]``, made part of Inspect's cache key.

Inspect answers a cache hit before it calls the provider, from a key over the messages, the
``GenerateConfig`` (``extra_body`` included), the tools and the provider's ``base_url``; sample
metadata is not in it.  Read by the provider alone, metadata steering would let ``--cache``
return an answer generated under other steering (or none), looking right.  So this hook copies a
sample's metadata spec into ``GenerateConfig.extra_body[METADATA_KEY]`` before every model call
of that sample, ahead of the cache lookup: the spec is then part of the key, is logged with the
call's config, and is the only way the provider learns of it.

Specs name vector files and SAE folders by path, so the hook also puts the digests of those
files' contents, as they are at this call, into ``extra_body[FILES_KEY]`` (for the metadata spec
and the solver's or task's ``extra_body["tlvllm"]`` alike): a vector file overwritten between two
runs gives another key, never the old steered answer.  The provider checks them again just
before it loads the files.  (The run-wide ``-M steer`` spec reaches the key through the
provider's ``base_url``, computed per call.)

The hook reads the sample from ``active.active_sample`` (Inspect's hook data carries only a
summary of the metadata, which thins large values such as inline vectors).
"""

from __future__ import annotations

from typing import Any

from inspect_ai.hooks import BeforeModelGenerate, Hooks, hooks

from inspect_tl_vllm._registry import MODEL_PREFIX
from inspect_tl_vllm.provider.active import active_sample
from inspect_tl_vllm.specs import TAG, SpecError, parse_request_spec

METADATA_KEY = "tlvllm_metadata"
"""``extra_body`` key that carries the sample's ``metadata["tlvllm"]`` (``extra_body["tlvllm"]``
stays the solver's and the user's own)."""
FILES_KEY = "tlvllm_files"
"""``extra_body`` key that carries the digests of the files the call's specs name."""
SPEC_KEYS = (METADATA_KEY, TAG)
"""The ``extra_body`` keys that hold a spec, in the order the provider merges them."""


def named_file_digests(extra_body: dict[str, Any]) -> dict[str, Any]:
    """Per spec in ``extra_body`` (``SPEC_KEYS``), the digests of the files it names; a spec that
    does not parse is left to the provider, which names what is wrong with it."""
    from inspect_tl_vllm.vectors.digests import spec_file_digests

    digests = {}
    for key in SPEC_KEYS:
        if extra_body.get(key) is None:
            continue
        try:
            spec = parse_request_spec(extra_body[key], key)
        except SpecError:
            continue
        named = spec_file_digests(spec)
        if named:
            digests[key] = named
    return digests


@hooks(
    name="tl_vllm_sample_steering",
    description="Puts a sample's metadata steering into the generate config, so Inspect's cache keys on it",
)
class SampleSteering(Hooks):
    async def on_before_model_generate(self, data: BeforeModelGenerate) -> None:
        if not data.model_name.startswith(MODEL_PREFIX):
            return
        active = active_sample()
        spec = (active.sample.metadata or {}).get(TAG) if active is not None else None
        # a new dict: the config is this call's own copy, its extra_body may be shared
        body = {**(data.config.extra_body or {})}
        if spec is not None:
            body[METADATA_KEY] = spec
        digests = named_file_digests(body)
        if digests:
            body[FILES_KEY] = digests
        if body != (data.config.extra_body or {}):
            data.config.extra_body = body
