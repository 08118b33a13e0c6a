"""Kernels rewritten for XLA:CPU (issue 20) against the formulas they replace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.models import softmax_cross_entropy


def test_softmax_cross_entropy_is_optaxs_bit_for_bit():
    """One-hot select instead of optax's gather: the same losses and gradients, bit for bit,
    including negative labels (counted from the end) and out-of-range ones (NaN)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 40, 10)).astype(np.float32) * 8)
    labels = jnp.asarray(rng.integers(0, 10, (3, 40)).astype(np.int32))
    odd = jnp.array([0, 9, -1, -10, 10, -11, 3], jnp.int32)

    def want(lg, lb):
        return optax.softmax_cross_entropy_with_integer_labels(lg, lb)

    got_odd = softmax_cross_entropy(logits[0, : odd.size], odd)
    want_odd = want(logits[0, : odd.size], odd)
    np.testing.assert_array_equal(np.asarray(got_odd), np.asarray(want_odd))
    assert np.isnan(np.asarray(got_odd)[4:6]).all()
    for fn in (lambda f: f, jax.jit, lambda f: jax.jit(jax.vmap(f))):
        np.testing.assert_array_equal(np.asarray(fn(softmax_cross_entropy)(logits, labels)),
                                      np.asarray(fn(want)(logits, labels)))

    def grad(loss):
        return jax.jit(jax.grad(lambda lg: jnp.sum(loss(lg, labels) * jnp.arange(40.0))))(logits)

    np.testing.assert_array_equal(np.asarray(grad(softmax_cross_entropy)), np.asarray(grad(want)))


def test_assign_clusters_equals_argmin_with_nan_inf_and_ties():
    """The two-reduction argmin against jnp.argmin (NaN read as +inf); a per-row Python
    loop checks the tie and NaN rules."""
    from fedjax_sim.ops.clustering import assign_clusters

    rng = np.random.default_rng(1)
    for k in (1, 2, 4, 33):
        losses = rng.integers(0, 4, (300, k)).astype(np.float32)  # many ties
        special = rng.random((300, k))
        losses[special < 0.1] = np.nan
        losses[(special >= 0.1) & (special < 0.15)] = np.inf
        losses[(special >= 0.15) & (special < 0.18)] = -np.inf
        losses[:3] = np.nan  # rows with nothing finite
        got = np.asarray(jax.jit(assign_clusters)(jnp.asarray(losses)))
        want = []
        for row in np.where(np.isnan(losses), np.inf, losses):
            best = 0
            for j in range(1, k):
                if row[j] < row[best]:
                    best = j
            want.append(best)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, np.argmin(np.where(np.isnan(losses), np.inf, losses),
                                                     axis=-1))
