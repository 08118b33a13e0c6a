"""A model is pure functions: init, apply and a per-example loss.

Algorithms only ever call `client_loss`, which masks padded rows, so any flax
module plugs in through `from_flax`. A model may be split into a trunk (a
feature map g, shared by every cluster under weight sharing, and the place
where DRFLM mixes examples) and a head (features -> predictions, the part IFCA
clusters); `split_model` builds one, `partition`/`combine` move between the
whole params and the (shared, per-cluster) parts. A model may also carry a
train-time apply taking a key (`Model.train_apply`: dropout), which only local
optimizer steps call; `from_flax(..., train_kwargs=...)` builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.models import conv

Params = Any

TRUNK, HEAD = "trunk", "head"


class DenseInput(NamedTuple):
    """A model whose first layer is dense on the flattened input x [n, d]:

        apply(params, x) == rest(without_kernel(params), x.reshape(n, -1) @ kernel(params))

    path: the keys of the first layer's kernel [d, h] in params.
    rest: (params with None at `path`, z [n, h]) -> predictions: everything
      after the product, the first layer's bias included.
    """

    path: tuple[str, ...]
    rest: Callable[[Params, jax.Array], jax.Array]

    def kernel(self, params) -> jax.Array:
        for k in self.path:
            params = params[k]
        return params

    def with_kernel(self, params, kernel) -> Params:
        """params with `kernel` (None to drop it) at `path`; the other leaves shared."""

        def put(tree, keys):
            return kernel if not keys else {**tree, keys[0]: put(tree[keys[0]], keys[1:])}

        return put(params, self.path)

    def without_kernel(self, params) -> Params:
        return self.with_kernel(params, None)


class Model(NamedTuple):
    """Pure functions of one model.

    init: key -> params.
    apply: (params, x [n, ...]) -> predictions [n, ...] (x may be a pytree).
    example_loss: (predictions [n, ...], y [n, ...]) -> losses [n].
    correct: optional (predictions, y) -> [n] 1.0 where a prediction is right
      (classification); None for regression.
    structure: optional name of a structure that `ops/` has fused kernels
      for ("linear": y = xᵀθ with squared error, params a [d] vector).
      None: the generic vmap/VJP kernels.
    features, head: set on split models (`split_model`): params are
      {"trunk": ..., "head": ...}, features(params["trunk"], x) -> [n, f] and
      head(params["head"], features) -> predictions. None on plain models.
    augment: optional train-time view (key, x [b, ...]) -> x of the same
      shape: local optimizer steps (`ops.client_update`) train on augment of
      each minibatch, with a fresh key per step; cluster choice and
      evaluation see x as it is. Not applied where a frozen trunk's features
      are computed once (they are not images any more). None: no augmentation.
    dense_input: optional `DenseInput`: the first layer is dense on the
      flattened input, which lets `ops.client_update` train it in the span of
      the client's rows (far fewer multiply-adds when a client has fewer rows
      than the input has features). None: no such declaration.
    train_apply: optional train-time apply (params, x [n, ...], key) ->
      predictions [n, ...], e.g. with dropout active (`from_flax(...,
      train_kwargs=...)`): the model's loss in a local optimizer step
      (`ops.client_update`) is taken on it, with a fresh key per step
      (`ops.local_update.DROPOUT_STREAM`). Evaluation, cluster choice and every
      other loss use `apply`. Not used by a `batch_loss` hook (Ditto's personal
      steps, DRFLM's mixup), which calls what it chooses, nor by steps on a
      frozen trunk's features. None: local steps use `apply`.
    """

    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, Any], jax.Array]
    example_loss: Callable[[jax.Array, jax.Array], jax.Array]
    correct: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    structure: str | None = None
    features: Callable[[Params, Any], jax.Array] | None = None
    head: Callable[[Params, jax.Array], jax.Array] | None = None
    augment: Callable[[jax.Array, Any], Any] | None = None
    dense_input: DenseInput | None = None
    train_apply: Callable[[Params, Any, jax.Array], jax.Array] | None = None

    @property
    def is_split(self) -> bool:
        return self.features is not None

    def unsplit(self) -> Model:
        """The same network as one model (no trunk/head parts): its params are whole, so
        `partition` gives ({}, params) and `combine` gives them back. What an algorithm
        that does not share a trunk (IFCA without weight sharing) sees of a split model."""
        return self._replace(features=None, head=None)


def partition(model: Model, params) -> tuple[Params, Params]:
    """(shared, per_cluster) parts: (trunk, head) of a split model, ({}, params) otherwise."""
    if model.is_split:
        return params[TRUNK], params[HEAD]
    return {}, params


def combine(model: Model, shared, per_cluster) -> Params:
    """Inverse of `partition`."""
    if model.is_split:
        return {TRUNK: shared, HEAD: per_cluster}
    return per_cluster


def masked_mean(values: jax.Array, num_examples) -> jax.Array:
    """Mean of values[:num_examples] ([n] -> scalar); 0 for an empty client."""
    mask = jnp.arange(values.shape[0]) < num_examples
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.maximum(num_examples, 1)


def client_loss(model: Model, params, x, y, num_examples) -> jax.Array:
    """F_i(params): the mean loss over one client's real rows. Scalar."""
    return masked_mean(model.example_loss(model.apply(params, x), y), num_examples)


def client_accuracy(model: Model, params, x, y, num_examples) -> jax.Array:
    """Fraction of correct predictions over one client's real rows. Scalar."""
    if model.correct is None:
        raise ValueError("this model has no accuracy (regression); use the loss instead.")
    return masked_mean(model.correct(model.apply(params, x), y), num_examples)


def check_model_data(model: Model, params, data) -> None:
    """Raises ValueError, naming the argument, when the model cannot take `data`.

    Uses shapes only (`jax.eval_shape`): the model must accept one client's
    features, and its per-example loss against that client's targets must be
    one value per row ([n]); a scalar-output model given [n, 1] labels would
    otherwise broadcast to an [n, n] loss silently.
    """

    def one_client(a):
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype)

    x = jax.tree.map(one_client, data.x)
    y = one_client(data.y)
    n = y.shape[0]
    try:
        pred = jax.eval_shape(model.apply, params, x)
    except (TypeError, ValueError, flax.errors.FlaxError) as err:  # flax: a param's shape
        shapes = jax.tree.map(lambda a: tuple(a.shape), x)
        raise ValueError(
            f"data.x does not fit the model: one client's features have shape {shapes} "
            f"([n_max, ...]); the model's apply failed with: {str(err).splitlines()[0]}"
        ) from None
    try:
        loss = jax.eval_shape(model.example_loss, pred, y)
    except (TypeError, ValueError) as err:
        raise ValueError(
            f"data.y does not fit the model: predictions have shape {pred.shape}, labels "
            f"{y.shape}; the loss failed with: {str(err).splitlines()[0]}"
        ) from None
    if loss.shape != (n,):
        raise ValueError(
            f"data.y has shape {tuple(y.shape)} per client but the model predicts "
            f"{tuple(pred.shape)}: the per-example loss would have shape {loss.shape}, not "
            f"({n},). Give labels shaped like the predictions (e.g. [m, n] for a scalar "
            "output)."
        )
    _check_label_range(model, pred, data)


