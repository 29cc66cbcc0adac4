"""Train a linear probe on activations logged during an eval, against the eval's own scores.

    python evals/train_probe.py LOG.eval --hook blocks.12.hook_resid_post --out probe.safetensors

Features: each sample's stored activations at ``--hook`` (mean over rows); labels: the first
score of the sample (1 = correct).  Use the probe in a later eval with
``inspect_tl_vllm.probes.probe_scorer("probe.safetensors")`` next to a capture of that hook.
"""

from __future__ import annotations

import argparse

import torch

from inspect_tl_vllm import activations
from inspect_tl_vllm.probes import save_probe, train_probe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log")
    parser.add_argument("--hook", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = [r for r in activations.load(args.log) if args.hook in r.activations and r.scores]
    features = torch.stack([r.activations[args.hook].float().mean(0) for r in records])
    labels = torch.tensor([float(next(iter(r.scores.values())) in (1, 1.0, "C")) for r in records])
    weight, bias = train_probe(features, labels)
    accuracy = float(((features @ weight + bias > 0).float() == labels).float().mean())
    save_probe(args.out, weight, bias, args.hook)
    print(f"probe: {len(records)} samples, {int(labels.sum())} positive, training accuracy {accuracy:.3f}")
    print(f"probe: saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
