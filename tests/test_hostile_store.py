"""A hostile activations folder or log (issue 49): readers and eval-retry's carry-over neither crash,
hang, return another sample's bytes nor lose samples silently.

- Every field of every index line (a local ``index.jsonl`` line, a remote index object, a shard's
  ``.jsonl`` line) is range-checked: a bad line is skipped with a warning naming its file and line.
- A FIFO in place of a stored file is refused, not waited on; carry-over checks a folder named in
  a log against its allowed roots before contacting it, and a store that does not answer is given
  up on after a time.
- A record whose bytes do not hold the hooks, shapes and dtypes its index line records is refused.
- ``-M activations_dir`` must name a store other processes can read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from inspect_ai.log import EvalLog, EvalSample, read_eval_log, write_eval_log
from inspect_ai.model import ModelOutput

from conftest import eval_spec
from inspect_tl_vllm import activations
from inspect_tl_vllm.specs import TAG
from inspect_tl_vllm.store.activations import SkippedRecordWarning
from inspect_tl_vllm.store.folders import INDEX, folder_at
from inspect_tl_vllm.store.sample_store import activations_dir_for, read_index, write_sample
from inspect_tl_vllm.store.shards import ShardWriter

HOOK = "blocks.0.hook_resid_post"
DEADLINE_S = 20.0
"""How long a call here may take before it counts as hung (each takes well under a second when it works)."""


def store(directory: Any, sample_id: str, rows: int = 2, shards: ShardWriter | None = None) -> dict[str, Any]:
    """A genuine sample, as the provider stores it: ``rows`` rows of the value ``rows``."""
    return write_sample(
        directory,
        eval_id="E1",
        sample_id=sample_id,
        epoch=1,
        sample_uuid=f"u-{sample_id}",
        activations={HOOK: torch.full((rows, 4), float(rows))},
        tokens={HOOK: rows},
        positions={HOOK: list(range(rows))},
        shards=shards,
    )


def hostile(entry: dict[str, Any], **raw: str) -> bytes:
    """``entry`` as one index line with each field of ``raw`` replaced by that raw JSON text (which
    ``json.dumps`` would never write: ``Infinity``, ``1e400``, 100k nested brackets)."""
    marked = {**entry, **{key: f"@{key}@" for key in raw}}
    text = json.dumps(marked, sort_keys=True)
    for key, value in raw.items():
        text = text.replace(f'"@{key}@"', value)
    return text.encode() + b"\n"


def append(path: Path, line: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(line)


def log_of(location: Path, ids: list[str]) -> EvalLog:
    samples = [EvalSample(id=i, epoch=1, input="q", target="a", uuid=f"u-{i}") for i in ids]
    return EvalLog(eval=eval_spec("E1"), samples=samples, location=str(location))


def finishes(call: Callable[[], Any], seconds: float = DEADLINE_S) -> tuple[Any, list[warnings.WarningMessage]]:
    """``call()``'s result and warnings, or a failure when it has not returned after ``seconds`` (it
    is left blocked in a daemon thread, which a FIFO's cleanup releases)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome["result"] = call()
            except BaseException as err:  # noqa: BLE001 (re-raised in the test's thread)
                outcome["error"] = err
            outcome["warnings"] = caught

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"], outcome["warnings"]


def messages(caught: list[warnings.WarningMessage]) -> str:
    return "\n".join(str(w.message) for w in caught)


# -- item 3: one hostile index line ------------------------------------------------------------------

HOSTILE_FIELDS = {
    "epoch Infinity": {"epoch": "Infinity"},
    "epoch -Infinity": {"epoch": "-Infinity"},
    "epoch NaN": {"epoch": "NaN"},
    "epoch 1e400": {"epoch": "1e400"},
    "epoch 2**64": {"epoch": str(2**64)},
    "epoch 0": {"epoch": "0"},
    "epoch true": {"epoch": "true"},
    "epoch 1.0": {"epoch": "1.0"},
    "sample_id 100k nested": {"sample_id": "[" * 100_000 + "]" * 100_000},
    "sample_id 500 nested": {"sample_id": "[" * 500 + "]" * 500},
    "sample_id a list": {"sample_id": '["h"]'},
    "sample_id 5000 digits": {"sample_id": "9" * 5000},
    "sample_uuid a number": {"sample_uuid": "7"},
    "sha256 a number": {"sha256": "1e400"},
    "hooks a list": {"hooks": "[]"},
    "shape negative": {"hooks": json.dumps({HOOK: {"shape": [-2, 4], "dtype": "float32", "tokens": 2}})},
    "a hook 1e400": {
        "hooks": json.dumps({HOOK: {"shape": [2, 4], "dtype": "float32", "tokens": 2}})[:-1] + ', "x": 1e400}'
    },
    "tokens 2**63": {"hooks": json.dumps({HOOK: {"shape": [2, 4], "dtype": "float32", "tokens": 2**63}})},
    "positions 2**61 long": {
        "hooks": json.dumps(
            {HOOK: {"shape": [2, 4], "dtype": "float32", "tokens": 2, "positions": {"start": 0, "stop": 2**61}}}
        )
    },
    "positions negative": {
        "hooks": json.dumps({HOOK: {"shape": [2, 4], "dtype": "float32", "tokens": 2, "positions": [-1, 0]}})
    },
    "whole line 100k nested": {},
}


