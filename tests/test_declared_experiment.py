"""A new experiment is one record: declared here, then run, compared (tuned, with unseen
clients) and swept through the command line's own path, with nothing else written.

The record holds only what the experiment is: its settings, a problem (k clusters of
linear clients per seed, some clients held out as unseen), its metric (test loss on the
seen and the unseen clients) and its methods. Everything else (method building, the
tune_* grids and their validation rows, the sweep, the output files) is the generic
layer's.
"""

from __future__ import annotations

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import cli, experiments
from fedjax_sim.data import linear_mixture
from fedjax_sim.experiments.base import DATA, Experiment, Preset, client_mean, stream_key
from fedjax_sim.experiments.settings import (
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    method_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
    unseen_clients_setting,
)
from fedjax_sim.experiments.unseen import held_out_count, pick_clients, split_ids
from fedjax_sim.io import read_csv
from fedjax_sim.models import linear_regression


def toy_problem(s: dict) -> dict:
    """Per seed: k clusters of m linear clients; unseen_clients of them held out."""
    seeds = [linear_mixture(jax.random.fold_in(stream_key(s["seed"], DATA), i), k=s["k"],
                            m=s["m"], n=s["n"], d=s["d"], sigma=0.1, R=1.0, n_test=s["n"])
             for i in range(s["seeds"])]
    train, test = (jax.tree.map(lambda *a: jnp.stack(a), *parts)
                   for parts in ([p.train for p in seeds], [p.test for p in seeds]))
    problem = {"train": train, "test": test, "model": linear_regression(s["d"])}
    held_out = held_out_count(s["unseen_clients"], s["m"], "m")
    if held_out:
        seen, unseen = split_ids(s["seed"], s["seeds"], s["m"], held_out)
        problem.update(train=pick_clients(train, seen), test=pick_clients(test, seen),
                       unseen_test=pick_clients(test, unseen))
    return problem


def toy_metrics(trained):
    """Test loss over the seen (and unseen) clients, weighted by their rows, per seed."""
    evaluate = jax.jit(trained.algorithm.evaluate)

    def loss(state, data):
        out = evaluate(state, data)
        return client_mean(out["client_loss"], out["client_weight"])

    def metrics(state):
        row = {"test_loss": loss(state, trained.problem["test"])}
        if "unseen_test" in trained.problem:
            row["unseen_test_loss"] = loss(state, trained.problem["unseen_test"])
        return row

    return metrics


TOY = Experiment(
    name="toy_clusters",
    description="FedAvg and IFCA on k clusters of linear clients",
    settings=(
        count("m", 8, "clients"), count("n", 10, "rows per client"), count("d", 3, "features"),
        lr_setting(0.1), local_steps_setting(2), rounds_setting(4), seeds_setting(2),
        seed_setting(), eval_every_setting(2), unseen_clients_setting(),
        method_setting(("fedavg", "ifca"), "ifca"),
    ),
    problem=toy_problem,
    metrics=toy_metrics,
    methods=("fedavg", "ifca"),
    baseline="fedavg",
    table=lambda s: ["test_loss"] + (["unseen_test_loss"] if s["unseen_clients"] else []),
    panels=(("test_loss", "test loss"),),
    unscoped=("k",),  # the problem's clusters as well as IFCA's cluster models
    tune_metric=("test_loss", "min"),
)


@pytest.fixture
def toy(monkeypatch):
    preset = Preset("toy-clusters", TOY, "FedAvg and IFCA on 2 clusters of 8 linear clients.")
    monkeypatch.setitem(experiments.PRESETS, preset.name, preset)
    return preset


def _main(*args) -> None:
    assert cli.main([*args, "--no-progress"]) == 0


def test_a_declared_experiment_runs_compares_and_sweeps(tmp_path, toy):
    assert toy.commands == ("run", "sweep", "compare")
    assert {"k", "methods", "tune_lr", "val_fraction"} <= set(TOY.declared)

    _main("run", "toy-clusters", "--out", str(tmp_path / "run"), "--set", "method=fedavg")
    run = read_csv(tmp_path / "run" / "metrics.csv")
    assert {int(r["seed"]) for r in run} == {0, 1}
    assert sorted({int(r["round"]) for r in run}) == [0, 2, 4]

    _main("compare", "toy-clusters", "--out", str(tmp_path / "plain"))
    plain = read_csv(tmp_path / "plain" / "per_seed.csv")
    # The run of fedavg and the comparison's fedavg are the same training, seed by seed.
    finals = {int(r["seed"]): float(r["test_loss"]) for r in run if int(r["round"]) == 4}
    fedavg = {int(r["seed"]): float(r["test_loss"]) for r in plain if r["method"] == "fedavg"}
    assert fedavg == pytest.approx(finals, rel=1e-6)

    _main("compare", "toy-clusters", "--out", str(tmp_path / "tuned"), "--set",
          "tune_lr=0.05,0.2", "unseen_clients=0.25")
    results = read_csv(tmp_path / "tuned" / "results.csv")
    assert [r["method"] for r in results] == ["fedavg", "ifca"]
    for row in results:
        assert 0.05 <= float(row["chosen_lr"]) <= 0.2  # the mean over seeds of their choices
        assert np.isfinite(float(row["unseen_test_loss_mean"]))
    per_seed = read_csv(tmp_path / "tuned" / "per_seed.csv")
    assert len(per_seed) == 4 and all(np.isfinite(float(r["unseen_test_loss"]))
                                      for r in per_seed)

    _main("sweep", "toy-clusters", "--out", str(tmp_path / "sweep"), "--set", "lr=0.1,0.2",
          "method=fedavg")
    trials = read_csv(tmp_path / "sweep" / "trials.csv")
    assert sorted((float(t["lr"]), int(t["data_seed"])) for t in trials) == [
        (0.1, 0), (0.1, 1), (0.2, 0), (0.2, 1)]
    # The cell at the run's settings trains what the run trained.
    cell = {int(t["data_seed"]): float(t["test_loss"]) for t in trials if float(t["lr"]) == 0.1}
    assert cell == pytest.approx(finals, rel=1e-6)
    summary = read_csv(tmp_path / "sweep" / "summary.csv")
    assert len(summary) == 2
    for row in summary:
        mine = [float(t["test_loss"]) for t in trials if t["lr"] == row["lr"]]
        assert float(row["test_loss_mean"]) == pytest.approx(np.mean(mine), rel=1e-6)

    # Nothing written outside the four directories the commands were given.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "run", "sweep", "tuned"]


def test_experiments_are_records_and_no_class_grows_large():
    """Every experiment is an `Experiment` record (no subclass overrides the generic path),
    and no class under experiments/ holds more than a dozen methods."""
    root = Path(experiments.__file__).parent
    large, subclasses = {}, []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            where = f"{path.relative_to(root)}:{node.name}"
            methods = [n for n in node.body
                       if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            if len(methods) > 12:
                large[where] = len(methods)
            if any(getattr(b, "id", getattr(b, "attr", None)) == "Experiment"
                   for b in node.bases):
                subclasses.append(where)
    assert not large, large
    assert not subclasses, subclasses
    assert all(isinstance(p.experiment, Experiment) for p in experiments.PRESETS.values())
