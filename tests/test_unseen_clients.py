"""Unseen clients in the heterogeneous-FL experiments (setting unseen_clients): a share of
the clients is held out of training, the same for every method of a seed, and each method
scores them by its rule (global model as it is; cluster of lowest training loss; a few
local steps of adaptation), beside the seen clients, with the participation gap."""

from __future__ import annotations

import csv

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import trained

from fedjax_sim import cli
from fedjax_sim.experiments import get_preset, hetero, resolve_settings, study
from fedjax_sim.experiments.hetero import metrics as hetero_metrics
from fedjax_sim.models.core import client_accuracy, client_loss

# Untuned (the preset's tune_lr grid off): these tests train `method_run` at one lr.
TINY = {"rounds": 2, "seeds": 2, "num_clients": 6, "hidden": 8, "local_steps": 2,
        "eval_every": 1, "unseen_clients": 0.34, "tune_lr": "none"}


def _settings(**overrides) -> dict:
    return resolve_settings(get_preset("hetero-digits"), {**TINY, **overrides}, "compare")


def _host(data):
    """x, y, num_examples of seed-stacked clients, on the host ([seeds, m, ...])."""
    d = data.materialize()
    return np.asarray(d.x), np.asarray(d.y), np.asarray(d.num_examples)


def _mean_over_clients(values, counts) -> float:
    keep = [v for v, n in zip(values, counts, strict=True) if n > 0]
    return float(np.mean(keep))


def test_held_out_clients_are_the_seeds_own_and_never_trained_on():
    s = _settings(participation=1.0)
    experiment = get_preset("hetero-digits").experiment
    full = experiment.problem({**s, "unseen_clients": 0.0})
    problem = experiment.problem(s)
    again = experiment.problem(s)
    m, held = s["num_clients"], round(0.34 * s["num_clients"])
    unseen = np.asarray(problem["unseen"])
    assert unseen.shape == (s["seeds"], held)
    np.testing.assert_array_equal(unseen, again["unseen"])  # deterministic
    fx, fy, fn = _host(full["train"])
    tx, ty, tn = _host(problem["train"])
    ux, uy, un = _host(problem["unseen_train"])
    for i in range(s["seeds"]):
        seen = sorted(set(range(m)) - set(unseen[i].tolist()))
        assert len(seen) == m - held
        # The training data is exactly the seen clients' (in order), the held-out
        # clients' own parts are kept apart.
        np.testing.assert_array_equal(tn[i], fn[i, seen])
        np.testing.assert_array_equal(ty[i], fy[i, seen])
        np.testing.assert_array_equal(tx[i], fx[i, seen])
        np.testing.assert_array_equal(un[i], fn[i, unseen[i]])
        np.testing.assert_array_equal(uy[i], fy[i, unseen[i]])
    # Stored copies hold out the same clients with the same rows as views.
    copies = experiment.problem({**s, "clients": "copies"})
    np.testing.assert_array_equal(copies["unseen"], unseen)
    for part in ("train", "test", "unseen_train", "unseen_test"):
        for a, b in zip(_host(copies[part]), _host(problem[part]), strict=True):
            np.testing.assert_array_equal(a, b)
    # Every method of the comparison trains on those clients only (a cohort of
    # participation 1 is every client of its data): the same data for each.
    for name in ("fedavg", "fedavg_ft", "ditto", "ifca", "hypcluster"):
        run = study.method_run(experiment, name, s, problem)
        _, _, n = _host(run.data)
        np.testing.assert_array_equal(n, tn)
        state = jax.eval_shape(run.algorithm.init, run.key, run.data)
        if name == "ditto":  # one personal model per seen client
            assert jax.tree.leaves(state.personal)[0].shape[:2] == (s["seeds"], m - held)


@pytest.mark.parametrize("name", ["ifca", "hypcluster"])
def test_unseen_clients_take_the_cluster_of_lowest_training_loss(name):
    s = _settings()
    problem, run, state = trained("hetero-digits", name, s)
    model = problem["model"]
    ux, uy, un = _host(problem["unseen_train"])
    vx, vy, vn = _host(problem["unseen_test"])
    got = run.evaluate(state)
    k = s["k"]
    for i in range(s["seeds"]):
        clusters = [jax.tree.map(lambda a, c=c: np.asarray(a[i, c]), state.cluster_params)
                    for c in range(k)]
        chosen, accuracies, losses = [], [], []
        for j in range(ux.shape[1]):
            train_loss = [float(client_loss(model, p, ux[i, j], uy[i, j], un[i, j]))
                          for p in clusters]
            c = int(np.argmin(train_loss))
            chosen.append(c)
            accuracies.append(float(client_accuracy(model, clusters[c], vx[i, j], vy[i, j],
                                                    vn[i, j])))
            losses.append(float(client_loss(model, clusters[c], vx[i, j], vy[i, j], vn[i, j])))
        seed_state = jax.tree.map(lambda a: a[i], state)
        train_i = problem["unseen_train"].copy_at(i)
        np.testing.assert_array_equal(
            hetero_metrics.assign_unseen(model, seed_state, train_i), chosen)
        np.testing.assert_allclose(got["unseen_test_accuracy"][i],
                                   _mean_over_clients(accuracies, vn[i]), rtol=1e-6)
        np.testing.assert_allclose(got["unseen_test_loss"][i],
                                   _mean_over_clients(losses, vn[i]), rtol=1e-5)
        np.testing.assert_allclose(got["participation_gap"][i],
                                   got["test_accuracy"][i] - got["unseen_test_accuracy"][i])


