"""The notebooks in notebooks/ are committed as a researcher first sees them: executed, with
their outputs and plots, and written against the public API only.

pytest's `--nbmake` (pyproject.toml) re-executes each notebook; these tests read the
committed files: every code cell ran, in order, in one kernel, without an error; a cell
that prints or shows a figure kept what it printed or showed; every notebook holds at least
one PNG plot; no output names a path of the machine that ran it; and no code cell imports
`fedjax_sim.experiments` (the presets' internals: a notebook runs a preset through the
`fedjax-sim` command line) or reaches a `fedjax_sim` name that begins with an underscore.

Each notebook's install cell is run where `fedjax_sim` cannot be imported (pip replaced
by a recorder): with nothing to install from it stops with one line saying what to do;
with a wheel in the working directory, or with `FEDJAX_SIM_SOURCE` set, it asks pip for
`fedjax_sim` from exactly that source.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# A path of the machine that executed the notebook (a temporary directory, a home, a checkout).
MACHINE_PATH = re.compile(r"(/tmp/|/var/folders/|/home/|/root/|/Users/|/work/|[A-Za-z]:\\)")
# What makes a cell show something: a print, a figure, a display.
SHOWS = re.compile(r"\b(print|plt\.show|display)\(")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _code_cells(nb: dict) -> list[dict]:
    return [cell for cell in nb["cells"] if cell["cell_type"] == "code"]


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _python(cell: dict) -> str:
    """The cell's code with IPython's line magics and shell escapes blanked out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in _source(cell).splitlines())


def _output_text(output: dict) -> str:
    if output["output_type"] == "stream":
        text = output["text"]
    elif output["output_type"] == "error":
        text = "\n".join(output.get("traceback", []))
    else:
        text = output.get("data", {}).get("text/plain", "")
    return text if isinstance(text, str) else "".join(text)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "ifca_rotated_mnist.ipynb",
                                           "drflm_molecules.ipynb", "mixed_fl.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_an_id(path):
    nb = _load(path)
    assert (nb["nbformat"], nb["nbformat_minor"]) >= (4, 5), "cell ids need nbformat >= 4.5"
    ids = [cell.get("id") for cell in nb["cells"]]
    assert all(ids), f"{path.name}: cells without an id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_with_the_outputs_of_one_run(path):
    cells = _code_cells(_load(path))
    counts = [cell.get("execution_count") for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{path.name}: code cells not executed once each, top to bottom, in one kernel "
        f"(execution counts {counts})")
    for cell in cells:
        errors = [o for o in cell["outputs"] if o["output_type"] == "error"]
        assert not errors, f"{path.name}, cell {cell['id']}: an error was saved"
        if SHOWS.search(_python(cell)):
            assert cell["outputs"], f"{path.name}, cell {cell['id']}: it ran but saved no output"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_shows_a_plot(path):
    pngs = [o for cell in _code_cells(_load(path)) for o in cell["outputs"]
            if "image/png" in o.get("data", {})]
    assert pngs, f"{path.name}: no image/png output (a matplotlib plot) was saved"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_name_no_path_of_the_machine(path):
    for cell in _code_cells(_load(path)):
        for output in cell["outputs"]:
            found = MACHINE_PATH.search(_output_text(output))
            assert not found, (f"{path.name}, cell {cell['id']}: an output names a local path "
                               f"({found.group(0)!r}...)")


