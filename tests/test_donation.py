"""`simulate.run` donates each chunk's input state: what the host still reads must survive.

The chunk after a checkpoint runs on a copy (the save reads the original), an
evaluation that hands back a leaf of the state keeps its value in the history,
and the numbers equal the same rounds in one non-donating `scan_rounds` call.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fedjax_sim import simulate
from fedjax_sim.algorithms import ifca, sgd
from fedjax_sim.checkpoint import RunCheckpoints
from fedjax_sim.data import linear_mixture
from fedjax_sim.execution import Checkpoints, Execution
from fedjax_sim.models import linear_regression


@pytest.fixture(scope="module")
def small():
    problem = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0)
    return ifca(linear_regression(3), sgd(0.2), num_clusters=2), problem.train


def test_donating_scan_rounds_deletes_its_input_and_matches(small):
    algorithm, data = small
    state = algorithm.init(jax.random.key(1), data)
    kept = jax.tree.map(np.array, state)
    plain, _ = simulate.scan_rounds(algorithm, state, data, jax.random.key(2), 0, 3)
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    donated, _ = simulate.scan_rounds(algorithm, state, data, jax.random.key(2), 0, 3,
                                      donate_state=True)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(donated), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(kept) == jax.tree.structure(plain)


def test_run_with_donated_chunks_equals_one_scan_and_keeps_what_the_host_reads(
        tmp_path, small):
    """Every chunk checkpointed (a save in flight while the next chunk runs), and an
    evaluation returning a state leaf itself (a jax array the next chunk would donate)."""
    algorithm, data = small
    key = jax.random.key(1)
    key_init, key_rounds = jax.random.split(key)
    state0 = algorithm.init(key_init, data)
    expected, _ = simulate.scan_rounds(algorithm, state0, data, key_rounds, 0, 12)
    expected_at = [jax.tree.map(np.array, simulate.scan_rounds(
        algorithm, state0, data, key_rounds, 0, t)[0]) for t in (4, 8)]

    def evaluate(state):
        leaf = jax.tree.leaves(state.cluster_params)[0]  # the state's own array
        return {"leaf": leaf}

    state, history = simulate.run(algorithm, data, key, rounds=12, eval_every=2,
                                  evaluate=evaluate, execution=Execution(
                                      progress=False,
                                      checkpoints=Checkpoints(tmp_path / "ckpt", every=4)))
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(history[-1]["leaf"],
                                  np.asarray(jax.tree.leaves(expected.cluster_params)[0]))
    assert [r["round"] for r in history] == [0, 2, 4, 6, 8, 10, 12]
    # The checkpoints the chunks' donation could have overwritten hold their own rounds.
    abstract = jax.eval_shape(algorithm.init, key_init, data)
    with RunCheckpoints(tmp_path / "ckpt", max_to_keep=5) as checkpoints:
        assert checkpoints.steps() == [8, 12]
        restored = checkpoints.restore(abstract, key, 8)
    for a, b in zip(jax.tree.leaves(expected_at[1]), jax.tree.leaves(restored.state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(restored.history[4]["leaf"], history[4]["leaf"])
