"""The IFCA synthetic mixture of linear regressions (Ghosh et al. 2020, §5.1).

Protocol of the official code (jichan3751/ifca, synthetic/), docs/protocols.md#ifca-synthetic:
θ*_j = R · Bernoulli(0.5)^d; machine i belongs to cluster i // (m/k) (contiguous,
equal clusters); X ~ N(0, 1); y = X θ*_c(i) + N(0, σ²). The generator is a pure
JAX function of a key, so a sweep can build many data seeds inside one `vmap`.

`generated_mixture` gives the same clients as `GeneratedClients`: nothing
per client is stored; a round draws each cohort chunk's rows from the
clients' keys when it trains them, so a round over m clients holds O(chunk)
data (and `take(ids)` equals `linear_mixture(...).train.take(ids)`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedjax_sim.data.federated import ClientSource, FederatedData
from fedjax_sim.execution import DEFAULT_PLAN, Plan
from fedjax_sim.systems import NO_SYSTEMS, Systems


class LinearMixture(NamedTuple):
    """A synthetic problem: train and test clients plus the true cluster models."""

    train: FederatedData
    test: FederatedData
    theta_star: jax.Array  # [k, d]


MAX_SIZE = 2**31 - 1  # client ids and per-client draws are int32-indexed
# Generated clients are drawn for a per-client map (an evaluation) this many floats
# at a time (2 MiB): XLA:CPU's threefry is a loop over the whole drawn array, ~2×
# faster when that array stays in cache (a test chunk of 17,893 clients × 100 rows with
# 10 restarts: 416 → 158 ms on a 2-core CPU).
MAP_DRAW_FLOATS = 2**19


def check_mixture_settings(
    k: int, m: int, n: int, d: int, sigma: float, R: float, n_test: int = 0
) -> None:
    """Raises ValueError, naming the setting, for values the generator cannot use."""
    for name, value in (("k", k), ("m", m), ("n", n), ("d", d)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    if not isinstance(n_test, int) or isinstance(n_test, bool) or n_test < 0:
        raise ValueError(f"n_test must be an integer >= 0; got {n_test!r}.")
    for name, value in (("m", m), ("n·(d+1)", n * (d + 1)), ("n_test·(d+1)", n_test * (d + 1))):
        if value > MAX_SIZE:
            raise ValueError(f"{name} must be at most 2**31 - 1 = {MAX_SIZE}; got {value}.")
    if m % k:
        raise ValueError(
            f"m must be divisible by k (clusters are contiguous and equal-size); got m={m}, k={k}."
        )
    for name, value in (("sigma", sigma), ("R", R)):
        if not (math.isfinite(float(value)) and float(value) >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")


def _clients(keys, ids, theta_star, m, n, sigma):
    """Clients `ids` of a problem with m machines; client i's rows come from keys[j]."""
    k, d = theta_star.shape
    cluster = (ids // (m // k)).astype(jnp.int32)
    # One flat draw per client: XLA:CPU compiles a small multi-dimensional
    # random.normal ~20x slower (~10 s for [20, 50, 10]) than a flat one.
    z = jax.vmap(lambda key: jax.random.normal(key, (n * (d + 1),)))(keys)
    x = z[:, : n * d].reshape(-1, n, d)
    noise = sigma * z[:, n * d :]
    y = jnp.einsum("mnd,md->mn", x, theta_star[cluster]) + noise
    count = jnp.full((ids.shape[0],), n, jnp.int32)
    return FederatedData(x=x, y=y, num_examples=count, cluster=cluster)


def _concrete(value):
    """value as numpy when it is known now (not traced inside a jit/vmap), else None."""
    if isinstance(value, jax.core.Tracer):
        return None
    return np.asarray(value)


def _check_traceable(m: int, sigma, R, client_ids) -> None:
    """Checks sigma, R and client_ids where they are concrete (before jit sees them)."""
    for name, value in (("sigma", sigma), ("R", R)):
        array = _concrete(value)
        if array is None:
            continue
        if array.ndim or array.dtype.kind not in "biuf" or not (
                np.isfinite(array) and array >= 0):
            raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")
    ids = None if client_ids is None else _concrete(client_ids)
    if ids is not None:
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"client_ids must be a 1-D array of integer client ids; got dtype {ids.dtype} "
                f"shape {ids.shape}.")
        if ids.size and (ids.min() < 0 or ids.max() >= m):
            raise ValueError(
                f"client_ids must lie in [0, m={m}); got ids in [{ids.min()}, {ids.max()}].")