def _private_uses(code: str) -> list[str]:
    """fedjax_sim.experiments imports and underscore names reached from fedjax_sim."""
    tree = ast.parse(code)
    bad, bound = [], set()  # bound: local names that refer to fedjax_sim modules or objects

    def private(dotted: str) -> bool:
        parts = dotted.split(".")
        return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__"))
                   for p in parts) or parts[:2] == ["fedjax_sim", "experiments"]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fedjax_sim":
                    if private(alias.name):
                        bad.append(f"import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "fedjax_sim":
                for alias in node.names:
                    if private(f"{node.module}.{alias.name}"):
                        bad.append(f"from {node.module} import {alias.name}")
                    bound.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                dotted = ".".join([base.id, *reversed(chain)])
                if private(dotted):
                    bad.append(dotted)
    if re.search(r"\bfedjax_sim\.experiments\b", code):
        bad.append("fedjax_sim.experiments (named in the code)")
    return sorted(set(bad))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_uses_only_the_public_api(path):
    for cell in _code_cells(_load(path)):
        uses = _private_uses(_python(cell))
        assert not uses, f"{path.name}, cell {cell['id']}: non-public fedjax_sim use {uses}"


@pytest.mark.parametrize("code, found", [
    ("from fedjax_sim.experiments import get_preset", True),
    ("from fedjax_sim.experiments.base import RunContext", True),
    ("import fedjax_sim.experiments", True),
    ("import fedjax_sim\nfedjax_sim.experiments.PRESETS", True),
    ("from fedjax_sim.algorithms import _helpers", True),
    ("from fedjax_sim.algorithms._helpers import x", True),
    ("from fedjax_sim import simulate\nsimulate._scan_rounds", True),
    ("from fedjax_sim import ifca, sgd\nfrom fedjax_sim.data import images", False),
    ("import fedjax_sim\nprint(fedjax_sim.__version__)", False),
    ("import numpy as np\nnp._private", False),
])
def test_the_public_api_check_finds_private_uses(code, found):
    assert bool(_private_uses(code)) == found


# --------------------------------------------------------------------------- install cell

# Run before the install cell: `import fedjax_sim` (and rdkit) fails, and pip is replaced
# by a recorder that prints the requirement it was given and stops.
_NOT_INSTALLED = """
import subprocess, sys
sys.modules["fedjax_sim"] = None
sys.modules["rdkit"] = None
def _record(args, **kwargs):
    print("PIP", args[-1])
    raise SystemExit(7)
subprocess.check_call = _record
"""


def _install_cell(path: Path) -> str:
    cells = [_source(c) for c in _code_cells(_load(path)) if "FEDJAX_SIM_SOURCE" in _source(c)]
    assert len(cells) == 1, f"{path.name}: one install cell, reading FEDJAX_SIM_SOURCE"
    return cells[0]


def _run_install_cell(path: Path, cwd: Path, source: str | None):
    env = {k: v for k, v in os.environ.items() if k != "FEDJAX_SIM_SOURCE"}
    if source is not None:
        env["FEDJAX_SIM_SOURCE"] = source
    code = _NOT_INSTALLED + _install_cell(path) + """
"""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _extra(path: Path) -> str:
    return "[molecules]" if path.name == "drflm_molecules.ipynb" else ""


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_without_a_source_says_what_to_do_in_one_line(path, tmp_path):
    proc = _run_install_cell(path, tmp_path, None)
    assert proc.returncode != 0 and "PIP" not in proc.stdout
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("SetupNeeded: fedjax_sim is not installed"), proc.stderr
    for what in ("python -m build", "FEDJAX_SIM_SOURCE", "git+https"):
        assert what in message, message
    # Jupyter shows `_render_traceback_`'s lines instead of a traceback: exactly one.
    probe = _NOT_INSTALLED + _install_cell(path).split("try:\n    import fedjax_sim")[0] + (
        "\ntry:\n    fedjax_sim_requirement()\nexcept SetupNeeded as err:\n"
        "    lines = err._render_traceback_()\n    print(len(lines), lines[0][:40])\n")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert shown.stdout.strip() == "1 SetupNeeded: fedjax_sim is not installed", shown


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_installs_a_wheel_in_the_working_directory(path, tmp_path):
    wheel = tmp_path / "fedjax_sim-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    proc = _run_install_cell(path, tmp_path, None)
    assert f"PIP fedjax_sim{_extra(path)} @ {wheel.resolve().as_uri()}" in proc.stdout, proc


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_installs_from_fedjax_sim_source(path, tmp_path):
    url = "git+https://git.example.org/fedjax_sim.git"
    proc = _run_install_cell(path, tmp_path, url)
    assert f"PIP fedjax_sim{_extra(path)} @ {url}" in proc.stdout, proc
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    proc = _run_install_cell(path, tmp_path, str(checkout))
    assert f"PIP fedjax_sim{_extra(path)} @ {checkout.resolve().as_uri()}" in proc.stdout, proc
