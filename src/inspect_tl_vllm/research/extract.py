"""Contrastive activation addition: a steering vector from pairs of prompts.

Each line of a JSONL file is ``{"positive": ..., "negative": ...}`` where each side is a
string or a list of chat messages.  The vector at each hook point is the mean over pairs of
(activation of positive - activation of negative), each side reduced over its tokens
(``mean`` or ``last``), captured by the instrumented engine itself so that it lives in
exactly the space the engine steers.

Beside the vectors, ``save_vectors`` keeps each pair's two rows (``rows_path``: ``X.rows.safetensors``
next to ``X.safetensors``, one ``[2 x pairs, width]`` tensor per hook point, positive then negative
for each pair).  Sweeps draw their stronger control directions from them (``controls.py``): from
the rows' own covariance, and from the same pairs with their labels flipped at random.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inspect_tl_vllm.spec_files import parse_json
from inspect_tl_vllm.specs import SpecError
from inspect_tl_vllm.vectors.files import write_vector_file


def read_pairs(path: Path) -> list[tuple[Any, Any]]:
    if not path.is_file():
        raise SpecError(f"pairs file {path} not found")
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = parse_json(line, str(path), first_line=number)  # strict: a key given twice is refused
        if not isinstance(item, dict) or "positive" not in item or "negative" not in item:
            raise SpecError(f"{path}:{number}: each line needs 'positive' and 'negative' (strings or chat messages)")
        for side in ("positive", "negative"):
            value = item[side]
            if not (isinstance(value, str) and value.strip()) and not (isinstance(value, list) and value):
                raise SpecError(f"{path}:{number}: '{side}' must be a non-empty string or list of chat messages")
        pairs.append((item["positive"], item["negative"]))
    if not pairs:
        raise SpecError(f"{path}: no pairs")
    return pairs


def extract_vectors(
    engine: Any, pairs: list[tuple[Any, Any]], hooks: list[str], reduce: str = "mean"
) -> tuple[dict, dict]:
    """Mean difference per hook point (float32 tensors of the model's hidden size), and the rows
    it is the mean over: per hook point ``[2 x pairs, width]``, each pair's positive row then its
    negative row."""
    import torch

    if reduce not in ("mean", "last"):
        raise SpecError(f"reduce: {reduce!r}; use 'mean' or 'last'")
    prompts = [side for pair in pairs for side in pair]
    results = engine.generate(prompts, capture={"hooks": hooks, "reduce": reduce}, max_tokens=1, progress=True)
    vectors, rows = {}, {}
    for hook in hooks:
        rows[hook] = torch.stack([r.activations[hook][0].float() for r in results])
        vectors[hook] = (rows[hook][0::2] - rows[hook][1::2]).mean(dim=0)
    return vectors, rows


def rows_path(vector_file: Path) -> Path:
    """Where the rows behind the vectors of ``vector_file`` are kept."""
    return vector_file.with_name(f"{vector_file.stem}.rows.safetensors")


def save_vectors(vectors: dict, path: Path, *, model: str, count: int, reduce: str, rows: dict | None = None) -> None:
    metadata = {"model": model, "count": str(count), "reduce": reduce}
    write_vector_file(vectors, path, metadata)
    if rows is not None:
        from safetensors.torch import save_file

        save_file({hook: r.contiguous() for hook, r in rows.items()}, str(rows_path(path)), metadata=metadata)
