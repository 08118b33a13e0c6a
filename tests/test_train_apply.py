"""Dropout in local steps: `Model.train_apply` (`from_flax(..., train_kwargs=...)`).

References are plain loops written here: SGD on a flax module called the way a flax
user trains with dropout, `module.apply({"params": p}, x, train=True, rngs={"dropout":
k})`, with the keys of the documented rule (`ops.client_update`'s docstring):

    step t of a client with key c:   k_t = jax.random.split(c, num_steps)[t]
    its dropout key:                 jax.random.fold_in(k_t, DROPOUT_STREAM)   (= 3)
    cohort slot j of a round key r:  c_j = jax.random.fold_in(jax.random.split(r)[1], j)
                                     (`ops.sample_cohort`: a key per slot)

Evaluation and every other loss call the module without them (deterministic).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.algorithms import fedavg, sgd
from fedjax_sim.data import FederatedData
from fedjax_sim.models import client_loss, from_flax, split_model
from fedjax_sim.models.zoo import simple_cnn
from fedjax_sim.ops import client_update, cluster_losses
from fedjax_sim.ops.local_update import DROPOUT_STREAM

D, CLASSES, LR, STEPS = 5, 3, 0.3, 3


class DropNet(nn.Module):
    """Dense 16 → ReLU → dropout 0.5 → dense 3, dropout active only with train=True."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dropout(0.5)(nn.relu(nn.Dense(16)(x)), deterministic=not train)
        return nn.Dense(CLASSES)(h)


class DropTrunk(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return nn.Dropout(0.3)(nn.relu(nn.Dense(8)(x)), deterministic=deterministic)


def _model(**kw):
    return from_flax(DropNet(), jnp.zeros((1, D)), **kw)


def _client(n_max=6, n=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_max, D)).astype(np.float32)
    y = rng.integers(0, CLASSES, n_max).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y), n


def _ce(logits, y, n):
    """Mean softmax cross-entropy over the first n rows (the client's real ones)."""
    logp = jax.nn.log_softmax(logits)
    per_row = -logp[jnp.arange(len(y)), y]
    return jnp.sum(jnp.where(jnp.arange(len(y)) < n, per_row, 0.0)) / max(n, 1)


def _loop(params, x, y, n, key, *, dropout: bool):
    """STEPS full-batch SGD steps at LR, written as a flax user would."""
    module = DropNet()
    keys = jax.random.split(key, STEPS)
    p = params
    for t in range(STEPS):

        def loss(q, t=t):
            if not dropout:
                return _ce(module.apply({"params": q}, x), y, n)
            k = jax.random.fold_in(keys[t], DROPOUT_STREAM)
            return _ce(module.apply({"params": q}, x, train=True, rngs={"dropout": k}), y, n)

        g = jax.grad(loss)(p)
        p = jax.tree.map(lambda a, b: a - LR * b, p, g)
    return p


def _assert_trees_close(got, want, rtol=1e-5, atol=1e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def _max_gap(a, b):
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_one_clients_steps_equal_a_loop_with_the_step_keys():
    model = _model(train_kwargs={"train": True})
    params = model.init(jax.random.key(0))
    x, y, n = _client()
    key = jax.random.key(7)
    got, _, _ = jax.jit(
        lambda p: client_update(model, optax.sgd(LR), p, x, y, n, key, num_steps=STEPS)
    )(params)
    want = _loop(params, x, y, n, key, dropout=True)
    _assert_trees_close(got, want)
    # dropout is active: the steps move away from the deterministic ones
    assert _max_gap(want, _loop(params, x, y, n, key, dropout=False)) > 1e-3


def test_a_model_without_train_apply_trains_as_before():
    """No train_kwargs: no train_apply, the steps are the deterministic loop's."""
    model = _model()
    assert model.train_apply is None
    params = model.init(jax.random.key(0))
    x, y, n = _client()
    key = jax.random.key(7)
    got, _, _ = client_update(model, optax.sgd(LR), params, x, y, n, key, num_steps=STEPS)
    _assert_trees_close(got, _loop(params, x, y, n, key, dropout=False))


def test_a_train_apply_moves_no_other_key():
    """Minibatches and augmentation draw the same keys with or without a train_apply: a
    train_apply that ignores its key gives the very same bits."""

    def augment(k, xb):
        return xb + 0.1 * jax.random.normal(k, xb.shape)

    plain = _model()._replace(augment=augment)
    keyed = plain._replace(train_apply=lambda p, x, k: plain.apply(p, x))
    params = plain.init(jax.random.key(0))
    x, y, n = _client(n_max=9, n=7)
    for sampling in ("with_replacement", "epochs"):
        runs = [
            client_update(
                m,
                optax.sgd(LR),
                params,
                x,
                y,
                n,
                jax.random.key(3),
                num_steps=4,
                batch_size=3,
                sampling=sampling,
            )
            for m in (plain, keyed)
        ]
        for a, b in zip(jax.tree.leaves(runs[0][0]), jax.tree.leaves(runs[1][0]), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(runs[0][2]), np.asarray(runs[1][2]))


def test_evaluation_and_losses_outside_training_are_deterministic():
    model = _model(train_kwargs={"train": True})
    params = model.init(jax.random.key(0))
    x, y, n = _client()
    want = DropNet().apply({"params": params}, x)  # train=False: no dropout
    np.testing.assert_array_equal(np.asarray(model.apply(params, x)), np.asarray(want))
    np.testing.assert_allclose(
        float(client_loss(model, params, x, y, n)), float(_ce(want, y, n)), rtol=1e-6
    )
    data = FederatedData.from_clients([np.asarray(x[:n])] * 2, [np.asarray(y[:n])] * 2)
    alg = fedavg(model, sgd(LR, steps=STEPS))
    state = alg.init(jax.random.key(1), data)
    first, second = alg.evaluate(state, data), alg.evaluate(state, data)
    np.testing.assert_array_equal(
        np.asarray(first["client_loss"]), np.asarray(second["client_loss"])
    )
    np.testing.assert_allclose(
        np.asarray(first["client_loss"]),
        [float(_ce(DropNet().apply({"params": state.params}, x), y, n))] * 2,
        rtol=1e-5,
    )


def test_ifcas_cluster_losses_are_deterministic():
    """IFCA's assignment reads F_i(θ_j) of the module called without train=True."""
    model = _model(train_kwargs={"train": True})
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(2), 2))  # k = 2
    x, y, n = _client()
    data = FederatedData.from_clients(
        [np.asarray(x[:n]), np.asarray(x[:2])], [np.asarray(y[:n]), np.asarray(y[:2])]
    )
    got = np.asarray(cluster_losses(model, params, data))
    want = [
        [
            float(
                _ce(
                    DropNet().apply({"params": jax.tree.map(lambda a: a[j], params)}, data.x[i]),
                    data.y[i],
                    c,
                )
            )
            for j in range(2)
        ]
        for i, c in enumerate((n, 2))
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_array_equal(got, np.asarray(cluster_losses(model, params, data)))


def test_a_fedavg_round_with_dropout_equals_a_loop_over_the_cohort():
    """Every client (4, 1, 0 and 3 rows, padded to 4) in one vmapped round: the mean of the
    loop's trained models over the clients holding data (uniform weights)."""
    sizes = (4, 1, 0, 3)
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(s, D)).astype(np.float32) for s in sizes]
    ys = [rng.integers(0, CLASSES, s).astype(np.int32) for s in sizes]
    data = FederatedData.from_clients(xs, ys)
    model = _model(train_kwargs={"train": True})
    alg = fedavg(model, sgd(LR, steps=STEPS))
    state = alg.init(jax.random.key(0), data)
    round_key = jax.random.key(11)
    new, _ = jax.jit(alg.round)(state, data, round_key)

    slot_keys = jax.random.split(round_key)[1]
    trained = []
    for j, s in enumerate(sizes):
        if s == 0:
            continue  # a client without data takes no part
        x, y = data.x[j], data.y[j]
        trained.append(_loop(state.params, x, y, s, jax.random.fold_in(slot_keys, j), dropout=True))
    want = jax.tree.map(lambda *a: sum(a) / len(a), *trained)
    _assert_trees_close(new.params, want)


