"""The activation layouts in an object store (S3 protocol, moto on localhost) beside local disk (CPU).

    python bench/storage_remote.py [--samples 2000] [--hooks 2] [--width 576] [--repeats 3] [--carry 100]
                                   [--shard-mb N] [--out F] [--quiet]

What ``store/folders.py``'s ``RemoteFolder`` costs, in time and above all in HTTP requests, when an
eval stores N samples in a bucket, one file per sample (the default) or in shards of about N MiB
(``--shard-mb N``: written through the spool, uploaded at their size and at the end, read through
a ``SampleReader`` that downloads each shard once, carried over a shard at a time with
``link_shard``; the read-one-by-name variant is skipped, since a shard's name does not derive from
the sample id). Remotely a sample
is two objects (its safetensors file, then its index entry ``index/<file>.json``), so every phase
below has a request count that grows with N; those counts are what a real store bills and what
its latency multiplies, and they are the numbers a sharded layout has to beat. The same phases run
on a local temporary folder (``LocalFolder``: a file per sample plus one ``index.jsonl``) for scale.

Phases, each on a freshly started s3fs client (its instance cache cleared, so no listing is served
from an earlier phase's cache; starting the client is timed apart as ``client_start_s``):

- **write**: N ``write_sample`` calls made as the provider makes them (``provider/model_api.py``
  ``_record``: ``activations_dir_for`` per sample, ``check_writable`` once per folder, then
  ``write_sample`` and ``record_dir``), one after another; wall time, rate, p50/p99 latency;
- **read index**: ``read_index(folder)`` (remotely one listing of ``index/``, 1000 keys a page, then
  one GET per entry, issued concurrently by ``fs.cat``);
- **read one** sample by id (the middle one), median of ``--repeats``: through the index as every
  reader does (``read_index`` + ``read_sample``), and, as a lower bound, directly by the file name
  derived from the id (``sample_file_name``) plus, remotely, its entry object (which holds the
  checksum), both fetched in one concurrent ``fs.cat`` with ``max_concurrency=1`` (two GETs: s3fs's
  ``cat_file`` otherwise asks for the size first with a HEAD, as ``RemoteFolder.read`` does); locally
  the file alone, unverified, since the checksum is only in the index;
- **read all**: ``read_index`` + ``read_sample`` (verified) for every entry, one after another;
- **carry-over**: ``link_sample`` of ``--carry`` samples into a second eval's folder beside the
  first, as ``eval-retry`` does (remotely a server-side copy plus an entry object; locally a hard
  link plus an index line). Reading the source's index, which ``eval-retry`` also does, is the
  read-index phase.

Requests are counted on the server: the benchmark starts moto's S3 app (``moto.server``'s werkzeug
WSGI app, threaded, as ``ThreadedMotoServer`` runs it) in a child process of its own behind a WSGI
wrapper that counts every request by kind before moto sees it: PUT, COPY (a PUT carrying
``x-amz-copy-source``), GET, LIST (a GET with ``list-type``), HEAD, DELETE, POST, with request and
response body bytes and the server process's CPU time. The benchmark reads the counters over HTTP
at a path moto never sees, so reading them adds no request. Its own process keeps moto's Python
work off the benchmark's interpreter lock, as a real store is another machine; but both still share
this machine's cores, so **absolute times are moto's on this machine, not a store's**: a real S3
adds a network round trip per request (milliseconds to tens of them) and serves requests in
parallel far beyond moto. The request counts carry over to a real store unchanged.

The tensors are random; their content does not matter to a layout that neither compresses nor
deduplicates. Nothing here touches AWS: the client's endpoint is the local server, with dummy keys.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

# the local benchmark's synthetic samples, so that the two layouts store the same (bench/ is on sys.path)
from storage_scale import POOLED_TOKENS, hooks, sample_id, write_as_provider

EVAL_ID = "bench-storage-remote"
RETRY_EVAL_ID = "bench-storage-remote-retry"
BUCKET = "tlvllm-bench"
LOG_NAME = "bench.eval"
"""The first eval's log; its activations folder is the default sibling ``bench.activations``."""
RETRY_LOG_NAME = "bench-retry.eval"
"""The log of the eval that carries samples over (``eval-retry``): ``bench-retry.activations``."""
KINDS = ("PUT", "COPY", "GET", "LIST", "HEAD", "DELETE", "POST", "OTHER")
"""Request kinds the server counts; COPY is a PUT with ``x-amz-copy-source``, LIST a GET with ``list-type``."""
COUNTS_PATH = "/_bench/counts"
"""Where the counting wrapper answers with its counters itself (moto never sees this path)."""


