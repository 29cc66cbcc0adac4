"""Python API for notebooks and scripts, on the same core as the Inspect provider (example):

engine = inspect_tl_vllm.boot("smollm2")
out = engine.generate(["Hello"], capture={"hooks": ["blocks.6.hook_resid_post"]},
                      steering=[{"hook": "blocks.6.hook_resid_post", "op": "add",
                                 "vector": "vec.safetensors", "coef": 4.0}])
out[0].text, out[0].activations["blocks.6.hook_resid_post"], out[0].receipt
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from inspect_tl_vllm.engine import lifecycle
from inspect_tl_vllm.engine.construct import InstrumentedLLM, construct_instrumented_llm, cpu_defaults
from inspect_tl_vllm.engine.frontend import PreparedRequest, merge_status, sampling_fields, vllm_prompt
from inspect_tl_vllm.specs import Capture, Intervention, RequestSpec, parse_request_spec

Prompt = str | list[dict[str, str]] | list[int]  # text, chat messages, or token ids


@dataclass
class Generation:
    """One prompt's result: text, tokens, and what the instrumentation did and saw."""

    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    receipt: dict[str, Any] = field(default_factory=dict)
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: dict[str, list[int]] = field(default_factory=dict)


def _chunks(total: int, first: int = 8) -> list[tuple[int, int]]:
    """[start, stop) ranges that double in size: the first requests reach the engine quickly,
    and a few hundred take only a handful of vector uploads."""
    bounds, start, size = [], 0, first
    while start < total:
        bounds.append((start, min(total, start + size)))
        start, size = start + size, size * 2
    return bounds


