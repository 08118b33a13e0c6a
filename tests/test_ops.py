"""The vectorized kernels against plain per-client loops written here, plus their invariants.

Every reference below is a Python loop over clients (numpy, float64) or, where
the kernel's randomness has to be reproduced, per-client calls of the one-client
function with the same key. The ragged fixture always holds a one-example client
and an empty client.
"""

from __future__ import annotations

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedjax_sim.data import FederatedData
from fedjax_sim.models import Model, mlp_classifier
from fedjax_sim.ops import (
    assign_clusters,
    client_keys,
    cluster_gradient_sums,
    cluster_losses,
    kmeans,
    local_update,
    mixup,
    mixup_client,
    project_simplex,
    sample_batch,
    sample_uniform,
    sample_weighted,
    segment_average,
)

RTOL = 1e-5
ATOL = 1e-5


def _cluster_params(k, d, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(k, d)), jnp.float32)


# --------------------------------------------------------------------------- cluster_losses


@pytest.mark.parametrize("k", [1, 3])
def test_cluster_losses_equals_per_client_loop(ragged, linear_model, ref, k):
    params = _cluster_params(k, ragged.x.shape[-1])
    got = cluster_losses(linear_model, params, ragged)
    chex.assert_shape(got, (ragged.num_clients, k))

    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)
    want = np.zeros((ragged.num_clients, k))
    for i in range(ragged.num_clients):
        for j in range(k):
            want[i, j] = ref.loss(params[j], x[i], y[i], n[i])
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    # The empty client has loss 0 for every cluster (masked mean of nothing).
    np.testing.assert_array_equal(np.asarray(got)[n == 0], 0.0)



def test_cluster_losses_vmapped_over_copies_equals_per_copy_loop(ragged, linear_model, ref):
    """The linear losses under vmap (its own batching rule): over restarts (models batched,
    one set of clients), over seeds (models and clients batched) and both nested, each
    against a loop over copies and clients of the reference loss."""
    k, d, copies = 3, ragged.x.shape[-1], 4
    params = jnp.stack([_cluster_params(k, d, seed=s) for s in range(copies)])  # [4, k, d]
    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)

    def loop(params_c, xs, ys, ns):
        return np.array([[ref.loss(params_c[j], xs[i], ys[i], ns[i]) for j in range(k)]
                         for i in range(len(xs))])

    def losses(p, data):
        return cluster_losses(linear_model, p, data)

    over_restarts = jax.jit(jax.vmap(losses, in_axes=(0, None)))(params, ragged)
    chex.assert_shape(over_restarts, (copies, ragged.num_clients, k))
    for c in range(copies):
        np.testing.assert_allclose(over_restarts[c], loop(params[c], x, y, n), rtol=RTOL,
                                   atol=ATOL)
    # Per-seed clients: the seed c's clients are the ragged ones with rows shifted by c.
    seeds = jax.tree.map(lambda *a: jnp.stack(a), *[
        FederatedData.from_arrays(x + c, y - c, n) for c in range(copies)])
    over_seeds = jax.jit(jax.vmap(losses))(params, seeds)
    for c in range(copies):
        np.testing.assert_allclose(over_seeds[c], loop(params[c], x + c, y - c, n), rtol=RTOL,
                                   atol=ATOL)
    nested = jax.jit(jax.vmap(jax.vmap(losses, in_axes=(0, None)), in_axes=(None, 0)))(
        params, seeds)  # [seeds, restarts, m, k]
    for seed in range(copies):
        for c in range(copies):
            np.testing.assert_allclose(nested[seed, c], loop(params[c], x + seed, y - seed, n),
                                       rtol=RTOL, atol=ATOL)


def _np_mlp_losses(params, x, labels):
    """Per-example cross-entropy of the flax MLP (Dense-ReLU-Dense), in numpy float64."""
    h = np.asarray(x, np.float64).reshape(len(x), -1)
    layers = sorted(params)  # Dense_0, Dense_1
    for name in layers:
        h = h @ np.asarray(params[name]["kernel"], np.float64) + np.asarray(
            params[name]["bias"], np.float64
        )
        if name != layers[-1]:
            h = np.maximum(h, 0.0)
    top = h.max(axis=1, keepdims=True)
    lse = np.log(np.exp(h - top).sum(axis=1)) + top[:, 0]
    return lse - h[np.arange(len(h)), labels]


