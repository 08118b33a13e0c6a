"""The engine's core paths against plain per-client Python loops.

The one cohort path (`sample_cohort`, `cohort_sums`, `take`/`put`), pytree
client data beside `ServerData` (sharded on 4 forced devices == unsharded),
IFCA weight sharing, `with_seeds`, the empty-client rules, one-shot
clustering's fixed clusters, eager argument checks and tracing once.

The ragged federations here have clients of 4, 1, 0, 3 and 2 real rows, and
their padding rows hold garbage (not zeros), so a missing mask shows up.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from federations import subprocess_env
from jax.sharding import PartitionSpec as P

from fedjax_sim import (
    Algorithm,
    FederatedData,
    ServerData,
    fedavg,
    ifca,
    linear_mixture,
    linear_regression,
    mlp_classifier,
    one_shot_clustering,
    simulate,
    with_seeds,
)
from fedjax_sim.algorithms import sgd, with_initial_params, with_weight_sharing
from fedjax_sim.algorithms.base import broadcast_to_clients
from fedjax_sim.execution import Execution, planned
from fedjax_sim.metrics import summarize_clients
from fedjax_sim.models import Model, client_loss, combine, squared_error
from fedjax_sim.ops import cohort_sums, local_update, put, sample_cohort, take

GARBAGE = 7.5
RAGGED_SIZES = (4, 1, 0, 3, 2)


def ragged_federation(seed: int) -> FederatedData:
    """Clients of 4, 1, 0, 3 and 2 rows (d = 3) in two linear clusters, like conftest's."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(2, 3)).astype(np.float32)
    xs = [rng.normal(size=(c, 3)).astype(np.float32) for c in RAGGED_SIZES]
    ys = [(x @ theta[i % 2] + 0.1 * rng.normal(size=len(x))).astype(np.float32)
          for i, x in enumerate(xs)]
    return with_garbage_padding(FederatedData.from_clients(xs, ys))


def with_garbage_padding(data: FederatedData, fill=GARBAGE) -> FederatedData:
    """The same clients, their padding rows overwritten with `fill` (x) and -fill (y)."""
    real = np.asarray(data.mask()) > 0

    def pad(a, value):
        a = np.array(a)
        a[~real] = value
        return a

    x = jax.tree.map(lambda a: pad(a, fill), data.x)
    return FederatedData.from_arrays(x, pad(data.y, -fill), np.asarray(data.num_examples),
                                     np.asarray(data.cluster))


@pytest.fixture(scope="module")
def garbage_ragged(ragged):
    data = with_garbage_padding(ragged)
    assert tuple(np.asarray(data.num_examples)) == RAGGED_SIZES
    return data


def key_bits(keys) -> np.ndarray:
    return np.asarray(jax.random.key_data(keys)).reshape(keys.shape[0], -1)


# --------------------------------------------------------------------------------------
# 1. The cohort path vs a loop over cohort slots
# --------------------------------------------------------------------------------------


def noisy_sum_step(batch):
    """Per slot: normal(slot key) · Σ of the client's real x; sums over active slots."""
    mask = batch.data.mask()[..., None]
    x_sum = jnp.sum(jnp.where(mask > 0, batch.data.x, 0.0), axis=(1, 2))
    out = jax.vmap(jax.random.normal)(batch.keys) * x_sum
    w = jnp.where(batch.active, batch.data.num_examples.astype(jnp.float32), 0.0)
    sums = {
        "weighted": jnp.sum(w * out),
        "weight": jnp.sum(w),
        "active": jnp.sum(batch.active.astype(jnp.float32)),
        "inputs": jnp.sum(jnp.where(batch.active, batch.inputs, 0.0)),
    }
    return sums, {"out": out, "active": batch.active, "inputs": batch.inputs}


def loop_over_slots(data: FederatedData, cohort, inputs):
    """The same quantities, slot by slot, on each client's unpadded rows."""
    x, n = np.asarray(data.x), np.asarray(data.num_examples)
    outs, actives, used_inputs = [], [], []
    sums = {"weighted": 0.0, "weight": 0.0, "active": 0.0, "inputs": 0.0}
    for slot in range(cohort.size):
        i = int(cohort.ids[slot])
        out = float(jax.random.normal(cohort.keys[slot])) * float(x[i, : n[i]].sum())
        active = bool(n[i] > 0)
        outs.append(out)
        actives.append(active)
        used_inputs.append(float(inputs[slot]))
        if active:
            sums["weighted"] += n[i] * out
            sums["weight"] += n[i]
            sums["active"] += 1
            sums["inputs"] += float(inputs[slot])
    return sums, {"out": np.array(outs), "active": np.array(actives),
                  "inputs": np.array(used_inputs)}


def weighted_cohort_with_repeat(data):
    """A weighted cohort in which a non-empty client fills two slots (the key is searched)."""
    weights = jnp.array([0.4, 0.0, 0.3, 0.3, 0.0])  # clients 1 and 4 can never be drawn
    n = np.asarray(data.num_examples)
    for seed in range(100):
        cohort = sample_cohort(jax.random.key(seed), 5, 7, weights=weights)
        ids = np.asarray(cohort.ids)
        counts = np.bincount(ids, minlength=5)
        if (counts[n > 0] >= 2).any() and counts[2] >= 1:
            return cohort
    raise AssertionError("no key gave a repeated non-empty client and the empty client")


