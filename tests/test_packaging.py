"""What pyproject.toml declares against what the code imports; extras; the built package.

The wheel/sdist test builds both, installs them in a fresh virtual environment
and runs a preset there. It needs the package index and a few minutes, so it
runs only with FEDJAX_SIM_PACKAGING_TESTS=1 (CI sets it: .ci/run).
"""

from __future__ import annotations

import ast
import builtins
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sim import cli, extras
from fedjax_sim.data import tfds_local

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# Declared but never imported, each for a stated reason.
RUN_NOT_IMPORTED = {
    # tensorflow-datasets imports it (tensorflow_datasets/core/dataset_builder.py) without
    # declaring it.
    "importlib-resources": "tfds",
    "pytest-xdist": "test",  # `pytest -n 2` in CI
    "nbmake": "test",  # `pytest --nbmake`: executes the notebooks
    "build": "test",  # test_wheel_and_sdist_install_and_run
    "ruff": "dev",  # the linter
    # `mkdocs build --strict` (.ci/run); docs/hooks.py imports mkdocs, outside the package.
    "mkdocs": "docs",
    "mkdocs-material": "docs",
    "mkdocstrings-python": "docs",
    # mkdocs.yml's pymdownx.arithmatex (the formulas); loaded by MkDocs, not imported.
    "pymdown-extensions": "docs",
}


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.\-]+", requirement)[0]).lower()


def _declared() -> dict[str, set[str]]:
    """Distribution names per group: "" for the dependencies, else the extra."""
    groups = {"": {_name(r) for r in PYPROJECT["dependencies"]}}
    for extra, reqs in PYPROJECT["optional-dependencies"].items():
        groups[extra] = {_name(r) for r in reqs if not r.startswith("fedjax_sim[")}
    return groups


def _imported_modules(folder: Path) -> set[str]:
    """Top-level modules imported anywhere in folder's .py files (lazy imports included)."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    # The folder's own modules, and the benchmarks' (tests of benchmarks/ import them).
    local = {p.stem for d in (folder, ROOT / "benchmarks") for p in d.glob("*.py")}
    local.add("fedjax_sim")
    return {m for m in found - local if m not in sys.stdlib_module_names}


def _distributions(modules: set[str]) -> dict[str, str]:
    """module -> normalised distribution name, from this environment's installed metadata."""
    owners = importlib.metadata.packages_distributions()
    out = {}
    for module in modules:
        assert module in owners, f"{module} is imported but no installed distribution has it"
        out[module] = _name(owners[module][0])
    return out


def test_every_import_is_declared_and_every_declaration_imported():
    groups = _declared()
    package = _distributions(_imported_modules(ROOT / "fedjax_sim"))
    tests = _distributions(_imported_modules(ROOT / "tests"))
    runtime = groups[""].union(*(groups[extra] for extra in extras.EXTRAS))
    for module, dist in package.items():
        if dist == "jaxlib":  # jax's own (its version is recorded); jax pins it
            continue
        assert dist in runtime, f"fedjax_sim imports {module} ({dist}), not declared"
    for module, dist in tests.items():
        assert dist in runtime | groups["test"], f"tests import {module} ({dist}), not declared"
    used = set(package.values()) | set(tests.values())
    for extra, names in groups.items():
        for dist in names - used:
            assert RUN_NOT_IMPORTED.get(dist) == (extra or "dependencies"), (
                f"{dist} is declared ({extra or 'dependencies'}) but nothing imports it")
    # jax brings its own jaxlib; declaring it separately only invites a mismatch.
    assert "jaxlib" not in groups[""]


def test_extras_are_declared_and_all_and_test_pull_them():
    optional = PYPROJECT["optional-dependencies"]
    names = _declared()
    for extra, modules in extras.EXTRAS.items():
        dists = {_name(importlib.metadata.packages_distributions()[m][0]) for m in modules}
        assert dists <= names[extra], (extra, dists)
    assert optional["all"] == [f"fedjax_sim[{','.join(extras.EXTRAS)}]"]
    assert "fedjax_sim[all]" in optional["test"]


