"""Short model names accepted wherever a model is named (``tl-vllm/<alias>``).

Anything not in the table is taken as a local directory or a Hugging Face id.  Both the Python
API (``construct``) and the Inspect provider resolve names here, so an unknown name gets the
same error, saying what was tried, from every front end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inspect_tl_vllm.specs import SpecError

ALIASES: dict[str, str] = {
    "smollm2": "SmolLM2-135M-Instruct, converted locally by `tl-vllm prepare-model smollm2`",
    "llama": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen": "Qwen/Qwen3-8B",
    "gemma": "google/gemma-3-4b-it",
    "mistral": "mistralai/Mistral-7B-Instruct-v0.3",
}


def resolve_model(name: str) -> str:
    """Alias -> path or hub id; clear errors for an unprepared ``smollm2``, a folder that is not a
    model, and a name that is none of alias, folder or hub id that can be had (cache or download).

    A hub id is checked by loading its config here, before any engine is built: the provider
    otherwise first fails in ``AutoTokenizer.from_pretrained`` with transformers' own error,
    which does not say that the name was also tried as an alias and a folder.
    """
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
        model_config(ALIASES[name], name)
        return ALIASES[name]
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json; is it a Hugging Face model folder?")
        return str(path.resolve())
    model_config(name, name)
    return name


def model_config(model: str, name: str) -> Any:
    """The transformers config of a resolved model (a folder or a hub id) that ``name`` named.

    An unknown hub id gets an error that lists what was tried: the aliases, a local folder, the
    Hugging Face cache and hub.
    """
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model)
    except (OSError, ValueError) as err:
        cause = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
        if Path(model).is_dir():
            raise SpecError(f"model folder {model}: cannot load its config.json ({cause})") from None
        if name in ALIASES:
            raise SpecError(
                f"model {name!r} is an alias of the Hugging Face id {model!r}, which is neither in the local "
                f"Hugging Face cache nor downloadable ({cause}); download it first (`hf download {model}`) "
                "or give a local model folder instead"
            ) from None
        raise SpecError(
            f"unknown model {name!r}: it is not an alias ({', '.join(ALIASES)}; `tl-vllm models` lists them), "
            f"not a local folder ({Path(name).expanduser().absolute()} does not exist), and not a Hugging Face "
            f"id in the local cache or on the hub ({cause}); give an alias, a folder holding config.json, or "
            "the id of a downloaded model"
        ) from None