def make_cohort(kind, data):
    key = jax.random.key(3)
    if kind == "everyone":
        return sample_cohort(key, 5, 5)
    if kind == "uniform":
        return sample_cohort(key, 5, 3)
    return weighted_cohort_with_repeat(data)


@pytest.mark.parametrize("kind", ["everyone", "uniform", "weighted"])
def test_cohort_sums_equal_loop_over_slots(kind, garbage_ragged):
    data = garbage_ragged
    cohort = make_cohort(kind, data)
    ids = np.asarray(cohort.ids)
    n = np.asarray(data.num_examples)
    if kind == "everyone":
        assert cohort.everyone
        np.testing.assert_array_equal(ids, np.arange(5))
    elif kind == "uniform":
        assert not cohort.everyone and cohort.size == 3
        assert len(set(ids.tolist())) == 3 and ids.min() >= 0 and ids.max() < 5
    else:
        assert not cohort.everyone
        assert set(ids.tolist()) <= {0, 2, 3}  # weight-0 clients are never drawn
    # Every slot, repeated clients included, has its own key.
    bits = key_bits(cohort.keys)
    assert len({tuple(b) for b in bits}) == cohort.size

    per_client_input = jnp.arange(5, dtype=jnp.float32) * 10.0 + 1.0
    inputs = take(cohort, per_client_input)
    np.testing.assert_array_equal(np.asarray(inputs), np.asarray(per_client_input)[ids])
    want_sums, want_out = loop_over_slots(data, cohort, np.asarray(inputs))

    results = {}
    for chunk in (None, 2):
        sums, out = cohort_sums(noisy_sum_step, planned(data, client_chunk=chunk), cohort,
                                inputs=inputs)
        chex.assert_shape(out["out"], (cohort.size,))
        where = f"{kind}, client_chunk={chunk}"
        np.testing.assert_array_equal(np.asarray(out["active"]), want_out["active"],
                                      err_msg=where)
        np.testing.assert_array_equal(np.asarray(out["active"]), n[ids] > 0, err_msg=where)
        np.testing.assert_allclose(np.asarray(out["out"]), want_out["out"], rtol=1e-5,
                                   atol=1e-5, err_msg=where)
        np.testing.assert_array_equal(np.asarray(out["inputs"]), want_out["inputs"],
                                      err_msg=where)
        for name, value in want_sums.items():
            np.testing.assert_allclose(float(sums[name]), value, rtol=1e-5, atol=1e-5,
                                       err_msg=f"{where}: {name}")
        results[chunk] = (sums, out)
    # Chunks of 2 pad the last chunk (5, 3 and 7 slots); the padding slot copies a
    # real client, so counting it would change "active" and "weight" above.
    chex.assert_trees_all_close(results[2], results[None], rtol=1e-6, atol=1e-6)


def test_weighted_cohort_repeats_get_different_keys_and_outputs(garbage_ragged):
    data = garbage_ragged
    cohort = weighted_cohort_with_repeat(data)
    _, out = cohort_sums(noisy_sum_step, data, cohort, inputs=jnp.zeros(cohort.size))
    ids = np.asarray(cohort.ids)
    n = np.asarray(data.num_examples)
    bits = key_bits(cohort.keys)
    repeated = [i for i in np.unique(ids) if n[i] > 0 and (ids == i).sum() >= 2]
    assert repeated
    for i in repeated:
        slots = np.flatnonzero(ids == i)
        assert (bits[slots[0]] != bits[slots[1]]).any(), f"client {i}: one key for two slots"
        outs = np.asarray(out["out"])[slots]
        assert abs(outs[0] - outs[1]) > 1e-6, f"client {i}: two slots gave one output {outs}"
    empty = np.flatnonzero(ids == 2)
    assert empty.size and not np.asarray(out["active"])[empty].any()


def test_take_put_round_trip():
    per_client = (jnp.arange(5, dtype=jnp.float32), jnp.arange(10, dtype=jnp.int32).reshape(5, 2))
    everyone = sample_cohort(jax.random.key(0), 5, 5)
    assert take(everyone, per_client) is per_client
    assert put(everyone, per_client, "values") == "values"

    cohort = sample_cohort(jax.random.key(1), 5, 3)
    ids = np.asarray(cohort.ids)
    rows = take(cohort, per_client)
    for slot, i in enumerate(ids):  # take: slot s holds client ids[s]
        np.testing.assert_array_equal(np.asarray(rows[0][slot]), np.asarray(per_client[0][i]))
        np.testing.assert_array_equal(np.asarray(rows[1][slot]), np.asarray(per_client[1][i]))
    chex.assert_trees_all_equal(put(cohort, per_client, rows), per_client)

    values = (-1.0 - jnp.arange(3, dtype=jnp.float32), -jnp.ones((3, 2), jnp.int32))
    written = put(cohort, per_client, values)
    want = [np.array(a) for a in per_client]
    for slot, i in enumerate(ids):
        want[0][i] = np.asarray(values[0])[slot]
        want[1][i] = np.asarray(values[1])[slot]
    np.testing.assert_array_equal(np.asarray(written[0]), want[0])
    np.testing.assert_array_equal(np.asarray(written[1]), want[1])
    chex.assert_trees_all_equal(take(cohort, written), values)


