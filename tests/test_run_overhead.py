"""What makes a run as fast as its compiled rounds keeps its guarantees.

* metrics.csv rows are fsynced once per checkpoint, before it is written, and
  at the end of the run, not once per row;
* an asynchronous checkpoint save (orbax's asynchronous mode) is complete once
  `close` returns; the next save (or a listing of the steps) waits for it, and
  a save that failed in the background raises at the next save or at `close`;
* a checkpoint's history is the same when its rows are encoded once each;
* the batched cluster identity accuracy equals a brute-force per-row loop.
"""

from __future__ import annotations

import itertools
import os
import time as time_module

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import checkpoint, io, logs
from fedjax_sim.checkpoint import RunCheckpoints
from fedjax_sim.experiments import run_preset
from fedjax_sim.metrics import cluster_identity_accuracies, cluster_identity_accuracy


def _fd_path(fd: int) -> str:
    return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_rows_are_fsynced_before_each_checkpoint_and_at_the_end(tmp_path, monkeypatch):
    events = []
    fsync = os.fsync

    def recording_fsync(fd):
        events.append(("fsync", _fd_path(fd)))
        fsync(fd)

    append = logs.MetricsCSV.append

    def recording_append(self, rows):
        events.append(("append", int(rows[-1]["round"])))
        append(self, rows)

    save = RunCheckpoints.save

    def recording_save(self, step, *args, **kwargs):
        save(self, step, *args, **kwargs)
        events.append(("save", int(step)))

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(logs.MetricsCSV, "append", recording_append)
    monkeypatch.setattr(RunCheckpoints, "save", recording_save)
    out = run_preset("ifca-synthetic-tiny", ["rounds=5", "eval_every=1", "checkpoint_every=2",
                                             "restarts=1"], out_dir=tmp_path / "run",
                     progress=False)
    appends = [e for e in events if e[0] == "append"]
    saves = [e for e in events if e[0] == "save"]
    csv_syncs = [i for i, e in enumerate(events) if e == ("fsync", "metrics.csv")]
    assert [r for _, r in appends] == [1, 2, 3, 4, 5] and [s for _, s in saves] == [2, 4]
    # Fewer fsyncs than rows: one before each checkpoint and one at the end.
    assert len(csv_syncs) < len(appends)
    for i, event in enumerate(events):
        if event[0] != "save":
            continue
        last_append = max(j for j, e in enumerate(events[:i]) if e[0] == "append")
        assert events[last_append][1] == event[1]  # that checkpoint's round was appended
        assert any(last_append < j < i for j in csv_syncs), events
    last_append = max(j for j, e in enumerate(events) if e[0] == "append")
    assert any(j > last_append for j in csv_syncs), events
    assert len(io.read_csv(out / "metrics.csv")) == 6  # rounds 0..5


def test_a_deferred_append_is_synced_by_sync_appended(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(_fd_path(fd)))
    path = tmp_path / "m.csv"
    io.append_csv(path, [{"round": 1}], ["round"], sync=False)
    assert synced == []
    io.sync_appended()
    assert synced == ["m.csv"]
    io.sync_appended()  # nothing new appended: no fsync
    assert synced == ["m.csv"]
    io.append_csv(path, [{"round": 2}], ["round"])  # the default fsyncs at once
    assert synced == ["m.csv", "m.csv"]
    assert path.read_text() == "round\n1\n2\n"


def _state(round_: int) -> dict:
    return {"w": jnp.arange(6.0).reshape(2, 3) * round_, "key": jax.random.key(round_)}


def test_an_async_checkpoint_is_complete_after_close(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    waits = []
    wait = RunCheckpoints.wait
    monkeypatch.setattr(RunCheckpoints, "wait",
                        lambda self: (waits.append(self._pending), wait(self))[1])
    history = [{"round": 0, "loss": np.float32(2.0)}]
    checkpoints = RunCheckpoints(directory)
    checkpoints.save(1, _state(1), jax.random.key(3), history)
    assert checkpoints._open()._options.enable_async_checkpointing
    history.append({"round": 2, "loss": np.array([1.0, 0.5], np.float32)})
    checkpoints.save(2, _state(2), jax.random.key(3), history)
    assert 1 in waits  # the second save waited for the first
    checkpoints.close()
    assert waits[-1] == 2  # close waited for the last one
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]
    with RunCheckpoints(directory) as again:
        assert again.steps() == [1, 2]
        restored = again.restore(jax.eval_shape(lambda: _state(0)),
                                 jax.eval_shape(lambda: jax.random.key(0)))
    assert restored.round == 2
    np.testing.assert_array_equal(restored.state["w"], _state(2)["w"])
    assert len(restored.history) == 2
    assert restored.history[0]["loss"] == np.float32(2.0)
    assert restored.history[0]["loss"].dtype == np.float32
    np.testing.assert_array_equal(restored.history[1]["loss"], history[1]["loss"])