def linear_mixture(
    key, *, k: int, m: int, n: int, d: int, sigma, R, n_test: int = 0, client_ids=None
):
    """Draws one data seed of the IFCA synthetic problem.

    Client i's train and test rows come from fold_in(key, i) streams, so a
    process (or a memory-bounded chunk) can build only its own clients and
    get exactly the rows the whole problem would have.

    Args:
      key: PRNG key of the data seed.
      k, m, n, d: clusters, machines, examples per machine, dimension (static).
      sigma: noise standard deviation (may be traced).
      R: cluster separation scale (may be traced).
      n_test: examples per machine in a test set from the same clusters
        (0 gives a one-row placeholder test set).
      client_ids: optional [s] ints, build only these clients (default all m).

    Returns:
      LinearMixture(train [s, n, d], test [s, n_test, d], theta_star [k, d]).

    Raises:
      ValueError: a size, sigma, R or client id out of range (sigma, R and
        client_ids are checked here, before jit, whenever they are concrete;
        traced ones, inside a caller's jit or vmap, are the caller's to check).
    """
    # k, m, n, d and n_test are static, so a bad one is named here rather than
    # deep inside JAX; sigma and R may be traced (a sweep vmaps them).
    check_mixture_settings(k, m, n, d, 0.0, 0.0, n_test=n_test)
    _check_traceable(m, sigma, R, client_ids)
    return _linear_mixture(key, k=k, m=m, n=n, d=d, sigma=sigma, R=R, n_test=n_test,
                           client_ids=client_ids)


@functools.partial(jax.jit, static_argnames=("k", "m", "n", "d", "n_test"))
def _linear_mixture(key, *, k, m, n, d, sigma, R, n_test, client_ids):
    k_theta, k_train, k_test = jax.random.split(key, 3)
    bits = jax.random.bernoulli(k_theta, 0.5, (k * d,)).astype(jnp.float32).reshape(k, d)
    theta_star = R * bits
    ids = jnp.arange(m) if client_ids is None else jnp.asarray(client_ids)

    def keys(base):
        return jax.vmap(lambda i: jax.random.fold_in(base, i))(ids)

    train = _clients(keys(k_train), ids, theta_star, m, n, sigma)
    test = _clients(keys(k_test), ids, theta_star, m, max(n_test, 1), sigma)
    return LinearMixture(train, test, theta_star)


