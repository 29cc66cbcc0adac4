"""Spec files and values are read strictly (no YAML 1.1 surprises, no duplicate keys, no strings or
bools as numbers), and a vector file is read one tensor at a time, cached until the file changes."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from inspect_tl_vllm.cli import _key_values
from inspect_tl_vllm.provider.model_args import parse_model_args
from inspect_tl_vllm.research.extract import read_pairs
from inspect_tl_vllm.specs import InstrumentConfig, SpecError, parse_request_spec
from inspect_tl_vllm.vectors.files import load_vector, read_vector_file

HOOK = "blocks.1.hook_resid_post"
STEP = f"interventions:\n  - hook: {HOOK}\n    op: scale\n"
"""The head of a YAML spec whose one intervention's further fields start on line 4."""


def steer(path: Path, text: str) -> object:
    path.write_text(text)
    return parse_model_args({"steer": str(path)}).run_spec


@pytest.mark.parametrize(
    ("body", "fragments"),
    [
        ("    positions: [010]\n", ["steer.yaml:4:", "write 10", "quote it ('010')"]),
        ("    positions: [-010, 3]\n", ["steer.yaml:4:", "write -10"]),
        ("    coef: 1:30\n", ["steer.yaml:4:", "'1:30'", "YAML 1.1 reads it as 90", "write 90"]),
        ("    coef: 1_000\n", ["steer.yaml:4:", "write 1000"]),
        ("    positions: on\n", ["steer.yaml:4:", "YAML 1.1 reads it as true", "quote it ('on')"]),
        ("    coef: 2\n    coef: 3\n", ["steer.yaml:5:", "'coef' is given twice", "line 4", "remove one"]),
        ("    coef: 2\ninterventions: []\n", ["steer.yaml:5:", "'interventions' is given twice"]),
    ],
)
def test_yaml_spec_files_refuse_yaml11_readings_and_duplicate_keys(tmp_path, body, fragments):
    with pytest.raises(SpecError) as info:
        steer(tmp_path / "steer.yaml", STEP + body)
    message = str(info.value)
    assert message.startswith("-M steer: ")
    for fragment in fragments:
        assert fragment in message, message


def test_yaml_spec_files_read_numbers_as_yaml_12_and_json_do(tmp_path):
    """PyYAML reads ``1e-3`` as text (YAML 1.1 floats need a dot); JSON and YAML 1.2 read a number."""
    spec = steer(tmp_path / "steer.yaml", STEP + "    coef: 1e-3\n    positions: [0x10, -1, +2, 0]\n")
    item = spec.interventions[0]
    assert item.coef == 0.001 and item.positions == [16, -1, 2, 0]
    with pytest.raises(SpecError, match="coef"):  # quoted: text, and coef refuses text
        steer(tmp_path / "steer.yaml", STEP + "    coef: '1:30'\n")


def test_spec_files_keep_vector_and_sae_paths_relative_to_their_folder(tmp_path):
    body = f"interventions:\n  - {{hook: {HOOK}, vector: v.safetensors:{HOOK}, coef: 2}}\n"
    spec = steer(tmp_path / "steer.yaml", body)
    assert spec.interventions[0].vector == str(tmp_path / f"v.safetensors:{HOOK}")


def test_json_spec_files_and_inline_json_refuse_duplicate_keys(tmp_path):
    path = tmp_path / "steer.json"
    path.write_text('{"interventions": [\n  {"hook": "' + HOOK + '", "op": "scale",\n   "coef": 2, "coef": 3}\n]}\n')
    with pytest.raises(SpecError, match=r"-M steer: .*steer.json:3: key 'coef' is given twice \(first on line 3\)"):
        parse_model_args({"steer": str(path)})
    with pytest.raises(SpecError, match="key 'interventions' is given twice"):
        parse_model_args({"steer": '{"interventions": [], "interventions": []}'})
    path.write_text('{"interventions": [}')
    with pytest.raises(SpecError, match=r"steer.json:1: not valid JSON"):
        parse_model_args({"steer": str(path)})


