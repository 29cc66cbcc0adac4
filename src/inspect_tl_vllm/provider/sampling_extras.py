"""vLLM sampling fields that ``GenerateConfig.extra_body`` may carry, as with Inspect's ``vllm/``.

Inspect's ``vllm/`` provider sends ``extra_body`` to vLLM's OpenAI server, which reads vLLM's own
sampling fields from it (``ignore_eos``, ``min_tokens``, ...).  A task written for ``vllm/`` should
mean the same on ``tl-vllm``, so the same fields are read here and passed to ``SamplingParams``.
Any other key is refused by name (a key silently dropped would change what a run measures:
``ignore_eos`` is how a benchmark fixes the output length), except tl-vllm's own keys.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from inspect_tl_vllm.provider.sample_spec import FILES_KEY, METADATA_KEY
from inspect_tl_vllm.specs import TAG, SpecError, readable_error


class VLLMSamplingExtras(BaseModel):
    """The accepted fields, each with the range vLLM's ``SamplingParams`` admits."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=2**20)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31)]] | None = Field(None, max_length=1024)


def sampling_extras(extra_body: dict[str, Any] | None, where: str) -> dict[str, Any]:
    """The ``SamplingParams`` keyword arguments that ``extra_body`` sets (tl-vllm's own keys aside)."""
    given = {key: value for key, value in (extra_body or {}).items() if key not in (TAG, METADATA_KEY, FILES_KEY)}
    unknown = sorted(set(given) - set(VLLMSamplingExtras.model_fields))
    if unknown:
        raise SpecError(
            f"{where}: extra_body key(s) {', '.join(map(repr, unknown))} are not used by tl-vllm. It reads "
            f"{TAG!r} (steering and capture) and these vLLM sampling fields: "
            f"{', '.join(VLLMSamplingExtras.model_fields)}; remove the others"
        )
    try:
        extras = VLLMSamplingExtras.model_validate(given)
    except ValueError as err:  # pydantic.ValidationError
        raise SpecError(f"{where}: extra_body: {readable_error(err)}") from None
    return extras.model_dump(exclude_none=True)
