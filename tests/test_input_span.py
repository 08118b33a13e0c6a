"""The dense input layer trained in the span of a client's rows (`ops.client_update`).

References are per-client numpy float64 loops of plain SGD (and heavy-ball momentum) on
a ReLU MLP with softmax cross-entropy, written here from the textbook backward pass: they
know nothing of the span form.
"""

from __future__ import annotations

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import ifca
from fedjax_sim.algorithms import sgd as sgd_training  # `sgd` here is optax's
from fedjax_sim.data import FederatedData
from fedjax_sim.models import mlp_classifier
from fedjax_sim.ops import (
    LinearInGradients,
    client_update,
    epoch_batches,
    input_span_pays,
    linear_in_gradients,
    local_update,
    sample_batch,
)

SHAPE, CLASSES = (12, 10), 5  # 120 input features: many more than a client's rows


def _layers(params, split: bool):
    """[(W, b), ...] in float64, input layer first."""
    if split:
        trunk = params["trunk"]
        dense = [trunk[f"Dense_{i}"] for i in range(len(trunk))] + [params["head"]]
    else:
        dense = [params[f"Dense_{i}"] for i in range(len(params))]
    return [(np.asarray(p["kernel"], np.float64), np.asarray(p["bias"], np.float64))
            for p in dense]


def _np_loss_and_grads(layers, x, y, mask):
    """Masked mean softmax cross-entropy of a ReLU MLP and its gradients (numpy, float64)."""
    acts, h = [], x.reshape(len(x), -1)
    for i, (w, b) in enumerate(layers):
        acts.append(h)
        z = h @ w + b
        h = np.maximum(z, 0.0) if i < len(layers) - 1 else z
    logits = h - h.max(axis=1, keepdims=True)
    prob = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    count = max(mask.sum(), 1.0)
    loss = float(np.sum(mask * -np.log(prob[np.arange(len(y)), y])) / count)
    g = prob.copy()
    g[np.arange(len(y)), y] -= 1.0
    g *= mask[:, None] / count
    grads = [None] * len(layers)
    for i in range(len(layers) - 1, -1, -1):
        w, _ = layers[i]
        grads[i] = (acts[i].T @ g, g.sum(axis=0))
        if i:
            g = (g @ w.T) * (acts[i] > 0)
    return loss, grads


def _np_steps(layers, x, y, batches, lr, momentum):
    """SGD (trace = g + μ·trace; step −lr·trace) over the given (rows, mask) batches."""
    trace = [(np.zeros_like(w), np.zeros_like(b)) for w, b in layers]
    losses = []
    for idx, mask in batches:
        loss, grads = _np_loss_and_grads(layers, x[idx], y[idx], mask)
        losses.append(loss)
        trace = [(gw + (momentum or 0) * tw, gb + (momentum or 0) * tb)
                 for (gw, gb), (tw, tb) in zip(grads, trace, strict=True)]
        layers = [(w - lr * tw, b - lr * tb)
                  for (w, b), (tw, tb) in zip(layers, trace, strict=True)]
    return layers, np.array(losses)


def _federation(counts, n_max=8, seed=0):
    rng = np.random.default_rng(seed)
    m = len(counts)
    x = rng.random((m, n_max, *SHAPE), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=(m, n_max)).astype(np.int32)
    real = np.arange(n_max)[None, :] < np.asarray(counts)[:, None]
    x = np.where(real[:, :, None, None], x, 0.0).astype(np.float32)  # padding is zeros
    return FederatedData(x=jnp.asarray(x), y=jnp.asarray(y * real),
                         num_examples=jnp.asarray(counts, jnp.int32),
                         cluster=jnp.zeros(m, jnp.int32))


def _starts(model, m, seed=1):
    keys = jax.random.split(jax.random.key(seed), m)
    return jax.vmap(model.init)(keys)  # every client starts elsewhere


def _gram_products(fn, *args) -> list[tuple]:
    """Output shapes of the dot products in fn's jaxpr (scan bodies included)."""
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                shapes.append(tuple(eqn.outvars[0].aval.shape))
        for sub in jax.extend.core.subjaxprs(jaxpr):
            walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


