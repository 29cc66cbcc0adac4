"""Sparse autoencoders in SAELens' on-disk format: a folder with ``cfg.json`` and
``sae_weights.safetensors`` (``W_enc`` [d_in, d_sae], ``b_enc`` [d_sae], ``W_dec`` [d_sae, d_in],
``b_dec`` [d_in], and ``threshold`` [d_sae] for JumpReLU), as ``SAE.save_model`` writes it and
Gemma Scope / Llama Scope releases ship.

Architectures: ``standard`` (ReLU), ``jumprelu`` (Gemma Scope) and ``topk`` (``k``, and
``rescale_acts_by_decoder_norm``). The config's hook name (``metadata.hook_name`` in SAELens 6,
``hook_name`` before) is TransformerLens' name, which is also this package's
(``blocks.N.hook_resid_post`` ...). Input normalisations other than ``none`` and ``hook_z``
reshaping are refused by name rather than approximated. Weights are read with safetensors only,
never unpickled, and checked for shape and finiteness when loaded.

What the engine takes from an SAE: a feature's decoder row and encoder (``feature_steering``, for
steering and clamping), and the encoder on a worker's device (``encoder_on``, for captures,
``instrument/feature_captures.py``).  ``densify`` turns a capture's sparse rows back into dense ones.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from inspect_tl_vllm.specs import MAX_FEATURE, MAX_VECTOR_ENTRY, SpecError, parse_hook_point
from inspect_tl_vllm.vectors.versions import FileVersion, file_version

CONFIG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")
BOOLEAN_FIELDS = {"apply_b_dec_to_input": True, "rescale_acts_by_decoder_norm": False}
"""The config's flags this package reads, with SAELens' defaults."""


@dataclass(frozen=True)
class SparseAutoencoder:
    path: Path
    architecture: str
    hook: str
    d_in: int
    d_sae: int
    W_enc: torch.Tensor  # noqa: N815 (SAELens' names)
    b_enc: torch.Tensor
    W_dec: torch.Tensor  # noqa: N815
    b_dec: torch.Tensor
    threshold: torch.Tensor | None
    k: int | None
    apply_b_dec_to_input: bool
    rescale_acts_by_decoder_norm: bool
    digest: str  # sha256 of cfg.json and the weights file, as read: the SAE's identity across processes
    _decoder_norms: torch.Tensor | None = dataclasses.field(default=None, repr=False, compare=False)

    def encode(self, activations: torch.Tensor) -> torch.Tensor:
        """Feature activations [..., d_sae] of activations [..., d_in], in float32, as SAELens'
        ``SAE.encode`` computes them for this architecture (in the encoder's dtype: float32 as
        loaded, the model's dtype on a worker's GPU, see ``encoder_on``)."""
        x = activations.to(self.W_enc.dtype)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = torch.addmm(self.b_enc, x.reshape(-1, self.d_in), self.W_enc).float().reshape(*x.shape[:-1], -1)
        if self.architecture == "standard":
            return pre.relu()
        if self.architecture == "jumprelu":
            assert self.threshold is not None
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        assert self.k is not None
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.decoder_norms
        values, indices = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, indices, values.relu())

    @property
    def nbytes(self) -> int:
        tensors = (self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold, self._decoder_norms)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def check_digest(self, digest: str, where: str) -> None:
        """A SpecError naming ``where`` unless these are the files a request was admitted with."""
        if self.digest != digest:
            raise SpecError(
                f"{where}: the SAE files at {self.path} changed after this request was admitted (sha256 "
                f"{digest[:12]}... then, {self.digest[:12]}... now); rerun it, and keep an SAE's files unchanged "
                "while an eval uses them"
            )

    @property
    def decoder_norms(self) -> torch.Tensor:
        """Each feature's decoder norm [d_sae] (TopK's ``rescale_acts_by_decoder_norm``), on the encoder's device."""
        if self._decoder_norms is None:
            object.__setattr__(self, "_decoder_norms", self.W_dec.norm(dim=-1).to(self.W_enc.device))
        return self._decoder_norms

    def encoder_on(self, device: torch.device | str, dtype: torch.dtype) -> SparseAutoencoder:
        """This SAE for encoding on ``device`` in ``dtype`` (a worker's GPU, the model's dtype: a
        float32 encoder would cost bfloat16 tensor cores several times over).  The decoder stays
        where it is: encoding reads only its norms."""
        norms = self.decoder_norms.to(device) if self.rescale_acts_by_decoder_norm else None
        moved = {name: getattr(self, name).to(device, dtype) for name in ("W_enc", "b_enc", "b_dec")}
        threshold = self.threshold.to(device) if self.threshold is not None else None
        return dataclasses.replace(self, threshold=threshold, _decoder_norms=norms, **moved)

    def decoder_row(self, feature: int, where: str) -> torch.Tensor:
        """Feature ``feature``'s decoder direction (what adding the feature adds), float32 [d_in]."""
        self.check_feature(feature, where)
        return self.W_dec[feature].contiguous()

    def check_feature(self, feature: int, where: str) -> None:
        """A SpecError naming ``where`` unless ``feature`` is one of this SAE's."""
        if not 0 <= feature < self.d_sae:
            raise SpecError(f"{where}: feature {feature} is out of range; {self.path} has features 0..{self.d_sae - 1}")

    def check_width(self, width: int, where: str) -> None:
        """A SpecError naming ``where`` unless this SAE reads activations of the model's ``width``."""
        if self.d_in != width:
            raise SpecError(
                f"{where}: the SAE at {self.path} reads {self.d_in}-wide activations but the model's hidden size is "
                f"{width}; was it trained on another model?"
            )