def test_cluster_losses_flax_model_ignores_padding():
    """A pytree-params model: each loss is the mean loss over the client's unpadded rows."""
    rng = np.random.default_rng(3)
    sizes = [3, 1, 0, 2]
    xs = [rng.normal(size=(s, 2, 2)).astype(np.float32) for s in sizes]
    ys = [rng.integers(0, 3, size=s).astype(np.int32) for s in sizes]
    data = FederatedData.from_clients(xs, ys)
    model = mlp_classifier((2, 2), hidden=(5,), num_classes=3)
    # Random params of the module's structure, two clusters (leaves [2, ...]).
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    params = jax.tree.map(
        lambda a: jnp.asarray(rng.normal(size=(2, *a.shape)), jnp.float32), shapes
    )
    got = np.asarray(cluster_losses(model, params, data))
    chex.assert_shape(got, (4, 2))
    for i, s in enumerate(sizes):
        for j in range(2):
            p = jax.tree.map(lambda a, j=j: np.asarray(a[j]), params)
            want = 0.0 if s == 0 else np.mean(_np_mlp_losses(p, xs[i], ys[i]))
            np.testing.assert_allclose(got[i, j], want, rtol=1e-4, atol=1e-5)


def _without_fused(model: Model) -> Model:
    """The same model without its declared structure: the generic vmap/VJP path."""
    return model._replace(structure=None)


def test_linear_model_declares_its_fused_structure(linear_model):
    # Otherwise the tests below would compare the generic path with itself.
    assert linear_model.structure == "linear"
    assert _without_fused(linear_model).structure is None


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "generic"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_cluster_gradient_sums_equals_per_client_loop(ragged, linear_model, ref, k, fused):
    """losses, argmin assignment and Σ_{i→j} w_i ∇F_i(θ_j), with a left-out client (w = 0)."""
    model = linear_model if fused else _without_fused(linear_model)
    params = _cluster_params(k, ragged.x.shape[-1], seed=k)
    weights = jnp.asarray([1.0, 2.0, 1.0, 0.0, 0.5][: ragged.num_clients], jnp.float32)
    losses, assignment, sums = jax.jit(
        lambda p, d, w: cluster_gradient_sums(model, p, d, weights=w)
    )(params, ragged, weights)
    m, d = ragged.num_clients, ragged.x.shape[-1]
    chex.assert_shape((losses, assignment, sums), ((m, k), (m,), (k, d)))

    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)
    want_sums = np.zeros((k, x.shape[-1]))
    for i in range(ragged.num_clients):
        row = [ref.loss(params[j], x[i], y[i], n[i]) for j in range(k)]
        np.testing.assert_allclose(losses[i], row, rtol=RTOL, atol=ATOL)
        j = int(np.argmin(row))
        assert int(assignment[i]) == j
        want_sums[j] += float(weights[i]) * ref.grad(params[j], x[i], y[i], n[i])
    np.testing.assert_allclose(sums, want_sums, rtol=1e-4, atol=1e-5)


def test_cluster_gradient_sums_custom_choice_and_diverged_cluster(ragged, linear_model, ref):
    """`choose` decides the assignment; a NaN cluster nobody chose leaves the others finite."""
    d = ragged.x.shape[-1]
    params = _cluster_params(3, d).at[2].set(jnp.nan)
    forced = jnp.asarray([1, 0, 1, 0, 1][: ragged.num_clients], jnp.int32)
    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)
    want = np.zeros((3, d))
    for i in range(ragged.num_clients):
        want[int(forced[i])] += ref.grad(params[int(forced[i])], x[i], y[i], n[i])
    for model in (linear_model, _without_fused(linear_model)):
        losses, assignment, sums = cluster_gradient_sums(model, params, ragged, lambda _: forced)
        np.testing.assert_array_equal(assignment, forced)
        assert np.isnan(np.asarray(losses)[n > 0, 2]).all()
        np.testing.assert_allclose(np.asarray(sums)[:2], want[:2], rtol=1e-4, atol=1e-5)


