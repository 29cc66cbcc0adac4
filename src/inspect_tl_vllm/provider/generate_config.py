"""``GenerateConfig`` fields beyond the basic sampling ones, as Inspect's ``vllm/`` provider means them.

``vllm/`` sends these to vLLM's OpenAI server, which makes them into ``SamplingParams``; here the
same ``SamplingParams`` fields are built, or the field is refused by name before generation (a field
silently dropped would change what a run measures):

- ``logit_bias`` ({token id: bias}): ``SamplingParams.logit_bias``.  vLLM's server clamps a bias to
  [-100, 100] and fails an id outside the vocabulary at admission; here either, or a bias that is
  not finite, is refused naming the entry.
- ``prompt_logprobs``: ``SamplingParams.prompt_logprobs``, reported on every choice as ``vllm/``
  reports them (``TLVLLMAPI._prompt_logprobs``).  Such a request reads no prefix cache, so every
  prompt token is scored (vLLM's own default for it, set here explicitly).
- ``response_schema``: vLLM's structured outputs, ``StructuredOutputsParams(json=schema)``, as vLLM's
  server turns ``response_format={"type": "json_schema", ...}`` into them; the engine's backend
  (``auto``: xgrammar, else guidance) runs on the CPU build too.  The whole schema is sent: ``vllm/``
  leaves out the extended fields (``pattern``, ``minLength``, ...) that some OpenAI-compatible
  servers reject, but vLLM honours them.
- ``best_of``: refused unless 1; vLLM's V1 engine has no ``best_of``.
- ``reasoning_effort``: ``vllm/`` hands it to the chat template as a variable, which tl-vllm does
  not: refused where the template reads it, accepted (as the no-op it is on ``vllm/``) elsewhere.
  Inspect's agent bridge sets it from an agent's own requests.
- ``modalities``: refused when it asks for any; vLLM generates text only.

``parallel_tool_calls=False`` keeps the first tool call, as vLLM's server does (``model_api.py``).  Every
field is read with ``getattr``: a ``GenerateConfig`` of an older Inspect may lack one.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from inspect_ai.model import GenerateConfig

from inspect_tl_vllm.specs import SpecError

LOGIT_BIAS_RANGE = 100.0
"""vLLM's server and OpenAI accept biases in [-100, 100]: 100 forces a token, -100 bans it."""


def refuse_unsupported(config: GenerateConfig, chat_template: str, where: str) -> None:
    """Raise, naming the field, for a field set to a value tl-vllm cannot honour with ``chat_template``."""
    best_of = getattr(config, "best_of", None)
    if best_of is not None and best_of != 1:
        raise SpecError(
            f"{where}: best_of={best_of} is not supported by vLLM's V1 engine (its SamplingParams has no "
            "best_of); use num_choices for several completions"
        )
    effort = getattr(config, "reasoning_effort", None)
    if effort is not None and "reasoning_effort" in chat_template:
        raise SpecError(
            f"{where}: reasoning_effort={effort!r} is not supported by tl-vllm: this model's chat template reads "
            "the variable 'reasoning_effort', which Inspect's vllm/ provider sets and tl-vllm does not; remove "
            "it, or give a chat template that sets the effort itself (-M chat_template)"
        )
    modalities = getattr(config, "modalities", None)
    if modalities:
        raise SpecError(f"{where}: modalities={modalities!r}: vLLM generates text only; remove modalities")


def config_sampling(config: GenerateConfig, vocab_size: int, chat_template: str, where: str) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments that ``logit_bias``, ``prompt_logprobs`` and
    ``response_schema`` set, checked against the model's ``vocab_size``, once the fields that
    cannot be honoured are refused."""
    refuse_unsupported(config, chat_template, where)
    fields: dict[str, Any] = {}
    bias = getattr(config, "logit_bias", None)
    if bias:
        fields["logit_bias"] = logit_bias(bias, vocab_size, where)
    prompt_logprobs = getattr(config, "prompt_logprobs", None)
    if prompt_logprobs is not None:
        if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or prompt_logprobs < 0:
            raise SpecError(f"{where}: prompt_logprobs={prompt_logprobs!r} must be a whole number >= 0")
        fields["prompt_logprobs"] = prompt_logprobs
        fields["skip_reading_prefix_cache"] = True  # a cached prefix's rows would have no logprobs
    schema = getattr(config, "response_schema", None)
    if schema is not None:
        from vllm.sampling_params import StructuredOutputsParams

        fields["structured_outputs"] = StructuredOutputsParams(json=schema.json_schema.model_dump(exclude_none=True))
    return fields


def per_request(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` for one request: a structured-outputs object of its own, as vLLM's server makes one
    per request (vLLM records the backend it chose in it)."""
    structured = fields.get("structured_outputs")
    return fields if structured is None else {**fields, "structured_outputs": copy.copy(structured)}


def logit_bias(bias: dict[Any, Any], vocab_size: int, where: str) -> dict[int, float]:
    """``{token id: bias}`` with every id in the vocabulary and every bias finite in [-100, 100]."""
    ids: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int):
            raise SpecError(f"{where}: logit_bias key {token!r} must be a token id (an integer)")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{where}: logit_bias[{token}] = {value!r} must be a number")
        if not (math.isfinite(value) and -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE):
            raise SpecError(
                f"{where}: logit_bias[{token}] = {value}: a bias must be a finite number in "
                f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}] (100 forces a token, -100 bans it)"
            )
        ids[token] = float(value)
    outside = sorted(token for token in ids if not 0 <= token < vocab_size)
    if outside:
        shown = ", ".join(map(str, outside[:10])) + (", ..." if len(outside) > 10 else "")
        raise SpecError(
            f"{where}: logit_bias names token id(s) {shown} outside the model's vocabulary of {vocab_size} "
            f"tokens (ids 0..{vocab_size - 1})"
        )
    return ids
