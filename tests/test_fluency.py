"""The fluency scorer on the real CPU engine: it scores the answer under the unsteered model,
equal to transformers' log-likelihood of the same tokens, whatever steering the sample asked for
and whether the answer ended by itself or was cut at max_tokens."""

from __future__ import annotations

import pytest
import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageAssistant, ModelOutput
from inspect_ai.solver import Generate, TaskState, solver

from conftest import provider_model_args
from hf_reference import load_hf
from inspect_tl_vllm.research.fluency import fluency

pytestmark = pytest.mark.engine
ANSWER = "The river runs to the sea."


@solver
def fixed_answer():
    """Answer ``ANSWER`` without generating, as if the model had said it and stopped (or, for a
    sample whose id says so, had been cut at max_tokens)."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        stop_reason = "max_tokens" if state.sample_id == "truncated" else "stop"
        state.output = ModelOutput.from_content(model=str(state.model), content=ANSWER, stop_reason=stop_reason)
        state.messages.append(ChatMessageAssistant(content=ANSWER))
        return state

    return solve


def test_fluency_is_the_unsteered_log_likelihood_of_the_answer(vllm_ready, tiny_llama_dir, tmp_path):
    torch.manual_seed(0)
    steering = {"interventions": [{"hook": "blocks.1.hook_resid_post", "vector": torch.randn(64).tolist(), "coef": 8}]}
    samples = [
        Sample(id="plain", input="What is a river?"),
        Sample(id="steered", input="What is a river?", metadata={"tlvllm": steering}),
        Sample(id="truncated", input="What is a river?"),
    ]
    task = Task(dataset=samples, solver=fixed_answer(), scorer=fluency())
    with provider_model_args() as args:
        log = eval(task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path), display="none")[0]
    assert log.status == "success", log.error
    scores = {s.id: s.scores["fluency"] for s in log.samples}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is a river?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer = tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([list(prompt) + answer + [tokenizer.eos_token_id]])
    with torch.no_grad():
        logits = load_hf(tiny_llama_dir)(ids).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None])[:, 0][len(prompt) - 1 :]
    expected, end = float(logprobs[:-1].mean()), float(logprobs[-1])

    for sample_id in ("plain", "steered", "truncated"):
        assert scores[sample_id].metadata["tokens"] == len(answer)
        assert scores[sample_id].value == pytest.approx(expected, abs=1e-4), sample_id
    assert scores["plain"].metadata["end_logprob"] == pytest.approx(end, abs=1e-4)
    assert scores["truncated"].metadata["truncated"] and "end_logprob" not in scores["truncated"].metadata
