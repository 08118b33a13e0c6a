"""The guides and the API reference agree: every function a guide names resolves as written
and has an entry in the API reference, and the guides' Python code runs.

Guides: README.md and the hand-written pages of docs/ (not the generated presets page,
not the API reference itself). What a guide names:

* in its ```python blocks: each name imported from fedjax_sim, and each attribute reached
  through one (`simulate.run`, `partition.dirichlet_partition`);
* in its prose, each code span's name: dotted from `fedjax_sim` (`fedjax_sim.io.read_csv`),
  from a module of fedjax_sim by its short name (`parallel.make_mesh(n)`), or from a name
  the guide's code imports or a package of fedjax_sim exports (`describe_preset(name)`,
  `FederatedData.from_clients`). Spans that are paths, file names or shell commands, and
  names the guide's own code defines (Extending's new algorithm), are left out.

Each name must resolve the way a reader would use it: imports as Python imports them, a
call in prose by attribute access from its first part (so `algorithms.ifca.evaluate_clusters(...)`
fails: `fedjax_sim.algorithms.ifca` is the factory, not the module). Each function, class
and module so named must be in the site's inventory (objects.inv, which mkdocstrings
writes for every object it documents), under the name as written or where it is
defined. The site is built once (tests/docs_site.py).

The Python guide's code blocks run in order in one fresh interpreter, in a temporary
directory, as the guide says they do, and so does the README's quick start (about a
minute of CPU and half a minute: both marked slow).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from docs_site import ROOT, built_site, inventory

GUIDES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                      if p.name != "presets.md")]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# A dotted name, not inside a word, a path, a quoted string or after `=` (a value).
NAME = re.compile(r"(?<![\w./\-\"'=])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?![\w.\"'])(\()?")
FILE_NAME = re.compile(r"\.(?:py|csv|json|png|md|npz|toml|yml|yaml|txt|cff|gz|bz2|ipynb)\b")
COMMAND = re.compile(r"^\s*(?:fedjax-sim|python3?|pip|pytest|mkdocs|git|ruff|bash)\b")
# Where a name that is not dotted from fedjax_sim may come from, in this order (after the
# guide's own imports): the package's top level, then its packages' exports.
PACKAGES = ("fedjax_sim", "fedjax_sim.algorithms", "fedjax_sim.data", "fedjax_sim.models",
            "fedjax_sim.ops", "fedjax_sim.experiments")


def python_blocks(text: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(text) if m.group(1) == "python"]


def _parse(block: str) -> ast.AST:
    """A code block's syntax tree; an excerpt with `...` for elided entries (Extending's
    registry lines) is parsed without them, or as its import lines alone."""
    try:
        return ast.parse(block)
    except SyntaxError:
        pass
    try:
        return ast.parse(re.sub(r"(?m)^\s*\.\.\.,?\s*$", "", block))
    except SyntaxError:
        imports = re.findall(r"(?m)^(?:from \S+ )?import [^(\n]+$", block)
        return ast.parse("\n".join(imports))


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> the fedjax_sim path it was imported as (`from M import a`: `M:a`)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "fedjax_sim":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}:{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fedjax_sim":
                    names[alias.asname or "fedjax_sim"] = alias.name if alias.asname \
                        else "fedjax_sim"
    return names


def _defined(tree: ast.AST) -> set[str]:
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.ClassDef)}


def _load(reference: str):
    """A reference of `_imports` or a dotted name: `M:a` imports M, then takes a (or the
    submodule M.a); a dotted name takes attributes from its first part, as written."""
    if ":" in reference:
        module_name, attribute = reference.split(":")
        module = importlib.import_module(module_name)
        if hasattr(module, attribute):
            return getattr(module, attribute)
        return importlib.import_module(f"{module_name}.{attribute}")
    head, *rest = reference.split(".")
    obj = importlib.import_module(head)
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _namespace() -> dict[str, object]:
    """Names a guide may use without importing them: fedjax_sim's modules by their short
    name, then its packages' exports (the earlier wins)."""
    names: dict[str, object] = {}
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        exported = getattr(package, "__all__", None) or [
            n for n in vars(package) if not n.startswith("_")]
        for name in exported:
            names.setdefault(name, getattr(package, name))
    for path in sorted((ROOT / "fedjax_sim").iterdir()):
        stem = path.stem if path.suffix == ".py" else path.name
        if not stem.startswith("_") and (path.suffix == ".py" or (path / "__init__.py").exists()):
            module = importlib.import_module(f"fedjax_sim.{stem}")
            names.setdefault(stem, module)
            names[stem] = names[stem] if isinstance(names[stem], types.ModuleType) else module
    return names


def named(path: Path) -> list[tuple[str, str]]:
    """(the name as the guide writes it, how to resolve it) for each name the guide uses."""
    text = path.read_text()
    blocks = python_blocks(text)
    trees = [_parse(block) for block in blocks]
    imported: dict[str, str] = {}
    defined: set[str] = set()
    for tree in trees:
        imported.update(_imports(tree))
        defined |= _defined(tree)
    found: dict[str, str] = {}
    for tree in trees:  # the imports, and attributes reached through them
        for reference in _imports(tree).values():
            if not set(re.split(r"[.:]", reference)) & defined:
                found[reference.replace(":", ".")] = reference
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, base = [node.attr], node.value
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if isinstance(base, ast.Name) and base.id in imported:
                    written = ".".join([base.id, *reversed(chain)])
                    found[written] = f"{imported[base.id]}.{'.'.join(reversed(chain))}"
    namespace = _namespace()
    for match in SPAN.finditer(FENCE.sub("", text)):
        span = " ".join(match.group(2).split())
        if "/" in span or FILE_NAME.search(span) or COMMAND.match(span):
            continue
        for name_match in NAME.finditer(span):
            name = name_match.group(1)
            head = name.split(".")[0]
            if set(name.split(".")) & defined:
                continue
            call = "=" if name_match.group(2) else ""
            if head == "fedjax_sim":
                found[name] = call + name
            elif head in imported:
                found[name] = call + imported[head] + name[len(head):]
            elif head in namespace:
                found[name] = f"{call}@{head}{name[len(head):]}"
    return sorted(found.items())