def test_put_with_a_repeated_client_writes_one_of_its_slots(garbage_ragged):
    # JAX leaves the order of duplicate scatter updates implementation-defined,
    # so only "one of its slots" is asserted (see the report on `put`'s docstring).
    cohort = weighted_cohort_with_repeat(garbage_ragged)
    ids = np.asarray(cohort.ids)
    values = jnp.arange(cohort.size, dtype=jnp.float32) + 100.0
    written = np.asarray(put(cohort, jnp.zeros(5), values))
    for i in range(5):
        slots = np.flatnonzero(ids == i)
        if slots.size:
            assert written[i] in (slots + 100.0), (i, written[i], slots)
        else:
            assert written[i] == 0.0


# --------------------------------------------------------------------------------------
# 2. Pytree client data and ServerData through a round (and sharded on 4 devices)
# --------------------------------------------------------------------------------------


def two_leaf_model() -> Model:
    """ŷ = x["a"]·w1 + x["b"]·w2 with squared error: apply reads both feature leaves."""

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w1": jax.random.normal(k1, (2,)), "w2": jax.random.normal(k2, (3,))}

    def apply(params, x):
        return x["a"] @ params["w1"] + x["b"] @ params["w2"]

    return Model(init, apply, squared_error)


def two_leaf_inputs(seed: int = 0):
    """(FederatedData with x = {"a": [8, 3, 2], "b": [8, 3, 3]}, ServerData of 8 rows)."""
    rng = np.random.default_rng(seed)
    m, n = 8, 3
    counts = np.array([3, 1, 0, 2, 3, 3, 1, 2], np.int32)
    a = rng.normal(size=(m, n, 2)).astype(np.float32)
    b = rng.normal(size=(m, n, 3)).astype(np.float32)
    w1, w2 = np.array([1.0, -2.0], np.float32), np.array([0.5, 0.0, -1.0], np.float32)
    y = (a @ w1 + b @ w2 + 0.1 * rng.normal(size=(m, n))).astype(np.float32)
    padding = np.arange(n)[None, :] >= counts[:, None]
    a[padding], b[padding], y[padding] = GARBAGE, -GARBAGE, 3 * GARBAGE
    data = FederatedData.from_arrays({"a": a, "b": b}, y, counts)
    server = ServerData(arrays={
        # As many rows as there are clients: only the type says this is not client data.
        "x": {"a": jnp.asarray(rng.normal(size=(8, 2)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(8, 3)), jnp.float32)},
        "y": jnp.asarray(rng.normal(size=(8,)), jnp.float32),
    })
    return data, server


class ToyState(NamedTuple):
    params: dict  # {"w1": [2], "w2": [3]}
    round: jax.Array  # int32


def fedavg_with_server_step(model, *, learning_rate, server_rate, local_steps, cohort,
                            batch_size=None) -> Algorithm:
    """A toy algorithm on (FederatedData, ServerData): FedAvg on a cohort, then a server step.

    Clients run `local_steps` SGD steps from the global model; the new model is
    their example-weighted mean, followed by one gradient step on the server's
    mean squared error. The cohort is processed in chunks of the client data's
    execution plan (`planned(inputs, client_chunk=...)`).
    """
    opt = optax.sgd(learning_rate)

    def server_loss(params, server):
        x, y = server.arrays["x"], server.arrays["y"]
        return jnp.mean(squared_error(model.apply(params, x), y))

    def init(key, inputs):
        return ToyState(model.init(key), jnp.zeros((), jnp.int32))

    def round_(state, inputs, key):
        data, server = inputs
        members = sample_cohort(key, data.num_clients, cohort)

        def client_step(batch):
            start = broadcast_to_clients(state.params, batch.keys.shape[0])
            trained, _, losses = local_update(model, opt, start, batch.data, batch.keys,
                                              num_steps=local_steps, batch_size=batch_size)
            w = jnp.where(batch.active, batch.data.num_examples, 0).astype(jnp.float32)
            total = jax.tree.map(lambda t: jnp.tensordot(w, t, axes=1), trained)
            return (total, jnp.sum(w)), losses[:, 0]

        (total, weight), _ = cohort_sums(client_step, data, members)
        params = jax.tree.map(lambda t, p: jnp.where(weight > 0, t / jnp.maximum(weight, 1e-30), p),
                              total, state.params)
        grads = jax.grad(server_loss)(params, server)
        params = jax.tree.map(lambda p, g: p - server_rate * g, params, grads)
        return ToyState(params, state.round + 1), {"server_loss": server_loss(params, server)}

    def evaluate(state, inputs):
        data, _ = inputs
        losses = jax.vmap(lambda x, y, n: client_loss(model, state.params, x, y, n))(
            data.x, data.y, data.num_examples)
        active = data.active()
        return {"client_loss": losses, "assignment": jnp.where(active, 0, -1),
                "client_weight": active.astype(jnp.float32)}

    return Algorithm(init, round_, evaluate)


