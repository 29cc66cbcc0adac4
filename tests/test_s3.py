"""Activations beside a log in an S3 bucket, against a real S3 protocol: moto's server on localhost
(started and stopped here), reached through s3fs as Inspect reaches its logs."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from inspect_ai import eval, eval_retry
from inspect_ai.log import EvalLog, EvalSample

from conftest import environment, eval_spec, provider_model_args

BUCKET = "tlvllm-test"
HOOK = "blocks.2.hook_resid_post"


@pytest.fixture(scope="module")
def s3() -> Iterator[object]:
    """A moto S3 server on a free localhost port, with the environment pointing s3fs (and so
    Inspect) at it; the bucket is created empty. Yields an s3fs filesystem on it."""
    import s3fs
    from moto.server import ThreadedMotoServer

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        with environment(**env):
            s3fs.S3FileSystem.clear_instance_cache()  # a cached client would keep another endpoint
            fs = s3fs.S3FileSystem()
            fs.mkdir(BUCKET)
            yield fs
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


@pytest.fixture
def bucket_dir(s3, request) -> str:
    """A folder of the bucket of this test's own."""
    return f"s3://{BUCKET}/{request.node.name}"


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return {HOOK: torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))}


def write(folder: str, sample_id: str, seed: int, epoch: int = 1) -> dict:
    from inspect_tl_vllm.store.sample_store import write_sample

    return write_sample(
        folder,
        eval_id="E",
        sample_id=sample_id,
        epoch=epoch,
        sample_uuid=f"u-{sample_id}-{seed}",
        activations=tensors(seed),
        tokens={HOOK: 3},
        positions={HOOK: [0, 1, 2]},
    )


# -- the layout in an object store ------------------------------------------------------------------


def test_files_and_index_entries_round_trip_and_a_retry_replaces_its_entry(s3, bucket_dir):
    from inspect_tl_vllm.store.sample_store import read_index, read_sample

    write(bucket_dir, "a", 1)
    write(bucket_dir, "b", 2)
    write(bucket_dir, "a", 3)  # a retried sample: same names, newer objects
    entries = {e["sample_id"]: e for e in read_index(bucket_dir)}
    assert set(entries) == {"a", "b"} and entries["a"]["sample_uuid"] == "u-a-3"
    assert torch.equal(read_sample(bucket_dir, entries["a"])[HOOK], tensors(3)[HOOK])
    assert torch.equal(read_sample(bucket_dir, entries["b"])[HOOK], tensors(2)[HOOK])
    names = sorted(Path(p).name for p in s3.find(bucket_dir.removeprefix("s3://")))
    assert names == sorted(
        [entries["a"]["file"], entries["b"]["file"]] + [f"{e['file']}.json" for e in entries.values()]
    )


def test_a_file_without_its_entry_is_invisible_and_a_torn_entry_is_skipped_with_a_warning(s3, bucket_dir):
    """A crash between storing a file and its entry leaves a file that readers never see; an entry
    object that does not parse hides only itself."""
    from inspect_tl_vllm.store.sample_store import read_index, sample_file_name

    write(bucket_dir, "kept", 1)
    root = bucket_dir.removeprefix("s3://")
    s3.pipe_file(f"{root}/{sample_file_name('crashed', 1)}", b"half a file")
    s3.pipe_file(f"{root}/index/{sample_file_name('torn', 1)}.json", b'{"sample_id": "torn", "ep')
    with pytest.warns(UserWarning, match="torn.*unreadable index entry"):
        entries = read_index(bucket_dir)
    assert [e["sample_id"] for e in entries] == ["kept"]


def test_a_changed_object_and_a_name_leading_out_are_refused_by_name(s3, bucket_dir):
    from inspect_tl_vllm.store.sample_store import StoredFileError, UnsafePathError, read_sample

    entry = write(bucket_dir, "a", 1)
    root = bucket_dir.removeprefix("s3://")
    s3.pipe_file(f"{root}/{entry['file']}", b"changed")
    with pytest.raises(StoredFileError, match="checksum mismatch"):
        read_sample(bucket_dir, entry)
    with pytest.raises(UnsafePathError, match=r"'\.\./other/x' refused for folder s3://"):
        read_sample(bucket_dir, {**entry, "file": "../other/x"})