@struct.dataclass
class GeneratedClients(ClientSource):
    """Clients of the linear mixture drawn when a round needs them, never stored.

    Client i's rows come from fold_in(key, i) and its cluster is i // (m/k),
    as in `linear_mixture`. Per-client arrays (num_examples, cluster, active)
    are computed broadcasts; the pytree's leaves are the key, θ* and σ, all
    shared (replicated over devices), and for a `subset` the ids of its
    clients, its one per-client leaf.

    Attributes:
      key: the stream key of the split (`linear_mixture`'s k_train or k_test).
      theta_star: [k, d] the cluster models.
      sigma: the noise standard deviation (may be traced).
      m, n: static clients of the whole problem and examples per client.
      ids: None (the clients are all m), or [s] int32: the clients are those
        of the problem (`subset`).
    """

    key: jax.Array
    theta_star: jax.Array
    sigma: jax.Array
    m: int = struct.field(pytree_node=False)
    n: int = struct.field(pytree_node=False)
    ids: jax.Array | None = None
    plan: Plan = struct.field(pytree_node=False, default=DEFAULT_PLAN)
    systems: Systems = struct.field(pytree_node=False, default=NO_SYSTEMS)

    never_empty = True

    @property
    def num_clients(self) -> int:
        return self.m if self.ids is None else self.ids.shape[0]

    def _ids(self) -> jax.Array:
        """[num_clients] the problem's ids of these clients."""
        return jnp.arange(self.m) if self.ids is None else self.ids

    @property
    def max_examples(self) -> int:
        return self.n

    @property
    def num_examples(self) -> jax.Array:
        """[num_clients] int32, n for every client."""
        return jnp.full((self.num_clients,), self.n, jnp.int32)

    @property
    def cluster(self) -> jax.Array:
        """[num_clients] int32 ground-truth clusters, i // (m/k)."""
        return _cluster_of(self._ids(), self.m, self.theta_star.shape[0])

    @property
    def x(self) -> jax.Array:
        """Every client's features ([m, n, d], drawn: O(m) memory)."""
        return self.materialize().x

    @property
    def y(self) -> jax.Array:
        """Every client's targets ([m, n], drawn: O(m) memory)."""
        return self.materialize().y

    def active(self) -> jax.Array:
        return jnp.ones((self.num_clients,), bool)

    def mask(self) -> jax.Array:
        return jnp.ones((self.num_clients, self.n), jnp.float32)

    def client_leaves(self):
        return () if self.ids is None else self.ids

    def gather(self, leaves, ids) -> FederatedData:
        # A subset's leaves are its problem ids at `ids`; the whole problem has none.
        ids = jnp.asarray(ids) if self.ids is None else leaves
        return _draw(self.key, ids, self.theta_star, self.sigma, m=self.m,
                     n=self.n).replace(plan=self.plan, systems=self.systems)

    def subset(self, ids) -> GeneratedClients:
        """The clients `ids` ([s] ints) still generated: their rows are drawn when needed."""
        ids = jnp.asarray(ids, jnp.int32)
        return self.replace(ids=ids if self.ids is None else self.ids[ids])

    def placement(self) -> GeneratedClients:
        return self.replace(key=False, theta_star=False, sigma=False,
                            ids=None if self.ids is None else True)

    def features_per_example(self) -> int:
        return self.theta_star.shape[-1]

    def map_chunk(self) -> int:
        """Clients whose n rows of d features and a target are `MAP_DRAW_FLOATS` floats."""
        return max(1, MAP_DRAW_FLOATS // (self.n * (self.theta_star.shape[-1] + 1)))


@functools.partial(jax.jit, static_argnames=("m", "n"))
def _draw(key, ids, theta_star, sigma, *, m, n):
    # Jitted even when called eagerly: `linear_mixture` draws its clients inside
    # a jit, and XLA's fused einsum rounds y differently from the eager one.
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(ids)
    return _clients(keys, ids, theta_star, m, n, sigma)


def _cluster_of(ids, m, k):
    return (ids // (m // k)).astype(jnp.int32)


def generated_mixture(key, *, k: int, m: int, n: int, d: int, sigma, R, n_test: int = 0):
    """`linear_mixture`'s problem as generated clients: the same rows, none stored.

    Args and checks as `linear_mixture` (without client_ids).

    Returns:
      LinearMixture(train, test: GeneratedClients, theta_star [k, d]);
      `train.take(ids)` equals `linear_mixture(key, ...).train.take(ids)`.
    """
    check_mixture_settings(k, m, n, d, 0.0, 0.0, n_test=n_test)
    _check_traceable(m, sigma, R, None)
    k_theta, k_train, k_test = jax.random.split(key, 3)
    theta_star = R * _theta_bits(k_theta, k, d)
    sigma = jnp.asarray(sigma, jnp.float32)
    return LinearMixture(GeneratedClients(k_train, theta_star, sigma, m, n),
                         GeneratedClients(k_test, theta_star, sigma, m, max(n_test, 1)),
                         theta_star)


def _theta_bits(key, k, d):
    return jax.random.bernoulli(key, 0.5, (k * d,)).astype(jnp.float32).reshape(k, d)


def bernoulli_init(key, k: int, d: int) -> jax.Array:
    """The official random init θ_j^(0) ∈ {0,1}^d, not scaled by R. [k, d]."""
    return jax.random.bernoulli(key, 0.5, (k, d)).astype(jnp.float32)
