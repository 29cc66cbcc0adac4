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
from inspect_tl_vllm.store.layout import (
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