def test_an_unwritable_bucket_is_reported_before_generation(s3):
    from inspect_tl_vllm.store.folders import folder_at

    with pytest.raises(OSError, match=r"s3://no-such-bucket/x is not writable.*activations_dir"):
        folder_at("s3://no-such-bucket/x").check_writable()


def test_link_sample_copies_on_the_server_and_never_downloads(s3, bucket_dir, monkeypatch):
    from inspect_tl_vllm.store.folders import RemoteFolder
    from inspect_tl_vllm.store.sample_store import link_sample, read_index, read_sample

    entry = write(f"{bucket_dir}/first", "a", 1)

    def no_download(*args, **kwargs):
        raise AssertionError("the file was downloaded: a copy within one store must stay on the server")

    monkeypatch.setattr(RemoteFolder, "read", no_download)
    carried = link_sample(f"{bucket_dir}/second", eval_id="F", source=f"{bucket_dir}/first", entry=entry)
    monkeypatch.undo()
    [indexed] = read_index(f"{bucket_dir}/second")
    assert indexed == carried and carried["carried_from"]["dir"] == f"{bucket_dir}/first"
    assert torch.equal(read_sample(f"{bucket_dir}/second", indexed)[HOOK], tensors(1)[HOOK])


def test_activations_load_reads_a_log_in_the_bucket_joined_with_scores(s3, bucket_dir, capsys):
    """A log written to the bucket with Inspect's own writer, its activations beside it."""
    from inspect_ai.log import write_eval_log
    from inspect_ai.scorer import Score

    from inspect_tl_vllm import activations
    from inspect_tl_vllm.store.sample_store import activations_dir_for

    location = f"{bucket_dir}/x.eval"
    samples = [
        EvalSample(id=i, epoch=1, input="q", target="a", uuid=f"u-{i}-{ord(i)}", scores={"s": Score(value=i)})
        for i in ("a", "b")
    ]
    log = EvalLog(eval=eval_spec("E"), samples=samples, location=location)
    write_eval_log(log, location)
    folder = activations_dir_for(location, "E", None)
    assert folder.location == f"{bucket_dir}/x.activations"
    write(folder.location, "a", ord("a"))
    write(folder.location, "b", ord("b"))
    records = activations.load(location)
    assert [(r.sample_id, r.scores) for r in records] == [("a", {"s": "a"}), ("b", {"s": "b"})]
    assert torch.equal(records[1].activations[HOOK], tensors(ord("b"))[HOOK])
    table = activations.arrow_reader(location).read_all()  # what a trainer streams, from the bucket
    assert table.column("sample_id").to_pylist() == ["a"] * 3 + ["b"] * 3  # one row per stored token row
    assert activations.main([location]) == 0  # `tl-vllm activations s3://...`
    assert "2 samples with activations, 0 skipped" in capsys.readouterr().out


# -- shards in an object store: spooled here, uploaded whole ---------------------------------------------


@pytest.fixture
def spool(tmp_path, monkeypatch) -> Path:
    """A spool folder of this test's own."""
    from inspect_tl_vllm.store.shards import SPOOL_ENV

    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    return tmp_path / "spool"


def write_sharded(writer, sample_id: str, seed: int) -> dict:
    from inspect_tl_vllm.store.sample_store import write_sample

    return write_sample(
        writer.folder,
        eval_id="E",
        sample_id=sample_id,
        epoch=1,
        sample_uuid=f"u-{sample_id}",
        activations=tensors(seed),
        tokens={HOOK: 3},
        shards=writer,
    )