def hostile_line(entry: dict[str, Any], case: str) -> bytes:
    if case == "whole line 100k nested":
        return b"[" * 100_000 + b"]" * 100_000 + b"\n"
    return hostile(entry, **HOSTILE_FIELDS[case])


@pytest.mark.parametrize("case", list(HOSTILE_FIELDS))
def test_a_hostile_index_line_is_skipped_with_a_warning_naming_it(tmp_path, case):
    """Sample ``h``'s genuine line, then a hostile one for it: the hostile line is skipped (so the
    genuine one counts) with a warning naming ``index.jsonl:4``; ``load`` neither raises
    (OverflowError, RecursionError, MemoryError) nor returns the hostile line's record."""
    log = log_of(tmp_path / "x.eval", ["a", "b", "h"])
    directory = activations_dir_for(log.location, "E1", None).path
    entries = {i: store(directory, i) for i in ("a", "b", "h")}
    append(directory / INDEX, hostile_line(entries["h"], case))
    records, caught = finishes(lambda: activations.load(log))
    assert [r.sample_id for r in records] == ["a", "b", "h"]
    assert records[2].index == entries["h"] and records[2].positions == {HOOK: [0, 1]}
    assert f"{directory / INDEX}:4: skipping an unreadable index entry" in messages(caught)


def test_the_activations_command_lists_the_other_samples_past_a_hostile_line(tmp_path, capsys):
    log = log_of(tmp_path / "x.eval", ["a", "b"])
    directory = activations_dir_for(log.location, "E1", None).path
    entry = store(directory, "a")
    store(directory, "b")
    append(directory / INDEX, hostile(entry, epoch="Infinity"))
    write_eval_log(log, log.location)
    assert activations.main([log.location]) == 0
    out, err = capsys.readouterr()
    assert "2 samples with activations, 0 skipped" in out
    assert f"{directory / INDEX}:3: skipping an unreadable index entry" in err


SHARD_CASES = {
    "offset 2**63": ({"offset": str(2**63)}, "unreadable index entry"),
    "length 2**63": ({"length": str(2**63)}, "unreadable index entry"),
    "offset 1e400": ({"offset": "1e400"}, "unreadable index entry"),
    "length Infinity": ({"length": "Infinity"}, "unreadable index entry"),
    "length 2**40": ({"length": str(2**40)}, "is cut short"),  # a valid number the shard does not hold
}


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_a_hostile_shard_line_fails_alone(tmp_path, case):
    """A line that cannot be a span of its shard is skipped when the index is read; one within
    range that runs past the shard's end fails its record (the shard is cut short) before any
    bytes are read, without reading (or allocating) a terabyte."""
    raw, expected = SHARD_CASES[case]
    log = log_of(tmp_path / "x.eval", ["a", "b", "h"])
    directory = activations_dir_for(log.location, "E1", None)
    writer = ShardWriter(directory, 1 << 20)
    entries = {i: store(directory, i, shards=writer) for i in ("a", "b", "h")}
    writer.close()
    index = directory.path / "shards" / entries["h"]["file"].replace(".bin", ".jsonl")
    append(index, hostile(entries["h"], **raw))
    records, caught = finishes(lambda: activations.load(log))
    fails_at_read = expected == "is cut short"
    assert [r.sample_id for r in records] == (["a", "b"] if fails_at_read else ["a", "b", "h"])
    assert expected in messages(caught)
    if not fails_at_read:
        assert f"{index}:4: skipping" in messages(caught)


