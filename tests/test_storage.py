"""Activation storage: atomic files, append-only index, retries, hostile sample ids."""

from __future__ import annotations

import threading

import pytest
import torch

from inspect_tl_vllm.storage import (
    activations_dir_for,
    check_writable,
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
        check_writable(blocker / "sub")


def test_default_directory_sits_beside_the_log():
    assert str(activations_dir_for("/logs/x_task_abc.eval", "E", None)) == "/logs/x_task_abc.activations"
    assert str(activations_dir_for("/logs/x.eval", "E", "/data/acts")) == "/data/acts/E"