def test_cluster_gradient_sums_fused_equals_generic_on_a_larger_problem():
    """The fused linear kernel against the generic VJP at a size with real reductions."""
    from fedjax_sim.data import linear_mixture
    from fedjax_sim.models import linear_regression

    data = linear_mixture(jax.random.key(3), k=4, m=64, n=7, d=12, sigma=0.3, R=0.5).train
    model = linear_regression(12)
    params = _cluster_params(4, 12, seed=9)
    fused = cluster_gradient_sums(model, params, data)
    generic = cluster_gradient_sums(_without_fused(model), params, data)
    np.testing.assert_allclose(fused[0], generic[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(fused[1], generic[1])
    np.testing.assert_allclose(fused[2], generic[2], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        cluster_losses(model, params, data), cluster_losses(_without_fused(model), params, data),
        rtol=1e-5, atol=1e-6,
    )


# --------------------------------------------------------------------------- assign_clusters


def _argmin_loop(losses):
    out = []
    for row in np.asarray(losses, np.float64):
        best, best_j = np.inf, 0
        for j, v in enumerate(row):
            v = np.inf if np.isnan(v) else v
            if v < best:  # strict: a tie keeps the lower index
                best, best_j = v, j
        out.append(best_j)
    return np.array(out)


def test_assign_clusters_ties_and_nan():
    nan, inf = np.nan, np.inf
    losses = np.array(
        [
            [1.0, 0.5, 0.5],  # tie -> lower index
            [nan, 2.0, 2.0],  # NaN never wins; tie -> 1
            [nan, nan, nan],  # nothing finite -> 0
            [inf, nan, 3.0],  # NaN is +inf, not smaller than 3
            [0.0, 0.0, 0.0],
            [nan, -1.0, nan],
            [5.0, 4.0, nan],
        ],
        np.float32,
    )
    got = assign_clusters(jnp.asarray(losses))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, [1, 1, 0, 2, 0, 1, 1])
    np.testing.assert_array_equal(got, _argmin_loop(losses))


@pytest.mark.parametrize("k", [1, 4])
def test_assign_clusters_equals_loop_random(k):
    rng = np.random.default_rng(0)
    # Small integers make many ties; sprinkle NaNs.
    losses = rng.integers(0, 3, size=(200, k)).astype(np.float32)
    losses[rng.random(size=losses.shape) < 0.2] = np.nan
    got = assign_clusters(jnp.asarray(losses))
    chex.assert_shape(got, (200,))
    np.testing.assert_array_equal(got, _argmin_loop(losses))


# --------------------------------------------------------------------------- local_update


def _np_sgd(theta, x, y, n, lr, steps, ref, momentum=None):
    """τ full-batch (momentum) SGD steps in float64; returns (params, losses before each step)."""
    theta = np.asarray(theta, np.float64).copy()
    trace = np.zeros_like(theta)
    losses = []
    for _ in range(steps):
        losses.append(ref.loss(theta, x, y, n))
        g = ref.grad(theta, x, y, n)
        if momentum is not None:
            trace = g + momentum * trace
            g = trace
        theta = theta - lr * g
    return theta, np.array(losses)


@pytest.mark.parametrize("momentum", [None, 0.9])
def test_local_update_full_batch_equals_loop(ragged, linear_model, ref, momentum):
    m, d = ragged.num_clients, ragged.x.shape[-1]
    lr, steps = 0.05, 4
    start = _cluster_params(m, d, seed=5)  # every client starts elsewhere
    opt = optax.sgd(lr) if momentum is None else optax.sgd(lr, momentum=momentum)
    keys = jax.random.split(jax.random.key(0), m)
    params, snap, losses = local_update(linear_model, opt, start, ragged, keys, num_steps=steps)
    assert snap is None
    chex.assert_shape(params, (m, d))
    chex.assert_shape(losses, (m, steps))
    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)
    for i in range(m):
        want_p, want_l = _np_sgd(start[i], x[i], y[i], n[i], lr, steps, ref, momentum)
        np.testing.assert_allclose(params[i], want_p, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(losses[i], want_l, rtol=1e-4, atol=1e-5)
    # The empty client has no gradient: its params do not move.
    np.testing.assert_array_equal(np.asarray(params)[n == 0], np.asarray(start)[n == 0])


def test_local_update_minibatch_equals_per_client_loop(ragged, linear_model, ref):
    """Reproduces the per-step batches with `sample_batch` and the documented key use."""
    m, d = ragged.num_clients, ragged.x.shape[-1]
    lr, steps, bs = 0.05, 5, 2
    n_max = ragged.max_examples
    start = _cluster_params(m, d, seed=6)
    keys = client_keys(jax.random.key(4), jnp.arange(m))
    params, _, losses = local_update(
        linear_model, optax.sgd(lr), start, ragged, keys, num_steps=steps, batch_size=bs
    )
    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)

    @jax.jit
    def batches(key, num_examples):
        """The documented key use: split(key, τ), then (k_batch, k_loss) = split(k_t)."""
        k_batch = jax.vmap(lambda k: jax.random.split(k)[0])(jax.random.split(key, steps))
        return jax.vmap(lambda kb: sample_batch(kb, num_examples, n_max, bs))(k_batch)

    for i in range(m):
        theta = np.asarray(start[i], np.float64)
        all_idx, all_mask = map(np.asarray, batches(keys[i], n[i]))
        for t in range(steps):
            idx, mask = all_idx[t], all_mask[t]
            rows = idx[mask]
            # The batch: distinct real rows, all of them when the client is smaller than bs.
            assert len(set(rows.tolist())) == len(rows) == min(bs, n[i])
            assert np.all(rows < n[i])
            xb, yb = x[i][rows], y[i][rows]
            np.testing.assert_allclose(
                losses[i, t], ref.loss(theta, xb, yb, len(rows)), rtol=1e-4, atol=1e-5
            )
            theta = theta - lr * ref.grad(theta, xb, yb, len(rows))
        np.testing.assert_allclose(params[i], theta, rtol=1e-4, atol=1e-5)


def test_sample_batch_masks():
    n_max, bs = 6, 4
    keys = jax.random.split(jax.random.key(0), 5)
    draw = jax.jit(jax.vmap(lambda k, n: sample_batch(k, n, n_max, bs), in_axes=(0, None)))
    for n in range(n_max + 1):
        idx, mask = map(np.asarray, draw(keys, n))
        chex.assert_shape(idx, (5, bs))
        chex.assert_shape(mask, (5, bs))
        for row_idx, row_mask in zip(idx, mask, strict=True):
            np.testing.assert_array_equal(row_mask, np.arange(bs) < n)
            real = row_idx[row_mask]
            assert len(set(real.tolist())) == len(real)
            assert np.all((real >= 0) & (real < n))


