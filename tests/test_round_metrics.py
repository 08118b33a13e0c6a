"""simulate.run with Execution(round_metrics=True): every round's metrics across a resume;
two copies axes."""

from __future__ import annotations

import pickle
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import simulate
from fedjax_sim.algorithms import Algorithm, ifca, sgd, with_restarts, with_seeds
from fedjax_sim.checkpoint import RunCheckpoints
from fedjax_sim.data import FederatedData, linear_mixture
from fedjax_sim.execution import Checkpoints, Execution
from fedjax_sim.models import linear_regression


@pytest.fixture(scope="module")
def seeds_by_restarts():
    """IFCA with 2 seeds × 3 restarts on one small mixture: copies axes [2, 3]."""
    problem = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0)
    algorithm = with_seeds(with_restarts(ifca(linear_regression(3), sgd(0.2), num_clusters=2),
                                         3), 2, shared_data=True)
    evaluate = jax.jit(algorithm.evaluate)

    def metrics(state):
        loss = np.asarray(evaluate(state, problem.train)["client_loss"])  # [2, 3, m]
        return {"loss": loss.mean(axis=-1)}

    return algorithm, problem.train, metrics


class _Killed(Exception):
    pass


def _assert_identical(a: dict, b: dict):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def test_resumed_run_returns_the_same_round_metrics_bytes(tmp_path, seeds_by_restarts):
    algorithm, data, metrics = seeds_by_restarts
    kw = dict(rounds=20, eval_every=5)
    plain = Execution(progress=False, copies=2, round_metrics=True)

    def saved(where, resume=False):
        return plain.replace(checkpoints=Checkpoints(tmp_path / where, every=5), resume=resume)

    state, history, every = simulate.run(algorithm, data, jax.random.key(1), evaluate=metrics,
                                         execution=saved("whole"), **kw)

    def killed_at_15(state):
        if int(np.asarray(state.round).ravel()[0]) == 15:
            raise _Killed  # after the checkpoint of round 10, before that of round 15
        return metrics(state)

    with pytest.raises(_Killed):
        simulate.run(algorithm, data, jax.random.key(1), evaluate=killed_at_15,
                     execution=saved("killed"), **kw)
    with RunCheckpoints(tmp_path / "killed") as checkpoints:
        assert checkpoints.steps() == [5, 10]
    resumed_state, resumed, resumed_every = simulate.run(
        algorithm, data, jax.random.key(1), evaluate=metrics,
        execution=saved("killed", resume=True), **kw)
    _assert_identical(every, resumed_every)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(resumed_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert [r["round"] for r in resumed] == [r["round"] for r in history] == [0, 5, 10, 15, 20]
    # Every round's [seeds, restarts] scalars; the history rows hold the last round's.
    assert every and all(v.shape == (20, 2, 3) for v in every.values())
    for row in history[1:]:
        for name, values in every.items():
            np.testing.assert_array_equal(row[name], values[row["round"] - 1])
    # An uninterrupted run without checkpoints returns the same arrays; without the
    # option, the old (state, history) pair.
    _, _, uninterrupted = simulate.run(algorithm, data, jax.random.key(1), evaluate=metrics,
                                       execution=plain, **kw)
    _assert_identical(every, uninterrupted)
    assert len(simulate.run(algorithm, data, jax.random.key(1), evaluate=metrics,
                            execution=plain.replace(round_metrics=False), **kw)) == 2


def test_resume_from_a_checkpoint_without_round_metrics_is_refused(tmp_path, seeds_by_restarts):
    algorithm, data, metrics = seeds_by_restarts
    execution = Execution(progress=False, copies=2, checkpoints=Checkpoints(tmp_path / "c"))
    kw = dict(eval_every=5, evaluate=metrics)
    simulate.run(algorithm, data, jax.random.key(1), rounds=5, execution=execution, **kw)
    with pytest.raises(ValueError, match="round_metrics"):
        simulate.run(algorithm, data, jax.random.key(1), rounds=10, **kw,
                     execution=execution.replace(resume=True, round_metrics=True))


def test_history_keeps_metrics_with_two_copies_axes(seeds_by_restarts):
    """With copies=2 a [seeds, restarts] round metric is a history column; with one
    copies axis it is not one number per copy, so it stays out (never guessed)."""
    algorithm, data, metrics = seeds_by_restarts
    kw = dict(rounds=4, eval_every=2, evaluate=metrics)
    _, two = simulate.run(algorithm, data, jax.random.key(1),
                          execution=Execution(progress=False, copies=2), **kw)
    _, one = simulate.run(algorithm, data, jax.random.key(1),
                          execution=Execution(progress=False, copies=1), **kw)
    chunk = jax.eval_shape(lambda s: simulate.scan_rounds(algorithm, s, data, jax.random.key(0),
                                                          0, 2)[1],
                           jax.eval_shape(algorithm.init, jax.random.key(0), data))
    per_copy = {n for n, s in chunk.items() if s.shape == (2, 2, 3)}
    assert per_copy and {n for n, s in chunk.items() if s.shape != (2, 2, 3)}
    assert set(two[0]) == {"round", "loss", *per_copy}
    assert set(one[0]) == {"round", "loss"}
    for name in per_copy:
        assert np.isnan(two[0][name]).all() and two[0][name].shape == (2, 3)
        assert np.isfinite(two[-1][name]).all()
    with pytest.raises(ValueError, match="copies must be the number of leading copies axes"):
        Execution(copies=-1)


class _Grow(NamedTuple):
    x: jax.Array  # [2, 3]


def _grow(factor) -> Algorithm:
    """x ← factor·x from 1 ([2, 3] copies): a copy overflows to inf once factorᵗ > 3.4e38."""
    factor = jnp.asarray(factor, jnp.float32)

    def round_(state, data, key):
        x = state.x * factor
        return _Grow(x), {"train_loss": x}

    return Algorithm(lambda key, data: _Grow(jnp.ones_like(factor)), round_,
                     lambda state, data: {})


def test_divergence_over_two_copies_axes_needs_every_copy():
    data = FederatedData.from_arrays(np.zeros((1, 1, 1), np.float32), np.zeros((1, 1), np.float32))
    execution = Execution(progress=False, copies=2)
    kw = dict(rounds=6, eval_every=3, evaluate=lambda s: {})
    one_healthy = [[1e20, 1e20, 1e20], [1e20, 1e10, 1.0]]
    _, history = simulate.run(_grow(one_healthy), data, jax.random.key(0), execution=execution,
                              **kw)
    assert history[-1]["round"] == 6 and history[-1]["train_loss"][1, 2] == 1.0
    # Copies overflow at round 2 (1e20) and 4 (1e10): the run diverges at 4, the last one.
    with pytest.raises(simulate.Diverged) as info:
        simulate.run(_grow([[1e20, 1e20, 1e20], [1e20, 1e10, 1e20]]), data,
                     jax.random.key(0), execution=execution, **kw)
    assert (info.value.round, info.value.metric, info.value.value) == (4, "train_loss", "inf")
    assert info.value.round_metrics is None
    # With round_metrics, the error carries every round's metrics up to the last good chunk.
    with pytest.raises(simulate.Diverged) as info:
        simulate.run(_grow([[1e20, 1e20, 1e20], [1e20, 1e10, 1e20]]), data,
                     jax.random.key(0), execution=execution.replace(round_metrics=True), **kw)
    kept = info.value.round_metrics["train_loss"]
    assert kept.shape == (3, 2, 3) and kept[2, 1, 1] == np.float32(1e30)
    assert pickle.loads(pickle.dumps(info.value)).round_metrics["train_loss"].shape == (3, 2, 3)