def test_remote_shards_are_spooled_then_uploaded_whole_data_before_index(s3, bucket_dir, spool, monkeypatch):
    """Nothing reaches the bucket sample by sample: a shard is uploaded when it is full (while
    writing goes on) and at close, its ``.bin`` before its ``.jsonl``; then the spool is gone."""
    from inspect_tl_vllm.store.folders import RemoteFolder, folder_at
    from inspect_tl_vllm.store.sample_store import read_index, read_sample
    from inspect_tl_vllm.store.shards import ShardWriter

    uploads: list[str] = []
    original = RemoteFolder.upload
    monkeypatch.setattr(
        RemoteFolder, "upload", lambda self, name, path: (uploads.append(name), original(self, name, path))
    )
    writer = ShardWriter(folder_at(bucket_dir), 1000)
    for i in range(3):
        write_sharded(writer, f"s{i}", i)
    assert read_index(bucket_dir) == []  # the first shard is not full yet: all of it is in the spool
    for i in range(3, 10):
        write_sharded(writer, f"s{i}", i)
    writer.close()
    assert len(uploads) >= 4 and all(
        a.endswith(".bin") and b == a.replace(".bin", ".jsonl")
        for a, b in zip(uploads[::2], uploads[1::2], strict=True)
    )
    entries = {e["sample_id"]: e for e in read_index(bucket_dir)}
    assert sorted(entries) == [f"s{i}" for i in range(10)]
    assert all(torch.equal(read_sample(bucket_dir, e)[HOOK], tensors(int(i[1:]))[HOOK]) for i, e in entries.items())
    assert not any(p.is_file() for p in spool.rglob("*"))


def test_a_killed_writers_spool_is_uploaded_by_the_next_reader_and_a_live_ones_is_left(s3, bucket_dir, spool):
    """A process killed before its upload leaves its shards in the spool on this machine; the next
    ``activations.load`` (or eval-retry) there uploads them. A spool whose writer still runs is
    locked and not touched."""
    from inspect_tl_vllm.store.folders import folder_at
    from inspect_tl_vllm.store.sample_store import read_index
    from inspect_tl_vllm.store.shards import ShardWriter, upload_spooled

    folder = folder_at(bucket_dir)
    killed = ShardWriter(folder, 1 << 20)
    write_sharded(killed, "a", 1)
    live = ShardWriter(folder, 1 << 20)
    write_sharded(live, "b", 2)
    killed._spool.release(remove=False)  # what the kernel does to a killed process's lock
    assert read_index(bucket_dir) == []
    assert upload_spooled(folder) == 1
    assert [e["sample_id"] for e in read_index(bucket_dir)] == ["a"]
    live.close()
    assert sorted(e["sample_id"] for e in read_index(bucket_dir)) == ["a", "b"]
    assert upload_spooled(folder) == 0 and not any(p.is_file() for p in spool.rglob("*"))


def test_a_spool_that_cannot_be_made_is_named_with_its_fix(s3, bucket_dir, tmp_path, monkeypatch):
    """The provider makes a bucket folder's writer before generation, so this fails the sample early."""
    from inspect_tl_vllm.store.folders import folder_at
    from inspect_tl_vllm.store.shards import SPOOL_ENV, ShardWriter

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(SPOOL_ENV, str(blocker))
    with pytest.raises(OSError, match=rf"cannot spool shards for {bucket_dir} in {blocker}/.*set {SPOOL_ENV}"):
        ShardWriter(folder_at(bucket_dir), 1 << 20)


def test_a_remote_shard_cut_short_loses_only_its_samples_past_the_cut(s3, bucket_dir, spool):
    from inspect_tl_vllm.store.folders import folder_at
    from inspect_tl_vllm.store.sample_store import SampleReader, StoredFileError, read_index, read_sample
    from inspect_tl_vllm.store.shards import ShardWriter

    writer = ShardWriter(folder_at(bucket_dir), 1 << 20)
    for i in range(3):
        write_sharded(writer, f"s{i}", i)
    writer.close()
    entries = sorted(read_index(bucket_dir), key=lambda e: e["offset"])
    shard = f"{bucket_dir.removeprefix('s3://')}/shards/{entries[0]['file']}"
    s3.pipe_file(shard, s3.cat_file(shard)[: entries[2]["offset"] + 5])
    for whole in (False, True):  # one ranged read, or the shard downloaded once
        with SampleReader(bucket_dir, whole_shards=whole) as reader:
            assert torch.equal(read_sample(bucket_dir, entries[1], reader=reader)[HOOK], tensors(1)[HOOK])
            with pytest.raises(StoredFileError, match="sample 's2' epoch 1.*is cut short: it holds 5 of"):
                read_sample(bucket_dir, entries[2], reader=reader)