@pytest.mark.parametrize("hidden", [(), (9,), (9, 4)])
@pytest.mark.parametrize("split", [False, True])
def test_mlp_declares_its_input_layer(hidden, split):
    model = mlp_classifier(SHAPE, hidden, CLASSES, split=split)
    params = model.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, *SHAPE))
    spec = model.dense_input
    z = x.reshape(3, -1) @ spec.kernel(params)
    chex.assert_shape(z, (3, hidden[0] if hidden else CLASSES))
    chex.assert_trees_all_close(spec.rest(spec.without_kernel(params), z),
                                model.apply(params, x), rtol=1e-6, atol=1e-6)
    assert spec.kernel(spec.without_kernel(params)) is None
    chex.assert_trees_all_equal(spec.with_kernel(params, spec.kernel(params)), params)


def test_input_span_pays_by_its_multiply_adds():
    # Rotated MNIST: 10 full-batch steps of 50 rows, 784 -> 200. Plain: 10·2·50·784·200 =
    # 156.8 M; span: 2·50·784·200 + 50²·784 + 10·50·50·200 = 22.64 M.
    assert input_span_pays(50, 50, 784, 200, 10)
    assert not input_span_pays(50, 50, 784, 200, 1)  # one step: the setup alone costs more
    assert not input_span_pays(2000, 50, 64, 32, 10)  # more rows than features
    # 2 steps of 10 rows of 30 (plain 2·2·10·d·h = 40dh): span 2·30dh + 900d + 600h.
    assert input_span_pays(30, 10, 1000, 100, 2) == (60 * 1000 * 100 + 900 * 1000
                                                     + 600 * 100 < 40 * 1000 * 100)


@pytest.mark.parametrize("sampling,batch_size", [("full", None), ("with_replacement", 3),
                                                 ("epochs", 3)])
@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("hidden,split", [((9,), False), ((9, 4), True), ((), False)])
def test_span_steps_equal_a_per_client_loop(sampling, batch_size, momentum, hidden, split):
    """Clients of 8, 5, 1 and 0 real rows (8 padded), 6 steps, each from its own params."""
    model = mlp_classifier(SHAPE, hidden, CLASSES, split=split)
    counts = [8, 5, 1, 0]
    data, m, steps, lr = _federation(counts), len(counts), 6, 0.3
    opt = linear_in_gradients(optax.sgd(lr, momentum=momentum))
    start = _starts(model, m)
    keys = jax.random.split(jax.random.key(7), m)
    kwargs = {"num_steps": steps, "batch_size": batch_size,
              "sampling": "with_replacement" if sampling == "full" else sampling}
    one = jax.tree.map(lambda a: a[0], start)
    assert (8, 8) in _gram_products(  # the span form is the one under test
        lambda p: client_update(model, opt, p, data.x[0], data.y[0], 8, keys[0], **kwargs)[0],
        one)
    params, _, losses = local_update(model, opt, start, data, keys, **kwargs)
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y)
    for i, n in enumerate(counts):
        if sampling == "full":
            batches = [(np.arange(8), (np.arange(8) < n).astype(np.float64))] * steps
        else:  # the documented key use (test_ops reproduces it for the plain steps)
            if sampling == "epochs":
                idx, mask = epoch_batches(jax.random.fold_in(keys[i], 2), n, 8, batch_size,
                                          steps)
            else:
                k_batch = jax.vmap(lambda k: jax.random.split(k)[0])(
                    jax.random.split(keys[i], steps))
                idx, mask = jax.vmap(lambda k, n=n: sample_batch(k, n, 8, batch_size))(k_batch)
            batches = list(zip(np.asarray(idx), np.asarray(mask, np.float64), strict=True))
        want, want_losses = _np_steps(_layers(jax.tree.map(lambda a, i=i: a[i], start), split),
                                      x[i], y[i], batches, lr, momentum)
        got = _layers(jax.tree.map(lambda a, i=i: a[i], params), split)
        for (w, b), (gw, gb) in zip(want, got, strict=True):
            np.testing.assert_allclose(gw, w, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(gb, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(losses[i], want_losses, rtol=1e-5, atol=1e-6)
    # The empty client has no gradient: it keeps its start exactly.
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[3], params),
                                jax.tree.map(lambda a: a[3], start))


