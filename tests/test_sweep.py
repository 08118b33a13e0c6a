"""Success-probability sweeps: the protocol, the vectorized cell, resuming, outputs."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import default_optimization_env

from fedjax_sim import experiments, ifca, linear_mixture, linear_regression, plots, sgd, stats
from fedjax_sim.experiments import ifca_success, ifca_synthetic, runner
from fedjax_sim.io import read_csv
from fedjax_sim.metrics import min_dist


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_small_sweep_success_rises_with_R(tmp_path):
    # 200 trials at d = 1000 are compute-bound: run at XLA's default optimisation level
    # (conftest.py compiles everything else at level 0), through the CLI.
    out = tmp_path / "s"
    subprocess.run([sys.executable, "-m", "fedjax_sim.cli", "sweep", "ifca-success-small",
                    "--out", str(out), "--no-progress"], env=default_optimization_env(),
                   check=True, capture_output=True, timeout=900)
    summary = _rows(out / "summary.csv")
    assert list(summary[0])[:8] == ["k", "m", "n", "d", "sigma", "R", "seeds", "success_prob"]
    grid = experiments.PRESETS["ifca-success-small"].defaults
    assert [float(r["R"]) for r in summary] == grid["R"]
    assert all(int(r["seeds"]) == grid["seeds"] == 40 for r in summary)
    p = np.array([float(r["success_prob"]) for r in summary])
    for row, prob in zip(summary, p, strict=True):  # the 95 % Wilson interval of each cell
        low, high = stats.wilson_interval(round(prob * 40), 40)
        assert float(row["ci_low"]) == pytest.approx(low)
        assert float(row["ci_high"]) == pytest.approx(high)
        assert float(row["ci_low"]) <= prob <= float(row["ci_high"])
    assert p[0] <= 0.2, p
    assert p[-1] >= 0.9, p
    assert np.all(np.diff(p) >= -1 / 40), p  # rises with R (up to one seed of noise)
    assert len(_rows(out / "trials.csv")) == len(grid["R"]) * 40
    assert (out / "success_vs_R.png").exists()


def test_cell_equals_separate_runs():
    """Every (seed, lr, restart) of the vmapped cell equals a plain run of IFCA."""
    k, m, n, d, rounds = 2, 8, 6, 4, 15
    lrs = [0.5, 0.1]
    cell = dict(k=k, m=m, n=n, d=d, sigma=0.3, R=0.7, lr=lrs, rounds=rounds, restarts=3,
                seeds=2, seed=5, threshold_offset=0.0)
    got = np.asarray(ifca_synthetic.cell_min_dist(
        jax.random.key(5), jnp.arange(2), 0.3, 0.7, jnp.asarray(lrs),
        k=k, m=m, n=n, d=d, rounds=rounds, restarts=3,
    ))
    assert got.shape == (2, 2, 3)
    base = jax.random.key(5)
    for seed in range(2):
        problem = linear_mixture(
            jax.random.fold_in(jax.random.fold_in(base, 0), seed),
            k=k, m=m, n=n, d=d, sigma=0.3, R=0.7,
        )
        for i, lr in enumerate(lrs):
            algorithm = ifca(linear_regression(d), sgd(lr), num_clusters=k)
            step = jax.jit(algorithm.round)
            for r in range(3):
                state = algorithm.init(jax.random.fold_in(jax.random.fold_in(base, 1), r),
                                       problem.train)
                for t in range(rounds):
                    key = jax.random.fold_in(jax.random.fold_in(base, 2), t)
                    state, _ = step(state, problem.train, key)
                want = float(min_dist(state.cluster_params, problem.theta_star))
                np.testing.assert_allclose(got[seed, i, r], want, rtol=2e-4, atol=1e-6)
    rows = ifca_success.SUCCESS.sweep.trials(cell, [0, 1])
    for row, runs in zip(rows, got, strict=True):
        assert row["best_min_dist"] == pytest.approx(float(runs.min()), rel=1e-6)


def test_seed_whose_runs_all_diverge_is_a_failure():
    cell = dict(k=2, m=8, n=6, d=4, sigma=0.1, R=0.5, lr=[1e6, 1e5], rounds=30, restarts=2,
                seeds=2, seed=0, threshold_offset=0.001)
    rows = ifca_success.SUCCESS.sweep.trials(cell, [0, 1])
    for row in rows:
        assert row["all_diverged"] == 1
        assert row["diverged_runs"] == 4
        assert row["success"] == 0
        assert np.isnan(row["best_min_dist"])
    key = runner.cell_id(experiments.PRESETS["ifca-success-small"], cell)
    summary = ifca_success.SUCCESS.sweep.summarize(
        [{**r, "cell_id": key} for r in rows], [{**cell, "cell_id": key}], [])
    assert summary[0]["success_prob"] == 0.0
    assert summary[0]["all_diverged_seeds"] == 2
    assert summary[0]["seeds"] == 2
    assert summary[0]["ci_low"] == 0.0
    assert summary[0]["ci_high"] == pytest.approx(stats.wilson_interval(0, 2)[1])


def test_diverged_runs_are_never_the_best():
    # lr=1e6 diverges, lr=0.5 does not: the best is the finite one.
    cell = dict(k=2, m=8, n=20, d=4, sigma=0.1, R=1.0, lr=[1e6, 0.5], rounds=60, restarts=4,
                seeds=1, seed=0, threshold_offset=0.001)
    (row,) = ifca_success.SUCCESS.sweep.trials(cell, [0])
    assert row["diverged_runs"] == 4 and row["all_diverged"] == 0
    assert row["best_lr"] == 0.5
    assert np.isfinite(row["best_min_dist"])


def test_resume_loses_and_duplicates_nothing(tmp_path):
    overrides = ["R=0.4,1.6", "seeds=5", "rounds=40", "restarts=3", "memory_budget_gb=0.00001"]
    full = experiments.sweep_preset(
        "ifca-success-small", overrides, out_dir=tmp_path / "full", progress=False
    )
    # memory_budget_gb that small gives one seed per chunk, so rows land one by one.
    lines = (full / "trials.csv").read_text().splitlines(keepends=True)
    assert len(lines) == 1 + 10
    part = tmp_path / "part"
    part.mkdir()
    # A sweep killed after 4 rows, in the middle of writing the fifth.
    (part / "trials.csv").write_text("".join(lines[:5]) + lines[5][:7])
    with pytest.raises(ValueError, match="already holds a trials.csv"):
        experiments.sweep_preset("ifca-success-small", overrides, out_dir=part, progress=False)
    # Resume needs the config.json a sweep writes before its first trial.
    with pytest.raises(ValueError, match="holds no config.json"):
        experiments.sweep_preset("ifca-success-small", overrides, out_dir=part, progress=False,
                                 resume=True)
    (part / "config.json").write_bytes((full / "config.json").read_bytes())
    # ...and a temporary file a write killed before its rename left: the resume deletes it.
    stale = part / ".summary.csv.0123456789ab.tmp"
    stale.write_text("R,")
    with pytest.raises(ValueError, match=r"already holds a run \(config.json\)"):
        experiments.sweep_preset("ifca-success-small", overrides, out_dir=part, progress=False)
    experiments.sweep_preset(
        "ifca-success-small", overrides, out_dir=part, progress=False, resume=True
    )
    key = lambda r: (float(r["R"]), int(r["data_seed"]))  # noqa: E731
    resumed = sorted(_rows(part / "trials.csv"), key=key)
    original = sorted(_rows(full / "trials.csv"), key=key)
    assert [key(r) for r in resumed] == [key(r) for r in original]
    assert resumed == original
    assert _rows(part / "summary.csv") == _rows(full / "summary.csv")
    assert not stale.exists()


def test_m_n_grid_expands_to_cells_and_plots_a_curve_per_n(tmp_path, monkeypatch):
    preset = experiments.PRESETS["ifca-success-m-n-k2"]
    settings = {**preset.defaults}
    axes = runner.sweep_axes(preset, settings)
    assert axes == ["m", "n", "R"]  # lr is a grid searched within each cell, not an axis
    cells = runner.expand_cells(settings, axes)
    assert len(cells) == 7 * 3 * 2
    assert {(c["m"], c["n"], c["R"]) for c in cells} == {
        (m, n, R) for m in settings["m"] for n in settings["n"] for R in settings["R"]
    }
    assert all(c["lr"] == settings["lr"] for c in cells)
    assert len({runner.cell_id(preset, c) for c in cells}) == len(cells)
    summary = []
    for c in cells:
        p = min(1.0, c["m"] * c["n"] / 40000)
        low, high = stats.wilson_interval(round(p * 40), 40)
        summary.append({**{key: c[key] for key in ifca_synthetic.SWEEP_KEYS}, "seeds": 40,
                        "success_prob": p, "ci_low": low, "ci_high": high})
    calls = []
    real_plot_curves = plots.plot_curves

    def spy(rows, path, **kw):
        calls.append((path.name, kw))
        return real_plot_curves(rows, path, **kw)

    monkeypatch.setattr(plots, "plot_curves", spy)
    written = ifca_success.SUCCESS.sweep.plot(summary, tmp_path)
    assert sorted(p.name for p in written) == ["success_vs_R.png", "success_vs_m.png"]
    kwargs = dict(calls)
    assert kwargs["success_vs_R.png"]["log_x"] is True  # R on a log axis
    assert kwargs["success_vs_m.png"]["log_x"] is False
    for kw in kwargs.values():
        assert kw["ci"] == ("ci_low", "ci_high")  # 95 % intervals drawn
    assert (tmp_path / "success_vs_R.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "success_vs_m.png").read_bytes()[:4] == b"\x89PNG"


def test_official_grids_are_the_papers():
    p = experiments.PRESETS
    r2 = p["ifca-success-r-noise-k2"].defaults
    assert (r2["k"], r2["m"], r2["n"], r2["d"]) == (2, 100, 100, 1000)
    assert r2["sigma"] == [0.0, 0.1, 0.2, 0.4] and r2["R"] == [0.1, 0.25, 0.5, 0.75, 1.0]
    assert r2["lr"] == [1.0, 0.1, 0.01] and r2["threshold_offset"] == 0.001
    r4 = p["ifca-success-r-noise-k4"].defaults
    assert (r4["k"], r4["m"], r4["lr"]) == (4, 400, [2.0, 1.0, 0.5])
    mn2 = p["ifca-success-m-n-k2"].defaults
    assert mn2["m"] == [50, 70, 100, 150, 200, 300, 400] and mn2["n"] == [50, 100, 200]
    assert mn2["threshold_offset"] == 0.0 and mn2["R"] == [0.1, 0.25]
    mn4 = p["ifca-success-m-n-k4"].defaults
    assert mn4["m"] == [100, 200, 300, 400, 800] and mn4["R"] == [0.5, 0.75]
    for name in ("ifca-success-r-noise-k2", "ifca-success-r-noise-k4",
                 "ifca-success-m-n-k2", "ifca-success-m-n-k4"):
        grid = p[name].defaults
        assert (grid["rounds"], grid["restarts"], grid["seeds"]) == (300, 10, 40)


def test_traced_axes_are_one_compiled_program_equal_to_separate_runs(tmp_path):
    """A sweep over lr (traced) is one vmapped compile; each trial equals `run` with its seed."""
    before = ifca_synthetic._final_runs._cache_size()
    out = experiments.sweep_preset(
        "ifca-synthetic-tiny", {"lr": "0.05,0.1", "seeds": "2", "rounds": "20"},
        out_dir=tmp_path / "sweep", progress=False)
    assert ifca_synthetic._final_runs._cache_size() == before + 1  # both cells, both seeds
    trials = {(float(r["lr"]), int(r["data_seed"])): r for r in read_csv(out / "trials.csv")}
    assert len(trials) == 4
    for lr, seed in ((0.05, 1), (0.1, 0)):
        run_dir = experiments.run_preset(
            "ifca-synthetic-tiny", {"lr": str(lr), "seed": str(seed), "rounds": "20",
                                    "eval_every": "20"},
            out_dir=tmp_path / f"run-{lr}-{seed}", progress=False)
        final = json.loads((run_dir / "summary.json").read_text())["final"]
        row = trials[(lr, seed)]
        for metric in ("train_loss", "test_loss", "cluster_accuracy", "min_dist"):
            np.testing.assert_allclose(float(row[metric]), final[metric], rtol=1e-5, atol=1e-7)
        assert row["diverged"] == "0"
