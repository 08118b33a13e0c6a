"""The notebooks in notebooks/ are committed as a researcher first sees them: executed, with
their outputs and plots, and written against the public API only.

pytest's `--nbmake` (pyproject.toml) re-executes each notebook; these tests read the
committed files: every code cell ran, in order, in one kernel, without an error; a cell
that prints or shows a figure kept what it printed or showed; every notebook holds at least
one PNG plot; no output names a path of the machine that ran it; and no code cell imports
`fedjax_sim.experiments` (the presets' internals: a notebook runs a preset through the
`fedjax-sim` command line) or reaches a `fedjax_sim` name that begins with an underscore.
"""

from __future__ import annotations

import ast
import json
import re
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
