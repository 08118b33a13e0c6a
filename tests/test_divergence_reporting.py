"""Divergence reported the same way by every comparison, and presets given to the wrong command.

A comparison in which every seed of every method diverges, for each experiment
family (synthetic IFCA, rotated-digit images, DRFA's molecules-style regression,
Mixed FL), is a diverged comparison like any other: exit 3, every row kept in
results.csv and per_seed.csv with its seeds marked, one line on stderr (how much
diverged, the first round and metric, where the details are), strict JSON. A
sweep-only preset given to `compare` or `run` at its defaults, a comparison
preset given to `sweep`, and a sweep's config.json given to `run` are refused in
one line naming the preset and the command to use, and nothing is written.
"""

from __future__ import annotations

import json
import math
import re

import pytest

from fedjax_sim import cli, experiments
from fedjax_sim.io import read_csv

_SYN = ["lr=1e30", "local_lr=1e30", "seeds=2", "rounds=4", "eval_every=2", "k=2", "m=8",
        "n=10", "d=5", "restarts=2", "n_test=5"]
_IMAGES = ["n=100", "test_per_class=30", "hidden=8", "rounds=2", "seeds=2", "local_steps=2",
           "eval_every=1", "lr=1e30"]
_MOLECULES = ["num_clients=4", "noisy_clients=1", "n=8", "n_test=8", "batch_size=4",
              "local_steps=2", "rounds=4", "eval_every=2", "seeds=2", "lr=1e30", "qffl_lr=1e30"]
_MIXED = ["lr=1e6", "seeds=2", "rounds=4", "eval_every=2", "m=4", "n=8", "n_c=16",
          "local_steps=2"]


def _no_constant(token):
    raise AssertionError(f"non-standard JSON constant {token}")


def _assert_strict_json(out):
    paths = sorted(out.rglob("*.json"))
    assert out / "config.json" in paths
    for path in paths:
        json.loads(path.read_text(), parse_constant=_no_constant)


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--no-progress"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("preset", "settings"), [
    pytest.param("ifca-synthetic-tiny", _SYN, id="synthetic"),
    pytest.param("ifca-rotated-digits", _IMAGES, id="images", marks=pytest.mark.slow),
    pytest.param("drfa-synthetic-noise", _MOLECULES, id="molecules", marks=pytest.mark.slow),
    pytest.param("mixed-synthetic", _MIXED, id="mixed"),
])
def test_an_all_diverged_comparison_is_a_diverged_comparison(tmp_path, capsys, preset,
                                                             settings):
    out = tmp_path / "cmp"
    code, err = _cli(capsys, "compare", preset, "--set", *settings, "--out", str(out))
    assert code == cli.EXIT_DIVERGED, err
    # One line for the whole comparison: counts, the first round and metric, where to look.
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    methods = list(experiments.PRESETS[preset].experiment.methods)
    match = re.fullmatch(
        r"fedjax-sim: comparison finished with diverged seeds: every seed of every method "
        rf"\({len(methods)} methods × 2 seeds\) diverged, the first at round (\d+) \(method "
        r"(\S+) seed (\d+): (.+) is (nan|inf|-inf)\); they are left out of means and "
        rf"differences \({re.escape(str(out))}/per_seed\.csv marks each seed, "
        rf"{re.escape(str(out))}/methods/<method>\.json gives its round and metric\)\n", err)
    assert match, err
    first_round, first_method, first_seed, first_metric, first_value = match.groups()
    # Every method's row is kept, with no seed used.
    rows = read_csv(out / "results.csv")
    assert [r["method"] for r in rows] == methods
    assert all((r["diverged_seeds"], r["seeds_used"]) == ("2", "0") for r in rows), rows
    per_seed = read_csv(out / "per_seed.csv")
    assert [(r["method"], int(r["seed"])) for r in per_seed] == [
        (m, s) for m in methods for s in range(2)]
    assert all(r["diverged"] == "True" for r in per_seed)
    # The line's first divergence is the earliest in methods/<method>.json.
    diverged = {m: json.loads((out / "methods" / f"{m}.json").read_text())["diverged"]
                for m in methods}
    assert all(d is not None for seeds in diverged.values() for d in seeds)
    assert int(first_round) == min(d["round"] for s in diverged.values() for d in s)
    assert diverged[first_method][int(first_seed)] == {
        "round": int(first_round), "metric": first_metric, "value": first_value}
    # Every table of a finished comparison (its plots have no seed left to draw), in strict
    # JSON.
    assert {"results.md", "metrics.csv", "per_seed_metrics.csv"} <= {
        p.name for p in out.iterdir()}
    assert not (out / "checkpoints").exists()
    _assert_strict_json(out)
    summary = json.loads((out / "methods" / f"{methods[0]}.json").read_text())
    assert all(v is None or not math.isfinite(v)
               for values in summary["per_seed"].values() for v in values)


