"""`tl-vllm import-vector` (npy, pt, safetensors, llama.cpp/repeng GGUF control vectors) and the
Parquet export of stored activations."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from inspect_tl_vllm.cli import main
from inspect_tl_vllm.vectors.files import load_vector

HOOK = "blocks.1.hook_resid_post"
WIDTH = 8


class Trap:
    """Touches ``marker`` if it is ever unpickled: proof that a refused file was never loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def vector(seed: int, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(width, generator=torch.Generator().manual_seed(seed))


def write_control_vector(path: Path, tensors: dict[str, np.ndarray], arch: str = "controlvector") -> Path:
    """A GGUF laid out as repeng's export_gguf and llama.cpp's cvector-generator write it."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    writer.add_uint32(f"{arch}.layer_count", len(tensors))
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run_import(*args: str) -> int:
    return main(["import-vector", *[str(a) for a in args]])


def read_output(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()  # noqa: SIM118


@pytest.mark.parametrize("kind", ["npy", "pt", "pt-dict", "safetensors"])
def test_single_vector_formats_round_trip_with_provenance(tmp_path, capsys, kind):
    from safetensors.torch import save_file

    value = vector(0)
    src = tmp_path / f"source.{kind.split('-')[0]}"
    ref = str(src)
    if kind == "npy":
        np.save(src, value.numpy())
    elif kind == "pt":
        torch.save(value, src)
    elif kind == "pt-dict":
        torch.save({"other": vector(1), "mine": value}, src)
        ref = f"{src}:mine"
    else:
        save_file({"v": value.reshape(1, WIDTH)}, str(src))  # a (1, d) row is one vector
    out = tmp_path / "out.safetensors"
    assert run_import(ref, "--out", out, "--hook", HOOK, "--model", "tiny") == 0
    printed = capsys.readouterr().out
    assert f"{HOOK} width {WIDTH} norm {float(value.norm()):.3f}" in printed and f"{out}:{HOOK}" in printed
    tensors, meta = read_output(out)
    assert list(tensors) == [HOOK] and tensors[HOOK].dtype == torch.float32
    assert torch.equal(tensors[HOOK], value)
    assert meta["format"] == kind.split("-")[0] and meta["model"] == "tiny"
    assert meta["source"] == str(src.resolve()) and meta.get("source_key", "") == ref.partition(":")[2]
    assert meta["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    hooks = json.loads(meta["hooks"])  # the same layout extract-vector writes
    assert hooks == {HOOK: {"layer": 1, "norm": pytest.approx(float(value.norm()))}}
    assert torch.equal(load_vector(f"{out}:{HOOK}", WIDTH), value)


def test_gguf_control_vector_imports_every_layer_as_resid_post(tmp_path, capsys):
    directions = {layer: vector(layer) for layer in (1, 2, 5)}
    src = write_control_vector(tmp_path / "cv.gguf", {f"direction.{n}": v.numpy() for n, v in directions.items()})
    out = tmp_path / "cv.safetensors"
    assert run_import(src, "--out", out) == 0
    printed = capsys.readouterr().out
    assert "wrote 3 vectors (gguf-controlvector, model hint 'llama')" in printed
    tensors, meta = read_output(out)
    assert sorted(tensors) == [f"blocks.{n}.hook_resid_post" for n in (1, 2, 5)]
    for layer, value in directions.items():
        hook = f"blocks.{layer}.hook_resid_post"
        assert torch.equal(tensors[hook], value) and f"{hook} width {WIDTH}" in printed
        assert torch.equal(load_vector(f"{out}:{hook}", WIDTH), value)
        assert json.loads(meta["hooks"])[hook]["layer"] == layer
    assert meta["format"] == "gguf-controlvector" and meta["model_hint"] == "llama" and "model" not in meta
    assert meta["source_sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()


def test_a_pickled_pt_file_is_refused_and_never_unpickled(tmp_path, capsys):
    probe = tmp_path / "probe-fired"
    pickle.loads(pickle.dumps(Trap(probe)))
    assert probe.exists(), "the trap does not fire on unpickling; the test below would prove nothing"
    marker = tmp_path / "unpickled"
    src = tmp_path / "evil.pt"
    torch.save({"vector": vector(0), "payload": Trap(marker)}, src)
    out = tmp_path / "out.safetensors"
    assert run_import(src, "--out", out, "--hook", HOOK) == 2
    err = capsys.readouterr().err
    assert str(src) in err and "needs full unpickling" in err and "torch.save(tensor, path)" in err
    assert not marker.exists() and not out.exists()


BAD_CASES = [
    "missing file",
    "wrong extension",
    "no --hook",
    "unknown hook",
    "NaN",
    "not 1-D",
    "object npy",
    "out not safetensors",
    "out overwrites source",
    "not a gguf",
    "model gguf",
    "foreign tensor",
    "f16 direction",
    "2-D direction",
    "mixed widths",
    "inf in gguf",
    "gguf with --hook",
]


def bad_inputs(tmp: Path) -> dict[str, tuple[list[object], list[str]]]:
    """Per case: import-vector arguments and the texts its error must contain (the file and the fix)."""
    from safetensors.torch import save_file

    good = tmp / "good.npy"
    np.save(good, vector(0).numpy())
    save_file({"v": vector(0)}, str(tmp / "src.safetensors"))
    nan = vector(0).numpy()
    nan[3] = np.nan
    np.save(tmp / "nan.npy", nan)
    np.save(tmp / "matrix.npy", np.ones((2, WIDTH), np.float32))
    np.save(tmp / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    (tmp / "vec.txt").write_text("1 2 3")
    (tmp / "junk.gguf").write_bytes(b"not a gguf file at all")
    write_control_vector(tmp / "model.gguf", {"token_embd.weight": np.ones((4, WIDTH), np.float32)}, arch="llama")
    write_control_vector(
        tmp / "named.gguf", {"direction.1": np.ones(WIDTH, np.float32), "bias": np.ones(2, np.float32)}
    )
    write_control_vector(tmp / "f16.gguf", {"direction.1": np.ones(WIDTH, np.float16)})
    write_control_vector(tmp / "flat.gguf", {"direction.1": np.ones((2, WIDTH), np.float32)})
    write_control_vector(
        tmp / "widths.gguf", {"direction.1": np.ones(WIDTH, np.float32), "direction.2": np.ones(4, np.float32)}
    )
    infinite = vector(0).numpy()
    infinite[0] = np.inf
    write_control_vector(tmp / "inf.gguf", {"direction.3": infinite})
    out, hook = ["--out", tmp / "out.safetensors"], ["--hook", HOOK]
    source = tmp / "src.safetensors"
    return {
        "missing file": ([tmp / "absent.npy", *out, *hook], ["absent.npy", "file not found"]),
        "wrong extension": ([tmp / "vec.txt", *out, *hook], ["vec.txt", "unsupported file type '.txt'", ".gguf"]),
        "no --hook": ([good, *out], ["good.npy", "--hook blocks.12.hook_resid_post"]),
        "unknown hook": ([good, *out, "--hook", "blocks.1.resid_post"], ["Did you mean"]),
        "NaN": ([tmp / "nan.npy", *out, *hook], ["nan.npy", "1 of 8 entries are NaN or inf"]),
        "not 1-D": ([tmp / "matrix.npy", *out, *hook], ["matrix.npy", "got shape (2, 8)", "single row"]),
        "object npy": ([tmp / "objects.npy", *out, *hook], ["objects.npy", "holds Python objects", "np.save"]),
        "out not safetensors": ([good, "--out", tmp / "out.pt", *hook], ["out.pt", "must be a .safetensors"]),
        "out overwrites source": ([source, "--out", source, *hook], ["src.safetensors", "overwrite the source"]),
        "not a gguf": ([tmp / "junk.gguf", *out], ["junk.gguf", "not a readable GGUF file"]),
        "model gguf": ([tmp / "model.gguf", *out], ["model.gguf", "'llama'", "not a control vector"]),
        "foreign tensor": ([tmp / "named.gguf", *out], ["named.gguf", "'bias' is not named direction.N"]),
        "f16 direction": ([tmp / "f16.gguf", *out], ["f16.gguf", "F16", "re-export it as float32"]),
        "2-D direction": ([tmp / "flat.gguf", *out], ["flat.gguf", "shape (2, 8)", "must be 1-D"]),
        "mixed widths": ([tmp / "widths.gguf", *out], ["widths.gguf", "different widths [4, 8]"]),
        "inf in gguf": ([tmp / "inf.gguf", *out], ["inf.gguf", "blocks.3.hook_resid_post", "NaN or inf"]),
        "gguf with --hook": ([tmp / "named.gguf", *out, *hook], ["named.gguf", "drop --hook"]),
    }


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_early_naming_the_file_and_the_fix(tmp_path, capsys, case):
    cases = bad_inputs(tmp_path)
    assert sorted(cases) == sorted(BAD_CASES)
    args, expected = cases[case]
    assert run_import(*args) == 2
    err = capsys.readouterr().err
    assert err.startswith("import-vector: ")
    for text in expected:
        assert text in err, f"{case}: {text!r} missing from {err!r}"
    assert not (tmp_path / "out.safetensors").exists()


def eval_log_with_activations(tmp: Path) -> Path:
    """A real Inspect log (mockllm, two samples, two epochs, a scorer), and activations stored beside it
    through the provider's storage writer: sample 1 per token (two hooks, one in bfloat16), sample 2
    reduced per sample, as ``-M capture_reduce=mean`` stores it."""
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ModelOutput, ModelUsage, get_model
    from inspect_ai.scorer import includes

    from inspect_tl_vllm.store.sample_store import activations_dir_for, write_sample

    task = Task(
        dataset=[Sample(id=1, input="Say hi", target="Default"), Sample(id=2, input="Say bye", target="nowhere")],
        scorer=includes(),
        epochs=2,
    )
    answer = ModelOutput.from_content("mockllm", "Default answer")
    answer.usage = ModelUsage(input_tokens=2, output_tokens=2, total_tokens=4)  # else mockllm fetches a tokenizer
    model = get_model("mockllm/model", custom_outputs=[answer] * 4)
    [log] = inspect_eval(task, model=model, log_dir=str(tmp / "logs"), display="none")
    assert log.status == "success", log.error
    directory = activations_dir_for(log.location, log.eval.eval_id, None).path
    for sample in log.samples:
        seed = 10 * int(sample.id) + sample.epoch
        if sample.id == 1:
            acts = {HOOK: torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(seed))}
            acts["blocks.2.hook_mlp_out"] = torch.randn(3, WIDTH).to(torch.bfloat16)
            reduce = "none"
        else:
            acts, reduce = {HOOK: vector(seed).reshape(1, WIDTH)}, "mean"
        write_sample(
            directory,
            eval_id=log.eval.eval_id,
            sample_id=sample.id,
            epoch=sample.epoch,
            sample_uuid=sample.uuid,
            activations=acts,
            tokens={hook: 3 for hook in acts},
            positions={hook: [4, 5, 9] for hook in acts} if reduce == "none" else None,
            extra={"model": "tiny", "reduce": reduce},
        )
    return Path(log.location)


def test_parquet_export_reads_back_the_numbers_load_gives(tmp_path, capsys):
    import pyarrow.parquet as pq

    from inspect_tl_vllm import activations

    log = eval_log_with_activations(tmp_path)
    out = tmp_path / "acts.parquet"
    assert main(["activations", str(log), "--export", str(out)]) == 0
    assert "exported 14 rows" in capsys.readouterr().out  # 2 epochs x (3 + 3 token rows, 1 reduced row)
    table = pq.read_table(out)
    assert table.schema.field("vector").type.list_size == WIDTH
    assert str(table.schema.field("vector").type.value_type) == "float"
    got = {(r["sample_id"], r["epoch"], r["hook"], r["position"]): r for r in table.to_pylist()}
    expected = {}
    for record in activations.load(log):
        for hook, tensor in record.activations.items():
            reduced = record.sample_id == 2
            for row, value in enumerate(tensor.float()):
                position = None if reduced else [4, 5, 9][row]  # the stored token positions
                expected[(record.sample_id, record.epoch, hook, position)] = (value, record.scores)
    assert got.keys() == expected.keys() and len(table) == 14
    for key, (value, scores) in expected.items():
        assert torch.equal(torch.tensor(got[key]["vector"], dtype=torch.float32), value), key
        assert got[key]["score_includes"] == scores["includes"] and scores["includes"] in ("C", "I")
    assert {r["score_includes"] for r in table.to_pylist()} == {"C", "I"}


def test_activations_export_refuses_other_file_types_before_reading_the_log(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["activations", str(tmp_path / "absent.eval"), "--export", str(tmp_path / "acts.csv")])
    assert "name a .npz or .parquet file" in capsys.readouterr().err


@pytest.mark.engine
def test_imported_control_vector_steers_the_engine_like_the_inline_vector(tiny_engine, tmp_path):
    """Both layers of a GGUF control vector, given as ``path:key``, against the same numbers inline."""
    directions = {layer: vector(layer, width=64) for layer in (1, 2)}
    src = write_control_vector(tmp_path / "cv.gguf", {f"direction.{n}": v.numpy() for n, v in directions.items()})
    out = tmp_path / "cv.safetensors"
    assert run_import(src, "--out", out, "--model", "tiny-llama") == 0
    hooks = {layer: f"blocks.{layer}.hook_resid_post" for layer in directions}
    from_file = [{"hook": hooks[n], "vector": f"{out}:{hooks[n]}", "coef": 4.0} for n in directions]
    inline = [{"hook": hooks[n], "vector": v.tolist(), "coef": 4.0} for n, v in directions.items()]
    prompt, capture = "Once upon a time", {"hooks": ["ln_final.hook_normalized"]}
    steered = tiny_engine.generate(prompt, max_tokens=12, steering=from_file, capture=capture)[0]
    reference = tiny_engine.generate(prompt, max_tokens=12, steering=inline, capture=capture)[0]
    assert steered.token_ids == reference.token_ids
    final, expected = steered.activations["ln_final.hook_normalized"], reference.activations["ln_final.hook_normalized"]
    assert float((final - expected).abs().max()) <= 1e-6 * float(expected.abs().max())  # same numbers, not just tokens
    assert all(item["fired"] for item in steered.receipt["interventions"])
    plain = tiny_engine.generate(prompt, max_tokens=12)[0]
    assert steered.token_ids != plain.token_ids, "steering had no visible effect; the test proves nothing"


def test_arrow_reader_streams_the_rows_the_parquet_export_writes(tmp_path):
    """Batches of at most about ``batch_rows`` rows, one schema, the same rows as the export; and
    ``iter_load`` reads a sample's file only when its record is reached."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from inspect_tl_vllm import activations

    log = eval_log_with_activations(tmp_path)
    out = tmp_path / "acts.parquet"
    assert activations.export_parquet(activations.load(log), out) == 14
    reader = activations.arrow_reader(log, batch_rows=3)
    batches = list(reader)
    assert len(batches) > 2 and all(b.num_rows <= 3 + 2 for b in batches)  # a sample's rows stay together
    streamed = pa.Table.from_batches(batches, schema=reader.schema)
    assert streamed.equals(pq.read_table(out))
    assert streamed.schema.field("sample_id").type == pa.int64()

    records = activations.iter_load(log)
    first = next(records)
    for path in activations_folder(log).glob("*.safetensors"):
        path.unlink()  # the other samples' files go after the first record was read
    with pytest.warns(activations.SkippedRecordWarning):
        assert list(records) == []
    assert first.sample_id == 1
    assert list(first.activations) == [HOOK, "blocks.2.hook_mlp_out"]  # the capture's order, every read
    with pytest.raises(ValueError, match="batch_rows must be within 1 and 2"):
        activations.arrow_reader(log, batch_rows=0)


def activations_folder(log: Path) -> Path:
    from inspect_ai.log import read_eval_log

    from inspect_tl_vllm.store.sample_store import activations_dir_for

    header = read_eval_log(str(log), header_only=True)
    return activations_dir_for(header.location, header.eval.eval_id, None).path


def test_parquet_export_refuses_vectors_of_two_widths(tmp_path):
    from inspect_tl_vllm.store.activations import SampleActivations, export_parquet

    records = [
        SampleActivations(sample_id=i, epoch=1, sample_uuid=str(i), scores={}, activations={HOOK: torch.zeros(1, w)})
        for i, w in enumerate((4, 8))
    ]
    with pytest.raises(ValueError, match="vectors of one width; found 4 and 8"):
        export_parquet(records, tmp_path / "acts.parquet")
    with pytest.raises(ValueError, match="found no activations"):
        export_parquet([], tmp_path / "acts.parquet")
