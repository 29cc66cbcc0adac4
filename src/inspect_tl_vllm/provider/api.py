"""``tl-vllm``: an Inspect ModelAPI on an instrumented vLLM engine.

Every sample Inspect runs concurrently becomes one request in vLLM's continuous batch, with
its own steering and capture (run-wide model args, merged with ``Sample.metadata["tlvllm"]``
and ``generate(extra_body={"tlvllm": ...})``).  Captured activations go to safetensors files
next to the eval log; ``ModelOutput.metadata["tlvllm"]`` carries the file reference, a small
summary and the steering receipt.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

from inspect_ai.model import (
    ChatCompletionChoice,
    ChatMessage,
    ChatMessageAssistant,
    GenerateConfig,
    Logprob,
    Logprobs,
    ModelAPI,
    ModelOutput,
    ModelUsage,
    TopLogprob,
)
from inspect_ai.tool import ToolChoice, ToolInfo

from inspect_tl_vllm.aliases import resolve_model
from inspect_tl_vllm.engine.frontend import (
    PreparedRequest,
    max_input_position,
    merge_fetched,
    sampling_fields,
    vllm_prompt,
)
from inspect_tl_vllm.provider import carry_over as _carry_over  # noqa: F401 (registers the eval-retry hook)
from inspect_tl_vllm.provider.engine_pool import EngineThread, shared_engine
from inspect_tl_vllm.provider.model_args import parse_model_args
from inspect_tl_vllm.specs import TAG, RequestSpec, SpecError, parse_request_spec

logger = logging.getLogger(__name__)

STOP_REASONS = {"stop": "stop", "length": "max_tokens", "abort": "unknown"}


class TLVLLMAPI(ModelAPI):
    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),  # noqa: B008 (Inspect's own signature)
        **model_args: Any,
    ) -> None:
        super().__init__(model_name=model_name, base_url=base_url, api_key=api_key, config=config)
        from inspect_tl_vllm.engine.api import cpu_defaults

        self.settings = parse_model_args(model_args)
        self.model_path = resolve_model(model_name)
        # Inspect's output cache keys on base_url: make it name the run-wide steering, so a
        # cached unsteered answer is never returned for a steered run or the reverse.
        self.base_url = f"tl-vllm:{self.settings.fingerprint(self.model_path)}"
        engine_kwargs = cpu_defaults(self.settings.engine)
        self.engine = shared_engine(
            self.settings.engine_key(self.model_path),
            lambda: EngineThread(self.model_path, self.settings.instrument, engine_kwargs),
        )
        if self.settings.boot == "eager" and not self.engine.booted:
            started = time.perf_counter()
            self.engine.boot_now()
            logger.info(f"tl-vllm: engine for {model_name} ready in {time.perf_counter() - started:.0f} s")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        template = self.settings.chat_template
        if template and Path(template).expanduser().is_file():
            template = Path(template).expanduser().read_text()
        self.chat_template = template
        self._writable_dirs: set[Path] = set()

    def max_connections(self) -> int:
        return 64  # continuous batching: many samples in flight at once

    def max_tokens(self) -> int | None:
        return None

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> ModelOutput:
        from inspect_ai.log._samples import sample_active

        core = await self.engine.core()
        active = sample_active()
        where = f"sample {active.sample.id!r} (epoch {active.epoch})" if active else "request"
        spec = self._spec_for(active, config, where)
        prompt_ids = self._prompt_ids(input, tools)
        max_len = core.engine.model_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise SpecError(
                f"{where}: prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; "
                "shorten the input or raise -M max_model_len"
            )
        max_tokens = min(config.max_tokens or max_len, max_len - len(prompt_ids))
        prepared = core.instrumentation.prepare(spec, prompt_len=len(prompt_ids), max_tokens=max_tokens, where=where)
        if prepared is not None and (config.num_choices or 1) > 1:
            raise SpecError(f"{where}: num_choices > 1 with steering or capture is not supported")
        if prepared is not None and active is not None and spec is not None and spec.capture is not None:
            self._activations_dir(active)  # fail before generation if it cannot be written
        params = self._sampling_params(config, max_tokens, prepared)
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            final, payload = await self.engine.run(lambda: self._run(core, prompt_ids, params, prepared))
        except EngineDeadError as err:
            self.engine.discard(core)
            raise RuntimeError(
                f"{where}: the vLLM engine died ({err}). Samples completed before this point kept their "
                "activations on disk; finish the rest with `inspect eval-retry <log>` (a new engine boots)."
            ) from err
        output = self._model_output(final, tools)
        if prepared is not None:
            output.metadata = {TAG: self._record(core, payload, prepared, active, where)}
        return output

    # -- request building ------------------------------------------------------------------
    def _spec_for(self, active: Any, config: GenerateConfig, where: str) -> RequestSpec | None:
        spec = self.settings.run_spec
        if active is not None and active.sample.metadata and TAG in active.sample.metadata:
            if config.cache:
                raise SpecError(
                    f"{where}: steering in Sample.metadata is not part of Inspect's cache key, so --cache could "
                    "return an answer generated under other steering; attach it with the steer() solver or "
                    f"generate(extra_body={{'{TAG}': ...}}) instead, or run without the cache"
                )
            spec = spec.merged(parse_request_spec(active.sample.metadata[TAG], f"{where}: metadata.{TAG}"))
        extra = (config.extra_body or {}).get(TAG)
        if extra is not None:
            spec = spec.merged(parse_request_spec(extra, f"{where}: extra_body.{TAG}"))
        return None if spec.empty else spec

    def _prompt_ids(self, input: list[ChatMessage], tools: list[ToolInfo]) -> list[int]:
        messages = [_message_dict(m) for m in input]
        template = self.chat_template or self.tokenizer.chat_template
        if template is None:
            raise SpecError(f"model {self.model_name} has no chat template; pass -M chat_template=FILE_OR_TEXT")
        tool_list = [_tool_dict(t) for t in tools] or None
        if tool_list and "tools" not in template:
            raise SpecError(f"the chat template of {self.model_name} does not render tool definitions")
        continuing = bool(messages) and messages[-1]["role"] == "assistant"
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tool_list,
            chat_template=template,
            add_generation_prompt=not continuing,
            continue_final_message=continuing,
            tokenize=True,
            return_dict=False,
        )
        return list(ids)

    def _sampling_params(self, config: GenerateConfig, max_tokens: int, prepared: PreparedRequest | None) -> Any:
        from vllm import SamplingParams

        args: dict[str, Any] = {"max_tokens": max_tokens, "n": config.num_choices or 1}
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("seed", "seed"),
            ("frequency_penalty", "frequency_penalty"),
            ("presence_penalty", "presence_penalty"),
        ):
            value = getattr(config, ours)
            if value is not None:
                args[theirs] = value
        if config.stop_seqs:
            args["stop"] = list(config.stop_seqs)
        if config.logprobs:
            args["logprobs"] = config.top_logprobs or 0
        # A fresh object per request, as vLLM's own OpenAI server makes: it need not be deep-copied.
        return SamplingParams(**args, **sampling_fields(prepared), skip_clone=True)

    async def _run(self, core: Any, prompt_ids: list[int], params: Any, prepared: PreparedRequest | None) -> Any:
        """On the engine loop: upload new vectors, run the request, fetch its captures."""
        engine = core.engine
        prompt = vllm_prompt(prompt_ids, prepared)
        front = core.instrumentation
        if prepared is not None and prepared.vectors:
            assert self.engine.upload_lock is not None
            async with self.engine.upload_lock:
                upload = front.pending_upload([prepared])
                if upload is not None:
                    await engine.collective_rpc("tlvllm_put_vectors", args=(upload.blob, upload.evict))
                front.hold([prepared], upload)
        final = None
        try:
            async for out in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
                final = out
        except BaseException:  # cancelled (a sample limit, a failed eval) or failed: vLLM aborted it
            if prepared is not None:
                self.engine.spawn(_discard(core, prepared))  # the cancelled caller cannot wait for it
            raise
        payload = None
        if prepared is not None:
            generated = max(len(c.token_ids) for c in final.outputs)
            wanted = [[prepared.uid, max_input_position(len(prompt_ids), generated)]]
            try:
                payload = merge_fetched(await engine.collective_rpc("tlvllm_fetch", args=front.fetch_args(wanted)))[0]
            finally:
                front.release([prepared])
        return final, payload

    # -- results ---------------------------------------------------------------------------
    def _model_output(self, final: Any, tools: list[ToolInfo]) -> ModelOutput:
        choices = []
        for completion in final.outputs:
            message = self._assistant_message(completion.text, tools)
            stop = "tool_calls" if message.tool_calls else STOP_REASONS.get(completion.finish_reason, "unknown")
            choices.append(ChatCompletionChoice(message=message, stop_reason=stop, logprobs=self._logprobs(completion)))
        input_tokens = len(final.prompt_token_ids)
        output_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = ModelUsage(
            input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens
        )
        return ModelOutput(model=self.model_name, choices=choices, usage=usage)

    def _assistant_message(self, text: str, tools: list[ToolInfo]) -> ChatMessageAssistant:
        if tools:
            from inspect_ai.model._providers.util import HFHandler

            return HFHandler(self.model_name).parse_assistant_response(text, tools)
        return ChatMessageAssistant(content=text, model=self.model_name, source="generate")

    def _logprobs(self, completion: Any) -> Logprobs | None:
        if not completion.logprobs:
            return None
        content = []
        for token_id, options in zip(completion.token_ids, completion.logprobs, strict=False):
            chosen = options[token_id]
            top = sorted(options.values(), key=lambda lp: lp.rank or 0)
            content.append(
                Logprob(
                    token=chosen.decoded_token or self.tokenizer.decode([token_id]),
                    logprob=chosen.logprob,
                    top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=lp.logprob) for lp in top],
                )
            )
        return Logprobs(content=content)

    def _record(self, core: Any, payload: Any, prepared: PreparedRequest, active: Any, where: str) -> dict[str, Any]:
        result = core.instrumentation.decode(payload, where)
        result.check(where)  # raises: never score an unsteered answer as steered
        record: dict[str, Any] = {"receipt": result.receipt}
        if result.activations:
            summary = {
                hook: {"shape": list(t.shape), "mean_norm": float(t.float().norm(dim=-1).mean())}
                for hook, t in result.activations.items()
            }
            record["activations"] = {"hooks": summary}
            if active is not None:
                from inspect_tl_vllm.storage import write_sample

                directory = self._activations_dir(active)
                try:
                    entry = write_sample(
                        directory,
                        eval_id=active.eval_id,
                        sample_id=active.sample.id,
                        epoch=active.epoch,
                        sample_uuid=active.sample_uuid,
                        activations=result.activations,
                        tokens=result.receipt.get("captures", {}),
                        positions=result.positions,
                        extra={
                            "model": self.model_name,
                            "reduce": prepared.spec.capture.reduce if prepared.spec.capture else None,
                        },
                    )
                except OSError as err:  # disk full, file size limit: fail this sample, name it
                    raise OSError(err.errno, f"{where}: {err.strerror or err}") from err
                record["activations"].update({"dir": str(directory), "file": entry["file"], "sha256": entry["sha256"]})
        return record

    def _activations_dir(self, active: Any) -> Path:
        """This eval's activations folder, checked for write access once per folder."""
        from inspect_tl_vllm.storage import activations_dir_for, check_writable

        directory = activations_dir_for(active.log_location, active.eval_id, self.settings.activations_dir)
        if directory not in self._writable_dirs:
            check_writable(directory)
            self._writable_dirs.add(directory)
        return directory


async def _discard(core: Any, prepared: PreparedRequest) -> None:
    """Take back what the workers hold for a request that did not finish; a failure is logged,
    as ``Engine._discard`` logs it (the engine may be what failed)."""
    front = core.instrumentation
    front.release([prepared])
    try:
        front.discard(await core.engine.collective_rpc("tlvllm_fetch", args=front.discard_args([prepared])))
    except Exception as err:
        logger.warning(f"tl-vllm: could not release the cancelled request's results in the workers: {err}")


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": message.text}
    tool_calls = getattr(message, "tool_calls", None)
    if tool_calls:
        out["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.function, "arguments": call.arguments}}
            for call in tool_calls
        ]
    if message.role == "tool":
        out["tool_call_id"] = getattr(message, "tool_call_id", None)
        out["name"] = getattr(message, "function", None)
    return out


def _tool_dict(tool: ToolInfo) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters.model_dump(exclude_none=True),
        },
    }
