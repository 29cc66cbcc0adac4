"""A LoRA adapter applied to every request of an engine, through vLLM's own LoRA support.

vLLM wraps each adapted linear layer in a LoRA layer while it loads the model; the hooks are
installed after that, on the wrapped modules, so every hook point sees the adapted model: the
query projection's output at ``attn.hook_q`` carries the adapter's update, as in the merged model.
An engine serves one adapter (the model under evaluation is base + adapter); it is loaded when the
engine boots, so a folder vLLM cannot use fails the boot with vLLM's reason, not the first sample.

Only ``adapter_model.safetensors`` is read: a pickled ``adapter_model.bin`` is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inspect_tl_vllm.specs import SpecError

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; an adapter's rank is rounded up to one of them."""
ADAPTER_NAME = "tl-vllm-adapter"


@dataclass(frozen=True)
class Adapter:
    """A checked adapter folder; ``sha256`` (of its weights file) tells runs of two adapters apart."""

    path: str
    rank: int
    sha256: str

    def engine_args(self) -> dict[str, Any]:
        """vLLM engine arguments that serve this adapter."""
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": next(r for r in LORA_RANKS if r >= self.rank)}

    def request(self) -> Any:
        """The ``LoRARequest`` every request of the engine carries."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, 1, self.path)

    def record(self) -> dict[str, Any]:
        """What logs and receipts record of the adapter."""
        return {"path": self.path, "rank": self.rank, "sha256": self.sha256}


def read_adapter(path: str | Path, where: str = "lora") -> Adapter:
    """Check a PEFT LoRA folder (``adapter_config.json`` and ``adapter_model.safetensors``)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SpecError(f"{where}={str(path)!r}: no such folder; give a PEFT LoRA adapter's folder")
    config_file = folder / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise SpecError(f"{where}={str(path)!r}: the folder has no adapter_config.json (a PEFT LoRA adapter)") from None
    except ValueError as err:
        raise SpecError(f"{where}: {config_file} is not valid JSON ({err})") from None
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        pickled = (folder / "adapter_model.bin").exists()
        why = " (adapter_model.bin is pickled and is never loaded: save the adapter as safetensors)" if pickled else ""
        raise SpecError(f"{where}={str(path)!r}: no adapter_model.safetensors{why}")
    rank = config.get("r") if isinstance(config, dict) else None
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= LORA_RANKS[-1]:
        raise SpecError(
            f"{where}: adapter_config.json's rank r={rank!r} must be a whole number within 1 and {LORA_RANKS[-1]}"
        )
    digest = hashlib.sha256()
    with weights.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return Adapter(str(folder.resolve()), rank, digest.hexdigest())


def check_lora_dtype(adapter: Adapter | None, engine_kwargs: dict[str, Any], on_gpu: bool) -> None:
    """vLLM's LoRA kernels on a GPU (Triton) take bfloat16 and float16 only; its CPU build takes float32 too."""
    dtype = str(engine_kwargs.get("dtype", "auto")).removeprefix("torch.")
    if adapter is not None and on_gpu and dtype in ("float32", "float"):
        raise SpecError(
            f"lora with dtype={dtype}: vLLM's LoRA kernels on a GPU take bfloat16 or float16; give dtype bfloat16"
        )


def check_lora_args(adapter: Adapter | None, engine_kwargs: dict[str, Any]) -> None:
    """Refuse engine arguments that would serve other adapters: captures could not say which one ran."""
    if adapter is None:
        if engine_kwargs.get("enable_lora"):
            raise SpecError(
                "engine argument enable_lora: give the adapter as lora=DIR (Python) or -M lora=DIR (Inspect), "
                "which loads it at the boot and applies it to every request"
            )
        return
    for name in ("enable_lora", "max_loras", "max_lora_rank"):
        if name in engine_kwargs:
            raise SpecError(f"engine argument {name}: set by tl-vllm for the adapter given as lora; leave it out")
