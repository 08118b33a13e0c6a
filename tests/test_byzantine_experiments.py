"""Byzantine clients and robust rules as experiment settings (`experiments.robustness`).

Runs go through `fedjax_sim.cli.main` on the hetero digits at a tiny size; the Byzantine
clients a run trains with are read from the state its own init builds (the key
`simulate` splits off for init), and their count checked against ⌊share·m⌋ by hand.
"""

from __future__ import annotations

import csv
import json

import jax
import numpy as np
import pytest

from fedjax_sim import cli
from fedjax_sim.experiments import robustness, study
from fedjax_sim.experiments.hetero import HETERO

TINY = ["num_clients=20", "rounds=2", "eval_every=1", "seeds=2", "hidden=8", "local_steps=2",
        "tune_lr=none"]


def _main(tmp_path, command, *settings, preset="hetero-digits"):
    out = tmp_path / command
    code = cli.main([command, preset, "--out", str(out), "--no-progress", "--set", *TINY,
                     *settings])
    return code, out


def test_a_run_with_an_attack_and_a_robust_rule_records_both(tmp_path):
    code, out = _main(tmp_path, "run", "method=fedavg", "aggregator=trimmed_mean",
                      "byzantine=0.2", "attack=sign_flip", "attack_scale=5")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["robustness"] == {
        "aggregator": "trimmed_mean", "pre_aggregation": "none", "bucket_size": None,
        "f": 4, "byzantine_clients": 4, "training_clients": 20, "cohort_slots": 20,
        "attack": "sign_flip", "attack_scale": 5.0}
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["round"] != "0"]
    # every client takes part: the 4 Byzantine ones report in every round
    assert rows and all(float(r["byzantine_reports"]) == 4.0 for r in rows)
    assert all(np.isfinite(float(r["test_accuracy"])) for r in rows)


def test_a_comparison_with_ifca_per_cluster_and_nnm(tmp_path):
    code, out = _main(tmp_path, "compare", "methods=fedavg,ifca", "aggregator=median",
                      "pre_aggregation=nnm", "byzantine=0.1", "attack=alie")
    assert code == 0
    with open(out / "results.csv") as f:
        methods = {r["method"] for r in csv.DictReader(f)}
    assert methods == {"fedavg", "ifca"}


def test_mean_without_byzantine_clients_is_the_plain_run_bit_for_bit(tmp_path):
    code, plain = _main(tmp_path / "a", "run", "method=fedavg")
    assert code == 0
    code, robust = _main(tmp_path / "b", "run", "method=fedavg", "aggregator=mean",
                         "pre_aggregation=none", "byzantine=0", "attack=none")
    assert code == 0
    assert (plain / "metrics.csv").read_bytes() == (robust / "metrics.csv").read_bytes()
    assert "robustness" not in json.loads((robust / "summary.json").read_text())


def test_every_method_of_a_seed_gets_the_same_byzantine_clients():
    s = {**HETERO.defaults(), **dict(kv.split("=") for kv in TINY)}
    s = {k: type(HETERO.defaults()[k])(v) if k in dict(kv.split("=") for kv in TINY)
         and k != "tune_lr" else v for k, v in s.items()}
    s.update(tune_lr=[], aggregator="median", byzantine=0.3, attack="ipm")
    problem = study.problem_for(HETERO, s)
    flags = {}
    for name in ("fedavg", "fedprox", "ifca"):
        spec = study.method_run(HETERO, name, s, problem)
        key_init, _ = jax.random.split(spec.key)  # what simulate.run's init gets
        state = jax.jit(spec.algorithm.init)(key_init, spec.data)
        flags[name] = np.asarray(state.aggregation.byzantine)
    m = robustness.training_clients(s)
    assert flags["fedavg"].shape == (2, m)
    assert (flags["fedavg"].sum(axis=1) == int(0.3 * m)).all()  # ⌊0.3 · 20⌋ = 6 per seed
    assert not (flags["fedavg"][0] == flags["fedavg"][1]).all()  # drawn per seed
    for name in ("fedprox", "ifca"):
        np.testing.assert_array_equal(flags[name], flags["fedavg"])