# -- the provider on the real CPU engine -------------------------------------------------------------

QUESTIONS = ["Name a colour.", "Count to three.", "What is a river?"]

CAPTURE_TASK = f"""
from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import exact
from inspect_ai.solver import generate, solver


@solver
def fail_once(victim: str, marker: str):
    \"\"\"Raise in the victim sample the first time only: the eval stops with the samples before it done.\"\"\"

    async def solve(state, generate):
        if state.sample_id == victim and not Path(marker).exists():
            Path(marker).touch()
            raise RuntimeError("a failure that eval-retry gets past")
        return state

    return solve


@task
def capture_task(marker: str):
    samples = [Sample(id=f"s{{i}}", input=q, target="x") for i, q in enumerate({QUESTIONS!r})]
    return Task(
        dataset=samples,
        solver=[fail_once("s1", marker), generate()],
        scorer=exact(),
        config=GenerateConfig(max_tokens=4, temperature=0.0),
    )
"""


def every_sample_once(retried: EvalLog, engine) -> list:
    """``activations.load`` of the retried log: every sample once, joined with its score, and equal
    to the engine's own capture of that question."""
    from inspect_tl_vllm import activations

    records = activations.load(retried.location)
    assert sorted(r.sample_id for r in records) == ["s0", "s1", "s2"]
    by_id = {s.id: s for s in retried.samples}
    for record in records:
        assert record.scores == {"exact": by_id[record.sample_id].scores["exact"].value}
        chat = [{"role": "user", "content": QUESTIONS[int(record.sample_id[1])]}]
        spec = {"capture": {"hooks": [HOOK], "reduce": "mean"}}
        direct = engine.generate([chat], specs=[spec], max_tokens=4)[0]
        assert torch.allclose(record.activations[HOOK], direct.activations[HOOK], rtol=1e-5, atol=1e-6)
    return records


@pytest.mark.engine
def test_eval_with_a_bucket_log_dir_stores_beside_the_log_and_eval_retry_carries_over(
    s3, bucket_dir, vllm_ready, tiny_llama_dir, tiny_engine, tmp_path
):
    """``eval(log_dir="s3://...")`` with capture on: the activations land beside the log in the
    bucket and read back joined with scores, equal to the engine's own capture. The run fails at
    s1; eval-retry finishes it, copying s0's object on the server: every sample comes back once,
    and nothing is generated twice."""
    from inspect_tl_vllm import activations

    log_dir = f"{bucket_dir}/logs"
    with provider_model_args(capture=HOOK, capture_reduce="mean") as args:
        task_file = tmp_path / "capture_task.py"
        task_file.write_text(CAPTURE_TASK)
        first = eval(
            f"{task_file}@capture_task",
            task_args={"marker": str(tmp_path / "failed")},
            model=f"tl-vllm/{tiny_llama_dir}",
            model_args=args,
            log_dir=log_dir,
            max_samples=1,
            display="none",
        )[0]
        assert first.status == "error" and first.location.startswith(log_dir)
        done = {s.id for s in first.samples if s.error is None}
        assert done == {"s0"}
        retried = eval_retry(first.location, log_dir=log_dir, max_samples=1, display="none")[0]
    assert retried.status == "success" and retried.location.startswith(f"{log_dir}/")

    records = every_sample_once(retried, tiny_engine)

    carried_read = activations.read(retried.location, "s0", 1)  # from the first eval's folder, via the log
    loaded = {r.sample_id: r for r in records}
    assert torch.equal(carried_read.activations[HOOK], loaded["s0"].activations[HOOK])
    root = retried.location.removesuffix(".eval").removeprefix("s3://") + ".activations"
    entries = [json.loads(s3.cat_file(p)) for p in s3.find(f"{root}/index")]
    assert sorted(e["sample_id"] for e in entries) == ["s0", "s1", "s2"]
    carried = {e["sample_id"]: e.get("carried_from") for e in entries}
    assert carried["s0"]["eval_id"] == first.eval.eval_id and carried["s1"] is None and carried["s2"] is None
    metadata = next(s for s in retried.samples if s.id == "s1").output.metadata["tlvllm"]["activations"]
    assert metadata["dir"] == Path(root).name  # recorded beside the log: the two can move together


