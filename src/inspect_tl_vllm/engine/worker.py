"""Worker side: attach the hooks to a freshly loaded model and route every step.

``attach`` runs inside the plugin's ``load_model`` wrapper of each worker process.  It reads
the instrumentation settings from ``vllm_config.additional_config["tlvllm"]`` (so the
settings reach every worker, local or remote, with the config itself), builds the hook
runtime, registers the hooks and wraps two methods of that worker's model runner:

- ``_preprocess``: the batch layout is final here and vLLM has just computed each token row's
  batch index and position on the device (``req_indices``, ``positions``), from which the
  steering tables are expanded, in the same stream order as vLLM's inputs.
- ``execute_model``: before the step, let go of finished requests; after it, harvest
  captures and steering receipts.

Results are packed in ``packing.py``; the counters ``tlvllm_status`` reports beyond the
routing's own are kept in ``telemetry.py``.

``TLWorkerExtension`` adds the RPC methods the front end calls with ``collective_rpc``.
Its method names must not exist on vLLM's Worker (vLLM asserts that), hence the prefix.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from inspect_tl_vllm.engine.handoff import shared_folder
from inspect_tl_vllm.engine.packing import ResultPacker, early_writes
from inspect_tl_vllm.engine.runners import NewRequest, StepLayout, V1Runner, V2Runner, new_requests, runner_for
from inspect_tl_vllm.engine.sae_encoders import SaeEncoders
from inspect_tl_vllm.engine.telemetry import GC_TIMER, HostTimer, pinned_host_stats
from inspect_tl_vllm.instrument.hookpoints import ModelShape, Site, build_sites, layout_for
from inspect_tl_vllm.instrument.request_state import RequestState, plan_request
from inspect_tl_vllm.instrument.routing import StepRouter
from inspect_tl_vllm.instrument.runtime import HookRuntime, install_hooks
from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.wire import RequestWire, WorkerStatus

log = logging.getLogger(__name__)


class Controller:
    """Per-worker state: hook runtime, vector bank index, live requests and their results.

    Under pipeline parallelism a worker hooks only the layers it holds (plus the final norm
    on the last stage); under tensor parallelism every rank steers (each holds the same
    residual stream after the all-reduce) and only rank 0 records captures and receipts.
    """

    def __init__(self, adapter: V1Runner | V2Runner, settings: dict[str, Any]) -> None:
        runner = adapter.runner
        model = runner.get_model()
        hf_config = runner.model_config.hf_text_config
        architecture = runner.model_config.architectures[0]
        layout = layout_for(architecture)
        table = build_sites(layout, ModelShape.of(hf_config), settings["hook_points"], architecture)
        inner = model.get_submodule(layout.model)
        layers, final_norm = getattr(inner, layout.layers), getattr(inner, layout.final_norm)
        every_site = sorted({site.index: site for site in table.values()}.values(), key=lambda s: s.index)
        self.sites = [site for site in every_site if _holds(inner, layers, final_norm, site)]
        self.owned = {site.index for site in self.sites}
        self.every_site = {site.index for site in every_site}
        device = next(model.parameters()).device
        self.runtime = HookRuntime(
            site_widths={site.index: site.width for site in self.sites},
            bank_width=max(site.width for site in every_site),
            max_tokens=int(runner.max_num_tokens),
            max_stack=int(settings["max_stack"]),
            max_vectors=int(settings["max_vectors"]),
            device=device,
            act_dtype=runner.model_config.dtype,
        )
        self.handles = install_hooks(layers, final_norm, self.sites, self.runtime, layout)
        self.attention = attention_settings(layers, self.sites, layout.attention)
        self.packer = ResultPacker({site.index: site.width for site in self.sites})
        self.encoders = SaeEncoders(self.runtime.device, self.runtime.act_dtype, int(hf_config.hidden_size))
        self.router = StepRouter(
            self.runtime,
            collect=_tensor_parallel_rank() == 0,
            on_capture_complete=self.packer.write_early if early_writes() else None,
        )
        self.adapter = adapter
        self.bank_rows: dict[str, int] = {}  # vector hash -> row of the bank
        # Unused rows, lowest last (pop() gives it); row 0 is the zero vector and never given out.
        self.free_rows: list[int] = list(range(int(settings["max_vectors"]), 0, -1))
        self.live: dict[str, RequestState] = {}  # vLLM request id -> state, instrumented requests only
        self.results: dict[str, RequestState] = {}  # uid -> state, until fetched
        self.host_time = HostTimer("route", "harvest")
        GC_TIMER.install()
        self.steps = 0
        self.resumed = 0  # instrumented requests resumed after preemption (their rows are recomputed)
        self._last_batch: tuple[list[RequestState], list[str], np.ndarray] | None = None
        log.info(
            "tl-vllm: %d of %d hook sites on this worker (%s, model runner %s), %.1f MiB of buffers",
            len(self.sites),
            len(every_site),
            architecture,
            adapter.name,
            self.runtime.memory_bytes() / 2**20,
        )

    # -- per step -------------------------------------------------------------------------
    def before_forward(self, scheduler_output: Any, layout: StepLayout) -> None:
        """Route the step: only instrumented requests are looked at, so plain traffic costs nothing."""
        started = self.host_time.start()
        self.resumed += self.adapter.resumed(scheduler_output, self.live)
        for new in new_requests(scheduler_output):
            self._register(new)
        self.router.begin_step(self._batch_index(layout), layout.query_start, layout.computed, layout.rows)
        self.steps += 1
        self.host_time.add("route", started)

    def _batch_index(self, layout: StepLayout) -> np.ndarray:
        """Per live request (``router.states``), its index in vLLM's batch (-1: not scheduled).

        Looked up again only when the batch's membership or order, or the live requests, changed."""
        states = self.router.states
        if self._last_batch is not None and self._last_batch[0] is states and self._last_batch[1] == layout.req_ids:
            return self._last_batch[2]
        batch_index = batch_indices(states, layout.index_of)
        self._last_batch = (states, list(layout.req_ids), batch_index)
        return batch_index

    def retire_finished(self, scheduler_output: Any) -> None:
        """Let go of requests vLLM has finished.

        Called on every ``execute_model``: the step that reports the last requests of a
        batch as finished schedules no tokens, and vLLM returns before ``_preprocess``
        for it, so routing never sees those ids (the live set then grew without bound).
        """
        for req_id in scheduler_output.finished_req_ids:
            state = self.live.pop(req_id, None)
            if state is not None:
                self.router.retire(state)

    def after_forward(self) -> None:
        started = self.host_time.start()
        self.router.end_step()
        self.host_time.add("harvest", started)

    def _register(self, new: NewRequest) -> None:
        if new.req_id in self.live:  # a preempted request sent again: keep what it has captured so far
            return
        raw = (new.extra_args or {}).get(TAG)
        if not raw:
            return
        try:
            state = plan_request(
                RequestWire.decode(raw),
                new.prompt_len,
                self.bank_rows,
                self.every_site,
                self.runtime.max_stack,
                self.owned,
            )
            if state.features is not None and state.capture and self.router.collect:
                state.encoder = self.encoders.encoder(state.features.sae, state.features.digest)
        except Exception as err:  # this request fails, alone: the step loop and every other request go on
            uid = str(raw.get("uid", "")) if isinstance(raw, dict) else ""
            state = RequestState(uid=uid, prompt_len=new.prompt_len, steer=[], capture=[])
            state.error = f"instrumentation refused this request: {type(err).__name__}: {err}"
        state.req_id = new.req_id
        self.live[new.req_id] = state
        self.router.admit(state)
        if self.router.collect:
            self.results[state.uid] = state

    # -- RPC ------------------------------------------------------------------------------
    def put_vectors(
        self, keys: list[str], widths: list[int], data: bytes, evict: list[str] | tuple[str, ...] = ()
    ) -> int:
        """Drop the ``evict``ed vectors (no live request uses them: the front end counts users),
        then write the new ones (``keys``, each ``widths`` float32 entries of ``data`` in turn)
        into free rows with one copy; returns how many vectors the bank holds."""
        for key in evict:
            row = self.bank_rows.pop(key, None)
            if row is not None:
                self.free_rows.append(row)
        entries = torch.frombuffer(bytearray(data), dtype=torch.float32)
        starts = np.cumsum([0, *widths])
        if starts[-1] != entries.numel():
            raise RuntimeError(f"vector upload: {entries.numel()} entries for widths summing to {starts[-1]}")
        fresh = [(k, key) for k, key in enumerate(keys) if key not in self.bank_rows]
        if not fresh:
            return len(self.bank_rows)
        if len(fresh) > len(self.free_rows):
            raise RuntimeError(
                f"vector bank full: {len(self.bank_rows)} of {self.runtime.max_vectors} rows taken, "
                f"{len(fresh)} more asked for; raise max_vectors in InstrumentConfig"
            )
        rows = [self.free_rows.pop() for _ in fresh]
        bank = self.runtime.bank
        width = bank.shape[1]
        if len(fresh) == len(keys) and all(w == width for w in widths):
            stacked = entries.view(len(keys), width)
        else:  # some already held, or narrower sites' vectors: zero-padded rows
            stacked = torch.zeros(len(fresh), width, dtype=torch.float32)
            for i, (k, _) in enumerate(fresh):
                stacked[i, : widths[k]] = entries[starts[k] : starts[k + 1]]
        bank[torch.tensor(rows, device=bank.device)] = stacked.to(bank.device)  # one copy, not one per vector
        self.bank_rows.update(zip((key for _, key in fresh), rows, strict=True))
        return len(self.bank_rows)

    def fetch(self, wanted: list[list[Any]], ticket: list[str] | None = None) -> list[Any] | None:
        """Encoded ``FetchedResult`` per wanted uid (None for a uid this worker has no record
        of); None from a rank that records nothing (TP rank > 0).

        ``ticket`` names the front end's hand-off folder (see ``handoff.py``)."""
        if not self.router.collect:
            return None
        self.router.drain()
        folder = shared_folder(ticket)
        states = [(self.results.pop(uid, None), int(max_pos)) for uid, max_pos in wanted]
        self.router.snapshot([state for state, _ in states if state is not None])
        return [
            None if state is None else self.packer.pack(state, max_pos, folder).encode() for state, max_pos in states
        ]

    def status(self) -> Any:
        """Encoded ``WorkerStatus``, for checks and tests; the batch-mixing maximum restarts at each call."""
        self.router.drain()
        steered, self.router.max_requests_steered_in_one_step = self.router.max_requests_steered_in_one_step, 0
        fired = self.runtime.fired()
        return WorkerStatus(
            runner=self.adapter.name,
            sites=[site.name for site in self.sites],
            fired=[fired[site.index] for site in self.sites],
            buffer_bytes=self.runtime.memory_bytes(),
            vectors=len(self.bank_rows),
            max_requests_steered_in_one_step=steered,
            pending_results=len(self.results),
            live_requests=len(self.live),
            collects=self.router.collect,
            steps=self.steps,
            step_kinds=dict(self.router.step_kinds),
            resumed_after_preemption=self.resumed,
            written_early=self.packer.written_early,
            host_seconds=self.host_time.report(),
            pinned_host=pinned_host_stats(),
            sae_held={"encoders": len(self.encoders), **self.router.feature_holdings()},
            attention=self.attention,
        ).encode()


