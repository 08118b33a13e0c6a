"""ε as a vmapped sweep axis: cells of a DP sweep that differ only in target_epsilon and
dp_noise train as one compiled program (σ calibrated on the host per cell, then traced),
and each cell's trials equal those of the cell trained alone, to float rounding."""

from __future__ import annotations

import csv
import json
import math

import pytest

from fedjax_sim import cli
from fedjax_sim.experiments import PRESETS, privacy, study

TINY = [
    "method=fedavg",
    "num_clients=20",
    "rounds=2",
    "eval_every=1",
    "seeds=2",
    "hidden=8",
    "local_steps=2",
]
METRICS = ("test_accuracy", "train_loss", "test_loss", "test_loss_worst", "epsilon")


def test_only_dp_cells_differing_in_epsilon_alone_are_one_program():
    base = {"cell_id": "a", "dp_clip": 0.5, "target_epsilon": 1.0, "dp_noise": 1.0, "lr": 0.1}
    assert privacy.one_program([base, {**base, "cell_id": "b", "target_epsilon": 3.0}])
    assert privacy.one_program([base, {**base, "cell_id": "b", "dp_noise": 0.0}])
    assert not privacy.one_program([base])
    assert not privacy.one_program([base, {**base, "cell_id": "b", "lr": 0.3}])
    assert not privacy.one_program(
        [{**base, "dp_clip": 0.0}, {**base, "dp_clip": 0.0, "dp_noise": 2.0}]
    )
    tuned = {**base, "tune_lr": [0.1, 0.3]}  # σ × the tune grid's points, one program
    assert privacy.one_program([tuned, {**tuned, "cell_id": "b", "dp_noise": 2.0}])



@pytest.mark.slow  # trains the grid and three cells alone (about 40 s on 2 cores; tuned 70 s,
# in the exhaustive tier: CI's set checks the tuned grid's choice in tests/test_dp_tuned.py)
@pytest.mark.parametrize(
    "tuning",
    [[], pytest.param(["tune_lr=0.05,0.5", "tune_dp_clip=0.05,2"], marks=pytest.mark.exhaustive)],
    ids=["untuned", "tuned"],
)
def test_an_epsilon_sweep_is_one_program_equal_to_its_cells_alone(tmp_path, tuning):
    """Tuned: each cell's lr and clip chosen per seed on the validation rows among the
    tune_* grid's points, inside the one program (σ × the grid's points)."""
    out = tmp_path / "sweep"
    settings = [*TINY, *tuning]
    code = cli.main(
        [
            "sweep",
            "dp-hetero-digits",
            "--out",
            str(out),
            "--no-progress",
            "--set",
            *settings,
            "target_epsilon=0,3",
            "dp_noise=0,1.5",
        ]
    )
    assert code == 0
    plan = json.loads((out / "config.json").read_text())["plan"]["trials_per_program"]
    assert list(plan.values()) == [3 * 2]  # one program: σ ∈ {0, 1.5, calibrated(3)} × 2 seeds
    with open(out / "trials.csv") as f:
        grouped = list(csv.DictReader(f))
    assert len(grouped) == 4 * 2
    by_cell = {
        (float(r["target_epsilon"]), float(r["dp_noise"]), int(r["data_seed"])): r for r in grouped
    }

    preset = PRESETS["dp-hetero-digits"]
    e = preset.experiment
    from fedjax_sim.experiments.runner import resolve_settings

    s = resolve_settings(preset, settings, "run")
    alone = study.sweep_of(e).trials  # a cell trained by itself (`study.run_method`)
    for target, noise in ((0.0, 0.0), (0.0, 1.5), (3.0, 0.0)):
        rows = alone({**s, "target_epsilon": target, "dp_noise": noise}, [0, 1])
        for i, row in enumerate(rows):
            mine = by_cell[(target, noise, i)]
            for metric in METRICS:
                want, got = float(row[metric]), float(mine[metric])
                if math.isinf(want):
                    assert math.isinf(got)
                else:
                    assert got == pytest.approx(want, rel=1e-5, abs=1e-6), (target, noise, metric)
    # cells whose σ is the same calibrated one share their point: equal trials
    for i in (0, 1):
        a, b = by_cell[(3.0, 0.0, i)], by_cell[(3.0, 1.5, i)]
        assert [a[m] for m in METRICS] == [b[m] for m in METRICS]
    assert float(by_cell[(3.0, 0.0, 0)]["epsilon"]) == pytest.approx(3.0, rel=0.01)


def test_a_run_without_noise_reports_infinite_epsilon_from_round_zero():
    """ε = ∞ (dp_noise = 0) is not a divergence: the column is inf from round 0 on."""
    s = {
        "dp_clip": 0.5,
        "dp_noise": 0.0,
        "dp_delta": 1e-5,
        "dp_accountant": "pld",
        "dp_sampling": "poisson",
        "participation": 1.0,
    }
    table = privacy.PrivateRule(s, 10, 4).table(2)
    assert [math.isinf(x) for x in table[[0, 2, 4]]] == [True] * 3
    assert all(math.isnan(x) for x in table[[1, 3]])
