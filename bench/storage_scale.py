"""The local activation layouts at scale: write, read one, read all (CPU).

    python bench/storage_scale.py [--samples 100000] [--hooks 2] [--width 576] [--rows 1] [--dtype float32]
                                  [--shard-mb N] [--dir DIR] [--keep] [--eval-file] [--no-evict] [--out F]

What one safetensors file per sample and epoch plus one ``index.jsonl`` (the default), or shards of
about N MiB with an index per shard (``--shard-mb N``), cost when an eval has 10^4 to 10^5
samples. It writes N synthetic samples (ids ``s000001``..., epoch 1; by default a pooled capture of
two hook points at SmolLM2's width) through exactly the calls the provider makes for a sample
(``activations_dir_for``, ``Folder.check_writable`` once, ``write_sample``, ``record_dir``; see
``provider/model_api.py`` ``_record``), then measures:

- **write**: wall time, rate, latency percentiles per sample and the rate per tenth of the run (does
  a write slow down as the folder fills?), peak RSS;
- **disk**: files (inodes), apparent bytes, allocated bytes (``st_blocks``), the index's size, the
  folder entry's own size;
- **read one** sample by id, in a fresh process (the way a user or a scorer starts): through the index
  as every reader does (``read_index`` parses the whole index, then ``read_sample`` reads and verifies
  one file), and, as a lower bound, by the file name derived from the id (``sample_file_name``, no
  checksum, since the checksum lives only in the index). Cold (page cache of those files evicted)
  and warm. Times: the process's wall time as the parent sees it (interpreter and ``import torch``
  included), and inside it imports, index parse, file read, total;
- **read all**, each in a fresh process with its own peak RSS: the storage layer's reader
  (``read_index`` + ``read_sample`` per entry, streaming, a sum of norms) cold and warm; and
  ``activations.load`` joined with an Inspect ``EvalLog`` of N samples with a score each, built in
  memory as the tests build logs (``tests/conftest.py`` ``eval_spec``), then a loop over every
  tensor. ``load`` accepts an ``EvalLog`` and otherwise only adds ``read_eval_log``, which is
  Inspect's cost; ``--eval-file`` also writes that log as a ``.eval`` file and times
  ``write_eval_log`` and ``read_eval_log``. Use it up to ~10^4 samples only: on 2 cores (inspect-ai
  0.3.285) ``write_eval_log`` took 26-35 s for 10^4 samples, ~88 s for 2*10^4 and had not finished
  after 22 minutes for 10^5 (it grows faster than linearly).

"Cold" evicts the files from the page cache with ``os.sync()`` and ``posix_fadvise(DONTNEED)`` per
file (no root needed). Dentries and inodes stay cached, and a VM's host may cache the disk too, so
cold here means "not in this kernel's page cache", not "from a spinning disk". Each phase runs in
its own process so that its peak RSS (``VmHWM``) is its own. The tensors are random; their content
does not matter to a layout that neither compresses nor deduplicates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # before the heavy imports: read-one counts them in its "start to tensor in hand"

EVAL_ID = "bench-storage-scale"
LOG_NAME = "bench.eval"
"""The log's name in the work folder: the activations folder is its default sibling ``bench.activations``."""
POOLED_TOKENS = 64
"""Token rows a pooled (``--rows 1``) capture stands for, as the provider records in ``tokens``."""
HOOK_LAYERS = (6, 12, 18, 24, 29, 3, 9, 15, 21, 27)
"""Layers the synthetic hook points sit at (SmolLM2-135M has 30); only their names reach the disk."""


def hooks(count: int) -> list[str]:
    """Hook point names of the synthetic capture; past the table, further layers."""
    layers = list(HOOK_LAYERS[:count]) + list(range(30, 30 + max(0, count - len(HOOK_LAYERS))))
    return [f"blocks.{layer}.hook_resid_post" for layer in layers]


def sample_id(index: int) -> str:
    """The id of the ``index``-th sample (1-based), ``s000001``...: sortable, plain."""
    return f"s{index:06d}"


def sample_uuid(index: int) -> str:
    """A 22-character uuid like the ones Inspect gives samples (shortuuid), deterministic here."""
    return f"u{index:021d}"


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``), falling back to ``getrusage`` where /proc lacks it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set now (``VmRSS``): taken after the imports, it tells the interpreter's
    and torch's share of the peak apart from the data's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def folders(root: Path) -> tuple[str, Path]:
    """The log location and the activations folder the provider would use for it (its default)."""
    from inspect_tl_vllm.store.sample_store import activations_dir_for

    location = str(root / LOG_NAME)
    return location, activations_dir_for(location, EVAL_ID, None).path


