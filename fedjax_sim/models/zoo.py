"""Flax modules of the papers' experiments."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.models.augment import center_crop, standardize_per_image, tutorial_augment
from fedjax_sim.models.core import DenseInput, Model, from_flax, split_model
from fedjax_sim.models.pool import max_pool

#: Dense-layer initialisations of the MLPs: "flax" (nn.Dense's: LeCun-normal weights, zero
#: biases) or "torch" (torch.nn.Linear's: weights and biases uniform on ±1/√fan_in, which
#: its kaiming_uniform(a=√5) amounts to; the official IFCA MNIST code's).
WEIGHT_INITS = ("flax", "torch")


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def dense(width: int, fan_in: int, weight_init: str = "flax") -> nn.Dense:
    """An nn.Dense layer of `width` outputs on `fan_in` inputs, initialised as `weight_init`."""
    if weight_init == "flax":
        return nn.Dense(width)
    if weight_init != "torch":
        raise ValueError(f"weight_init must be one of {WEIGHT_INITS}; got {weight_init!r}.")
    bound = 1.0 / math.sqrt(fan_in)
    return nn.Dense(width, kernel_init=_uniform(bound), bias_init=_uniform(bound))


class MLP(nn.Module):
    """ReLU multilayer perceptron on flattened inputs."""

    hidden: Sequence[int]
    outputs: int
    weight_init: str = "flax"

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(dense(width, x.shape[-1], self.weight_init)(x))
        return dense(self.outputs, x.shape[-1], self.weight_init)(x)


class MLPTrunk(nn.Module):
    """The hidden layers of `MLP`: flattened input -> last hidden activations."""

    hidden: Sequence[int]
    weight_init: str = "flax"

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in self.hidden:
            x = nn.relu(dense(width, x.shape[-1], self.weight_init)(x))
        return x


def _is_size(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def _check_num_classes(num_classes) -> None:
    if not _is_size(num_classes):
        raise ValueError(f"num_classes must be an integer >= 1; got {num_classes!r}.")


def _check_input_shape(input_shape) -> tuple[int, ...]:
    """input_shape as a tuple of positive ints (ValueError naming it otherwise)."""
    try:
        shape = tuple(input_shape)
    except TypeError:
        shape = None
    if shape is None or not all(_is_size(v) for v in shape):
        raise ValueError(
            f"input_shape must be a sequence of integers >= 1 (one example's shape); got "
            f"{input_shape!r}.")
    return tuple(int(v) for v in shape)


def mlp_classifier(
    input_shape: Sequence[int], hidden: Sequence[int], num_classes: int, *, split: bool = False,
    weight_init: str = "flax",
) -> Model:
    """An MLP with softmax cross-entropy (e.g. 784-200-10 for rotated MNIST).

    split=True makes the hidden layers the trunk and the last Dense layer the
    head (IFCA weight sharing clusters only the head). weight_init: one of
    `WEIGHT_INITS`, for every layer.

    Raises:
      ValueError: input_shape, a hidden width or num_classes is not a positive
        integer, or weight_init is not one of WEIGHT_INITS.
    """
    input_shape = _check_input_shape(input_shape)
    try:
        widths = tuple(hidden)
    except TypeError:
        widths = None
    if widths is None or not all(_is_size(w) for w in widths):
        raise ValueError(
            f"hidden must be a sequence of layer widths, integers >= 1 (empty: no hidden "
            f"layer); got {hidden!r}.")
    hidden = tuple(int(w) for w in widths)
    _check_num_classes(num_classes)
    if weight_init not in WEIGHT_INITS:
        raise ValueError(f"weight_init must be one of {WEIGHT_INITS}; got {weight_init!r}.")
    example = jnp.zeros((1, *input_shape), jnp.float32)
    if split:
        head_in = hidden[-1] if hidden else math.prod(input_shape)
        model = split_model(MLPTrunk(tuple(hidden), weight_init),
                            dense(num_classes, head_in, weight_init), example)
    else:
        model = from_flax(MLP(tuple(hidden), num_classes, weight_init), example)
    return model._replace(dense_input=_mlp_dense_input(len(hidden), split))


def _mlp_dense_input(num_hidden: int, split: bool) -> DenseInput:
    """`MLP` / `MLPTrunk` + head after their first product x @ W₀ (`DenseInput`)."""
    if split:  # trunk Dense_0..Dense_{L-1}, then the head's Dense
        def layers(p):
            return [p["trunk"][f"Dense_{i}"] for i in range(num_hidden)] + [p["head"]]
        path = ("trunk", "Dense_0", "kernel") if num_hidden else ("head", "kernel")
    else:
        def layers(p):
            return [p[f"Dense_{i}"] for i in range(num_hidden + 1)]
        path = ("Dense_0", "kernel")

    def rest(params, z):
        first, *after = layers(params)
        h = z + first["bias"]
        for layer in after:
            h = nn.relu(h) @ layer["kernel"] + layer["bias"]
        return h

    return DenseInput(path, rest)


# ----------------------------------------------------------------------------- IFCA image models
# Each model below is a trunk (features) and a head (the last Dense layer), declared once in
# `_trunk_and_head`: split=True gives a split model (`split_model`, for IFCA weight sharing, which
# shares the trunk and clusters the head); split=False the same network as one flax module
# (`TrunkHead`), for every algorithm without weight sharing (the algorithms treat the params of a
# split model as (shared, per-cluster) parts). Both have params {"trunk": ..., "head": ...}.


class TrunkHead(nn.Module):
    """head(trunk(x)) as one module; params {"trunk": ..., "head": ...} like a split model."""

    trunk: nn.Module
    head: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.head(self.trunk(x))


def _trunk_and_head(trunk: nn.Module, head: nn.Module, example, split: bool) -> Model:
    if split:
        return split_model(trunk, head, example)
    return from_flax(TrunkHead(trunk, head), example)


class Flatten(nn.Module):
    """[n, ...] -> [n, features]: the (parameter-free) trunk of logistic regression."""

    @nn.compact
    def __call__(self, x):
        return x.reshape((x.shape[0], -1))


def logistic_classifier(input_shape: Sequence[int], num_classes: int, *,
                        split: bool = False) -> Model:
    """Multinomial logistic regression on flattened inputs (softmax cross-entropy).

    The trunk is the flattening (no parameters); the head is the one Dense layer.
    """
    input_shape = _check_input_shape(input_shape)
    _check_num_classes(num_classes)
    example = jnp.zeros((1, *input_shape), jnp.float32)
    return _trunk_and_head(Flatten(), nn.Dense(num_classes), example, split)


def local_response_norm(x, depth_radius: int = 4, bias: float = 1.0, alpha: float = 0.001 / 9.0,
                        beta: float = 0.75):
    """tf.nn.lrn over the channel axis: x / (bias + alpha · Σ_{|c'−c|≤r} x_c'²)^beta."""
    window = 2 * depth_radius + 1
    sq = jnp.pad(jnp.square(x), [(0, 0)] * (x.ndim - 1) + [(depth_radius, depth_radius)])
    csum = jnp.cumsum(sq, axis=-1)
    csum = jnp.concatenate([jnp.zeros_like(csum[..., :1]), csum], axis=-1)
    total = csum[..., window:] - csum[..., :-window]
    return x / jnp.power(bias + alpha * total, beta)


def _truncated(std: float):
    return nn.initializers.truncated_normal(stddev=std)


class CifarTrunk(nn.Module):
    """The TF r0.12 CIFAR-10 tutorial CNN up to its 192 features (`ifca:cifar/cifar10.py`).

    conv 5×5×64 (std 0.05) → ReLU → maxpool 3/2 → LRN → conv 5×5×64 (bias 0.1) → ReLU → LRN →
    maxpool 3/2 → fc 384 (std 0.04, bias 0.1) → fc 192 (std 0.04, bias 0.1), on [n, 24, 24, 3].
    crop: None takes x as it is; an int first takes x's center crop×crop and standardizes
    it per image (the tutorial's test-time input), so x can be the uncropped images.
    """

    crop: int | None = None

    @nn.compact
    def __call__(self, x):
        if self.crop is not None:
            x = standardize_per_image(center_crop(x, self.crop))
        x = nn.Conv(64, (5, 5), padding="SAME", kernel_init=_truncated(5e-2))(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        x = local_response_norm(x)
        x = nn.Conv(64, (5, 5), padding="SAME", kernel_init=_truncated(5e-2),
                    bias_init=nn.initializers.constant(0.1))(x)
        x = local_response_norm(nn.relu(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(384, kernel_init=_truncated(0.04),
                             bias_init=nn.initializers.constant(0.1), name="fc1")(x))
        return nn.relu(nn.Dense(192, kernel_init=_truncated(0.04),
                                bias_init=nn.initializers.constant(0.1), name="fc2")(x))


def cifar_cnn(num_classes: int = 10, input_shape: Sequence[int] = (24, 24, 3), *,
              split: bool = False, crop: int | None = None, augment: bool = False) -> Model:
    """The TF-tutorial CIFAR-10 CNN (docs/protocols.md#ifca-rotated-cifar); head: 192 → classes.

    crop: None for inputs already cropped and standardized; CROP (24) for uncropped
    [n, 32, 32, 3] images in [0, 1], which the model center-crops and standardizes
    itself. augment (needs crop): local steps train on the tutorial's distorted
    views (`augment.tutorial_augment`). The tutorial's L2 weight decay (0.004 on
    fc1/fc2) belongs to the optimizer: see `cifar_weight_decay_mask`.
    """
    _check_num_classes(num_classes)
    input_shape = _check_input_shape(input_shape)
    if augment and crop is None:
        raise ValueError("cifar_cnn(augment=True) needs crop: the distorted crop is written "
                         "at the center of the uncropped image, which the model crops.")
    example = jnp.zeros((1, *input_shape), jnp.float32)
    head = nn.Dense(num_classes, kernel_init=_truncated(1 / 192.0))
    model = _trunk_and_head(CifarTrunk(crop), head, example, split)
    if augment:
        model = model._replace(augment=functools.partial(tutorial_augment, size=crop))
    return model


def cifar_weight_decay_mask(params):
    """True on the fc1/fc2 kernels (the tutorial's weight-decayed variables), False elsewhere."""
    import jax

    def decayed(path, _):
        names = [getattr(p, "key", None) for p in path]
        return "kernel" in names and ("fc1" in names or "fc2" in names)

    return jax.tree_util.tree_map_with_path(decayed, params)


class FemnistTrunk(nn.Module):
    """The LEAF FEMNIST CNN up to its 2048 features (`ifca:femnist/ifca/models/femnist/cnn.py`).

    conv 5×5×32 → pool 2 → conv 5×5×64 → pool 2 → dense 3136 → 2048 ReLU, on [n, 28, 28]
    (or [n, 28, 28, 1], or flattened [n, 784]).
    """

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], 28, 28, 1))
        x = nn.relu(nn.Conv(32, (5, 5), padding="SAME")(x))
        x = max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(64, (5, 5), padding="SAME")(x))
        x = max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))
        return nn.relu(nn.Dense(2048)(x))


