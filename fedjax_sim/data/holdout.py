"""A validation split carved from each client's training rows, on the host.

`validation_split(data, fraction, seed)` deals every client's real rows at
random into a part to train on and a validation part of ⌊fraction·n_i⌋ rows
(at most n_i − 1: a client keeps a row to train on). Both parts keep the
data's kind (stored copies, or views of one base: only their index rows move),
its leading copies (seeds) axes and its width n_max, so one compiled
evaluation serves both. A comparison tuned on the validation part never reads
the test data to choose (`experiments.tuned`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data.federated import ClientViews, FederatedData


def validation_counts(num_examples, fraction: float) -> np.ndarray:
    """Validation rows of clients holding `num_examples` rows: ⌊fraction·n_i⌋, at most
    n_i − 1 (0 for a client of one row or none)."""
    n = np.asarray(num_examples, np.int64)
    return np.clip(np.floor(fraction * n + 1e-9).astype(np.int64), 0, np.maximum(n - 1, 0))


def _deal(num_examples: np.ndarray, width: int, fraction: float, seed: int):
    """Per client (any leading axes): row indices of the part kept for training and of the
    validation part ([..., width] each, real rows first in their original order, then
    zeros) and their counts."""
    n = np.asarray(num_examples, np.int64)
    rng = np.random.default_rng([seed, 0x7A11D])
    # A random order of each client's real rows: uniform keys, padding rows last.
    keys = np.where(np.arange(width) < n[..., None], rng.random(n.shape + (width,)), np.inf)
    order = np.argsort(keys, axis=-1, kind="stable")
    v = validation_counts(n, fraction)
    rank = np.argsort(order, axis=-1)  # row r's place in its client's random order
    real = np.arange(width) < n[..., None]
    in_val = real & (rank < v[..., None])
    in_fit = real & ~in_val

    def gather(mask):
        # Chosen rows first, each part in its original row order.
        idx = np.argsort(~mask, axis=-1, kind="stable")
        return np.where(np.arange(width) < mask.sum(-1, keepdims=True), idx, 0)

    return gather(in_fit), n - v, gather(in_val), v


def validation_split(data, fraction: float, seed: int):
    """(fit, val): `data` with each client's rows dealt into a training part and a
    validation part of `validation_counts(n_i, fraction)` rows.

    Args:
      data: FederatedData or ClientViews, with or without leading copies (seeds)
        axes; each copy's clients are dealt on their own.
      fraction: the validation share, in (0, 1).
      seed: the deal's seed (the same seed deals the same rows).

    Returns:
      Two sources of data's kind and shape; padding rows are zeros (views: the
      base's padding index).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"validation fraction must be in (0, 1); got {fraction!r}.")
    counts = np.asarray(data.num_examples)
    lead = counts.ndim  # the row axis of every per-client leaf
    rows = data.rows if isinstance(data, ClientViews) else data.y
    width = np.shape(rows)[lead]  # (max_examples reads a copy's shape, not a stack's)
    fit_idx, fit_n, val_idx, val_n = _deal(counts, width, fraction, seed)

    def take(a, idx, count, pad):
        a = np.asarray(a)
        i = idx.reshape(idx.shape + (1,) * (a.ndim - lead - 1))
        out = np.take_along_axis(a, np.broadcast_to(i, idx.shape + a.shape[lead + 1:]),
                                 axis=lead)
        keep = (np.arange(width) < count[..., None]).reshape(
            idx.shape + (1,) * (a.ndim - lead - 1))
        return jnp.asarray(np.where(keep, out, np.asarray(pad, a.dtype)))

    def part(idx, count):
        n = jnp.asarray(count, jnp.int32)
        if isinstance(data, FederatedData):
            return data.replace(x=jax.tree.map(lambda a: take(a, idx, count, 0), data.x),
                                y=take(data.y, idx, count, 0), num_examples=n)
        if isinstance(data, ClientViews):
            base = np.asarray(data.base_y).shape[0 if data.shared_base else lead]
            return data.replace(rows=take(data.rows, idx, count, base), num_examples=n)
        raise ValueError(f"a validation split takes FederatedData or ClientViews; got "
                         f"{type(data).__name__}.")

    return part(fit_idx, fit_n), part(val_idx, val_n)


__all__ = ["validation_counts", "validation_split"]