KILLED_RUN = """
import ast
import os
import sys

from inspect_ai import Task, eval, task
from inspect_ai.dataset import Sample
from inspect_ai.model import GenerateConfig
from inspect_ai.scorer import exact
from inspect_ai.solver import generate, solver


@solver
def killed_at(victim: str, marker: str):
    # the process dies as under kill -9 (no clean-up, no upload) when the victim sample first starts;
    # eval-retry runs this solver again, in the test's own process, and must get past it
    async def solve(state, generate):
        if state.sample_id == victim and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(9)
        return state

    return solve


@task
def killed_task(marker: str):
    samples = [Sample(id=f"s{i}", input=q, target="x") for i, q in enumerate(QUESTIONS)]
    return Task(
        dataset=samples,
        solver=[killed_at("s2", marker), generate()],
        scorer=exact(),
        config=GenerateConfig(max_tokens=4, temperature=0.0),
    )


if __name__ == "__main__":  # vLLM's spawned processes import this file too
    model, log_dir, args, marker = sys.argv[1], sys.argv[2], ast.literal_eval(sys.argv[3]), sys.argv[4]
    task = killed_task(marker)
    eval(task, model=model, model_args=args, log_dir=log_dir, max_samples=1, log_buffer=1, display="none")
"""


@pytest.mark.engine
def test_a_killed_sharded_run_is_finished_by_eval_retry_with_nothing_lost_or_doubled(
    s3, bucket_dir, spool, vllm_ready, tiny_llama_dir, tiny_engine, tmp_path
):
    """With shards in a bucket, a process killed at s2 (after s0 and s1 were logged) has uploaded
    nothing: their activations wait in its spool. ``eval_retry`` of its log uploads that spool,
    carries s0 and s1 over with a server-side copy of their shard, and runs s2: every sample reads
    back once, joined with its score and equal to the engine's own capture."""
    import subprocess
    import sys

    from inspect_ai.log import list_eval_logs, read_eval_log

    from inspect_tl_vllm import activations
    from inspect_tl_vllm.store.sample_store import read_index

    log_dir = f"{bucket_dir}/logs"
    with provider_model_args(capture=HOOK, capture_reduce="mean", activations_shard_mb=1) as args:
        script = tmp_path / "killed_run.py"
        script.write_text(f"QUESTIONS = {QUESTIONS!r}\n" + KILLED_RUN)
        model = f"tl-vllm/{tiny_llama_dir}"
        done = subprocess.run(
            [sys.executable, str(script), model, log_dir, repr(args), str(tmp_path / "killed")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 9, done.stderr[-3000:]
        [info] = list_eval_logs(log_dir)
        killed = read_eval_log(info.name)
        assert killed.status == "started" and sorted(s.id for s in killed.samples) == ["s0", "s1"]
        folder = killed.location.removesuffix(".eval") + ".activations"
        assert read_index(folder) == []  # nothing uploaded: the spool holds s0 and s1
        assert len(list(spool.rglob("*.jsonl"))) == 1
        retried = eval_retry(killed.location, log_dir=log_dir, max_samples=1, display="none")[0]
    assert retried.status == "success"
    records = every_sample_once(retried, tiny_engine)
    entries = read_index(retried.location.removesuffix(".eval") + ".activations")
    assert sorted(e["sample_id"] for e in entries) == ["s0", "s1", "s2"]
    carried = {e["sample_id"]: e.get("carried_from", {}).get("eval_id") for e in entries}
    assert carried == {"s0": killed.eval.eval_id, "s1": killed.eval.eval_id, "s2": None}
    assert sorted(e["sample_id"] for e in read_index(folder)) == ["s0", "s1"]  # the spool, uploaded
    assert not any(p.is_file() for p in spool.rglob("*"))
    loaded = {r.sample_id: r for r in records}
    for sample_id in ("s0", "s2"):  # through the log alone: a ranged read of the shard its output names
        one = activations.read(retried.location, sample_id, 1)
        assert one.index["offset"] >= 0 and torch.equal(one.activations[HOOK], loaded[sample_id].activations[HOOK])