def femnist_cnn(num_classes: int = 62, *, split: bool = False) -> Model:
    """The LEAF FEMNIST CNN; the head is its last dense layer 2048 → classes (IFCA clusters it)."""
    _check_num_classes(num_classes)
    example = jnp.zeros((1, 28, 28), jnp.float32)
    return _trunk_and_head(FemnistTrunk(), nn.Dense(num_classes), example, split)


class SimpleCNN(nn.Module):
    """pfl-research's `simple_cnn` (its CIFAR-10 benchmark model), as a plain flax module.

    conv 3×3×32 (valid) → ReLU → conv 3×3×64 (valid) → ReLU → maxpool 2 → dropout 0.25 →
    flatten → dense 128 → ReLU → dropout 0.5 → dense classes; Glorot-uniform kernels and
    zero biases (pfl's Keras model; its PyTorch one draws the same kernels). On
    [n, 32, 32, 3]: 896 + 18 496 + 1 605 760 + 1 290 = 1 626 442 parameters for 10
    classes. x is cast to float32 and standardized per channel by the fixed `mean` and
    `std` (pfl standardizes its images by the training set's channel statistics).
    Dropout is active only with train=True and a "dropout" rng (`simple_cnn` passes
    both in local training steps).
    """

    num_classes: int = 10
    mean: tuple[float, ...] = (0.0,)
    std: tuple[float, ...] = (1.0,)

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = (x.astype(jnp.float32) - jnp.asarray(self.mean, jnp.float32)) / jnp.asarray(
            self.std, jnp.float32)
        glorot = nn.initializers.xavier_uniform()
        x = nn.relu(nn.Conv(32, (3, 3), padding="VALID", kernel_init=glorot)(x))
        x = nn.relu(nn.Conv(64, (3, 3), padding="VALID", kernel_init=glorot)(x))
        x = max_pool(x, (2, 2), strides=(2, 2))
        x = nn.Dropout(0.25)(x, deterministic=not train)
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(128, kernel_init=glorot)(x))
        x = nn.Dropout(0.5)(x, deterministic=not train)
        return nn.Dense(self.num_classes, kernel_init=glorot)(x)


