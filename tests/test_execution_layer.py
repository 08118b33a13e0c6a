"""Execution in one place: experiments declare what a round holds, the executor decides how.

No module under `fedjax_sim/experiments/` imports the client-chunk planner (the
functions of `fedjax_sim.memory` that choose a chunk) or chooses a client chunk
(a `client_chunk=` argument, a `Plan(...)`, `with_plan`, a `client_chunk` method
of its own, `Execution.client_chunk`): the executor plans it from the experiment's
`execution.Footprint` (`Execution.planned`). `simulate.run` keeps at most 8
parameters, and its old execution keywords still work for one release, with a
DeprecationWarning. A progress line leaves out compilation from its ETA and shows
the round counters only once they move.
"""

from __future__ import annotations

import ast
import inspect
import time
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import logs, memory, simulate
from fedjax_sim.algorithms import Algorithm
from fedjax_sim.data import FederatedData
from fedjax_sim.execution import Checkpoints, Execution

EXPERIMENTS = Path(__file__).resolve().parents[1] / "fedjax_sim" / "experiments"

# What of `fedjax_sim.memory` chooses (or sizes) a round's client chunk.
PLANNER = {"choose_client_chunk", "client_chunk_for_budget", "client_chunk_within_machine",
           "working_memory_chunk", "plan_client_chunk", "estimate_bytes_per_client",
           "evaluation_bytes_per_client", "working_bytes_per_client", "CPU_ROUND_WORK_BYTES",
           "PER_CLIENT_MODELS_BYTES", "GENERATED_WORK_BYTES"}
# Calls that set or choose a plan's chunk.
CHOOSING_CALLS = {"Plan", "with_plan", "client_chunk"}


