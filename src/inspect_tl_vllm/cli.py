"""``tl-vllm``: command-line entry point (model preparation, aliases, demo generation)."""

from __future__ import annotations

import argparse
import sys

from inspect_tl_vllm.aliases import ALIASES


def _prepare_model(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.model_prep import ModelPrepError, is_prepared, prepare_smollm2, smollm2_dir

    if args.name != "smollm2":
        print(f"prepare-model: only 'smollm2' can be prepared offline; got {args.name!r}", file=sys.stderr)
        return 2
    if not args.force and is_prepared(smollm2_dir()):
        print(f"prepare-model: smollm2 ready at {smollm2_dir()}")
        return 0
    try:
        prepare_smollm2(force=args.force)
    except ModelPrepError as err:
        print(f"prepare-model: {err}", file=sys.stderr)
        return 1
    return 0


def _models(_: argparse.Namespace) -> int:
    width = max(len(k) for k in ALIASES)
    for alias, target in ALIASES.items():
        print(f"{alias:<{width}}  {target}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.demo import run

    run(args.model, coef=args.coef, max_tokens=args.max_tokens, out_dir=args.out, save_vector=args.save_vector)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tl-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare-model", help="convert the default model (SmolLM2) from its PyPI GGUF")
    prep.add_argument("name", choices=["smollm2"])
    prep.add_argument("--force", action="store_true", help="convert again even if prepared")
    prep.set_defaults(func=_prepare_model)
    models = sub.add_parser("models", help="list model aliases accepted by tl-vllm/<model>")
    models.set_defaults(func=_models)
    demo = sub.add_parser("demo", help="steered, captured generation on the default model")
    demo.add_argument("--model", default="smollm2")
    demo.add_argument("--coef", type=float, default=1.0)
    demo.add_argument("--max-tokens", type=int, default=40)
    demo.add_argument("--out", default="logs", help="directory for the captured activations")
    demo.add_argument("--save-vector", default=None, help="also save the extracted steering vector here")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
