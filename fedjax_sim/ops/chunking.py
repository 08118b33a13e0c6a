"""The client axis in chunks: peak memory O(chunk × model size), not O(m × model size)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_client_chunk(client_chunk) -> None:
    """Raises ValueError unless client_chunk is None (all clients at once) or an int >= 1."""
    if client_chunk is None:
        return
    if isinstance(client_chunk, bool) or not isinstance(client_chunk, int) or client_chunk < 1:
        raise ValueError(
            f"client_chunk must be None (all clients at once) or an integer >= 1; "
            f"got {client_chunk!r}."
        )


def scan_client_chunks(fn, carry, clients, client_chunk: int):
    """A `lax.scan` over the client axis, `client_chunk` clients per step.

    Each step gathers its chunk of `clients` (no copy of the whole axis is
    made, so a [m, n, ...] data array is read in place). When m is not a
    multiple of the chunk, the last chunk is padded with copies of the last
    client: real inputs, so they cannot produce NaNs of their own, but `fn`
    must give them weight 0 (`valid` is False there), and their outputs are
    cut off.

    Args:
      fn: (carry, part, valid) -> (carry, out). `part` is `clients` with
        leaves [c, ...] (c = min(client_chunk, m)); `valid` is [c] bool; `out`
        is a pytree of per-client outputs, leaves [c, ...].
      carry: initial accumulator (e.g. per-cluster sums).
      clients: pytree, leaves [m, ...] (data, ids, keys, per-client params).
      client_chunk: clients per step (static).

    Returns:
      (final carry, outputs with leaves [m, ...]).
    """
    check_client_chunk(client_chunk)
    m = jax.tree.leaves(clients)[0].shape[0]
    chunk = min(client_chunk, m)
    num_chunks = -(-m // chunk)

    def body(carry, start):
        pos = start + jnp.arange(chunk)
        valid = pos < m
        idx = jnp.minimum(pos, m - 1)
        part = jax.tree.map(lambda a: a[idx], clients)
        return fn(carry, part, valid)

    carry, outs = jax.lax.scan(body, carry, jnp.arange(num_chunks) * chunk)
    outs = jax.tree.map(lambda a: a.reshape((num_chunks * chunk,) + a.shape[2:])[:m], outs)
    return carry, outs


def map_client_chunks(fn, clients, client_chunk: int | None):
    """fn over the client axis, all at once (None) or `client_chunk` clients at a time.

    Args:
      fn: part -> per-client outputs (leaves [c, ...]), for any number c of
        clients; padding clients' outputs are discarded.
      clients: pytree, leaves [m, ...].

    Returns:
      fn(clients), computed chunk by chunk when client_chunk is set.
    """
    if client_chunk is None:
        return fn(clients)
    _, outs = scan_client_chunks(lambda c, part, _: (c, fn(part)), (), clients, client_chunk)
    return outs