class Engine:
    """Offline instrumented engine: batches all prompts of a call into one vLLM run.

    Safe to share between threads: calls run one after another.  ``vllm.LLM`` has one engine
    client and waits for *all* its requests at the end of a call, so two calls at once would
    mix their outputs (and its ZeroMQ socket aborts the process when two threads use it).
    To batch prompts, pass them to one call."""

    def __init__(self, core: InstrumentedLLM) -> None:
        self.core = core
        self.llm = core.llm
        self.tokenizer = self.llm.get_tokenizer()
        self.last_timings: dict[str, float] = {}  # seconds per phase of the last generate() call
        self._lock = threading.Lock()  # one call on the engine at a time (see the class docstring)

    @property
    def hidden_size(self) -> int:
        return self.core.instrumentation.hidden_size

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        return list(
            self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    def generate(
        self,
        prompts: list[Prompt] | Prompt,
        *,
        steering: list[Intervention | dict[str, Any]] | None = None,
        capture: Capture | dict[str, Any] | None = None,
        specs: list[RequestSpec | dict[str, Any] | None] | None = None,
        max_tokens: int = 16,
        temperature: float = 0.0,
        strict: bool = True,
        progress: bool = False,
        **sampling: Any,
    ) -> list[Generation]:
        """Generate for every prompt; ``specs`` gives each prompt its own spec (else one for all).

        Requests enter the engine in growing chunks, each as soon as its specs are prepared and
        its vectors uploaded, so the engine is already generating for the first prompts while
        the front end loads, hashes and uploads the vectors of the later ones (vLLM's own
        ``generate`` likewise adds each prompt as soon as it is rendered).  Every spec is
        validated before the first request goes in; a later failure (a vector file that does
        not load, a vector of the wrong width) aborts the requests already added.
        ``progress=True`` shows vLLM's progress bar over the requests.
        """
        with self._lock:
            return self._generate(
                prompts, steering, capture, specs, max_tokens, temperature, strict, progress, sampling
            )

    def _generate(
        self,
        prompts: list[Prompt] | Prompt,
        steering: list[Intervention | dict[str, Any]] | None,
        capture: Capture | dict[str, Any] | None,
        specs: list[RequestSpec | dict[str, Any] | None] | None,
        max_tokens: int,
        temperature: float,
        strict: bool,
        progress: bool,
        sampling: dict[str, Any],
    ) -> list[Generation]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], dict | int))
        prompts = [prompts] if single else prompts
        shared = parse_request_spec({"interventions": steering or [], "capture": capture}, "generate()")
        per_prompt = specs if specs is not None else [shared] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"specs: {len(per_prompt)} specs for {len(prompts)} prompts")
        front = self.core.instrumentation
        started = time.perf_counter()
        checked = [None if raw is None else parse_request_spec(raw, f"prompt {i}") for i, raw in enumerate(per_prompt)]
        sampling = {"max_tokens": max_tokens, "temperature": temperature, **sampling}
        prepared: list[PreparedRequest | None] = []
        added: list[str] = []
        try:
            for start, stop in _chunks(len(prompts)):
                tokens = [self.tokenize(prompt) for prompt in prompts[start:stop]]
                requests = [
                    front.prepare(spec, prompt_len=len(ids), max_tokens=max_tokens, where=f"prompt {i}")
                    for i, spec, ids in zip(range(start, stop), checked[start:stop], tokens, strict=True)
                ]
                added += self._add(tokens, requests, sampling)
                prepared += requests
            prepared_at = time.perf_counter()
            outputs = self.llm.wait_for_completion(use_tqdm=progress)
        except BaseException:  # a failed spec or an interrupt: no request of this call may run on
            if added:
                self.llm.llm_engine.abort_request(added, internal=True)
                lifecycle.drive(lifecycle.release_aborted(front, [r for r in prepared if r is not None]), self.llm)
            raise
        generated_at = time.perf_counter()
        finished = [
            (request, len(out.prompt_token_ids), len(out.outputs[0].token_ids))
            for out, request in zip(outputs, prepared, strict=True)
            if request is not None
        ]
        labels = [f"prompt {i}" for i, request in enumerate(prepared) if request is not None]
        payloads = lifecycle.drive(lifecycle.fetch(front, finished), self.llm) if finished else []
        fetched = (
            lifecycle.decode(front, payload, label, strict=strict)
            for payload, label in zip(payloads, labels, strict=True)
        )
        results = []
        for out, request in zip(outputs, prepared, strict=True):
            completion = out.outputs[0]
            gen = Generation(
                completion.text, list(out.prompt_token_ids), list(completion.token_ids), completion.finish_reason
            )
            if request is not None:
                result = next(fetched)
                gen.receipt, gen.activations, gen.positions = result.receipt, result.activations, result.positions
            results.append(gen)
        self.last_timings = {
            # specs checked, vectors loaded and uploaded, requests added (the engine runs meanwhile)
            "prepare_s": prepared_at - started,
            "generate_s": generated_at - prepared_at,  # the rest of vLLM's generation
            "fetch_s": time.perf_counter() - generated_at,  # results fetched from the workers and decoded
        }
        return results

    def _add(
        self, token_lists: list[list[int]], requests: list[PreparedRequest | None], sampling: dict[str, Any]
    ) -> list[str]:
        """Upload the vectors these requests need that the workers lack, then add the requests."""
        from vllm import SamplingParams

        lifecycle.drive(lifecycle.upload(self.core.instrumentation, requests), self.llm)
        inputs = [vllm_prompt(tokens, request) for tokens, request in zip(token_lists, requests, strict=True)]
        # one fresh object per request: vLLM need not deep-copy it (and its wire spec)
        params = [SamplingParams(**sampling, **sampling_fields(request), skip_clone=True) for request in requests]
        return self.llm.enqueue(inputs, params, lora_request=self.core.lora_request, use_tqdm=False)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return merge_status(self.llm.collective_rpc("tlvllm_status"))


def boot(model: str = "smollm2", *, instrument: Any = None, lora: str | None = None, **engine_kwargs: Any) -> Engine:
    """Boot an offline instrumented engine (CPU-friendly defaults when there is no GPU); ``lora``: a
    PEFT LoRA adapter's folder that every request runs with."""
    return Engine(
        construct_instrumented_llm(model, instrument=instrument, lora=lora, **cpu_defaults(engine_kwargs, model))
    )
