"""Write the demonstration SAE that ``evals/sae_features.py`` and docs/RESEARCH.md use.

    python evals/saes/make_demo_sae.py      # writes evals/saes/smollm2_l12_demo/

A 64-feature ReLU SAE in SAELens' on-disk format for SmolLM2's ``blocks.12.hook_resid_post``,
*not trained*: feature 0 writes the shipped ocean steering vector (its decoder row) and reads the
stream's projection onto it, in units of that vector (its encoder column is v / |v|^2); features
1..63 do the same for fixed random directions of the same norm.  It stands in for a trained SAE
(Gemma Scope, Llama Scope, SAELens releases), which needs the Hugging Face hub, so that the
example runs anywhere.  Deterministic: the same file comes out every time.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
HOOK = "blocks.12.hook_resid_post"
FEATURES = 64


def main() -> None:
    ocean = load_file(str(HERE.parent / "vectors" / "smollm2_ocean_l12.safetensors"))["vector"].float()
    generator = torch.Generator().manual_seed(0)
    others = torch.randn(FEATURES - 1, ocean.numel(), generator=generator)
    decoder = torch.cat([ocean[None], others / others.norm(dim=1, keepdim=True) * ocean.norm()])
    encoder = (decoder / decoder.norm(dim=1, keepdim=True) ** 2).T.contiguous()
    folder = HERE / "smollm2_l12_demo"
    folder.mkdir(exist_ok=True)
    weights = {
        "W_enc": encoder,
        "b_enc": torch.zeros(FEATURES),
        "W_dec": decoder.contiguous(),
        "b_dec": torch.zeros(ocean.numel()),
    }
    save_file(weights, str(folder / "sae_weights.safetensors"))
    config = {
        "architecture": "standard",
        "d_in": ocean.numel(),
        "d_sae": FEATURES,
        "apply_b_dec_to_input": False,
        "normalize_activations": "none",
        "dtype": "float32",
        "device": "cpu",
        "metadata": {"hook_name": HOOK, "model_name": "SmolLM2-135M-Instruct", "note": "demonstration, not trained"},
    }
    (folder / "cfg.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"make_demo_sae: wrote {folder} ({FEATURES} features at {HOOK})")


if __name__ == "__main__":
    main()
