"""Stacked, padded client data: every client on one leading array axis.

Clients hold different numbers of examples. They are padded once, on the host,
to the largest client; `num_examples` records how many rows of each client are
real, and every loss, gradient and batch sampler in fedjax_sim masks the rest,
so ragged clients are exact, not approximate. A client with 0 examples takes
no part in any algorithm.

Features may be any pytree of per-client arrays with leading [m, n_max] axes
(an image array; node features and adjacency of molecular graphs; token ids).
Arrays with no client axis (a datacenter dataset, a central loss's inputs) go
in `ServerData` beside the clients: the type, not an array's shape, says what
is per-client, so devices shard `FederatedData` over clients and replicate
`ServerData`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


def _to_device(a: np.ndarray, name: str, rows: np.ndarray) -> jax.Array:
    """The device array of a, refusing non-numbers and values the device dtype would change.

    With 64-bit JAX off (the default), float64 becomes float32 and int64
    becomes int32: 1e300 would silently turn into inf and 2**40 into 0.
    """
    if a.dtype.kind not in "biuf":
        raise ValueError(
            f"{name} must hold numbers (bool, int or float); got dtype {a.dtype}."
        )
    if a.dtype.kind == "f" and not np.all(np.isfinite(a[rows])):
        raise ValueError(f"{name} has NaN or inf values in real (unpadded) rows.")
    dev = jnp.asarray(a)
    if dev.dtype != a.dtype:
        back = np.asarray(dev).astype(a.dtype)
        if not np.array_equal(back[rows], a[rows]) and not (
            a.dtype.kind == "f" and np.allclose(back[rows], a[rows], rtol=1e-6, atol=0)
        ):
            raise ValueError(
                f"{name} has values that do not fit the device dtype {dev.dtype} "
                f"(converted from {a.dtype}); rescale them or enable jax_enable_x64."
            )
    return dev


@struct.dataclass
class FederatedData:
    """m clients, padded to n_max examples each.

    Attributes:
      x: features, an array [m, n_max, ...] or any pytree of such arrays
        (e.g. {"nodes": [m, n, atoms, f], "adjacency": [m, n, atoms, atoms]});
        rows at or past `num_examples[i]` are padding.
      y: [m, n_max, ...] targets, padded like `x`.
      num_examples: [m] int32, the number of real rows of each client.
      cluster: [m] int32 ground-truth cluster of each client, -1 where unknown.
        Read only by metrics, never by an algorithm.
    """

    x: Any
    y: jax.Array
    num_examples: jax.Array
    cluster: jax.Array

    @property
    def num_clients(self) -> int:
        return self.num_examples.shape[0]

    @property
    def max_examples(self) -> int:
        return self.y.shape[1]

    def mask(self) -> jax.Array:
        """[m, n_max] float32 mask, 1 on real rows and 0 on padding."""
        rows = jnp.arange(self.max_examples)
        return (rows[None, :] < self.num_examples[:, None]).astype(jnp.float32)

    def active(self) -> jax.Array:
        """[m] bool, True for clients holding at least one example."""
        return self.num_examples > 0

    def take(self, idx) -> FederatedData:
        """The clients `idx` ([s] ints, repeats allowed), as a new FederatedData."""
        return jax.tree.map(lambda a: a[idx], self)

    @classmethod
    def from_arrays(cls, x, y, num_examples=None, cluster=None) -> FederatedData:
        """Builds from already stacked arrays, validating shapes on the host.

        Args:
          x: [m, n_max, ...] features, or a pytree (dict, tuple) of such arrays.
          y: [m, n_max, ...] targets.
          num_examples: [m] ints in [0, n_max]; defaults to n_max for every client.
          cluster: [m] ints (-1 = unknown); defaults to all -1.
        """
        paths, treedef = jax.tree_util.tree_flatten_with_path(x)
        if not paths:
            raise ValueError("x must hold at least one array; got an empty pytree.")
        names = [
            "x" + jax.tree_util.keystr(p) if p else "x" for p, _ in paths
        ]
        xs = [np.asarray(a) for _, a in paths]
        y = np.asarray(y)
        if y.ndim < 2:
            raise ValueError(f"y must be [m, n_max, ...] (at least 2-D); got shape {y.shape}.")
        for name, a in zip(names, xs, strict=True):
            if a.ndim < 2:
                raise ValueError(
                    f"{name} must be [m, n_max, ...] (at least 2-D); got shape {a.shape}."
                )
            if y.shape[:2] != a.shape[:2]:
                raise ValueError(
                    f"{name} and y must agree on their first two axes [m, n_max]; got "
                    f"{name} {a.shape} and y {y.shape}."
                )
        m, n_max = y.shape[:2]
        if num_examples is None:
            num_examples = np.full((m,), n_max, np.int32)
        num_examples = np.asarray(num_examples)
        if num_examples.shape != (m,):
            raise ValueError(f"num_examples must have shape [m]=({m},); got {num_examples.shape}.")
        if not np.issubdtype(num_examples.dtype, np.integer):
            raise ValueError(f"num_examples must be integers; got dtype {num_examples.dtype}.")
        if num_examples.min(initial=0) < 0 or num_examples.max(initial=0) > n_max:
            raise ValueError(
                f"num_examples must lie in [0, n_max={n_max}]; got range "
                f"[{num_examples.min()}, {num_examples.max()}]."
            )
        if cluster is None:
            cluster = np.full((m,), -1, np.int32)
        cluster = np.asarray(cluster)
        if cluster.shape != (m,):
            raise ValueError(f"cluster must have shape [m]=({m},); got {cluster.shape}.")
        if not np.issubdtype(cluster.dtype, np.integer):
            raise ValueError(f"cluster must be integers; got dtype {cluster.dtype}.")
        rows = np.arange(n_max)[None, :] < num_examples[:, None]
        x_dev = jax.tree_util.tree_unflatten(
            treedef, [_to_device(a, name, rows) for name, a in zip(names, xs, strict=True)]
        )
        y_dev = _to_device(y, "y", rows)
        return cls(
            x=x_dev,
            y=y_dev,
            num_examples=jnp.asarray(num_examples, jnp.int32),
            cluster=jnp.asarray(cluster, jnp.int32),
        )

    @classmethod
    def from_clients(
        cls,
        xs: Sequence,
        ys: Sequence,
        cluster: Sequence[int] | None = None,
        n_max: int | None = None,
    ) -> FederatedData:
        """Stacks ragged per-client arrays, padding with zeros.

        Args:
          xs: m arrays, client i's of shape [n_i, ...]; the trailing shape and
            dtype must agree across clients.
          ys: m arrays, [n_i, ...] each.
          cluster: optional m ground-truth cluster ids.
          n_max: pad to this many rows (default: the largest n_i).
        """
        if len(xs) != len(ys):
            raise ValueError(f"xs and ys must list the same clients; got {len(xs)} and {len(ys)}.")
        if len(xs) == 0:
            raise ValueError("at least one client is needed; got none.")
        xs = [np.asarray(a) for a in xs]
        ys = [np.asarray(a) for a in ys]
        counts = np.array([a.shape[0] if a.ndim else -1 for a in xs])
        for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
            if a.ndim == 0 or b.ndim == 0 or a.shape[0] != b.shape[0]:
                raise ValueError(
                    f"client {i}: x and y must have the same number of rows; got x {a.shape} "
                    f"and y {b.shape}."
                )
            if a.shape[1:] != xs[0].shape[1:] or b.shape[1:] != ys[0].shape[1:]:
                raise ValueError(
                    f"client {i}: feature shape {a.shape[1:]} / target shape {b.shape[1:]} "
                    f"differ from client 0's {xs[0].shape[1:]} / {ys[0].shape[1:]}."
                )
            if a.dtype != xs[0].dtype or b.dtype != ys[0].dtype:
                raise ValueError(
                    f"client {i}: dtypes x {a.dtype}, y {b.dtype} differ from client 0's "
                    f"x {xs[0].dtype}, y {ys[0].dtype}."
                )
        width = int(counts.max()) if n_max is None else int(n_max)
        if width < counts.max():
            raise ValueError(f"n_max={width} is smaller than the largest client ({counts.max()}).")
        width = max(width, 1)  # keep at least one (masked) row so shapes stay non-empty
        x = np.zeros((len(xs), width) + xs[0].shape[1:], xs[0].dtype)
        y = np.zeros((len(ys), width) + ys[0].shape[1:], ys[0].dtype)
        for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
            x[i, : len(a)] = a
            y[i, : len(b)] = b
        return cls.from_arrays(x, y, counts.astype(np.int32), cluster)


@struct.dataclass
class ServerData:
    """Arrays an algorithm reads on the server, with no client axis.

    A datacenter dataset, a central loss's inputs, a regularizer's table:
    passed to an algorithm beside the clients and replicated over devices,
    never sharded as if it were clients.

    Attributes:
      arrays: any pytree of arrays.
    """

    arrays: Any