def write_as_provider(
    location: str,
    eval_id: str,
    index: int,
    tensors: dict[str, Any],
    tokens: dict[str, int],
    positions: dict[str, list[int]] | None,
    extra: dict[str, Any],
    writable: set[Any],
    shard_mb: int | None = None,
) -> dict[str, Any]:
    """Store the ``index``-th sample with the calls the provider's ``_record`` makes for one sample
    (``activations_dir_for``, ``Folder.check_writable`` once per folder, ``write_sample`` into a
    shard when ``shard_mb`` is set, ``record_dir``); returns its index entry. With shards, the
    caller finishes them with ``close_writer`` as the provider's task-end hook does."""
    from inspect_tl_vllm.store.sample_store import activations_dir_for, record_dir, write_sample
    from inspect_tl_vllm.store.shards import writer_for

    directory = activations_dir_for(location, eval_id, None)
    if directory not in writable:
        directory.check_writable()
        writable.add(directory)
    entry = write_sample(
        directory,
        eval_id=eval_id,
        sample_id=sample_id(index),
        epoch=1,
        sample_uuid=sample_uuid(index),
        activations=tensors,
        tokens=tokens,
        positions=positions,
        extra=extra,
        shards=writer_for(directory, shard_mb) if shard_mb else None,
    )
    record_dir(directory, location)
    return entry


# --------------------------------------------------------------------------- phases (each in its own process)


