"""``inspect`` with a start-up timeline of the ``tl-vllm`` provider, for ``e2e.py``.

    python bench/inspect_timeline.py TIMELINE.json eval task.py --model tl-vllm/...

Runs Inspect's command line unchanged, after wrapping a few provider functions so that the
seconds since this process started are recorded when Inspect is imported, when the
provider's module is (it brings torch), when the model's constructor starts, when vLLM's
engine classes are imported, when the engine starts and is ready, when the constructor
returns (with ``-M boot=eager`` the engine boots inside it; with ``-M boot=background`` it
starts there), and when the first model call starts and when it is answered.  The wrappers
only take timestamps; the marks are written to TIMELINE.json when the command exits.
"""

from __future__ import annotations

import atexit
import functools
import json
import runpy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STARTED = time.time()
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    MARKS.setdefault(name, round(time.time() - STARTED, 2))


def timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mark(f"{name} start")
        result = function(*args, **kwargs)
        mark(f"{name} end")
        return result

    return wrapper


def instrument() -> None:
    import inspect_ai  # noqa: F401

    mark("inspect_ai imported")
    from inspect_tl_vllm.engine import construct
    from inspect_tl_vllm.provider import engine_pool, model_api

    mark("provider imported")
    model_api.TLVLLMAPI.__init__ = timed("model constructor", model_api.TLVLLMAPI.__init__)
    construct.model_config = timed("hf config", construct.model_config)
    build = construct.construct_instrumented_llm

    @functools.wraps(build)
    def construct_with_marks(*args: Any, **kwargs: Any) -> Any:
        mark("construct_instrumented_llm start")
        # imported here rather than a moment later inside ``build``, to time the import apart
        from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: F401
        from vllm.v1.engine.async_llm import AsyncLLM

        mark("vllm engine classes imported")
        AsyncLLM.from_engine_args = classmethod(timed("AsyncLLM.from_engine_args", AsyncLLM.from_engine_args.__func__))
        result = build(*args, **kwargs)
        mark("construct_instrumented_llm end")
        return result

    engine_pool.construct_instrumented_llm = construct_with_marks
    generate = model_api.TLVLLMAPI.generate

    @functools.wraps(generate)
    async def first_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        mark("first model call")
        result = await generate(self, *args, **kwargs)
        mark("first model call answered")
        return result

    model_api.TLVLLMAPI.generate = first_call


def main() -> None:
    out = Path(sys.argv[1])

    @atexit.register  # registered first, so it runs last: after the provider shut its engine down
    def write() -> None:
        mark("exiting, engine shut down")
        out.write_text(json.dumps(MARKS, indent=1))

    instrument()
    sys.argv = ["inspect", *sys.argv[2:]]
    runpy.run_module("inspect_ai", run_name="__main__")  # `python -m inspect_ai`, in this process


if __name__ == "__main__":
    main()