def _check_label_range(model: Model, pred, data) -> None:
    """Integer class labels of real rows must lie in [0, classes) when their values are known.

    Out of range, softmax cross-entropy reads a missing logit (NaN) and the run
    "diverges" at its first round. Known when `data` is concrete (not traced):
    `simulate.run` traces `init` once with the data closed over for this.
    Only for classifiers whose predictions are per-class scores (`correct` is
    `argmax_correct`); other integer targets (item ids of a recommender) are
    not class indices of the predictions.
    """
    y, counts = data.y, data.num_examples
    if (
        model.correct is not argmax_correct
        or isinstance(y, jax.core.Tracer)
        or isinstance(counts, jax.core.Tracer)
        or not jnp.issubdtype(y.dtype, jnp.integer)
        or len(pred.shape) != y.ndim
        or not getattr(y, "is_fully_addressable", True)
    ):
        return
    classes = pred.shape[-1]
    labels = np.asarray(y)
    real = np.arange(labels.shape[1])[None, :] < np.asarray(counts)[:, None]
    real = real.reshape(real.shape + (1,) * (labels.ndim - 2))
    bad = real & ((labels < 0) | (labels >= classes))
    if bad.any():
        values = labels[bad]
        raise ValueError(
            f"data.y holds labels outside [0, {classes}) (the model's {classes} classes): "
            f"{bad.sum()} real rows, values in [{values.min()}, {values.max()}]."
        )


def squared_error(pred, y):
    """(y − ŷ)², no ½: the official IFCA code uses torch MSELoss."""
    return jnp.square(pred - y)


def linear_regression(d: int) -> Model:
    """y = xᵀθ, no bias; θ^(0) ~ Bernoulli(0.5)^d as in the official IFCA code.

    Declares structure "linear", so `ops` uses its fused kernels
    (`ops/linear.py`); they equal the generic path to float rounding (tested).
    """
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"d must be an integer >= 1; got {d!r}.")

    def init(key):
        return jax.random.bernoulli(key, 0.5, (d,)).astype(jnp.float32)

    def apply(theta, x):
        return x @ theta

    return Model(init, apply, squared_error, structure="linear")