def phase_write(args: argparse.Namespace) -> dict[str, Any]:
    """Write N samples with the provider's calls; per-write latencies kept in one array (8 bytes each)."""
    from array import array

    import torch

    rss_after_imports = rss_bytes()
    location, _ = folders(Path(args.dir))
    names = hooks(args.hooks)
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator().manual_seed(args.seed)
    pooled = args.rows == 1
    tokens = {hook: POOLED_TOKENS if pooled else args.rows for hook in names}
    positions = None if pooled else {hook: list(range(args.rows)) for hook in names}
    extra = {"model": "tl-vllm/smollm2-shape", "reduce": "mean" if pooled else "none"}
    latencies = array("d")
    writable: set[object] = set()
    started = time.perf_counter()
    for index in range(1, args.samples + 1):
        tensors = {hook: torch.randn(args.rows, args.width, generator=generator).to(dtype) for hook in names}
        begun = time.perf_counter()
        entry = write_as_provider(location, EVAL_ID, index, tensors, tokens, positions, extra, writable, args.shard_mb)
        latencies.append(time.perf_counter() - begun)
        if args.progress and index % max(1, args.samples // 10) == 0:
            print(f"  wrote {index}/{args.samples} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    if args.shard_mb:
        from inspect_tl_vllm.store.sample_store import activations_dir_for
        from inspect_tl_vllm.store.shards import close_writer

        close_writer(activations_dir_for(location, EVAL_ID, None))
    wall = time.perf_counter() - started
    ordered = sorted(latencies)
    tenth = max(1, len(latencies) // 10)
    per_tenth = [len(latencies[i : i + tenth]) / sum(latencies[i : i + tenth]) for i in range(0, len(latencies), tenth)]
    return {
        "samples": args.samples,
        "wall_s": wall,
        "write_calls_s": sum(latencies),
        "rate_per_s": args.samples / wall,
        "write_calls_rate_per_s": args.samples / sum(latencies),
        "latency_ms": {
            "p50": 1e3 * ordered[len(ordered) // 2],
            "p90": 1e3 * ordered[int(len(ordered) * 0.9)],
            "p99": 1e3 * ordered[int(len(ordered) * 0.99)],
            "max": 1e3 * ordered[-1],
        },
        "rate_per_tenth_per_s": per_tenth,
        "last_entry_file": entry["file"],
        "rss_after_imports_bytes": rss_after_imports,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def phase_read_one(args: argparse.Namespace) -> dict[str, Any]:
    """One sample by id, the way a fresh process gets it: through the index, or by its derived file name."""
    import torch

    from inspect_tl_vllm.store.sample_store import read_index, read_sample, sample_file_name

    imported = time.perf_counter()
    _, directory = folders(Path(args.dir))
    out: dict[str, Any] = {"sample_id": args.read_one, "via": args.via, "import_s": imported - STARTED}
    if args.via == "index":
        entries = read_index(directory)  # the whole index: readers keep the last line per (sample id, epoch)
        parsed = time.perf_counter()
        entry = next(e for e in entries if e["sample_id"] == args.read_one and e["epoch"] == 1)
        found = time.perf_counter()
        tensors = read_sample(directory, entry, verify=True)
        out.update(index_entries=len(entries), index_parse_s=parsed - imported, index_find_s=found - parsed)
    elif args.via == "log":  # activations.read: the sample's record in the .eval log, then its file
        import inspect_ai.log  # noqa: F401  (Inspect's import is its own cost, timed apart)

        from inspect_tl_vllm import activations

        found = time.perf_counter()
        out["inspect_import_s"] = found - imported
        location, _ = folders(Path(args.dir))
        tensors = activations.read(location, args.read_one, 1).activations
    else:
        from safetensors.torch import load

        found = time.perf_counter()
        tensors = load((directory / sample_file_name(args.read_one, 1)).read_bytes())  # no checksum: it is in the index
    done = time.perf_counter()
    out.update(
        read_file_s=done - found,
        after_imports_s=done - imported,
        start_to_tensor_s=done - STARTED,
        norm=float(sum(torch.linalg.vector_norm(t.float()) for t in tensors.values())),
        peak_rss_bytes=peak_rss_bytes(),
    )
    return out


def phase_read_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every tensor through the storage layer's reader, streaming: only one sample's tensors live at a time."""
    import torch

    from inspect_tl_vllm.store.sample_store import SampleReader, read_index, read_sample

    rss_after_imports = rss_bytes()
    _, directory = folders(Path(args.dir))
    started = time.perf_counter()
    entries = read_index(directory)
    parsed = time.perf_counter()
    total, count = 0.0, 0
    with SampleReader(directory) as reader:  # as activations.iter_load reads
        for entry in entries:
            for tensor in read_sample(directory, entry, verify=True, reader=reader).values():
                total += float(torch.linalg.vector_norm(tensor.float()))
                count += 1
    done = time.perf_counter()
    return {
        "samples": len(entries),
        "tensors": count,
        "norm_sum": total,
        "index_parse_s": parsed - started,
        "read_s": done - parsed,
        "wall_s": done - started,
        "rate_per_s": len(entries) / (done - started),
        "rss_after_imports_bytes": rss_after_imports,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def eval_log(args: argparse.Namespace, location: str) -> Any:
    """An Inspect ``EvalLog`` of the N samples, each with one score, built without running an eval (as the
    tests build theirs: ``tests/conftest.py`` ``eval_spec``)."""
    from inspect_ai.log import EvalConfig, EvalDataset, EvalLog, EvalSample, EvalSpec
    from inspect_ai.model import ModelOutput
    from inspect_ai.scorer import Score

    from inspect_tl_vllm.store.sample_store import STORED_KEYS, read_index

    _, directory = folders(Path(args.dir))
    stored = {entry["sample_id"]: entry for entry in read_index(directory)}

    def output(index: int) -> ModelOutput:
        """What the provider's output records of a stored sample, which ``activations.read`` follows."""
        entry = stored[sample_id(index)]
        found = {key: entry[key] for key in STORED_KEYS if key in entry}
        record = {"hooks": entry["hooks"], "dir": directory.name, **found}
        result = ModelOutput.from_content("tl-vllm/smollm2-shape", "a")
        result.metadata = {"tlvllm": {"activations": record}}
        return result

    spec = EvalSpec(
        created="2026-01-01T00:00:00+00:00",
        task="bench_storage_scale",
        dataset=EvalDataset(),
        model="tl-vllm/smollm2-shape",
        config=EvalConfig(),
        eval_id=EVAL_ID,
        model_args={},
    )
    samples = [
        EvalSample(
            id=sample_id(i),
            epoch=1,
            input="q",
            target="a",
            uuid=sample_uuid(i),
            scores={"match": Score(value="C" if i % 2 else "I")},
            output=output(i),
        )
        for i in range(1, args.samples + 1)
    ]
    return EvalLog(eval=spec, samples=samples, location=location)


def phase_write_log(args: argparse.Namespace) -> dict[str, Any]:
    """The ``.eval`` file an eval would leave, so that ``load`` can be timed from a path (``--eval-file``)."""
    from inspect_ai.log import write_eval_log

    location, _ = folders(Path(args.dir))
    started = time.perf_counter()
    log = eval_log(args, location)
    built = time.perf_counter()
    write_eval_log(log, location)
    done = time.perf_counter()
    return {
        "build_s": built - started,
        "write_eval_log_s": done - built,
        "bytes": Path(location).stat().st_size,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def phase_load(args: argparse.Namespace) -> dict[str, Any]:
    """``activations.load`` joined with the log's samples and scores, then every tensor touched.

    ``load`` returns a list: every sample's tensors are in memory at once, which the peak RSS shows;
    ``--reader iter_load`` reads one sample at a time instead."""
    import inspect_ai.log
    import inspect_ai.scorer  # noqa: F401  (imported here so that the timings below leave Inspect's import out)
    import torch

    from inspect_tl_vllm import activations

    rss_after_imports = rss_bytes()
    location, _ = folders(Path(args.dir))
    started = time.perf_counter()
    log = inspect_ai.log.read_eval_log(location) if args.log_from == "file" else eval_log(args, location)
    got_log = time.perf_counter()
    records = activations.load(log) if args.reader == "load" else activations.iter_load(log)
    loaded = time.perf_counter()
    total, count, found = 0.0, 0, 0
    for record in records:
        found += 1
        for tensor in record.activations.values():
            total += float(torch.linalg.vector_norm(tensor.float()))
            count += 1
    done = time.perf_counter()
    return {
        "log_from": "read_eval_log(.eval file)" if args.log_from == "file" else "EvalLog built in memory",
        "reader": args.reader,
        "records": found,
        "tensors": count,
        "norm_sum": total,
        "log_s": got_log - started,
        "load_s": loaded - got_log,
        "touch_s": done - loaded,
        "wall_s": done - started,
        "load_plus_touch_s": done - got_log,
        "rss_after_imports_bytes": rss_after_imports,
        "peak_rss_bytes": peak_rss_bytes(),
    }


PHASES = {
    "write": phase_write,
    "read-one": phase_read_one,
    "read-all": phase_read_all,
    "write-log": phase_write_log,
    "load": phase_load,
}


# --------------------------------------------------------------------------- the driver


def run_phase(args: argparse.Namespace, phase: str, *extra: str) -> dict[str, Any]:
    """Run one phase in a fresh interpreter; its last stdout line is its JSON. The parent's wall time
    includes interpreter start-up and imports, as a user's script would pay them."""
    command = [sys.executable, __file__, "--phase", phase, "--dir", args.dir, *phase_flags(args), *extra]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = time.perf_counter() - started
    return result


def phase_flags(args: argparse.Namespace) -> list[str]:
    """The workload flags a phase needs to rebuild the same samples and log."""
    flags = ["--samples", str(args.samples), "--hooks", str(args.hooks), "--width", str(args.width)]
    flags += ["--rows", str(args.rows), "--dtype", args.dtype, "--seed", str(args.seed)]
    flags += ["--shard-mb", str(args.shard_mb)] if args.shard_mb else []
    return flags + (["--eval-file"] if args.eval_file else []) + (["--progress"] if args.progress else [])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each timing over repeated runs (start-up on a shared 2-core machine is noisy), and
    every run's process wall time, so that the spread stays visible."""
    out = dict(runs[0])
    for key, value in runs[0].items():
        if key.endswith("_s") and isinstance(value, float):
            out[key] = statistics.median(run[key] for run in runs)
    out["runs"] = len(runs)
    out["process_wall_s_each"] = [run["process_wall_s"] for run in runs]
    return out


def evict(paths: list[Path]) -> float:
    """Drop ``paths`` from the page cache: ``sync`` first (dirty pages would stay), then ``DONTNEED``
    per file. Returns the seconds it took (not part of any measurement)."""
    started = time.perf_counter()
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return time.perf_counter() - started


def disk_use(directory: Path) -> dict[str, Any]:
    """What the folder occupies: files (one inode each), apparent and allocated bytes, the index."""
    files = apparent = allocated = index_bytes = folders = 0
    sizes: list[int] = []
    for path in directory.rglob("*"):
        info = path.stat(follow_symlinks=False)
        if path.is_dir():
            folders += 1
            allocated += info.st_blocks * 512
            continue
        files += 1
        apparent += info.st_size
        allocated += info.st_blocks * 512
        if path.name.endswith((".safetensors", ".bin")):
            sizes.append(info.st_size)
        if path.name.endswith((".jsonl", ".json")):
            index_bytes += info.st_size
    indexes = [directory / "index.jsonl", *directory.glob("shards/*.jsonl")]
    samples = sum(path.read_bytes().count(b"\n") for path in indexes if path.exists())
    folder = directory.stat()
    return {
        "files": files,
        "inodes": files + folders + 1,  # the folders' own
        "sample_files": len(sizes),
        "sample_file_bytes": statistics.median(sizes) if sizes else 0,
        "apparent_bytes": apparent,
        "allocated_bytes": allocated + folder.st_blocks * 512,
        "index_bytes": index_bytes,
        "index_bytes_per_sample": index_bytes / max(1, samples),
        "folder_entry_bytes": folder.st_size,
        "block_size": os.statvfs(directory).f_bsize,
        "filesystem": filesystem(directory),
    }


def filesystem(path: Path) -> str:
    """The file system type the folder lies on (the longest mount point above it in /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, point, fstype, *_ = line.split()
            if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best):
                best, kind = point, fstype
    except OSError:
        pass
    return kind


def machine() -> dict[str, Any]:
    """Where the numbers come from: versions, cores, memory, CPU model, commit."""
    import safetensors
    import torch

    meminfo = Path("/proc/meminfo").read_text().split("\n") if Path("/proc/meminfo").exists() else []
    total = next((int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:")), None)
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    try:
        import inspect_ai

        inspect_version = inspect_ai.__version__
    except ImportError:
        inspect_version = None
    root = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "inspect_ai": inspect_version,
        "platform": platform.platform(),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": total,
        "commit": commit or None,
    }


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """All phases in order, each in its own process; the work folder is removed at the end unless kept."""
    made = args.dir is None
    root = Path(args.dir or tempfile.mkdtemp(prefix="tlvllm-storage-scale-"))
    args.dir = str(root)
    location, directory = folders(root)
    if directory.exists() and any(directory.iterdir()):
        raise SystemExit(f"{directory} is not empty: give --dir an empty or new folder")
    result: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k not in ("phase", "read_one", "via", "log_from", "reader")}
    }
    result["machine"] = machine()
    result["load_average_start"] = os.getloadavg()
    result["folder"] = {"log": location, "activations": str(directory)}
    say = print if args.progress else (lambda *a, **k: None)
    try:
        say(f"writing {args.samples} samples to {directory}", file=sys.stderr)
        result["write"] = run_phase(args, "write")
        result["disk"] = disk_use(directory)
        if args.eval_file:
            say("writing the .eval log (Inspect's write_eval_log)", file=sys.stderr)
            result["eval_file"] = run_phase(args, "write-log")
        target = sample_id((args.samples + 1) // 2)
        from inspect_tl_vllm.store.sample_store import sample_file_name

        if args.shard_mb:  # the sample's shard is not known before its index is read: evict them all
            files = sorted(path for path in directory.rglob("*") if path.is_file())
        else:
            files = [directory / "index.jsonl", directory / sample_file_name(target, 1)]
        files += [Path(location)] if args.eval_file else []  # read one via the log reads the .eval file
        result["read_one"] = {}
        by_name = [] if args.shard_mb else ["name"]  # a shard has no file name derived from the id
        for via in ("index", *by_name, *(["log"] if args.eval_file else [])):
            for cache in ("cold", "warm"):
                runs = []
                for _ in range(args.repeats):
                    if cache == "cold" and not args.no_evict:
                        evict(files)
                    say(f"reading {target} via {via} ({cache})", file=sys.stderr)
                    runs.append(run_phase(args, "read-one", "--read-one", target, "--via", via))
                result["read_one"][f"{via}_{cache}"] = median_run(runs)
        everything = sorted(path for path in directory.rglob("*") if path.is_file())
        result["read_all"] = {}
        for cache in ("cold", "warm"):
            if cache == "cold" and not args.no_evict:
                result["evict_s"] = evict(everything)
            say(f"reading all through the storage reader ({cache})", file=sys.stderr)
            result["read_all"][f"storage_{cache}"] = run_phase(args, "read-all")
        for log_from in ("memory", "file") if args.eval_file else ("memory",):
            if not args.no_evict:
                evict(everything)
            say(f"activations.load, log from {log_from} (cold)", file=sys.stderr)
            key = "load_cold" if log_from == "memory" else "load_from_eval_file_cold"
            result["read_all"][key] = run_phase(args, "load", "--log-from", log_from)
        if not args.no_evict:
            evict(everything)
        say("activations.iter_load, log from memory (cold)", file=sys.stderr)
        result["read_all"]["iter_load_cold"] = run_phase(args, "load", "--reader", "iter_load")
        result["load_average_end"] = os.getloadavg()
        result["page_cache"] = (
            "not evicted (--no-evict)"
            if args.no_evict
            else "cold runs: os.sync() then posix_fadvise(DONTNEED) per file; dentries, inodes and any host cache stay"
        )
    finally:
        if made and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return result


def table(result: dict[str, Any]) -> str:
    """A short human summary of the JSON."""
    mib = 2**20
    w, d, one, every = result["write"], result["disk"], result["read_one"], result["read_all"]
    rows = [
        ("samples", f"{w['samples']}"),
        ("write wall", f"{w['wall_s']:.1f} s ({w['rate_per_s']:.0f}/s; write calls {w['write_calls_s']:.1f} s)"),
        ("write latency p50/p99/max", "{p50:.2f} / {p99:.2f} / {max:.1f} ms".format(**w["latency_ms"])),
        ("write rate first/last tenth", f"{w['rate_per_tenth_per_s'][0]:.0f} / {w['rate_per_tenth_per_s'][-1]:.0f} /s"),
        (
            "write peak RSS",
            f"{w['peak_rss_bytes'] / mib:.0f} MiB ({w['rss_after_imports_bytes'] / mib:.0f} after imports)",
        ),
        ("files (inodes)", f"{d['files']} ({d['inodes']})"),
        ("bytes apparent / allocated", f"{d['apparent_bytes'] / mib:.1f} / {d['allocated_bytes'] / mib:.1f} MiB"),
        ("per data file / index line", f"{d['sample_file_bytes']:.0f} B / {d['index_bytes_per_sample']:.0f} B"),
    ]
    for key, got in one.items():
        inner = f"index parse {got['index_parse_s']:.2f} s, " if "index_parse_s" in got else ""
        inner += f"Inspect's import {got['inspect_import_s']:.2f} s, " if "inspect_import_s" in got else ""
        rows.append(
            (
                f"read one ({key}, median of {got['runs']})",
                f"process {got['process_wall_s']:.2f} s; imports {got['import_s']:.2f} s, {inner}"
                f"file {1e3 * got['read_file_s']:.2f} ms; peak RSS {got['peak_rss_bytes'] / mib:.0f} MiB",
            )
        )
    for key, got in every.items():
        if key.startswith("storage"):
            detail = f"index {got['index_parse_s']:.1f} s + files {got['read_s']:.1f} s"
        else:
            detail = f"log {got['log_s']:.1f} s ({got['log_from']}) + load {got['load_s']:.1f} s"
            detail += f" + touch {got['touch_s']:.1f} s"
        rate = got.get("samples", got.get("records", 0)) / got["wall_s"]
        rows.append(
            (
                f"read all ({key})",
                f"{got['wall_s']:.1f} s ({rate:.0f}/s): {detail}; process {got['process_wall_s']:.1f} s; "
                f"peak RSS {got['peak_rss_bytes'] / mib:.0f} MiB",
            )
        )
    if "eval_file" in result:
        e = result["eval_file"]
        rows.append(("write_eval_log", f"{e['write_eval_log_s']:.1f} s, {e['bytes'] / mib:.1f} MiB"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; run one phase (inside a child) or drive them all."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--hooks", type=int, default=2, help="hook points per sample (one tensor each)")
    parser.add_argument("--width", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    parser.add_argument("--rows", type=int, default=1, help="rows per tensor: 1 is a pooled capture, more per-token")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-mb", type=int, default=None, help="store in shards of about this many MiB")
    parser.add_argument("--dir", default=None, help="work folder (empty or new; kept); default a temporary one")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--eval-file", action="store_true", help="also write a .eval log and load from that path")
    parser.add_argument("--no-evict", action="store_true", help="do not evict files from the page cache")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per read-one variant (median)")
    parser.add_argument("--progress", action="store_true", help="say on stderr what runs")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    parser.add_argument("--read-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--via", choices=["index", "name", "log"], default="index", help=argparse.SUPPRESS)
    parser.add_argument("--log-from", choices=["memory", "file"], default="memory", help=argparse.SUPPRESS)
    parser.add_argument("--reader", choices=["load", "iter_load"], default="load", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.samples, args.hooks, args.width, args.rows, args.repeats) < 1:
        parser.error("--samples, --hooks, --width, --rows and --repeats must be at least 1")
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return 0
    result = drive(args)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
