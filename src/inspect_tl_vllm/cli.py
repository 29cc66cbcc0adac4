"""``tl-vllm``: model preparation, aliases, vector extraction and import, sweeps, reports, activations, demo,
self-check."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

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
    from inspect_tl_vllm.research.demo import run

    if args.save_vector:  # demo.run writes it without making its folder
        Path(args.save_vector).parent.mkdir(parents=True, exist_ok=True)
    run(args.model, coef=args.coef, max_tokens=args.max_tokens, out_dir=args.out, save_vector=args.save_vector)
    return 0


def _extract_vector(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.engine.offline import boot
    from inspect_tl_vllm.research.extract import extract_vectors, read_pairs, rows_path, save_vectors
    from inspect_tl_vllm.specs import SpecError

    try:
        pairs = read_pairs(Path(args.pairs))
        print(f"extract-vector: {len(pairs)} pairs from {args.pairs}; booting {args.model}", flush=True)
        engine = boot(args.model, instrument={"hook_points": args.hook}, dtype=args.dtype)
        vectors, rows = extract_vectors(engine, pairs, args.hook, args.reduce)
        save_vectors(vectors, Path(args.out), model=args.model, count=len(pairs), reduce=args.reduce, rows=rows)
    except SpecError as err:
        print(f"extract-vector: {err}", file=sys.stderr)
        return 2
    for hook, vector in vectors.items():
        print(f"extract-vector: {hook} norm {float(vector.norm()):.3f}")
    print(f"extract-vector: saved {len(vectors)} vectors to {args.out} (use 'path:hook' to pick one)")
    rows_file = rows_path(Path(args.out))
    print(f"extract-vector: saved the pairs' rows to {rows_file} (for sweeps' covariance and relabel controls)")
    return 0


def _import_vector(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.specs import SpecError
    from inspect_tl_vllm.vectors.importers import import_vector_file

    try:
        imported = import_vector_file(args.src, Path(args.out), hook=args.hook, model=args.model)
    except SpecError as err:
        print(f"import-vector: {err}", file=sys.stderr)
        return 2
    for hook, vector in imported.vectors.items():
        print(f"import-vector: {hook} width {vector.numel()} norm {float(vector.norm()):.3f}")
    hint = imported.metadata.get("model_hint")
    source = imported.metadata["format"] + (f", model hint {hint!r}" if hint else "")
    count = len(imported.vectors)
    print(f"import-vector: wrote {count} vector{'s' if count > 1 else ''} ({source}) to {args.out}")
    print(f"import-vector: steer with vector: {args.out}:{next(iter(imported.vectors))}")
    return 0


def _key_values(items: list[str]) -> dict[str, object]:
    """KEY=VALUE pairs with YAML values (as Inspect's -M and -T): true, 3, 0.5 or text. Read strictly
    (``spec_files.parse_value``): 010, on or 1:30 are refused rather than read as 8, true or 90, and a
    key given twice is refused rather than the last one winning."""
    from inspect_tl_vllm.spec_files import parse_value
    from inspect_tl_vllm.specs import SpecError

    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        if key in pairs:
            raise SystemExit(f"{key} is given twice ({key}={pairs[key]!r} and {item}); give it once")
        try:
            pairs[key] = parse_value(value, item)
        except SpecError as err:
            raise SystemExit(str(err)) from None
    return pairs


def _sweep(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.research.sweep import run_sweep, sweep_points

    if not 0 <= args.controls <= 1000:
        print(f"sweep: --controls {args.controls} is out of range; give 0 to 1000 directions", file=sys.stderr)
        return 2
    model_args = _key_values(args.M)
    points = sweep_points(
        [float(c) for c in args.coef.split(",")], [int(x) for x in args.layer.split(",")], args.controls,
        args.control_kind, args.controls_in_one_eval,
    )  # fmt: skip
    shared = _key_values(args.T)
    points = [{**shared, **point} for point in points]
    failed = run_sweep(
        args.task, points, model=args.model, model_args=model_args, log_dir=args.log_dir, limit=args.limit
    )
    if failed:
        print(
            f"sweep: {failed} of {len(points)} points failed (above); the same command again runs only the points "
            "that have no successful log; the report lists the failed ones",
            file=sys.stderr,
        )
        return 1
    print(f"sweep: done; run `tl-vllm report {args.log_dir}`")
    return 0


def _report(args: argparse.Namespace) -> int:
    from inspect_tl_vllm.research.sweep import report

    table, png = report(args.log_dir)
    print(table)
    print(f"report: plot {png}; table {png.with_suffix('.md')}")
    return 0


def output_problem(path: Path, is_dir: bool) -> str | None:
    """Why ``path`` cannot be written as an output file (or folder), or None if it can.

    Checked before the command does any work: extract-vector and demo boot an engine first, so a
    write that fails at the end would cost minutes and end in a raw traceback.
    """
    if path.exists():
        if path.is_dir() != is_dir:
            wanted = "folder" if is_dir else "file"
            return f"is an existing {'file' if is_dir else 'folder'}; give the path of a {wanted}"
        return None
    for parent in path.parents:
        if parent.is_dir():
            return None if os.access(parent, os.W_OK) else f"cannot be created: {parent} is not writable"
        if parent.exists():
            return f"cannot be created: {parent} is a file, not a folder; choose another path"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["activations"]:  # its own parser: list or export a log's activations
        from inspect_tl_vllm.store.activations import main as activations_main

        return activations_main(argv[1:])
    parser = argparse.ArgumentParser(prog="tl-vllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare-model", help="convert the default model (SmolLM2) from its PyPI GGUF")
    prep.add_argument("name", choices=["smollm2"])
    prep.add_argument("--force", action="store_true", help="convert again even if prepared")
    prep.set_defaults(func=_prepare_model)
    models = sub.add_parser("models", help="list model aliases accepted by tl-vllm/<model>")
    models.set_defaults(func=_models)
    extract = sub.add_parser("extract-vector", help="steering vector from contrastive prompt pairs (JSONL)")
    extract.add_argument("pairs", help='JSONL file, one {"positive": ..., "negative": ...} per line')
    extract.add_argument("--model", default="smollm2")
    extract.add_argument("--hook", action="append", required=True, help="hook point (repeatable)")
    extract.add_argument("--reduce", default="mean", choices=["mean", "last"])
    extract.add_argument("--dtype", default="auto", help="engine dtype (vLLM's 'auto' runs fp32 models in bf16)")
    extract.add_argument("--out", required=True, help="output .safetensors (one tensor per hook point)")
    extract.set_defaults(func=_extract_vector, outputs={"out": False})
    imp = sub.add_parser("import-vector", help="convert a .npy/.pt/.safetensors vector or a GGUF control vector")
    imp.add_argument("src", help="vector file (FILE or FILE:KEY); a .gguf control vector gives every layer")
    imp.add_argument("--out", required=True, help="output .safetensors, one tensor per hook point")
    imp.add_argument("--hook", default=None, help="hook point of a single vector, e.g. blocks.12.hook_resid_post")
    imp.add_argument("--model", default=None, help="model the vector is for (recorded in the metadata)")
    imp.set_defaults(func=_import_vector, outputs={"out": False})
    sweep = sub.add_parser("sweep", help="one eval per coefficient/layer/control point, one shared engine")
    sweep.add_argument("task", help="task reference, e.g. evals/steering_demo.py@steering_sweep")
    sweep.add_argument("--model", default="tl-vllm/smollm2")
    sweep.add_argument("--coef", default="0,0.5,1,2", help="comma-separated coefficients")
    sweep.add_argument("--layer", default="12", help="comma-separated layers")
    sweep.add_argument(
        "--controls",
        type=int,
        default=2,
        help="random directions of the vector's norm, drawn anew at each nonzero coefficient (19 let p reach 0.05)",
    )
    sweep.add_argument(
        "--control-kind",
        choices=("gauss", "covariance", "relabel"),
        default="gauss",
        help="uniformly random directions; from the covariance of the rows the vector was extracted from; or the "
        "vector re-extracted from its pairs with labels flipped at random (the last two read the rows "
        "extract-vector saves; the task gets control_kind)",
    )
    sweep.add_argument(
        "--controls-in-one-eval",
        action="store_true",
        help="run a coefficient's control directions in one eval (task argument control_seeds), each question "
        "once per direction in one continuous batch: many controls (99) at the cost of a large batch",
    )
    sweep.add_argument("--limit", type=int, default=None, help="samples per point")
    sweep.add_argument("-M", action="append", default=[], help="model arg KEY=VALUE (repeatable)")
    sweep.add_argument("-T", action="append", default=[], help="task arg KEY=VALUE for every point (repeatable)")
    sweep.add_argument("--log-dir", default="logs/sweep")
    sweep.set_defaults(func=_sweep, outputs={"log_dir": True})
    rep = sub.add_parser("report", help="table and PNG of score against coefficient from a sweep's logs")
    rep.add_argument("log_dir")
    rep.set_defaults(func=_report)
    sub.add_parser("activations", help="list or export (--export FILE.npz|FILE.parquet) an eval log's activations")
    demo = sub.add_parser("demo", help="steered, captured generation on the default model")
    demo.add_argument("--model", default="smollm2")
    demo.add_argument("--coef", type=float, default=1.0)
    demo.add_argument("--max-tokens", type=int, default=40)
    demo.add_argument("--out", default="logs", help="directory for the captured activations")
    demo.add_argument("--save-vector", default=None, help="also save the extracted steering vector here")
    demo.set_defaults(func=_demo, outputs={"out": True, "save_vector": False})
    from inspect_tl_vllm import verify  # light: torch and vLLM are imported when it runs

    check = sub.add_parser("verify", help="self-check: hooks fire, steering, isolation, fidelity against transformers")
    verify.add_arguments(check)
    check.set_defaults(func=verify.run)
    args = parser.parse_args(argv)
    for dest, is_dir in getattr(args, "outputs", {}).items():  # {argument: whether it names a folder}
        value = getattr(args, dest)
        problem = value and output_problem(Path(value), is_dir)
        if problem:
            print(f"{args.command}: --{dest.replace('_', '-')} {value}: {problem}", file=sys.stderr)
            return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