def _resolve(reference: str, namespace: dict[str, object]):
    """The object a reference of `named` stands for (AttributeError, ImportError if none)."""
    call = reference.startswith("=")
    reference = reference.lstrip("=")
    if reference.startswith("@"):  # from the namespace, then attribute by attribute
        head, *rest = reference[1:].split(".")
        obj = namespace[head]
        for part in rest:
            obj = getattr(obj, part)
        return obj
    if ":" in reference:  # imported: `from M import a`, then attributes of a
        module_name, attributes = reference.split(":")
        first, *rest = attributes.split(".")
        obj = _load(f"{module_name}:{first}")
        for part in rest:
            obj = getattr(obj, part)
        return obj
    try:
        return _load(reference)
    except AttributeError:
        if call:  # a call must work as written
            raise
        # A location (`fedjax_sim.algorithms.ifca.evaluate_clusters` as where it lives):
        # the longest importable module, then attributes.
        parts = reference.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                for part in parts[cut:]:
                    obj = getattr(obj, part)
            except (ImportError, AttributeError):
                continue
            return obj
        raise


def _where_defined(obj) -> str | None:
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if inspect.ismethod(obj):
        module, qualname = obj.__func__.__module__, obj.__func__.__qualname__
    return f"{module}.{qualname}" if module and qualname else None


def _documentable(obj) -> bool:
    """A module, class or function of fedjax_sim (not data, not another library's)."""
    where = _where_defined(obj)
    return bool(where and where.startswith("fedjax_sim") and (
        isinstance(obj, types.ModuleType) or inspect.isclass(obj) or inspect.isroutine(obj)))


@pytest.fixture(scope="module")
def documented():
    return inventory(built_site())


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_function_a_guide_names_resolves_and_is_in_the_api_reference(path, documented):
    namespace = _namespace()
    unresolved, missing = [], []
    for written, reference in named(path):
        try:
            obj = _resolve(reference, namespace)
        except (AttributeError, ImportError) as err:
            unresolved.append(f"`{written}`: {type(err).__name__}: {err}")
            continue
        if not _documentable(obj):
            continue
        where = _where_defined(obj)
        full = reference.lstrip("=@").replace(":", ".")
        candidates = {written, full, where, f"fedjax_sim.{written}"}
        if not candidates & documented:
            missing.append(f"`{written}` ({where})")
    assert not unresolved, (f"{path.name} names what does not exist as written:\n  "
                            + "\n  ".join(unresolved))
    assert not missing, (f"{path.name} names functions the API reference (docs/api/) does "
                         "not document:\n  " + "\n  ".join(missing))


def test_the_name_extraction_finds_calls_imports_and_attributes(tmp_path):
    guide = tmp_path / "guide.md"
    guide.write_text(
        "Call `algorithms.ifca.evaluate_clusters(model, params, test)` or "
        "`fedjax_sim.io.read_csv`; `describe_preset(name)` lists them; "
        "`runs/tiny/metrics.csv` and `fedjax-sim run x` are not names.\n\n"
        "```python\nfrom fedjax_sim import simulate\nfrom fedjax_sim.data import partition\n"
        "simulate.run(a, b)\nparts = partition.dirichlet_partition(labels)\n"
        "def mine():\n    pass\n```\n\nAnd `mine(x)` is the guide's own.\n")
    found = dict(named(guide))
    assert set(found) == {"algorithms.ifca.evaluate_clusters", "fedjax_sim.io.read_csv",
                          "describe_preset", "fedjax_sim.simulate", "fedjax_sim.data.partition",
                          "simulate.run", "partition.dirichlet_partition"}, found
    namespace = _namespace()
    with pytest.raises(AttributeError):  # the factory function, not the module
        _resolve(found["algorithms.ifca.evaluate_clusters"], namespace)
    assert _resolve(found["partition.dirichlet_partition"], namespace).__name__ \
        == "dirichlet_partition"
    assert _resolve(found["describe_preset"], namespace).__module__ \
        == "fedjax_sim.experiments.runner"


# --------------------------------------------------------------------------- code blocks


def _run_python(code: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _session(blocks: list[str]) -> str:
    """The blocks as one script that says which block failed."""
    parts = [f"print('--- block {i + 1} of {len(blocks)}', flush=True)\n{block}"
             for i, block in enumerate(blocks)]
    return "\n".join(parts)


@pytest.mark.slow
def test_the_python_guide_runs_top_to_bottom(tmp_path):
    blocks = python_blocks((ROOT / "docs" / "python.md").read_text())
    assert len(blocks) >= 15
    proc = _run_python(_session(blocks), tmp_path, timeout=1800)
    assert proc.returncode == 0, (f"docs/python.md: {proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")
    assert (tmp_path / "runs" / "tiny" / "metrics.csv").is_file()


@pytest.mark.slow
def test_the_readme_python_quick_start_runs(tmp_path):
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) == 1
    proc = _run_python(_session(blocks), tmp_path, timeout=900)
    assert proc.returncode == 0, f"README.md: {proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "best restart" in proc.stdout
