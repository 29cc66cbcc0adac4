"""Front-end half of the capture contract: turn specs into per-request wire data, and
wire data back into results.  Shared by the offline API and the Inspect provider.

A request's spec becomes ``SamplingParams.extra_args["tlvllm"]`` (a ``wire.RequestWire``: hook
points resolved to site numbers, vectors replaced by content hashes), a ``cache_salt`` that keeps
its prefix-cache entries apart from differently steered requests, and
``skip_reading_prefix_cache`` when it captures (cached prompt rows would never be computed).
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from inspect_tl_vllm.engine.attention_patterns import KEY, QUERY, attention_pattern
from inspect_tl_vllm.engine.handoff import HandoffFolder
from inspect_tl_vllm.instrument.hookpoints import (
    ModelShape,
    Site,
    build_sites,
    canonical_hook_point,
    layout_for,
    pattern_sources,
)
from inspect_tl_vllm.specs import (
    TAG,
    Capture,
    InstrumentConfig,
    RequestSpec,
    SpecError,
    hook_of_key,
    is_pattern,
    parse_hook_point,
)
from inspect_tl_vllm.vectors.files import load_vector, vector_hash
from inspect_tl_vllm.vectors.sae import feature_steering, load_sae
from inspect_tl_vllm.wire import (
    CaptureWire,
    EncoderWire,
    FeaturesWire,
    FetchedResult,
    Receipt,
    RequestWire,
    SteerWire,
    WorkerStatus,
)


class SteeringNotApplied(RuntimeError):
    """A requested intervention or capture touched no token row, its result was not finite, or the
    worker refused the request."""


@dataclass
class PreparedRequest:
    uid: str
    wire: RequestWire
    vectors: dict[str, torch.Tensor]
    cache_salt: str | None
    skip_prefix_cache: bool
    spec: RequestSpec
    holds_vectors: bool = False  # counted among the users of its vectors in the bank (``Instrumentation.hold``)

    def applied(self) -> dict[str, Any]:
        """What this request applies, as a log keeps it: per intervention its label, coef and
        positions, and its vector's content hash and norm (as applied: ablate's direction is
        normalised); the capture's hook points, positions and reduction, and an SAE's folder and
        digest.  With these a log tells two runs apart after a vector file was overwritten."""
        interventions = [
            {
                "label": item.label,
                "coef": item.coef,
                "positions": item.positions,
                "vector": item.vector,
                "vector_norm": None if item.vector is None else float(self.vectors[item.vector].double().norm()),
            }
            for item in self.wire.steer
        ]
        capture = self.wire.capture
        if capture is None:
            return {"interventions": interventions, "capture": None}
        described: dict[str, Any] = {
            "hooks": [hook for hook, _ in capture.hooks],
            "positions": capture.positions,
            "reduce": capture.features.reduce if capture.features is not None else capture.reduce,
            "dtype": capture.dtype,
        }
        if capture.features is not None:
            described.update(sae=capture.features.sae, sae_digest=capture.features.digest)
        return {"interventions": interventions, "capture": described}


@dataclass
class VectorUpload:
    """What ``tlvllm_put_vectors`` sends: the new vectors (their keys, their widths, and their
    float32 entries one after another in one buffer: no per-vector framing to build or parse),
    and the unused ones the workers drop first."""

    keys: list[str]
    widths: list[int]
    data: bytes
    evict: list[str]

    @property
    def args(self) -> tuple[list[str], list[int], bytes, list[str]]:
        return self.keys, self.widths, self.data, self.evict


@dataclass
class CaptureResult:
    """What came back for one request: activations per hook point, positions, receipt."""

    receipt: dict[str, Any]
    activations: dict[str, torch.Tensor] = field(default_factory=dict)
    positions: dict[str, list[int]] = field(default_factory=dict)

    def tokens(self) -> dict[str, int]:
        """How many token rows each returned tensor stands for (before any reduction)."""
        captured = self.receipt.get("captures", {})
        return {key: captured.get(hook_of_key(key), 0) for key in self.activations}

    def check(self, where: str = "request") -> None:
        """Raise unless every requested intervention and capture touched at least one row and
        every result is finite: an answer is never reported as steered, or a capture as taken,
        when it was not.  The workers check captured rows where they are (``host_copies.py``,
        ``packing.py``) and report NaN or inf as the receipt's error."""
        if self.receipt.get("error"):
            raise SteeringNotApplied(f"{where}: {self.receipt['error']}")
        for item in self.receipt.get("interventions", []):
            if item["rows"] == 0:
                raise SteeringNotApplied(
                    f"{where}: intervention {item['label']} touched no token row (check its positions); "
                    "refusing to report an unsteered answer as steered"
                )
            if not item["fired"]:
                raise SteeringNotApplied(f"{where}: the hook of intervention {item['label']} never ran")
            if not math.isfinite(item["mean_norm_change"]):
                raise SteeringNotApplied(
                    f"{where}: intervention {item['label']} made the activations non-finite (mean norm change "
                    f"{item['mean_norm_change']}); lower its coef or the vector's scale"
                )
        for hook, rows in self.receipt.get("captures", {}).items():
            if rows == 0 and not self.receipt.get("capture_unreached"):
                raise SteeringNotApplied(
                    f"{where}: capture at {hook} selected no token row (check capture.positions against the "
                    "prompt and the generated length)"
                )