def _failing_orbax_save(monkeypatch, failing_step: int, error: Exception):
    """orbax's asynchronous save of `failing_step` failing in the background: it commits
    nothing and its error comes out of the next `wait_until_finished`."""
    manager = checkpoint._orbax().CheckpointManager
    orbax_save, orbax_wait = manager.save, manager.wait_until_finished
    failed = []

    def save(self, step, *args, **kwargs):
        if step == failing_step:
            failed.append(step)
            return True
        return orbax_save(self, step, *args, **kwargs)

    def wait_until_finished(self):
        orbax_wait(self)
        if failed:
            failed.clear()
            raise error

    monkeypatch.setattr(manager, "save", save)
    monkeypatch.setattr(manager, "wait_until_finished", wait_until_finished)


def test_a_failed_background_save_raises_at_the_next_save(tmp_path, monkeypatch):
    _failing_orbax_save(monkeypatch, 2, ValueError(
        "Error writing local file: [RESOURCE_EXHAUSTED: os_error_code=28 ...]"))
    checkpoints = RunCheckpoints(tmp_path / "c")
    checkpoints.save(1, _state(1), jax.random.key(3), [])
    checkpoints.save(2, _state(2), jax.random.key(3), [])  # fails in the background
    with pytest.raises(OSError) as error:
        checkpoints.save(3, _state(3), jax.random.key(3), [])
    assert error.value.errno == 28 and error.value.filename == str(tmp_path / "c" / "2")
    checkpoints.close()  # the error was raised once; nothing is pending
    with RunCheckpoints(tmp_path / "c") as again:
        assert again.steps() == [1]  # round 3 was refused, round 2 never committed


def test_a_failed_last_save_raises_at_close(tmp_path, monkeypatch):
    _failing_orbax_save(monkeypatch, 2, RuntimeError("disk on fire"))
    checkpoints = RunCheckpoints(tmp_path / "c")
    checkpoints.save(1, _state(1), jax.random.key(3), [])
    checkpoints.save(2, _state(2), jax.random.key(3), [])
    with pytest.raises(RuntimeError, match="disk on fire"):
        checkpoints.close()
    with RunCheckpoints(tmp_path / "c") as again:
        assert again.steps() == [1]


def test_numpy_leaves_are_saved_as_they_were_when_save_was_called(tmp_path):
    state = {"w": np.arange(6.0, dtype=np.float32), "key": jax.random.key(1)}
    with RunCheckpoints(tmp_path / "c") as checkpoints:
        checkpoints.save(1, state, jax.random.key(3), [])
        state["w"][:] = -1.0  # changed while orbax may still be writing
    with RunCheckpoints(tmp_path / "c") as again:
        restored = again.restore(jax.eval_shape(lambda: {"w": jnp.zeros(6, jnp.float32),
                                                         "key": jax.random.key(0)}),
                                 jax.eval_shape(lambda: jax.random.key(0)))
    np.testing.assert_array_equal(restored.state["w"], np.arange(6.0, dtype=np.float32))


def test_a_new_history_is_encoded_afresh(tmp_path):
    # Rows of another list (not the one saved before) are not taken for the saved ones.
    with RunCheckpoints(tmp_path / "c") as checkpoints:
        checkpoints.save(1, _state(1), jax.random.key(3), [{"round": 1, "loss": 1.0}])
        checkpoints.save(2, _state(2), jax.random.key(3), [{"round": 1, "loss": 9.0},
                                                            {"round": 2, "loss": 8.0}])
    with RunCheckpoints(tmp_path / "c") as again:
        restored = again.restore(jax.eval_shape(lambda: _state(0)),
                                 jax.eval_shape(lambda: jax.random.key(0)))
    assert restored.history == [{"round": 1, "loss": 9.0}, {"round": 2, "loss": 8.0}]
    assert checkpoint.decode_history(checkpoint.encode_history(restored.history)) == (
        restored.history)


def _brute_force(assignment, truth, labels: int) -> float:
    """Best fraction of known clients right over every relabeling (a permutation)."""
    known = [(a, t) for a, t in zip(assignment, truth, strict=True) if t >= 0]
    if not known:
        return float("nan")
    best = max(sum(1 for a, t in known if a >= 0 and perm[a] == t)
               for perm in itertools.permutations(range(labels)))
    return best / len(known)


