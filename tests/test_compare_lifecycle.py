"""The comparison lifecycle: divergence bookkeeping, kill-and-resume, --config re-runs.

A toy experiment built here (a scalar per seed multiplied every round by a
rate that depends on the method and the seed) makes divergence exact: method
`one_bad` overflows in seed 1 only, `all_bad` in every seed, and the means
over the surviving seeds are computed by hand from the same recurrence.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import cli, experiments
from fedjax_sim.algorithms import Algorithm, sgd
from fedjax_sim.data import FederatedData
from fedjax_sim.experiments import study
from fedjax_sim.experiments.base import Experiment, Preset
from fedjax_sim.experiments.methods import Method
from fedjax_sim.experiments.settings import checkpoint_setting, count, method_setting, seed_setting
from fedjax_sim.io import read_csv

RATES = {"base": 0.5, "better": 0.25, "one_bad": 0.75, "all_bad": 1e30}
BAD_SEED = 1  # one_bad's rate there is 1e10: inf at round 4


def _toy_algorithm(name):
    rate = RATES[name]

    # The data of a seed is one client holding one row: the seed's index.
    def init(key, data):
        del key
        return {"x": 1.0 + data.x[0, 0, 0]}

    def round_(state, data, key):
        del key
        seed = data.x[0, 0, 0]
        r = rate if name != "one_bad" else jnp.where(seed == BAD_SEED, 1e10, rate)
        return {"x": state["x"] * jnp.float32(r)}, {}

    def evaluate(state, data):
        return {"client_loss": state["x"][None]}

    return Algorithm(init, round_, evaluate)


def _toy_metrics(trained):
    def evaluate(state):
        return {"loss": np.asarray(state["x"], np.float64)}

    return evaluate


TOY = Experiment(
    name="toy",
    description="x ← rate · x per round",
    settings=(count("seeds", 3, "seeds"), seed_setting(), count("rounds", 6, "rounds"),
              count("eval_every", 2, "eval"), checkpoint_setting(0),
              method_setting(tuple(RATES), "base")),
    # One client per seed holding one row: the seed's index.
    problem=lambda s: {"train": FederatedData(
        x=jnp.arange(s["seeds"], dtype=jnp.float32)[:, None, None, None],
        y=jnp.zeros((s["seeds"], 1, 1)), num_examples=jnp.ones((s["seeds"], 1), jnp.int32),
        cluster=-jnp.ones((s["seeds"], 1), jnp.int32)), "model": None},
    metrics=_toy_metrics,
    methods=tuple(RATES),
    baseline="base",
    panels=(("loss", "loss"),),
    # Methods of its own: each row's factory is the toy algorithm at the method's rate.
    method_table={name: Method(lambda model, training, name=name: _toy_algorithm(name),
                               f"x <- {rate} x") for name, rate in RATES.items()},
    client_training=lambda s, learning_rate: sgd(1.0),
)


@pytest.fixture
def toy(monkeypatch):
    preset = Preset("toy", TOY, "toy")
    monkeypatch.setitem(experiments.PRESETS, "toy", preset)
    return preset


def _expected_final(name, seed, rounds=6):
    return (1.0 + seed) * RATES[name] ** rounds


def test_diverged_seeds_are_named_counted_and_left_out(tmp_path, capsys, toy):
    out = tmp_path / "cmp"
    assert cli.main(["compare", "toy", "--out", str(out), "--no-progress"]) == 3
    err = capsys.readouterr().err.splitlines()
    # One line for the whole comparison (counts, the first round and metric, where each
    # seed's details are), none per seed.
    assert err == [
        "fedjax-sim: comparison finished with diverged seeds: 4 of 12 seeds in 2 of 4 methods "
        "(one_bad 1/3, all_bad 3/3) diverged, the first at round 2 (method all_bad seed 0: "
        f"loss is inf); they are left out of means and differences ({out}/per_seed.csv marks "
        f"each seed, {out}/methods/<method>.json gives its round and metric)"]
    # Each seed's round and metric, in its method's file.
    assert json.loads((out / "methods" / "one_bad.json").read_text())["diverged"] == [
        None, {"round": 4, "metric": "loss", "value": "inf"}, None]
    assert json.loads((out / "methods" / "all_bad.json").read_text())["diverged"] == [
        {"round": 2, "metric": "loss", "value": "inf"}] * 3
    rows = {r["method"]: r for r in read_csv(out / "results.csv")}
    assert {m: int(r["diverged_seeds"]) for m, r in rows.items()} == {
        "base": 0, "better": 0, "one_bad": 1, "all_bad": 3}
    assert {m: int(r["seeds_used"]) for m, r in rows.items()} == {
        "base": 3, "better": 3, "one_bad": 2, "all_bad": 0}
    # Means over the surviving seeds, by hand from the recurrence (float32 products).
    kept = [0, 2]
    want = np.mean([np.float32(_expected_final("one_bad", i)) for i in kept])
    assert float(rows["one_bad"]["loss_mean"]) == pytest.approx(want, rel=1e-6)
    diffs = [np.float32(_expected_final("one_bad", i)) - np.float32(_expected_final("base", i))
             for i in kept]
    assert float(rows["one_bad"]["loss_diff"]) == pytest.approx(np.mean(diffs), rel=1e-5)
    assert float(rows["better"]["loss_mean"]) == pytest.approx(
        np.mean([_expected_final("better", i) for i in range(3)]), rel=1e-6)
    # A method with no seed left: no number and no "significant".
    assert rows["all_bad"]["loss_significant"] == "False"
    assert math.isnan(float(rows["all_bad"]["loss_mean"]))
    table = (out / "results.md").read_text()
    all_bad_line = next(line for line in table.splitlines() if line.startswith("| all_bad"))
    assert "diverged" in all_bad_line and "yes" not in all_bad_line
    assert "3 of 3 seeds diverged" in all_bad_line
    per_seed = read_csv(out / "per_seed.csv")
    marks = {(r["method"], int(r["seed"])): r["diverged"] for r in per_seed}
    assert marks[("one_bad", 1)] == "True" and marks[("one_bad", 0)] == "False"
    assert all(marks[("all_bad", i)] == "True" for i in range(3))
    # Every output was written before the exit code.
    assert {"results.md", "per_seed.csv", "per_seed_metrics.csv", "metrics.csv",
            "comparison.png"} <= {p.name for p in out.iterdir()}
    curves = read_csv(out / "per_seed_metrics.csv")
    assert len([r for r in curves if r["method"] == "base"]) == 3 * 4  # rounds 0, 2, 4, 6


def test_run_of_a_comparison_preset_trains_one_method(tmp_path, capsys, toy):
    out = tmp_path / "run"
    assert cli.main(["run", "toy", "--set", "method=better", "--out", str(out),
                     "--no-progress"]) == 0
    rows = read_csv(out / "metrics.csv")
    assert [(int(r["round"]), int(r["seed"])) for r in rows][:4] == [(0, 0), (0, 1), (0, 2),
                                                                      (2, 0)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "better" and summary["diverged_seeds"] == 0
    assert summary["final_per_seed"]["loss"] == pytest.approx(
        [_expected_final("better", i) for i in range(3)], rel=1e-6)
    # Every seed diverged: exit 3, as a run that diverged, in one line.
    capsys.readouterr()
    assert cli.main(["run", "toy", "--set", "method=all_bad", "--out", str(tmp_path / "bad"),
                     "--no-progress"]) == 3
    assert capsys.readouterr().err == "fedjax-sim: run diverged at round 2: loss is inf\n"
    # Some seeds diverged: the run is done (exit 0), and one line says so, none per seed.
    out = tmp_path / "some"
    assert cli.main(["run", "toy", "--set", "method=one_bad", "--out", str(out),
                     "--no-progress"]) == 0
    assert capsys.readouterr().err == (
        "fedjax-sim: method one_bad diverged in 1 of 3 seeds, the first at round 4 (seed 1: "
        "loss is inf); they are left out of summary.json's final_mean (its \"diverged\" "
        "gives each seed's round and metric)\n")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] == [None, {"round": 4, "metric": "loss", "value": "inf"}, None]


def test_the_python_api_reports_divergence_in_one_line(capsys, toy):
    comparison = study.compare(toy.experiment, toy.defaults)
    assert capsys.readouterr().err == (
        "fedjax-sim: comparison finished with diverged seeds: 4 of 12 seeds in 2 of 4 methods "
        "(one_bad 1/3, all_bad 3/3) diverged, the first at round 2 (method all_bad seed 0: "
        "loss is inf); they are left out of means and differences (results[method].diverged "
        "gives each seed's round and metric)\n")
    assert comparison.results["one_bad"].diverged[1] == {"round": 4, "metric": "loss",
                                                         "value": "inf"}


def test_a_setting_the_command_ignores_is_refused(tmp_path, capsys, toy):
    out = tmp_path / "cmp"
    assert cli.main(["compare", "toy", "--set", "method=better", "--out", str(out)]) == 2
    assert "setting method is not read by compare" in capsys.readouterr().err
    assert not out.exists()
    assert cli.main(["run", "ifca-synthetic-tiny", "--set", "seeds=3", "--out", str(out)]) == 2
    assert "setting seeds is not read by run" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------- kill and resume

_NO_TIMING = ("timing",)


def _steps(directory):
    return [p for p in directory.glob("*") if p.name.isdigit()] if directory.is_dir() else []


def _kill_when(proc, ready, what, timeout=300):
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if proc.poll() is not None:
                pytest.fail(f"the comparison ended (code {proc.returncode}) before {what}:\n"
                            f"{proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail(f"not {what} within {timeout} s")
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stdout.close()


def _compare_cmd(*args):
    return subprocess.Popen([sys.executable, "-m", "fedjax_sim.cli", "compare", *args,
                             "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _methods(out):
    return {p.name: {k: v for k, v in json.loads(p.read_text()).items() if k not in _NO_TIMING}
            for p in sorted((out / "methods").iterdir())}


# Small sizes and 20 rounds: after the second method's first checkpoint the process still
# has a checkpoint to write and four more methods to compile and train, seconds in which
# the kill lands (the test fails, never passes, if it misses). The kill during a checkpoint
# write (checkpoint.py, the same for every experiment) is made in the synthetic comparison;
# the DRFA one (minibatches, λ and sampled clients in its state) is killed and resumed once.
@pytest.mark.parametrize(("preset", "sets", "methods", "write_kill"), [
    ("ifca-synthetic-tiny", ["seeds=2", "rounds=20", "eval_every=10", "checkpoint_every=10",
                             "m=4", "n=5", "d=3", "n_test=5", "restarts=2",
                             "pretrain_steps=5"], ("ifca", "fedavg"), True),
    ("drfa-synthetic-noise", ["seeds=2", "rounds=20", "eval_every=10", "checkpoint_every=10",
                              "num_clients=4", "noisy_clients=1", "n=8", "n_test=8",
                              "batch_size=4", "local_steps=2"], ("fedavg", "drfa"), False),
    # Tuned (experiments.tuned): the state and history carry a grid axis before the seeds.
    ("drfa-synthetic-noise", ["seeds=2", "rounds=20", "eval_every=10", "checkpoint_every=10",
                              "num_clients=4", "noisy_clients=1", "n=8", "n_test=8",
                              "batch_size=4", "local_steps=2", "tune_lr=0.005,0.02",
                              "methods=fedavg,drfa,drflm"], ("fedavg", "drfa"), False),
])
def test_killed_comparison_resumes_to_identical_outputs(tmp_path, preset, sets, methods,
                                                        write_kill):
    """SIGKILL during the second method, resume (and for the synthetic comparison SIGKILL
    it during a checkpoint write, resume): results.csv, per_seed.csv, per_seed_metrics.csv
    and methods/*.json equal an uninterrupted comparison's (timing aside)."""
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    first, second = methods[0], methods[1]
    proc = _compare_cmd(preset, "--set", *sets, "--out", str(killed))
    _kill_when(proc, lambda: bool(_steps(killed / "checkpoints" / second)),
               f"a checkpoint of {second}")
    assert (killed / "methods" / f"{first}.json").exists()
    assert not (killed / "results.csv").exists()
    if write_kill:
        # Resume from the directory alone (its config.json), and kill it as a new checkpoint
        # step appears: mid-write. A name the killed process did not leave (it may have left
        # a save's temporary directory) is the resumed process's write.
        def entries():
            directory = killed / "checkpoints"
            return {str(p.relative_to(directory)) for p in directory.glob("*/*")} if \
                directory.is_dir() else set()

        seen = entries()
        proc = _compare_cmd("--resume", "--out", str(killed))

        def new_step():
            return bool(entries() - seen)

        _kill_when(proc, new_step, "a new checkpoint write")
        assert not (killed / "results.csv").exists()
    assert cli.main(["compare", "--resume", "--out", str(killed), "--no-progress"]) == 0
    assert cli.main(["compare", preset, "--set", *sets, "--out", str(whole),
                     "--no-progress"]) == 0
    for name in ("results.csv", "per_seed.csv", "per_seed_metrics.csv", "metrics.csv"):
        assert (killed / name).read_text() == (whole / name).read_text(), name
    assert _methods(killed) == _methods(whole)
    assert not (killed / "checkpoints").exists()
    config = json.loads((killed / "config.json").read_text())
    assert len(config["resumed"]) == (2 if write_kill else 1)