def chunk_choices(source: str) -> list[str]:
    """Where `source` imports the planner or chooses a client chunk, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and node.module == "fedjax_sim.memory":
            found += [f"{where}: imports memory.{a.name}" for a in node.names
                      if a.name in PLANNER]
        elif isinstance(node, ast.Attribute) and node.attr in PLANNER:
            found.append(f"{where}: uses .{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in CHOOSING_CALLS:
                found.append(f"{where}: calls {name}(...)")
            found += [f"{where}: passes client_chunk=" for k in node.keywords
                      if k.arg == "client_chunk"]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name == "client_chunk":
            found.append(f"{where}: defines client_chunk")
    return found


def test_the_planner_names_exist():
    """The scan's names are memory's (a renamed planner would slip past it otherwise)."""
    assert all(hasattr(memory, name) for name in PLANNER)


@pytest.mark.parametrize("snippet", [
    "from fedjax_sim import memory\nchunk = memory.choose_client_chunk(model, data, 2**30)",
    "from fedjax_sim.memory import working_memory_chunk",
    "problem = planned(problem, client_chunk=chunk)",
    "data = with_plan(data, Plan(client_chunk=8))",
    "class E:\n    def client_chunk(self, s):\n        return None",
    "chunk = execution.client_chunk(footprint)",
    "work = memory.CPU_ROUND_WORK_BYTES",
])
def test_the_scan_finds_a_chunk_choice(snippet):
    assert chunk_choices(snippet)


def test_the_scan_lets_a_footprint_and_reading_the_plan_pass():
    assert chunk_choices(
        "from fedjax_sim.execution import Footprint, plan_of, planned\n"
        "fp = Footprint(model, shapes, copies=3)\n"
        "problem = execution.planned(problem, fp)\n"
        "chunk = plan_of(data).client_chunk\n"
        "data = planned(data, keep_client_state=False)\n"
        "execution.check(fp)\n") == []


def test_no_experiment_imports_the_planner_or_chooses_a_chunk():
    modules = sorted(EXPERIMENTS.rglob("*.py"))
    assert len(modules) > 20
    found = {str(p.relative_to(EXPERIMENTS)): hits for p in modules
             if (hits := chunk_choices(p.read_text(encoding="utf-8")))}
    assert not found, found


def test_simulate_run_keeps_at_most_eight_parameters():
    parameters = inspect.signature(simulate.run).parameters
    assert len(parameters) <= 8, list(parameters)
    # Every execution option is the Execution's, not run's.
    fields = set(Execution.__dataclass_fields__)
    assert not fields & set(parameters), fields & set(parameters)
    assert "execution" in parameters


class _Count(NamedTuple):
    t: jax.Array


def _counting() -> Algorithm:
    """One float, one fixed whole-number and one growing whole-number round metric."""
    def round_(state, data, key):
        t = state.t + 1
        return _Count(t), {"loss": 1.0 / (t + 1.0), "fixed": jnp.float32(4.0),
                           "moving": t.astype(jnp.float32)}

    return Algorithm(lambda key, data: _Count(jnp.int32(0)), round_,
                     lambda state, data: {})


def _data():
    return FederatedData.from_arrays(np.zeros((2, 1, 1), np.float32), np.zeros((2, 1),
                                                                              np.float32))


def test_the_old_keywords_warn_and_run_as_the_execution(tmp_path):
    alg, data = _counting(), _data()
    kw = dict(rounds=4, eval_every=2, evaluate=lambda s: {})
    with pytest.warns(DeprecationWarning, match="execution=Execution"):
        old_state, old = simulate.run(alg, data, jax.random.key(0), progress=False,
                                      checkpoint_dir=tmp_path / "old", checkpoint_every=2,
                                      **kw)
    state, new = simulate.run(alg, data, jax.random.key(0), **kw, execution=Execution(
        progress=False, checkpoints=Checkpoints(tmp_path / "new", every=2)))
    assert int(old_state.t) == int(state.t) == 4
    assert [r["round"] for r in old] == [r["round"] for r in new] == [0, 2, 4]
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == \
        sorted(p.name for p in (tmp_path / "new").iterdir())
    with pytest.raises(TypeError, match="not both"):
        simulate.run(alg, data, jax.random.key(0), progress=False, execution=Execution(), **kw)
    with pytest.raises(TypeError, match="fields of Execution"):
        simulate.run(alg, data, jax.random.key(0), devices=2, **kw)


@pytest.mark.parametrize("fields,message", [
    ({"resume": True}, "resume=True needs the checkpoints"),
    ({"copies": True}, "copies must be the number of leading copies axes"),
    ({"memory_budget": -1}, "memory_budget must be a number of bytes >= 0"),
    ({"progress": "yes"}, "progress must be True or False"),
    ({"checkpoints": "ckpt"}, r"checkpoints must be None or Checkpoints\(directory, every\)"),
])
def test_a_bad_execution_is_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as info:
        Execution(**fields)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="every must be None or an integer >= 1"):
        Checkpoints("ckpt", every=0)


def test_the_progress_line_leaves_out_compiling_and_counters_that_do_not_move(
        capsys, monkeypatch):
    monkeypatch.setattr(logs, "_PROGRESS_EVERY", 0.0)  # a line per chunk
    clocks = []

    class Recorded(logs.Progress):
        def __init__(self, *args, **kwargs):
            clocks.append(kwargs["clock"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(simulate, "Progress", Recorded)
    timing: dict = {}
    simulate.run(_counting(), _data(), jax.random.key(0), rounds=6, eval_every=2,
                 evaluate=lambda s: {}, execution=Execution(timing=timing, description="c"))
    # The ETA and the rate run on a clock that leaves out the compile seconds so far.
    assert timing["compile_seconds"] > 0
    assert abs(clocks[0]() - (time.perf_counter() - timing["compile_seconds"])) < 0.5
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("c: ")]
    assert len(lines) == 3, lines
    assert all("loss=" in line and "fixed=" not in line for line in lines)
    # A counter shows once it has moved (round 2's value is its first).
    assert "moving=" not in lines[0] and "moving=4" in lines[1] and "moving=6" in lines[2]
