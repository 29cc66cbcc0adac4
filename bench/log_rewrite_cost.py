"""What adding the run record costs at an eval's end: the whole log rewritten, or its header alone.

    python bench/log_rewrite_cost.py LOG [--samples 4000] [--out F]

At a task's end the provider adds its run record to the eval log's metadata
(``provider/run_record.py``).  Rewriting the whole log to do so costs time in proportion to the
samples it holds; a local ``.eval`` log instead gets its header entry swapped.  This takes a real
eval log (``LOG``: one written by ``tl-vllm``, whose samples carry capture summaries), copies its
samples until the log holds ``--samples`` of them, writes that log twice, and times the same
metadata edit both ways: read, edit, write the whole log, against read the header, edit, write the
header only.  Both copies are then read back to check that every sample is still there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from inspect_ai.log import MetadataEdit, ProvenanceData, edit_eval_log, read_eval_log, write_eval_log


def grown_log(source: str, samples: int, target: Path) -> None:
    """``source``'s log with its samples copied (new ids) until it holds ``samples``."""
    log = read_eval_log(source)
    if not log.samples:
        raise SystemExit(f"log_rewrite_cost: {source} holds no samples to copy")
    copies = [
        log.samples[i % len(log.samples)].model_copy(update={"id": i, "uuid": f"copy-{i}"}) for i in range(samples)
    ]
    write_eval_log(log.model_copy(update={"samples": copies}), str(target))


def timed_edit(location: Path, header_only: bool) -> float:
    started = time.perf_counter()
    log = read_eval_log(str(location), header_only=header_only)
    edit = MetadataEdit(metadata_set={"log_rewrite_cost": True})
    edited = edit_eval_log(log, [edit], ProvenanceData(author="log_rewrite_cost", reason="timing"))
    write_eval_log(edited, str(location), header_only=header_only)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", help="an .eval log whose samples are copied")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--out", default=None, help="write the result as JSON here too")
    args = parser.parse_args()
    if not args.log.endswith(".eval") or args.samples < 1:
        raise SystemExit("log_rewrite_cost: give an .eval log and --samples of at least 1")
    with tempfile.TemporaryDirectory() as folder:
        whole, header = Path(folder) / "whole.eval", Path(folder) / "header.eval"
        grown_log(args.log, args.samples, whole)
        shutil.copyfile(whole, header)
        result = {
            "samples": args.samples,
            "log_mb": round(whole.stat().st_size / 1e6, 1),
            "whole_log_s": round(timed_edit(whole, header_only=False), 3),
            "header_only_s": round(timed_edit(header, header_only=True), 3),
        }
        for copy in (whole, header):
            log = read_eval_log(str(copy))
            if len(log.samples or []) != args.samples or not log.metadata.get("log_rewrite_cost"):
                raise SystemExit(f"log_rewrite_cost: {copy.name} lost samples or the edit")
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
