"""What vLLM's front end pays to detokenize a generated token, by what the token is.

    python bench/diagnostics/detok_cost.py [--requests 256] [--tokens 256] [--out F]

The 8B-shaped throughput model has 128,256 ids but borrows SmolLM2's tokenizer, which knows
49,152, and its random weights decode greedily, so what a variant generates (and with it the
front end's work) depends on arbitrary ids: steering changes which ids come out.  This drives
vLLM's own incremental detokenizer (``IncrementalDetokenizer.from_new_request``, the one
``LLM.generate`` uses) over the same step order as a batch of ``--requests`` requests
decoding ``--tokens`` tokens, for streams of ordinary text, one known id repeated, one id
past the tokenizer repeated, and ids drawn uniformly from either vocabulary.  It prints
microseconds per token and the front end's detokenizing time per decode step of the batch,
to set against an engine step (~11 ms for the 8B shape at 256 requests on an H200).  CPU only:
no engine is started.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MODEL_VOCAB = 128_256  # the 8B shape's ids


def streams(tokenizer: Any, requests: int, tokens: int) -> dict[str, Callable[[int], list[int]]]:
    """Per case, a function from request index to that request's generated ids."""
    text = "The city grew along the river, and its markets drew traders from far away. " * 40
    text_ids = tokenizer(text)["input_ids"][:tokens]
    known = len(tokenizer)
    rng = random.Random(0)
    return {
        "ordinary text": lambda i: text_ids,
        "one known id repeated": lambda i: [1234] * tokens,
        f"one id past the tokenizer ({known:,}+) repeated": lambda i: [100_000] * tokens,
        f"uniform over the tokenizer's {known:,}": lambda i: [rng.randrange(known) for _ in range(tokens)],
        f"uniform over the model's {MODEL_VOCAB:,}": lambda i: [rng.randrange(MODEL_VOCAB) for _ in range(tokens)],
    }


def measure(tokenizer: Any, prompt: list[int], ids_of: Callable[[int], list[int]], requests: int, tokens: int) -> float:
    """Seconds to detokenize ``tokens`` steps of ``requests`` requests, one token each per step."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    detokenizers = [
        IncrementalDetokenizer.from_new_request(
            tokenizer, SimpleNamespace(sampling_params=params, prompt_token_ids=prompt, request_id=str(i))
        )
        for i in range(requests)
    ]
    generated = [ids_of(i) for i in range(requests)]
    start = time.perf_counter()
    for step in range(tokens):
        for detokenizer, ids in zip(detokenizers, generated, strict=True):
            detokenizer.update([ids[step]], False)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/, for the throughput bench's prompts
    from throughput import chat_prompts
    from transformers import AutoTokenizer

    from inspect_tl_vllm.aliases import resolve_model

    path = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = chat_prompts(path, 1)[0]
    results = []
    for case, ids_of in streams(tokenizer, args.requests, args.tokens).items():
        seconds = measure(tokenizer, prompt, ids_of, args.requests, args.tokens)
        per_token_us = seconds / (args.requests * args.tokens) * 1e6
        per_step_ms = seconds / args.tokens * 1e3
        results.append({"case": case, "us_per_token": round(per_token_us, 2), "ms_per_step": round(per_step_ms, 2)})
        print(f"{case:48s} {per_token_us:6.2f} us/token  {per_step_ms:6.2f} ms per step of {args.requests}", flush=True)
    if args.out:
        summary = {"requests": args.requests, "tokens": args.tokens, "results": results}
        args.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
