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
    from inspect_tl_vllm.store.layout import write_sample

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
    from inspect_tl_vllm.store.layout import read_index, read_sample

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
    from inspect_tl_vllm.store.layout import read_index, sample_file_name

    write(bucket_dir, "kept", 1)
    root = bucket_dir.removeprefix("s3://")
    s3.pipe_file(f"{root}/{sample_file_name('crashed', 1)}", b"half a file")
    s3.pipe_file(f"{root}/index/{sample_file_name('torn', 1)}.json", b'{"sample_id": "torn", "ep')
    with pytest.warns(UserWarning, match="torn.*unreadable index entry"):
        entries = read_index(bucket_dir)
    assert [e["sample_id"] for e in entries] == ["kept"]


def test_a_changed_object_and_a_name_leading_out_are_refused_by_name(s3, bucket_dir):
    from inspect_tl_vllm.store.layout import StoredFileError, UnsafePathError, read_sample

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
    from inspect_tl_vllm.store.layout import link_sample, read_index, read_sample

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
    from inspect_tl_vllm.store.layout import activations_dir_for

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

    records = activations.load(retried.location)
    assert sorted(r.sample_id for r in records) == ["s0", "s1", "s2"]
    by_id = {s.id: s for s in retried.samples}
    for record in records:
        assert record.scores == {"exact": by_id[record.sample_id].scores["exact"].value}
        chat = [{"role": "user", "content": QUESTIONS[int(record.sample_id[1])]}]
        spec = {"capture": {"hooks": [HOOK], "reduce": "mean"}}
        direct = tiny_engine.generate([chat], specs=[spec], max_tokens=4)[0]
        assert torch.allclose(record.activations[HOOK], direct.activations[HOOK], rtol=1e-5, atol=1e-6)

    carried_read = activations.read(retried.location, "s0", 1)  # from the first eval's folder, via the log
    loaded = {r.sample_id: r for r in records}
    assert torch.equal(carried_read.activations[HOOK], loaded["s0"].activations[HOOK])
    root = retried.location.removesuffix(".eval").removeprefix("s3://") + ".activations"
    entries = [json.loads(s3.cat_file(p)) for p in s3.find(f"{root}/index")]
    assert sorted(e["sample_id"] for e in entries) == ["s0", "s1", "s2"]
    carried = {e["sample_id"]: e.get("carried_from") for e in entries}
    assert carried["s0"]["eval_id"] == first.eval.eval_id and carried["s1"] is None and carried["s2"] is None
    metadata = by_id["s1"].output.metadata["tlvllm"]["activations"]
    assert metadata["dir"] == Path(root).name  # recorded beside the log: the two can move together
