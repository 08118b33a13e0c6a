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

Clients need not be stored copies. A `ClientSource` is anything that can
produce the `FederatedData` of some of its clients (`take(ids)`), gathered or
drawn inside a round, one cohort chunk at a time: `FederatedData` itself (the
copies), `ClientViews` (index rows into one shared dataset held once, with a
per-client transform such as a rotation), and `data.synthetic.GeneratedClients`
(clients drawn from their per-client key). The cohort path
(`ops.cohort`, `ops.chunking`) splits a source into its per-client leaves,
which it slices by chunk (and devices shard), and rebuilds the chunk's
`FederatedData` with `gather`; which leaves are per-client is said by
`placement`, never guessed from shapes; `subset(ids)` keeps some clients as a
source of the same kind, and `map_chunk` lets a source ask a per-client map (an
evaluation) to build few clients at a time (generated clients: a cache-sized
draw). Views of several seeds stack on one
base (`stack_views`): only their index arrays carry the seeds axis, and
`copies_axes` / `copy_at` say so to `with_seeds` and per-seed code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from fedjax_sim.execution import DEFAULT_PLAN, Plan
from fedjax_sim.systems import NO_SYSTEMS, Systems


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
        # rows: [m, n_max] (a client's rows) or [examples] (a shared base's)
        bad = ~np.isfinite(a).reshape(a.shape[:rows.ndim] + (-1,)).all(-1) & rows
        first = np.argwhere(bad)[0]
        where = (f"client {first[0]}, row {first[1]}" if rows.ndim == 2 else
                 f"example {first[0]}")
        count = int(bad.sum())
        raise ValueError(f"{name} (shape {a.shape}) has NaN or inf values in {count} real "
                         f"(unpadded) row{'s' if count != 1 else ''}, the first at {where}.")
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


class ClientSource:
    """Where a round gets its clients' rows from (see the module docstring).

    A subclass is a pytree (a `flax.struct.dataclass`) and provides
    `num_clients`, `max_examples`, `num_examples` ([m] int32), `cluster`
    ([m] int32) and `active()`, besides the methods below.
    """

    never_empty = False  # True where no client can hold 0 examples (nothing to warn about)

    # Every subclass has a static field `plan` (`fedjax_sim.execution.Plan`): how the
    # executor runs the rounds over these clients. It is no data: algorithms never read it.
    def with_plan(self, plan: Plan) -> ClientSource:
        """These clients with the executor's `plan` (static: part of jit's cache key)."""
        return self.replace(plan=plan)

    # ... and a static field `systems` (`fedjax_sim.systems.Systems`): whether clients show
    # up, report and straggle. The cohort path reads it (`ops.sample_cohort`).
    def with_systems(self, systems: Systems) -> ClientSource:
        """These clients behaving as `systems` says (static: part of jit's cache key)."""
        return self.replace(systems=systems)

    def client_leaves(self):
        """The per-client part: a pytree of [m, ...] arrays (sliced by chunks, sharded)."""
        raise NotImplementedError

    def gather(self, leaves, ids) -> FederatedData:
        """The clients `ids` ([c] ints) as FederatedData, from `client_leaves()` at `ids`.

        `leaves` is `client_leaves()` with every leaf already taken at `ids`
        (by a chunk's slice or gather); `ids` may be unused (copies).
        """
        raise NotImplementedError

    def placement(self):
        """self with each array leaf replaced by True (per-client, [m, ...]) or False (shared)."""
        raise NotImplementedError

    def take(self, ids) -> FederatedData:
        """The clients `ids` ([s] ints, repeats allowed), as a new FederatedData."""
        ids = jnp.asarray(ids)
        return self.gather(jax.tree.map(lambda a: a[ids], self.client_leaves()), ids)

    def materialize(self) -> FederatedData:
        """Every client, as FederatedData (O(m) memory: for paths that read all clients at once)."""
        return self.take(jnp.arange(self.num_clients, dtype=jnp.int32))

    def subset(self, ids) -> ClientSource:
        """The clients `ids` ([s] ints) as a source of the same kind where it can be (views
        and generated clients: their rows built only when a chunk needs them), else
        copies (`take`)."""
        return self.take(ids)

    def map_chunk(self) -> int | None:
        """The most clients a per-client map (an evaluation) should build at once; None: any.

        A map's per-client outputs do not depend on how many clients it builds at
        a time, so a source whose rows are costly to build may ask for small
        blocks (`ops.chunking.map_client_chunks` takes the smaller of this and
        the caller's chunk). Stored and gathered rows ask nothing.
        """
        return None

    def features_per_example(self) -> int:
        """Features of one example, summed over x's leaves (picks compiler options)."""
        x = jax.eval_shape(lambda s: s.take(jnp.zeros((1,), jnp.int32)).x, self)
        return sum(math.prod(a.shape[2:]) for a in jax.tree.leaves(x))

    def copies_axes(self):
        """vmap in_axes of this source stacked per copy (seed): 0, or a prefix per leaf."""
        return 0

    def copy_at(self, i):
        """Copy (seed) i of this source stacked per copy."""
        return jax.tree.map(lambda a: a[i], self)