@pytest.mark.parametrize("settings, message", [
    (["method=qffl", "aggregator=median"], "cannot take a robust rule"),
    (["method=fedavg", "attack=sign_flip"], "needs Byzantine clients"),
    (["method=fedavg", "aggregator=krum", "byzantine=0.45"], "krum: needs n > 2f + 2"),
    (["method=fedavg", "aggregator=krum", "pre_aggregation=bucketing", "byzantine=0.2"],
     "after bucketing with f=4"),
    (["method=fedavg", "aggregator=median", "dp_clip=0.5"], "one aggregation rule"),
    (["method=fedavg", "byzantine=0.01"], "makes none Byzantine"),
    (["method=fedavg", "byzantine=0.1", "attack=mimic", "attack_scale=2"], "attack_scale"),
    (["method=fedavg", "aggregator=median", "cc_tau=2"], "cc_tau"),
])
def test_bad_robust_settings_are_refused_in_one_line_and_write_nothing(tmp_path, capsys,
                                                                       settings, message):
    code, out = _main(tmp_path, "run", *settings)
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not out.exists() or not any(out.iterdir())


def test_a_sweep_cell_beyond_the_rule_is_refused_before_anything_is_written(tmp_path, capsys):
    code, out = _main(tmp_path, "sweep", "method=fedavg", "aggregator=median,bulyan",
                      "byzantine=0.1,0.3")
    assert code != 0
    err = capsys.readouterr().err
    assert "bulyan: needs n ≥ 4f + 3" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not out.exists() or not any(out.iterdir())


def test_robust_ifca_cannot_take_byzantine_members_and_says_so(tmp_path, capsys):
    code, out = _main(tmp_path, "compare", "methods=ifca,robust_ifca",
                      preset="robust-ifca-byzantine-digits")
    assert code != 0
    err = capsys.readouterr().err
    assert "robust_ifca cannot take a robust rule" in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not out.exists() or not any(out.iterdir())


def test_f_is_the_byzantine_count_a_cohort_holds_rounded_up():
    s = {"num_clients": 20, "byzantine": 0.3, "participation": 0.5}
    assert robustness.byzantine_count(s, 20) == 6  # ⌊0.3 · 20⌋, not 5 by rounding
    assert robustness.rule_f(s, 20) == 3  # ⌈6 · 10 / 20⌉
    assert robustness.rule_f({**s, "participation": 0.35}, 20) == 3  # ⌈6 · 7 / 20⌉ = ⌈2.1⌉
    assert robustness.rule_f({**s, "robust_f": 1}, 20) == 1


def test_the_sweep_summary_names_the_worst_attack_of_each_rule():
    from fedjax_sim.experiments.hetero.byzantine import worst_case
    from fedjax_sim.experiments.hetero.experiment import BYZANTINE

    base = BYZANTINE.defaults()
    accuracy = {("median", "none"): 0.8, ("median", "alie"): 0.5, ("median", "ipm"): 0.6,
                ("krum", "none"): 0.4, ("krum", "alie"): 0.7, ("krum", "ipm"): 0.45}
    cells, trials = [], []
    for i, ((rule, attack), value) in enumerate(accuracy.items()):
        cells.append({**base, "aggregator": rule, "attack": attack, "byzantine": 0.2,
                      "cell_id": str(i)})
        trials += [{"cell_id": str(i), "data_seed": seed, "test_accuracy": value + d}
                   for seed, d in ((0, 0.01), (1, -0.01))]
    summary = BYZANTINE.sweep.summarize(trials, cells, ["aggregator", "attack"])
    worst = {(r["aggregator"], r["worst_attack"], round(r["worst_test_accuracy"], 6))
             for r in worst_case(summary)}
    assert worst == {("median", "alie", 0.5), ("krum", "none", 0.4)}
