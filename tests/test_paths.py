"""Names read back from an index or a log stay inside their folder.

An ``index.jsonl`` line or an eval log can be edited, so the ``file`` and ``dir`` they hold are
data, not paths: readers, ``eval-retry``'s carry-over and the probe scorer must refuse a name that
leads elsewhere, and must neither read nor create nor modify any file outside the folder.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from inspect_ai.log import EvalLog, EvalSample, read_eval_log, write_eval_log
from inspect_ai.model import ModelOutput

from conftest import eval_spec
from inspect_tl_vllm.provider.carry_over import carry_over
from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.store.sample_store import (
    INDEX,
    UnsafePathError,
    link_sample,
    read_index,
    read_sample,
    write_sample,
)

HOOK = "blocks.0.hook_resid_post"
PRECIOUS = b"precious: must not change"


def store(directory: Path, sample_id: str = "s", eval_id: str = "E1") -> dict:
    """A genuine file and index line, as the provider writes them."""
    return write_sample(
        directory,
        eval_id=eval_id,
        sample_id=sample_id,
        epoch=1,
        sample_uuid=f"u-{sample_id}",
        activations={HOOK: torch.ones(2, 4)},
        tokens={HOOK: 2},
    )


def append_line(directory: Path, entry: dict) -> None:
    """An index line as an attacker (or a bad edit) would add it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / INDEX, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(PRECIOUS)
    return path


def assert_untouched(victim: Path, before: os.stat_result) -> None:
    """Same bytes, same inode, no extra hard link, not rewritten."""
    after = victim.stat()
    assert victim.read_bytes() == PRECIOUS
    assert (after.st_ino, after.st_nlink, after.st_mtime_ns) == (before.st_ino, before.st_nlink, before.st_mtime_ns)


# -- read_sample ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parent", "absolute", "nested", "dotdot", "dot", "empty", "nul", "symlink"])
def test_read_sample_refuses_names_that_leave_the_folder(tmp_path, kind):
    """Each name points at a valid copy of a stored file (same checksum), so only the name check stops it."""
    folder = tmp_path / "acts"
    entry = store(folder)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((folder / entry["file"]).read_bytes())
    (folder / "a").mkdir()
    (folder / "a" / "b").write_bytes(outside.read_bytes())
    (folder / "link.safetensors").symlink_to(outside)
    name = {
        "parent": "../outside.safetensors",
        "absolute": str(outside),
        "nested": "a/b",
        "dotdot": "..",
        "dot": ".",
        "empty": "",
        "nul": "x\0y",
        "symlink": "link.safetensors",
    }[kind]
    with pytest.raises(UnsafePathError, match=r"file name .* refused for folder .*plain file name"):
        read_sample(folder, {**entry, "file": name})


# -- link_sample ---------------------------------------------------------------------------------


@pytest.mark.parametrize("absolute", [False, True])
def test_link_sample_refuses_a_name_leading_out_and_touches_nothing(tmp_path, victim, absolute):
    """``source/../../victim`` is an attacker's payload, ``new/../../victim`` the victim: without the
    check the victim would be replaced by a link to the payload."""
    source = tmp_path / "logs" / "deep" / "old.activations"
    entry = store(source)
    payload = tmp_path / "logs" / "victim"
    payload.write_bytes(b"evil")
    directory = tmp_path / "new" / "x.activations"
    before = victim.stat()
    hostile = {**entry, "file": str(victim) if absolute else "../../victim"}
    with pytest.raises(UnsafePathError, match=r"old\.activations/index\.jsonl, sample 's' epoch 1: file name"):
        link_sample(directory, eval_id="E2", source=source, entry=hostile)
    assert_untouched(victim, before)
    assert payload.read_bytes() == b"evil"
    assert not directory.exists()  # refused before the folder, a temporary file or an index line


def test_link_sample_refuses_a_source_symlink_leading_out(tmp_path, victim):
    """Linked or copied (across file systems), the symlink would bring the victim into the new folder,
    where every later reader would read it."""
    source = tmp_path / "old.activations"
    entry = store(source)
    (source / entry["file"]).unlink()
    (source / entry["file"]).symlink_to(victim)
    before = victim.stat()
    directory = tmp_path / "new.activations"
    with pytest.raises(UnsafePathError, match="no symlink leading out"):
        link_sample(directory, eval_id="E2", source=source, entry=entry)
    assert_untouched(victim, before)
    assert not directory.exists()