def test_a_hostile_remote_index_object_is_skipped_with_a_warning_naming_it(tmp_path):
    """The same checks for a folder in an object store (fsspec's in-memory store here)."""
    from inspect_tl_vllm.store.folders import RemoteFolder

    folder = folder_at(f"memory://tlvllm-hostile-{uuid.uuid4().hex}/x.activations")
    assert isinstance(folder, RemoteFolder)
    entry = store(folder, "a")
    store(folder, "b")
    folder.fs.pipe_file(f"{folder.root}/index/zz-hostile.json", hostile(entry, sample_id="1e400"))
    folder.fs.pipe_file(f"{folder.root}/index/zz-nested.json", b"[" * 100_000 + b"]" * 100_000)
    found, caught = finishes(lambda: read_index(folder))
    assert sorted(e["sample_id"] for e in found) == ["a", "b"]
    assert "zz-hostile.json: skipping an unreadable index entry" in messages(caught)
    assert "zz-nested.json: skipping an unreadable index entry" in messages(caught)


def retry_log(
    log_dir: Path, source: str | Path, entries: dict[str, dict[str, Any]], model_args: dict | None = None
) -> EvalLog:
    """A finished retry log (written and read back) whose samples reused those of ``entries``, each
    output naming ``source`` and its file, as eval-retry copies them."""
    samples = []
    for sample_id, entry in entries.items():
        output = ModelOutput.from_content("tl-vllm/tiny", "answer")
        stored = {"dir": str(source), "file": entry["file"], "sha256": entry["sha256"]}
        output.metadata = {TAG: {"activations": stored}}
        samples.append(EvalSample(id=sample_id, epoch=1, input="q", target="a", uuid=f"u-{sample_id}", output=output))
    log_dir.mkdir(parents=True, exist_ok=True)
    location = log_dir / "retry.eval"
    write_eval_log(EvalLog(eval=eval_spec("E2", model_args), samples=samples), str(location))
    return read_eval_log(str(location))


@pytest.mark.parametrize("where", ["earlier", "own"])
def test_carry_over_carries_every_sample_past_a_hostile_index_line(tmp_path, where):
    """A hostile line in the earlier eval's index, or in the retry's own, is skipped with a warning:
    all four samples are carried over (it used to raise, and carry none while the retry reported success)."""
    from inspect_tl_vllm.provider.carry_over import carry_over

    source = tmp_path / "logs" / "old.activations"
    entries = {i: store(source, i) for i in ("a", "b", "c", "d")}
    own = tmp_path / "logs" / "retry.activations"
    if where == "own":
        own.mkdir(parents=True)
        append(own / INDEX, hostile(entries["a"], epoch="Infinity"))
    else:
        append(source / INDEX, hostile(entries["a"], epoch="Infinity"))
    log = retry_log(tmp_path / "logs", source, entries)
    linked, caught = finishes(lambda: carry_over(log))
    assert linked == 4
    carried, _ = finishes(lambda: read_index(own))
    assert sorted(e["sample_id"] for e in carried) == ["a", "b", "c", "d"]
    index = (own if where == "own" else source) / INDEX
    line = 1 if where == "own" else 5
    assert f"{index}:{line}: skipping an unreadable index entry" in messages(caught)


# -- item 4: hangs -------------------------------------------------------------------------------------


@contextlib.contextmanager
def released(fifo: Path) -> Iterator[None]:
    """Unblock a reader a failed test left waiting on ``fifo`` (open it for writing, then close)."""
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_a_fifo_in_place_of_a_sample_file_is_refused_not_waited_on(tmp_path):
    log = log_of(tmp_path / "x.eval", ["a", "b"])
    directory = activations_dir_for(log.location, "E1", None).path
    entry = store(directory, "a")
    store(directory, "b")
    fifo = directory / entry["file"]
    fifo.unlink()
    os.mkfifo(fifo)
    with released(fifo):
        records, caught = finishes(lambda: activations.load(log))
    assert [r.sample_id for r in records] == ["b"]
    assert f"sample 'a' epoch 1: {fifo} is not a regular file" in messages(caught)


def test_a_fifo_in_place_of_a_shard_is_refused_not_waited_on(tmp_path):
    log = log_of(tmp_path / "x.eval", ["a", "b"])
    directory = activations_dir_for(log.location, "E1", None)
    writer = ShardWriter(directory, 1 << 20)
    entry = store(directory, "a", shards=writer)
    store(directory, "b", shards=writer)
    writer.close()
    fifo = directory.path / "shards" / entry["file"]
    fifo.unlink()
    os.mkfifo(fifo)
    with released(fifo):
        records, caught = finishes(lambda: activations.load(log))
    assert records == []
    assert messages(caught).count(f"{fifo} is not a regular file") == 2


