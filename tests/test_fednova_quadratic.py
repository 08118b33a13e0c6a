"""The fednova-quadratic preset: its closed forms against independent computations, its
comparison through the CLI (FedNova at the true optimum, FedAvg at the surrogate one, each
at the exact fixed point of its rounds at the run's lr), and its refusals.

The fixed points at a given lr come from the rounds themselves, written here in float64:
τ full-batch GD steps on F_i are an affine map x ↦ G_i x + h_i, so FedAvg's round is
x ↦ Σ p_i (G_i x + h_i) and FedNova's x ↦ x − τ_eff Σ (p_i/τ_i)((I − G_i) x − h_i); each
fixed point solves a d × d linear system.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import np_client_grad, np_client_loss
from fedjax_sim import cli
from fedjax_sim.experiments import get_preset, resolve_settings, study
from fedjax_sim.experiments.fednova_quadratic import (
    EXPERIMENT,
    build_problem,
    proximal_work,
    work_table,
)
from fedjax_sim.io import read_csv

PRESET = "fednova-quadratic"
# Small enough for seconds, large enough that both methods reach their fixed points.
SMALL = {"num_clients": 6, "d": 3, "n_min": 5, "n_max": 15, "tau_max": 10, "lr": 0.01,
         "rounds": 200, "eval_every": 100, "seeds": 2}


def _settings(overrides=None, command="compare") -> dict:
    return resolve_settings(get_preset(PRESET), {**SMALL, **(overrides or {})}, command)


def _clients(problem, seed):
    train = problem["train"]
    x, y, n = (np.asarray(a[seed]) for a in (train.x, train.y, train.num_examples))
    return x.astype(np.float64), y.astype(np.float64), n


def _objective_grad(x, y, n, q, w):
    """∇ Σ_i q_i F_i(w), client by client (conftest's per-client gradient)."""
    return sum(qi * np_client_grad(w, x[i], y[i], n[i]) for i, qi in enumerate(q))


def _gd_map(x, y, n, tau, lr):
    """(G, h) of τ full-batch GD steps on F_i: GD_τ(w) = G w + h (float64)."""
    d = x.shape[-1]
    g0 = np_client_grad(np.zeros(d), x, y, n)  # ∇F_i(w) = A w + g0
    a = np.stack([np_client_grad(e, x, y, n) - g0 for e in np.eye(d)], axis=1)
    step = np.eye(d) - lr * a
    big_g, h = np.eye(d), np.zeros(d)
    for _ in range(tau):
        big_g, h = step @ big_g, step @ h - lr * g0
    return big_g, h


def _fixed_points(problem, seed, lr):
    """FedAvg's and FedNova's exact fixed points at `lr` (float64)."""
    x, y, n = _clients(problem, seed)
    p, table = problem["p"][seed], problem["work"]
    maps = [_gd_map(x[i], y[i], n[i], t, lr) for i, t in enumerate(table)]
    eye = np.eye(x.shape[-1])
    fedavg = np.linalg.solve(eye - sum(pi * g for pi, (g, _) in zip(p, maps, strict=True)),
                             sum(pi * h for pi, (_, h) in zip(p, maps, strict=True)))
    scale = p / np.asarray(table, np.float64)
    fednova = np.linalg.solve(
        sum(c * (eye - g) for c, (g, _) in zip(scale, maps, strict=True)),
        sum(c * h for c, (_, h) in zip(scale, maps, strict=True)))
    return fedavg, fednova


# --------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_closed_forms_zero_the_gradients_of_their_objectives(weighting):
    s = _settings({"weighting": weighting, "sigma": 0.3})
    problem = build_problem(s)
    tau = np.asarray(problem["work"], np.float64)
    rng = np.random.default_rng(0)
    for seed in range(s["seeds"]):
        x, y, n = _clients(problem, seed)
        p = problem["p"][seed]
        expected = n / n.sum() if weighting == "examples" else np.full(len(n), 1 / len(n))
        np.testing.assert_allclose(p, expected)
        w_star, w_sur = problem["optimum"][seed], problem["surrogate"][seed]
        np.testing.assert_allclose(_objective_grad(x, y, n, p, w_star), 0.0, atol=1e-10)
        np.testing.assert_allclose(_objective_grad(x, y, n, p * tau, w_sur), 0.0, atol=1e-9)
        assert np.linalg.norm(w_star - w_sur) > 0.1  # the two objectives differ
        # F(w) − F(w*) = (w − w*)ᵀ H_p (w − w*), against the losses themselves.
        w = w_star + rng.normal(size=w_star.shape)
        def objective(v, p=p, x=x, y=y, n=n):
            return sum(pi * np_client_loss(v, x[i], y[i], n[i]) for i, pi in enumerate(p))

        gap = w - w_star
        np.testing.assert_allclose(gap @ problem["hessian"][seed] @ gap,
                                   objective(w) - objective(w_star), rtol=1e-9)
        if weighting == "examples":  # w*: least squares over every client's rows pooled
            rows = np.concatenate([x[i, :n[i]] for i in range(len(n))])
            targets = np.concatenate([y[i, :n[i]] for i in range(len(n))])
            np.testing.assert_allclose(w_star, np.linalg.lstsq(rows, targets)[0], rtol=1e-9)


def test_small_lr_fixed_points_are_the_closed_forms():
    """As lr → 0 FedAvg's rounds stop at w̃ = argmin Σ p_i τ_i F_i, FedNova's at w*."""
    problem = build_problem(_settings())
    gap = np.linalg.norm(problem["optimum"][0] - problem["surrogate"][0])
    fedavg, fednova = _fixed_points(problem, 0, 1e-6)
    assert np.linalg.norm(fedavg - problem["surrogate"][0]) < 1e-4 * gap
    assert np.linalg.norm(fednova - problem["optimum"][0]) < 1e-4 * gap


def test_work_table_and_data_follow_the_settings():
    s = _settings({"tau_min": 2, "tau_max": 11, "num_clients": 4})
    assert work_table(s) == (2, 5, 8, 11)
    assert work_table({**s, "tau_min": 11}) == (11,) * 4
    training = study.training_of(EXPERIMENT, "fednova", s)  # plain SGD rebuilt: the work kept
    assert training.work.per_client == (2, 5, 8, 11) and training.steps == 11
    assert training.batch_size is None  # full-batch GD
    a, b = build_problem(s), build_problem(s)
    np.testing.assert_array_equal(np.asarray(a["train"].x), np.asarray(b["train"].x))
    n = np.asarray(a["train"].num_examples)
    assert n.shape == (s["seeds"], 4) and n.min() >= s["n_min"] and n.max() <= s["n_max"]
    other = build_problem({**s, "seed": 1})
    assert not np.array_equal(np.asarray(other["train"].y), np.asarray(a["train"].y))
    np.testing.assert_allclose(proximal_work((1, 4), 0.1, 0.0), (1, 4))
    np.testing.assert_allclose(proximal_work((1, 4), 0.1, 5.0), (1, (1 - 0.5**4) / 0.5))


# --------------------------------------------------------------------------- the preset


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("nova") / "cmp"
    args = [f"{k}={v}" for k, v in SMALL.items()]
    assert cli.main(["compare", PRESET, "--set", *args, "--out", str(out),
                     "--no-progress"]) == 0
    return out


def _per_seed(out) -> dict:
    rows = read_csv(out / "per_seed.csv")
    return {m: {k: np.array([float(r[k]) for r in rows if r["method"] == m])
                for k in ("dist_to_optimum", "dist_to_surrogate", "excess_loss")}
            for m in ("fedavg", "fednova", "fedprox")}


def test_fednova_reaches_the_optimum_fedavg_the_surrogate(compared):
    assert [r["method"] for r in read_csv(compared / "results.csv")] == [
        "fedavg", "fednova", "fedprox"]
    problem = build_problem(_settings())
    gap = np.linalg.norm(problem["optimum"] - problem["surrogate"], axis=-1)
    got = _per_seed(compared)
    fedavg, fednova = got["fedavg"], got["fednova"]
    assert np.all(fednova["dist_to_optimum"] < 0.2 * fedavg["dist_to_optimum"])
    assert np.all(fedavg["dist_to_optimum"] > 0.7 * gap)
    assert np.all(fedavg["dist_to_surrogate"] < 0.3 * gap)
    assert np.all(fednova["excess_loss"] < 0.05 * fedavg["excess_loss"])
    # FedProx's proximal term shrinks the work's spread: between the two.
    prox = got["fedprox"]["dist_to_optimum"]
    assert np.all((fednova["dist_to_optimum"] < prox) & (prox < fedavg["dist_to_optimum"]))


def test_reported_distances_are_those_of_the_exact_fixed_points(compared):
    """At the run's lr each method stops at its rounds' own fixed point (float64 here)."""
    s = _settings()
    problem = build_problem(s)
    got = _per_seed(compared)
    for seed in range(s["seeds"]):
        for name, point in zip(("fedavg", "fednova"), _fixed_points(problem, seed, s["lr"]),
                               strict=True):
            for metric, target in (("dist_to_optimum", "optimum"),
                                   ("dist_to_surrogate", "surrogate")):
                np.testing.assert_allclose(
                    got[name][metric][seed], np.linalg.norm(point - problem[target][seed]),
                    rtol=2e-3, atol=2e-4, err_msg=f"{name} {metric} seed {seed}")


def test_notes_give_the_fixed_points(compared):
    import json

    notes = json.loads((compared / "notes.json").read_text())
    assert "‖w* − w̃‖" in notes["fixed_points"] and "τ_i = 1, 3, 5, 6, 8, 10" in notes["work"]
    assert "ημ" in notes["fedprox_fixed_point"]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("overrides, named", [
    (["tau_min=8", "tau_max=3"], "setting tau_min=8 exceeds tau_max=3"),
    (["tau_min=-1"], "setting tau_min must be an integer"),
    (["tau_min=0"], "setting tau_min must be an integer"),
    (["tau_max=0"], "setting tau_max must be an integer"),
    (["n_min=20", "n_max=10"], "setting n_min=20 exceeds n_max=10"),
    (["num_clients=2", "n_min=1", "n_max=3", "d=4"], "w* would not be unique"),
    (["weighting=size"], "setting weighting must be one of examples, uniform"),
    (["R=-1"], "setting R must be a finite number >= 0"),
    (["methods=fedavg,ifca"], "method ifca needs"),
    (["methods=fednova"], "include the baseline fedavg"),
])
def test_bad_settings_are_refused_naming_them(tmp_path, capsys, overrides, named):
    out = tmp_path / "refused"
    assert cli.main(["compare", PRESET, "--set", *overrides, "--out", str(out),
                     "--no-progress"]) == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_validate_raises_value_errors():
    with pytest.raises(ValueError, match="tau_min=5 exceeds tau_max=4"):
        EXPERIMENT.validate({**_settings(), "tau_min": 5, "tau_max": 4})
