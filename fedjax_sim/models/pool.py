"""Max pooling whose gradient is a mask: `nn.max_pool`'s numbers, fast to train on a CPU.

`flax.linen.max_pool` is `lax.reduce_window`; its gradient is XLA's select-and-scatter,
which XLA's CPU backend rewrites into a reduce-window carrying one index array per
dimension plus a scatter. Inside the scanned, vmapped local steps of a CNN that costs
more than the convolution it follows (benchmarks/README.md, "conv_round.py").

`max_pool` takes `nn.max_pool`'s arguments. When the windows tile the input (strides
equal to the window, VALID padding: 2×2 pooling of stride 2, the common case) it is a
reshape and a max over the window axes, and its derivative routes each output's
cotangent to the *first* maximum of its window in row-major order — the element
select-and-scatter picks — so values and gradients equal `nn.max_pool`'s. Any other
pooling goes to `nn.max_pool` unchanged.

>>> import jax.numpy as jnp
>>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
>>> max_pool(x, (2, 2), strides=(2, 2))[0, :, :, 0]
Array([[ 5.,  7.],
       [13., 15.]], dtype=float32)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


def max_pool(x, window_shape: Sequence[int], strides: Sequence[int] | None = None,
             padding="VALID"):
    """`nn.max_pool(x, window_shape, strides, padding)` (x [n, spatial…, c]); tiling windows
    as a reshape whose gradient is the first-maximum mask, anything else by flax."""
    window = tuple(int(k) for k in window_shape)
    steps = tuple(int(s) for s in strides) if strides is not None else (1,) * len(window)
    if padding != "VALID" or steps != window or x.ndim != len(window) + 2:
        return nn.max_pool(x, window_shape, strides=strides, padding=padding)
    # VALID drops the rows and columns a last window would not fill.
    kept = tuple(slice(0, (size // k) * k) for size, k in zip(x.shape[1:-1], window,
                                                              strict=True))
    return _tiled_max(x[(slice(None), *kept, slice(None))], window)


def _windows(x, window):
    """[n, s_1, …, c] -> [n, s_1/k_1, k_1, s_2/k_2, k_2, …, c]."""
    shape = [x.shape[0]]
    for size, k in zip(x.shape[1:-1], window, strict=True):
        shape += [size // k, k]
    return x.reshape((*shape, x.shape[-1]))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _tiled_max(x, window):
    axes = tuple(2 + 2 * i for i in range(len(window)))
    return jnp.max(_windows(x, window), axis=axes)


def _first_maximum(x, y, window):
    """[n, s_1/k_1, k_1, …, c] bool: each window's first element (row-major) equal to y."""
    blocks = _windows(x, window)
    axes = tuple(2 + 2 * i for i in range(len(window)))
    at_max = blocks == jnp.expand_dims(y, axes)
    # Row-major position of each element within its window, and the first one at max.
    position = 0
    for axis, k in zip(axes, window, strict=True):
        index = jax.lax.broadcasted_iota(jnp.int32, blocks.shape, axis)
        position = position * k + index
    big = jnp.int32(2**30)
    first = jnp.min(jnp.where(at_max, position, big), axis=axes, keepdims=True)
    return position == first


@_tiled_max.defjvp
def _tiled_max_jvp(window, primals, tangents):
    (x,), (dx,) = primals, tangents
    y = _tiled_max(x, window)
    mask = _first_maximum(x, y, window)
    axes = tuple(2 + 2 * i for i in range(len(window)))
    return y, jnp.sum(jnp.where(mask, _windows(dx, window), 0), axis=axes)
