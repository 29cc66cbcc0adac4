"""Does writing captures out early slow the engine's step loop?  (CPU only)

    python bench/diagnostics/writer_gil.py --requests 64 --writers 1 --rounds 5

While capturing requests decode, the worker's writer threads write each request's prompt
rows to the hand-off folder (``engine/packing.py``).  Each torch call and each write a writer
makes releases the GIL and takes it back, and every time it takes it back the step loop,
which releases the GIL at each of its own torch calls, may have to wait; the writes' memory
traffic may also slow the loop's own work.

This script runs a stand-in for the step loop (small torch ops and some Python, as vLLM's
host work per step is) on the main thread, and measures its steps per second alone and
while ``--writers`` threads write ``--requests`` requests of 33 hook points x 54 prompt rows
x 4,096 bf16 numbers to /dev/shm.  Same bytes, same threads; what differs is how often the
writers give up and take back the GIL: ``write_tensors`` (the project's writer,
``engine/handoff.py``) against ``writev_prepared`` (no torch call in the writer, one
``writev`` per file: the same I/O with the least GIL traffic).  The main thread's CPU time
per step is recorded too: wall time above it is time spent waiting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from inspect_tl_vllm.engine.handoff import header_bytes, write_tensors

HOOKS, ROWS, WIDTH = 33, 54, 4096


def step_loop(stop: threading.Event, steps: list[tuple[float, float]]) -> None:
    """A host step: 200 small torch ops with Python between them; records each step's wall
    and CPU seconds."""
    small = torch.zeros(256)
    index = torch.arange(256)
    bookkeeping = list(range(256))
    while not stop.is_set():
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(100):
            small.add_(1.0)
            small.index_select(0, index)
        bookkeeping = [x + 1 for x in bookkeeping]
        steps.append((time.perf_counter() - wall, time.thread_time() - cpu))


def requests(count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` requests' rows: views into one block per hook, as the worker keeps them."""
    blocks = [torch.randn(count * ROWS, WIDTH).to(torch.bfloat16) for _ in range(HOOKS)]
    return [
        {f"blocks.{h}.hook_resid_post": blocks[h][i * ROWS : (i + 1) * ROWS] for h in range(HOOKS)}
        for i in range(count)
    ]


def write_prepared(folder: Path, uid: str, arrays: dict[str, Any]) -> None:
    """No torch call at all: numpy views made beforehand, header and rows in one ``writev``."""
    header, offset = {}, 0
    for name, array in arrays.items():
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    fd = os.open(folder / f"{uid}.safetensors", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.writev(fd, [header_bytes(header), *arrays.values()])
    finally:
        os.close(fd)


WRITERS = {
    "write_tensors": lambda folder, uid, tensors: write_tensors(folder, uid, tensors),  # the project's writer
    "writev_prepared": write_prepared,
}


def measure(mode: str, writers: int, batch: list[Any], folder: Path, seconds_alone: float) -> dict[str, Any]:
    """Step-loop speed alone for ``seconds_alone``, then while the writers write ``batch``."""
    stop, steps = threading.Event(), []
    loop = threading.Thread(target=step_loop, args=(stop, steps))
    loop.start()
    time.sleep(seconds_alone)
    alone = list(steps)
    steps.clear()
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=writers) as pool:
        for _ in pool.map(lambda item: WRITERS[mode](folder, f"r{item[0]}", item[1]), enumerate(batch)):
            pass
    writing_s = time.perf_counter() - started
    during = list(steps)
    stop.set()
    loop.join()
    for file in folder.glob("*.safetensors"):
        file.unlink()
    return {
        "mode": mode,
        "writing_s": round(writing_s, 3),
        "steps_per_s_alone": round(len(alone) / seconds_alone, 1),
        "steps_per_s_while_writing": round(len(during) / writing_s, 1),
        "step_ms_alone": _mean_ms(alone),
        "step_ms_while_writing": _mean_ms(during),
    }


def _mean_ms(steps: list[tuple[float, float]]) -> dict[str, float]:
    """Mean wall and CPU milliseconds per step (means: the waits are rare and long)."""
    return {
        "wall": round(statistics.fmean(w for w, _ in steps) * 1e3, 3),
        "cpu": round(statistics.fmean(c for _, c in steps) * 1e3, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batch = requests(args.requests)
    gigabytes = args.requests * HOOKS * ROWS * WIDTH * 2 / 1e9
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    results = []
    with tempfile.TemporaryDirectory(dir=base) as folder:
        prepared = [{name: t.view(torch.int16).numpy() for name, t in request.items()} for request in batch]
        for round_index in range(args.rounds):
            for mode in WRITERS:
                result = measure(
                    mode, args.writers, prepared if mode == "writev_prepared" else batch, Path(folder), 1.0
                )
                results.append(result)
                print(f"[writer_gil] round {round_index + 1}: {json.dumps(result)}", flush=True)
    summary = {"requests": args.requests, "writers": args.writers, "gigabytes": round(gigabytes, 2), "rounds": results}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