def is_client_source(node) -> bool:
    """Whether a pytree node is client data (copies, views or generated clients)."""
    return isinstance(node, ClientSource)


def copies_axes(data):
    """vmap in_axes of inputs stacked per copy (seed): 0 for every leaf, except the
    shared base of views stacked with `stack_views` (None: every copy reads it)."""
    return jax.tree.map(lambda n: n.copies_axes() if is_client_source(n) else 0, data,
                        is_leaf=is_client_source)


def copy_at(data, i):
    """Copy (seed) i of inputs stacked per copy (a shared base stays whole)."""
    return jax.tree.map(lambda n: n.copy_at(i) if is_client_source(n) else n[i], data,
                        is_leaf=is_client_source)


@struct.dataclass
class FederatedData(ClientSource):
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
    plan: Plan = struct.field(pytree_node=False, default=DEFAULT_PLAN)
    systems: Systems = struct.field(pytree_node=False, default=NO_SYSTEMS)

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

    # As a ClientSource: every leaf is per-client, and a chunk's rows are the chunk itself.
    def client_leaves(self) -> FederatedData:
        return self

    def gather(self, leaves, ids) -> FederatedData:
        del ids
        return leaves

    def placement(self) -> FederatedData:
        return jax.tree.map(lambda _: True, self)

    def materialize(self) -> FederatedData:
        return self

    def features_per_example(self) -> int:
        batch = len(self.num_examples.shape) + 1
        return sum(math.prod(a.shape[batch:]) for a in jax.tree.leaves(self.x))

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
class ClientViews(ClientSource):
    """m clients as rows of one shared dataset, held once, each under its own transform.

    Row r of client i is example `rows[i, r]` of the base, with its features
    rearranged by `maps[transform[i]]` (a rotation by a multiple of 90°, a
    flip, a pixel permutation): `take(ids)` gives exactly the FederatedData a
    stored copy would hold, padding rows included (zeros). Only the index
    arrays are per-client; the base is shared, so devices replicate it and
    shard the indices, and a round gathers one cohort chunk's rows at a time.

    Attributes:
      rows: [m, n_max] int32 base indices; padding rows (at or past
        num_examples[i]) hold N, which gathers as zeros.
      transform: [m] int32, the row of `maps` applied to each client.
      num_examples: [m] int32 real rows of each client.
      cluster: [m] int32 ground-truth cluster, -1 where unknown (metrics only).
      base_x: [N, *features] the shared features (a pytree of such arrays
        where `maps` is None).
      base_y: [N, ...] the shared targets.
      maps: [T, F] int32, F = prod(features): transform t puts flat feature
        maps[t, f] of an example at flat position f; None: no transform.
      shared_base: the per-client leaves carry leading copies (seeds) axes that
        base_x, base_y and maps do not: every copy reads the one base
        (`stack_views`; `copies_axes` gives vmap their in_axes).
    """

    rows: jax.Array
    transform: jax.Array
    num_examples: jax.Array
    cluster: jax.Array
    base_x: Any
    base_y: jax.Array
    maps: jax.Array | None = None
    shared_base: bool = struct.field(pytree_node=False, default=False)
    plan: Plan = struct.field(pytree_node=False, default=DEFAULT_PLAN)
    systems: Systems = struct.field(pytree_node=False, default=NO_SYSTEMS)

    @property
    def num_clients(self) -> int:
        return self.num_examples.shape[0]

    @property
    def max_examples(self) -> int:
        return self.rows.shape[1]

    @property
    def x(self):
        """Every client's features ([m, n_max, ...], gathered: O(m) memory)."""
        return self.materialize().x

    @property
    def y(self) -> jax.Array:
        """Every client's targets ([m, n_max, ...], gathered: O(m) memory)."""
        return self.materialize().y

    def mask(self) -> jax.Array:
        """[m, n_max] float32 mask, 1 on real rows and 0 on padding."""
        rows = jnp.arange(self.max_examples)
        return (rows[None, :] < self.num_examples[:, None]).astype(jnp.float32)

    def active(self) -> jax.Array:
        """[m] bool, True for clients holding at least one example."""
        return self.num_examples > 0

    def client_leaves(self):
        return (self.rows, self.transform, self.num_examples, self.cluster)

    def gather(self, leaves, ids) -> FederatedData:
        del ids
        rows, transform, count, cluster = leaves

        def rows_of(base):  # index N (padding) lies out of range: filled with zeros
            return base.at[rows].get(mode="fill", fill_value=0)

        if self.maps is None:
            x = jax.tree.map(rows_of, self.base_x)
        else:
            # One gather of (example, feature) pairs: the transform costs no extra pass.
            flat = self.base_x.reshape(self.base_x.shape[0], -1)
            cols = self.maps[transform]  # [..., c, F]
            x = flat.at[rows[..., None], cols[..., None, :]].get(mode="fill", fill_value=0)
            x = x.reshape(rows.shape + self.base_x.shape[1:])
        # The rows as a buffer of their own, as a stored copy's chunk is: fused into its
        # consumers, the gather would let XLA reorder their sums (a loss 1 ulp off).
        x, y = jax.lax.optimization_barrier((x, rows_of(self.base_y)))
        return FederatedData(x=x, y=y, num_examples=count, cluster=cluster, plan=self.plan,
                             systems=self.systems)

    def materialize(self) -> FederatedData:
        # The per-client leaves as they are (no gather by 0..m-1): on a mesh the rows
        # then stay where the indices live, as a stored copy's would. Seed-stacked views
        # ([*copies, m] counts) gather every copy at once from a shared base, or copy by
        # copy from their own bases.
        copies = self.num_examples.ndim - 1
        if copies and not self.shared_base:
            return jax.vmap(lambda v: v.materialize())(self)
        return self.gather(self.client_leaves(), None)

    def features_per_example(self) -> int:
        # base_x leaves are [*copies, N, *features], with the copies (seeds) axes that
        # num_examples ([*copies, m]) carries unless the base is shared: no gather.
        batch = 1 if self.shared_base else len(self.num_examples.shape)
        return sum(math.prod(a.shape[batch:]) for a in jax.tree.leaves(self.base_x))

    def copies_axes(self):
        if not self.shared_base:
            return 0
        return self.replace(rows=0, transform=0, num_examples=0, cluster=0, base_x=None,
                            base_y=None, maps=None)

    def copy_at(self, i) -> ClientViews:
        if not self.shared_base:
            return super().copy_at(i)
        rows, transform, count, cluster = (a[i] for a in self.client_leaves())
        return self.replace(rows=rows, transform=transform, num_examples=count,
                            cluster=cluster)

    def subset(self, ids) -> ClientViews:
        """The clients `ids` ([s] ints) as views of the same base: nothing is gathered."""
        rows, transform, count, cluster = (a[ids] for a in self.client_leaves())
        return self.replace(rows=rows, transform=transform, num_examples=count, cluster=cluster)

    def placement(self) -> ClientViews:
        return self.replace(
            rows=True, transform=True, num_examples=True, cluster=True,
            base_x=jax.tree.map(lambda _: False, self.base_x), base_y=False,
            maps=None if self.maps is None else False)

    @classmethod
    def from_indices(cls, base_x, base_y, rows, num_examples=None, cluster=None,
                     transform=None, maps=None) -> ClientViews:
        """Builds views, validating indices on the host.

        Args:
          base_x: [N, *features] features (a pytree of such arrays without maps).
          base_y: [N, ...] targets.
          rows: [m, n_max] ints in [0, N) (padding rows may hold anything).
          num_examples: [m] ints in [0, n_max] (default n_max).
          cluster: [m] ints, -1 = unknown (default all -1).
          transform: [m] ints in [0, T) (default 0); needs maps when not all 0.
          maps: [T, F] ints in [0, F), F = prod(features) of a single array
            base_x; None: features unchanged.
        """
        xs = [np.asarray(a) for a in jax.tree.leaves(base_x)]
        base_y = np.asarray(base_y)
        rows = np.asarray(rows)
        if not xs:
            raise ValueError("base_x must hold at least one array; got an empty pytree.")
        big = len(base_y)
        for a in xs:
            if a.ndim < 1 or len(a) != big:
                raise ValueError(
                    f"base_x and base_y must have the same number of examples N; got base_x "
                    f"{a.shape} and base_y {base_y.shape}.")
        if rows.ndim != 2 or rows.dtype.kind not in "iu":
            raise ValueError(f"rows must be [m, n_max] integers; got dtype {rows.dtype} shape "
                             f"{rows.shape}.")
        m, n_max = rows.shape
        if num_examples is None:
            num_examples = np.full((m,), n_max, np.int32)
        num_examples = np.asarray(num_examples)
        if num_examples.shape != (m,) or num_examples.dtype.kind not in "iu":
            raise ValueError(f"num_examples must be [m]=({m},) integers; got dtype "
                             f"{num_examples.dtype} shape {num_examples.shape}.")
        if num_examples.min(initial=0) < 0 or num_examples.max(initial=0) > n_max:
            raise ValueError(f"num_examples must lie in [0, n_max={n_max}].")
        real = np.arange(n_max)[None, :] < num_examples[:, None]
        if real.any() and (rows[real].min() < 0 or rows[real].max() >= big):
            raise ValueError(f"rows of real examples must lie in [0, N={big}); got "
                             f"[{rows[real].min()}, {rows[real].max()}].")
        rows = np.where(real, rows, big).astype(np.int32)
        cluster = np.full((m,), -1, np.int32) if cluster is None else np.asarray(cluster)
        if cluster.shape != (m,) or cluster.dtype.kind not in "iu":
            raise ValueError(f"cluster must be [m]=({m},) integers; got dtype {cluster.dtype} "
                             f"shape {cluster.shape}.")
        transform = np.zeros((m,), np.int32) if transform is None else np.asarray(transform)
        if transform.shape != (m,) or transform.dtype.kind not in "iu":
            raise ValueError(f"transform must be [m]=({m},) integers; got dtype "
                             f"{transform.dtype} shape {transform.shape}.")
        if maps is None:
            if np.any(transform != 0):
                raise ValueError("transform needs maps (the [T, F] feature maps it indexes).")
        else:
            if len(xs) != 1:
                raise ValueError("maps need base_x to be a single array.")
            maps = np.asarray(maps)
            width = math.prod(xs[0].shape[1:])
            if maps.ndim != 2 or maps.shape[1] != width or maps.dtype.kind not in "iu":
                raise ValueError(f"maps must be [T, F={width}] integers (F: features of one "
                                 f"example); got dtype {maps.dtype} shape {maps.shape}.")
            if maps.size and (maps.min() < 0 or maps.max() >= width):
                raise ValueError(f"maps must lie in [0, F={width}).")
            if transform.size and (transform.min() < 0 or transform.max() >= len(maps)):
                raise ValueError(f"transform must lie in [0, T={len(maps)}) (rows of maps); got "
                                 f"[{transform.min()}, {transform.max()}].")
            maps = jnp.asarray(maps, jnp.int32)
        every = np.ones((big,), bool)
        names = ["base_x" + jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(base_x)[0]]
        x_dev = jax.tree_util.tree_unflatten(
            jax.tree.structure(base_x),
            [_to_device(a, name, every) for a, name in zip(xs, names, strict=True)])
        return cls(rows=jnp.asarray(rows), transform=jnp.asarray(transform, jnp.int32),
                   num_examples=jnp.asarray(num_examples, jnp.int32),
                   cluster=jnp.asarray(cluster, jnp.int32), base_x=x_dev,
                   base_y=_to_device(base_y, "base_y", every), maps=maps)