def loop_toy_round(params, data, server, ids, *, learning_rate, server_rate, local_steps):
    """`fedavg_with_server_step`'s full-batch round, client by client, in float64 numpy."""
    a, b = np.asarray(data.x["a"], np.float64), np.asarray(data.x["b"], np.float64)
    y, n = np.asarray(data.y, np.float64), np.asarray(data.num_examples)
    w1, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "w2"))
    totals, weight = [np.zeros(2), np.zeros(3)], 0.0
    for i in ids:
        if n[i] == 0:
            continue
        ai, bi, yi = a[i, : n[i]], b[i, : n[i]], y[i, : n[i]]
        v1, v2 = w1.copy(), w2.copy()
        for _ in range(local_steps):
            r = ai @ v1 + bi @ v2 - yi
            step = learning_rate * 2 / n[i]
            v1, v2 = v1 - step * ai.T @ r, v2 - step * bi.T @ r
        totals[0] += n[i] * v1
        totals[1] += n[i] * v2
        weight += n[i]
    if weight > 0:
        w1, w2 = totals[0] / weight, totals[1] / weight
    sa, sb = (np.asarray(server.arrays["x"][k], np.float64) for k in ("a", "b"))
    sy = np.asarray(server.arrays["y"], np.float64)
    r = sa @ w1 + sb @ w2 - sy
    w1, w2 = w1 - server_rate * 2 / len(sy) * sa.T @ r, w2 - server_rate * 2 / len(sy) * sb.T @ r
    return {"w1": w1, "w2": w2}


@pytest.mark.parametrize(("cohort", "client_chunk"), [(8, None), (5, 2)])
def test_pytree_round_with_server_data_equals_loop(cohort, client_chunk):
    data, server = two_leaf_inputs()
    settings = {"learning_rate": 0.1, "server_rate": 0.05, "local_steps": 2}
    algorithm = fedavg_with_server_step(two_leaf_model(), cohort=cohort, **settings)
    inputs = planned((data, server), client_chunk=client_chunk)
    state = algorithm.init(jax.random.key(0), inputs)
    key = jax.random.key(5)
    new, metrics = jax.jit(algorithm.round)(state, inputs, key)
    ids = np.asarray(sample_cohort(key, 8, cohort).ids)
    want = loop_toy_round(state.params, data, server, ids, **settings)
    chex.assert_trees_all_close(jax.tree.map(np.asarray, new.params), want, rtol=1e-5,
                                atol=1e-5)
    assert int(new.round) == 1 and np.isfinite(float(metrics["server_loss"]))


