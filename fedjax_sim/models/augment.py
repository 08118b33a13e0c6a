"""Train-time image augmentation as pure functions of a key (a model's `augment`).

The rotated-CIFAR protocol (docs/protocols.md#ifca-rotated-cifar) trains on the TF CIFAR-10
tutorial's distorted views: a random 24×24 crop, a random left-right flip,
random brightness and random contrast, then per-image standardization; tests
on the center crop. The official IFCA code (`ifca:cifar/train_cluster_cifar_tf.py`,
`train_transform`) applies the tutorial's ops to a whole minibatch tensor, so
one crop offset, one brightness delta and one contrast factor are drawn per
minibatch and the flip per image; `tutorial_augment` does the same, with its
brightness max_delta of 63 on [0, 1] images (that code's quirk).

Shapes stay fixed: the distorted crop is written back at the center of the
uncropped image, where the model's own preprocessing (center crop, then
per-image standardization, `zoo.CifarTrunk(crop=24)`) reads it. So a model
takes the same [n, 32, 32, 3] arrays in training, in cluster choice and in
evaluation, and only local steps see distorted views.

Note: per-image standardization removes a constant offset, so the brightness
delta cancels up to float rounding; the contrast factor scales each value's
deviation from its channel's mean, so after standardization it changes only
how much the channels' mean differences (the colour cast) weigh. Both are
kept because the official code applies them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

CROP = 24


def tutorial_distort(x, top, left, flip, delta, factor, *, size: int = CROP):
    """The distorted view of a batch x [b, H, W, C], given its random draws.

    Args:
      x: images [b, H, W, C].
      top, left: the size×size crop's corner (scalars: one for the batch).
      flip: [b] bool, images mirrored left-right.
      delta: brightness, added to every value (scalar).
      factor: contrast: (v − mean)·factor + mean, the mean per image and channel
        of the crop (tf.image.adjust_contrast; scalar).

    Returns:
      x's shape, with the distorted crop written at the center.
    """
    b, h, w, c = x.shape
    crop = jax.lax.dynamic_slice(x, (0, top, left, 0), (b, size, size, c))
    crop = jnp.where(flip[:, None, None, None], crop[:, :, ::-1], crop)
    crop = crop + delta
    mean = jnp.mean(crop, axis=(1, 2), keepdims=True)
    crop = (crop - mean) * factor + mean
    return jax.lax.dynamic_update_slice(x, crop, (0, (h - size) // 2, (w - size) // 2, 0))


def tutorial_augment(key, x, *, size: int = CROP, max_delta: float = 63.0,
                     contrast: tuple[float, float] = (0.2, 1.8)):
    """`tutorial_distort` with the official code's draws: one crop corner uniform over the
    valid corners, one brightness delta in [−max_delta, max_delta), one contrast factor in
    [lower, upper) per batch; a fair coin per image for the flip."""
    b, h, w, _ = x.shape
    k_crop, k_flip, k_bright, k_contrast = jax.random.split(key, 4)
    top, left = jax.random.randint(k_crop, (2,), 0, jnp.array([h - size + 1, w - size + 1]))
    flip = jax.random.bernoulli(k_flip, 0.5, (b,))
    delta = jax.random.uniform(k_bright, (), minval=-max_delta, maxval=max_delta)
    factor = jax.random.uniform(k_contrast, (), minval=contrast[0], maxval=contrast[1])
    return tutorial_distort(x, top, left, flip, delta, factor, size=size)


def center_crop(x, size: int = CROP):
    """The central size×size crop of a batch [b, H, W, ...]."""
    h, w = x.shape[1:3]
    top, left = (h - size) // 2, (w - size) // 2
    return x[:, top: top + size, left: left + size]


def standardize_per_image(x):
    """(v − mean) / max(std, 1/√pixels) per image, as tf.image.per_image_standardization."""
    axes = tuple(range(1, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    pixels = math.prod(x.shape[1:])
    std = jnp.maximum(jnp.std(x, axis=axes, keepdims=True), 1.0 / math.sqrt(pixels))
    return (x - mean) / std


__all__ = ["CROP", "center_crop", "standardize_per_image", "tutorial_augment", "tutorial_distort"]
