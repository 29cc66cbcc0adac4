"""vLLM general plugin (entry point ``vllm.general_plugins``).

vLLM loads it in every process that runs vLLM code, including plain engines and servers
that never asked for instrumentation.  It only wraps two worker methods; the wrappers act
when the engine's ``additional_config`` carries the ``tlvllm`` key and do nothing otherwise.

- ``Worker.load_model``: install the hooks right after the weights load, before the memory
  profile run that triggers torch.compile (hooks registered later never run when compiled).
- ``Worker.compile_or_warm_up_model``: after warm-up, check that every hook fired.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_MARK = "_tlvllm_wrapped"


def register() -> None:
    from vllm.v1.worker import gpu_worker  # the CPU worker subclasses this Worker

    from inspect_tl_vllm.engine import worker as tl_worker

    _wrap(gpu_worker.Worker, "load_model", after=tl_worker.attach)
    _wrap(gpu_worker.Worker, "compile_or_warm_up_model", after=tl_worker.verify_hooks_fired)


def _wrap(cls: type, name: str, after: Callable[[Any], None]) -> None:
    original = getattr(cls, name)
    if getattr(original, _MARK, False):
        return  # plugins may load several times in one process

    @functools.wraps(original)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        after(self)
        return result

    setattr(wrapper, _MARK, True)
    setattr(cls, name, wrapper)
