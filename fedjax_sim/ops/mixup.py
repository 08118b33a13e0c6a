"""Mixup within each client (Zhang et al. 2018), as DRFLM uses it (arXiv 2204.07742)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def mixup_client(key, x, y, num_examples, alpha, beta):
    """Convex combinations of one client's own rows.

    One γ ~ Beta(α, β) per call and one random pairing π among the client's
    real rows; x̃ = γ x + (1 − γ) x[π], ỹ likewise. Padded rows stay as they
    are (they are masked downstream). Never mixes across clients.

    Args:
      key: PRNG key.
      x: [n, ...] features (or embeddings g(x)), or a pytree of such arrays
        (a graph's node features and adjacency): every leaf is mixed with the
        same γ and pairing.
      y: [n, ...] targets (float: one-hot labels or regression targets).
      num_examples: number of real rows.
      alpha, beta: Beta parameters (may be traced).

    Returns:
      (x̃, ỹ, γ).
    """
    k_gamma, k_perm = jax.random.split(key)
    gamma = jax.random.beta(k_gamma, alpha, beta).astype(jnp.float32)
    n = y.shape[0]
    rows = jnp.arange(n)
    valid = rows < num_examples
    # A random permutation of the real rows, padding rows mapped to themselves.
    scores = jnp.where(valid, jax.random.uniform(k_perm, (n,)), jnp.inf)
    # Real rows are the first num_examples rows, so order[:num_examples] is a
    # random permutation of them.
    order = jnp.argsort(scores)
    perm = jnp.where(valid, order, rows)

    def mix(a):
        g = gamma.reshape((1,) * a.ndim).astype(a.dtype)
        return jnp.where(
            valid.reshape((n,) + (1,) * (a.ndim - 1)), g * a + (1 - g) * a[perm], a
        )

    return jax.tree.map(mix, x), mix(y), gamma


@jax.jit
def mixup(keys, x, y, num_examples, alpha, beta):
    """`mixup_client` for every client: keys [m], x [m, n, ...], y [m, n, ...], num_examples [m].

    Returns (x̃ [m, n, ...], ỹ [m, n, ...], γ [m]).
    """
    return jax.vmap(mixup_client, in_axes=(0, 0, 0, 0, None, None))(
        keys, x, y, num_examples, alpha, beta
    )