def batch_indices(states: list[RequestState], index_of: dict[str, int]) -> np.ndarray:
    """Per state, its index in vLLM's batch (``index_of``, vLLM's ``req_id_to_index``; -1 for a
    request not scheduled); ``bench/router_cost.py`` times it with the router."""
    return np.fromiter((index_of.get(s.req_id, -1) for s in states), dtype=np.int64, count=len(states))


def _holds(inner: Any, layers: Any, final_norm: Any, site: Site) -> bool:
    """Whether this pipeline stage runs the module a site hooks (all of them without PP)."""
    if site.layer is None:
        return not _is_missing(final_norm)
    start = getattr(inner, "start_layer", 0)
    end = getattr(inner, "end_layer", len(layers))
    return start <= site.layer < end and not _is_missing(layers[site.layer])


def attention_settings(layers: Any, sites: list[Site], attention: str) -> dict[str, list[float]]:
    """Per layer whose rotated query and key this worker hooks: the attention's scale, sliding window
    and logit soft-cap (0 for none), as its vLLM attention layer holds them, so the front end can
    compute attention patterns exactly as the model attends (``engine/attention_patterns.py``)."""
    hooked: dict[int, set[str]] = {}
    for site in sites:
        if site.layer is not None and site.name.endswith((".hook_rot_q", ".hook_rot_k")):
            hooked.setdefault(site.layer, set()).add(site.name.rsplit(".", 1)[1])
    settings = {}
    for layer, names in hooked.items():
        if len(names) == 2:
            attn = layers[layer].get_submodule(attention)
            scale = float(getattr(attn.impl, "scale", 0.0) or 0.0)
            window = float(getattr(attn, "sliding_window", None) or 0)
            soft_cap = float(getattr(attn.impl, "logits_soft_cap", None) or 0.0)
            settings[str(layer)] = [scale, window, soft_cap]
    return settings


