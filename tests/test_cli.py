"""The `fedjax-sim` command end to end, and its refusal of bad input."""

from __future__ import annotations

import csv
import json
import math

import pytest

from fedjax_sim import cli, experiments


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_list_names_presets_and_algorithms(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    for name in experiments.PRESETS:
        assert name in out
    for name in ("ifca", "fedavg", "local", "oneshot"):
        assert f"  {name} " in out


def test_run_writes_a_complete_run_directory(tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        ["run", "ifca-synthetic-tiny", "--set", "rounds=20", "eval_every=5", "--out", str(out),
         "--no-progress"]
    )
    assert code == 0
    assert {p.name for p in out.iterdir()} == {
        "config.json", "metrics.csv", "summary.json", "metrics.png"
    }
    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == "ifca-synthetic-tiny"
    assert config["settings"]["rounds"] == 20
    assert config["settings"]["k"] == 2 and config["seed"] == 0
    assert config["fedjax_sim_version"]
    rows = _rows(out / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [0, 5, 10, 15, 20]
    for column in ("train_loss", "test_loss", "cluster_accuracy", "min_dist"):
        assert all(math.isfinite(float(r[column])) for r in rows), column
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["round"] == 20
    assert len(summary["restarts_final_min_dist"]) == config["settings"]["restarts"]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"])
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_is_deterministic(tmp_path):
    args = ["run", "ifca-synthetic-tiny", "--set", "rounds=10", "--no-progress", "--out"]
    assert cli.main([*args, str(tmp_path / "a")]) == 0
    assert cli.main([*args, str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "metrics.csv").read_text() == (
        tmp_path / "b" / "metrics.csv"
    ).read_text()


@pytest.mark.parametrize(
    ("command", "overrides", "message"),
    [
        ("run", ["k=0"], "k must be an integer >= 1"),
        ("run", ["k=3"], "m must be divisible by k"),
        ("run", ["lr=-0.1"], "lr must be a finite number >= 0"),
        ("run", ["lr=nan"], "lr must be a finite number >= 0"),
        ("run", ["banana=1"], "unknown setting 'banana'"),
        ("run", ["m=10.5"], "setting m: cannot read"),
        ("run", ["R=0.1,0.2"], "setting R takes one value here"),
        ("run", ["rounds=0"], "rounds must be an integer >= 1"),
        ("run", ["memory_budget_gb=0.00000001"], "memory budget"),
        ("sweep", ["k=0"], "k must be an integer >= 1"),
        ("sweep", ["m=30"], "m must be divisible by k"),
        ("sweep", ["lr=0.1,-1"], "lr must be a finite number >= 0"),
        ("sweep", ["colour=red"], "unknown setting 'colour'"),
    ],
)
def test_bad_settings_are_refused_and_nothing_is_written(
    tmp_path, capsys, command, overrides, message
):
    preset = "ifca-synthetic-tiny" if command == "run" else "ifca-success-small"
    out = tmp_path / "out"
    code = cli.main([command, preset, "--set", *overrides, "--out", str(out), "--no-progress"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_preset_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["run", "no-such-preset", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown run preset 'no-such-preset'" in err and "ifca-synthetic" in err
    assert not out.exists()
    # A sweep preset is not a run preset.
    assert cli.main(["run", "ifca-success-small", "--out", str(out)]) == 2
    assert not out.exists()


def test_existing_run_directory_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "ifca-synthetic-tiny", "--set", "rounds=5", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    before = (out / "metrics.csv").read_text()
    assert cli.main(args) == 2
    assert "already holds a config.json" in capsys.readouterr().err
    assert (out / "metrics.csv").read_text() == before