def test_a_pairs_file_refuses_a_key_given_twice(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"positive": "a", "negative": "b"}\n\n{"positive": "a", "negative": "b", "positive": "c"}\n')
    with pytest.raises(SpecError, match=r"pairs.jsonl:3: key 'positive' is given twice"):
        read_pairs(path)


def test_cli_key_values_are_read_strictly():
    assert _key_values(["coef=1e-3", "n=3", "flag=true", "name=text", f"vector=v.safetensors:{HOOK}"]) == {
        "coef": 0.001,
        "n": 3,
        "flag": True,
        "name": "text",
        "vector": f"v.safetensors:{HOOK}",
    }
    for item, fragment in [("layer=010", "write 10"), ("flag=yes", "write true or false"), ("at=1:30", "write 90")]:
        with pytest.raises(SystemExit, match=f"{item}: .*{fragment}"):
            _key_values([item])
    with pytest.raises(SystemExit, match="layer is given twice"):
        _key_values(["layer=3", "layer=4"])


@pytest.mark.parametrize(
    ("item", "field"),
    [
        ({"op": "scale", "coef": "1.5"}, "coef"),
        ({"op": "scale", "coef": True}, "coef"),
        ({"op": "add", "vector": ["1.5", 2.0]}, "vector"),
        ({"op": "add", "vector": [True, 1.0]}, "vector"),
        ({"op": "scale", "positions": ["3"]}, "positions"),
        ({"op": "add", "sae": "sae", "feature": True}, "feature"),
    ],
)
def test_numeric_fields_refuse_strings_and_bools(item, field):
    with pytest.raises(SpecError, match=rf"sample 1: interventions\.0\.{field}"):
        parse_request_spec({"interventions": [{"hook": HOOK, **item}]}, "sample 1")


def test_numeric_capture_and_instrument_settings_refuse_strings_and_bools():
    with pytest.raises(SpecError, match=r"capture\.top_k"):
        parse_request_spec({"capture": {"sae": "sae", "top_k": True}}, "x")
    for name, value in [("max_stack", True), ("max_vectors", "64"), ("capture_bytes_per_request", 1.0e6)]:
        with pytest.raises(ValueError, match=name):
            InstrumentConfig(**{name: value})
    assert parse_request_spec({"interventions": [{"hook": HOOK, "op": "scale", "coef": 4}]}).interventions[0].coef == 4


class Opens:
    """Counts the opens of one file (inotify IN_OPEN), whichever library opens it (safetensors' Rust too)."""

    IN_OPEN = 0x20

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0 and libc.inotify_add_watch(self.fd, bytes(path), self.IN_OPEN) >= 0

    def since_last(self) -> int:
        """Opens since the last call (read after each step: inotify merges identical unread events)."""
        try:
            return len(os.read(self.fd, 1 << 16)) // 16  # a watched file's events carry no name: 16 bytes each
        except BlockingIOError:
            return 0

    def close(self) -> None:
        os.close(self.fd)


def save(kind: str, path: Path, values: torch.Tensor) -> str:
    """``values`` as the tensor ``v`` of a file of ``kind``, next to a tensor ``w``; the reference to ``v``."""
    tensors = {"v": values, "w": torch.zeros(4)}
    if kind == "safetensors":
        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)
    return f"{path}:v"


