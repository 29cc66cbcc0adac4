"""``-M`` model args of ``tl-vllm``: engine settings, instrumentation, run-wide steering/capture.

Run-wide steering: ``-M steer=spec.yaml`` (a file holding a RequestSpec: ``interventions``
and optionally ``capture``) or inline JSON (``-M steer='{"interventions": [...]}'``).
Run-wide capture: ``-M capture=blocks.6.hook_resid_post,ln_final.hook_normalized`` with
``-M capture_reduce=mean|last|max_norm|none`` and ``-M capture_positions=all|prompt|generated``;
or an SAE's features: ``-M capture_sae=DIR -M capture_top_k=32`` (``capture_reduce`` mean|max|last|none).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inspect_tl_vllm.engine.adapters import Adapter, check_lora_args, read_adapter
from inspect_tl_vllm.engine.construct import check_engine_args
from inspect_tl_vllm.spec_files import load_spec_file, parse_json
from inspect_tl_vllm.specs import InstrumentConfig, RequestSpec, SpecError, parse_request_spec

ENGINE_ARGS = (
    "dtype",
    "max_model_len",
    "gpu_memory_utilization",
    "max_num_batched_tokens",
    "max_num_seqs",
    "enforce_eager",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "enable_prefix_caching",
    "seed",
    "kv_cache_memory_bytes",
)
INSTRUMENT_ARGS = ("hook_points", "max_stack", "max_vectors", "capture_bytes_per_request")
PROVIDER_ARGS = (
    "steer",
    "capture",
    "capture_reduce",
    "capture_positions",
    "capture_dtype",
    "capture_sae",
    "capture_top_k",
    "activations_dir",
    "activations_shard_mb",
    "chat_template",
    "engine_args",
    "boot",
    "lora",
)

BOOT_MODES = ("lazy", "background", "eager")
"""When the engine boots: at the first request, starting when the model is built (the first
request waits for it), or while the model is built (its errors before the eval starts)."""


@dataclass
class ProviderSettings:
    engine: dict[str, Any] = field(default_factory=dict)
    instrument: InstrumentConfig = field(default_factory=InstrumentConfig)
    run_spec: RequestSpec = field(default_factory=RequestSpec)
    activations_dir: str | None = None
    activations_shard_mb: int | None = None  # None: one file per sample; else shards of about this many MiB
    chat_template: str | None = None
    boot: str = "lazy"  # lazy: at the first request; eager: when the model is constructed
    adapter: Adapter | None = None  # -M lora: a LoRA adapter every request runs with

    def engine_key(self, model: str) -> str:
        adapter = self.adapter.record() if self.adapter is not None else None
        return json.dumps([model, self.engine, self.instrument.model_dump(), adapter], sort_keys=True, default=str)

    def fingerprint(self, model: str) -> str:
        """Hash of the model, engine settings and run-wide spec, with the contents of the files
        the spec names as they are now (``vectors/digests.py``: a stat per file, a read only
        when a file changed), so a call after a vector file was rewritten gets another key."""
        from inspect_tl_vllm.vectors.digests import spec_file_digests

        spec = [self.run_spec.model_dump(), spec_file_digests(self.run_spec)]
        text = json.dumps([self.engine_key(model), spec], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _load_structured(value: str, name: str) -> Any:
    """Inline JSON or a .yaml/.json file, read strictly (``spec_files``: no key twice, no YAML 1.1 misreadings)."""
    text = value.strip()
    if text.startswith(("{", "[")):
        return parse_json(text, f"-M {name} (inline JSON)")
    path = Path(text).expanduser()
    if not path.is_file():
        raise SpecError(f"-M {name}={value!r}: no such file; give a .yaml/.json spec file or inline JSON")
    try:
        loaded = load_spec_file(path)
    except SpecError as err:  # it names the file and line; say which argument named the file
        raise SpecError(f"-M {name}: {err}") from None
    return _relative_vectors(loaded, path.parent)


def _relative_vectors(spec: Any, base: Path) -> Any:
    """Vector files and SAE folders (of interventions and the capture) named in a spec file are
    relative to that file's folder."""
    if isinstance(spec, dict):
        capture = spec.get("capture")
        for item in [*(spec.get("interventions") or []), *([capture] if isinstance(capture, dict) else [])]:
            for field_name in ("vector", "sae"):
                value = item.get(field_name) if isinstance(item, dict) else None
                if isinstance(value, str) and not Path(value).expanduser().is_absolute():
                    item[field_name] = str(base / value)
    return spec


def _as_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return list(value)


