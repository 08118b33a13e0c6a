"""Unseen clients in the IFCA rotated-image experiments (setting unseen_clients): a share of
the training clients is held out, the same for every method of a seed and never trained on,
and each is scored on its paired test client (cluster models: the cluster of lowest loss on
its training part). The participation gap compares them with the seen training clients'
paired test clients, served by the same rule."""

from __future__ import annotations

import csv

import jax
import numpy as np
import pytest
from federations import trained

from fedjax_sim import cli
from fedjax_sim.experiments import get_preset, resolve_settings, study
from fedjax_sim.experiments.unseen import assign_unseen
from fedjax_sim.models.core import client_accuracy, client_loss

# tests/golden.py's tiny settings of the preset, with a quarter of the clients held out.
TINY = {"n": 100, "test_per_class": 30, "hidden": 8, "rounds": 2, "seeds": 2,
        "local_steps": 2, "eval_every": 1, "unseen_clients": 0.25}
PRESET = "ifca-rotated-digits"


def _settings(**overrides) -> dict:
    return resolve_settings(get_preset(PRESET), {**TINY, **overrides}, "compare")


def _host(data):
    d = data.materialize()
    return np.asarray(d.x), np.asarray(d.y), np.asarray(d.num_examples)


def _trained(name: str, s: dict):
    """(problem, the method's run, its state after s["rounds"] rounds)."""
    return trained(PRESET, name, s)


def test_held_out_clients_are_the_same_for_every_method_and_never_trained_on():
    s = _settings()
    experiment = get_preset(PRESET).experiment
    full = experiment.problem({**s, "unseen_clients": 0.0})
    problem = experiment.problem(s)
    m = len(full["test_of_client"])
    unseen = np.asarray(problem["unseen"])
    assert unseen.shape == (s["seeds"], round(0.25 * m))
    fx, fy, fn = _host(full["train"])
    tx, ty, tn = _host(problem["train"])
    ux, uy, _ = _host(problem["unseen_train"])
    px, _, _ = _host(full["paired"])
    qx, _, _ = _host(problem["unseen_paired"])
    for i in range(s["seeds"]):
        seen = sorted(set(range(m)) - set(unseen[i].tolist()))
        np.testing.assert_array_equal(problem["seen"][i], seen)
        np.testing.assert_array_equal(tx[i], fx[i, seen])
        np.testing.assert_array_equal(ty[i], fy[i, seen])
        np.testing.assert_array_equal(ux[i], fx[i, unseen[i]])
        np.testing.assert_array_equal(uy[i], fy[i, unseen[i]])
        np.testing.assert_array_equal(qx[i], px[i, unseen[i]])  # their paired test clients
    copies = experiment.problem({**s, "clients": "copies"})
    np.testing.assert_array_equal(copies["unseen"], unseen)
    for part in ("train", "paired", "unseen_train", "unseen_paired"):
        for a, b in zip(_host(copies[part]), _host(problem[part]), strict=True):
            np.testing.assert_array_equal(a, b)
    for name in experiment.methods:  # every method trains on the seen clients only
        run = study.method_run(experiment, name, s, problem)
        x, _, n = _host(run.data)
        np.testing.assert_array_equal(n, tn)
        np.testing.assert_array_equal(x, tx)
        again = experiment.problem(s)
        np.testing.assert_array_equal(again["unseen"], unseen)


@pytest.mark.parametrize("name", ["ifca", "oneshot"])
def test_unseen_clients_take_the_cluster_of_lowest_training_loss(name):
    s = _settings(local_rounds=2)
    problem, run, state = _trained(name, s)
    model = problem["model"][False]
    ux, uy, un = _host(problem["unseen_train"])
    vx, vy, vn = _host(problem["unseen_paired"])
    got = run.evaluate(state)
    k = np.shape(jax.tree.leaves(state.cluster_params)[0])[1]
    for i in range(s["seeds"]):
        clusters = [jax.tree.map(lambda a, c=c: np.asarray(a[i, c]), state.cluster_params)
                    for c in range(k)]
        chosen, correct, rows, losses = [], 0.0, 0, []
        for j in range(ux.shape[1]):
            c = int(np.argmin([float(client_loss(model, p, ux[i, j], uy[i, j], un[i, j]))
                               for p in clusters]))
            chosen.append(c)
            correct += vn[i, j] * float(client_accuracy(model, clusters[c], vx[i, j],
                                                        vy[i, j], vn[i, j]))
            rows += vn[i, j]
            losses.append(float(client_loss(model, clusters[c], vx[i, j], vy[i, j],
                                            vn[i, j])))
        seed_state = jax.tree.map(lambda a: a[i], state)
        np.testing.assert_array_equal(
            assign_unseen(model, seed_state, problem["unseen_train"].copy_at(i)), chosen)
        # accuracy: Σ correct / Σ rows (the preset's own weighting); loss: client mean
        np.testing.assert_allclose(got["unseen_test_accuracy"][i], correct / rows, rtol=1e-6)
        np.testing.assert_allclose(got["unseen_test_loss"][i], np.mean(losses), rtol=1e-5)
        np.testing.assert_allclose(got["participation_gap"][i],
                                   got["seen_test_accuracy"][i] - got["unseen_test_accuracy"][i])


def _by_hand(model, serve, train_x, train_y, train_n, test_x, test_y, test_n, ids,
             test_of_client):
    """(Σ correct / Σ rows, mean loss) over the training clients `ids` of one seed, each
    scored on its paired test client (test_of_client[id]) with `serve(train rows)` -> params."""
    correct = rows = 0.0
    losses = []
    for c in ids:
        params = serve(train_x[c], train_y[c], train_n[c], c)
        t = test_of_client[c]
        correct += test_n[t] * float(client_accuracy(model, params, test_x[t], test_y[t],
                                                     test_n[t]))
        rows += test_n[t]
        losses.append(float(client_loss(model, params, test_x[t], test_y[t], test_n[t])))
    return correct / rows, float(np.mean(losses))


