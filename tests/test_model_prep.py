"""Model preparation: clear errors for missing, corrupt and mismatched GGUF files."""

from __future__ import annotations

import pytest

from inspect_tl_vllm.model_prep import ModelPrepError, convert_gguf, is_prepared


def test_missing_gguf_is_a_clear_error(tmp_path):
    with pytest.raises(ModelPrepError, match="not found"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_checksum_mismatch_names_the_fix(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelPrepError, match="checksum mismatch.*prepare-model smollm2"):
        convert_gguf(bad, tmp_path / "out")


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelPrepError, match="could not read .* as a GGUF model"):
        convert_gguf(bad, tmp_path / "out", expected_sha256=None)
    assert not (tmp_path / "out").exists()


def test_unverified_directory_is_not_prepared(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not is_prepared(tmp_path)
    (tmp_path / "tlvllm-prepared.json").write_text("{broken")
    assert not is_prepared(tmp_path)