def test_resume_refuses_a_changed_result_setting_and_writes_nothing(tmp_path, capsys, toy):
    out = tmp_path / "cmp"
    assert cli.main(["compare", "toy", "--set", "checkpoint_every=2", "--out", str(out),
                     "--no-progress"]) == 3
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert cli.main(["compare", "--resume", "--out", str(out), "--set", "rounds=8"]) == 2
    assert "rounds" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # A setting that does not change results may differ.
    assert cli.main(["compare", "--resume", "--out", str(out), "--set", "checkpoint_every=3",
                     "--no-progress"]) == 3


@pytest.mark.parametrize("command", ["compare", "run"])
def test_a_resume_removes_the_temporary_files_a_killed_write_left(tmp_path, capsys, toy,
                                                                   command):
    """A SIGKILL between an atomic write's temporary file and its rename leaves
    ".<name>.<12 hex>.tmp" (CI saw one in methods/): a resume deletes such files, once it
    writes (a refused resume leaves them), and no other file."""
    out = tmp_path / "out"
    sets = ["checkpoint_every=2"] + (["method=better"] if command == "run" else [])
    assert cli.main([command, "toy", "--set", *sets, "--out", str(out), "--no-progress"]) in (0, 3)
    (out / "methods").mkdir(exist_ok=True)
    stale = [out / "methods" / ".base.json.0123456789ab.tmp", out / ".config.json.abcdef012345.tmp"]
    kept = [out / "notes.tmp", out / "methods" / ".base.json.xyz.tmp", out / "a.0123456789ab.tmp"]
    for path in stale + kept:
        path.write_text("{")
    # A changed result setting: refused, nothing touched.
    assert cli.main([command, "--resume", "--out", str(out), "--set", "rounds=8"]) == 2
    assert all(p.exists() for p in stale + kept)
    capsys.readouterr()
    assert cli.main([command, "--resume", "--out", str(out), "--no-progress"]) in (0, 3)
    assert [p.name for p in stale if p.exists()] == []
    assert all(p.read_text() == "{" for p in kept)