def _sgd_loop(model, params, x, y, n, lr: float, steps: int):
    """`steps` full-batch gradient steps on one client's mean training loss."""
    grad = jax.grad(lambda p: client_loss(model, p, x, y, n))
    for _ in range(steps):
        params = jax.tree.map(lambda p, g: p - lr * g, params, grad(params))
    return params


@pytest.mark.parametrize("name", ["fedavg_ft", "ditto"])
def test_adaptation_is_adapt_steps_of_full_batch_sgd_from_the_global_model(name):
    s = _settings(batch_size=0, adapt_steps=3, lr=0.2)
    problem, run, state = trained("hetero-digits", name, s)
    model = problem["model"]
    ux, uy, un = _host(problem["unseen_train"])
    vx, vy, vn = _host(problem["unseen_test"])
    got = run.evaluate(state)
    experiment = get_preset("hetero-digits").experiment
    training = study.training_of(experiment, name, s).replace(
        steps=s["adapt_steps"] or s["local_steps"])
    for i in range(s["seeds"]):
        start = jax.tree.map(lambda a: np.asarray(a[i]), state.params)  # the global model
        adapted = hetero_metrics.adapt(model, training, start,
                                       problem["unseen_train"].copy_at(i), jax.random.key(0),
                                       jnp.asarray(problem["unseen"][i]))
        accuracies = []
        for j in range(ux.shape[1]):
            mine = _sgd_loop(model, start, ux[i, j], uy[i, j], un[i, j], 0.2, 3)
            for a, b in zip(jax.tree.leaves(jax.tree.map(lambda a, j=j: a[j], adapted)),
                            jax.tree.leaves(mine), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            accuracies.append(float(client_accuracy(model, mine, vx[i, j], vy[i, j],
                                                    vn[i, j])))
        np.testing.assert_allclose(got["unseen_test_accuracy"][i],
                                   _mean_over_clients(accuracies, vn[i]), rtol=1e-6)
    if name == "fedavg_ft":  # the seen clients are fine-tuned as well before their test
        tx, ty, tn = _host(problem["train"])
        sx, sy, sn = _host(problem["test"])
        start = jax.tree.map(lambda a: np.asarray(a[0]), state.params)
        accuracies = [float(client_accuracy(
            model, _sgd_loop(model, start, tx[0, j], ty[0, j], tn[0, j], 0.2, 3),
            sx[0, j], sy[0, j], sn[0, j])) for j in range(tx.shape[1])]
        np.testing.assert_allclose(got["test_accuracy"][0],
                                   _mean_over_clients(accuracies, sn[0]), rtol=1e-6)


def test_global_models_score_unseen_clients_as_they_are():
    s = _settings()
    problem, run, state = trained("hetero-digits", "fedavg", s)
    model = problem["model"]
    vx, vy, vn = _host(problem["unseen_test"])
    got = run.evaluate(state)
    for i in range(s["seeds"]):
        params = jax.tree.map(lambda a: np.asarray(a[i]), state.params)
        accuracies = [float(client_accuracy(model, params, vx[i, j], vy[i, j], vn[i, j]))
                      for j in range(vx.shape[1])]
        np.testing.assert_allclose(got["unseen_test_accuracy"][i],
                                   _mean_over_clients(accuracies, vn[i]), rtol=1e-6)


def test_comparison_end_to_end_has_the_unseen_columns(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", "hetero-digits", "--set", "rounds=2", "seeds=2", "num_clients=6",
            "hidden=8", "local_steps=2", "unseen_clients=0.34",
            "methods=fedavg,fedavg_ft,ditto,ifca", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["fedavg", "fedavg_ft", "ditto", "ifca"]
    for column in ("test_accuracy_mean", "unseen_test_accuracy_mean",
                   "unseen_test_accuracy_worst_mean", "unseen_test_loss_mean",
                   "participation_gap_mean"):
        assert column in rows[0], column
        assert all(np.isfinite(float(r[column])) for r in rows), column
    with open(out / "per_seed.csv") as f:
        per_seed = list(csv.DictReader(f))
    for r in per_seed:
        np.testing.assert_allclose(
            float(r["participation_gap"]),
            float(r["test_accuracy"]) - float(r["unseen_test_accuracy"]), atol=1e-12)


def test_no_unseen_clients_changes_nothing():
    s = resolve_settings(get_preset("hetero-digits"), {**TINY, "unseen_clients": 0.0},
                         "compare")
    experiment = get_preset("hetero-digits").experiment
    assert not any(m.startswith("unseen_") or m == "participation_gap"
                   for m in study.table(experiment, s))
    assert "unseen_train" not in hetero.build_problem(s)


@pytest.mark.parametrize("overrides", [
    {"unseen_clients": 0.95}, {"unseen_clients": -0.1},
    {"num_clients": 2, "unseen_clients": 0.9, "k": 1},
])
def test_bad_unseen_clients_refused_in_one_line(overrides):
    with pytest.raises(ValueError, match="unseen_clients") as err:
        resolve_settings(get_preset("hetero-digits"), {**TINY, **overrides}, "compare")
    assert "\n" not in str(err.value)
