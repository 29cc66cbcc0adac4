"""SAEs made and saved by ``sae-lens`` itself (the ``sae-reference`` extra), with random weights."""

from __future__ import annotations

import torch

HOOK = "blocks.1.hook_resid_post"
WIDTH = 64  # the tiny model's hidden size (conftest.TINY)


def saved_sae(folder, architecture: str, d_in: int = WIDTH, d_sae: int = 256, hook: str = HOOK, seed: int = 0):
    """An SAE of ``architecture`` with random weights, made and saved by sae-lens; returns it."""
    from sae_lens import SAE, JumpReLUSAEConfig, StandardSAEConfig, TopKSAEConfig

    configs = {"standard": StandardSAEConfig, "jumprelu": JumpReLUSAEConfig, "topk": TopKSAEConfig}
    extra = {"k": 8, "rescale_acts_by_decoder_norm": True} if architecture == "topk" else {}
    config = configs[architecture](d_in=d_in, d_sae=d_sae, **extra).to_dict()
    config["metadata"]["hook_name"] = hook
    sae = SAE.from_dict(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sae.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
            if name == "threshold":
                parameter.abs_()
    sae.save_model(folder)
    return sae