@pytest.mark.parametrize("name", ["ifca", "oneshot", "fedavg"])
def test_participation_gap_compares_seen_and_unseen_clients_under_one_rule(name):
    """Both populations formed by hand from the full federation (no client held out): the
    seen side is every training client not held out, the unseen side the held-out ones,
    each scored on its paired test client; cluster models: on both sides the cluster of
    lowest loss on the client's own training part; a global model as it is."""
    s = _settings(local_rounds=2)
    problem, run, state = _trained(name, s)
    experiment = get_preset(PRESET).experiment
    full = experiment.problem({**s, "unseen_clients": 0.0})
    model = problem["model"][False]
    fx, fy, fn = _host(full["train"])
    tx, ty, tn = _host(full["test"])
    pairing = np.asarray(full["test_of_client"])
    m = len(pairing)
    got = run.evaluate(state)
    for i in range(s["seeds"]):
        unseen = sorted(np.asarray(problem["unseen"][i]).tolist())
        seen = [c for c in range(m) if c not in unseen]
        if name == "fedavg":
            params = jax.tree.map(lambda a, i=i: np.asarray(a[i]), state.params)

            def serve(x, y, n, c, params=params):
                return params
        else:
            k = np.shape(jax.tree.leaves(state.cluster_params)[0])[1]
            clusters = [jax.tree.map(lambda a, i=i, j=j: np.asarray(a[i, j]),
                                     state.cluster_params) for j in range(k)]

            def serve(x, y, n, c, clusters=clusters):  # lowest loss on the training part
                return clusters[int(np.argmin([float(client_loss(model, p, x, y, n))
                                               for p in clusters]))]
        sides = {side: _by_hand(model, serve, fx[i], fy[i], fn[i], tx[i], ty[i], tn[i], ids,
                                pairing)
                 for side, ids in (("seen", seen), ("unseen", unseen))}
        for side, (accuracy, loss) in sides.items():
            np.testing.assert_allclose(got[f"{side}_test_accuracy"][i], accuracy, rtol=1e-5)
            np.testing.assert_allclose(got[f"{side}_test_loss"][i], loss, rtol=1e-5)
        np.testing.assert_allclose(got["participation_gap"][i],
                                   sides["seen"][0] - sides["unseen"][0], atol=1e-6)


def test_seen_metrics_match_the_full_runs_layout_for_local_models():
    """The official local-baseline accuracy of the seen models: each on all test data of
    its cluster, as without held-out clients."""
    s = _settings(local_rounds=1)
    problem, run, state = _trained("local", s)
    got = run.evaluate(state)
    model = problem["model"][False]
    tx, ty, tn = _host(problem["test"])
    per_test = problem["test_clients"] // s["k"]
    truth = np.asarray(problem["train"].cluster)
    for i in range(s["seeds"]):
        correct = rows = 0.0
        for j, c in enumerate(truth[i]):
            params = jax.tree.map(lambda a, j=j: np.asarray(a[i, j]), state.params)
            for t in range(c * per_test, (c + 1) * per_test):
                acc = float(client_accuracy(model, params, tx[i, t], ty[i, t], tn[i, t]))
                correct += acc * tn[i, t]
                rows += tn[i, t]
        np.testing.assert_allclose(got["test_accuracy"][i], correct / rows, rtol=1e-5)
    assert np.all(np.isfinite(got["unseen_test_accuracy"]))


def test_comparison_end_to_end_has_the_unseen_columns(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", PRESET, "--set", *(f"{k}={v}" for k, v in TINY.items()),
            "local_rounds=1", "--out", str(out), "--no-progress"]
    assert cli.main(argv) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == ["ifca", "fedavg", "local", "hypcluster", "cfl"]
    for column in ("test_accuracy_mean", "seen_test_accuracy_mean", "seen_test_loss_mean",
                   "unseen_test_accuracy_mean", "unseen_test_loss_mean",
                   "participation_gap_mean"):
        assert all(np.isfinite(float(r[column])) for r in rows), column
    with open(out / "per_seed.csv") as f:
        for r in csv.DictReader(f):
            np.testing.assert_allclose(
                float(r["participation_gap"]),
                float(r["seen_test_accuracy"]) - float(r["unseen_test_accuracy"]),
                atol=1e-12)


def test_no_unseen_clients_changes_nothing():
    s = _settings(unseen_clients=0.0)
    experiment = get_preset(PRESET).experiment
    assert not any(m.startswith(("seen_", "unseen_")) or m == "participation_gap"
                   for m in experiment.table(s))
    assert "unseen_train" not in experiment.problem(s)


@pytest.mark.parametrize("overrides, match", [
    ({"unseen_clients": 0.95}, "unseen_clients"), ({"unseen_clients": -0.1}, "unseen_clients"),
    ({"n": 300, "unseen_clients": 0.9, "k": 1}, "unseen_clients"),
    ({"n": 300, "unseen_clients": 0.8}, "exceeds the 3 training clients"),
    ({"unseen_clients": 0.0, "adapt_steps": 3}, "adapt_steps"),
])
def test_bad_unseen_clients_refused_in_one_line(overrides, match):
    with pytest.raises(ValueError, match=match) as err:
        s = _settings(**overrides)
        get_preset(PRESET).experiment.validate(s)
    assert "\n" not in str(err.value)