def softmax_cross_entropy(logits, labels):
    """Cross-entropy against integer labels: logits [..., C], labels [...] -> losses [...].

    optax's formula, logsumexp(logits) − logits[label], and its values bit for bit
    (negative labels count from the end, out-of-range ones give NaN, as its
    `take_along_axis` does), but the label's logit is picked with a one-hot select, not a
    gather: the gather's transpose is two scatter-adds per local step, serial loops on
    XLA:CPU; the select's transpose is elementwise and fuses with the softmax's.
    """
    classes = logits.shape[-1]
    labels = jnp.where(labels < 0, labels + classes, labels)
    picked = jnp.sum(jnp.where(labels[..., None] == jnp.arange(classes), logits, 0.0), axis=-1)
    picked = jnp.where((labels >= 0) & (labels < classes), picked, jnp.nan)
    return jax.nn.logsumexp(logits, axis=-1) - picked


def soft_cross_entropy(logits, targets):
    """Cross-entropy against soft labels [n, classes] (rows summing to 1), as mixup makes."""
    return optax.softmax_cross_entropy(logits, targets)


def argmax_correct(logits, labels):
    return (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)


def check_train_kwargs(train_kwargs, name: str = "train_kwargs") -> dict | None:
    """train_kwargs as a dict (None stays None); ValueError naming `name` otherwise."""
    if train_kwargs is None:
        return None
    if not isinstance(train_kwargs, Mapping) or not all(
        isinstance(k, str) and k.isidentifier() for k in train_kwargs
    ):
        raise ValueError(
            f"{name} must be None or a dict of the module's keyword arguments in training, "
            f"e.g. {{'train': True}} or {{'deterministic': False}}; got {train_kwargs!r}."
        )
    return dict(train_kwargs)


def check_train_rngs(train_rngs) -> tuple[str, ...]:
    """train_rngs as a tuple of distinct names; ValueError naming it otherwise."""
    names = (train_rngs,) if isinstance(train_rngs, str) else train_rngs
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if (
        not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"train_rngs must be one or more distinct rng collection names, e.g. "
            f"('dropout',); got {train_rngs!r}."
        )
    return names


def train_rngs_of(names: tuple[str, ...], key) -> dict:
    """The `rngs` of one training call: the key itself for one collection, else
    `jax.random.split(key, len(names))` in the order of the names."""
    if len(names) == 1:
        return {names[0]: key}
    return dict(zip(names, jax.random.split(key, len(names)), strict=True))


