"""``tl-vllm``: an Inspect ModelAPI on an instrumented vLLM engine.

Every sample Inspect runs concurrently becomes one request in vLLM's continuous batch, with
its own steering and capture (run-wide model args, merged with ``Sample.metadata["tlvllm"]``
and ``generate(extra_body={"tlvllm": ...})``).  Captured activations go to safetensors files
next to the eval log; ``ModelOutput.metadata["tlvllm"]`` carries the file reference, a small
summary and the steering receipt.
"""

from __future__ import annotations

import asyncio
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
    ModelCall,
    ModelOutput,
    ModelUsage,
    TopLogprob,
)
from inspect_ai.tool import ToolChoice, ToolInfo

from inspect_tl_vllm.aliases import resolve_model
from inspect_tl_vllm.engine import lifecycle
from inspect_tl_vllm.engine.construct import InstrumentedLLM, cpu_defaults
from inspect_tl_vllm.engine.exits import why_engine_died
from inspect_tl_vllm.engine.frontend import CaptureResult, PreparedRequest, sampling_fields, vllm_prompt
from inspect_tl_vllm.provider import carry_over, run_record, sample_spec  # noqa: F401 (each registers its Inspect hook)
from inspect_tl_vllm.provider.active import ActiveSample, active_sample
from inspect_tl_vllm.provider.engine_pool import EngineThread, shared_engine
from inspect_tl_vllm.provider.generate_config import config_sampling, per_request
from inspect_tl_vllm.provider.model_args import parse_model_args
from inspect_tl_vllm.provider.run_record import record_run_once, spec_sha256
from inspect_tl_vllm.provider.sample_spec import FILES_KEY, METADATA_KEY, named_file_digests
from inspect_tl_vllm.provider.sampling_extras import sampling_extras
from inspect_tl_vllm.provider.tool_calls import parse_tool_calls
from inspect_tl_vllm.specs import TAG, RequestSpec, SpecError, parse_request_spec
from inspect_tl_vllm.store.folders import Folder
from inspect_tl_vllm.wire import FetchedResult