@pytest.mark.parametrize("extra_rows", [0, 2], ids=["as-large-as-client", "larger-than-padding"])
def test_local_update_batch_holding_every_row_equals_full_batch(ragged, linear_model, extra_rows):
    """A batch that holds every real row is the full batch, for any key.

    sample_batch's contract: a client with fewer than batch_size rows uses all
    of them, even when batch_size exceeds the padded width n_max.
    """
    m, d = ragged.num_clients, ragged.x.shape[-1]
    start = _cluster_params(m, d, seed=7)
    keys = jax.random.split(jax.random.key(1), m)
    full, _, _ = local_update(linear_model, optax.sgd(0.05), start, ragged, keys, num_steps=3)
    mini, _, _ = local_update(
        linear_model,
        optax.sgd(0.05),
        start,
        ragged,
        keys,
        num_steps=3,
        batch_size=ragged.max_examples + extra_rows,
    )
    chex.assert_trees_all_close(mini, full, rtol=RTOL, atol=ATOL)


def test_local_update_snapshot(ragged, linear_model, ref):
    m, d = ragged.num_clients, ragged.x.shape[-1]
    lr, steps = 0.05, 5
    start = _cluster_params(m, d, seed=8)
    keys = jax.random.split(jax.random.key(0), m)
    x, y, n = np.asarray(ragged.x), np.asarray(ragged.y), np.asarray(ragged.num_examples)
    for t_snap in (0, 2, steps):
        _, snap, _ = local_update(
            linear_model,
            optax.sgd(lr),
            start,
            ragged,
            keys,
            num_steps=steps,
            snapshot_step=jnp.int32(t_snap),
        )
        for i in range(m):
            want, _ = _np_sgd(start[i], x[i], y[i], n[i], lr, t_snap, ref)
            np.testing.assert_allclose(snap[i], want, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- segment_average


def _segment_loop(values, ids, k, weights, fallback, normalize):
    """Per-segment weighted mean, fallback for a segment of zero weight (the docstring)."""
    out = {name: np.array(fb, np.float64) for name, fb in fallback.items()}
    seg_w = np.zeros(k)
    for j in range(k):
        members = [i for i in range(len(ids)) if ids[i] == j]
        seg_w[j] = sum(weights[i] for i in members)
        if seg_w[j] == 0:
            continue
        denom = seg_w[j] if normalize == "segment" else np.sum(weights)
        for name, v in values.items():
            out[name][j] = sum(weights[i] * np.asarray(v[i], np.float64) for i in members) / denom
    return out, seg_w


@pytest.mark.parametrize("normalize", ["segment", "total"])
@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_segment_average_equals_loop(ragged, normalize, weighting):
    m, k = ragged.num_clients, 4
    rng = np.random.default_rng(0)
    values = {
        "a": rng.normal(size=(m, 2, 3)).astype(np.float32),
        "b": rng.normal(size=(m,)).astype(np.float32),
    }
    fallback = {
        "a": np.full((k, 2, 3), 7.0, np.float32),
        "b": np.full((k,), -3.0, np.float32),
    }
    # Segment 2 has no client; segment 3 holds only the empty client, so it has
    # zero weight under sample weighting.
    n = np.asarray(ragged.num_examples)
    ids = np.array([0, 1, 3, 0, 1], np.int32)
    assert n[2] == 0
    weights = np.ones(m, np.float32) if weighting == "uniform" else n.astype(np.float32)
    got, seg_w = segment_average(
        jax.tree.map(jnp.asarray, values),
        jnp.asarray(ids),
        k,
        None if weighting == "uniform" else jnp.asarray(weights),
        fallback=jax.tree.map(jnp.asarray, fallback),
        normalize=normalize,
    )
    want, want_w = _segment_loop(values, ids, k, weights, fallback, normalize)
    chex.assert_shape(got["a"], (k, 2, 3))
    chex.assert_shape(got["b"], (k,))
    np.testing.assert_allclose(seg_w, want_w, rtol=RTOL)
    chex.assert_trees_all_close(
        jax.tree.map(np.asarray, got),
        jax.tree.map(lambda a: a.astype(np.float32), want),
        rtol=RTOL,
        atol=ATOL,
    )


def test_segment_average_empty_cluster_keeps_fallback_exactly():
    values = jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
    fallback = jnp.asarray([[9.0, 9.0], [-5.0, 0.5], [8.0, 8.0]])
    got, seg_w = segment_average(values, jnp.asarray([0, 2]), 3, fallback=fallback)
    np.testing.assert_array_equal(got[1], fallback[1])
    np.testing.assert_array_equal(got[0], values[0])
    np.testing.assert_array_equal(got[2], values[1])
    np.testing.assert_array_equal(seg_w, [1.0, 0.0, 1.0])
    # Without a fallback an empty segment is zeros.
    got0, _ = segment_average(values, jnp.asarray([0, 2]), 3)
    np.testing.assert_array_equal(got0[1], [0.0, 0.0])


def test_segment_average_k1_is_weighted_mean():
    rng = np.random.default_rng(1)
    values = rng.normal(size=(6, 3)).astype(np.float32)
    weights = rng.uniform(0.1, 2.0, size=6).astype(np.float32)
    got, seg_w = segment_average(
        jnp.asarray(values), jnp.zeros(6, jnp.int32), 1, jnp.asarray(weights)
    )
    chex.assert_shape(got, (1, 3))
    want = (weights[:, None] * values).sum(0) / weights.sum()
    np.testing.assert_allclose(got[0], want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(seg_w, [weights.sum()], rtol=RTOL)


@pytest.mark.parametrize("chunk", [1, 3, 4, 7, 50])
def test_segment_average_chunked_equals_loop_and_unchunked(chunk):
    # Chunks scatter into the running totals in client order: the unchunked sums exactly
    # (many clients per segment, so the order of the float additions shows).
    m, k = 50, 3
    rng = np.random.default_rng(2)
    values = {"a": rng.normal(size=(m, 4, 3)).astype(np.float32),
              "b": rng.normal(size=(m,)).astype(np.float32)}
    ids = rng.integers(-1, k + 1, size=m).astype(np.int32)  # -1 and k are dropped
    weights = rng.uniform(0.0, 3.0, size=m).astype(np.float32)
    fallback = {"a": np.zeros((k, 4, 3), np.float32), "b": np.zeros((k,), np.float32)}
    args = (jax.tree.map(jnp.asarray, values), jnp.asarray(ids), k, jnp.asarray(weights))
    got, seg_w = segment_average(*args, client_chunk=chunk)
    plain, plain_w = segment_average(*args)
    chex.assert_trees_all_equal(got, plain)
    np.testing.assert_array_equal(seg_w, plain_w)
    want, want_w = _segment_loop(values, ids, k, weights, fallback, "segment")
    chex.assert_trees_all_close(jax.tree.map(np.asarray, got),
                                jax.tree.map(lambda a: a.astype(np.float32), want),
                                rtol=RTOL, atol=ATOL)


def test_segment_average_drops_out_of_range_ids():
    values = jnp.asarray([[1.0], [2.0], [100.0], [-100.0]])
    got, seg_w = segment_average(values, jnp.asarray([0, 0, 2, -1]), 2)
    np.testing.assert_allclose(got, [[1.5], [0.0]])
    np.testing.assert_array_equal(seg_w, [2.0, 0.0])


@settings(max_examples=40, deadline=None)
@given(
    ids=hnp.arrays(np.int32, 7, elements=st.integers(0, 2)),
    weights=hnp.arrays(np.float32, 7, elements=st.floats(0.0, 10.0, width=32)),
    normalize=st.sampled_from(["segment", "total"]),
)
def test_segment_average_conserves_weight(ids, weights, normalize):
    values = jnp.arange(7.0)[:, None]
    _, seg_w = segment_average(
        values, jnp.asarray(ids), 3, jnp.asarray(weights), normalize=normalize
    )
    np.testing.assert_allclose(
        np.sum(seg_w), np.sum(weights, dtype=np.float64), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(seg_w, np.bincount(ids, weights, minlength=3), rtol=1e-5, atol=1e-5)


def test_segment_average_rejects_bad_normalize():
    with pytest.raises(ValueError, match="normalize"):
        segment_average(jnp.ones((2, 1)), jnp.zeros(2, jnp.int32), 1, normalize="mean")


# --------------------------------------------------------------------------- sampling


def test_sample_uniform_distinct_in_range():
    m, s, trials = 10, 4, 1000
    draws = np.asarray(
        jax.vmap(lambda k: sample_uniform(k, m, s))(jax.random.split(jax.random.key(0), trials))
    )
    chex.assert_shape(draws, (trials, s))
    assert draws.dtype == np.int32
    assert np.all((draws >= 0) & (draws < m))
    for row in draws:
        assert len(set(row.tolist())) == s
    # Every client is in a cohort with probability s/m.
    freq = np.bincount(draws.ravel(), minlength=m) / len(draws)
    np.testing.assert_allclose(freq, s / m, atol=0.05)


@pytest.mark.parametrize("cohort", [0, 11])
def test_sample_uniform_rejects_bad_cohort(cohort):
    with pytest.raises(ValueError, match="cohort_size"):
        sample_uniform(jax.random.key(0), 10, cohort)


def test_sample_weighted_frequencies_with_replacement():
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0], np.float32)
    s, trials = 8, 4000
    draws = np.asarray(
        jax.vmap(lambda k: sample_weighted(k, jnp.asarray(probs), s))(
            jax.random.split(jax.random.key(0), trials)
        )
    )
    chex.assert_shape(draws, (trials, s))
    assert draws.dtype == np.int32
    freq = np.bincount(draws.ravel(), minlength=len(probs)) / draws.size
    # 32000 draws: the standard error of each frequency is below 0.003.
    np.testing.assert_allclose(freq, probs, atol=0.015)
    assert freq[-1] == 0.0
    # With replacement: repeats happen, and a cohort may exceed the number of clients.
    assert np.mean([len(set(r.tolist())) < s for r in draws]) > 0.5
    big = sample_weighted(jax.random.key(1), jnp.asarray([0.5, 0.5]), 6)
    chex.assert_shape(big, (6,))
    assert set(np.asarray(big).tolist()) <= {0, 1}


# --------------------------------------------------------------------------- mixup


# One compilation shared by the tests below (Beta sampling is slow to compile).
_mixup_client_jit = jax.jit(mixup_client)


def _mixup_data(seed=0):
    rng = np.random.default_rng(seed)
    sizes = np.array([4, 1, 0, 3, 2], np.int32)
    m, n_max, d, c = len(sizes), 4, 3, 2
    x = rng.normal(size=(m, n_max, d)).astype(np.float32)
    y = np.eye(c, dtype=np.float32)[rng.integers(0, c, size=(m, n_max))]
    # Distinctive padding: it must come back untouched and never be mixed in.
    pad = np.arange(n_max)[None, :] >= sizes[:, None]
    x[pad] = 1000.0
    y[pad] = -1000.0
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(sizes)


def test_mixup_equals_per_client_mixup_client():
    x, y, n = _mixup_data()
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    xt, yt, g = mixup(keys, x, y, n, 2.0, 2.0)
    chex.assert_shape(g, (x.shape[0],))
    for i in range(x.shape[0]):
        xi, yi, gi = _mixup_client_jit(keys[i], x[i], y[i], n[i], 2.0, 2.0)
        np.testing.assert_allclose(xt[i], xi, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(yt[i], yi, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(g[i], gi, rtol=1e-6)


def test_mixup_client_mixes_only_real_rows_of_the_client():
    """Recovers the pairing from the output: a permutation of the client's real rows."""
    x, y, n = _mixup_data(1)
    checked = 0
    for seed in range(6):
        keys = jax.random.split(jax.random.key(seed), x.shape[0])
        xt, yt, g = mixup(keys, x, y, n, 2.0, 2.0)
        xt, yt, g = np.asarray(xt, np.float64), np.asarray(yt, np.float64), np.asarray(g)
        for i in range(x.shape[0]):
            ni = int(n[i])
            xi, yi = np.asarray(x[i], np.float64), np.asarray(y[i], np.float64)
            # Padded rows unchanged, bit for bit.
            np.testing.assert_array_equal(xt[i, ni:], xi[ni:])
            np.testing.assert_array_equal(yt[i, ni:], yi[ni:])
            assert 0.0 <= g[i] <= 1.0
            if ni == 0 or not 0.05 < g[i] < 0.95:
                continue
            partners = (xt[i, :ni] - g[i] * xi[:ni]) / (1.0 - g[i])
            dist = np.linalg.norm(partners[:, None, :] - xi[None, :ni, :], axis=-1)
            perm = dist.argmin(axis=1)
            assert dist.min(axis=1).max() < 1e-3
            assert sorted(perm.tolist()) == list(range(ni))
            np.testing.assert_allclose(
                yt[i, :ni], g[i] * yi[:ni] + (1 - g[i]) * yi[perm], atol=1e-5
            )
            checked += 1
    assert checked >= 10  # enough (client, key) pairs with a usable γ were tested


def test_mixup_one_example_client_is_unchanged():
    x, y, n = _mixup_data(2)
    i = int(np.flatnonzero(np.asarray(n) == 1)[0])
    xt, yt, _ = _mixup_client_jit(jax.random.key(3), x[i], y[i], n[i], 2.0, 2.0)
    np.testing.assert_allclose(xt, x[i], rtol=1e-6)
    np.testing.assert_allclose(yt, y[i], rtol=1e-6)


def test_mixup_gamma_one_is_identity():
    """Beta(1, 1e-30) draws γ = 1 exactly; then mixup must return its input bit for bit."""
    x, y, n = _mixup_data(3)
    for seed in range(5):
        keys = jax.random.split(jax.random.key(seed), x.shape[0])
        xt, yt, g = mixup(keys, x, y, n, 1.0, 1e-30)
        np.testing.assert_array_equal(g, 1.0)  # the premise of the test
        chex.assert_trees_all_equal((xt, yt), (x, y))


def test_mixup_gamma_zero_permutes_real_rows():
    """Beta(1e-30, 1) draws γ = 0: each client's real rows come back permuted, exactly."""
    x, y, n = _mixup_data(4)
    keys = jax.random.split(jax.random.key(0), x.shape[0])
    xt, yt, g = mixup(keys, x, y, n, 1e-30, 1.0)
    np.testing.assert_array_equal(g, 0.0)
    for i in range(x.shape[0]):
        ni = int(n[i])
        rows_in = sorted(map(tuple, np.asarray(x[i, :ni]).tolist()))
        rows_out = sorted(map(tuple, np.asarray(xt[i, :ni]).tolist()))
        assert rows_in == rows_out
        np.testing.assert_array_equal(xt[i, ni:], x[i, ni:])


# --------------------------------------------------------------------------- project_simplex


def _np_projection_sort(v):
    """Sort method (Held et al.; FedTorch's projection_simplex_sort), float64."""
    v = np.asarray(v, np.float64)
    u = np.sort(v)[::-1]
    cssv = np.cumsum(u) - 1.0
    ind = np.arange(1, len(v) + 1)
    rho = ind[u - cssv / ind > 0][-1]
    theta = cssv[rho - 1] / rho
    return np.maximum(v - theta, 0.0)


def _np_projection_brute_force(v):
    """Tries every support S: λ_S = v_S − (Σv_S − 1)/|S|; keeps the closest feasible point."""
    v = np.asarray(v, np.float64)
    best, best_d = None, np.inf
    for r in range(1, len(v) + 1):
        for support in itertools.combinations(range(len(v)), r):
            s = list(support)
            lam = np.zeros_like(v)
            lam[s] = v[s] - (v[s].sum() - 1.0) / r
            if lam.min() < -1e-12:
                continue
            d = np.sum((lam - v) ** 2)
            if d < best_d:
                best, best_d = lam, d
    return best


def test_project_simplex_equals_sort_and_brute_force():
    rng = np.random.default_rng(0)
    cases = [rng.normal(scale=s, size=n) for n in (1, 2, 5, 6) for s in (0.1, 1.0, 10.0)]
    cases += [
        np.array([0.2, 0.3, 0.5]),  # already on the simplex
        np.array([1.0, 1.0, 1.0, 1.0]),  # ties
        np.array([-5.0, -5.0, 3.0]),
        np.array([0.0, 0.0, 0.0]),
    ]
    for v in cases:
        got = np.asarray(project_simplex(jnp.asarray(v, jnp.float32)), np.float64)
        np.testing.assert_allclose(got, _np_projection_sort(v), atol=1e-5)
        np.testing.assert_allclose(got, _np_projection_brute_force(v), atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, 6, elements=st.floats(-50, 50, width=32)))
def test_project_simplex_invariants(v):
    lam = np.asarray(project_simplex(jnp.asarray(v)))
    assert np.all(lam >= 0.0)
    np.testing.assert_allclose(lam.sum(), 1.0, atol=1e-5)
    np.testing.assert_allclose(lam, _np_projection_sort(v), atol=1e-4)
    # Idempotent: a point of the simplex projects to itself.
    np.testing.assert_allclose(project_simplex(jnp.asarray(lam)), lam, atol=1e-6)


def test_project_simplex_fixes_simplex_points():
    rng = np.random.default_rng(1)
    for p in rng.dirichlet(np.ones(7) * 0.5, size=20).astype(np.float32):
        np.testing.assert_allclose(project_simplex(jnp.asarray(p)), p, atol=1e-6)


def test_project_simplex_floor():
    floor = 1e-3
    rng = np.random.default_rng(2)
    for _ in range(10):
        v = rng.normal(size=8) * 3
        got = np.asarray(project_simplex(jnp.asarray(v, jnp.float32), floor), np.float64)
        lam = np.maximum(_np_projection_sort(v), floor)
        want = lam / lam.sum()
        np.testing.assert_allclose(got, want, atol=1e-6)
        np.testing.assert_allclose(got.sum(), 1.0, atol=1e-6)
        # No client's weight reaches zero.
        assert got.min() >= floor / (1 + len(v) * floor) - 1e-7
    # floor = 0 is the plain projection.
    v = jnp.asarray([3.0, -1.0, 0.5])
    np.testing.assert_array_equal(project_simplex(v, 0.0), project_simplex(v))


# --------------------------------------------------------------------------- kmeans


def _np_inertia(points, labels, k):
    points = np.asarray(points, np.float64)
    total = 0.0
    for j in range(k):
        members = points[np.asarray(labels) == j]
        if len(members):
            total += np.sum((members - members.mean(0)) ** 2)
    return total


def test_kmeans_recovers_blobs_and_inertia_matches_loop(ref):
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    truth = np.repeat(np.arange(3), 5)
    points = (centers[truth] + 0.3 * rng.normal(size=(15, 2))).astype(np.float32)
    labels, inertia = kmeans(jax.random.key(0), jnp.asarray(points), 3)
    chex.assert_shape(labels, (15,))
    assert labels.dtype == jnp.int32
    assert ref.perm_accuracy(labels, truth, 3) == 1.0
    np.testing.assert_allclose(inertia, _np_inertia(points, labels, 3), rtol=1e-4)
    # Lloyd fixed point: every point is nearest to its own cluster's mean.
    means = np.stack([points[np.asarray(labels) == j].mean(0) for j in range(3)])
    nearest = np.argmin(((points[:, None] - means[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(labels, nearest)


def test_kmeans_finds_brute_force_optimum():
    rng = np.random.default_rng(1)
    points = np.concatenate([rng.normal(size=(4, 3)), rng.normal(size=(4, 3)) + 4.0]).astype(
        np.float32
    )
    best = min(
        _np_inertia(points, np.array(lab), 2)
        for lab in itertools.product(range(2), repeat=len(points))
    )
    labels, inertia = kmeans(jax.random.key(0), jnp.asarray(points), 2)
    np.testing.assert_allclose(inertia, best, rtol=1e-4)
    np.testing.assert_allclose(_np_inertia(points, labels, 2), best, rtol=1e-4)


def test_kmeans_k1():
    points = np.random.default_rng(2).normal(size=(9, 4)).astype(np.float32)
    labels, inertia = kmeans(jax.random.key(0), jnp.asarray(points), 1)
    np.testing.assert_array_equal(labels, 0)
    want = np.sum((points - points.mean(0)) ** 2, dtype=np.float64)
    np.testing.assert_allclose(inertia, want, rtol=1e-4)


def test_kmeans_duplicate_points_empty_cluster_stays_finite():
    """Duplicated initial centers leave a cluster empty; it keeps its center (no NaN)."""
    points = jnp.asarray([[0.0], [0.0], [0.0], [0.0], [10.0]])
    for seed in range(4):
        labels, inertia = kmeans(jax.random.key(seed), points, 3, restarts=2)
        assert np.isfinite(float(inertia))
        assert np.all((np.asarray(labels) >= 0) & (np.asarray(labels) < 3))
        np.testing.assert_allclose(inertia, _np_inertia(points, labels, 3), atol=1e-5)
        # The isolated point is never in a cluster with the zeros.
        assert int(labels[4]) not in set(np.asarray(labels[:4]).tolist())


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("num_examples,n_max,batch", [(4096, 4096, 256), (100, 300, 40),
                                                      (40, 64, 16), (5, 12, 8), (0, 6, 3)])
def test_sample_batch_is_the_lowest_scores_in_order(num_examples, n_max, batch, replicated):
    """The batch is the rows with the `batch` lowest uniform scores (padding rows last),
    ascending, ties to the lower row: numpy's stable argsort of the same scores (counted
    ranks for n_max <= 128, top_k or argsort above)."""
    from fedjax_sim.ops import sample_batch
    from fedjax_sim.ops.local_update import lowest

    sample = jax.jit(sample_batch, static_argnums=(2, 3), static_argnames="replicated")
    for seed in range(3):
        key = jax.random.key(seed)
        idx, mask = sample(key, num_examples, n_max, batch, replicated=replicated)
        scores = np.asarray(jax.random.uniform(key, (n_max,)), np.float64)
        scores[num_examples:] = np.inf
        np.testing.assert_array_equal(np.asarray(idx),
                                      np.argsort(scores, kind="stable")[: min(batch, n_max)])
        np.testing.assert_array_equal(np.asarray(mask), np.arange(len(idx)) < num_examples)
    # Ties (and padding's inf) keep their row order, on every path.
    scores = jnp.asarray([0.5, 0.25, jnp.inf, 0.5, 0.25, jnp.inf, 0.75])
    want = np.argsort(np.asarray(scores), kind="stable")[:6]
    np.testing.assert_array_equal(lowest(scores, 6, replicated=replicated), want)
    np.testing.assert_array_equal(jax.lax.top_k(-scores, 6)[1], want)
    np.testing.assert_array_equal(jnp.argsort(scores)[:6], want)


@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("num_examples,n_max,batch", [(50, 64, 16), (300, 300, 40), (3, 8, 5)])
def test_sample_batches_equal_one_draw_per_key(num_examples, n_max, batch, replicated):
    """K steps' batches drawn together are the K one-at-a-time draws, row for row."""
    from fedjax_sim.ops.local_update import sample_batches

    keys = jax.random.split(jax.random.key(7), 5)
    idx, mask = jax.jit(sample_batches, static_argnums=(2, 3), static_argnames="replicated")(
        keys, num_examples, n_max, batch, replicated=replicated)
    assert idx.shape == mask.shape == (5, min(batch, n_max))
    for j in range(5):
        one_idx, one_mask = sample_batch(keys[j], num_examples, n_max, batch,
                                         replicated=replicated)
        np.testing.assert_array_equal(np.asarray(idx[j]), np.asarray(one_idx))
        np.testing.assert_array_equal(np.asarray(mask[j]), np.asarray(one_mask))
    assert len({tuple(np.asarray(r)) for r in idx}) > 1  # the steps' batches differ