def stack_views(views: Sequence[ClientViews]) -> ClientViews:
    """Views of one base (one per seed), their per-client leaves stacked on a leading
    [copies] axis and the base held once (`shared_base`).

    Raises:
      ValueError: the views differ in their base (values or shapes), or in their
        clients' shapes (pad the index rows to one n_max first).
    """
    first = views[0]
    for i, v in enumerate(views[1:], 1):
        same = (jax.tree.structure(v.base_x) == jax.tree.structure(first.base_x)
                and (v.maps is None) == (first.maps is None)
                and all(a.shape == b.shape and bool(jnp.array_equal(a, b)) for a, b in zip(
                    jax.tree.leaves((v.base_x, v.base_y, v.maps)),
                    jax.tree.leaves((first.base_x, first.base_y, first.maps)), strict=True)))
        if not same:
            raise ValueError(f"views {i} and 0 index different bases; stack_views shares one.")
        if v.rows.shape != first.rows.shape:
            raise ValueError(f"views {i} has rows {v.rows.shape}, views 0 {first.rows.shape}: "
                             "stacking needs one [m, n_max].")
    leaves = [jnp.stack(column) for column in zip(*(v.client_leaves() for v in views),
                                                  strict=True)]
    rows, transform, count, cluster = leaves
    return first.replace(rows=rows, transform=transform, num_examples=count, cluster=cluster,
                         shared_base=True)


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