def test_link_sample_refuses_a_destination_symlink_leading_out(tmp_path, victim):
    source = tmp_path / "old.activations"
    entry = store(source)
    directory = tmp_path / "new.activations"
    directory.mkdir()
    (directory / entry["file"]).symlink_to(victim)
    before = victim.stat()
    with pytest.raises(UnsafePathError, match=f"refused for folder {directory}"):
        link_sample(directory, eval_id="E2", source=source, entry=entry)
    assert_untouched(victim, before)
    assert sorted(p.name for p in directory.iterdir()) == [entry["file"]]  # no index line, no temporary file


# -- carry_over (eval-retry) ---------------------------------------------------------------------


def retried_log(log_dir: Path, recorded_dir: str, model_args: dict | None = None, *, stored: dict) -> EvalLog:
    """A finished retry log, written and read back, whose reused sample ``s`` names ``recorded_dir``
    and the file (name and sha256) of ``stored``, the index entry its output recorded."""
    output = ModelOutput.from_content("tl-vllm/tiny", "answer")
    output.metadata = {TAG: {"activations": {"dir": recorded_dir, "file": stored["file"], "sha256": stored["sha256"]}}}
    spec = eval_spec("E2", model_args)
    sample = EvalSample(id="s", epoch=1, input="q", target="a", uuid="u-s", output=output)
    log_dir.mkdir(parents=True, exist_ok=True)
    location = log_dir / "retry.eval"
    write_eval_log(EvalLog(eval=spec, samples=[sample]), str(location))
    return read_eval_log(str(location))


def test_carry_over_uses_recorded_folders_only_below_the_log_folder_or_activations_dir(tmp_path, caplog):
    """A genuine file in a folder elsewhere is not taken; the same under ``-M activations_dir`` is."""
    elsewhere = tmp_path / "elsewhere" / "E1"
    entry = store(elsewhere)
    log = retried_log(tmp_path / "logs", str(elsewhere), stored=entry)
    with caplog.at_level(logging.WARNING, logger="inspect_tl_vllm"):
        assert carry_over(log) == 0
    assert not (tmp_path / "logs" / "retry.activations").exists()
    assert f"sample 's' epoch 1: not carrying activations over from {elsewhere}" in caplog.text
    assert "must resolve below" in caplog.text

    allowed = retried_log(
        tmp_path / "logs", str(elsewhere), {"activations_dir": str(tmp_path / "elsewhere")}, stored=entry
    )
    assert carry_over(allowed) == 1
    assert read_index(tmp_path / "elsewhere" / "E2")[0]["carried_from"]["eval_id"] == "E1"


def test_carry_over_refuses_index_names_leading_out_and_touches_nothing(tmp_path, victim, caplog):
    """The recorded folder is allowed (below the log folder) but its index line names ``../../victim``:
    from there it reaches a payload, from the new folder the victim."""
    source = tmp_path / "logs" / "deep" / "old.activations"
    entry = store(source)
    hostile = {**entry, "file": "../../victim"}  # an edited index line, and a log edited to name it
    append_line(source, hostile)
    (tmp_path / "logs" / "victim").write_bytes(b"evil")
    before = victim.stat()
    log = retried_log(tmp_path / "logs", str(source), stored=hostile)
    with caplog.at_level(logging.WARNING, logger="inspect_tl_vllm"):
        assert carry_over(log) == 0
    assert_untouched(victim, before)
    assert "sample 's' epoch 1" in caplog.text and "'../../victim' refused" in caplog.text
    assert read_index(tmp_path / "logs" / "retry.activations") == []


def test_carry_over_refuses_a_dotdot_folder_name(tmp_path, caplog):
    """``logs/sub/..`` is the log folder itself, and a folder named ``..`` beside the new one is the
    log folder's parent: neither may serve as a source, though the parent holds a genuine index."""
    (tmp_path / "logs" / "sub").mkdir(parents=True)
    entry = store(tmp_path)
    log = retried_log(tmp_path / "logs", str(tmp_path / "logs" / "sub" / ".."), stored=entry)
    with caplog.at_level(logging.WARNING, logger="inspect_tl_vllm"):
        assert carry_over(log) == 0
    assert read_index(tmp_path / "logs" / "retry.activations") == []
    assert "not carrying activations over from" in caplog.text
