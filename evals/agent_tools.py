"""An agent eval that keeps every model call's activations: a tool loop, captured turn by turn.

    inspect eval evals/agent_tools.py --model tl-vllm/smollm2 \
        -M chat_template=evals/templates/chatml_tools.jinja -M capture=blocks.20.hook_resid_post

The model adds numbers with the ``add`` tool in a ``generate(tool_calls="loop")`` agent; the sample
ends at its message limit after ``turns`` calls.  SmolLM2-135M does not call tools on its own, so
``response_schema`` (vLLM's structured outputs) holds each reply to one call of ``add``; its own chat
template renders no tools, so the command gives a ChatML template that does.  With capture on, each
of the ``turns`` model calls of a sample stores its own record (``r.call``, ``r.input_messages``).
"""

from __future__ import annotations

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig, ResponseSchema
from inspect_ai.scorer import Score, Target, mean, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import tool
from inspect_ai.util import JSONSchema

CALL_ADD = JSONSchema(
    type="object",
    properties={
        "name": JSONSchema(type="string", enum=["add"]),
        "arguments": JSONSchema(
            type="object",
            properties={"x": JSONSchema(type="integer"), "y": JSONSchema(type="integer")},
            required=["x", "y"],
            additionalProperties=False,
        ),
    },
    required=["name", "arguments"],
    additionalProperties=False,
)
QUESTIONS = (
    "Add 2 and 3, then add 4 to the result.",
    "What is 17 plus 25? Then add 8.",
)


@tool
def add():
    async def execute(x: int, y: int) -> int:
        """Add two whole numbers.

        Args:
            x: The first number.
            y: The second number.
        """
        return x + y

    return execute


@scorer(metrics=[mean()])
def tool_calls_made():
    """How many of the sample's tool calls ran without an error."""

    async def score(state: TaskState, target: Target) -> Score:
        results = [m for m in state.messages if m.role == "tool"]
        return Score(value=sum(getattr(m, "error", None) is None for m in results))

    return score


@task
def agent_tools(turns: int = 3) -> Task:
    return Task(
        dataset=[Sample(id=f"q{i}", input=question) for i, question in enumerate(QUESTIONS, 1)],
        solver=[use_tools(add()), generate(tool_calls="loop")],
        scorer=tool_calls_made(),
        message_limit=1 + 2 * turns,  # the question, then a call and its result per turn
        config=GenerateConfig(
            temperature=0.0, max_tokens=48, response_schema=ResponseSchema(name="add_call", json_schema=CALL_ADD)
        ),
    )