# --------------------------------------------------------------------------- the server (a child process)


def classify(environ: dict[str, Any]) -> str:
    """The kind of one S3 request, from its method, query string and headers."""
    method = environ.get("REQUEST_METHOD", "")
    if method == "PUT":
        return "COPY" if environ.get("HTTP_X_AMZ_COPY_SOURCE") else "PUT"
    if method == "GET":
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        return "LIST" if "list-type" in query else "GET"
    return method if method in KINDS else "OTHER"


class CountingApp:
    """A WSGI wrapper that counts requests (and body bytes) by kind, then hands them to moto.

    Counting at the server, not in the client, sees every request the client library makes
    (listings, HEADs before a copy, retries), whatever path in s3fs or botocore issued it."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(KINDS, 0)
        self.bytes_in = 0
        self.bytes_out = 0

    def counts(self) -> dict[str, Any]:
        times = os.times()
        with self.lock:
            return {
                "requests": dict(self.requests),
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "cpu_s": times.user + times.system,
            }

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == COUNTS_PATH:
            body = json.dumps(self.counts()).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = classify(environ)
        sent = int(environ.get("CONTENT_LENGTH") or 0)
        with self.lock:
            self.requests[kind] += 1
            self.bytes_in += sent

        def counting_start(status: str, headers: list[tuple[str, str]], *rest: Any) -> Any:
            length = next((int(v) for k, v in headers if k.lower() == "content-length" and v.isdigit()), 0)
            if kind != "HEAD":  # a HEAD's Content-Length is the object's, no body is sent
                with self.lock:
                    self.bytes_out += length
            return start_response(status, headers, *rest)

        return self.app(environ, counting_start)


def serve() -> None:
    """Run moto's S3 server with the counting wrapper on a free localhost port; print the port."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@dataclass
class Server:
    """The moto child process, its endpoint, and the environment that points s3fs at it."""

    process: subprocess.Popen[str]
    endpoint: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls) -> Server:
        process = subprocess.Popen(
            [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True, stderr=subprocess.DEVNULL
        )
        assert process.stdout is not None
        port = process.stdout.readline().strip()
        if not port.isdigit():
            process.kill()
            raise SystemExit(f"the moto server did not start (it printed {port!r})")
        endpoint = f"http://127.0.0.1:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never look for real credentials
        }
        return cls(process, endpoint, env)

    def counts(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.endpoint + COUNTS_PATH, timeout=30) as answer:
            return json.loads(answer.read())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def difference(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the server counted between two snapshots."""
    requests = {kind: after["requests"][kind] - before["requests"][kind] for kind in KINDS}
    return {
        "requests": {kind: n for kind, n in requests.items() if n},
        "requests_total": sum(requests.values()),
        "bytes_in": after["bytes_in"] - before["bytes_in"],
        "bytes_out": after["bytes_out"] - before["bytes_out"],
        "server_cpu_s": after["cpu_s"] - before["cpu_s"],
    }


# --------------------------------------------------------------------------- the workload


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max of latencies, in milliseconds."""
    ordered = sorted(seconds)
    return {
        "p50": 1e3 * ordered[len(ordered) // 2],
        "p99": 1e3 * ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))],
        "max": 1e3 * ordered[-1],
    }


