"""Checkpoints, resume and divergence: a killed run resumes bit-for-bit; NaN/inf stops a run.

The kill test runs the CLI in a subprocess, SIGKILLs it once a checkpoint is
on disk, resumes it and compares metrics.csv and summary.json, as strings,
with an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import cli, experiments, simulate
from fedjax_sim.algorithms import Algorithm, ifca, sgd, with_restarts
from fedjax_sim.checkpoint import RunCheckpoints
from fedjax_sim.data import linear_mixture
from fedjax_sim.execution import Checkpoints, Execution, planned
from fedjax_sim.experiments import ifca_synthetic, runner
from fedjax_sim.io import write_json
from fedjax_sim.models import linear_regression

# Timing, and rounds_run (the rounds this process ran: fewer after a resume, by design).
TIMING = ("seconds", "rounds_per_second", "compile_seconds", "evaluate_seconds", "run_seconds",
          "rounds_run")


def _summary(out):
    summary = json.loads((out / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in TIMING}


def _assert_same_leaves(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _assert_same_history(a, b):
    assert [r["round"] for r in a] == [r["round"] for r in b]
    for row_a, row_b in zip(a, b, strict=True):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            np.testing.assert_array_equal(row_a[key], row_b[key], err_msg=key)
            assert np.asarray(row_a[key]).dtype == np.asarray(row_b[key]).dtype, key


# ----------------------------------------------------------------------------- simulate.run


@pytest.fixture(scope="module")
def small_ifca():
    problem = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0)
    algorithm = with_restarts(ifca(linear_regression(3), sgd(0.2), num_clusters=2), 3)
    evaluate = jax.jit(algorithm.evaluate)

    def metrics(state):
        loss = np.asarray(evaluate(state, problem.train)["client_loss"])
        return {"loss": loss.mean(axis=1), "loss_worst": loss.max(axis=1).astype(np.float64)}

    return algorithm, problem.train, metrics


class _Killed(Exception):
    pass


def test_resume_keeps_the_history_columns_of_the_checkpointed_run(tmp_path, small_ifca):
    """A run resumed with a round that logs a new scalar metric (e.g. a checkpoint of an
    older version) keeps the checkpointed history's columns, so its metrics.csv takes
    the new rows."""
    algorithm, data, metrics = small_ifca
    saved = Execution(progress=False, copies=1, checkpoints=Checkpoints(tmp_path / "run", 10))
    kw = dict(eval_every=5, evaluate=metrics)
    simulate.run(algorithm, data, jax.random.key(1), rounds=10, execution=saved, **kw)

    def round_with_extra(state, data, key):
        state, out = algorithm.round(state, data, key)
        return state, {**out, "extra": jnp.ones(np.shape(out["downlink_floats"]))}

    newer = algorithm._replace(round=round_with_extra)
    _, history = simulate.run(newer, data, jax.random.key(1), rounds=20,
                              execution=saved.replace(resume=True), **kw)
    assert [r["round"] for r in history] == [0, 5, 10, 15, 20]
    assert all(set(r) == set(history[0]) for r in history) and "extra" not in history[0]
    _, fresh = simulate.run(newer, data, jax.random.key(1), rounds=5, eval_every=5,
                            evaluate=metrics, execution=Execution(progress=False, copies=1))
    assert np.isnan(fresh[0]["extra"]).all() and (fresh[1]["extra"] == 1).all()


def test_simulate_resume_is_bitwise_identical(tmp_path, small_ifca):
    algorithm, data, metrics = small_ifca
    kw = dict(rounds=40, eval_every=5, evaluate=metrics)

    def saved(where, resume=False):
        return Execution(progress=False, copies=1, resume=resume,
                         checkpoints=Checkpoints(tmp_path / where, every=10))

    state, history = simulate.run(algorithm, data, jax.random.key(1), execution=saved("whole"),
                                  **kw)

    def killed_at_25(state):
        row = metrics(state)
        if int(np.asarray(state.round)[0]) == 25:
            raise _Killed
        return row

    with pytest.raises(_Killed):
        simulate.run(algorithm, data, jax.random.key(1), execution=saved("killed"),
                     **{**kw, "evaluate": killed_at_25})
    with RunCheckpoints(tmp_path / "killed") as checkpoints:
        assert checkpoints.steps() == [10, 20]  # max_to_keep=2 of 10, 20

    # Without resume=True a directory holding checkpoints is refused.
    with pytest.raises(ValueError, match="already holds checkpoints"):
        simulate.run(algorithm, data, jax.random.key(1), execution=saved("killed"), **kw)
    with pytest.raises(ValueError, match="another key"):
        simulate.run(algorithm, data, jax.random.key(2), execution=saved("killed", True), **kw)
    resumed_state, resumed = simulate.run(
        algorithm, data, jax.random.key(1), execution=saved("killed", True), **kw
    )
    _assert_same_leaves(state, resumed_state)
    _assert_same_history(history, resumed)
    assert [r["round"] for r in resumed] == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    with RunCheckpoints(tmp_path / "killed") as checkpoints:
        assert checkpoints.steps() == [30, 40]

    # The checkpoint holds the state, the key, the round and the history up to it.
    with RunCheckpoints(tmp_path / "whole") as checkpoints:
        restored = checkpoints.restore(
            jax.eval_shape(algorithm.init, jax.random.key(0), data), jax.random.key(1), 40
        )
    assert restored.round == 40
    _assert_same_leaves(restored.state, state)
    _assert_same_history(restored.history, history)
    assert jax.random.key_data(restored.key).tolist() == jax.random.key_data(
        jax.random.key(1)).tolist()


def test_checkpoint_every_does_not_move_evaluations(tmp_path, small_ifca):
    algorithm, data, metrics = small_ifca
    kw = dict(rounds=14, eval_every=4, evaluate=metrics)
    plain_run = Execution(progress=False, copies=1)
    _, plain = simulate.run(algorithm, data, jax.random.key(1), execution=plain_run, **kw)
    _, checkpointed = simulate.run(algorithm, data, jax.random.key(1), **kw,
                                   execution=plain_run.replace(
                                       checkpoints=Checkpoints(tmp_path / "c", every=6)))
    assert [r["round"] for r in plain] == [r["round"] for r in checkpointed] == [
        0, 4, 8, 12, 14]
    for a, b in zip(plain, checkpointed, strict=True):
        for key in a:
            np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)
    with RunCheckpoints(tmp_path / "c") as checkpoints:
        assert checkpoints.steps() == [6, 12]


class _Blowup(NamedTuple):
    x: jax.Array  # [] or [copies]


def _blowup(factor) -> Algorithm:
    """x ← factor·x from x = 1: float32 overflows to inf once factorᵗ > 3.4e38."""
    factor = jnp.asarray(factor, jnp.float32)

    def init(key, data):
        return _Blowup(jnp.ones_like(factor))

    def round_(state, data, key):
        x = state.x * factor
        return _Blowup(x), {"train_loss": x, "steps": jnp.ones_like(x, jnp.int32)}

    def evaluate(state, data):
        m = data.num_clients
        return {"client_loss": jnp.full((m,), jnp.max(state.x)),
                "assignment": jnp.zeros((m,), jnp.int32)}

    return Algorithm(init, round_, evaluate)


def test_divergence_names_the_round_and_metric(tmp_path, ragged):
    # 1e10^t overflows at t = 4; chunks of 3 rounds: the bad chunk is rounds 4-6.
    with pytest.raises(simulate.Diverged) as info:
        simulate.run(_blowup(1e10), ragged, jax.random.key(0), rounds=9, eval_every=3,
                     execution=Execution(progress=False, checkpoints=Checkpoints(tmp_path / "c")))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert (err.round, err.metric, err.value) == (4, "train_loss", "inf")
    assert [r["round"] for r in err.history] == [0, 3]  # up to the last good evaluation
    assert err.checkpoint_round == 3
    assert str(err) == (f"run diverged at round 4: train_loss is inf; last good checkpoint: "
                        f"round 3 in {(tmp_path / 'c').absolute()}")
    # The bad state was not saved; the last good one restores finite.
    with RunCheckpoints(tmp_path / "c") as checkpoints:
        assert checkpoints.steps() == [3]
        restored = checkpoints.restore(
            jax.eval_shape(_blowup(1e10).init, jax.random.key(0), ragged), jax.random.key(0))
    assert restored.round == 3 and 1e29 < float(restored.state.x) < 1e31

    # Before any checkpoint, and without checkpoints at all.
    with pytest.raises(simulate.Diverged, match="none written yet") as info:
        simulate.run(_blowup(1e20), ragged, jax.random.key(0), rounds=9, eval_every=3,
                     execution=Execution(progress=False, checkpoints=Checkpoints(tmp_path / "d")))
    assert (info.value.round, info.value.checkpoint_round) == (2, None)
    with pytest.raises(simulate.Diverged, match=r"^run diverged at round 2: train_loss is inf$"):
        simulate.run(_blowup(1e20), ragged, jax.random.key(0), rounds=9,
                     execution=Execution(progress=False))


def test_a_run_with_copies_diverges_only_when_every_copy_has(ragged):
    def per_copy(state):
        return {"x": np.asarray(state.x)}

    kw = dict(rounds=10, eval_every=5, evaluate=per_copy,
              execution=Execution(progress=False, copies=1))
    # Copies overflow at rounds 2, 4 and 8: the run diverges at 8, the last one.
    with pytest.raises(simulate.Diverged) as info:
        simulate.run(_blowup([1e20, 1e10, 1e5]), ragged, jax.random.key(0), **kw)
    assert (info.value.round, info.value.metric) == (8, "train_loss")
    assert [r["round"] for r in info.value.history] == [0, 5]
    # One healthy copy: the run goes on, its diverged copies are failed copies.
    _, history = simulate.run(_blowup([1e20, 1.0]), ragged, jax.random.key(0), **kw)
    assert history[-1]["round"] == 10
    assert history[-1]["x"].tolist() == [math.inf, 1.0]
    # The same failures without the copies axis stop the run at the first copy.
    with pytest.raises(simulate.Diverged, match="round 2: train_loss is inf"):
        simulate.run(_blowup([1e20, 1.0]), ragged, jax.random.key(0),
                     **{**kw, "execution": Execution(progress=False)})


# ----------------------------------------------------------------------------- the CLI


def _checkpoint_steps(directory):
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_killed_run_resumes_to_identical_results(tmp_path):
    """SIGKILL a `fedjax-sim run` mid-way, `--resume` it: the same metrics.csv and summary."""
    # Each chunk of 30 rounds is evaluated and checkpointed (~0.2 s each): ~1 s from the
    # first checkpoint to the end, time enough to land the kill (the test fails, never
    # passes, if it misses).
    settings = ["--set", "rounds=180", "eval_every=30", "checkpoint_every=30"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_sim.cli", "run", "ifca-synthetic-tiny", *settings,
         "--out", str(killed), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not _checkpoint_steps(killed / "checkpoints"):
            if proc.poll() is not None:
                pytest.fail(f"the run ended (code {proc.returncode}) before its first "
                            f"checkpoint was seen:\n{proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint within 240 s")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stdout.close()
    steps = _checkpoint_steps(killed / "checkpoints")
    assert not (killed / "summary.json").exists(), "the kill landed after the run had finished"
    assert steps and max(steps) < 180, steps
    # metrics.csv is appended (fsynced) before each checkpoint: the killed run kept its rows.
    kept = [int(line.split(",")[0]) for line in
            (killed / "metrics.csv").read_text().splitlines()[1:]]
    assert kept and max(kept) >= max(steps)

    assert cli.main(["run", "ifca-synthetic-tiny", *settings, "--out", str(killed),
                     "--no-progress", "--resume"]) == 0
    assert cli.main(["run", "ifca-synthetic-tiny", *settings, "--out", str(whole),
                     "--no-progress"]) == 0
    text = (whole / "metrics.csv").read_text()
    assert text.count("\n") == 1 + 7 * 10  # header, rounds 0, 30, ..., 180 × 10 restarts
    assert (killed / "metrics.csv").read_text() == text
    assert _summary(killed) == _summary(whole)
    config = json.loads((killed / "config.json").read_text())
    assert len(config["resumed"]) == 1


def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "ifca-synthetic-tiny", "--out", str(out), "--no-progress", "--resume"]
    assert cli.main([*args, "--set", "rounds=2"]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    assert not out.exists()
    # The config.json a run with rounds=2 writes before it starts.
    preset = experiments.get_preset("ifca-synthetic-tiny")
    settings = experiments.resolve_settings(preset, ["rounds=2"])
    write_json(out / "config.json", runner._config(preset, "run", settings))
    before = (out / "config.json").read_text()
    with pytest.raises(ValueError, match=r"settings differ from its config.json: lr \(0.1 there, "
                                         r"0.2 now\), rounds \(2 there, 3 now\)"):
        experiments.run_preset("ifca-synthetic-tiny", ["rounds=3", "lr=0.2"], out,
                               progress=False, resume=True)
    assert cli.main([*args, "--set", "rounds=2", "restarts=3"]) == 2
    assert "restarts (10 there, 3 now)" in capsys.readouterr().err
    assert (out / "config.json").read_text() == before
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]


def test_diverged_run_exits_3_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    code = cli.main(["run", "ifca-synthetic-tiny", "--set", "lr=4", "checkpoint_every=10",
                     "--out", str(out), "--no-progress"])
    assert code == cli.EXIT_DIVERGED == 3
    err = capsys.readouterr().err
    match = re.search(r"fedjax-sim: run diverged at round (\d+): (\w+) is (nan|inf); "
                      r"last good checkpoint: round (\d+) in (\S+)", err)
    assert match, err
    diverged_round, metric, _, checkpoint_round, directory = match.groups()
    diverged_round, checkpoint_round = int(diverged_round), int(checkpoint_round)
    assert metric == "cohort_loss"  # the round's own metric goes first, before evaluation
    assert 0 < checkpoint_round < diverged_round <= 60
    assert os.path.samefile(directory, out / "checkpoints")

    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"] is True and summary["success"] is False
    assert summary["diverged_round"] == diverged_round
    assert summary["diverged_metric"] == metric
    assert summary["last_checkpoint_round"] == checkpoint_round
    rounds = [int(line.split(",")[0]) for line in
              (out / "metrics.csv").read_text().splitlines()[1:]]
    # One row per restart, up to the last good evaluation.
    assert sorted(set(rounds)) == list(range(0, checkpoint_round + 1, 10))

    # The last good checkpoint restores a finite state.
    settings = json.loads((out / "config.json").read_text())["settings"]
    problem = ifca_synthetic.make_problem(
        settings, jax.random.fold_in(jax.random.key(settings["seed"]), ifca_synthetic.DATA))
    algorithm = with_restarts(ifca(linear_regression(settings["d"]), sgd(settings["lr"]),
                                   num_clusters=settings["k"]), settings["restarts"])
    # The run's IFCA keeps no per-client state (every client takes part in every round):
    # its data's execution plan says so.
    forgetting = planned(problem.train, keep_client_state=False)
    key = jax.random.fold_in(jax.random.key(settings["seed"]), ifca_synthetic.ROUNDS)
    with RunCheckpoints(out / "checkpoints") as checkpoints:
        assert checkpoints.latest_step() == checkpoint_round
        restored = checkpoints.restore(jax.eval_shape(algorithm.init, key, forgetting), key)
        # A state of another shape (IFCA keeping per-client assignments: its 5 arrays,
        # assignment and stable beside the run's 3) is refused, named.
        with pytest.raises(ValueError, match=r"state arrays where this run's state has 5: "
                           "written by another version or with other settings"):
            checkpoints.restore(jax.eval_shape(algorithm.init, key, problem.train), key)
    for leaf in jax.tree.leaves(restored.state):
        assert np.isfinite(np.asarray(leaf)).all()
    assert restored.history[-1]["round"] == checkpoint_round


def test_corrupt_newest_checkpoint_resumes_from_the_previous_one(tmp_path, capsys):
    """A truncated array file in the newest checkpoint: --resume says so, restores the one
    before, and ends with the same metrics.csv as an uninterrupted run."""
    settings = ["--set", "rounds=20", "eval_every=10", "checkpoint_every=10", "restarts=2"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    assert cli.main(["run", "ifca-synthetic-tiny", *settings, "--out", str(whole),
                     "--no-progress"]) == 0
    # A copy of the finished run (a second run writes the same bytes: test_cli's
    # test_run_is_deterministic) without its summary, as a run killed after its last save.
    shutil.copytree(whole, broken)
    (broken / "summary.json").unlink()
    # The OCDBT data file the arrays are read from (`state/d/<hash>`).
    files = sorted((p for p in (broken / "checkpoints" / "20" / "state" / "d").iterdir()
                    if p.is_file()), key=lambda p: p.stat().st_size)
    assert files, "no array data file in the newest checkpoint"
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert cli.main(["run", "ifca-synthetic-tiny", *settings, "--out", str(broken),
                     "--no-progress", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "skipped checkpoint of round 20" in err, err
    assert (broken / "metrics.csv").read_bytes() == (whole / "metrics.csv").read_bytes()
    assert _summary(broken) == _summary(whole)
