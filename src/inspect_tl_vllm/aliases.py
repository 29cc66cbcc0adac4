"""Short model names accepted wherever a model is named (``tl-vllm/<alias>``).

Anything not in the table is taken as a Hugging Face id or a local directory.
"""

from __future__ import annotations

from pathlib import Path

ALIASES: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct, converted locally by `tl-vllm prepare-model smollm2`",
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen": "Qwen/Qwen3-8B",
    "gemma": "google/gemma-3-4b-it",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
}


def resolve_model(name: str) -> str:
    """Alias -> path or hub id; ``smollm2`` must have been prepared (clear error otherwise)."""
    if name == "smollm2":
        from inspect_tl_vllm.model_prep import is_prepared, smollm2_dir

        path = smollm2_dir()
        if not is_prepared(path):
            raise FileNotFoundError(
                f"model 'smollm2' is not prepared at {path}; run `tl-vllm prepare-model smollm2` "
                "(or scripts/setup.sh) first"
            )
        return str(path)
    if name in ALIASES:
        return ALIASES[name]
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json; is it a Hugging Face model folder?")
        return str(path.resolve())
    return name
