"""The activation hand-off (``engine/handoff.py``): files on a shared host, bytes otherwise.

The engine tests go through the file path on every capture; these cover the fallbacks a CPU
engine never takes: a worker that cannot see the folder (another node), a folder that fills
up or disappears, and two hook names of one site giving views of the same rows.
"""

from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch
from safetensors.torch import load

from inspect_tl_vllm.engine.handoff import HandoffFolder, shared_folder, write_tensors


def tensors() -> dict[str, torch.Tensor]:
    block = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    return {"blocks.0.hook_resid_post": block[1:3], "blocks.1.hook_resid_pre": block[1:3], "other": block[4:]}


def test_same_host_round_trip_through_a_file_that_is_deleted_after_reading() -> None:
    folder = HandoffFolder()
    try:
        payload = write_tensors(shared_folder(folder.ticket()), "uid", tensors())
        assert payload["tensors"] == b"" and len(payload["files"]) == 1
        got = folder.take(payload["files"][0])
        assert all(torch.equal(got[k], v) for k, v in tensors().items())  # aliased views written apart
        assert not (folder.path / payload["files"][0]).exists()
    finally:
        folder.close()
    assert not folder.path.exists()


def test_a_worker_that_cannot_prove_the_folder_sends_bytes(tmp_path) -> None:
    folder = HandoffFolder()
    try:
        assert shared_folder([str(folder.path), "another front end's token"]) is None
        assert shared_folder([str(tmp_path / "absent"), folder.token]) is None  # another node
        assert shared_folder(None) is None
        payload = write_tensors(None, "uid", tensors())
        assert payload["files"] == []
        assert torch.equal(load(payload["tensors"])["other"], tensors()["other"])
    finally:
        folder.close()


def test_a_folder_that_vanished_falls_back_to_bytes() -> None:
    folder = HandoffFolder()
    seen = shared_folder(folder.ticket())
    shutil.rmtree(folder.path)  # as if /dev/shm were cleaned, or full: the write fails with OSError
    payload = write_tensors(seen, "uid", tensors())
    assert payload["files"] == [] and set(load(payload["tensors"])) == set(tensors())
    assert write_tensors(seen, "uid", {}) == {"tensors": b"", "files": []}


@pytest.mark.parametrize("short_writes", [False, True])
def test_the_one_copy_writer_gives_files_safetensors_reads(tmp_path, monkeypatch, short_writes: bool) -> None:
    """With ``short_writes`` each ``writev`` writes at most 7 bytes, as a write may: the
    writer must go on from exactly where it stopped."""
    from safetensors.torch import load_file

    from inspect_tl_vllm.engine import handoff
    from inspect_tl_vllm.engine.handoff import save_file

    if short_writes:
        writev = os.writev
        monkeypatch.setattr(handoff.os, "writev", lambda fd, views: writev(fd, [bytes(views[0])[:7]]))

    block = torch.randn(7, 5).to(torch.bfloat16)
    written = {
        "bf16 rows": block[2:5],
        "float32": torch.randn(3, 4),
        "float16, not contiguous": torch.randn(4, 6).half().t(),
        "no rows": torch.zeros(0, 5, dtype=torch.bfloat16),
        "same rows again": block[2:5],
    }
    save_file(written, tmp_path / "x.safetensors")
    got = load_file(str(tmp_path / "x.safetensors"))
    assert set(got) == set(written)
    for name, tensor in written.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_taken_tensors_are_copy_on_write_views_that_outlive_the_deleted_file() -> None:
    folder = HandoffFolder()
    try:
        written = {"bf16": torch.randn(5, 3).to(torch.bfloat16), "f32": torch.randn(2, 7), "none": torch.zeros(0, 3)}
        payload = write_tensors(shared_folder(folder.ticket()), "uid", written)
        got = folder.take(payload["files"][0])
        assert list(folder.path.glob("uid-*")) == []  # deleted once mapped
        gc.collect()
        for name, tensor in written.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        got["f32"] += 1  # a copy-on-write map: writable, private to the front end
        assert torch.equal(got["f32"], written["f32"] + 1)
    finally:
        folder.close()


def test_a_truncated_file_is_refused_with_its_name(tmp_path) -> None:
    from inspect_tl_vllm.engine.handoff import load_mapped, save_file

    save_file({"rows": torch.randn(4, 4)}, tmp_path / "x.safetensors")
    data = (tmp_path / "x.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match="cut.safetensors: tensor 'rows' lies outside the file"):
        load_mapped(tmp_path / "cut.safetensors")
    (tmp_path / "tiny.safetensors").write_bytes(data[:4])
    with pytest.raises(ValueError, match="tiny.safetensors: not a safetensors file"):
        load_mapped(tmp_path / "tiny.safetensors")


def test_one_thread_writes_early_unless_told_otherwise(monkeypatch) -> None:
    """Four writers cost capture-all a fifth of its throughput on an H200 (docs/BENCHMARKS.md, one writer thread)."""
    from inspect_tl_vllm.engine.packing import writer_threads

    monkeypatch.delenv("TLVLLM_WRITER_THREADS", raising=False)
    assert writer_threads() == 1
    for value, threads in (("3", 3), ("0", 1), ("many", 1)):
        monkeypatch.setenv("TLVLLM_WRITER_THREADS", value)
        assert writer_threads() == threads, value