def _check_train_apply(train_apply, init, example_input, settings: str) -> None:
    """ValueError, in one line naming `settings`, when the train apply cannot run on
    `example_input` (shapes only: `jax.eval_shape`)."""
    try:
        params = jax.eval_shape(init, jax.random.key(0))
        jax.eval_shape(train_apply, params, example_input, jax.random.key(0))
    except (TypeError, ValueError, flax.errors.FlaxError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise ValueError(
            f"{settings} do not fit the module: its training call failed with: {first}"
        ) from None


def from_flax(
    module: nn.Module,
    example_input,
    example_loss=softmax_cross_entropy,
    correct=argmax_correct,
    *,
    conv_form: str | None = None,
    train_kwargs: dict | None = None,
    train_rngs=("dropout",),
) -> Model:
    """Wraps a flax module taking a batch [n, ...] into a Model.

    conv_form: the form its `nn.Conv` layers run in (`models.conv`): "auto" (patches ×
      kernel as one GEMM on CPU, XLA's convolution on GPU/TPU), "patches" or "xla";
      None: the environment variable FEDJAX_SIM_CONV_FORM, else "auto". Same numbers
      to float rounding in every form.
    train_kwargs: how local optimizer steps call the module, for dropout: None (default):
      as evaluation does, `module.apply({"params": p}, x)` (no `train_apply`); a dict,
      e.g. {"train": True} or {"deterministic": False}: `Model.train_apply(p, x, key)` is
      `module.apply({"params": p}, x, **train_kwargs, rngs=...)`, with `rngs` the step's
      key for each of `train_rngs` (`train_rngs_of`: {"dropout": key} by default).
      `apply` (evaluation, cluster choice) stays the call without them.
    train_rngs: the rng collections the training call draws (default ("dropout",)).

    Raises:
      ValueError: a bad conv_form, train_kwargs or train_rngs, or train_kwargs the
        module's call does not take (checked on shapes, `jax.eval_shape`).

    Examples:
      >>> import flax.linen as nn
      >>> import jax, jax.numpy as jnp
      >>> class Net(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x, train: bool = False):
      ...         x = nn.Dropout(0.5)(nn.relu(nn.Dense(8)(x)), deterministic=not train)
      ...         return nn.Dense(3)(x)
      >>> model = from_flax(Net(), jnp.zeros((1, 4)), train_kwargs={"train": True})
      >>> p, x = model.init(jax.random.key(0)), jnp.ones((2, 4))
      >>> bool(jnp.all(model.apply(p, x) == Net().apply({"params": p}, x)))
      True
      >>> k = jax.random.key(1)
      >>> want = Net().apply({"params": p}, x, train=True, rngs={"dropout": k})
      >>> bool(jnp.all(model.train_apply(p, x, k) == want))
      True
    """
    conv_form = conv.check_conv_form(conv_form)
    train_kwargs = check_train_kwargs(train_kwargs)
    train_rngs = check_train_rngs(train_rngs)

    def init(key):
        return module.init(key, example_input)["params"]

    def apply(params, x):
        with conv.conv_context(conv_form):
            return module.apply({"params": params}, x)

    if train_kwargs is None:
        return Model(init, apply, example_loss, correct)

    def train_apply(params, x, key):
        with conv.conv_context(conv_form):
            return module.apply(
                {"params": params}, x, **train_kwargs, rngs=train_rngs_of(train_rngs, key)
            )

    _check_train_apply(
        train_apply,
        init,
        example_input,
        f"train_kwargs={train_kwargs!r} with train_rngs={train_rngs!r}",
    )
    return Model(init, apply, example_loss, correct, train_apply=train_apply)


def split_model(
    trunk: nn.Module,
    head: nn.Module,
    example_input,
    example_loss=softmax_cross_entropy,
    correct=argmax_correct,
    *,
    conv_form: str | None = None,
    train_kwargs: dict | None = None,
    head_train_kwargs: dict | None = None,
    train_rngs=("dropout",),
) -> Model:
    """A Model made of a trunk (features g(x)) and a head (features -> predictions).

    Params are {"trunk": ..., "head": ...}; the two parts get independent
    init keys. conv_form: as in `from_flax`.

    train_kwargs, head_train_kwargs: how local optimizer steps call the trunk and the
      head (as `from_flax`'s train_kwargs, e.g. {"train": True}); when either is set,
      `train_apply(p, x, key)` runs the trunk on rngs from `jax.random.split(key)[0]`
      and the head on rngs from `[1]` (`train_rngs_of`), a part without its kwargs as
      `apply` runs it. `features` and `head` (mixup's embeddings, a frozen trunk's
      features) stay the calls without them.
    """
    conv_form = conv.check_conv_form(conv_form)
    train_kwargs = check_train_kwargs(train_kwargs)
    head_train_kwargs = check_train_kwargs(head_train_kwargs, "head_train_kwargs")
    train_rngs = check_train_rngs(train_rngs)

    def run(module, params, x, kwargs=None, key=None):
        with conv.conv_context(conv_form):
            if kwargs is None:
                return module.apply({"params": params}, x)
            return module.apply(
                {"params": params}, x, **kwargs, rngs=train_rngs_of(train_rngs, key)
            )

    def features(trunk_params, x):
        return run(trunk, trunk_params, x)

    def head_apply(head_params, f):
        return run(head, head_params, f)

    def init(key):
        k_trunk, k_head = jax.random.split(key)
        # .get: a parameter-free trunk (flattening, for logistic regression) has no "params".
        trunk_params = trunk.init(k_trunk, example_input).get("params", {})
        f = jax.eval_shape(features, trunk_params, example_input)
        head_params = head.init(k_head, jnp.zeros(f.shape, f.dtype))["params"]
        return {TRUNK: trunk_params, HEAD: head_params}

    def apply(params, x):
        return head_apply(params[HEAD], features(params[TRUNK], x))

    model = Model(init, apply, example_loss, correct, features=features, head=head_apply)
    if train_kwargs is None and head_train_kwargs is None:
        return model

    def train_apply(params, x, key):
        k_trunk, k_head = jax.random.split(key)
        f = run(trunk, params[TRUNK], x, train_kwargs, k_trunk)
        return run(head, params[HEAD], f, head_train_kwargs, k_head)

    _check_train_apply(
        train_apply,
        init,
        example_input,
        f"train_kwargs={train_kwargs!r}, head_train_kwargs="
        f"{head_train_kwargs!r} with train_rngs={train_rngs!r}",
    )
    return model._replace(train_apply=train_apply)
