"""Mistakes a user can make before any engine runs get errors that name the input and the fix.

None of these tests boots an engine: each error must come before one would boot, which is the
point (a lazily booted engine would otherwise fail at the first sample, after the eval started).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from conftest import VLLM_VERSION
from inspect_tl_vllm.aliases import ALIASES
from inspect_tl_vllm.specs import SpecError


@pytest.fixture
def hub_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub requests: without a network transformers would retry for 25 s before giving up."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A folder that passes for a model by name; the errors tested here come before it is loaded."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _assert_says_what_was_tried(message: str, name: str) -> None:
    assert f"unknown model {name!r}" in message
    assert all(alias in message for alias in ALIASES)  # the aliases are listed
    assert str(Path(name).absolute()) in message  # the folder it looked for
    assert "Hugging Face id" in message and "OSError" in message  # and the hub, with transformers' reason


def test_unknown_model_in_the_provider_says_what_was_tried(hub_offline: None) -> None:
    from inspect_ai.model import get_model

    with pytest.raises(SpecError) as raised:
        get_model("tl-vllm/no-such-model")
    _assert_says_what_was_tried(str(raised.value), "no-such-model")


def test_unknown_model_in_the_python_api_gets_the_same_error(hub_offline: None) -> None:
    from inspect_tl_vllm.engine.construct import construct_instrumented_llm

    with pytest.raises(SpecError) as raised:
        construct_instrumented_llm("no-such-model")
    _assert_says_what_was_tried(str(raised.value), "no-such-model")


def test_alias_of_a_missing_hub_model_names_the_id_and_the_download(
    hub_offline: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspect_tl_vllm.aliases import resolve_model

    monkeypatch.setitem(ALIASES, "absent", "tlvllm-tests/absent-model")
    with pytest.raises(
        SpecError, match="'absent' is an alias of the Hugging Face id 'tlvllm-tests/absent-model'"
    ) as raised:
        resolve_model("absent")
    assert "hf download tlvllm-tests/absent-model" in str(raised.value)


REFUSED_ENGINE_ARGS = [
    (
        {"additional_config": {"tlvllm": {"max_stack": 4}}},
        "additional_config['tlvllm'] is set by tl-vllm",
        "-M hook_points",
    ),
    ({"speculative_config": {"method": "ngram"}}, "engine argument speculative_config=", "speculative decoding"),
    ({"enable_dbo": True}, "engine argument enable_dbo=True", "micro-batches"),
    ({"worker_extension_cls": "my.Extension"}, "engine argument worker_extension_cls=", "its own worker extension"),
    ({"data_parallel_size": 2}, "engine argument data_parallel_size=2", "run one eval per replica"),
]


@pytest.mark.parametrize(("engine_args", "names", "explains"), REFUSED_ENGINE_ARGS)
@pytest.mark.parametrize("as_json", [False, True], ids=["dict", "json"])
def test_refused_engine_args_fail_when_the_model_is_constructed(
    model_folder: Path, engine_args: dict, names: str, explains: str, as_json: bool
) -> None:
    from inspect_ai.model import get_model

    from inspect_tl_vllm.provider import engine_pool

    before = engine_pool.engines()
    value = json.dumps(engine_args) if as_json else engine_args  # -M engine_args='{...}' arrives as text
    with pytest.raises(SpecError) as raised:
        get_model(f"tl-vllm/{model_folder}", engine_args=value)
    assert names in str(raised.value) and explains in str(raised.value)
    assert engine_pool.engines() == before  # refused before an engine (even a lazy one) was set up


def test_plugin_exclusion_fails_when_the_model_is_constructed(
    model_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from inspect_ai.model import get_model

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    with pytest.raises(SpecError, match="VLLM_PLUGINS='some_other_plugin' excludes 'inspect_tl_vllm'"):
        get_model(f"tl-vllm/{model_folder}")


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text("a file, not a folder")
    return path


def test_import_vector_out_under_a_file_is_a_clear_error(
    tmp_path: Path, a_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import numpy as np

    from inspect_tl_vllm.cli import main

    source = tmp_path / "direction.npy"
    np.save(source, np.ones(8, dtype=np.float32))
    out = a_file / "vector.safetensors"
    assert main(["import-vector", str(source), "--hook", "blocks.0.hook_resid_post", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert f"import-vector: --out {out}: cannot be created: {a_file} is a file, not a folder" in error
    assert "Traceback" not in error
    assert a_file.read_text() == "a file, not a folder"


HOOK = "--hook blocks.0.hook_resid_post"


@pytest.mark.parametrize(
    ("command", "flag", "complaint"),
    [
        (f"import-vector v.npy {HOOK} --out {{dir}}", "--out", "is an existing folder"),
        (f"extract-vector pairs.jsonl {HOOK} --out {{file}}/deeper/v.safetensors", "--out", "is a file, not a folder"),
        ("demo --out {file}", "--out", "is an existing file"),
        ("demo --save-vector {file}/v.safetensors", "--save-vector", "is a file, not a folder"),
        ("sweep task.py --log-dir {file}/logs", "--log-dir", "is a file, not a folder"),
    ],
    ids=["import-vector-folder", "extract-vector", "demo-out", "demo-save-vector", "sweep-log-dir"],
)
def test_other_outputs_are_checked_before_any_work(
    tmp_path: Path, a_file: Path, capsys: pytest.CaptureFixture[str], command: str, flag: str, complaint: str
) -> None:
    from inspect_tl_vllm.cli import main

    argv = command.format(dir=tmp_path, file=a_file).split()
    assert main(argv) == 2  # before booting an engine or reading the (absent) inputs
    error = capsys.readouterr().err
    assert f"{argv[0]}: {flag} " in error and complaint in error


def test_sha256_vector_form_is_gone_and_reads_as_a_path(tmp_path: Path) -> None:
    from inspect_tl_vllm.provider.model_args import parse_model_args
    from inspect_tl_vllm.vectors.files import read_vector_file

    spec = tmp_path / "steer.yaml"
    spec.write_text("interventions:\n  - {hook: blocks.0.hook_resid_post, op: add, vector: 'sha256:0123abcd'}\n")
    vector = parse_model_args({"steer": str(spec)}).run_spec.interventions[0].vector
    assert vector == str(tmp_path / "sha256:0123abcd")  # relative to the spec file, like any vector path
    with pytest.raises(SpecError, match=f"vector file '{tmp_path / 'sha256'}' not found"):
        read_vector_file(vector)


@pytest.mark.parametrize(("package", "extra"), [("pyarrow", "parquet"), ("matplotlib", "report")])
def test_a_feature_whose_extra_is_missing_names_the_extra(monkeypatch, tmp_path, package, extra):
    from inspect_tl_vllm import activations
    from inspect_tl_vllm.research import sweep

    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(
        ImportError, match=rf"needs {package}, which is not installed: pip install 'inspect-tl-vllm\[{extra}\]'"
    ):
        if package == "pyarrow":
            activations.export_parquet([], tmp_path / "acts.parquet")
        else:
            sweep._plot([], tmp_path / "report.png", title="sweep")


def test_an_unsupported_vllm_is_left_untouched_and_refused_at_construction(monkeypatch):
    from vllm.v1.worker import gpu_worker

    from inspect_tl_vllm.engine import plugin
    from inspect_tl_vllm.engine.construct import construct_instrumented_llm

    def load_model(self):  # an unwrapped method: register() would wrap it for a supported vLLM
        return None

    monkeypatch.setattr(gpu_worker.Worker, "load_model", load_model)
    installed = VLLM_VERSION  # any release of the range: the suite runs on both ends
    monkeypatch.setattr(plugin, "VLLM_RANGE", ("0.0.1", "0.0.2"))
    plugin.register()
    assert gpu_worker.Worker.load_model is load_model
    refusal = (
        rf"tl-vllm instruments vLLM 0\.0\.1 up to \(not including\) 0\.0\.2, but vLLM {re.escape(installed)} is "
        r"installed.*`pip install 'vllm>=0\.0\.1,<0\.0\.2'`"
    )
    with pytest.raises(RuntimeError, match=refusal):
        construct_instrumented_llm("smollm2")
    monkeypatch.setattr(plugin, "VLLM_RANGE", (installed, "99"))
    plugin.register()
    assert gpu_worker.Worker.load_model is not load_model  # the check above could fail


@pytest.mark.parametrize(
    ("version", "supported", "warned"),
    [
        ("0.20.1", False, False),
        ("0.20.2", True, False),
        ("0.26.0", True, False),
        ("0.32.0", True, False),
        ("0.33.0", True, True),
        ("0.34.1.dev7+g1234abc", True, True),
        ("0.35.0", False, False),
        ("1.0.0", False, False),
    ],
)
def test_the_vllm_range_admits_its_releases_and_warns_past_those_the_tests_run(monkeypatch, version, supported, warned):
    from inspect_tl_vllm.engine import plugin

    monkeypatch.setattr(plugin, "installed_vllm", lambda: version)
    assert (plugin.unsupported_vllm() is None) is supported
    note = plugin.untested_vllm()
    assert (note is not None) is warned
    if warned:
        assert f"vLLM {version} is newer than the releases tl-vllm's tests run" in note
        assert "tl-vllm verify" in note


def test_a_model_runner_tl_vllm_does_not_know_is_refused_by_name() -> None:
    """A worker whose runner is neither of vLLM's (no V1 ``_preprocess`` and batch, no V2
    ``prepare_inputs`` and request states) fails at load, naming the runner."""
    from types import SimpleNamespace

    from inspect_tl_vllm.engine.worker import attach

    class GPUModelRunner:
        pass

    worker = SimpleNamespace(
        vllm_config=SimpleNamespace(additional_config={"tlvllm": {}}), model_runner=GPUModelRunner()
    )
    with pytest.raises(RuntimeError, match=r"GPUModelRunner is neither of the vLLM model runners tl-vllm instruments"):
        attach(worker)
    assert not hasattr(worker, "_tlvllm")
