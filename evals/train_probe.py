"""Train a linear probe on activations logged during an eval, against the eval's own scores.

    python evals/train_probe.py LOG.eval --hook blocks.12.hook_resid_post --out probe.safetensors

Features: each sample's stored activations at ``--hook`` (mean over rows); labels: the first
score of the sample (1 = correct).  Use the probe in a later eval with
``inspect_tl_vllm.research.probes.probe_scorer("probe.safetensors")`` next to a capture of that hook.
"""

from __future__ import annotations

import argparse

import torch

from inspect_tl_vllm import activations
from inspect_tl_vllm.research.probes import save_probe, train_probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--hook", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--l2", type=float, default=1e-2, help="weight decay on the standardised weights")
    args = parser.parse_args()
    records = [r for r in activations.load(args.log) if args.hook in r.activations and r.scores]
    features = torch.stack([r.activations[args.hook].float().mean(0) for r in records])
    labels = torch.tensor([float(next(iter(r.scores.values())) in (1, 1.0, "C")) for r in records])
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(0))
    held = order[: len(order) // 4]
    train = order[len(order) // 4 :]
    weight, bias = train_probe(features[train], labels[train], l2=args.l2)

    def accuracy(idx: torch.Tensor) -> float:
        return float(((features[idx] @ weight + bias > 0).float() == labels[idx]).float().mean())

    majority = max(float(labels[held].mean()), 1 - float(labels[held].mean()))
    print(f"probe: {len(records)} samples, {int(labels.sum())} correct; trained on {len(train)}")
    print(
        f"probe: accuracy train {accuracy(train):.3f}, held-out {accuracy(held):.3f} "
        f"(majority baseline {majority:.3f} on {len(held)} held-out samples)"
    )
    weight, bias = train_probe(features, labels, l2=args.l2)  # the saved probe uses every sample
    save_probe(args.out, weight, bias, args.hook)
    print(f"probe: saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