def simple_cnn(num_classes: int = 10, input_shape: Sequence[int] = (32, 32, 3), *,
               mean: Sequence[float] = (0.0, 0.0, 0.0),
               std: Sequence[float] = (1.0, 1.0, 1.0), dropout: bool = True) -> Model:
    """pfl-research's `simple_cnn` (`SimpleCNN`) as a Model, softmax cross-entropy.

    mean, std: per-channel statistics the model standardizes its (uint8 or float)
    input by, e.g. the training images' (docs/protocols.md#cifar-10-pfl-research).
    dropout: True (pfl's training): local steps call the module with train=True and
    each step's own "dropout" key (`Model.train_apply`, `from_flax`'s train_kwargs),
    dropping 25 % and 50 %; False: they train it without dropout. Evaluation never
    drops.

    Raises:
      ValueError: num_classes or input_shape is not positive integers, the image is
        smaller than 6×6, mean/std do not have one positive value per channel, or
        dropout is not a bool.
    """
    _check_num_classes(num_classes)
    input_shape = _check_input_shape(input_shape)
    if len(input_shape) != 3 or min(input_shape[:2]) < 6:
        raise ValueError(f"input_shape must be (height, width, channels) of at least 6×6; got "
                         f"{input_shape!r}.")
    mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    channels = input_shape[-1]
    if len(mean) != channels or len(std) != channels or min(std) <= 0:
        raise ValueError(f"mean and std must give one value per channel ({channels}), std > 0; "
                         f"got mean={mean!r}, std={std!r}.")
    if not isinstance(dropout, (bool, np.bool_)):
        raise ValueError(f"dropout must be True or False; got {dropout!r}.")
    example = jnp.zeros((1, *input_shape), jnp.float32)
    return from_flax(SimpleCNN(num_classes, mean, std), example,
                     train_kwargs={"train": True} if dropout else None)
