"""DP as experiment settings: a run's ε per evaluated round, its calibration, refusals.

ε is recomputed here with Google's dp-accounting called directly (not fedjax_sim's
accounting module): a Poisson-sampled Gaussian of the run's σ at q = participation,
composed over the evaluated round's count, by the PLD accountant (add-or-remove).
"""

from __future__ import annotations

import csv
import json

import dp_accounting
import pytest

from fedjax_sim import cli

TINY = ["num_clients=40", "rounds=4", "eval_every=2", "seeds=2", "hidden=8",
        "local_steps=2"]


def _pld_epsilon(sigma, q, rounds, delta):
    acc = dp_accounting.pld.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                rounds)
    return acc.get_epsilon(delta)


def _run(tmp_path, *settings):
    out = tmp_path / "run"
    code = cli.main(["run", "dp-hetero-digits", "--out", str(out), "--no-progress", "--set",
                     *TINY, *settings])
    return code, out


def test_a_run_reports_epsilon_after_every_evaluation_and_meets_its_target(tmp_path):
    code, out = _run(tmp_path, "method=fedavg", "target_epsilon=3")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    record = summary["privacy"]
    sigma, q, delta = record["noise_multiplier"], record["q"], record["delta"]
    assert (q, delta, record["sampling"], record["accountant"]) == (0.2, 1e-5, "poisson", "pld")
    final = _pld_epsilon(sigma, q, 4, delta)
    assert final <= 3.0 and final == pytest.approx(3.0, rel=0.01)  # calibrated within 1 %
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    by_round = {int(r["round"]): float(r["epsilon"]) for r in rows if r["epsilon"]}
    assert sorted(by_round) == [0, 2, 4]
    assert by_round[0] == 0.0
    for r in (2, 4):
        assert by_round[r] == pytest.approx(_pld_epsilon(sigma, q, r, delta), rel=1e-5)
    assert summary["final_mean"]["epsilon"] == pytest.approx(final, rel=1e-5)
    # the Poisson cohort's static slots overflow with probability at most 1e-9
    assert record["poisson_overflow"] <= 1e-9 and record["cohort_slots"] >= 8


def test_dp_noise_is_used_as_given_without_a_target(tmp_path):
    code, out = _run(tmp_path, "method=ifca", "target_epsilon=0", "dp_noise=1.5")
    assert code == 0
    record = json.loads((out / "summary.json").read_text())["privacy"]
    assert record["noise_multiplier"] == 1.5


@pytest.mark.parametrize("settings, message", [
    (["method=qffl"], "cannot be trained with user-level DP"),
    (["method=fedavg", "dp_sampling=fixed"], "dp_sampling=fixed needs dp_accountant=rdp"),
    (["method=fedavg", "dp_delta=1.5"], "dp_delta"),
    (["method=fedavg", "dp_clip=-1"], "dp_clip"),
    (["method=fedavg", "target_epsilon=1e-4"], "unreachable"),
])
def test_bad_dp_settings_are_refused_in_one_line_and_write_nothing(tmp_path, capsys, settings,
                                                                   message):
    code, out = _run(tmp_path, *settings)
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not (out / "metrics.csv").exists() and not (out / "summary.json").exists()
