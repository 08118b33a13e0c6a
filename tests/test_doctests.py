"""The `Examples:` of the algorithms run: every module's doctests pass, and every factory has one.

Each module of `fedjax_sim/algorithms/` is one test: `doctest.testmod` over it, with
ELLIPSIS and NORMALIZE_WHITESPACE. A registered factory (`ALGORITHMS`), `sgd` and the
combinators (`with_restarts`, `with_seeds`, `with_server_optimizer`, IFCA's) must each
show a `>>>` example, and a registered factory a `References:` section. The examples
build tiny problems (8 clients, d = 3) that share one data shape, so the data
generator compiles once per process.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

from fedjax_sim import algorithms

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    "fedjax_sim.algorithms" if path.stem == "__init__" else f"fedjax_sim.algorithms.{path.stem}"
    for path in (ROOT / "fedjax_sim" / "algorithms").glob("*.py"))
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# The factories and combinators a user builds algorithms with: each shows an example.
COMBINATORS = ("sgd", "with_restarts", "with_seeds", "with_server_optimizer",
               "with_weight_sharing", "with_frozen_trunk", "with_warm_start",
               "with_fixed_assignment", "with_balanced_init", "with_initial_params")
DOCUMENTED = {*algorithms.ALGORITHMS.values(), *(getattr(algorithms, n) for n in COMBINATORS)}


def _defined_in(module_name: str) -> list:
    return sorted((f for f in DOCUMENTED if f.__module__ == module_name),
                  key=lambda f: f.__name__)


def test_every_documented_function_is_in_a_tested_module():
    assert {f.__module__ for f in DOCUMENTED} <= set(MODULES)


@pytest.mark.parametrize("module_name", MODULES)
def test_module_doctests(module_name):
    module = importlib.import_module(module_name)
    missing = [f.__name__ for f in _defined_in(module_name) if ">>>" not in (f.__doc__ or "")]
    assert not missing, f"{module_name}: no `>>>` example in {', '.join(missing)}"
    unreferenced = [f.__name__ for f in _defined_in(module_name)
                    if f in algorithms.ALGORITHMS.values()
                    and "References:" not in (f.__doc__ or "")]
    assert not unreferenced, f"{module_name}: no References: in {', '.join(unreferenced)}"
    result = doctest.testmod(module, optionflags=OPTIONS, report=False)
    assert result.failed == 0, (f"{module_name}: {result.failed} of {result.attempted} doctest "
                                "examples failed (the report is in the captured stdout)")
