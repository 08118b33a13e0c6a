"""Tuned comparisons (`experiments.tuned`): a grid per method as one vmapped axis, each
method's point chosen per seed on validation rows carved from its clients' training rows.

Each check against a plain loop written here: the grid combinator against every point
trained alone; the validation split against the rows dealt client by client; the chosen
value per method and seed against a loop that trains each grid value alone and picks by
the validation metric; and the choice with the test rows replaced by NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import experiments, simulate
from fedjax_sim.algorithms import PRIVATE_READY, fedprox, sgd, with_grid
from fedjax_sim.data import FederatedData, linear_mixture
from fedjax_sim.data.federated import ClientViews, stack_views
from fedjax_sim.data.holdout import validation_counts, validation_split
from fedjax_sim.execution import Execution
from fedjax_sim.experiments import study, tuned
from fedjax_sim.experiments.base import available
from fedjax_sim.models import linear_regression


def test_grid_equals_each_point_trained_alone():
    """with_grid over (lr, μ) of FedProx: after 3 rounds every point's model is the one a
    plain FedProx at that point reaches from the same keys."""
    data = linear_mixture(jax.random.key(0), k=2, m=6, n=9, d=3, sigma=0.1, R=1.0).train
    model = linear_regression(3)
    lrs, mus = [0.05, 0.2, 0.05, 0.2], [0.0, 0.0, 0.5, 0.5]

    def build(point):
        return fedprox(model, sgd(point["lr"], steps=3, batch_size=4), mu=point["mu"],
                       participation=0.5)

    grid = with_grid(build, {"lr": lrs, "mu": mus})
    keys = jax.random.split(jax.random.key(7), 4)
    state = jax.jit(grid.init)(keys[0], data)
    step = jax.jit(grid.round)
    for key in keys[1:]:
        state, _ = step(state, data, key)
    evaluation = grid.evaluate(state, data)["client_loss"]
    for g, (lr, mu) in enumerate(zip(lrs, mus, strict=True)):
        alone = build({"lr": lr, "mu": mu})
        one = alone.init(keys[0], data)
        for key in keys[1:]:
            one, _ = jax.jit(alone.round)(one, data, key)
        np.testing.assert_allclose(state.params[g], one.params, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(evaluation[g], alone.evaluate(one, data)["client_loss"],
                                   rtol=1e-5, atol=1e-6)


def test_grid_refuses_ragged_points():
    with pytest.raises(ValueError, match="the same G for every name"):
        with_grid(lambda p: None, {"lr": [0.1, 0.2], "mu": [0.0]})


def _stacked(counts, width, features=2, seed=0):
    rng = np.random.default_rng(seed)
    counts = np.asarray(counts)
    x = rng.normal(size=counts.shape + (width, features)).astype(np.float32)
    y = rng.normal(size=counts.shape + (width,)).astype(np.float32)
    pad = np.arange(width) >= counts[..., None]
    x[pad], y[pad] = 0.0, 0.0
    return FederatedData(x=jnp.asarray(x), y=jnp.asarray(y),
                         num_examples=jnp.asarray(counts, jnp.int32),
                         cluster=jnp.full(counts.shape, -1, jnp.int32))


def test_validation_split_deals_each_clients_rows_once():
    """Seed-stacked clients of 7, 1, 0 and 5 rows: per client (a loop here), the fit and
    validation rows are its own real rows, each exactly once, ⌊0.3·n⌋ of them validation
    (none for a client of one row); padding is zeros; the same seed deals the same rows."""
    counts = [[7, 1, 0, 5], [3, 6, 2, 7]]
    data = _stacked(counts, 7)
    fit, val = validation_split(data, 0.3, seed=4)
    again, _ = validation_split(data, 0.3, seed=4)
    np.testing.assert_array_equal(again.y, fit.y)
    for s, row in enumerate(counts):
        for i, n in enumerate(row):
            v = int(np.floor(0.3 * n)) if n > 1 else 0
            assert int(val.num_examples[s, i]) == v and int(fit.num_examples[s, i]) == n - v
            mine = {tuple(data.x[s, i, r].tolist()) + (float(data.y[s, i, r]),)
                    for r in range(n)}
            dealt = [tuple(part.x[s, i, r].tolist()) + (float(part.y[s, i, r]),)
                     for part in (fit, val) for r in range(int(part.num_examples[s, i]))]
            assert sorted(dealt) == sorted(mine)
            for part in (fit, val):
                assert not np.any(np.asarray(part.y[s, i, int(part.num_examples[s, i]):]))
    np.testing.assert_array_equal(validation_counts([0, 1, 2, 10], 0.5), [0, 0, 1, 5])


def test_validation_split_of_views_moves_indices_only():
    """Views of one base: the split's views gather exactly the rows of the split's copies."""
    rng = np.random.default_rng(1)
    base_x = rng.normal(size=(30, 2)).astype(np.float32)
    base_y = rng.normal(size=30).astype(np.float32)
    views = stack_views([ClientViews.from_indices(base_x, base_y,
                                                  rng.integers(0, 30, size=(3, 6)), [6, 4, 1])
                         for _ in range(2)])
    fit, val = validation_split(views, 0.4, seed=2)
    copies = views.materialize()
    fit_c, val_c = validation_split(copies, 0.4, seed=2)
    for a, b in ((fit, fit_c), (val, val_c)):
        got = a.materialize()
        np.testing.assert_array_equal(got.num_examples, b.num_examples)
        np.testing.assert_array_equal(got.x, b.x)
        np.testing.assert_array_equal(got.y, b.y)


_SMALL = {"seeds": 3, "rounds": 6, "eval_every": 3, "n": 15, "n_test": 10,
          "methods": "fedavg,qffl", "tune_lr": [0.005, 0.05], "tune_qffl_lr": [0.01, 0.1]}


def _settings(**more):
    preset = experiments.get_preset("drfa-synthetic-noise", "compare")
    return preset.experiment, experiments.resolve_settings(preset, {**_SMALL, **more},
                                                           "compare")


def _train_alone(experiment, name, s, problem):
    """Method `name` trained alone on problem.fit (one program per value), with its final
    state: its test finals and its validation metric from the experiment's own evaluation."""
    spec = study.method_run(experiment, name, s, problem.fit)
    state, history = simulate.run(spec.algorithm, spec.data, spec.key, rounds=spec.rounds,
                                  eval_every=spec.eval_every, evaluate=spec.evaluate,
                                  execution=Execution(progress=False, copies=1,
                                                      data_copies=spec.data_copies))
    val = study.method_run(experiment, name, s, problem.val).evaluate(state)["test_rmse_worst"]
    return history[-1], np.asarray(val, np.float64)


