"""The client axis in chunks (the execution plan's `client_chunk`) gives the unchunked results.

Chunk sizes that divide the number of clients and ones that do not (the last
chunk is padded with weight-0 copies), on a ragged federation with an empty
and a one-example client; float32 tolerance for sums whose order changes,
exact equality for assignments. Also the chunk-size helpers of
`fedjax_sim.memory`.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim import memory
from fedjax_sim.algorithms import (
    ClientTraining,
    fedavg,
    ifca,
    local_models,
    one_shot_clustering,
    sgd,
    with_restarts,
)
from fedjax_sim.data import FederatedData
from fedjax_sim.execution import Plan, planned
from fedjax_sim.models import linear_regression, mlp_classifier
from fedjax_sim.ops import (
    check_client_chunk,
    client_keys,
    cluster_losses,
    local_update,
    scan_client_chunks,
)

RTOL = ATOL = 2e-5
# These tests compile many small programs and run each once: skip LLVM's
# optimizations, which halves XLA:CPU compile time. Chunked and unchunked
# programs are compiled alike, so the comparison is unaffected.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
# 8 clients, one of them empty and one with a single row.
SIZES = (4, 1, 0, 3, 2, 4, 2, 3)
D = 3


def _ragged(sizes=SIZES, seed=0):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(2, D)).astype(np.float32)
    xs = [rng.normal(size=(n, D)).astype(np.float32) for n in sizes]
    ys = [(x @ theta[i % 2]).astype(np.float32) for i, x in enumerate(xs)]
    return FederatedData.from_clients(xs, ys, cluster=[i % 2 for i in range(len(sizes))])


@functools.cache
def _data():
    return _ragged()


@functools.cache
def _linear():
    return linear_regression(D)


@functools.cache
def _mlp_problem():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(7, 5, 2, 3)).astype(np.float32)
    y = rng.integers(0, 3, size=(7, 5)).astype(np.int32)
    data = FederatedData.from_arrays(x, y, num_examples=np.array([5, 1, 0, 3, 5, 2, 4], np.int32))
    return mlp_classifier((2, 3), (4,), 3), data


INIT_KEY, ROUND_KEY = jax.random.key(5), jax.random.key(6)


@functools.partial(jit, static_argnums=0)
def _rounds(alg, data, state):
    """Two rounds from `state`, then evaluate, under one jit."""
    state, metrics = jax.lax.scan(
        lambda s, k: alg.round(s, data, k), state, jax.random.split(ROUND_KEY, 2)
    )
    return state, metrics, alg.evaluate(state, data)


def _run(alg, data, state=None):
    """(initial state, final state, round metrics, evaluation).

    Chunking never changes `init` (except one-shot's local pre-training), so
    a chunked run may start from the unchunked run's state: one compilation
    of `init` fewer (random initializers compile slowly on XLA:CPU).
    """
    if state is None:
        state = jit(alg.init)(INIT_KEY, data)
    return (state, *_rounds(alg, data, state))


def _assert_same_run(plain, chunked):
    """Integer leaves (assignments, counters) equal; float leaves to float32 tolerance."""
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(chunked), strict=True):
        if jnp.issubdtype(a.dtype, jnp.integer):
            np.testing.assert_array_equal(a, b)
    chex.assert_trees_all_close(plain, chunked, rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- the scan helper


@pytest.mark.parametrize("chunk", [1, 3, 4, 8, 20])
def test_scan_client_chunks_visits_every_client_once(chunk):
    m = 8
    values = jnp.arange(m, dtype=jnp.float32) + 1

    def fn(total, part, valid):
        return total + jnp.sum(jnp.where(valid, part, 0.0)), 2 * part

    total, doubled = scan_client_chunks(fn, jnp.float32(0), values, chunk)
    assert float(total) == float(values.sum())
    np.testing.assert_array_equal(doubled, 2 * values)


@pytest.mark.parametrize("m,chunk", [(10, 3), (11, 2), (7, 4), (13, 5), (12, 4)])
def test_scan_client_chunks_padded_outputs_in_place(m, chunk):
    # Each output row is its own client's, padded last chunk included (written at m − c
    # over the rows the chunk before it wrote), and the carry sees each client once.
    values = {"x": jnp.arange(m, dtype=jnp.float32) + 1,
              "y": jnp.arange(2 * m, dtype=jnp.int32).reshape(m, 2)}
    seen = []

    def fn(total, part, valid):
        return total + jnp.sum(jnp.where(valid, part["x"], 0.0)), {
            "x": 3 * part["x"], "y": part["y"] - 1, "valid": valid}

    total, out = scan_client_chunks(fn, jnp.float32(0), values, chunk)
    for i in range(m):
        seen.append((float(out["x"][i]), out["y"][i].tolist(), bool(out["valid"][i])))
    assert seen == [(3.0 * (i + 1), [2 * i - 1, 2 * i], True) for i in range(m)]
    assert float(total) == m * (m + 1) / 2


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_check_client_chunk_rejects(bad):
    with pytest.raises(ValueError, match="client_chunk"):
        check_client_chunk(bad)
    # The chunk is the executor's: a plan (and the data planned with it) refuses it.
    with pytest.raises(ValueError, match="client_chunk"):
        Plan(client_chunk=bad)
    with pytest.raises(ValueError, match="client_chunk"):
        planned(_data(), client_chunk=bad)


# --------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("chunk", [3, 4])
def test_cluster_losses_chunked_equals_unchunked(chunk):
    data = _data()
    params = jax.random.normal(jax.random.key(0), (3, D))
    want = cluster_losses(_linear(), params, data)
    got = jit(lambda p, d: cluster_losses(_linear(), p, d, client_chunk=chunk))(params, data)
    chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)


@functools.cache
def _local_update(client_chunk):
    data = _data()
    m = data.num_clients
    params = jax.random.normal(jax.random.key(0), (m, D))
    keys = client_keys(jax.random.key(1), jnp.arange(m))
    opt = optax.sgd(0.05, momentum=0.9)

    @jit
    def run(params, data, keys, snapshot_step):
        return local_update(
            _linear(), opt, params, data, keys, num_steps=3, batch_size=2,
            snapshot_step=snapshot_step,
        )

    return run(params, planned(data, client_chunk=client_chunk), keys, jnp.int32(2))


@pytest.mark.parametrize("chunk", [3, 4])
def test_local_update_chunked_equals_unchunked(chunk):
    chex.assert_trees_all_close(_local_update(chunk), _local_update(None), rtol=RTOL, atol=ATOL)


# --------------------------------------------------------------------------- algorithms

# name -> (factory(), problem); the chunk rides on the data (`planned`). With 8
# clients, chunk 3 leaves a padded last chunk and 4 does not; with participation
# 0.75 the cohort has 6 clients, where 4 pads and 3 divides (and evaluate sees all 8).
# Each factory is cached: the chunked runs reuse the plain run's algorithm object.
_CASES = {
    "ifca_gradient": (
        functools.cache(lambda: ifca(_linear(), sgd(0.05), num_clusters=3, stable_rounds=1)),
        _data,
    ),
    # A flax model (several leaves, accuracy in evaluate), an optimizer state,
    # minibatches, a cohort and frozen clients.
    "ifca_model": (
        functools.cache(lambda: ifca(
            _mlp_problem()[0], ClientTraining(optax.sgd(0.1, momentum=0.9), steps=2,
                                              batch_size=2),
            num_clusters=2, option="model", participation=0.75, stable_rounds=1,
            weighting="examples",
        )),
        lambda: _mlp_problem()[1],
    ),
    "fedavg": (
        functools.cache(lambda: fedavg(_linear(), sgd(0.05, steps=2), participation=0.75)),
        _data,
    ),
    "local": (
        functools.cache(lambda: local_models(_linear(), sgd(0.05, steps=2))),
        _data,
    ),
    "oneshot": (
        functools.cache(lambda: one_shot_clustering(
            _linear(), sgd(0.05), num_clusters=2, pretraining=sgd(0.05, steps=2),
            kmeans_restarts=1,
        )),
        _data,
    ),
}


@functools.cache
def _plain_run(name):
    build, problem = _CASES[name]
    return _run(build(), problem())


@pytest.mark.parametrize("chunk", [3, 4])
@pytest.mark.parametrize("name", sorted(_CASES))
def test_algorithm_chunked_equals_unchunked(name, chunk):
    build, problem = _CASES[name]
    plain = _plain_run(name)
    # One-shot's init trains local models, which is chunked too: run it.
    chunked = _run(build(), planned(problem(), client_chunk=chunk),
                   None if name == "oneshot" else plain[0])
    _assert_same_run(plain, chunked)


def test_with_restarts_chunked_equals_unchunked():
    alg = with_restarts(ifca(_linear(), sgd(0.05), num_clusters=2), 2)
    plain = _run(alg, _data())
    _assert_same_run(plain, _run(alg, planned(_data(), client_chunk=3), plain[0]))


# --------------------------------------------------------------------------- memory helpers


def test_client_chunk_for_budget():
    assert memory.client_chunk_for_budget(10, 100, 1000) is None
    # 1000 clients of 100 B in 25_000 B: 250 fit, so 4 chunks of 250.
    assert memory.client_chunk_for_budget(1000, 100, 25_000) == 250
    # 1000 clients, 300 fit: still 4 chunks, evened out to 250.
    assert memory.client_chunk_for_budget(1000, 100, 30_000) == 250
    assert memory.client_chunk_for_budget(1000, 10**9, 1) == 1
    for m in (7, 100, 1001):
        for budget in (150, 999, 4321):
            c = memory.client_chunk_for_budget(m, 10, budget)
            if c is not None:
                assert 1 <= c and c * 10 <= max(budget, 10)
                assert -(-m // c) == -(-m // max(1, budget // 10))  # fewest chunks
    for args in ((0, 1, 1), (5, 0, 1), (5, 1, 0)):
        with pytest.raises(ValueError):
            memory.client_chunk_for_budget(*args)


def test_estimate_bytes_per_client_grows_with_copies_and_clusters():
    model, data = _mlp_problem()
    est = functools.partial(memory.estimate_bytes_per_client, model, data)
    params = memory.tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))
    rows = memory.tree_bytes([data.x[0], data.y[0]])
    assert est(local_training=False) > rows
    assert est() >= rows + 5 * params
    assert est(num_clusters=4) > est()
    # Adam keeps two params-sized moments (plus a step count).
    assert est(optimizer=optax.adam(1e-3)) - est() >= 2 * params
    with pytest.raises(ValueError, match="local_training"):
        est(local_training="both")


def test_choose_client_chunk():
    model, data = _mlp_problem()
    assert memory.choose_client_chunk(model, data, 2**30) is None
    resident = memory.tree_bytes(data)
    per = memory.estimate_bytes_per_client(model, data)
    assert memory.choose_client_chunk(model, data, resident + 2.5 * per) == 2
    with pytest.raises(ValueError, match="raise the memory budget"):
        memory.choose_client_chunk(model, data, resident / 2)
    with pytest.raises(ValueError, match="raise memory_budget_gb"):  # the caller's setting
        memory.choose_client_chunk(model, data, resident / 2, budget_name="memory_budget_gb")