class Instrumentation:
    """The engine's hook table as the front end sees it, plus the uploaded-vector index."""

    def __init__(self, hf_config: Any, settings: InstrumentConfig) -> None:
        architecture = (getattr(hf_config, "architectures", None) or ["?"])[0]
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.architecture = architecture
        self.settings = settings
        self.shape = ModelShape.of(text_config)
        self.num_layers = self.shape.num_layers
        self.hidden_size = self.shape.d_model
        layout = layout_for(architecture)
        self.sites: dict[str, Site] = build_sites(layout, self.shape, settings.hook_points, architecture)
        # The workers' vector bank as the front end sees it: content hash -> how many requests in
        # flight use it, least recently used first.  Unused vectors are evicted to make room.
        self.bank: OrderedDict[str, int] = OrderedDict()
        # per layer whose query and key are hooked: (scale, sliding window, soft-cap), from the workers
        self.attention: dict[int, tuple[float, float, float]] = {}
        self.handoff = HandoffFolder()

    def site(self, hook: str, where: str) -> Site:
        canonical_hook_point(hook, self.num_layers)  # precise error for layers out of range
        site = self.sites.get(hook)
        if site is None:
            raise SpecError(
                f"{where}: hook point {hook!r} is not instrumented in this engine "
                f"(hook_points={self.settings.hook_points}); boot with it listed, or hook_points=['all']"
            )
        return site

    def prepare(
        self, spec: RequestSpec | None, *, prompt_len: int, max_tokens: int, where: str = "request"
    ) -> PreparedRequest | None:
        if spec is None or spec.empty:
            return None
        uid = uuid.uuid4().hex
        vectors: dict[str, torch.Tensor] = {}
        steer: list[SteerWire] = []
        stages: dict[int, int] = {}
        for i, item in enumerate(spec.interventions):
            label = f"interventions[{i}] {item.op} at {item.hook}"
            site = self.site(item.hook, f"{where}: interventions[{i}].hook")
            stage = stages.get(site.index, 0)
            if stage >= self.settings.max_stack:
                raise SpecError(
                    f"{where}: interventions[{i}]: more than max_stack={self.settings.max_stack} interventions at "
                    f"{site.name}; boot with a larger InstrumentConfig.max_stack"
                )
            stages[site.index] = stage + 1
            _check_reach(item.positions, prompt_len, max_tokens, f"{where}: interventions[{i}].positions")
            key = None
            vector: torch.Tensor | None = None
            encoder = None
            if item.sae is not None and item.feature is not None:
                feature = feature_steering(
                    item.sae,
                    item.feature,
                    op=item.op,
                    hook=item.hook,
                    width=site.width,
                    where=f"{where}: interventions[{i}]",
                )
                vector = feature.decoder
                if feature.encoder is not None:
                    encoder_key = vector_hash(feature.encoder)
                    vectors[encoder_key] = feature.encoder
                    encoder = EncoderWire(vector=encoder_key, bias=feature.bias, threshold=feature.threshold)
            elif item.vector is not None:
                inline = item.inline_vector
                vector = load_vector(
                    item.vector if inline is None else inline,
                    site.width,
                    where=f"{where}: interventions[{i}].vector",
                    width_of=width_of(site),
                )
            mask_key = None
            if item.heads is not None:
                mask = head_columns(site, item.heads, f"{where}: interventions[{i}].heads")
                mask_key = vector_hash(mask)
                vectors[mask_key] = mask
                vector = vector * mask if vector is not None else None  # a direction within the chosen heads
            if vector is not None and item.sae is None and item.op == "ablate":
                norm = vector.double().norm()  # float64: a float32 norm of large entries overflows
                if norm == 0:
                    within = " within the chosen heads" if item.heads is not None else ""
                    raise SpecError(f"{where}: interventions[{i}].vector: cannot ablate a zero direction{within}")
                vector = (vector.double() / norm).float()
            if vector is not None:
                key = vector_hash(vector)
                vectors[key] = vector
            steer.append(
                SteerWire(
                    label=label,
                    site=site.index,
                    stage=stage,
                    op=item.op,
                    coef=item.coef,
                    vector=key,
                    positions=item.positions,
                    encoder=encoder,
                    mask=mask_key,
                )
            )
        capture = None
        if spec.capture is not None:
            features, names = None, spec.capture.hooks
            if spec.capture.sae is not None:
                features, sae_hook = self._features(spec.capture, f"{where}: capture")
                names = [sae_hook]
            sites = self._capture_sites(names, f"{where}: capture.hooks")
            hooks = [(name, site.index) for name, site in sites]
            _check_reach(spec.capture.positions, prompt_len, max_tokens, f"{where}: capture.positions")
            per_token = spec.capture.reduce == "none" or features is not None
            rows = prompt_len + max_tokens
            row_bytes = sum(_host_bytes_per_row(spec.capture.reduce, features, site.width) for _, site in sites)
            # a pattern is [query, head, key] float32, and each row's query and key come back first
            patterns = [site.heads * rows * 4 for name, site in sites if name.endswith(QUERY)]
            need = rows * (row_bytes + sum(patterns))
            if need > self.settings.capture_bytes_per_request:
                fewer = "a smaller top_k or fewer features" if features is not None else "fewer positions or hooks"
                raise SpecError(
                    f"{where}: capture of {len(hooks)} hook points over up to {prompt_len + max_tokens} tokens "
                    f"needs up to {need} bytes, over capture_bytes_per_request="
                    f"{self.settings.capture_bytes_per_request}; capture {fewer}, reduce per sample, or raise the limit"
                )
            capture = CaptureWire(
                hooks=hooks,
                positions=spec.capture.positions,
                reduce="none" if features is not None else spec.capture.reduce,  # SAE: features.reduce
                dtype=spec.capture.dtype,
                max_bytes=self.settings.capture_bytes_per_request,
                handoff=self.handoff.ticket() if per_token else None,
                features=features,
            )
        wire = RequestWire(uid=uid, steer=steer, capture=capture)
        salt = None
        if steer:
            salt = hashlib.sha256(msgspec.json.encode(steer)).hexdigest()[:24]  # fields in a fixed order
        return PreparedRequest(uid, wire, vectors, salt, capture is not None, spec)

    def _capture_sites(self, names: list[str], where: str) -> list[tuple[str, Site]]:
        """The sites a capture reads, by the name its rows come back under: an attention pattern
        reads its block's rotated query and key (``<pattern>:q``, ``<pattern>:k``)."""
        sites = []
        for name in names:
            if not is_pattern(name):
                sites.append((name, self.site(name, where)))
                continue
            layer, _ = parse_hook_point(name)
            canonical_hook_point(name, self.num_layers)  # a layer past the model's: a precise error
            query, key = pattern_sources(name)
            if query not in self.sites or key not in self.sites or layer not in self.attention:
                raise SpecError(
                    f"{where}: {name} is computed from {query} and {key}, which this engine does not hook; "
                    f"boot with hook_points listing {name} (or blocks.{layer}.attn.*)"
                )
            sites += [(name + QUERY, self.sites[query]), (name + KEY, self.sites[key])]
        return sites

    def _features(self, capture: Capture, where: str) -> tuple[FeaturesWire, str]:
        """An SAE capture's wire form and its SAE's hook point, the SAE checked against the model
        and the capture's fields."""
        assert capture.sae is not None
        sae = load_sae(capture.sae, f"{where}.sae")
        if capture.hooks and capture.hooks != [sae.hook]:
            raise SpecError(
                f"{where}.hooks: the SAE at {sae.path} reads {sae.hook!r}, not {capture.hooks[0]!r}; omit hooks"
            )
        sae.check_width(self.site(sae.hook, f"{where}.sae").width, f"{where}.sae")
        past = [f for f in capture.features or () if f >= sae.d_sae]
        if past:
            raise SpecError(f"{where}.features: {past[:5]} out of range; {sae.path} has features 0..{sae.d_sae - 1}")
        if capture.features is None and capture.top_k > sae.d_sae:
            raise SpecError(f"{where}.top_k: {capture.top_k} is more than the SAE's {sae.d_sae} features")
        wire = FeaturesWire(
            sae=str(sae.path), digest=sae.digest, top_k=capture.top_k, features=capture.features, reduce=capture.reduce
        )
        return wire, sae.hook

    def pending_upload(self, requests: list[PreparedRequest | None]) -> VectorUpload | None:
        """The upload that gives the workers' bank every vector of ``requests`` (None: they have
        them all).  Room is made by evicting vectors no request in flight uses, least recently
        used first; a SpecError when even that is not enough.  Nothing changes until ``hold``."""
        fresh: dict[str, torch.Tensor] = {}
        for request in requests:
            if request is not None:
                fresh.update({k: v for k, v in request.vectors.items() if k not in self.bank})
        if not fresh:
            return None
        overflow = len(self.bank) + len(fresh) - self.settings.max_vectors
        evict = [key for key, users in self.bank.items() if users == 0][: max(overflow, 0)]
        if overflow > len(evict):
            in_use = sum(1 for users in self.bank.values() if users)
            raise SpecError(
                f"steering vectors: {len(fresh)} new vectors do not fit the engine's bank ({in_use} of "
                f"max_vectors={self.settings.max_vectors} rows are used by requests in flight); boot with a "
                "larger InstrumentConfig.max_vectors (-M max_vectors), or reuse vectors across samples"
            )
        entries = torch.cat([vector.reshape(-1).to(torch.float32) for vector in fresh.values()])
        return VectorUpload(
            list(fresh), [vector.numel() for vector in fresh.values()], entries.numpy().tobytes(), evict
        )

    def hold(self, requests: list[PreparedRequest | None], upload: VectorUpload | None) -> None:
        """Record that the workers applied ``upload`` and that ``requests`` now use their vectors
        until ``release``."""
        for key in upload.evict if upload is not None else ():
            del self.bank[key]
        for request in requests:
            if request is None or request.holds_vectors or not request.vectors:
                continue
            for key in request.vectors:
                self.bank[key] = self.bank.get(key, 0) + 1
                self.bank.move_to_end(key)
            request.holds_vectors = True

    def release(self, requests: list[PreparedRequest | None]) -> None:
        """``requests`` are done with their vectors (finished, fetched or aborted): once no request
        uses a vector any more, it may be evicted."""
        for request in requests:
            if request is None or not request.holds_vectors:
                continue
            for key in request.vectors:
                self.bank[key] -= 1
            request.holds_vectors = False

    def fetch_args(self, wanted: list[list[Any]]) -> tuple[list[list[Any]], list[str]]:
        """Arguments of the ``tlvllm_fetch`` RPC for ``wanted`` ([uid, last input position] pairs)."""
        return wanted, self.handoff.ticket()

    def release_args(self, requests: list[PreparedRequest]) -> tuple[list[list[Any]], list[str]]:
        """``tlvllm_release`` arguments that take back what the workers hold for requests that were
        aborted or cancelled: their receipts, captured rows and early-written files would
        otherwise stay until the engine stops (position 0: no more rows than needed)."""
        return self.fetch_args([[request.uid, 0] for request in requests])

    def drop_released(self, per_worker: list[Any]) -> None:
        """Drop the workers' answer to ``tlvllm_release``, deleting the hand-off files it names."""
        for payload in merge_fetched(per_worker):
            for name in payload.files if payload is not None else ():
                self.handoff.take(name)

    def decode(self, payload: FetchedResult | None, where: str = "request") -> CaptureResult:
        if payload is None:
            raise SteeringNotApplied(f"{where}: the worker has no record of this request (was the engine restarted?)")
        activations: dict[str, torch.Tensor] = {}
        if payload.tensors:
            from safetensors.torch import load

            activations = load(payload.tensors)
        for name in payload.files:
            activations.update(self.handoff.take(name))
        receipt, positions = payload.receipt.encode(), dict(payload.positions)
        for hook, rows in activations.items():
            site = self._site_of_key(hook)
            if site is not None and site.heads:  # per head, as TransformerLens: [pos, head, d_head]
                activations[hook] = rows.view(*rows.shape[:-1], site.heads, site.width // site.heads)
        for query in [hook for hook in activations if hook.endswith(QUERY)]:
            self._pattern(query[: -len(QUERY)], activations, receipt, positions)
        return CaptureResult(receipt, activations, positions)

    def _site_of_key(self, key: str) -> Site | None:
        """The site whose rows came back under ``key``: a hook point's, or a pattern's query or key."""
        for suffix, source in ((QUERY, 0), (KEY, 1)):
            if key.endswith(suffix):
                return self.sites.get(pattern_sources(key[: -len(suffix)])[source])
        return self.sites.get(key)

    def _pattern(
        self, name: str, activations: dict[str, torch.Tensor], receipt: dict[str, Any], positions: dict[str, list[int]]
    ) -> None:
        """Replace a pattern's query and key rows by the pattern (``attention_patterns.py``)."""
        q, k = activations.pop(name + QUERY), activations.pop(name + KEY)
        kept = positions.pop(name + QUERY)
        positions.pop(name + KEY, None)
        layer, _ = parse_hook_point(name)
        scale, window, soft_cap = self.attention[layer]
        activations[name] = attention_pattern(q, k, kept, scale, window, soft_cap)
        positions[name] = kept
        captures = receipt.get("captures", {})
        captures[name] = captures.pop(name + QUERY, len(kept))
        captures.pop(name + KEY, None)


def width_of(site: Site) -> str:
    """What sets a site's width, for errors about a vector of the wrong width."""
    if site.heads:
        return f"the width of {site.name} ({site.heads} heads x {site.width // site.heads})"
    if ".mlp." in site.name:
        return f"the width of {site.name} (the MLP's neurons)"
    return "the model's hidden size"


def head_columns(site: Site, heads: list[int], where: str) -> torch.Tensor:
    """The 0/1 row over a per-head site's columns that selects ``heads`` (an intervention's ``heads``)."""
    past = [h for h in heads if h >= site.heads]
    if past:
        raise SpecError(f"{where}: heads {past} do not exist at {site.name}, which has heads 0..{site.heads - 1}")
    d_head = site.width // site.heads
    mask = torch.zeros(site.heads, d_head)
    mask[heads] = 1.0
    return mask.flatten()


def _host_bytes_per_row(reduce: str, features: FeaturesWire | None, hidden_size: int) -> int:
    """Host memory one captured token row can take at most: a float32 row of the hook point
    per token, an SAE capture's (index, value) pairs per token (encoded on the device), and
    nothing per token for what is reduced per sample on the device."""
    if features is not None:
        return 0 if features.reduce != "none" else 8 * features.kept()
    return hidden_size * 4 if reduce == "none" else 0


def _check_reach(scope: Any, prompt_len: int, max_tokens: int, where: str) -> None:
    """Refuse a position scope that cannot select any row of this request.

    Rows are the forward passes whose input is token ``p``: prompt positions ``0..P-1`` and
    generated ones up to ``P + max_tokens - 2`` (the last generated token is never an input).
    A listed scope may name positions some requests do not reach; it must reach one.
    """
    last = prompt_len + max(max_tokens, 1) - 2
    if scope == "generated" and last < prompt_len:
        raise SpecError(
            f"{where}: 'generated' selects no row when at most {max_tokens} token is generated (the last "
            "generated token is never an input); raise max_tokens or use 'all'"
        )
    if isinstance(scope, list) and not any(0 <= (p + prompt_len if p < 0 else p) <= last for p in scope):
        raise SpecError(
            f"{where}: none of {scope[:8]}{' ...' if len(scope) > 8 else ''} lies in this request's rows: the "
            f"prompt has {prompt_len} tokens and at most {max_tokens} are generated, so positions run 0..{last} "
            f"(or -{prompt_len}..-1 counting back from the end of the prompt)"
        )


def vllm_prompt(token_ids: list[int], request: PreparedRequest | None, *, rendered: bool = False) -> dict[str, Any]:
    """vLLM's prompt for ``token_ids``, salted when steered so that differently steered requests
    never share prefix-cache entries.

    ``rendered=True`` gives the engine input that ``AsyncLLM.generate`` takes as it is (vLLM
    deprecates raw prompts there); ``vllm.LLM`` renders prompts itself and takes the raw form."""
    salt = request.cache_salt if request is not None and request.cache_salt else None
    if rendered:
        from vllm.inputs import tokens_input

        return dict(tokens_input(token_ids, cache_salt=salt))
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return prompt


def sampling_fields(request: PreparedRequest | None) -> dict[str, Any]:
    """The ``SamplingParams`` fields that carry ``request``'s spec to the workers (none for a
    plain request): the wire spec, and no prefix-cache reads when it captures."""
    if request is None:
        return {}
    return {
        "extra_args": {TAG: request.wire.encode()},
        "skip_reading_prefix_cache": request.skip_prefix_cache or None,
    }


def max_input_position(prompt_len: int, num_generated: int) -> int:
    """The last position that was an *input* token: the final generated token never is."""
    return prompt_len + max(num_generated, 1) - 2


def merge_fetched(per_worker: list[Any]) -> list[FetchedResult | None]:
    """One result per wanted request from every worker's answer to ``tlvllm_fetch`` (each a list
    of encoded ``FetchedResult`` or None).

    Tensor-parallel ranks other than 0 answer None (they hold the same residual stream);
    pipeline stages each answer for the hook points and interventions of their own layers,
    and those parts are merged here.  A request some stage has no record of is None.
    """
    answers = [answer for answer in per_worker if answer is not None]
    if not answers:
        raise RuntimeError("tl-vllm: no worker records captures (is tensor-parallel rank 0 instrumented?)")
    decoded = [[None if part is None else FetchedResult.decode(part) for part in answer] for answer in answers]
    return [_merge_parts(list(parts)) for parts in zip(*decoded, strict=True)]


def _merge_parts(parts: list[FetchedResult | None]) -> FetchedResult | None:
    """Pipeline stages' parts of one request's result as one result (None if a stage has none)."""
    present = [part for part in parts if part is not None]
    if len(present) < len(parts):
        return None
    if len(present) == 1:
        return present[0]
    from safetensors.torch import load, save

    tensors: dict[str, torch.Tensor] = {}
    receipt = Receipt(interventions=[], captures={}, error=None)
    positions: dict[str, list[int]] = {}
    files: list[str] = []
    for part in present:
        files += part.files
        if part.tensors:
            tensors.update(load(part.tensors))
        positions.update(part.positions)
        receipt.interventions.extend(part.receipt.interventions)
        receipt.captures.update(part.receipt.captures)
        receipt.error = receipt.error or part.receipt.error
        receipt.capture_unreached = receipt.capture_unreached or part.receipt.capture_unreached
    receipt.interventions.sort(key=lambda item: item.index)
    return FetchedResult(
        uid=present[0].uid, receipt=receipt, positions=positions, tensors=save(tensors) if tensors else b"", files=files
    )


def merge_status(per_worker: list[Any]) -> dict[str, Any]:
    """The workers' counters (encoded ``WorkerStatus``) as one: sites and fire counts of the
    recording ranks, totals of the rest."""
    workers = [WorkerStatus.decode(status) for status in per_worker]
    recording = [status for status in workers if status.collects]

    def per_recording(field: str) -> Any:
        """A recording rank's own dict, or one per rank when several record (pipeline stages)."""
        values = [getattr(status, field) for status in recording]
        return values[0] if len(values) == 1 else values

    return {
        "runner": workers[0].runner,
        "sites": [name for status in recording for name in status.sites],
        "fired": [count for status in recording for count in status.fired],
        "buffer_bytes": sum(status.buffer_bytes for status in workers),
        "vectors": max(status.vectors for status in workers),
        "max_requests_steered_in_one_step": max(s.max_requests_steered_in_one_step for s in workers),
        "pending_results": sum(status.pending_results for status in recording),
        "live_requests": max(status.live_requests for status in workers),
        "workers": len(workers),
        "steps": max(status.steps for status in workers),
        "step_kinds": per_recording("step_kinds"),
        "resumed_after_preemption": max(status.resumed_after_preemption for status in workers),
        "written_early": sum(status.written_early for status in recording),
        "host_seconds": per_recording("host_seconds"),
        "pinned_host": per_recording("pinned_host"),
        "sae_held": per_recording("sae_held"),
        "attention": {layer: value for status in workers for layer, value in status.attention.items()},
    }


def adopt_worker_status(instrumentation: Instrumentation, status: dict[str, Any]) -> None:
    """At boot: every instrumented hook point must have landed on some worker (pipeline stages split
    them); the attention settings the workers read (for attention patterns) are kept."""
    instrumentation.attention = {int(layer): tuple(value) for layer, value in status["attention"].items()}
    landed = set(status["sites"])
    missing = sorted({site.name for site in instrumentation.sites.values()} - landed)
    if missing:
        raise RuntimeError(
            f"tl-vllm: hook points {missing[:5]} landed on no worker; this model's pipeline stages do not hold them"
        )