def test_chosen_value_equals_a_loop_over_the_grid():
    """drfa-synthetic-noise (FedAvg with an lr grid, q-FFL with a qffl_lr grid, 3 seeds):
    per method and seed the reported value is the grid value whose run alone has the
    lowest validation worst-client RMSE, and the reported test metrics are that run's."""
    experiment, s = _settings()
    comparison = study.compare(experiment, s)
    problem = study.problem_for(experiment, s)
    assert isinstance(problem, tuned.Tuned)
    for name, setting in (("fedavg", "lr"), ("qffl", "qffl_lr")):
        grid = s[f"tune_{setting}"]
        runs = [_train_alone(experiment, name, {**s, setting: v}, problem) for v in grid]
        val = np.stack([v for _, v in runs])  # [G, seeds]
        best = np.argmin(val, axis=0)
        got = comparison.per_seed[name]
        np.testing.assert_array_equal(got[f"chosen_{setting}"], np.asarray(grid)[best])
        for metric in ("test_rmse_worst", "test_rmse_avg", "train_loss"):
            want = np.array([runs[g][0][metric][i] for i, g in enumerate(best)])
            np.testing.assert_allclose(got[metric], want, rtol=1e-4)
        np.testing.assert_allclose(comparison.results[name].per_seed["val_rmse_worst"],
                                   val[best, np.arange(s["seeds"])], rtol=1e-5)
    assert "tuning" in comparison.notes and "chosen_per_seed" in comparison.notes