def test_every_lower_bound_is_pinned_in_constraints_min():
    pins = {}
    for line in (ROOT / "constraints-min.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_name(name)] = version
    for requirement in PYPROJECT["dependencies"]:
        name, bound = _name(requirement), requirement.split(">=")[1]
        assert pins.get(name) == bound, (
            f"{requirement}: constraints-min.txt must pin the lower bound it tests")


def _block(monkeypatch, module):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)


def _pip_line(extra: str) -> str:
    """What a user types to install `extra`'s requirements as pyproject.toml declares
    them, and the extra's own name for a checkout."""
    declared = PYPROJECT["optional-dependencies"][extra]
    quoted = " ".join(f"'{r}'" for r in declared)
    return f"pip install {quoted} (the extra '{extra}'; in a checkout: pip install -e '.[{extra}]')"


@pytest.mark.parametrize("extra", sorted(extras.EXTRAS))
def test_the_requirements_of_each_extra_are_those_pyproject_declares(extra):
    assert extras.requirements(extra) == [
        r.replace(" ", "") for r in PYPROJECT["optional-dependencies"][extra]]


def test_require_names_the_pip_line(monkeypatch):
    _block(monkeypatch, "rdkit")
    assert _pip_line("molecules") == ("pip install 'rdkit>=2026.9.1' (the extra 'molecules'; "
                                      "in a checkout: pip install -e '.[molecules]')")
    with pytest.raises(ValueError, match=re.escape(_pip_line("molecules"))):
        extras.require("rdkit", "molecules", "dataset=esol")
    with pytest.raises(ValueError, match="extra 'molecules' does not provide module 'scipy'"):
        extras.require("scipy", "molecules")


@pytest.mark.parametrize("command, args, module, extra", [
    ("compare", ["drflm-esol"], "rdkit", "molecules"),
    ("compare", ["ifca-rotated-cifar", "--set", "data_dir={data}"], "tensorflow_datasets",
     "tfds"),
    ("run", ["ifca-synthetic-tiny", "--tensorboard"], "tensorboardX", "tensorboard"),
])
def test_preset_needing_a_missing_extra_exits_2_and_writes_nothing(
        tmp_path, capsys, monkeypatch, command, args, module, extra):
    data = tmp_path / "data"
    data.mkdir()  # exists, holds no .npz: reading it needs tfds
    _block(monkeypatch, module)
    out = tmp_path / "out"
    args = [a.format(data=data) for a in args]
    assert cli.main([command, *args, "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert _pip_line(extra) in err, err
    assert module in err
    assert not out.exists()


def test_tfds_reader_without_tfds_names_the_extra(tmp_path, monkeypatch):
    _block(monkeypatch, "tensorflow_datasets")
    with pytest.raises(ValueError, match=re.escape(_pip_line("tfds"))):
        tfds_local.load_images("cifar10", tmp_path, "train")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FEDJAX_SIM_PACKAGING_TESTS") != "1",
                    reason="builds and installs in a fresh venv from the package index "
                           "(minutes); set FEDJAX_SIM_PACKAGING_TESTS=1 (CI does)")
def test_wheel_and_sdist_install_and_run(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = dist.glob("fedjax_sim-*.whl")
    (sdist,) = dist.glob("fedjax_sim-*.tar.gz")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "-c", str(ROOT / "constraints.txt")]
    # Outside the checkout, so the installed package is the one imported.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for archive, extra in ((wheel, ""), (sdist, "--force-reinstall --no-deps")):
        subprocess.run([*pip, *extra.split(), str(archive)], check=True, env=env, cwd=tmp_path)
        out = tmp_path / f"run-{archive.suffix}"
        done = subprocess.run(
            [str(venv / "bin" / "fedjax-sim"), "run", "ifca-synthetic-tiny", "--out", str(out),
             "--no-progress"], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (out / "summary.json").is_file()
        where = subprocess.run(
            [str(venv / "bin" / "python"), "-c", "import fedjax_sim; print(fedjax_sim.__file__)"],
            capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
        assert str(venv) in where, where
    # The sdist carries the license.
    names = subprocess.run(["tar", "tzf", str(sdist)], capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(n.endswith("/LICENSE") for n in names)