def load_sae(path: str | Path, where: str = "sae") -> SparseAutoencoder:
    """The SAE in the folder ``path`` (read once per version of its files, ``sae_version``), or a
    SpecError naming ``where``, the file and what is wrong."""
    version = sae_version(path, where)
    sae = _loaded.get(version)
    if sae is None:  # a folder rewritten since loads anew
        sae = read_sae(version[0], where)
        _loaded[version] = sae
        while len(_loaded) > MAX_CACHED or (len(_loaded) > 1 and _cached_bytes() > MAX_CACHED_BYTES):
            _loaded.pop(next(iter(_loaded)))
    return sae


SaeVersion = tuple[str, tuple[FileVersion, ...]]

MAX_CACHED = 8
MAX_CACHED_BYTES = 4 << 30
"""SAEs kept loaded in one process, by count and by their tensors' bytes (the newest always stays)."""

_loaded: dict[SaeVersion, SparseAutoencoder] = {}


def _cached_bytes() -> int:
    return sum(sae.nbytes for sae in _loaded.values())


def sae_version(path: str | Path, where: str = "sae") -> SaeVersion:
    """The folder's resolved path and its two files' versions (``versions.file_version``), so a
    cache keyed on this never serves an older version.  A SpecError when the folder is not an SAE's."""
    folder = Path(path).expanduser()
    files = [folder / CONFIG, folder / WEIGHTS]
    for file in files:
        if not file.is_file():
            raise SpecError(
                f"{where}: {folder} is not an SAE folder: {file.name} not found (SAELens' format: "
                f"{CONFIG} and {WEIGHTS}, as SAE.save_model writes them)"
            )
    stats = (file.stat() for file in files)
    return str(folder.resolve()), tuple(file_version(info) for info in stats)


