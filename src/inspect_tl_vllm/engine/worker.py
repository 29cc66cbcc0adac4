"""Worker side: attach the hooks to a freshly loaded model and route every step.

``attach`` runs inside the plugin's ``load_model`` wrapper of each worker process.  It reads
the instrumentation settings from ``vllm_config.additional_config["tlvllm"]`` (so the
settings reach every worker, local or remote, with the config itself), builds the hook
runtime, registers the hooks and wraps two methods of that worker's model runner:

- ``_preprocess``: the batch layout is final here and vLLM's own input copies happen here,
  so the routing tables are written in the same place and stream order as vLLM's inputs.
- ``execute_model``: after the step, harvest captures and steering receipts.

``TLWorkerExtension`` adds the RPC methods the front end calls with ``collective_rpc``.
Its method names must not exist on vLLM's Worker (vLLM asserts that), hence the prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from inspect_tl_vllm.engine.config import CONFIG_KEY
from inspect_tl_vllm.instrument.hookpoints import build_sites, layout_for
from inspect_tl_vllm.instrument.routing import BatchEntry, RequestState, StepRouter, plan_request
from inspect_tl_vllm.instrument.runtime import HookRuntime, install_hooks
from inspect_tl_vllm.specs import TAG

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Controller:
    """Per-worker state: hook runtime, vector bank index, live requests and their results."""

    def __init__(self, runner: Any, settings: dict[str, Any]) -> None:
        model = runner.get_model()
        hf_config = runner.model_config.hf_text_config
        architecture = runner.model_config.architectures[0]
        layout = layout_for(architecture)
        num_layers = int(hf_config.num_hidden_layers)
        table = build_sites(layout, num_layers, settings["hook_points"])
        self.sites = sorted({site.index: site for site in table.values()}.values(), key=lambda s: s.index)
        inner = model.model
        device = next(model.parameters()).device
        self.runtime = HookRuntime(
            num_sites=len(self.sites),
            hidden_size=int(hf_config.hidden_size),
            max_tokens=int(runner.max_num_tokens),
            max_stack=int(settings["max_stack"]),
            max_vectors=int(settings["max_vectors"]),
            device=device,
            act_dtype=runner.model_config.dtype,
        )
        self.handles = install_hooks(inner.layers, inner.norm, self.sites, self.runtime)
        self.router = StepRouter(self.runtime)
        self.runner = runner
        self.bank_rows: dict[str, int] = {}
        self.live: dict[str, RequestState | None] = {}  # vLLM request id -> state (None: plain)
        self.results: dict[str, RequestState] = {}  # uid -> state, until fetched
        log.info(
            "tl-vllm: %d hook sites on %s, %.1f MiB of buffers",
            len(self.sites),
            architecture,
            self.runtime.memory_bytes() / 2**20,
        )

    # -- per step -------------------------------------------------------------------------
    def before_forward(self, scheduler_output: Any) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.live.pop(req_id, None)
        batch = self.runner.input_batch
        scheduled = scheduler_output.num_scheduled_tokens
        entries = []
        start = 0
        for i, req_id in enumerate(batch.req_ids):
            count = int(scheduled[req_id])
            state = self._state_for(req_id)
            if state is not None:
                entries.append(BatchEntry(state, start, count, int(batch.num_computed_tokens_cpu[i])))
            start += count
        self.router.begin_step(entries)

    def after_forward(self) -> None:
        self.router.end_step()

    def _state_for(self, req_id: str) -> RequestState | None:
        if req_id in self.live:
            return self.live[req_id]
        request = self.runner.requests[req_id]
        wire = (request.sampling_params.extra_args or {}).get(TAG) if request.sampling_params else None
        state = None
        if wire:
            try:
                state = plan_request(wire, request.num_prompt_tokens, self.bank_rows)
            except (KeyError, ValueError) as err:
                state = RequestState(uid=wire["uid"], prompt_len=request.num_prompt_tokens, steer=[], capture=[])
                state.error = f"instrumentation refused this request: {err}"
            self.results[state.uid] = state
        self.live[req_id] = state
        return state

    # -- RPC ------------------------------------------------------------------------------
    def put_vectors(self, blob: bytes) -> int:
        from safetensors.torch import load

        vectors = load(blob)
        for key, vector in vectors.items():
            if key in self.bank_rows:
                continue
            row = len(self.bank_rows) + 1
            if row > self.runtime.max_vectors:
                raise RuntimeError(
                    f"vector bank full ({self.runtime.max_vectors} vectors); raise max_vectors in InstrumentConfig"
                )
            self.runtime.bank[row].copy_(vector.to(torch.float32))
            self.bank_rows[key] = row
        return len(self.bank_rows)

    def fetch(self, wanted: list[list[Any]]) -> list[dict[str, Any] | None]:
        return [self._pack(uid, int(max_pos)) for uid, max_pos in wanted]

    def _pack(self, uid: str, max_pos: int) -> dict[str, Any] | None:
        from safetensors.torch import save

        state = self.results.pop(uid, None)
        if state is None:
            return None
        dtype = _DTYPES[state.dtype]
        tensors: dict[str, torch.Tensor] = {}
        positions: dict[str, list[int]] = {}
        for item in state.capture:
            if state.reduce == "none":
                kept = sorted(p for p in item.rows if p <= max_pos)
                positions[item.hook] = kept
                if kept:
                    rows = [torch.from_numpy(item.rows[p]) for p in kept]
                    tensors[item.hook] = torch.stack(rows).to(dtype)
                else:
                    tensors[item.hook] = torch.zeros(0, self.runtime.hidden_size, dtype=dtype)
            elif item.count:
                row = item.total / item.count if state.reduce == "mean" else item.best
                tensors[item.hook] = torch.from_numpy(row).to(torch.float32).to(dtype).unsqueeze(0)
        return {
            "uid": uid,
            "receipt": state.receipt(),
            "positions": positions,
            "tensors": save(tensors) if tensors else b"",
        }

    def status(self) -> dict[str, Any]:
        """Counters for checks and tests; the batch-mixing maximum restarts at each call."""
        steered, self.router.max_requests_steered_in_one_step = self.router.max_requests_steered_in_one_step, 0
        return {
            "sites": [site.name for site in self.sites],
            "fired": self.runtime.fired.cpu().tolist(),
            "buffer_bytes": self.runtime.memory_bytes(),
            "vectors": len(self.bank_rows),
            "max_requests_steered_in_one_step": steered,
            "pending_results": len(self.results),
        }


def attach(worker: Any) -> None:
    """Plugin hook after ``Worker.load_model``: instrument if this engine asked for it."""
    settings = _settings(worker)
    if settings is None:
        return
    runner = worker.model_runner
    controller = Controller(runner, settings)
    worker._tlvllm = controller

    preprocess = runner._preprocess
    execute = runner.execute_model

    def _preprocess(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        controller.before_forward(scheduler_output)
        return preprocess(scheduler_output, *args, **kwargs)

    def execute_model(*args: Any, **kwargs: Any) -> Any:
        try:
            return execute(*args, **kwargs)
        finally:
            controller.after_forward()

    runner._preprocess = _preprocess
    runner.execute_model = execute_model


def verify_hooks_fired(worker: Any) -> None:
    """Plugin hook after warm-up: every site must have run inside the (compiled) model."""
    controller: Controller | None = getattr(worker, "_tlvllm", None)
    if controller is None:
        return
    fired = controller.runtime.fired.cpu().tolist()
    silent = [site.name for site, count in zip(controller.sites, fired, strict=True) if count == 0]
    if silent:
        raise RuntimeError(
            f"tl-vllm: hooks installed but never ran during warm-up at {silent[:5]}"
            f"{' ...' if len(silent) > 5 else ''}; the compiled graph does not contain them "
            "(a stale torch.compile cache? set VLLM_DISABLE_COMPILE_CACHE=1)"
        )


def _settings(worker: Any) -> dict[str, Any] | None:
    extra = getattr(worker.vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(CONFIG_KEY), dict):
        return extra[CONFIG_KEY]
    return None


class TLWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); ``self`` is the worker."""

    def _tl_controller(self) -> Controller:
        controller = getattr(self, "_tlvllm", None)
        if controller is None:
            raise RuntimeError(
                "tl-vllm: this worker is not instrumented; the vLLM plugin 'inspect_tl_vllm' did not load "
                "(is the package installed, and is it excluded by VLLM_PLUGINS?)"
            )
        return controller

    def tlvllm_put_vectors(self, blob: bytes) -> int:
        return self._tl_controller().put_vectors(blob)

    def tlvllm_fetch(self, wanted: list[list[Any]]) -> list[dict[str, Any] | None]:
        return self._tl_controller().fetch(wanted)

    def tlvllm_status(self) -> dict[str, Any]:
        return self._tl_controller().status()