@dataclass
class Store:
    """One place the phases run against: a local folder, or a prefix in the moto bucket."""

    name: str
    root: str
    """Where the logs would be (a path or ``s3://bucket/prefix``); the activations folders lie beside them."""
    server: Server | None = None

    def log(self, name: str) -> str:
        return f"{self.root}/{name}"

    def open(self, log_name: str = LOG_NAME, eval_id: str = EVAL_ID) -> tuple[Any, float]:
        """The activations folder for a log, on a freshly started client (remotely: s3fs's instance
        cache cleared, so nothing an earlier phase listed is served from its cache), and how long
        starting that client took."""
        from inspect_tl_vllm.store.sample_store import activations_dir_for

        started = time.perf_counter()
        if self.server is not None:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
        folder = activations_dir_for(self.log(log_name), eval_id, None)
        if self.server is not None:
            folder.fs.connect()
        return folder, time.perf_counter() - started

    @contextmanager
    def measured(self, into: dict[str, Any]) -> Iterator[None]:
        """Wall time, this process's CPU time and, remotely, the server's counts of the block."""
        before = self.server.counts() if self.server else None
        cpu, started = time.process_time(), time.perf_counter()
        yield
        into["wall_s"] = time.perf_counter() - started
        into["client_cpu_s"] = time.process_time() - cpu
        if self.server is not None and before is not None:
            into.update(difference(before, self.server.counts()))