def read_sae(folder: str | Path, where: str = "sae") -> SparseAutoencoder:
    """The SAE in ``folder``, read now (no cache), with ``digest`` the sha256 of the very bytes
    its tensors were built from: each file is read once, so a file rewritten meanwhile cannot
    give tensors of one version and the digest of another."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(folder)
    try:
        config_bytes = (path / CONFIG).read_bytes()
        config = json.loads(config_bytes)
    except RecursionError:
        raise SpecError(f"{where}: {path / CONFIG} nests too deeply to be an SAE config") from None
    except (OSError, ValueError) as err:
        raise SpecError(f"{where}: cannot read {path / CONFIG}: {err}") from err
    if not isinstance(config, dict):
        raise SpecError(f"{where}: {path / CONFIG} is not a JSON object")
    architecture = config.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise SpecError(f"{where}: {path}: architecture {architecture!r} is not supported; use one of {ARCHITECTURES}")
    for key, allowed in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if config.get(key, "none") not in (allowed, None):
            raise SpecError(f"{where}: {path}: {key}={config[key]!r} is not supported (only {allowed!r})")
    metadata = config.get("metadata") if isinstance(config.get("metadata"), dict) else {}
    hook = metadata.get("hook_name") or config.get("hook_name")
    if not isinstance(hook, str):
        raise SpecError(f"{where}: {path / CONFIG} names no hook point (metadata.hook_name)")
    try:
        parse_hook_point(hook)
    except SpecError as err:
        raise SpecError(f"{where}: {path / CONFIG}: hook {hook!r}: {err}") from None
    d_in, d_sae = config.get("d_in"), config.get("d_sae")
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_FEATURE + 1 for v in (d_in, d_sae)):
        raise SpecError(f"{where}: {path / CONFIG}: d_in and d_sae must be whole numbers within 1 and 2**24")
    flags = {name: config.get(name, default) for name, default in BOOLEAN_FIELDS.items()}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise SpecError(f"{where}: {path / CONFIG}: {name} must be true or false (JSON booleans), got {value!r}")
    try:
        weight_bytes = (path / WEIGHTS).read_bytes()
        weights = load(weight_bytes)
    except (OSError, SafetensorError) as err:
        raise SpecError(f"{where}: cannot read {path / WEIGHTS}: {err}") from err
    digest = hashlib.sha256(config_bytes)
    digest.update(weight_bytes)
    del weight_bytes
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if architecture == "jumprelu":
        shapes["threshold"] = (d_sae,)
    tensors = {}
    for name, shape in shapes.items():
        tensor = weights.get(name)
        if tensor is None:
            raise SpecError(f"{where}: {path / WEIGHTS} has no tensor {name!r} ({architecture} needs {sorted(shapes)})")
        if tuple(tensor.shape) != shape:
            raise SpecError(f"{where}: {path / WEIGHTS}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        if not tensor.is_floating_point():
            raise SpecError(f"{where}: {path / WEIGHTS}: {name} is {tensor.dtype}, not floating point")
        tensor = tensor.to(torch.float32)
        if not torch.isfinite(tensor).all():
            raise SpecError(f"{where}: {path / WEIGHTS}: {name} holds NaN or inf")
        tensors[name] = tensor.contiguous()
    largest = float(tensors["W_dec"].abs().max())
    if largest > MAX_VECTOR_ENTRY:
        raise SpecError(
            f"{where}: {path / WEIGHTS}: W_dec has an entry of magnitude {largest:g}, over {MAX_VECTOR_ENTRY:g}"
        )
    k = config.get("k") if architecture == "topk" else None
    if architecture == "topk" and not (isinstance(k, int) and not isinstance(k, bool) and 0 < k <= d_sae):
        raise SpecError(f"{where}: {path / CONFIG}: a topk SAE needs k within 1 and d_sae={d_sae}, got {k!r}")
    return SparseAutoencoder(
        path=path,
        architecture=architecture,
        hook=hook,
        d_in=d_in,
        d_sae=d_sae,
        threshold=tensors.get("threshold"),
        k=k,
        digest=digest.hexdigest(),
        **flags,
        **{name: tensors[name] for name in ("W_enc", "b_enc", "W_dec", "b_dec")},
    )


@dataclass(frozen=True)
class FeatureSteering:
    """What steering by one feature needs: the decoder row it moves along, and (for ReLU and
    JumpReLU SAEs) the feature's own encoder, f = act(x . encoder + bias) with act keeping values
    above ``threshold``, so that the hook can clamp it and report it before and after."""

    decoder: torch.Tensor
    encoder: torch.Tensor | None
    bias: float
    threshold: float


def feature_steering(path: str, feature: int, *, op: str, hook: str, width: int, where: str) -> FeatureSteering:
    """Feature ``feature`` of the SAE at ``path``, checked against its own hook point, the model's
    hidden size and the op (``clamp`` needs the feature's activation on its own, which a TopK SAE
    does not define)."""
    sae = load_sae(path, f"{where}.sae")
    if sae.hook != hook:
        raise SpecError(
            f"{where}: the SAE at {sae.path} was trained on {sae.hook!r}, not {hook!r}; steer at its hook point"
        )
    sae.check_width(width, where)
    decoder = sae.decoder_row(feature, f"{where}.feature")
    if sae.architecture == "topk":
        if op == "clamp":
            raise SpecError(
                f"{where}.op: a TopK SAE's feature activation depends on every other feature, so it cannot be "
                f"clamped alone; use op 'add' with {sae.path}, or a ReLU or JumpReLU SAE"
            )
        return FeatureSteering(decoder, None, 0.0, 0.0)
    encoder = sae.W_enc[:, feature].contiguous()
    bias = float(sae.b_enc[feature])
    if sae.apply_b_dec_to_input:
        bias -= float(sae.b_dec.double() @ encoder.double())
    threshold = max(float(sae.threshold[feature]), 0.0) if sae.threshold is not None else 0.0
    return FeatureSteering(decoder, encoder, bias, threshold)


def densify(indices: torch.Tensor, values: torch.Tensor, d_sae: int) -> torch.Tensor:
    """Sparse feature activations as an SAE capture stores them (``<hook>.sae_indices`` and
    ``<hook>.sae_values``, [rows, k]) as dense [rows, d_sae] rows, zeros where a feature was not kept."""
    if indices.shape != values.shape or indices.dim() != 2:
        raise ValueError(f"densify: indices {tuple(indices.shape)} and values {tuple(values.shape)} must be [rows, k]")
    if indices.numel() and not 0 <= int(indices.min()) <= int(indices.max()) < d_sae:
        raise ValueError(f"densify: feature indices run outside 0..{d_sae - 1}")
    dense = torch.zeros(values.shape[0], d_sae, dtype=values.dtype)
    return dense.scatter_(1, indices.long(), values)
