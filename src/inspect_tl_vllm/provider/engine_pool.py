"""One instrumented ``AsyncLLM`` per process and (model, engine settings), shared by every
``get_model`` instance and model role that names them.

vLLM's async client is bound to the event loop it first runs on, while Inspect runs each
``eval()`` in a loop of its own.  So each engine lives on a private event loop in a daemon
thread; Inspect's coroutines submit work there and await the result.  The engine therefore
outlives any one ``eval()`` call, and is shut down once at interpreter exit (or earlier,
by ``shutdown_engines``).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

from inspect_tl_vllm.engine.construct import (
    InstrumentedLLM,
    construct_instrumented_llm,
    import_engine_classes,
    load_adapter,
)
from inspect_tl_vllm.engine.exits import oom_kills
from inspect_tl_vllm.engine.frontend import adopt_worker_status, merge_status
from inspect_tl_vllm.specs import InstrumentConfig

T = TypeVar("T")
logger = logging.getLogger(__name__)


class EngineThread:
    """An instrumented AsyncLLM on its own event loop thread."""

    def __init__(
        self, model: str, instrument: InstrumentConfig, engine_kwargs: dict[str, Any], lora: str | None = None
    ) -> None:
        # Inspect may construct model instances it never calls: start nothing until used.
        self.loop: asyncio.AbstractEventLoop | None = None
        self._start_lock = threading.Lock()
        self.upload_lock: asyncio.Lock | None = None
        self._model = model
        self._instrument = instrument
        self._kwargs = engine_kwargs
        self._lora = lora
        self._instrumented: InstrumentedLLM | None = None
        self._background: concurrent.futures.Future[None] | None = None  # a boot started by boot_in_background
        self._boot_lock = asyncio.Lock()  # concurrent first requests must boot one engine, not one each
        self._tasks: set[asyncio.Task] = set()  # background work on the engine loop, kept referenced
        self.boots = 0
        self.boot_seconds = 0.0  # of the last boot; samples' times exclude it
        self.oom_kills_at_boot: int | None = None  # the kernel's count then (engine/exits.py)

    @property
    def booted(self) -> bool:
        return self._instrumented is not None

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._start_lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                name = f"tl-vllm:{self._model}"
                threading.Thread(target=self.loop.run_forever, name=name, daemon=True).start()
            return self.loop

    async def instrumented(self) -> InstrumentedLLM:
        """The engine, booted on first use (on the engine thread, off Inspect's loop).  A boot
        started in the background is awaited; if it failed, the request that finds it raises
        its error, and a later request boots afresh (as after a failed boot at first use)."""
        background, self._background = self._background, None
        if background is not None:
            await asyncio.wrap_future(background)
        if self._instrumented is None:
            await self.run(self._boot)
        assert self._instrumented is not None
        return self._instrumented

    async def _boot(self) -> None:
        # Runs on the engine loop; the boot awaits the workers, so other callers wait on the lock
        # and then find the engine booted.
        async with self._boot_lock:
            if self._instrumented is not None:
                return
            self.boots += 1
            self.oom_kills_at_boot = oom_kills()
            started = time.perf_counter()
            instrumented = construct_instrumented_llm(
                self._model, instrument=self._instrument, async_engine=True, lora=self._lora, **self._kwargs
            )
            try:
                adopt_worker_status(
                    instrumented.instrumentation,
                    merge_status(await instrumented.llm.collective_rpc("tlvllm_status")),
                )
                await load_adapter(instrumented)
            except Exception:
                instrumented.llm.shutdown()
                raise
            self._instrumented = instrumented
            self.upload_lock = asyncio.Lock()
            self.boot_seconds = time.perf_counter() - started
            logger.info(f"tl-vllm: engine for {self._model} booted in {self.boot_seconds:.1f} s")

    def boot_now(self) -> None:
        """Boot from synchronous code and wait (``-M boot=eager``: errors before the eval starts)."""
        asyncio.run_coroutine_threadsafe(self._boot(), self._start()).result()

    def boot_in_background(self) -> None:
        """Start booting and return at once (``-M boot=background``): vLLM's engine process loads
        and compiles the model while Inspect sets up the eval and starts its samples, so the first
        request waits only for what is left of the boot."""
        if self._instrumented is None and self._background is None:
            import_engine_classes()
            self._background = asyncio.run_coroutine_threadsafe(self._boot(), self._start())

    async def run(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``make()`` on the engine loop and await its result from the caller's loop."""
        future = asyncio.run_coroutine_threadsafe(make(), self._start())
        return await asyncio.wrap_future(future)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` on the engine loop without waiting for it (call from that loop)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def discard(self, instrumented: InstrumentedLLM) -> None:
        """Drop a dead engine so the next request boots a fresh one (once, however many
        in-flight requests report the death)."""
        if self._instrumented is instrumented:
            self._instrumented = None
            with contextlib.suppress(Exception):
                instrumented.llm.shutdown()

    def close(self) -> None:
        if self.loop is None:
            return
        if self._instrumented is not None:
            engine = self._instrumented.llm
            self._instrumented = None
            done = asyncio.run_coroutine_threadsafe(_shutdown(engine), self.loop)
            with contextlib.suppress(Exception):  # best effort at exit
                done.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)


async def _shutdown(engine: Any) -> None:
    engine.shutdown()


_ENGINES: dict[str, EngineThread] = {}
_LOCK = threading.Lock()


def shared_engine(key: str, factory: Callable[[], EngineThread]) -> EngineThread:
    with _LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = factory()
        return _ENGINES[key]


def engines() -> dict[str, EngineThread]:
    """The shared engines by key, booted or not: a copy, for looking one up (tests, status checks)."""
    with _LOCK:
        return dict(_ENGINES)


@atexit.register
def shutdown_engines(keys: Iterable[str] | None = None) -> None:
    """Shut down the shared engines under ``keys`` (all of them when None) and forget them.

    An engine otherwise lives until the interpreter exits, when this runs for all of them.
    Tests and long-lived processes that want an engine's memory and processes released now
    call it.  The next model made with those settings boots a new engine; a model instance
    made before (Inspect memoises ``get_model``) keeps the closed one and must not be used.
    """
    with _LOCK:
        chosen = list(_ENGINES) if keys is None else [key for key in keys if key in _ENGINES]
        closing = [_ENGINES.pop(key) for key in chosen]
    for engine in closing:
        engine.close()
