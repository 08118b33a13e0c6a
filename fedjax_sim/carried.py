"""Static values that ride on client data (the executor's `Plan`, a `Systems`).

A client source holds such a value in a static field `NAME` and sets it with its
method `with_NAME`; these two functions find and set it through any pytree that
holds client sources. This module imports nothing from fedjax_sim.
"""

from __future__ import annotations

import jax


def _carrier(name: str):
    return lambda node: hasattr(node, name) and hasattr(node, f"with_{name}")


def carried(data, name: str, default):
    """`data.NAME` of a client source, or of the first one in a pytree (`default` if none)."""
    is_carrier = _carrier(name)
    if is_carrier(data):
        return getattr(data, name)
    for node in jax.tree.leaves(data, is_leaf=is_carrier):
        if is_carrier(node):
            return getattr(node, name)
    return default


def carrying(data, name: str, value):
    """`data` (a client source, or a pytree holding them) with every client source's NAME
    set to `value` (`with_NAME`); other nodes as they are."""
    is_carrier = _carrier(name)
    if is_carrier(data):
        return getattr(data, f"with_{name}")(value)
    return jax.tree.map(lambda n: getattr(n, f"with_{name}")(value) if is_carrier(n) else n,
                        data, is_leaf=is_carrier)