def test_a_sweep_preset_given_to_compare_names_the_sweep(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _cli(capsys, "compare", "ifca-success-small", "--out", str(out))
    assert code == cli.EXIT_BAD_INPUT
    assert err == ("fedjax-sim: error: preset ifca-success-small is a sweep preset (commands: "
                   "run, sweep); it has no compare: use `fedjax-sim sweep ifca-success-small` "
                   "or `fedjax-sim run ifca-success-small` for one cell (--set each grid axis "
                   "to one value).\n")
    assert not out.exists()


def test_a_sweep_preset_run_at_its_defaults_names_the_sweep(tmp_path, capsys):
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", "ifca-success-small", "--out", str(out))
    assert code == cli.EXIT_BAD_INPUT
    axes = [k for k, v in experiments.PRESETS["ifca-success-small"].defaults.items()
            if isinstance(v, list)
            and not experiments.PRESETS["ifca-success-small"].experiment.declared[k].listable]
    assert axes == ["R"]
    assert err == ("fedjax-sim: error: preset ifca-success-small is a sweep preset: its "
                   "defaults give R several values (the axes of its grid); use `fedjax-sim "
                   "sweep ifca-success-small`, or give each one value to run one cell (e.g. "
                   "--set R=0.1).\n")
    assert not out.exists()


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    assert cli.main(["sweep", "ifca-success-small", "--set", "k=2", "m=8", "n=5", "d=5",
                     "rounds=2", "restarts=2", "seeds=1", "R=1.0,2.0", "sigma=0.1",
                     "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_sweeps_config_given_to_another_command_names_the_sweep(tmp_path, capsys, sweep_dir,
                                                                   command):
    out = tmp_path / "out"
    config = sweep_dir / "config.json"
    code, err = _cli(capsys, command, "--config", str(config), "--out", str(out))
    assert code == cli.EXIT_BAD_INPUT
    assert err == (f"fedjax-sim: error: --config {config} records a sweep of preset "
                   f"ifca-success-small (settings with lists), not a {command}; rerun it with "
                   f"`fedjax-sim sweep --config {config}`.\n")
    assert not out.exists()
    # --resume of the sweep's directory with another command: the same, for --resume.
    before = sorted(p.name for p in sweep_dir.iterdir())
    code, err = _cli(capsys, command, "--resume", "--out", str(sweep_dir))
    assert code == cli.EXIT_BAD_INPUT
    assert err == (f"fedjax-sim: error: --out {sweep_dir} holds a sweep of preset "
                   f"ifca-success-small, not a {command}; continue it with `fedjax-sim sweep "
                   f"--resume --out {sweep_dir}`.\n")
    assert sorted(p.name for p in sweep_dir.iterdir()) == before


def test_recorded_lists_outside_a_sweep_name_the_sweep(tmp_path, capsys):
    """A config.json that does not say it is a sweep's (an older one) but holds its lists."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"preset": "ifca-success-small",
                                  "settings": {"R": [1.0, 2.0], "sigma": [0.1, 0.2]}}))
    out = tmp_path / "out"
    code, err = _cli(capsys, "run", "--config", str(config), "--out", str(out))
    assert code == cli.EXIT_BAD_INPUT
    assert err == ("fedjax-sim: error: the recorded settings give sigma and R several values, "
                   "as a sweep's config.json does; a run takes one value each: use `fedjax-sim "
                   "sweep --config DIR/config.json` (preset ifca-success-small), or --set "
                   "sigma=0.1 R=1.0.\n")
    assert not out.exists()
