"""The IFCA synthetic mixture of linear regressions (Ghosh et al. 2020, §5.1).

Protocol as in the official code (jichan3751/ifca, synthetic/), see PAPERS.md §2.1:
θ*_j = R · Bernoulli(0.5)^d; machine i belongs to cluster i // (m/k) (contiguous,
equal clusters); X ~ N(0, 1); y = X θ*_c(i) + N(0, σ²). The generator is a pure
JAX function of a key, so a sweep can build many data seeds inside one `vmap`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.data.federated import FederatedData


class LinearMixture(NamedTuple):
    """A synthetic problem: train and test clients plus the true cluster models."""

    train: FederatedData
    test: FederatedData
    theta_star: jax.Array  # [k, d]


def check_mixture_settings(k: int, m: int, n: int, d: int, sigma: float, R: float) -> None:
    """Raises ValueError, naming the setting, for values the generator cannot use."""
    for name, value in (("k", k), ("m", m), ("n", n), ("d", d)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    if m % k:
        raise ValueError(
            f"m must be divisible by k (clusters are contiguous and equal-size); got m={m}, k={k}."
        )
    for name, value in (("sigma", sigma), ("R", R)):
        if not (float(value) >= 0.0):  # also rejects NaN
            raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")


def _clients(z, theta_star, m, n, sigma):
    """Clients from a flat block z of m·n·(d + 1) standard normals."""
    k, d = theta_star.shape
    cluster = jnp.arange(m, dtype=jnp.int32) // (m // k)
    x = z[: m * n * d].reshape(m, n, d)
    noise = sigma * z[m * n * d :].reshape(m, n)
    y = jnp.einsum("mnd,md->mn", x, theta_star[cluster]) + noise
    return FederatedData(x=x, y=y, num_examples=jnp.full((m,), n, jnp.int32), cluster=cluster)


@functools.partial(jax.jit, static_argnames=("k", "m", "n", "d", "n_test"))
def linear_mixture(key, *, k: int, m: int, n: int, d: int, sigma, R, n_test: int = 0):
    """Draws one data seed of the IFCA synthetic problem.

    Args:
      key: PRNG key of the data seed.
      k, m, n, d: clusters, machines, examples per machine, dimension (static).
      sigma: noise standard deviation (may be traced).
      R: cluster separation scale (may be traced).
      n_test: examples per machine in a test set from the same clusters
        (0 gives a one-row placeholder test set).

    Returns:
      LinearMixture(train [m, n, d], test [m, n_test, d], theta_star [k, d]).
    """
    k_theta, k_x = jax.random.split(key)
    bits = jax.random.bernoulli(k_theta, 0.5, (k * d,)).astype(jnp.float32).reshape(k, d)
    theta_star = R * bits
    n_test = max(n_test, 1)
    # All normals in one flat draw: XLA:CPU spends ~0.5-1 s compiling each
    # random op (and ~10 s for a small 3-D one), which dominated a sweep cell.
    z = jax.random.normal(k_x, (m * (n + n_test) * (d + 1),))
    split = m * n * (d + 1)
    train = _clients(z[:split], theta_star, m, n, sigma)
    test = _clients(z[split:], theta_star, m, n_test, sigma)
    return LinearMixture(train, test, theta_star)


def bernoulli_init(key, k: int, d: int) -> jax.Array:
    """The official random init θ_j^(0) ∈ {0,1}^d, not scaled by R. [k, d]."""
    return jax.random.bernoulli(key, 0.5, (k, d)).astype(jnp.float32)