SHARDED_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from fedjax_sim import parallel, simulate
    from fedjax_sim.execution import Execution, planned
    from test_engine import fedavg_with_server_step, two_leaf_inputs, two_leaf_model

    assert jax.device_count() == 4
    data, server = two_leaf_inputs()
    inputs = (data, server)
    mesh = parallel.make_mesh(4)
    specs = parallel.input_shardings(inputs, mesh)
    placed = parallel.place_inputs(inputs, mesh)
    out = {
        "client_specs": [str(s.spec) for s in jax.tree.leaves(specs[0])],
        "server_specs": [str(s.spec) for s in jax.tree.leaves(specs[1])],
        "client_placed": [str(a.sharding.spec) for a in jax.tree.leaves(placed[0])],
        "server_replicated": [a.sharding.is_fully_replicated for a in jax.tree.leaves(placed[1])],
        "client_leaves": len(jax.tree.leaves(data)),
        "runs": {},
    }
    model = two_leaf_model()
    for cohort, chunk in ((8, 2), (5, 2)):  # strided chunks; a sampled cohort, padded
        algorithm = fedavg_with_server_step(
            model, learning_rate=0.1, server_rate=0.05, local_steps=2, batch_size=2,
            cohort=cohort)
        chunked = planned(inputs, client_chunk=chunk)
        for name, m in (("one", None), ("four", mesh)):
            state, history = simulate.run(algorithm, chunked, jax.random.key(3), rounds=3,
                                          eval_every=3,
                                          execution=Execution(progress=False, mesh=m))
            out["runs"][f"{cohort}/{chunk}/{name}"] = {
                "params": {k: np.asarray(v).tolist() for k, v in state.params.items()},
                "history": history,
            }
    print("RESULT" + json.dumps(out))
    """
)


@pytest.mark.slow
def test_pytree_and_server_data_sharded_on_four_devices_equal_unsharded():
    proc = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], capture_output=True,
                          text=True, env=subprocess_env(4), timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    # FederatedData (x["a"], x["b"], y, num_examples, cluster) over clients; ServerData
    # replicated even though its arrays have 8 rows, like the clients.
    assert out["client_leaves"] == 5
    assert out["client_specs"] == [str(P("clients"))] * 5
    assert out["client_placed"] == [str(P("clients"))] * 5
    assert out["server_specs"] == [str(P())] * 3
    assert out["server_replicated"] == [True] * 3
    runs = out["runs"]
    for setting in ("8/2", "5/2"):
        one, four = runs[f"{setting}/one"], runs[f"{setting}/four"]
        for leaf in ("w1", "w2"):
            np.testing.assert_allclose(four["params"][leaf], one["params"][leaf], rtol=1e-5,
                                       atol=1e-5, err_msg=f"{setting}: {leaf}")
        assert [r["round"] for r in one["history"]] == [0, 3]
        for row_one, row_four in zip(one["history"], four["history"], strict=True):
            assert row_one.keys() == row_four.keys()
            for name in row_one:
                np.testing.assert_allclose(row_four[name], row_one[name], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{setting}: {name}")
    # The settings train differently (a check that the runs are not all the same).
    assert runs["8/2/one"]["params"] != runs["5/2/one"]["params"]


# --------------------------------------------------------------------------------------
# 3. IFCA weight sharing
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def classification():
    """5 clients (4, 1, 0, 3, 2 rows) of 4 features, integer labels in [0, 3), garbage padding."""
    rng = np.random.default_rng(1)
    xs = [rng.normal(size=(c, 4)).astype(np.float32) for c in RAGGED_SIZES]
    ys = [rng.integers(0, 3, size=c).astype(np.int32) for c in RAGGED_SIZES]
    data = FederatedData.from_clients(xs, ys)
    real = np.asarray(data.mask()) > 0
    x, y = np.array(data.x), np.array(data.y)
    x[~real], y[~real] = GARBAGE, 2
    return FederatedData.from_arrays(x, y, np.asarray(data.num_examples))


@pytest.fixture(scope="module")
def split_mlp():
    return mlp_classifier((4,), [8], 3, split=True)


def real_rows(data, i):
    n = int(np.asarray(data.num_examples)[i])
    return np.asarray(data.x)[i, :n], np.asarray(data.y)[i, :n]  # numpy: no per-row compiles


@functools.cache  # one pair of jitted functions per model: compiled once per client size
def unpadded_loss(model):
    """(loss, its gradient) of one client's rows, no mask: the mean over every row given."""

    def loss(params, x, y):
        return jnp.mean(model.example_loss(model.apply(params, x), y))

    return jax.jit(loss), jax.jit(jax.grad(loss))


def loop_weight_sharing_round(model, shared, heads, data, *, lr, steps):
    """IFCA option II with weight sharing, client by client on unpadded rows (uniform weights)."""

    loss, grad = unpadded_loss(model)
    # Host (numpy) arithmetic between the jitted loss and gradient calls.
    shared, heads = (jax.tree.map(np.asarray, t) for t in (shared, heads))
    k = jax.tree.leaves(heads)[0].shape[0]
    trunks, members = [], [[] for _ in range(k)]
    for i in range(data.num_clients):
        if int(np.asarray(data.num_examples)[i]) == 0:
            continue
        x, y = real_rows(data, i)
        head_of = [jax.tree.map(lambda h, j=j: h[j], heads) for j in range(k)]
        j = int(np.argmin([float(loss(combine(model, shared, h), x, y)) for h in head_of]))
        params = combine(model, shared, head_of[j])
        for _ in range(steps):
            grads = grad(params, x, y)
            params = jax.tree.map(lambda p, g: p - lr * np.asarray(g), params, grads)
        trunks.append(params["trunk"])
        members[j].append(params["head"])
    new_shared = jax.tree.map(lambda *t: np.mean(np.stack(t), axis=0), *trunks)
    new_heads = [
        jax.tree.map(lambda *h: np.mean(np.stack(h), axis=0), *members[j]) if members[j]
        else jax.tree.map(lambda h, j=j: np.asarray(h[j]), heads)
        for j in range(k)
    ]
    return new_shared, jax.tree.map(lambda *h: np.stack(h), *new_heads)