def test_span_form_only_where_declared_and_cheaper():
    model = mlp_classifier(SHAPE, (9,), CLASSES)
    data = _federation([8])
    p = model.init(jax.random.key(0))
    x, y, key = data.x[0], data.y[0], jax.random.key(1)

    def grams(m, opt, **kw):
        return (8, 8) in _gram_products(
            lambda q: client_update(m, opt, q, x, y, 8, key, **kw)[0], p)

    sgd = optax.sgd(0.1)
    assert grams(model, linear_in_gradients(sgd), num_steps=3)
    assert not grams(model, sgd, num_steps=3)  # not declared linear
    assert not grams(model, linear_in_gradients(sgd), num_steps=1)  # does not pay
    assert not grams(model._replace(dense_input=None), linear_in_gradients(sgd), num_steps=3)
    assert not grams(model._replace(augment=lambda k, xb: xb), linear_in_gradients(sgd),
                     num_steps=3)

    def mixup_like(q, xb, yb, mb, _key):
        return jnp.sum(mb * model.example_loss(model.apply(q, xb), yb)) / jnp.sum(mb)

    assert not grams(model, linear_in_gradients(sgd), num_steps=3, batch_loss=mixup_like)
    assert not grams(model, linear_in_gradients(sgd), num_steps=3, keep_first_grad=True)


def test_a_declared_optimizer_is_not_the_undeclared_one():
    sgd = optax.sgd(0.1)
    declared = linear_in_gradients(sgd)
    assert isinstance(declared, LinearInGradients)
    assert declared != sgd and sgd != declared  # jit's static-argument cache tells them apart
    assert not isinstance(sgd, LinearInGradients)
    params = {"w": jnp.ones(3)}
    grads = {"w": jnp.arange(3.0)}
    chex.assert_trees_all_equal(declared.update(grads, declared.init(params), params)[0],
                                sgd.update(grads, sgd.init(params), params)[0])


def test_ifca_round_with_span_steps_equals_per_client_loop():
    """One IFCA option-II round (every client, k = 2, 3 full-batch steps) vs a loop: each
    client takes its lowest-loss cluster model, trains it in numpy, and each cluster model
    becomes the mean of its members' (a cluster without members keeps its model)."""
    model = mlp_classifier(SHAPE, (9,), CLASSES)
    counts = [8, 8, 6, 8, 7, 8]
    data, k, steps, lr = _federation(counts, seed=3), 2, 3, 0.2
    algorithm = ifca(model, sgd_training(lr, steps=steps), num_clusters=k, option="model")
    state = algorithm.init(jax.random.key(2), data)
    new, _ = jax.jit(algorithm.round)(state, data, jax.random.key(5))
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y)
    clusters = [_layers(jax.tree.map(lambda a, j=j: a[j], state.cluster_params), False)
                for j in range(k)]
    members = [[] for _ in range(k)]
    for i, n in enumerate(counts):
        mask = (np.arange(8) < n).astype(np.float64)
        j = int(np.argmin([_np_loss_and_grads(c, x[i], y[i], mask)[0] for c in clusters]))
        trained, _ = _np_steps(clusters[j], x[i], y[i], [(np.arange(8), mask)] * steps, lr,
                               None)
        members[j].append(trained)
    assert all(members)  # both clusters are used: the averaging is under test
    got = [_layers(jax.tree.map(lambda a, j=j: a[j], new.cluster_params), False)
           for j in range(k)]
    for j in range(k):  # option II's default cluster mean is uniform over members
        for layer, (gw, gb) in enumerate(got[j]):
            for part, value in ((0, gw), (1, gb)):
                want = np.mean([t[layer][part] for t in members[j]], axis=0)
                np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-6)


def test_integer_pixels_train_as_their_float_values():
    """uint8 images: the Gram matrix of their rows must not sum in uint8 (it would wrap)."""
    model = mlp_classifier(SHAPE, (9,), CLASSES)
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 256, size=(8, *SHAPE)).astype(np.uint8)
    y = jnp.asarray(rng.integers(0, CLASSES, size=8).astype(np.int32))
    p = model.init(jax.random.key(0))
    opt = linear_in_gradients(optax.sgd(1e-5))

    def train(x):
        return client_update(model, opt, p, x, y, 8, jax.random.key(1), num_steps=3)

    assert (8, 8) in _gram_products(lambda q: train(jnp.asarray(pixels))[0], p)
    got, _, got_losses = train(jnp.asarray(pixels))
    want, _, want_losses = train(jnp.asarray(pixels, jnp.float32))
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(got_losses, want_losses, rtol=1e-6)