def say(quiet: bool, message: str) -> None:
    """Progress on stderr, so that stdout holds only the table."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def phase_write(store: Store, args: argparse.Namespace) -> dict[str, Any]:
    """N samples through the provider's calls, one after another (the provider writes each sample
    from a worker thread as its generation finishes; with several samples at once writes overlap)."""
    import torch
    from safetensors.torch import save

    _, client_start = store.open()
    names = hooks(args.hooks)
    generator = torch.Generator().manual_seed(args.seed)
    tokens = dict.fromkeys(names, POOLED_TOKENS)
    extra = {"model": "tl-vllm/smollm2-shape", "reduce": "mean"}
    location = store.log(LOG_NAME)
    latencies: list[float] = []
    writable: set[object] = set()
    out: dict[str, Any] = {"samples": args.samples, "client_start_s": client_start}
    tenth = max(1, args.samples // 10)
    with store.measured(out):
        started = time.perf_counter()
        for index in range(1, args.samples + 1):
            tensors = {hook: torch.randn(1, args.width, generator=generator) for hook in names}
            begun = time.perf_counter()
            entry = write_as_provider(location, EVAL_ID, index, tensors, tokens, None, extra, writable, args.shard_mb)
            latencies.append(time.perf_counter() - begun)
            if index % tenth == 0:
                say(
                    args.quiet, f"  [{store.name}] wrote {index}/{args.samples} ({time.perf_counter() - started:.1f} s)"
                )
        if args.shard_mb:  # as the provider's task-end hook: upload the last shard
            from inspect_tl_vllm.store.shards import close_writer

            close_writer(store.open()[0])
    out["rate_per_s"] = args.samples / out["wall_s"]
    out["latency_ms"] = percentiles(latencies)
    tenths = [latencies[i : i + tenth] for i in range(0, len(latencies), tenth)]
    out["rate_per_tenth_per_s"] = [len(part) / sum(part) for part in tenths]
    out["sample_file_bytes"] = len(save({hook: tensor.contiguous() for hook, tensor in tensors.items()}))
    out["last_entry"] = entry
    return out


def phase_read_index(store: Store, args: argparse.Namespace) -> dict[str, Any]:
    """``read_index`` of the whole folder: what every reader pays before its first sample."""
    from inspect_tl_vllm.store.sample_store import read_index

    folder, client_start = store.open()
    out: dict[str, Any] = {"client_start_s": client_start}
    with store.measured(out):
        entries = read_index(folder)
    out["entries"] = len(entries)
    return out


def phase_read_one(store: Store, args: argparse.Namespace, target: str, via: str) -> dict[str, Any]:
    """One sample by id, median of ``--repeats`` runs, each on a fresh client; requests per run."""
    import torch
    from safetensors.torch import load

    from inspect_tl_vllm.store.folders import REMOTE_INDEX
    from inspect_tl_vllm.store.sample_store import read_index, read_sample, sample_file_name

    runs: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        folder, client_start = store.open()
        run: dict[str, Any] = {"client_start_s": client_start}
        with store.measured(run):
            if via == "index":
                entry = next(e for e in read_index(folder) if e["sample_id"] == target and e["epoch"] == 1)
                tensors = read_sample(folder, entry, verify=True)
            else:
                name = sample_file_name(target, 1)
                if store.server is None:  # the checksum is only in index.jsonl: the file alone, unverified
                    tensors = load(Path(folder.file(name, "bench")).read_bytes())
                else:  # the file and its entry object (which holds the checksum), fetched together
                    path, entry_path = f"{folder.root}/{name}", f"{folder.root}/{REMOTE_INDEX}/{name}.json"
                    # max_concurrency=1: no HEAD for the size first (s3fs's cat_file does one by default, to
                    # decide on ranged parallel GETs), so that this is the least a reader has to ask
                    blobs = folder.fs.cat([path, entry_path], max_concurrency=1)
                    if hashlib.sha256(blobs[path]).hexdigest() != json.loads(blobs[entry_path])["sha256"]:
                        raise SystemExit(f"{path}: checksum mismatch")
                    tensors = load(blobs[path])
        run["norm"] = float(sum(torch.linalg.vector_norm(t) for t in tensors.values()))
        runs.append(run)
    wall = [run["wall_s"] for run in runs]
    out: dict[str, Any] = {
        "sample_id": target,
        "via": via,
        "verified": via == "index" or store.server is not None,
        "runs": len(runs),
        "wall_s": statistics.median(wall),
        "wall_s_all": wall,
        "client_start_s": statistics.median(run["client_start_s"] for run in runs),
        "client_cpu_s": statistics.median(run["client_cpu_s"] for run in runs),
    }
    if store.server is not None:
        out["requests"] = runs[-1]["requests"]
        out["requests_total"] = runs[-1]["requests_total"]
        out["requests_same_every_run"] = len({json.dumps(run["requests"], sort_keys=True) for run in runs}) == 1
        out["server_cpu_s"] = statistics.median(run["server_cpu_s"] for run in runs)
        out["bytes_out"] = runs[-1]["bytes_out"]
    return out


def phase_read_all(store: Store, args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Every sample through the storage reader, verified, one after another; also returns the index."""
    import torch

    from inspect_tl_vllm.store.sample_store import SampleReader, read_index, read_sample

    folder, client_start = store.open()
    out: dict[str, Any] = {"client_start_s": client_start}
    total = 0.0
    with store.measured(out), SampleReader(folder, whole_shards=True) as reader:  # as activations.iter_load
        started = time.perf_counter()
        entries = read_index(folder)
        out["index_s"] = time.perf_counter() - started
        tenth = max(1, len(entries) // 10)
        for number, entry in enumerate(entries, start=1):
            tensors = read_sample(folder, entry, reader=reader)
            total += float(sum(torch.linalg.vector_norm(t) for t in tensors.values()))
            if number % tenth == 0:
                say(
                    args.quiet, f"  [{store.name}] read {number}/{len(entries)} ({time.perf_counter() - started:.1f} s)"
                )
    out.update(samples=len(entries), norm_sum=total, rate_per_s=len(entries) / out["wall_s"])
    return out, entries


def phase_carry(store: Store, args: argparse.Namespace, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """``link_sample`` of the first ``--carry`` samples into a later eval's folder (``eval-retry``);
    with shards, ``link_shard`` once per shard holding them, as ``carry_over`` does."""
    from inspect_tl_vllm.store.sample_store import link_sample, link_shard, read_index

    source, _ = store.open()
    target, client_start = store.open(RETRY_LOG_NAME, RETRY_EVAL_ID)
    chosen = sorted(entries, key=lambda e: e["sample_id"])[: args.carry]
    latencies: list[float] = []
    out: dict[str, Any] = {"samples": len(chosen), "client_start_s": client_start}
    with store.measured(out):
        if args.shard_mb:
            by_shard: dict[str, list[tuple[dict[str, Any], None]]] = {}
            for entry in chosen:
                by_shard.setdefault(entry["file"], []).append((entry, None))
            for samples in by_shard.values():
                begun = time.perf_counter()
                link_shard(target, eval_id=RETRY_EVAL_ID, source=source, samples=samples)
                latencies.append(time.perf_counter() - begun)
            out["shards"] = len(by_shard)
        for number, entry in enumerate([] if args.shard_mb else chosen, start=1):
            begun = time.perf_counter()
            link_sample(target, eval_id=RETRY_EVAL_ID, source=source, entry=entry)
            latencies.append(time.perf_counter() - begun)
            if number % max(1, len(chosen) // 4) == 0:
                say(args.quiet, f"  [{store.name}] carried {number}/{len(chosen)}")
    out["rate_per_s"] = len(chosen) / out["wall_s"]
    out["latency_ms"] = percentiles(latencies)
    out["indexed_after"] = len(read_index(target))  # outside the measured block: a check, not the work
    return out


def footprint(store: Store) -> dict[str, Any]:
    """Objects (files) and bytes the first eval's folder holds (counted after the phases)."""
    folder, _ = store.open()
    if store.server is None:
        sizes = [path.stat().st_size for path in folder.path.rglob("*") if path.is_file()]
    else:
        sizes = [info["size"] for info in folder.fs.find(folder.root, detail=True).values()]
    return {"objects": len(sizes), "bytes": sum(sizes)}


def run_store(store: Store, args: argparse.Namespace) -> dict[str, Any]:
    """All phases on one store, in order."""
    say(args.quiet, f"[{store.name}] writing {args.samples} samples to {store.log('bench.activations')}")
    result: dict[str, Any] = {"root": store.root, "write": phase_write(store, args)}
    say(args.quiet, f"[{store.name}] reading the index")
    result["read_index"] = phase_read_index(store, args)
    target = sample_id((args.samples + 1) // 2)
    for via in ("index",) if args.shard_mb else ("index", "name"):  # a shard's name is not the id's
        say(args.quiet, f"[{store.name}] reading {target} via {via} ({args.repeats} times)")
        result[f"read_one_{via}"] = phase_read_one(store, args, target, via)
    say(args.quiet, f"[{store.name}] reading all samples")
    result["read_all"], entries = phase_read_all(store, args)
    say(args.quiet, f"[{store.name}] carrying {min(args.carry, len(entries))} samples over")
    result["carry_over"] = phase_carry(store, args, entries)
    result["footprint"] = footprint(store)
    return result


# --------------------------------------------------------------------------- the driver


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.processor(),
    )
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, check=False
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "versions": {
            name: version(name)
            for name in ("s3fs", "fsspec", "aiobotocore", "botocore", "moto", "werkzeug", "torch", "safetensors")
        },
        "commit": commit or None,
    }


NOTE = (
    "moto is a Python server (werkzeug, a thread per connection) in a process of its own on the same {cores}-core "
    "machine as this client: absolute S3 times are moto's on this machine, not a real store's (which adds a network "
    "round trip per request and serves far more requests in parallel). Request counts carry over to a real store."
)


def drive(args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, run every phase on local disk and on S3, stop the server, clean up."""
    result: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k not in ("serve", "out")}}
    result["machine"] = machine()
    result["note"] = NOTE.format(cores=result["machine"]["cpus_usable"] or result["machine"]["cpu_count"])
    result["load_average_start"] = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="tlvllm-storage-remote-"))
    server = Server.start()
    try:
        os.environ.update(server.env)
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # a cached client would keep another endpoint
        s3fs.S3FileSystem().mkdir(BUCKET)
        result["stores"] = {}
        result["stores"]["local"] = run_store(Store("local", str(work)), args)
        result["stores"]["s3"] = run_store(Store("s3", f"s3://{BUCKET}/run", server), args)
        result["server_total"] = server.counts()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    result["load_average_end"] = os.getloadavg()
    return result


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table (one row per phase and store) with a short header."""
    n = result["args"]["samples"]
    m = result["machine"]
    load = (result["load_average_start"][0], result["load_average_end"][0])
    cores = m["cpus_usable"] or m["cpu_count"]
    shard_mb = result["args"].get("shard_mb")
    layout = f"in shards of {shard_mb} MiB" if shard_mb else "a file each"
    lines = [
        f"{n} samples, {result['args']['hooks']} hook points x {result['args']['width']} float32, pooled "
        f"({result['stores']['local']['write']['sample_file_bytes']} B of safetensors a sample, {layout}). "
        f"{m['cpus_usable']} cores ({m['cpu_model']}), Python {m['python']}, s3fs {m['versions']['s3fs']}, "
        f"moto {m['versions']['moto']}, botocore {m['versions']['botocore']}.",
        "",
        result["note"],
        f"Load average (1 min) at start / end: {load[0]:.1f} / {load[1]:.1f}"
        + (
            f" (above {cores}: other work shared the cores and slowed both stores' times)."
            if max(load) > cores
            else "."
        ),
        "",
        "| phase | store | wall | rate | latency p50 / p99 | requests | per sample | kinds | server CPU | client CPU |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    phases = [
        ("write", f"write {n}", n),
        ("read_index", "read index", n),
        ("read_one_index", "read one via index", None),
        ("read_one_name", "read one by name", None),
        ("read_all", "read all", n),
        ("carry_over", f"carry-over {min(n, result['args']['carry'])}", min(n, result["args"]["carry"])),
    ]
    for key, label, per in phases:
        for store in ("local", "s3"):
            if key not in result["stores"][store]:  # read one by name: not with shards
                continue
            got = result["stores"][store][key]
            wall = got["wall_s"]
            count = got.get("samples", got.get("entries", per))
            rate = f"{count / wall:,.0f}/s" if per else ""
            latency = "{p50:.2f} / {p99:.2f} ms".format(**got["latency_ms"]) if "latency_ms" in got else ""
            if store == "s3":
                requests = f"{got['requests_total']:,}"
                each = f"{got['requests_total'] / per:.2f}" if per else ""
                kinds = ", ".join(f"{kind} {number:,}" for kind, number in got["requests"].items())
                server_cpu = f"{got['server_cpu_s']:.2f} s"
            else:
                requests = each = kinds = server_cpu = ""
            note = f" (median of {got['runs']})" if "runs" in got else ""
            if key == "read_one_name":
                note += " file + entry" if store == "s3" else " file only, unverified"
            shown = f"{wall * 1e3:.1f} ms" if wall < 1 else f"{wall:.2f} s"
            lines.append(
                f"| {label}{note} | {store} | {shown} | {rate} | {latency} | {requests} | {each} | {kinds} | "
                f"{server_cpu} | {got['client_cpu_s']:.2f} s |"
            )
    local, s3 = result["stores"]["local"]["footprint"], result["stores"]["s3"]["footprint"]
    lines += [
        "",
        f"Footprint of the first eval's folder: local {local['objects']:,} files, {local['bytes'] / 2**20:.1f} MiB; "
        f"S3 {s3['objects']:,} objects, {s3['bytes'] / 2**20:.1f} MiB. S3 client start (fresh s3fs instance): "
        f"{result['stores']['s3']['read_index']['client_start_s'] * 1e3:.0f} ms, not in the walls above.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments; serve (inside the child) or drive every phase."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--hooks", type=int, default=2, help="hook points per sample (one tensor each)")
    parser.add_argument("--width", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per read-one variant (median)")
    parser.add_argument("--carry", type=int, default=100, help="samples carried over with link_sample")
    parser.add_argument("--shard-mb", type=int, default=None, help="store in shards of about this many MiB")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--out", default=None, help="write the JSON here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve()
        return 0
    if min(args.samples, args.hooks, args.width, args.repeats, args.carry) < 1:
        parser.error("--samples, --hooks, --width, --repeats and --carry must be at least 1")
    result = drive(args)
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
