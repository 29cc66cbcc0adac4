"""Activation storage: atomic files, append-only index, retries, hostile sample ids, and a reader
that skips (or, strict, refuses) a record whose file cannot be used."""

from __future__ import annotations

import hashlib
import json
import re
import threading

import pytest
import torch
from inspect_ai.log import EvalLog, EvalSample, write_eval_log

from conftest import eval_spec
from inspect_tl_vllm import activations
from inspect_tl_vllm.store.activations import SkippedRecordWarning
from inspect_tl_vllm.store.folders import folder_at
from inspect_tl_vllm.store.sample_store import (
    INDEX,
    StoredFileError,
    activations_dir_for,
    read_index,
    read_sample,
    sample_file_name,
    write_sample,
)


def write(directory, sample_id, value, epoch=1):
    return write_sample(
        directory,
        eval_id="E",
        sample_id=sample_id,
        epoch=epoch,
        sample_uuid=f"u-{sample_id}",
        activations={"blocks.0.hook_resid_post": torch.full((2, 4), float(value))},
        tokens={"blocks.0.hook_resid_post": 2},
    )


def test_hostile_sample_ids_stay_inside_the_directory(tmp_path):
    for sample_id in ("../../etc/passwd", "a/b", "..", 'ü n\\i:c*o?d"e', 7):
        name = sample_file_name(sample_id, 1)
        assert "/" not in name and "\\" not in name and not name.startswith(".")
        entry = write(tmp_path, sample_id, 1.0)
        assert (tmp_path / entry["file"]).resolve().parent == tmp_path.resolve()
    assert sample_file_name("a/b", 1) != sample_file_name("a_b", 1)