STOP_REASONS = {"stop": "stop", "length": "max_tokens", "abort": "unknown"}
DEFAULT_CONNECTIONS = 256
"""Samples in flight unless ``--max-connections`` or adaptive connections say otherwise: twice vLLM's
default ``max_num_seqs`` (128), so that requests wait in vLLM's queue, not in Inspect's."""
MIN_LOGPROB = -9999.0  # vLLM's OpenAI server clamps -inf to this; Inspect's vllm/ provider reports it so


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
        if config.max_connections is None and config.adaptive_connections is None:
            # Inspect's default, adaptive concurrency, starts at 20 samples in flight, grows to 100,
            # and never reads max_connections(); continuous batching wants the scheduler kept full.
            # ``config`` is the Model's own, which Inspect's sample limit also reads.
            config.max_connections = DEFAULT_CONNECTIONS
        self.settings = parse_model_args(model_args)
        self.model_path = resolve_model(model_name)
        engine_kwargs = cpu_defaults(self.settings.engine, self.model_path)
        self.engine_thread = shared_engine(
            self.settings.engine_key(self.model_path),
            lambda: EngineThread(
                self.model_path,
                self.settings.instrument,
                engine_kwargs,
                self.settings.adapter.path if self.settings.adapter is not None else None,
            ),
        )
        if self.settings.boot == "eager" and not self.engine_thread.booted:
            self.engine_thread.boot_now()
        elif self.settings.boot == "background":
            self.engine_thread.boot_in_background()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        template = self.settings.chat_template
        if template and Path(template).expanduser().is_file():
            template = Path(template).expanduser().read_text()
        self.chat_template = template
        self._writable_dirs: set[Folder] = set()
        self._calls: dict[tuple[str, str, int], int] = {}  # (eval, sample, epoch) -> model calls recorded

    @property
    def base_url(self) -> str | None:  # type: ignore[override]
        """Inspect's output cache keys on this, read at every call: it names the run-wide steering
        and the contents of the files it names as they are now, so a cached answer is never
        returned for other steering, or for a vector file overwritten since."""
        settings: Any = self.__dict__.get("settings")
        return None if settings is None else f"tl-vllm:{settings.fingerprint(self.model_path)}"

    @base_url.setter
    def base_url(self, value: str | None) -> None:
        """``ModelAPI.__init__`` assigns its ``base_url`` argument; tl-vllm serves no URL and derives its own."""

    def max_connections(self) -> int:
        return DEFAULT_CONNECTIONS  # continuous batching: many samples in flight at once

    def max_tokens(self) -> int | None:
        return None

    async def generate(
        self,
        input: list[ChatMessage],
        tools: list[ToolInfo],
        tool_choice: ToolChoice,
        config: GenerateConfig,
    ) -> tuple[ModelOutput, ModelCall]:
        active = active_sample()
        where = f"sample {active.sample.id!r} (epoch {active.epoch})" if active else "request"
        if active is not None:
            record_run_once(active.eval_id, self.settings, self.model_path)  # for the eval's log
        spec = self._spec_for(active, config, where)
        prompt_ids = self._prompt_ids(input, tools)  # a spec or chat that cannot work fails before the boot
        instrumented = await self.engine_thread.instrumented()
        max_len = instrumented.llm.model_config.max_model_len
        if len(prompt_ids) >= max_len:
            raise SpecError(
                f"{where}: prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; "
                "shorten the input or raise -M max_model_len"
            )
        max_tokens = min(config.max_tokens or max_len, max_len - len(prompt_ids))
        runs = self._runs(instrumented, spec, config, len(prompt_ids), max_tokens, where)
        if spec is not None and spec.capture is not None and active is not None:
            self._activations_dir(active)  # fail before generation if it cannot be written
        from vllm.v1.engine.exceptions import EngineDeadError

        started = time.perf_counter()  # after the boot: a sample's time is its own generation
        try:
            results = await self.engine_thread.run(lambda: self._run_all(instrumented, prompt_ids, runs))
        except EngineDeadError as err:
            why = await asyncio.to_thread(why_engine_died, instrumented.llm, self.engine_thread.oom_kills_at_boot)
            self.engine_thread.discard(instrumented)
            raise RuntimeError(
                f"{where}: the vLLM engine died ({err}): {why}. Samples completed before this point kept their "
                "activations on disk; finish the rest with `inspect eval-retry <log>` (a new engine boots)."
            ) from err
        output = self._model_output([final for final, _ in results], len(prompt_ids), tools, config)
        prepared = [request for _, request in runs]
        if prepared[0] is not None:
            front = instrumented.instrumentation
            # every choice is steered and checked (raises: never score an unsteered answer as
            # steered); the first one's capture is stored
            checked = [
                lifecycle.decode(front, payload, where if i == 0 else f"{where} choice {i}")
                for i, (_, payload) in enumerate(results)
            ]
            turn = (self._next_call(active), len(input))
            # in a thread: a store's upload (s3://...) must not hold up the other samples' requests
            record = await asyncio.to_thread(self._record, checked[0], prepared[0], active, where, turn)
            if len(runs) > 1:
                record["choices"] = [result.receipt for result in checked]
            output.metadata = {TAG: record}
        call = ModelCall.create(
            request={
                "prompt_tokens": len(prompt_ids),
                "sampling": [_sampling_summary(params) for params, _ in runs],
                "instrumented": prepared[0] is not None,
            },
            response={"finish_reasons": [choice.stop_reason for choice in output.choices]},
            time=time.perf_counter() - started,
        )
        return output, call

    async def answer_logprobs(self, input: list[ChatMessage], answer: str, *, ended: bool) -> list[float]:
        """The log-probability of each token of ``answer`` after ``input``, under the model with no
        steering at all (neither run-wide nor the sample's): the engine scores the prompt and
        the answer as one prompt (vLLM's ``prompt_logprobs``) and generates one token.
        ``ended`` adds the end-of-turn token, when the answer stopped by itself.  Tokens past the
        context (``max_model_len`` less one) are left out.  This is what
        ``research.fluency.fluency()`` scores; it never passes through Inspect's cache."""
        instrumented = await self.engine_thread.instrumented()
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        prompt_ids = self._prompt_ids(input, [])
        answer_ids = list(self.tokenizer(answer, add_special_tokens=False)["input_ids"])
        if ended and self.tokenizer.eos_token_id is not None:
            answer_ids.append(self.tokenizer.eos_token_id)
        if not answer_ids:
            raise SpecError("answer_logprobs: the answer is empty and did not end by itself; nothing to score")
        # an answer that ran to the end of the context is scored as far as it fits beside the one
        # token the engine must generate
        room = instrumented.llm.model_config.max_model_len - 1 - len(prompt_ids)
        if room <= 0:
            raise SpecError(f"answer_logprobs: the prompt alone has {len(prompt_ids)} tokens; raise -M max_model_len")
        answer_ids = answer_ids[:room]
        ids = prompt_ids + answer_ids
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
        )
        final, _ = await self.engine_thread.run(lambda: self._run(instrumented, ids, params, None))
        scored = final.prompt_logprobs[len(prompt_ids) :]
        return [max(entry[token].logprob, MIN_LOGPROB) for entry, token in zip(scored, answer_ids, strict=True)]

    # -- request building ------------------------------------------------------------------
    def _spec_for(self, active: ActiveSample | None, config: GenerateConfig, where: str) -> RequestSpec | None:
        """Run-wide spec, then the sample's metadata spec (put in ``extra_body`` by the hook in
        ``sample_spec.py``, so that Inspect's cache keys on it), then ``extra_body["tlvllm"]``."""
        extra = config.extra_body or {}
        if active is not None and TAG in (active.sample.metadata or {}) and METADATA_KEY not in extra:
            raise SpecError(
                f"{where}: Sample.metadata[{TAG!r}] did not reach the request: the tl-vllm hook "
                "'tl_vllm_sample_steering' that carries it (and keys Inspect's cache on it) is not active"
            )
        if FILES_KEY in extra and named_file_digests(extra) != extra[FILES_KEY]:
            raise SpecError(
                f"{where}: a vector file or SAE that this call's spec names changed after Inspect looked up its "
                "cache for the call; rerun the sample, and keep such files unchanged while an eval runs"
            )
        spec = self.settings.run_spec
        if METADATA_KEY in extra:
            spec = spec.merged(parse_request_spec(extra[METADATA_KEY], f"{where}: metadata.{TAG}"))
        if extra.get(TAG) is not None:
            spec = spec.merged(parse_request_spec(extra[TAG], f"{where}: extra_body.{TAG}"))
        return None if spec.empty else spec

    def _runs(
        self,
        instrumented: InstrumentedLLM,
        spec: RequestSpec | None,
        config: GenerateConfig,
        prompt_len: int,
        max_tokens: int,
        where: str,
    ) -> list[tuple[Any, PreparedRequest | None]]:
        """The vLLM requests behind one call, with their sampling params.

        Plain: one request with ``n = num_choices``.  Instrumented: one request per choice (the
        worker keeps one result per request), each steered alike; only the first captures, so a
        sample stores one set of activations.  A seed gives choice i the seed + i, as vLLM seeds
        the children of one request.  The fields of ``config`` that tl-vllm cannot honour are
        refused here, before any request is made (``generate_config.py``)."""
        choices = config.num_choices or 1
        front = instrumented.instrumentation
        vocab_size = instrumented.llm.model_config.get_vocab_size()
        template = str(self.chat_template or self.tokenizer.chat_template or "")
        extras = {**sampling_extras(config.extra_body, where), **config_sampling(config, vocab_size, template, where)}
        if spec is None:
            return [(self._sampling_params(config, max_tokens, None, extras, n=choices), None)]
        steer_only = RequestSpec(interventions=spec.interventions)
        runs = []
        for i in range(choices):
            request = front.prepare(
                spec if i == 0 else steer_only, prompt_len=prompt_len, max_tokens=max_tokens, where=where
            )
            seed = None if config.seed is None else config.seed + i
            runs.append((self._sampling_params(config, max_tokens, request, extras, n=1, seed=seed), request))
        return runs

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

    def _sampling_params(
        self,
        config: GenerateConfig,
        max_tokens: int,
        prepared: PreparedRequest | None,
        extras: dict[str, Any],
        *,
        n: int,
        seed: int | None = None,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        # FINAL_ONLY: one output with every choice (the default, cumulative, streams one child at a time)
        args: dict[str, Any] = {"max_tokens": max_tokens, "n": n, "output_kind": RequestOutputKind.FINAL_ONLY}
        for name in ("temperature", "top_p", "top_k", "frequency_penalty", "presence_penalty"):
            value = getattr(config, name)
            if value is not None:
                args[name] = value
        seed = config.seed if seed is None else seed
        if seed is not None:
            args["seed"] = seed
        if config.stop_seqs:
            args["stop"] = list(config.stop_seqs)
        if config.logprobs:
            args["logprobs"] = config.top_logprobs or 0
        # vLLM's own fields from extra_body (ignore_eos, min_tokens, ...), and logit_bias,
        # prompt_logprobs (which reads no prefix cache) and response_schema (generate_config.py)
        args.update(per_request(extras))
        # the spec's wire data, and no prefix-cache reads for a capture (None: vLLM's default)
        args.update({name: value for name, value in sampling_fields(prepared).items() if value is not None})
        # A fresh object per request, as vLLM's own OpenAI server makes: it need not be deep-copied.
        return SamplingParams(**args, skip_clone=True)

    async def _run_all(
        self, instrumented: InstrumentedLLM, prompt_ids: list[int], runs: list[tuple[Any, PreparedRequest | None]]
    ) -> list[tuple[Any, FetchedResult | None]]:
        """Every request of one call, concurrently; the first failure is raised once all are done."""
        if len(runs) == 1:
            return [await self._run(instrumented, prompt_ids, *runs[0])]
        results = await asyncio.gather(
            *(self._run(instrumented, prompt_ids, params, request) for params, request in runs),
            return_exceptions=True,
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)

    async def _run(
        self, instrumented: InstrumentedLLM, prompt_ids: list[int], params: Any, prepared: PreparedRequest | None
    ) -> tuple[Any, FetchedResult | None]:
        """On the engine loop: upload new vectors, run the request, fetch what the workers hold for it."""
        llm, front = instrumented.llm, instrumented.instrumentation
        if prepared is not None and prepared.vectors:
            assert self.engine_thread.upload_lock is not None
            async with self.engine_thread.upload_lock:
                await lifecycle.drive_async(lifecycle.upload(front, [prepared]), llm)
        final = None
        try:
            async for out in llm.generate(
                vllm_prompt(prompt_ids, prepared, rendered=True),
                params,
                request_id=uuid.uuid4().hex,
                lora_request=instrumented.lora_request,
            ):
                final = out
        except BaseException:  # cancelled (a sample limit, a failed eval) or failed: vLLM aborted it
            if prepared is not None:  # the cancelled caller cannot wait for this
                self.engine_thread.spawn(lifecycle.drive_async(lifecycle.release_aborted(front, [prepared]), llm))
            raise
        if prepared is None:
            return final, None
        generated = max(len(c.token_ids) for c in final.outputs)
        payloads = await lifecycle.drive_async(lifecycle.fetch(front, [(prepared, len(prompt_ids), generated)]), llm)
        return final, payloads[0]

    # -- results ---------------------------------------------------------------------------
    def _model_output(
        self, finals: list[Any], prompt_len: int, tools: list[ToolInfo], config: GenerateConfig
    ) -> ModelOutput:
        choices = []
        with_prompt_logprobs = getattr(config, "prompt_logprobs", None) is not None
        one_tool_call = getattr(config, "parallel_tool_calls", None) is False
        for final in finals:
            # vLLM's server puts a request's prompt logprobs on the response; Inspect's vllm/ on every choice
            prompt_logprobs = self._prompt_logprobs(final.prompt_logprobs) if with_prompt_logprobs else None
            for completion in final.outputs:
                message = self._assistant_message(completion.text, tools)
                if one_tool_call and message.tool_calls:
                    message.tool_calls = message.tool_calls[:1]  # as vLLM's server does
                stop = "tool_calls" if message.tool_calls else STOP_REASONS.get(completion.finish_reason, "unknown")
                logprobs = self._logprobs(completion, config.top_logprobs or 0) if config.logprobs else None
                choices.append(
                    ChatCompletionChoice(
                        message=message, stop_reason=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs
                    )
                )
        output_tokens = sum(len(c.token_ids) for final in finals for c in final.outputs)
        usage = ModelUsage(
            input_tokens=prompt_len, output_tokens=output_tokens, total_tokens=prompt_len + output_tokens
        )
        return ModelOutput(model=self.model_name, choices=choices, usage=usage)

    def _assistant_message(self, text: str, tools: list[ToolInfo]) -> ChatMessageAssistant:
        content, tool_calls = parse_tool_calls(text, tools) if tools else (text, [])
        return ChatMessageAssistant(
            content=content, tool_calls=tool_calls or None, model=self.model_name, source="generate"
        )

    def _logprobs(self, completion: Any, top: int) -> Logprobs | None:
        """Per token: the sampled token's logprob and the first ``top`` alternatives as vLLM lists
        them (the sampled token first, then by rank), as vLLM's OpenAI server and so Inspect's
        ``vllm/`` provider report them: exactly ``top`` entries, none when ``top`` is 0."""
        if not completion.logprobs:
            return None
        content = []
        for token_id, options in zip(completion.token_ids, completion.logprobs, strict=False):
            chosen = options[token_id]
            alternatives = list(options.items())[:top]
            content.append(
                Logprob(
                    token=self._token_text(token_id, chosen),
                    logprob=max(chosen.logprob, MIN_LOGPROB),
                    bytes=_utf8(self._token_text(token_id, chosen)),
                    top_logprobs=[
                        TopLogprob(
                            token=self._token_text(other, lp),
                            logprob=max(lp.logprob, MIN_LOGPROB),
                            bytes=_utf8(self._token_text(other, lp)),
                        )
                        for other, lp in alternatives
                    ],
                )
            )
        return Logprobs(content=content)

    def _prompt_logprobs(self, entries: list[Any] | None) -> Logprobs | None:
        """vLLM's prompt logprobs as Inspect's ``vllm/`` provider reports them (its
        ``parse_vllm_prompt_logprobs_raw`` on vLLM's OpenAI server's response): one entry per prompt
        token but the first, the token vLLM lists first (the prompt's own), then the others it lists
        as ``top_logprobs`` (None when there are none); -inf as the server sends it, -9999."""
        content = []
        for entry in entries or []:
            if not entry:
                continue
            (token_id, own), *others = entry.items()
            content.append(
                Logprob(
                    token=self._token_text(token_id, own),
                    logprob=_served_logprob(own.logprob),
                    top_logprobs=[
                        TopLogprob(token=self._token_text(other, lp), logprob=_served_logprob(lp.logprob))
                        for other, lp in others
                    ]
                    or None,
                )
            )
        return Logprobs(content=content) if content else None

    def _token_text(self, token_id: int, logprob: Any) -> str:
        return logprob.decoded_token if logprob.decoded_token is not None else self.tokenizer.decode([token_id])

    def _next_call(self, active: ActiveSample | None) -> int:
        """The number of this model call among the sample's calls that ran here (0 first): every call
        of an agent loop or a dialogue keeps its own capture."""
        if active is None:
            return 0
        key = (active.eval_id, active.sample_uuid or repr(active.sample.id), active.epoch)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        return call

    def _record(
        self,
        result: CaptureResult,
        prepared: PreparedRequest,
        active: ActiveSample | None,
        where: str,
        turn: tuple[int, int] = (0, 0),
    ) -> dict[str, Any]:
        """The call's record for its output metadata, its captures stored as call ``turn[0]`` of the
        sample (``turn[1]``: how many messages its input held)."""
        applied = prepared.applied()
        record: dict[str, Any] = {"receipt": result.receipt, "applied": applied, "spec_sha256": spec_sha256(applied)}
        if result.activations:
            summary = {
                hook: {"shape": list(t.shape), "mean_norm": float(t.float().norm(dim=-1).mean())}
                for hook, t in result.activations.items()
            }
            record["activations"] = {"hooks": summary}
            if active is not None:
                from inspect_tl_vllm.store.sample_store import STORED_KEYS, record_dir, write_sample
                from inspect_tl_vllm.store.shards import writer_for

                directory = self._activations_dir(active)
                shard_mb = self.settings.activations_shard_mb
                try:
                    entry = write_sample(
                        directory,
                        eval_id=active.eval_id,
                        sample_id=active.sample.id,
                        epoch=active.epoch,
                        sample_uuid=active.sample_uuid,
                        activations=result.activations,
                        tokens=result.tokens(),
                        positions=result.positions,
                        extra={
                            "model": self.model_name,
                            "reduce": prepared.spec.capture.reduce if prepared.spec.capture else None,
                            "input_messages": turn[1],
                        },
                        shards=writer_for(directory, shard_mb) if shard_mb else None,
                        call=turn[0],
                    )
                except OSError as err:  # disk full, file size limit: fail this sample, name it
                    raise OSError(err.errno, f"{where}: {err.strerror or err}") from err
                folder = record_dir(directory, active.log_location)
                # the entry's hook details too (dtype, token count, positions): with them the log alone
                # finds and describes the file (activations.read), with no index to go through
                hooks = {hook: {**entry["hooks"][hook], **summary[hook]} for hook in summary}
                stored = {"dir": folder, **{key: entry[key] for key in STORED_KEYS if key in entry}}
                record["activations"] = {"hooks": hooks, **stored}
        return record

    def _activations_dir(self, active: ActiveSample) -> Folder:
        """This eval's activations folder, checked for write access once per folder (with shards,
        its writer made too, so that a spool that cannot be created fails before generation)."""
        from inspect_tl_vllm.store.sample_store import activations_dir_for
        from inspect_tl_vllm.store.shards import writer_for

        directory = activations_dir_for(active.log_location, active.eval_id, self.settings.activations_dir)
        if directory not in self._writable_dirs:
            directory.check_writable()
            if self.settings.activations_shard_mb:
                writer_for(directory, self.settings.activations_shard_mb)
            self._writable_dirs.add(directory)
        return directory


def _sampling_summary(params: Any) -> dict[str, Any]:
    """The sampling parameters a request ran with, as the log's model call records them."""
    fields = ("n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs")
    summary = {name: getattr(params, name) for name in fields}
    if params.prompt_logprobs is not None:
        summary["prompt_logprobs"] = params.prompt_logprobs
    if params.logit_bias:
        summary["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    if params.structured_outputs is not None:
        summary["response_schema"] = params.structured_outputs.json
    return summary


def _served_logprob(value: float) -> float:
    """A prompt logprob as vLLM's OpenAI server sends it: -inf as -9999, others as they are."""
    return MIN_LOGPROB if value == float("-inf") else value


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


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