def test_config_reruns_a_comparison(tmp_path, toy):
    first, again = tmp_path / "first", tmp_path / "again"
    assert cli.main(["compare", "toy", "--set", "rounds=4", "--out", str(first),
                     "--no-progress"]) == 3
    assert cli.main(["compare", "--config", str(first / "config.json"), "--out", str(again),
                     "--no-progress"]) == 3
    for name in ("results.csv", "per_seed.csv", "per_seed_metrics.csv"):
        assert (first / name).read_text() == (again / name).read_text()


# ----------------------------------------------------------------------------- every family

TINY = {
    "ifca-rotated-digits": ["n=100", "test_per_class=30", "hidden=8", "rounds=2", "seeds=2",
                            "local_steps=2", "eval_every=1"],
    "drfa-synthetic-noise": ["num_clients=4", "noisy_clients=1", "n=8", "n_test=8",
                             "batch_size=4", "local_steps=2", "rounds=4", "eval_every=2",
                             "seeds=2"],
}


@pytest.mark.parametrize("preset", sorted(TINY))
def test_a_comparison_preset_runs_one_method_and_reruns_from_its_config(tmp_path, preset):
    first, again = tmp_path / "first", tmp_path / "again"
    assert cli.main(["run", preset, "--set", *TINY[preset], "checkpoint_every=1", "--out",
                     str(first), "--no-progress"]) == 0
    summary = json.loads((first / "summary.json").read_text())
    assert summary["method"] == {"ifca-rotated-digits": "ifca",
                                 "drfa-synthetic-noise": "drflm"}[preset]  # the method default
    assert summary["diverged_seeds"] == 0
    assert all(math.isfinite(v) for v in summary["final_mean"].values() if v is not None)
    rows = read_csv(first / "metrics.csv")
    assert {int(r["seed"]) for r in rows} == {0, 1}
    assert cli.main(["run", "--config", str(first / "config.json"), "--out", str(again),
                     "--no-progress"]) == 0
    assert (first / "metrics.csv").read_text() == (again / "metrics.csv").read_text()