def test_split_model_trunk_and_head_draw_their_own_keys():
    trunk, head = DropTrunk(), DropNet()
    example = jnp.zeros((1, D))
    model = split_model(
        trunk,
        head,
        example,
        train_kwargs={"deterministic": False},
        head_train_kwargs={"train": True},
    )
    params = model.init(jax.random.key(0))
    x, _, _ = _client()
    key = jax.random.key(4)
    k_trunk, k_head = jax.random.split(key)
    f = trunk.apply({"params": params["trunk"]}, x, deterministic=False, rngs={"dropout": k_trunk})
    want = head.apply({"params": params["head"]}, f, train=True, rngs={"dropout": k_head})
    np.testing.assert_array_equal(np.asarray(model.train_apply(params, x, key)), np.asarray(want))
    det = head.apply({"params": params["head"]}, trunk.apply({"params": params["trunk"]}, x))
    np.testing.assert_array_equal(np.asarray(model.apply(params, x)), np.asarray(det))
    assert split_model(trunk, head, example).train_apply is None


def test_several_rng_collections_split_the_step_key():
    class TwoStreams(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.Dropout(0.5)(nn.Dense(8)(x), deterministic=not train)
            return nn.Dropout(0.5, rng_collection="noise")(h, deterministic=not train)

    module = TwoStreams()
    model = from_flax(
        module, jnp.zeros((1, D)), train_kwargs={"train": True}, train_rngs=("dropout", "noise")
    )
    params = model.init(jax.random.key(0))
    x, _, _ = _client()
    key = jax.random.key(9)
    k_drop, k_noise = jax.random.split(key)
    want = module.apply(
        {"params": params}, x, train=True, rngs={"dropout": k_drop, "noise": k_noise}
    )
    np.testing.assert_array_equal(np.asarray(model.train_apply(params, x, key)), np.asarray(want))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(train_kwargs=["train"]), r"^train_kwargs must be None or a dict"),
        (
            dict(train_kwargs={"training": True}),
            r"^train_kwargs=\{'training': True\} with "
            r"train_rngs=\('dropout',\) do not fit the module",
        ),
        (dict(train_kwargs={"train": True}, train_rngs=()), r"^train_rngs must be one or more"),
        (
            dict(train_kwargs={"train": True}, train_rngs=("noise",)),
            r"^train_kwargs=.*do not fit the module.*needs PRNG for \"dropout\"",
        ),
    ],
)
def test_bad_train_settings_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        _model(**kwargs)
    assert len(str(err.value).splitlines()) == 1


def test_simple_cnn_trains_with_dropout_unless_told_not_to():
    assert simple_cnn(input_shape=(8, 8, 3)).train_apply is not None
    assert simple_cnn(input_shape=(8, 8, 3), dropout=False).train_apply is None
    with pytest.raises(ValueError, match=r"^dropout must be True or False"):
        simple_cnn(dropout="yes")