def parse_model_args(args: dict[str, Any]) -> ProviderSettings:
    unknown = set(args) - set(ENGINE_ARGS) - set(INSTRUMENT_ARGS) - set(PROVIDER_ARGS)
    if unknown:
        raise SpecError(
            f"unknown model args {sorted(unknown)} for tl-vllm; engine settings: {', '.join(ENGINE_ARGS)}; "
            f"other vLLM engine arguments go in -M engine_args='{{...}}' (JSON)"
        )
    engine = {k: args[k] for k in ENGINE_ARGS if k in args}
    if "engine_args" in args:
        extra = args["engine_args"]
        extra = _load_structured(extra, "engine_args") if isinstance(extra, str) else extra
        if not isinstance(extra, dict):
            raise SpecError("-M engine_args: must be a JSON object of vLLM engine arguments")
        engine.update(extra)
    check_engine_args(engine)  # here, not only at the boot: a lazy boot fails at the first sample
    adapter = read_adapter(str(args["lora"]), "-M lora") if args.get("lora") is not None else None
    check_lora_args(adapter, engine)
    instrument_raw = {k: args[k] for k in INSTRUMENT_ARGS if k in args}
    if "hook_points" in instrument_raw:
        instrument_raw["hook_points"] = _as_list(instrument_raw["hook_points"])
    try:
        instrument = InstrumentConfig(**instrument_raw)
    except ValueError as err:
        raise SpecError(f"instrumentation model args: {err}") from None
    spec = RequestSpec()
    if args.get("steer"):
        raw = args["steer"]
        spec = parse_request_spec(_load_structured(raw, "steer") if isinstance(raw, str) else raw, "-M steer")
    if args.get("capture") and args.get("capture_sae"):
        raise SpecError("-M capture and -M capture_sae: a request has one capture; give one of them")
    if args.get("capture") or args.get("capture_sae"):
        capture = {
            "reduce": args.get("capture_reduce", "mean"),
            "positions": args.get("capture_positions", "all"),
            "dtype": args.get("capture_dtype", "float32"),
        }
        if args.get("capture_sae"):
            capture["sae"] = str(args["capture_sae"])
            if "capture_top_k" in args:
                capture["top_k"] = args["capture_top_k"]
        else:
            capture["hooks"] = _as_list(args["capture"])
        where = "-M capture_sae" if args.get("capture_sae") else "-M capture"
        spec = spec.merged(parse_request_spec({"capture": capture}, where))
    boot = str(args.get("boot", "lazy"))
    if boot not in BOOT_MODES:
        raise SpecError(
            f"-M boot={boot!r}: use lazy (at the first request), background (start when the model is built, "
            "wait at the first request) or eager (before the eval starts)"
        )
    return ProviderSettings(
        engine,
        instrument,
        spec,
        _activations_dir(args.get("activations_dir")),
        _shard_mb(args.get("activations_shard_mb")),
        args.get("chat_template"),
        boot,
        adapter,
    )


def _activations_dir(value: Any) -> str | None:
    """``-M activations_dir``: a folder's path or a store's URL that outlives this process, or absent.
    Readers (``activations.load``, ``tl-vllm activations``) and eval-retry run in other processes, so
    an in-memory store would take the activations with it when the eval ends."""
    from inspect_tl_vllm.store.folders import in_memory

    if value is None:
        return None
    if not isinstance(value, str):
        raise SpecError(
            f"-M activations_dir={value!r}: give a folder's path or a store's URL (s3://bucket/acts); a folder "
            "named like a number or a bool goes as ./NAME"
        )
    protocol = in_memory(value)
    if protocol is not None:
        raise SpecError(
            f"-M activations_dir={value!r}: {protocol}:// is an in-memory store that ends with this process, so "
            "no reader and no eval-retry could see the activations; give a local folder (-M activations_dir=DIR) "
            "or a persistent store's URL (s3://, gs://, az://, ...)"
        )
    return value


def _shard_mb(value: Any) -> int | None:
    """``-M activations_shard_mb``: a whole number of MiB in ``SHARD_MB_RANGE``, or absent."""
    from inspect_tl_vllm.store.shards import SHARD_MB_RANGE

    if value is None:
        return None
    low, high = SHARD_MB_RANGE
    try:
        mb = int(value) if not isinstance(value, bool | float) else None
    except (TypeError, ValueError):
        mb = None
    if mb is None or not low <= mb <= high:
        raise SpecError(
            f"-M activations_shard_mb={value!r}: give a shard's target size as a whole number of MiB within "
            f"{low} and {high} (256 suits most runs), or leave it out to store one file per sample"
        )
    return mb
