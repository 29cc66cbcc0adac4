"""Every model call of a sample keeps its own capture: a three-turn dialogue stores three records,
each with its own rows, joinable to its model event in the log."""

from __future__ import annotations

import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageUser, GenerateConfig
from inspect_ai.solver import Generate, TaskState, solver

from conftest import PROVIDER_ARGS, environment

pytestmark = pytest.mark.engine
HOOK = "blocks.1.hook_resid_post"


@solver
def three_turns():
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        for follow_up in ("Tell me more.", "And then?"):
            state = await generate(state)
            state.messages.append(ChatMessageUser(content=follow_up))
        return await generate(state)

    return solve


def test_each_turn_of_a_dialogue_keeps_its_capture(vllm_ready, tiny_llama_dir, tmp_path):
    from inspect_tl_vllm.store import activations
    from inspect_tl_vllm.store.sample_store import read_index

    pytest.importorskip("pyarrow")
    args = {**PROVIDER_ARGS, "capture": HOOK, "capture_reduce": "none"}
    task = Task(
        dataset=[Sample(id="a", input="Hello there"), Sample(id="b", input="Name a colour.")],
        solver=three_turns(),
        config=GenerateConfig(max_tokens=4, temperature=0.0),
    )
    with environment(TORCH_COMPILE_DISABLE="1"):
        log = eval(task, model=f"tl-vllm/{tiny_llama_dir}", model_args=args, log_dir=str(tmp_path), display="none")[0]
    assert log.status == "success", log.error
    records = activations.load(log.location)
    assert [(r.sample_id, r.call, r.input_messages) for r in records] == [
        (sample, call, 1 + 2 * call) for sample in ("a", "b") for call in range(3)
    ]
    for sample in log.samples:
        events = [e for e in sample.events if e.event == "model"]
        mine = [r for r in records if r.sample_id == sample.id]
        assert len(events) == len(mine) == 3
        for event, record in zip(events, mine, strict=True):
            assert len(event.input) == record.input_messages
            prompt = event.output.usage.input_tokens
            rows = record.activations[HOOK]
            assert rows.shape[0] == prompt + event.output.usage.output_tokens - 1  # every input row of the call
            assert record.positions[HOOK] == list(range(rows.shape[0]))
            stored = event.output.metadata["tlvllm"]["activations"]
            assert stored["file"] == record.index["file"] and stored["call"] == record.call
        assert (
            mine[0].activations[HOOK].shape[0] < mine[1].activations[HOOK].shape[0] < mine[2].activations[HOOK].shape[0]
        )
        assert activations.read(log.location, sample.id).call == 2  # the sample's output: its last call
    assert (
        len(
            {
                entry["file"]
                for entry in read_index(activations.activations_dir_for(log.location, log.eval.eval_id, None))
            }
        )
        == 6
    )
    table = activations.arrow_reader(log.location).read_all().to_pydict()
    assert sorted(set(zip(table["sample_id"], table["call"], strict=True))) == [(s, c) for s in "ab" for c in range(3)]


def test_a_one_token_answer_gives_an_empty_capture_of_generated_tokens(tiny_engine):
    """A capture of generated tokens when the answer is one token (it stopped at once): the rows
    it asks for never existed (the last token is never an input), so the capture is empty and says
    why; the answer is not failed.  (Listed positions past the end still fail: test_hostile.py.)"""
    first = tiny_engine.generate("Once upon a time", max_tokens=1)[0]
    stop = {"stop_token_ids": [first.token_ids[0]]}  # stop on the greedy first token: a one-token answer
    for reduce, shape in (("none", (0, 64)), ("mean", None)):
        capture = {"hooks": [HOOK], "positions": "generated", "reduce": reduce}
        out = tiny_engine.generate("Once upon a time", max_tokens=8, capture=capture, **stop)[0]
        assert len(out.token_ids) == 1
        assert out.receipt["capture_unreached"] is True and out.receipt["captures"] == {HOOK: 0}
        assert (tuple(out.activations[HOOK].shape) if HOOK in out.activations else None) == shape
    two = tiny_engine.generate("Once upon a time", max_tokens=2, capture={"hooks": [HOOK], "positions": "generated"})
    assert two[0].receipt["capture_unreached"] is False and two[0].receipt["captures"] == {HOOK: 1}


def test_scopes_know_whether_an_answer_reached_them():
    from inspect_tl_vllm.instrument.request_state import Scope

    assert not Scope.resolve("generated", 5).reaches(4) and Scope.resolve("generated", 5).reaches(5)
    assert Scope.resolve([7, 9], 5).reaches(7) and not Scope.resolve([7, 9], 5).reaches(6)
    assert Scope.resolve([-1], 5).reaches(4) and Scope.resolve("prompt", 5).reaches(0)