# ----------------------------------------------------------------------------- defaults train


def test_the_synthetic_baselines_stay_finite_at_their_defaults(tmp_path):
    """run local-synthetic / oneshot-synthetic and compare ifca-synthetic at the presets'
    defaults (d=1000, m=n=100, ..., and their step sizes), shortened to 50 rounds: at the
    shared lr 0.1 the local models overflowed at round 46 (44 in the comparison) and
    one-shot's pretraining at round 0. Two restarts and one seed (the runs' one data draw):
    restarts start elsewhere on the same data, which does not move the step size at which
    gradient descent on it diverges (with local_lr or oneshot_lr at 0.1 each part fails
    at those rounds)."""
    fewer = ["rounds=50", "restarts=2", "checkpoint_every=0"]
    for preset in ("local-synthetic", "oneshot-synthetic"):
        out = tmp_path / preset
        assert cli.main(["run", preset, "--set", *fewer, "--out", str(out),
                         "--no-progress"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["diverged"] is False and not any(summary["restarts_diverged"])
    out = tmp_path / "compare"
    assert cli.main(["compare", "ifca-synthetic", "--set", *fewer, "seeds=1", "--out", str(out),
                     "--no-progress"]) == 0
    rows = read_csv(out / "results.csv")
    assert [r["method"] for r in rows] == ["ifca", "fedavg", "local", "oneshot", "hypcluster",
                                           "cfl"]
    assert all(r["diverged_seeds"] == "0" for r in rows)
    assert all(math.isfinite(float(r["test_loss_mean"])) for r in rows)