def test_ifca_weight_sharing_round_equals_loop(split_mlp, classification):
    model, data = split_mlp, classification
    algorithm = with_weight_sharing(
        ifca(model, sgd(0.1, steps=2), num_clusters=2, option="model"), model)
    state = jax.jit(algorithm.init)(jax.random.key(0), data)
    new, metrics = jax.jit(algorithm.round)(state, data, jax.random.key(1))

    one = jax.eval_shape(model.init, jax.random.key(9))
    chex.assert_trees_all_equal_shapes(new.shared_params, one["trunk"])  # no cluster axis
    chex.assert_trees_all_equal_shapes(
        new.cluster_params, jax.tree.map(lambda h: jnp.zeros((2, *h.shape)), one["head"]))
    assert any(not np.allclose(h[0], h[1]) for h in jax.tree.leaves(new.cluster_params))

    want_shared, want_heads = loop_weight_sharing_round(
        model, state.shared_params, state.cluster_params, data, lr=0.1, steps=2)
    chex.assert_trees_all_close(new.shared_params, want_shared, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(new.cluster_params, want_heads, rtol=1e-5, atol=1e-5)
    assert np.asarray(new.assignment)[2] == -1
    assert float(np.sum(metrics["cluster_sizes"])) == 4

    # Each cluster's full model: the shared trunk with its own head.
    shared, heads = (jax.tree.map(np.asarray, t) for t in (new.shared_params,
                                                            new.cluster_params))
    full = [combine(model, shared, jax.tree.map(lambda h, j=j: h[j], heads)) for j in range(2)]
    chex.assert_trees_all_equal(full[0]["trunk"], full[1]["trunk"])
    evaluation = jax.tree.map(np.asarray, jax.jit(algorithm.evaluate)(new, data))
    loss, _ = unpadded_loss(model)
    for i in range(data.num_clients):
        if int(np.asarray(data.num_examples)[i]) == 0:
            assert int(evaluation["assignment"][i]) == -1
            continue
        x, y = real_rows(data, i)
        losses = [float(loss(p, x, y)) for p in full]
        assert int(evaluation["assignment"][i]) == int(np.argmin(losses))
        np.testing.assert_allclose(float(evaluation["client_loss"][i]), min(losses), rtol=1e-5)


def test_ifca_weight_sharing_with_one_cluster_equals_fedavg(split_mlp, classification):
    model, data = split_mlp, classification
    start = jax.jit(model.init)(jax.random.key(4))
    training = sgd(0.1, steps=2, batch_size=2)
    shared_ws = with_weight_sharing(
        with_initial_params(ifca(model, training, num_clusters=1, option="model"),
                            lambda _: jax.tree.map(lambda p: p[None], start)),
        model)
    baseline = fedavg(model, training)
    round_key = jax.random.key(8)
    state_ws = jax.jit(shared_ws.init)(jax.random.key(4), data)
    state_fa = jax.jit(baseline.init)(jax.random.key(4), data)
    chex.assert_trees_all_equal(state_fa.params, start)
    state_ws, _ = simulate.scan_rounds(shared_ws, state_ws, data, round_key, 0, 3)
    state_fa, _ = simulate.scan_rounds(baseline, state_fa, data, round_key, 0, 3)
    whole = combine(model, state_ws.shared_params,
                    jax.tree.map(lambda h: h[0], state_ws.cluster_params))
    chex.assert_trees_all_close(whole, state_fa.params, rtol=1e-5, atol=1e-5)
    assert not np.allclose(state_fa.params["head"]["kernel"], start["head"]["kernel"])


# --------------------------------------------------------------------------------------
# 4. with_seeds == seed-by-seed runs
# --------------------------------------------------------------------------------------

SEEDS = 3
ROUNDS = 3


@pytest.fixture(scope="module")
def seeded_setup():
    federations = [ragged_federation(s) for s in range(SEEDS)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *federations)
    # Minibatches and a sampled cohort, so every key matters.
    algorithm = fedavg(linear_regression(3), sgd(0.1, steps=2, batch_size=2),
                       participation=0.6)
    return algorithm, federations, stacked, jax.jit(algorithm.round)


def loop_seed(algorithm, round_, data, key_init, round_key, s, *, seed_last=True):
    """Seed s by hand: init with fold_in(key_init, s), round t with fold_in(round t's key, s).

    seed_last=False keys round t as a plain `scan_rounds` with round key
    fold_in(round_key, s) would: fold_in(fold_in(round_key, s), t).
    """
    state = algorithm.init(jax.random.fold_in(key_init, s), data)
    losses = []
    for t in range(ROUNDS):
        if seed_last:
            key_t = jax.random.fold_in(jax.random.fold_in(round_key, t), s)
        else:
            key_t = jax.random.fold_in(jax.random.fold_in(round_key, s), t)
        state, metrics = round_(state, data, key_t)
        losses.append(float(metrics["cohort_loss"]))
    return state, np.array(losses)


@pytest.mark.parametrize("shared_data", [False, True])
def test_with_seeds_equals_seed_by_seed_runs(seeded_setup, shared_data):
    algorithm, federations, stacked, round_ = seeded_setup
    key_init, round_key = jax.random.key(10), jax.random.key(11)
    seeded = with_seeds(algorithm, SEEDS, shared_data=shared_data)
    inputs = federations[0] if shared_data else stacked
    state = seeded.init(key_init, inputs)
    state, metrics = simulate.scan_rounds(seeded, state, inputs, round_key, 0, ROUNDS)
    chex.assert_shape(metrics["cohort_loss"], (ROUNDS, SEEDS))
    finals = []
    for s in range(SEEDS):
        data_s = federations[0] if shared_data else federations[s]
        want, want_losses = loop_seed(algorithm, round_, data_s, key_init, round_key, s)
        chex.assert_trees_all_close(jax.tree.map(lambda a, s=s: a[s], state), want,
                                    rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(metrics["cohort_loss"][:, s]), want_losses,
                                   rtol=1e-6, atol=1e-6)
        finals.append(np.asarray(want.params))
    assert not np.allclose(finals[0], finals[1])  # the seeds really differ


def test_run_history_keeps_each_copys_round_metrics_with_columns_from_round_0(tmp_path,
                                                                               garbage_ragged):
    """With a copies axis a history row keeps the scalar round metrics per copy; round 0
    declares them (NaN), so metrics.csv takes every later row."""
    from fedjax_sim.logs import MetricsCSV

    data = garbage_ragged
    copies, k, d = 3, 2, 3
    algorithm = with_seeds(ifca(linear_regression(d), sgd(0.1, steps=2), num_clusters=k,
                                option="model"), copies, shared_data=True)
    csv = MetricsCSV(tmp_path / "metrics.csv")
    rows = []

    def on_rows(new):
        rows.extend(new)
        csv.append([{"round": r["round"], "copy": c,
                     **{n: float(np.asarray(v).reshape(-1)[c]) if np.ndim(v) else float(v)
                        for n, v in r.items() if n != "round"}}
                    for r in new for c in range(copies)])

    _, history = simulate.run(algorithm, data, jax.random.key(0), rounds=4, eval_every=2,
                              execution=Execution(progress=False, copies=1, on_rows=on_rows))
    assert [r["round"] for r in history] == [0, 2, 4] and rows == history
    assert np.isnan(history[0]["downlink_floats"]).all()
    for row in history[1:]:
        # The 4 clients holding data download the k models of d floats; the empty one nothing.
        np.testing.assert_array_equal(row["downlink_floats"], np.full(copies, 4 * k * d))
        chex.assert_shape(row["frozen_clients"], (copies,))
    assert "cluster_sizes" not in history[-1]  # a vector per round: not a history column
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 1 + 3 * copies


# --------------------------------------------------------------------------------------
# 5. Empty clients
# --------------------------------------------------------------------------------------


def loop_ifca_model_round(thetas, data, ref, *, lr, steps):
    """IFCA option II (uniform weights, full batch), client by client in float64."""
    x, y, n = np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)
    k = thetas.shape[0]
    assignment = np.full(data.num_clients, -1)
    members = [[] for _ in range(k)]
    chosen_losses = []
    for i in range(data.num_clients):
        if n[i] == 0:
            continue
        losses = [ref.loss(thetas[j], x[i], y[i], n[i]) for j in range(k)]
        j = int(np.argmin(losses))
        assignment[i] = j
        chosen_losses.append(losses[j])
        theta = np.asarray(thetas[j], np.float64)
        for _ in range(steps):
            theta = theta - lr * ref.grad(theta, x[i], y[i], n[i])
        members[j].append(theta)
    new = np.stack([np.mean(members[j], axis=0) if members[j] else np.asarray(thetas[j])
                    for j in range(k)])
    sizes = np.array([len(mj) for mj in members], np.float64)
    return new, assignment, sizes, float(np.mean(chosen_losses))


