"""ifca-theory: the measures against known answers, sample splitting against a loop over one
fixed sample, the preset end to end, bad settings."""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest

from fedjax_sim.data import generated_mixture
from fedjax_sim.experiments import ifca_theory
from fedjax_sim.experiments.base import DATA, INIT
from fedjax_sim.experiments.registry import PRESETS
from fedjax_sim.experiments.runner import run_preset

TINY = {"m": 4, "n": 20, "d": 3, "rounds": 6, "seeds": 2, "deltas": [0.1, 0.4],
        "n_grid": [12, 24], "success_deltas": [0.2, 2.0], "success_seeds": 3}


def test_loglog_slope_recovers_a_power_law():
    x = np.array([10.0, 30.0, 100.0, 1000.0])
    assert ifca_theory.loglog_slope(x, 3.0 * x ** -0.5) == pytest.approx(-0.5, abs=1e-12)
    assert ifca_theory.loglog_slope(x, 0.2 * x ** 1.7) == pytest.approx(1.7, abs=1e-12)


def test_linear_rate_recovers_a_geometric_phase_then_a_floor():
    t = np.arange(60)
    errors = np.maximum(2.0 * 0.8 ** t, 1e-3)  # floor 1e-3 from t ≈ 34
    rate, fitted = ifca_theory.linear_rate(errors)
    assert rate == pytest.approx(0.8, abs=1e-9)
    assert 20 < fitted < 34
    assert ifca_theory.linear_rate(np.full(10, 0.5))[0] is None  # no phase above the floor


@pytest.mark.parametrize("option,lr,want", [
    ("gradient", 0.2, 1 - 2 * 0.2 / 2),  # 1 − 2γ/k: (γ/m)·Σ over a cluster's m/k clients
    ("model", 0.05, (1 - 2 * 0.05) ** 2),  # (1 − 2γ)^τ: τ = 2 local steps, averaged
])
def test_noiseless_rate_is_the_population_contraction(option, lr, want):
    # σ → 0 and many rows per client: the empirical Hessians are ≈ 2I (squared loss, no ½).
    s = {**ifca_theory.THEORY.defaults(), "k": 2, "m": 20, "n": 1000, "d": 5,
         "sigma": 1e-6, "lr": lr, "rounds": 40, "option": option, "local_steps": 2}
    assert ifca_theory.population_contraction(s) == pytest.approx(want)
    errors = ifca_theory.trajectories(s, n=s["n"], deltas=[0.3], seeds=1)[0, 0]
    rate, fitted = ifca_theory.linear_rate(errors)
    assert fitted >= 20
    assert rate == pytest.approx(want, abs=0.01)


def test_matched_error_against_numpy():
    rng = np.random.default_rng(0)
    for k in (1, 2, 3, 4):
        params, star = rng.normal(size=(k, 6)), rng.normal(size=(k, 6))
        params = params[rng.permutation(k)]
        want = min(np.mean([np.linalg.norm(params[j] - star[p[j]]) for j in range(k)])
                   for p in itertools.permutations(range(k)))
        got = float(ifca_theory.matched_error(params.astype(np.float32),
                                              star.astype(np.float32)))
        assert got == pytest.approx(want, rel=1e-5)


def test_close_init_is_delta_separations_away():
    # Δ_j: the nearest other θ* (θ*_1 is 5 from θ*_0 and √26 from θ*_2).
    star = jax.numpy.asarray([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0], [0.0, 0.0, 1.0]])
    init = np.asarray(ifca_theory.close_init(jax.random.key(0), star, 0.5))
    dist = np.linalg.norm(init - np.asarray(star), axis=-1)
    np.testing.assert_allclose(dist, [0.5 * 1.0, 0.5 * 5.0, 0.5 * 1.0], rtol=1e-6)


@pytest.mark.parametrize("n,rounds", [(12, 6), (13, 3), (100, 7), (5, 2)])
def test_split_parts_are_disjoint_rows_of_one_sample(n, rounds):
    parts = ifca_theory.split_parts(n, rounds)
    size = n // (2 * rounds)
    assert parts.shape == (rounds, 2, size)
    rows = parts.reshape(-1)
    assert len(np.unique(rows)) == rows.size == 2 * rounds * size  # no row used twice
    assert rows.min() >= 0 and rows.max() < n


def test_split_below_one_row_per_part_is_refused():
    s = {**ifca_theory.THEORY.defaults(), "rounds": 6}
    with pytest.raises(ValueError, match="n=11") as err:
        ifca_theory.trajectories(s, n=11, deltas=[0.1], seeds=1, variant="split")
    assert "\n" not in str(err.value)