def _is_missing(module: Any) -> bool:
    return type(module).__name__ == "PPMissingLayer"


def _tensor_parallel_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def attach(worker: Any) -> None:
    """Plugin hook after ``Worker.load_model``: instrument if this engine asked for it."""
    settings = _settings(worker)
    if settings is None:
        return
    runner = worker.model_runner
    adapter = runner_for(runner)
    controller = Controller(adapter, settings)
    worker._tlvllm = controller
    # vLLM sizes the KV cache as the memory budget minus the weights (measured while the
    # model loads, before these buffers exist) and the profile run's peak *increase* (taken
    # after they exist), so the buffers would be counted nowhere and the engine would exceed
    # gpu_memory_utilization by their size.  Count them with the weights.
    if hasattr(runner, "model_memory_usage"):
        runner.model_memory_usage += controller.runtime.memory_bytes()
    adapter.install(controller.retire_finished, controller.before_forward, controller.after_forward)


def verify_hooks_fired(worker: Any) -> None:
    """Plugin hook after warm-up: every site must have run inside the (compiled) model."""
    controller: Controller | None = getattr(worker, "_tlvllm", None)
    if controller is None:
        return
    fired = controller.runtime.fired()
    silent = [site.name for site in controller.sites if fired[site.index] == 0]
    if silent:
        raise RuntimeError(
            f"tl-vllm: hooks installed but never ran during warm-up at {silent[:5]}"
            f"{' ...' if len(silent) > 5 else ''}; the compiled graph does not contain them "
            "(a stale torch.compile cache? set VLLM_DISABLE_COMPILE_CACHE=1)"
        )


def _settings(worker: Any) -> dict[str, Any] | None:
    extra = getattr(worker.vllm_config, "additional_config", None)
    if isinstance(extra, dict) and isinstance(extra.get(TAG), dict):
        return extra[TAG]
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

    def tlvllm_put_vectors(
        self, keys: list[str], widths: list[int], data: bytes, evict: list[str] | tuple[str, ...] = ()
    ) -> int:
        return self._tl_controller().put_vectors(keys, widths, data, evict)

    def tlvllm_fetch(self, wanted: list[list[Any]], ticket: list[str] | None = None) -> list[Any] | None:
        return self._tl_controller().fetch(wanted, ticket)

    def tlvllm_release(self, wanted: list[list[Any]], ticket: list[str] | None = None) -> list[Any] | None:
        """Let go of aborted requests: what a fetch would answer (files written early included, for
        the front end to delete), which the front end drops."""
        return self._tl_controller().fetch(wanted, ticket)

    def tlvllm_status(self) -> Any:
        return self._tl_controller().status()
