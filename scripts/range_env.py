"""A throwaway environment for testing this package at another end of its version ranges.

Installing vLLM takes minutes and gigabytes, so the environment is an overlay: a new virtual
environment that sees every package of the project's ``.venv`` (through a ``.pth`` file) except
inspect-ai, this package and the packages pinned on the command line, which it installs itself
from PyPI.  Then, with ``--wheel``, it builds this package's wheel and installs it *with its
dependencies*, the way a researcher adds the plugin to an environment that already holds Inspect,
and reports which distributions that install changed.

    python scripts/range_env.py DIR --oldest            # inspect-ai and transformers at their lower bounds
    python scripts/range_env.py DIR --pin inspect-ai     # the newest inspect-ai PyPI serves
    python scripts/range_env.py DIR --oldest --wheel     # ... then install the wheel, print what changed

Prints one JSON object: the environment's python, the versions it holds and, with ``--wheel``,
``changed`` ({name: [before, after]} of every distribution the wheel's install added, removed or
moved).  Exits 1 when that install changed anything but this package.  Run it with the project's
``.venv/bin/python``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "inspect-tl-vllm"
RANGED = ("inspect-ai", "transformers")
"""The dependencies whose whole declared range is tested (the newest by the main suite)."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The normalized distribution name a requirement string names (``"inspect-ai>=0.3"`` ->
    ``"inspect-ai"``)."""
    return normalized(re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0])


def lower_bounds() -> list[str]:
    """``name==lower`` for each ranged dependency, read from pyproject.toml so the oldest end
    tested is always the one declared."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = []
    for name in RANGED:
        spec = next(d for d in declared if requirement_name(d) == name)
        lower = re.search(r">=\s*([^,\s]+)", spec)
        if lower is None:
            raise SystemExit(f"range_env: pyproject.toml declares {spec!r} with no lower bound (>=)")
        pins.append(f"{name}=={lower.group(1)}")
    return pins


def shadowed_entries(names: set[str]) -> set[str]:
    """Top-level site-packages entries (packages, dist-info folders, .pth files) that belong to
    the named distributions in the running (project) environment."""
    entries: set[str] = set()
    for dist in md.distributions():
        if normalized(dist.metadata["Name"] or "") not in names:
            continue
        for file in dist.files or []:
            parts = Path(file).parts
            if parts and parts[0] != "..":
                entries.add(parts[0])
    return entries


def build_base(base: Path, hidden: set[str]) -> None:
    """Symlinks to the project environment's packages, less the hidden ones."""
    site = Path(sysconfig.get_paths()["purelib"])
    base.mkdir(parents=True)
    for entry in site.iterdir():
        if entry.name in hidden or entry.suffix == ".pth" or entry.name == "__pycache__":
            continue
        (base / entry.name).symlink_to(entry)


def installed(python: Path) -> dict[str, str]:
    """{normalized name: version} as the environment resolves them (first on sys.path wins)."""
    code = (
        "import importlib.metadata as m, json, re\n"
        "seen = {}\n"
        "for d in m.distributions():\n"
        "    n = re.sub(r'[-_.]+', '-', d.metadata['Name'] or '').lower()\n"
        "    seen.setdefault(n, d.version)\n"
        "print(json.dumps(seen))\n"
    )
    return json.loads(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout)


def pip(python: Path, *args: str) -> None:
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        noise = "WARNING: Location"
        sys.stderr.write("\n".join(line for line in result.stderr.splitlines() if noise not in line) + "\n")
        raise SystemExit(f"range_env: pip install {' '.join(args)} failed")


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    return next(out.glob("inspect_tl_vllm-*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="folder for the environment (replaced if it exists)")
    parser.add_argument("--oldest", action="store_true", help="pin inspect-ai and transformers to their lower bounds")
    parser.add_argument("--pin", action="append", default=[], help="a requirement to install first (repeatable)")
    parser.add_argument("--wheel", action="store_true", help="then build and install this package's wheel")
    args = parser.parse_args(argv)

    pins = [*(lower_bounds() if args.oldest else []), *args.pin]
    pinned = {requirement_name(p) for p in pins}
    hidden = shadowed_entries({"inspect-ai", PACKAGE, *pinned})
    if args.dir.exists():
        shutil.rmtree(args.dir)
    build_base(args.dir / "base", hidden)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(args.dir / "env")], check=True)
    python = args.dir / "env" / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(purelib) / "zz_project_env.pth").write_text(str((args.dir / "base").resolve()) + os.linesep)
    if "inspect-ai" not in pinned:
        pins.append(f"inspect-ai=={md.version('inspect-ai')}")
    pip(python, *pins)
    report: dict[str, object] = {"python": str(python), "pins": pins}
    before = installed(python)
    if args.wheel:
        wheel = build_wheel(args.dir / "dist")
        pip(python, str(wheel))
        after = installed(python)
        changed = {
            name: [before.get(name), after.get(name)]
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
        }
        report["changed"] = changed
        before = after
    report["versions"] = {name: before[name] for name in (*RANGED, PACKAGE) if name in before}
    print(json.dumps(report))
    unexpected = set(report.get("changed", {})) - {PACKAGE}  # type: ignore[arg-type]
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