def _split_loop(x, y, theta_star, init, *, rounds, lr, option, local_steps):
    """The paper's sample splitting, float64, one client at a time: client i's one fixed
    sample of n rows is cut into 2T disjoint parts Z_i^(0..2T-1) of ⌊n/2T⌋ rows;
    iteration t picks ĵ_i = argmin_j F_i(θ_j; Z_i^(2t)) and updates on Z_i^(2t+1).
    Returns the matched errors [T + 1] and every (client, row) the run read."""
    m, n, _ = x.shape
    k = theta_star.shape[0]
    size = n // (2 * rounds)
    theta = init.copy()
    used = []

    def loss(th, rows):
        return np.mean((x[i, rows] @ th - y[i, rows]) ** 2)

    def grad(th, rows):
        return 2.0 / len(rows) * x[i, rows].T @ (x[i, rows] @ th - y[i, rows])

    def error(th):
        return min(np.mean([np.linalg.norm(th[j] - theta_star[p[j]]) for j in range(k)])
                   for p in itertools.permutations(range(k)))

    errors = [error(theta)]
    for t in range(rounds):
        assign_rows = np.arange(2 * t * size, (2 * t + 1) * size)
        step_rows = np.arange((2 * t + 1) * size, (2 * t + 2) * size)
        new_sum, count = np.zeros_like(theta), np.zeros(k)
        for i in range(m):
            used += [(i, r) for r in (*assign_rows, *step_rows)]
            j = int(np.argmin([loss(theta[c], assign_rows) for c in range(k)]))
            if option == "gradient":  # θ_j ← θ_j − (γ/m) Σ_{i: ĵ_i = j} ∇F_i(θ_j)
                new_sum[j] += grad(theta[j], step_rows)
            else:  # τ local full-batch steps from θ_ĵ, then the cluster's uniform mean
                local = theta[j].copy()
                for _ in range(local_steps):
                    local = local - lr * grad(local, step_rows)
                new_sum[j] += local
                count[j] += 1
        if option == "gradient":
            theta = theta - lr / m * new_sum
        else:
            theta = np.where(count[:, None] > 0, new_sum / np.maximum(count, 1)[:, None], theta)
        errors.append(error(theta))
    return np.array(errors), used


@pytest.mark.parametrize("option,lr", [("gradient", 0.3), ("model", 0.1)])
def test_split_variant_equals_a_loop_over_one_fixed_sample(option, lr):
    s = {**ifca_theory.THEORY.defaults(), "k": 2, "m": 6, "n": 27, "d": 3, "sigma": 0.5,
         "lr": lr, "rounds": 4, "option": option, "local_steps": 2, "seed": 3}
    deltas = [0.3, 1.2]
    got = ifca_theory.trajectories(s, n=s["n"], deltas=deltas, seeds=2, variant="split")
    seed_key = jax.random.key(s["seed"])
    for seed_id in range(2):
        problem = generated_mixture(
            jax.random.fold_in(jax.random.fold_in(seed_key, DATA), seed_id),
            k=2, m=s["m"], n=s["n"], d=s["d"], sigma=s["sigma"], R=s["R"])
        sample = problem.train.materialize()  # the one fixed sample of n rows per client
        x, y = np.asarray(sample.x, np.float64), np.asarray(sample.y, np.float64)
        star = np.asarray(problem.theta_star, np.float64)
        init_key = jax.random.fold_in(jax.random.fold_in(seed_key, INIT), seed_id)
        for i, delta in enumerate(deltas):
            init = np.asarray(ifca_theory.close_init(init_key, problem.theta_star, delta),
                              np.float64)
            want, used = _split_loop(x, y, star, init, rounds=s["rounds"], lr=lr,
                                     option=option, local_steps=s["local_steps"])
            assert len(used) == len(set(used)) == s["m"] * 2 * s["rounds"] * 3  # 3 rows/part
            np.testing.assert_allclose(got[seed_id, i], want, rtol=2e-4, atol=1e-6)
    # splitting reads 24 of the 27 rows once each; fixed data re-reads all of them: not equal
    fixed = ifca_theory.trajectories(s, n=s["n"], deltas=deltas, seeds=2)
    assert not np.allclose(fixed[:, :, -1], got[:, :, -1], rtol=1e-3)


def test_preset_runs_end_to_end(tmp_path):
    out = run_preset("ifca-theory", TINY, out_dir=tmp_path / "run", progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["slope_vs_N"]) == {"fixed", "split", "fresh_stream"}
    assert all(np.isfinite(v) for v in summary["slope_vs_N"].values())
    assert len(summary["success_vs_delta"]) == 2
    assert len(summary["linear_phase"]) == 6  # 3 variants × 2 δ
    assert summary["split_part_rows"] == 1  # ⌊20 / (2 · 6)⌋
    assert [r["split_part_rows"] for r in summary["error_vs_N"]] == [1, 2]
    for name in ("metrics.csv", "error_vs_N.csv", "success_vs_delta.csv", "linear_phase.csv",
                 "theory.png"):
        assert (out / name).exists(), name
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == ["round", "fixed_delta0.1", "fixed_delta0.4", "split_delta0.1",
                      "split_delta0.4", "fresh_stream_delta0.1", "fresh_stream_delta0.4"]


@pytest.mark.parametrize("setting,value", [
    ("sigma", 0.0), ("R", 0.0), ("threshold", 0.0), ("n_grid", [12]), ("n_grid", [1, 12]),
    ("n", 11), ("n_grid", [12, 11]),  # sample splitting: n/(2·rounds) < 1 row per part
])
def test_bad_settings_are_refused_in_one_line(tmp_path, setting, value):
    with pytest.raises(ValueError, match=f"setting {setting}") as err:
        run_preset("ifca-theory", {**TINY, setting: value}, out_dir=tmp_path / "bad",
                   progress=False)
    assert "\n" not in str(err.value)


def test_preset_is_registered():
    assert PRESETS["ifca-theory"].commands == ("run",)