def test_retry_overwrites_and_the_last_index_line_wins(tmp_path):
    write(tmp_path, "s", 1.0)
    write(tmp_path, "s", 2.0)
    entries = read_index(tmp_path)
    assert len(entries) == 1
    assert read_sample(tmp_path, entries[0])["blocks.0.hook_resid_post"][0, 0] == 2.0
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_concurrent_writers_never_interleave_index_lines(tmp_path):
    threads = [
        threading.Thread(target=lambda i=i: [write(tmp_path, f"t{i}-{k}", i) for k in range(20)]) for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(read_index(tmp_path)) == 80
    assert not list(tmp_path.glob(".tmp-*"))


def test_corrupt_file_is_detected(tmp_path):
    entry = write(tmp_path, "s", 1.0)
    path = tmp_path / entry["file"]
    path.write_bytes(path.read_bytes()[:-4] + b"oops")
    with pytest.raises(ValueError, match="checksum mismatch"):
        read_sample(tmp_path, entry)


def test_unwritable_directory_is_reported_before_generation(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="not writable.*activations_dir"):
        folder_at(blocker / "sub").check_writable()


def test_default_directory_sits_beside_the_log():
    assert str(activations_dir_for("/logs/x_task_abc.eval", "E", None)) == "/logs/x_task_abc.activations"
    assert str(activations_dir_for("/logs/x.eval", "E", "/data/acts")) == "/data/acts/E"
    assert str(activations_dir_for("file:///logs/x.eval", "E", None)) == "/logs/x.activations"


def test_a_remote_log_keeps_its_activations_beside_it_in_the_same_store():
    """Beside a log in a bucket the folder is in that bucket too (not a local folder named after the
    URL); ``-M activations_dir`` may be local or remote; a store fsspec cannot open is named."""
    from inspect_tl_vllm.specs import SpecError

    assert activations_dir_for("s3://bucket/logs/x.eval", "E", None).location == "s3://bucket/logs/x.activations"
    assert activations_dir_for("memory://logs/x.json", "E", None).location == "memory://logs/x.activations"
    assert str(activations_dir_for("s3://bucket/logs/x.eval", "E", "/data/acts")) == "/data/acts/E"
    assert activations_dir_for("/logs/x.eval", "E", "s3://b/acts/").location == "s3://b/acts/E"
    with pytest.raises(SpecError, match=r"nosuchstore://b/x.activations.*fsspec.*activations_dir"):
        activations_dir_for("nosuchstore://b/x.eval", "E", None)


# -- reading policy: one bad record is skipped (or, strict, raised), the others are returned -----------------

BAD = {
    "missing": "cannot read .*No such file",
    "tampered": "checksum mismatch",
    "escaping": "'../outside.safetensors' refused",
    "unparsable": "not a readable safetensors file",
}


def log_with_bad_records(tmp_path, bad: list[str]) -> EvalLog:
    """An eval log of samples ``good-1``, each kind in ``bad`` (its file spoiled that way), ``good-2``."""
    ids = ["good-1", *bad, "good-2"]
    spec = eval_spec("E")
    samples = [EvalSample(id=i, epoch=1, input="q", target="a", uuid=f"u-{i}") for i in ids]
    log = EvalLog(eval=spec, samples=samples, location=str(tmp_path / "x.eval"))
    directory = activations_dir_for(log.location, "E", None).path
    entries = {i: write(directory, i, 1.0) for i in ids}
    for kind in bad:
        _spoil(directory, kind, entries[kind])
    return log


def _spoil(directory, kind: str, entry: dict) -> None:
    path = directory / entry["file"]
    if kind == "missing":
        path.unlink()
    elif kind == "tampered":
        path.write_bytes(path.read_bytes()[:-4] + b"oops")
    elif kind == "escaping":  # a valid copy outside, with its right checksum: only the name gives it away
        (directory.parent / "outside.safetensors").write_bytes(path.read_bytes())
        _append(directory, {**entry, "file": "../outside.safetensors"})
    else:  # unparsable: garbage whose checksum the index line matches
        path.write_bytes(b"not safetensors")
        _append(directory, {**entry, "sha256": hashlib.sha256(b"not safetensors").hexdigest()})


def _append(directory, entry: dict) -> None:
    with open(directory / INDEX, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def test_load_skips_unusable_records_with_a_warning_and_returns_the_others(tmp_path):
    log = log_with_bad_records(tmp_path, list(BAD))
    with pytest.warns(SkippedRecordWarning) as caught:
        records = activations.load(log)
    assert [r.sample_id for r in records] == ["good-1", "good-2"]
    messages = [str(w.message) for w in caught if w.category is SkippedRecordWarning]
    assert len(messages) == len(BAD)
    for kind, message in zip(BAD, messages, strict=True):
        assert f"sample {kind!r} epoch 1" in message and "x.activations" in message
        assert re.search(BAD[kind], message), message


@pytest.mark.parametrize("kind", list(BAD))
def test_load_strict_raises_on_the_first_unusable_record(tmp_path, kind):
    log = log_with_bad_records(tmp_path, [kind])
    with pytest.raises(StoredFileError, match=f"sample {kind!r} epoch 1.*{BAD[kind]}"):
        activations.load(log, strict=True)


def test_cli_counts_skipped_records_and_strict_fails(tmp_path, capsys):
    log = log_with_bad_records(tmp_path, ["tampered"])
    write_eval_log(log, log.location)
    assert activations.main([log.location]) == 0
    out, err = capsys.readouterr()
    assert "2 samples with activations, 1 skipped" in out
    assert "checksum mismatch" in err
    with pytest.raises(SystemExit) as exit_info:
        activations.main([log.location, "--strict"])
    assert exit_info.value.code == 1
    assert "error:" in capsys.readouterr().err


def test_read_finds_one_sample_through_the_log_and_names_what_it_cannot_use(tmp_path):
    """``activations.read`` takes file, checksum and hook details from the sample's output in the
    log (no index): it returns what ``load`` returns, and names a sample that stored nothing or a
    file that changed."""
    from inspect_ai.model import ModelOutput

    location = str(tmp_path / "x.eval")
    directory = activations_dir_for(location, "E", None).path
    entries = {i: write(directory, i, float(n)) for n, i in enumerate(["a", "b"])}
    samples = []
    for i in ["a", "b", "plain"]:
        output = ModelOutput.from_content("m", "answer")
        if i in entries:
            stored = {"dir": directory.name, "file": entries[i]["file"], "sha256": entries[i]["sha256"]}
            output.metadata = {"tlvllm": {"activations": {"hooks": entries[i]["hooks"], **stored}}}
        samples.append(EvalSample(id=i, epoch=1, input="q", target="a", uuid=f"u-{i}", output=output))
    write_eval_log(EvalLog(eval=eval_spec("E"), samples=samples, location=location), location)
    one = activations.read(location, "b")
    hook = "blocks.0.hook_resid_post"
    assert torch.equal(one.activations[hook], torch.full((2, 4), 1.0)) and one.sample_uuid == "u-b"
    with pytest.raises(StoredFileError, match=r"sample 'plain' epoch 1: its output names no stored activations"):
        activations.read(location, "plain")
    (directory / entries["a"]["file"]).write_bytes(b"changed")
    with pytest.raises(StoredFileError, match="sample 'a' epoch 1 output metadata.*checksum mismatch"):
        activations.read(location, "a")


# -- shards: many samples per file, an index per shard ----------------------------------------------------


def write_sharded(writer, sample_id, value, epoch=1, rows=2):
    return write_sample(
        writer.folder,
        eval_id="E",
        sample_id=sample_id,
        epoch=epoch,
        sample_uuid=f"u-{sample_id}",
        activations={"blocks.0.hook_resid_post": torch.full((rows, 4), float(value))},
        tokens={"blocks.0.hook_resid_post": rows},
        shards=writer,
    )


def test_shards_pack_samples_roll_at_their_size_and_the_last_entry_wins(tmp_path):
    """Samples go into shards of about the target size (each ``.bin`` with its ``.jsonl``), read back
    by one ranged read each; a retried sample's later entry, in a later shard, wins."""
    from inspect_tl_vllm.store.shards import ShardWriter

    writer = ShardWriter(folder_at(tmp_path), 1000)
    first = [write_sharded(writer, f"s{i}", i) for i in range(12)]
    again = write_sharded(writer, "s3", 33.0)
    writer.close()
    shards = sorted(p.name for p in (tmp_path / "shards").iterdir())
    assert len(shards) >= 4 and len(shards) % 2 == 0  # each shard: .bin and .jsonl
    assert all((tmp_path / "shards" / p).stat().st_size <= 1000 for p in shards if p.endswith(".bin"))
    assert not list(tmp_path.glob("*.safetensors")) and not (tmp_path / INDEX).exists()
    assert again["file"] != first[3]["file"]  # the retry landed in a later shard
    entries = {e["sample_id"]: e for e in read_index(tmp_path)}
    assert sorted(entries) == sorted(f"s{i}" for i in range(12))
    for sample_id, entry in entries.items():
        value = 33.0 if sample_id == "s3" else float(sample_id[1:])
        assert torch.equal(read_sample(tmp_path, entry)["blocks.0.hook_resid_post"], torch.full((2, 4), value))


def test_shard_writer_serves_concurrent_threads(tmp_path):
    from inspect_tl_vllm.store.shards import ShardWriter

    writer = ShardWriter(folder_at(tmp_path), 4096)
    threads = [
        threading.Thread(target=lambda i=i: [write_sharded(writer, f"t{i}-{k}", i) for k in range(20)])
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.close()
    entries = read_index(tmp_path)
    assert len(entries) == 80
    assert len({(e["file"], e["offset"]) for e in entries}) == 80
    assert all(read_sample(tmp_path, e)["blocks.0.hook_resid_post"][0, 0] == int(e["sample_id"][1]) for e in entries)


def sharded_log(tmp_path, ids, target=600):
    from inspect_tl_vllm.store.shards import ShardWriter

    samples = [EvalSample(id=i, epoch=1, input="q", target="a", uuid=f"u-{i}") for i in ids]
    log = EvalLog(eval=eval_spec("E"), samples=samples, location=str(tmp_path / "x.eval"))
    writer = ShardWriter(activations_dir_for(log.location, "E", None), target)
    entries = [write_sharded(writer, i, n) for n, i in enumerate(ids)]
    writer.close()
    return log, entries


def test_a_shard_cut_short_skips_its_lost_samples_with_a_warning_and_reads_the_rest(tmp_path):
    """A crash (or a copy stopped half way) that cut a shard short loses only the samples past the
    cut: ``load`` warns for each, by name, and returns the shard's complete samples and every
    other shard's."""
    ids = [f"s{i}" for i in range(8)]
    log, entries = sharded_log(tmp_path, ids)
    cut = entries[-1]["file"]
    in_cut = [e for e in entries if e["file"] == cut]
    assert len(in_cut) >= 2 and len({e["file"] for e in entries}) >= 2
    path = tmp_path / "x.activations" / "shards" / cut
    path.write_bytes(path.read_bytes()[: in_cut[1]["offset"] + 10])  # the shard's first sample survives
    with pytest.warns(SkippedRecordWarning) as caught:
        records = activations.load(log)
    lost = [e["sample_id"] for e in in_cut[1:]]
    assert [r.sample_id for r in records] == [i for i in ids if i not in lost]
    messages = [str(w.message) for w in caught if w.category is SkippedRecordWarning]
    assert len(messages) == len(lost)
    assert all(re.search(rf"sample '{i}' epoch 1.*{cut} is cut short", m) for i, m in zip(lost, messages, strict=True))
    with pytest.raises(StoredFileError, match="cut short"):
        activations.load(log, strict=True)


def test_a_shard_index_line_can_only_point_into_its_own_shard(tmp_path):
    """An edited shard index cannot make a reader read another shard or a file outside the folder:
    such lines are skipped with a warning, the others read."""
    log, entries = sharded_log(tmp_path, ["a", "b"], target=1 << 20)
    shards = tmp_path / "x.activations" / "shards"
    index = shards / entries[0]["file"].replace(".bin", ".jsonl")
    (tmp_path / "outside.bin").write_bytes((shards / entries[0]["file"]).read_bytes())
    forged = [{**entries[0], "sample_id": "c", "file": name} for name in ("../../outside.bin", "other.bin")]
    forged.append({**entries[0], "sample_id": "d", "offset": -1})
    with open(index, "a") as handle:
        handle.writelines(json.dumps(e) + "\n" for e in forged)
    with pytest.warns(UserWarning) as caught:
        found = read_index(tmp_path / "x.activations")
    assert len([w for w in caught if "does not point into its own shard" in str(w.message)]) == 2
    assert len([w for w in caught if ":5: skipping an unreadable index entry (offset must" in str(w.message)]) == 1
    assert sorted(e["sample_id"] for e in found) == ["a", "b"]
    with pytest.warns(UserWarning, match="does not point into its own shard|offset must"):
        assert [r.sample_id for r in activations.load(log)] == ["a", "b"]


def test_carrying_over_a_shard_links_it_once_and_indexes_only_the_carried_samples(tmp_path):
    """eval-retry's carry-over adds a shard whole to the later folder (a hard link, no bytes
    copied) with an index of just the samples carried: a sample of that shard that failed and ran
    again in the later eval is not seen twice."""
    from inspect_tl_vllm.store.sample_store import link_shard

    log, entries = sharded_log(tmp_path, ["a", "b", "c"], target=1 << 20)
    source = tmp_path / "x.activations"
    later = tmp_path / "y.activations"
    carried = link_shard(later, eval_id="F", source=source, samples=[(e, None) for e in entries[:2]])
    shard = later / "shards" / entries[0]["file"]
    assert shard.stat().st_ino == (source / "shards" / entries[0]["file"]).stat().st_ino
    found = read_index(later)
    assert sorted(e["sample_id"] for e in found) == ["a", "b"]
    assert all(e["eval_id"] == "F" and e["carried_from"]["eval_id"] == "E" for e in found + carried)
    assert torch.equal(read_sample(later, found[1])["blocks.0.hook_resid_post"], torch.full((2, 4), 1.0))


@pytest.mark.parametrize("value", [0, 4097, -1, "big", True, 1.5])
def test_shard_size_is_checked(value):
    from inspect_tl_vllm.provider.model_args import parse_model_args
    from inspect_tl_vllm.specs import SpecError

    with pytest.raises(SpecError, match=r"activations_shard_mb=.*within 1 and 4096"):
        parse_model_args({"activations_shard_mb": value})
    assert parse_model_args({"activations_shard_mb": "64"}).activations_shard_mb == 64


def test_sharded_samples_stream_out_as_arrow_rows_joined_with_their_samples(tmp_path):
    """What a probe or SAE trainer reads: one Arrow row per stored token row, from shards."""
    pytest.importorskip("pyarrow")
    log, entries = sharded_log(tmp_path, ["a", "b", "c"], target=300)
    assert len({e["file"] for e in entries}) >= 2
    table = activations.arrow_reader(log, batch_rows=3).read_all()
    assert table.column("sample_id").to_pylist() == ["a", "a", "b", "b", "c", "c"]
    vectors = table.column("vector").to_pylist()
    assert [v[0] for v in vectors] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
