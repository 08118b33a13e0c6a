"""ifca-theory: the measures against known answers, the preset end to end, bad settings."""

from __future__ import annotations

import itertools
import json

import jax
import numpy as np
import pytest

from fedjax_sim.experiments import ifca_theory
from fedjax_sim.experiments.registry import PRESETS
from fedjax_sim.experiments.runner import run_preset

TINY = {"m": 4, "n": 20, "d": 3, "rounds": 6, "seeds": 2, "deltas": [0.1, 0.4],
        "n_grid": [10, 20], "success_deltas": [0.2, 2.0], "success_seeds": 3}


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
    errors = ifca_theory.trajectories(s, n=s["n"], deltas=[0.3], seeds=1, fresh=False)[0, 0]
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


def test_preset_runs_end_to_end(tmp_path):
    out = run_preset("ifca-theory", TINY, out_dir=tmp_path / "run", progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["slope_vs_N"]) == {"fixed", "fresh"}
    assert all(np.isfinite(v) for v in summary["slope_vs_N"].values())
    assert len(summary["success_vs_delta"]) == 2
    assert len(summary["linear_phase"]) == 4  # 2 variants × 2 δ
    for name in ("metrics.csv", "error_vs_N.csv", "success_vs_delta.csv", "linear_phase.csv",
                 "theory.png"):
        assert (out / name).exists(), name
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header == ["round", "fixed_delta0.1", "fixed_delta0.4", "fresh_delta0.1",
                      "fresh_delta0.4"]


@pytest.mark.parametrize("setting,value", [
    ("sigma", 0.0), ("R", 0.0), ("threshold", 0.0), ("n_grid", [10]), ("n_grid", [1, 10]),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, setting, value):
    with pytest.raises(ValueError, match=f"setting {setting}") as err:
        run_preset("ifca-theory", {**TINY, setting: value}, out_dir=tmp_path / "bad",
                   progress=False)
    assert "\n" not in str(err.value)


def test_preset_is_registered():
    assert PRESETS["ifca-theory"].commands == ("run",)