def test_choice_never_reads_the_test_rows():
    """The same comparison with every test row (features and targets) NaN: the same values
    are chosen on the same validation metrics, and only the test metrics change."""
    experiment, s = _settings()
    clean = study.compare(experiment, s)
    problem = experiment.problem(s)
    problem = problem._replace(test=problem.test.replace(
        x=jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), problem.test.x),
        y=jnp.full_like(problem.test.y, jnp.nan)))
    poisoned = study.compare(experiment.replace(problem=lambda settings: problem), s)
    for name in ("fedavg", "qffl"):
        a, b = clean.results[name].per_seed, poisoned.results[name].per_seed
        chosen = [k for k in a if k.startswith("chosen_")]
        assert chosen
        for k in [*chosen, "val_rmse_worst", "train_loss"]:
            np.testing.assert_array_equal(a[k], b[k])
        assert np.all(np.isnan(b["test_rmse_worst"]))
        assert not np.isnan(a["test_rmse_worst"]).any()


@pytest.mark.parametrize("override, message", [
    ({"tune_lr": "-0.1,0.1"}, "setting tune_lr must be a finite number >= 0"),
    ({"tune_lr": "0.1,0.1"}, "setting tune_lr repeats a value"),
    ({"tune_prox_mu": "0.1,1"}, "setting tune_prox_mu is read only by method"),
    ({"val_fraction": 0.9}, r"setting val_fraction must be a finite number in \[0.05, 0.5\]"),
    ({"tune_lr": "0.01,0.1", "lr": 0.5}, "setting lr is not read while tune_lr is set"),
    ({"val_fraction": 0.3}, "setting val_fraction is read only with a tune_\\* grid"),
])
def test_bad_grids_are_refused_naming_the_setting(override, message):
    preset = experiments.get_preset("drfa-synthetic-noise", "compare")
    with pytest.raises(ValueError, match=message):
        experiments.resolve_settings(preset, override, "compare")


def test_a_grid_can_be_emptied():
    """A preset's default grid is turned off with none (the comparison then tunes nothing)."""
    preset = experiments.get_preset("hetero-digits", "compare")
    assert preset.defaults["tune_lr"] == [0.03, 0.1, 0.3]
    s = experiments.resolve_settings(preset, {"tune_lr": "none"}, "compare")
    assert s["tune_lr"] == [] and not tuned.tunes(s)


@pytest.mark.parametrize("preset", ["drfa-synthetic-noise", "hetero-digits"])
def test_each_grid_reaches_exactly_the_methods_reading_its_setting(preset):
    """tune_X is declared for X's readers, and a method trains over X's grid exactly when it
    reads X (its own learning-rate setting, or X among its reads)."""
    p = experiments.get_preset(preset)
    experiment = p.experiment
    declared = experiment.declared
    grids = {st.name[5:] for st in declared.values() if st.name.startswith("tune_")}
    assert {"lr", "q", "lambda_lr", "prox_mu"} <= grids
    s = {**p.defaults, **{f"tune_{x}": [1.0, 2.0] for x in grids}}
    for x in grids:
        assert declared[f"tune_{x}"].methods == declared[x].methods
        for name in available(experiment):
            method = experiment.method_table[name]
            reads = (x in method.reads
                     or experiments.methods.setting_of(method, "lr", s) == x
                     # the clip: every method that can be trained with DP (its server rule)
                     or (x == "dp_clip" and method.algorithm in PRIVATE_READY))
            assert (x in tuned.method_grid(method, s)) == reads, (name, x)
            if declared[x].methods is not None:
                assert reads == (name in declared[x].methods), (name, x)
