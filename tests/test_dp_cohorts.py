"""The dp-cohorts-synthetic experiment: DP-FedAvg on generated clients, and the noise shortcut.

ε is recomputed here with Google's dp-accounting called directly (not fedjax_sim's
accounting module): the shortcut's claim is a Poisson-sampled Gaussian of the run's σ at
q = N/m (PLD, add-or-remove); the run as trained is the same event at the trained cohort's
q with the sum's multiplier σ·(q·m)/N, by RDP at dp-accounting's default orders.
"""

from __future__ import annotations

import csv
import json

import dp_accounting
import pytest

from fedjax_sim import cli

M, Q, SIGMA = 2000, 0.01, 1.0  # an expected cohort of 20
TINY = [f"m={M}", "k=2", "n=5", "n_test=5", "d=3", "test_clients=20", "rounds=2",
        "eval_every=1", "seeds=2", f"participation={Q}", "target_epsilon=0",
        f"dp_noise={SIGMA}", "dp_delta=1e-5"]


def _pld_epsilon(sigma, q, rounds, delta):
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                rounds)
    return acc.get_epsilon(delta)


def _rdp_epsilon(sigma, q, rounds, delta):
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                rounds)
    return acc.get_epsilon(delta)


def _main(*args) -> int:
    return cli.main([*args, "--no-progress"])


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_the_shortcut_reports_the_epsilon_it_claims_and_says_so(tmp_path):
    out = tmp_path / "run"
    assert _main("run", "dp-cohorts-synthetic", "--out", str(out), "--set", *TINY,
                 "dp_noise_cohort=200") == 0
    summary = json.loads((out / "summary.json").read_text())
    record = summary["privacy"]
    assert record["shortcut"] is True and record["noise_cohort_size"] == 200
    assert record["claimed_q"] == pytest.approx(200 / M)
    assert "holds only for a run that trained 200 clients" in record["claim"]
    assert record["noise_multiplier"] == SIGMA and record["q"] == Q
    by_round = {}
    for row in _rows(out / "metrics.csv"):
        by_round.setdefault(int(row["round"]), []).append(row)
    assert sorted(by_round) == [0, 1, 2]
    for r in (1, 2):  # the claim: q = N/m
        claimed = _pld_epsilon(SIGMA, 200 / M, r, 1e-5)
        as_trained = _rdp_epsilon(SIGMA * Q * M / 200, Q, r, 1e-5)
        assert as_trained > 2 * claimed  # the run trained is far less private than claimed
        for row in by_round[r]:
            assert float(row["epsilon"]) == pytest.approx(claimed, rel=1e-5)
            assert float(row["epsilon_as_trained"]) == pytest.approx(as_trained, rel=1e-5)
    assert summary["final_mean"]["epsilon"] == pytest.approx(_pld_epsilon(SIGMA, 200 / M, 2,
                                                                          1e-5), rel=1e-5)
    assert record["epsilon_as_trained"] == pytest.approx(
        _rdp_epsilon(SIGMA * Q * M / 200, Q, 2, 1e-5), rel=1e-5)
    assert record["trained_noise_multiplier"] == pytest.approx(SIGMA * Q * M / 200)
    for metric in ("test_loss", "mean_dist", "min_dist"):
        assert summary["final_mean"][metric] > 0


def test_a_two_cell_sweep_the_shortcut_at_the_trained_cohort_is_the_real_run(tmp_path):
    """dp_noise_cohort = q·m (the cohort that trains) adds the real run's noise and is
    accounted at the real q: the two cells train and report the same numbers."""
    out = tmp_path / "sweep"
    assert _main("sweep", "dp-cohorts-synthetic", "--out", str(out), "--set", *TINY,
                 f"dp_noise_cohort=0,{round(Q * M)}") == 0
    trials = _rows(out / "trials.csv")
    assert sorted((int(t["dp_noise_cohort"]), int(t["data_seed"])) for t in trials) == [
        (0, 0), (0, 1), (20, 0), (20, 1)]
    real = {int(t["data_seed"]): t for t in trials if t["dp_noise_cohort"] == "0"}
    short = {int(t["data_seed"]): t for t in trials if t["dp_noise_cohort"] == "20"}
    for seed in (0, 1):
        for metric in ("test_loss", "mean_dist", "min_dist", "epsilon"):
            assert float(short[seed][metric]) == float(real[seed][metric]), metric
        # the shortcut's own ε is by RDP (an upper bound on the PLD's)
        assert float(short[seed]["epsilon_as_trained"]) == pytest.approx(
            _rdp_epsilon(SIGMA, Q, 2, 1e-5), rel=1e-5)
        assert float(real[seed]["epsilon"]) == pytest.approx(_pld_epsilon(SIGMA, Q, 2, 1e-5),
                                                             rel=1e-5)
    assert len(_rows(out / "summary.csv")) == 2


@pytest.mark.parametrize("command, settings, message", [
    ("run", ["dp_noise_cohort=10"], "dp_noise_cohort=10 must be 0 (off) or between the "
                                    "expected cohort (20"),
    ("run", [f"dp_noise_cohort={M + 1}"], "between the expected cohort"),
    ("run", ["dp_noise_cohort=100", "dp_clip=0"], "dp_noise_cohort (the noise shortcut) needs DP"),
    ("run", ["test_clients=5000", "dp_noise_cohort=0"], "test_clients=5000 exceeds m=2000"),
    ("sweep", ["dp_noise_cohort=0,10"], "dp_noise_cohort=10 must be 0 (off)"),
])
def test_bad_settings_are_refused_in_one_line_and_write_nothing(tmp_path, capsys, command,
                                                                settings, message):
    out = tmp_path / "out"
    given = {item.split("=")[0] for item in settings}
    tiny = [item for item in TINY if item.split("=")[0] not in given]
    assert _main(command, "dp-cohorts-synthetic", "--out", str(out), "--set", *tiny,
                 *settings) != 0
    err = capsys.readouterr().err
    assert message in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not out.exists() or not any(out.iterdir())