@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_a_vector_file_is_read_once_until_it_is_rewritten(tmp_path, kind):
    path = tmp_path / f"vectors.{kind}"
    ref = save(kind, path, torch.arange(4.0))
    opens = Opens(path)
    try:
        assert torch.equal(load_vector(ref, 4), torch.arange(4.0)) and opens.since_last() >= 1
        again = load_vector(ref, 4)
        assert torch.equal(again, torch.arange(4.0)) and opens.since_last() == 0  # from the cache
        again += 1  # a caller's copy: changing it leaves the cache alone
        assert torch.equal(load_vector(ref, 4), torch.arange(4.0)) and opens.since_last() == 0
        before = path.stat()
        new = tmp_path / "new" / path.name  # the same name: torch.save writes it into the file
        new.parent.mkdir()
        save(kind, new, torch.arange(4.0) * -1)
        path.write_bytes(new.read_bytes())  # in place (the same inode), the same size, and the same mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        while path.stat().st_ctime_ns == before.st_ctime_ns:  # a coarse clock: wait for a tick the kernel records
            time.sleep(0.005)
            os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = path.stat()
        assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)
        assert torch.equal(load_vector(ref, 4), torch.arange(4.0) * -1) and opens.since_last() >= 1
    finally:
        opens.close()


def test_a_vector_read_is_a_copy_that_a_rewrite_of_its_file_leaves_alone(tmp_path):
    """safetensors maps the file (MAP_SHARED): a tensor left on that mapping would change with the file,
    and a truncated file would end the process (SIGBUS) when the vector is next read."""
    path = tmp_path / "v.safetensors"
    save("safetensors", path, torch.ones(4))
    vector = read_vector_file(f"{path}:v")
    data = bytearray(path.read_bytes())
    offset = data.index(torch.ones(4).numpy().tobytes())
    data[offset : offset + 16] = torch.full((4,), 2.0).numpy().tobytes()
    with path.open("r+b") as handle:  # in place, as a tool that rewrites the file would
        handle.write(data)
    assert torch.equal(vector, torch.ones(4))


def faults() -> int:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def test_a_vector_named_inside_a_large_checkpoint_reads_that_tensor_alone(tmp_path):
    """The decoy: 384 MiB of FP6 (sparse on disk), which torch cannot hold: decoding it fails, and reading
    it would fault in its pages (at least one per 64 KiB)."""
    warm = tmp_path / "warm.safetensors"
    save("safetensors", warm, torch.ones(4))
    read_vector_file(f"{warm}:v")  # imports done before counting
    size = 3 << 27
    header = {
        "decoy": {"dtype": "F6_E2M3", "shape": [size // 3 * 4], "data_offsets": [0, size]},
        "v": {"dtype": "F32", "shape": [4], "data_offsets": [size, size + 16]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = tmp_path / "checkpoint.safetensors"
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(text)) + text)
        handle.seek(8 + len(text) + size)
        handle.write(torch.arange(4.0).numpy().tobytes())
    before = faults()
    assert torch.equal(load_vector(f"{path}:v", 4), torch.arange(4.0))
    assert faults() - before < 1000
    with pytest.raises(SpecError, match="has no tensor 'x'; it has"):
        load_vector(f"{path}:x", 4)


def test_the_vector_cache_is_bounded_in_bytes_and_drops_the_least_recently_used(tmp_path, monkeypatch):
    from inspect_tl_vllm.vectors import files

    monkeypatch.setattr(files, "VECTOR_CACHE_BYTES", 40)  # two 4-entry float32 vectors, not three
    refs, opens = {}, {}
    for name in "abc":
        refs[name] = save("safetensors", tmp_path / f"{name}.safetensors", torch.ones(4))
        opens[name] = Opens(tmp_path / f"{name}.safetensors")
    try:
        for name in "abac":  # c pushes out b, the least recently used
            read_vector_file(refs[name])
        assert [opens[name].since_last() > 0 for name in "abc"] == [True, True, True]
        read_vector_file(refs["a"])
        read_vector_file(refs["c"])
        assert [opens[name].since_last() > 0 for name in "ac"] == [False, False]
        read_vector_file(refs["b"])
        assert opens["b"].since_last() > 0
        big = save("safetensors", tmp_path / "big.safetensors", torch.ones(16))  # 64 bytes: never kept
        big_opens = Opens(tmp_path / "big.safetensors")
        for _ in range(2):
            read_vector_file(big)
            assert big_opens.since_last() > 0
        big_opens.close()
    finally:
        for counter in opens.values():
            counter.close()