@pytest.mark.parametrize("client_chunk", [None, 2])
@pytest.mark.parametrize("far", [False, True], ids=["two-clusters", "one-empty-cluster"])
def test_ifca_model_averaging_leaves_the_empty_client_out(garbage_ragged, ref, far, client_chunk):
    data = planned(garbage_ragged, client_chunk=client_chunk)  # rounds and evaluation
    thetas = np.array([[1.0, 0.0, -1.0], [1e3, 1e3, 1e3] if far else [-1.0, 1.0, 0.5]],
                      np.float32)
    algorithm = with_initial_params(
        ifca(linear_regression(3), sgd(0.1, steps=2), num_clusters=2, option="model",
             weighting="uniform"),
        lambda _: jnp.asarray(thetas))
    state = algorithm.init(jax.random.key(0), data)
    new, metrics = jax.jit(algorithm.round)(state, data, jax.random.key(1))
    want, want_assignment, want_sizes, want_loss = loop_ifca_model_round(
        thetas, data, ref, lr=0.1, steps=2)
    assert int(new.assignment[2]) == -1
    np.testing.assert_array_equal(np.asarray(new.assignment), want_assignment)
    np.testing.assert_array_equal(np.asarray(metrics["cluster_sizes"]), want_sizes)
    assert float(np.sum(metrics["cluster_sizes"])) == 4  # the non-empty clients
    if far:
        assert want_sizes[1] == 0
        np.testing.assert_array_equal(np.asarray(new.cluster_params[1]), thetas[1])
    else:
        assert (want_sizes > 0).all()
    np.testing.assert_allclose(np.asarray(new.cluster_params), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(metrics["cohort_loss"]), want_loss, rtol=1e-5)

    evaluation = algorithm.evaluate(new, data)
    np.testing.assert_array_equal(np.asarray(evaluation["client_weight"]), [1, 1, 0, 1, 1])
    summary = summarize_clients(evaluation)
    losses = np.asarray(evaluation["client_loss"], np.float64)[[0, 1, 3, 4]]
    np.testing.assert_allclose(summary["loss"], losses.mean(), rtol=1e-6)
    np.testing.assert_allclose(summary["loss_worst"], losses.max(), rtol=1e-6)