@pytest.fixture
def silent_server() -> Iterator[tuple[socket.socket, int]]:
    """A TCP port that takes connections (the kernel's backlog) and never answers: a store that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener, listener.getsockname()[1]


def was_contacted(listener: socket.socket) -> bool:
    listener.setblocking(False)
    try:
        connection, _ = listener.accept()
    except BlockingIOError:
        return False
    connection.close()
    return True


def test_carry_over_checks_a_folder_named_in_a_log_before_contacting_it(tmp_path, silent_server, caplog):
    """The log names a folder on a host it chose; the folder is not below the log's folder, so it is
    refused without a request (one used to wait the HTTP client's five minutes)."""
    from inspect_tl_vllm.provider.carry_over import carry_over

    listener, port = silent_server
    url = f"http://127.0.0.1:{port}/old.activations"
    entries = {"a": store(tmp_path / "elsewhere", "a")}
    log = retry_log(tmp_path / "logs", url, entries)
    with caplog.at_level(logging.WARNING, logger="inspect_tl_vllm"):
        linked, _ = finishes(lambda: carry_over(log))
    assert linked == 0
    assert not was_contacted(listener)
    assert f"not carrying activations over from {url}" in caplog.text


def test_carry_over_gives_up_on_a_store_that_does_not_answer_and_says_what_it_left(
    tmp_path, silent_server, caplog, monkeypatch
):
    """The eval's own ``-M activations_dir`` is a store that stopped answering: carry-over stops
    after the store time limit with a warning naming the folder and the samples left out."""
    from inspect_tl_vllm.provider.carry_over import carry_over
    from inspect_tl_vllm.store import folders

    monkeypatch.setattr(folders, "REMOTE_TIMEOUT_S", 1.0)
    _, port = silent_server
    root = f"http://127.0.0.1:{port}/acts"
    entries = {"a": store(tmp_path / "logs" / "old.activations", "a")}
    log = retry_log(tmp_path / "logs", f"{root}/E1", entries, {"activations_dir": root})
    with caplog.at_level(logging.WARNING, logger="inspect_tl_vllm"):
        linked, _ = finishes(lambda: carry_over(log))
    assert linked == 0
    assert f"{root}/E2" in caplog.text and "did not answer within 1" in caplog.text
    assert "sample 'a' epoch 1" in caplog.text


# -- item 6: another sample's bytes; a store no other process sees ------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_an_index_line_naming_another_samples_bytes_is_refused(tmp_path, sharded):
    """Sample ``a``'s last line names ``b``'s bytes (file, span and checksum, all genuine): the
    bytes hold a (3, 4) tensor where ``a``'s line records (2, 4), so ``a`` is refused, not
    returned with ``b``'s activations."""
    log = log_of(tmp_path / "x.eval", ["a", "b"])
    directory = activations_dir_for(log.location, "E1", None)
    writer = ShardWriter(directory, 1 << 20) if sharded else None
    a = store(directory, "a", rows=2, shards=writer)
    b = store(directory, "b", rows=3, shards=writer)
    if writer is not None:
        writer.close()
    forged = {**a, **{key: b[key] for key in ("file", "sha256", "offset", "length") if key in b}}
    index = directory.path / ("shards/" + a["file"].replace(".bin", ".jsonl") if sharded else INDEX)
    append(index, json.dumps(forged).encode() + b"\n")
    with pytest.warns(SkippedRecordWarning, match=r"sample 'a' epoch 1.*\(3, 4\).*\(2, 4\)"):
        records = activations.load(log)
    assert [r.sample_id for r in records] == ["b"]
    assert torch.equal(records[0].activations[HOOK], torch.full((3, 4), 3.0))


@pytest.mark.parametrize("location", ["memory://acts", "MEMORY://bucket/acts"])
def test_a_store_no_other_process_can_read_is_refused_when_model_args_are_parsed(location):
    from inspect_tl_vllm.provider.model_args import parse_model_args
    from inspect_tl_vllm.specs import SpecError

    with pytest.raises(SpecError, match=rf"-M activations_dir={location!r}.*in-memory.*local folder"):
        parse_model_args({"activations_dir": location})
    for fine in ("acts", "/data/acts", "file:///data/acts", "s3://bucket/acts"):
        assert parse_model_args({"activations_dir": fine}).activations_dir == fine