def test_batched_cluster_accuracy_equals_a_brute_force_loop():
    rng = np.random.default_rng(0)
    k, m = 3, 17
    assignment = rng.integers(-1, k, size=(4, 5, m))
    truth = rng.integers(-1, k, size=(4, 5, m))
    truth[0, 0] = -1  # no known client: NaN
    truth[1, 1] = rng.integers(0, k, size=m)  # every client known
    assignment[2, 2] = truth[2, 2] % k  # right up to relabeling
    got = cluster_identity_accuracies(assignment, truth, k)
    assert got.shape == (4, 5) and got.dtype == np.float64
    for i, j in itertools.product(range(4), range(5)):
        want = _brute_force(assignment[i, j], truth[i, j], k)
        if np.isnan(want):
            assert np.isnan(got[i, j]) and np.isnan(
                cluster_identity_accuracy(assignment[i, j], truth[i, j], k))
        else:
            assert got[i, j] == want
            assert cluster_identity_accuracy(assignment[i, j], truth[i, j], k) == want
    # Labels past num_clusters widen the label space, as per row.
    assert cluster_identity_accuracies(np.array([[4, 4, 0]]), np.array([[1, 1, 0]]), 2)[0] == 1.0


def test_round_metrics_restore_bit_for_bit_in_their_order(tmp_path):
    metrics = {
        "loss": np.array([[1.5, np.nan], [0.25, np.inf]], np.float32),  # an array item
        "sizes": np.array([[3, 4], [5, 6]], np.int32),
        "wide": np.array([[0.1], [0.2]], np.float64),  # JAX would narrow it: stays JSON
        "none_yet": np.zeros((0, 2), np.float32),  # empty: stays JSON
    }
    with RunCheckpoints(tmp_path / "c") as checkpoints:
        checkpoints.save(2, _state(2), jax.random.key(3), [{"round": 2}], round_metrics=metrics)
    with RunCheckpoints(tmp_path / "c") as again:
        restored = again.restore(jax.eval_shape(lambda: _state(0)),
                                 jax.eval_shape(lambda: jax.random.key(0)))
    assert list(restored.round_metrics) == list(metrics)
    for name, want in metrics.items():
        got = restored.round_metrics[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


def test_timing_counts_an_evaluation_as_evaluation_and_its_compiling_as_compilation(
        monkeypatch):
    """The 10^8-client run's summary said compile_seconds = 4 228 s: the whole first
    evaluation (70 minutes of it) was counted as compilation. Each evaluation's wall time
    is evaluate_seconds now, less what JAX reports compiling inside it."""
    import types

    from fedjax_sim import simulate
    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.data import linear_mixture
    from fedjax_sim.execution import Execution
    from fedjax_sim.models import linear_regression

    problem = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0)
    algorithm = ifca(linear_regression(3), sgd(0.2), num_clusters=2)
    # simulate's clock: the real one, plus what the evaluations "spend" (100 s at round 0,
    # 1 s each after), so the split is exact whatever the machine's load.
    spent = [0.0]
    monkeypatch.setattr(simulate, "time", types.SimpleNamespace(
        perf_counter=lambda: time_module.perf_counter() + spent[0]))
    compiles = []

    def evaluate(state):
        spent[0] += 100.0 if not compiles else 1.0
        # A function compiled inside the evaluation, on each call (a new closure).
        scale = float(len(compiles) + 1)
        compiles.append(scale)
        return {"norm": jax.jit(lambda s: scale * jnp.sum(s ** 2))(
            jax.tree.leaves(state.cluster_params)[0])}

    timing = {}
    simulate.run(algorithm, problem.train, jax.random.key(1), rounds=6, eval_every=2,
                 evaluate=evaluate, execution=Execution(progress=False, timing=timing))
    assert len(compiles) == 4  # rounds 0, 2, 4, 6
    assert 103.0 <= timing["evaluate_seconds"] < 103.0 + 30.0
    assert timing["compile_seconds"] < 30.0  # not the first evaluation's 100 s
    assert timing["run_seconds"] >= timing["evaluate_seconds"]
    # What is charged to compilation is what JAX reports compiling in the call, and only
    # that: a new function compiles, a compiled one does not.
    f = jax.jit(lambda x: jnp.sin(x) * 3.0)
    x = jnp.ones(5)
    _, first = simulate._compile_seconds_during(lambda: f(x).block_until_ready())
    _, again = simulate._compile_seconds_during(lambda: f(x).block_until_ready())
    assert first > 0.0 and again == 0.0