def test_summarize_clients_leaves_weight_zero_clients_out():
    evaluation = {
        "client_loss": np.array([1.0, 4.0, np.nan, 2.0, 1e9]),
        "client_weight": np.array([1.0, 3.0, 0.0, 2.0, 0.0]),
        "client_accuracy": np.array([0.5, 1.0, np.nan, 0.25, -5.0]),
    }
    summary = summarize_clients(evaluation, prefix="test_")
    np.testing.assert_allclose(summary["test_loss"], (1 + 12 + 4) / 6)
    assert summary["test_loss_worst"] == 4.0
    np.testing.assert_allclose(summary["test_accuracy"], (0.5 + 3 + 0.5) / 6)
    assert summary["test_accuracy_worst"] == 0.25
    # Per copy (a leading restarts axis): each row on its own.
    stacked = {name: np.stack([v, v[::-1]]) for name, v in evaluation.items()}
    rows = summarize_clients(stacked)
    np.testing.assert_allclose(rows["loss"], [(1 + 12 + 4) / 6] * 2)
    np.testing.assert_array_equal(rows["loss_worst"], [4.0, 4.0])


# --------------------------------------------------------------------------------------
# 6. One-shot clustering evaluates with its fixed clusters
# --------------------------------------------------------------------------------------


def test_one_shot_evaluates_with_its_kmeans_clusters(garbage_ragged, ref):
    data = garbage_ragged
    algorithm = one_shot_clustering(linear_regression(3), sgd(0.1), num_clusters=2,
                                    pretraining=sgd(0.1, steps=5), kmeans_restarts=2)
    state = algorithm.init(jax.random.key(2), data)
    assignment = np.asarray(state.assignment)
    assert assignment[2] == -1 and (assignment[[0, 1, 3, 4]] >= 0).all()
    # Client 0's own cluster gets a model far from every client, the other a plain one,
    # so the lowest-loss model is not client 0's cluster.
    own = assignment[0]
    thetas = np.zeros((2, 3), np.float32)
    thetas[own] = 100.0
    state = state._replace(cluster_params=jnp.asarray(thetas))
    evaluation = algorithm.evaluate(state, data)
    x, y, n = np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)
    argmin = [int(np.argmin([ref.loss(t, x[i], y[i], n[i]) for t in thetas])) for i in range(5)]
    assert argmin[0] != own
    np.testing.assert_array_equal(np.asarray(evaluation["assignment"]), assignment)
    np.testing.assert_array_equal(np.asarray(evaluation["client_weight"]), n.astype(np.float32))
    for i in range(5):
        if n[i]:
            np.testing.assert_allclose(float(evaluation["client_loss"][i]),
                                       ref.loss(thetas[assignment[i]], x[i], y[i], n[i]),
                                       rtol=1e-5)
    # Training keeps the clusters too.
    new, _ = jax.jit(algorithm.round)(state, data, jax.random.key(3))
    np.testing.assert_array_equal(np.asarray(new.assignment), assignment)


# --------------------------------------------------------------------------------------
# 7. Eager argument checks
# --------------------------------------------------------------------------------------


def test_python_api_errors_name_the_argument(garbage_ragged):
    with pytest.raises(ValueError, match=r"\bk must be"):
        linear_mixture(jax.random.key(0), k=0, m=4, n=5, d=3, sigma=0.1, R=1.0)
    wide = FederatedData.from_arrays(np.zeros((2, 3, 4), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"data\.x"):
        ifca(linear_regression(3), sgd(0.1), num_clusters=2).init(jax.random.key(0), wide)
    column = FederatedData.from_arrays(np.zeros((2, 3, 3), np.float32),
                                       np.zeros((2, 3, 1), np.float32))
    with pytest.raises(ValueError, match=r"data\.y"):
        fedavg(linear_regression(3), sgd(0.1)).init(jax.random.key(0), column)
    # The learning rate is the training's, checked where it is built (was: by every factory).
    with pytest.raises(ValueError, match="learning_rate"):
        sgd(float("inf"))
    # Option I takes one full-batch gradient per client: local steps are refused.
    with pytest.raises(ValueError, match="steps=1"):
        ifca(linear_regression(3), sgd(0.1, steps=3), num_clusters=2, option="gradient")


# --------------------------------------------------------------------------------------
# 8. No recompilation
# --------------------------------------------------------------------------------------


def test_scan_rounds_traces_once(garbage_ragged):
    data = garbage_ragged
    inner = ifca(linear_regression(3), sgd(0.1, steps=2, batch_size=2), num_clusters=2,
                 option="model", participation=0.6)
    traces = []

    def counted_round(state, data, key):
        traces.append(1)
        return inner.round(state, data, key)

    algorithm = inner._replace(round=counted_round)
    state = algorithm.init(jax.random.key(0), data)
    first, _ = simulate.scan_rounds(algorithm, state, data, jax.random.key(1), 0, 2)
    second, _ = simulate.scan_rounds(algorithm, first, data, jax.random.key(2), 2, 2)
    assert len(traces) == 1
    assert not np.allclose(first.cluster_params, second.cluster_params)
    # simulate.run compiles one chunk length once, however many chunks it runs.
    traces.clear()
    simulate.run(algorithm, data, jax.random.key(3), rounds=9, eval_every=3,
                 execution=Execution(progress=False))
    assert len(traces) == 1
