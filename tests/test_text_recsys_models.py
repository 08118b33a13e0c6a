"""The char model's masked loss, and the dual encoder's row-sparse client step and counts."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedjax_sim.experiments.mixed.movielens import costs
from fedjax_sim.models import core, recsys
from fedjax_sim.models import text as char
from fedjax_sim.ops.local_update import client_update

# ------------------------------------------------------------------------------ char model


def _numpy_params(model, seed, scale=0.5):
    """Random params of the model's shapes drawn with numpy: no XLA compile of an init."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    return jax.tree.map(lambda s: jnp.asarray(scale * rng.normal(size=s.shape), s.dtype), shapes)


def _np_masked_ce(logits, y):
    out = []
    for lg, row in zip(np.asarray(logits, np.float64), np.asarray(y), strict=True):
        terms = []
        for t, label in enumerate(row):
            if label == char.PAD_ID:
                continue
            z = lg[t] - lg[t].max()
            terms.append(-(z[label] - np.log(np.exp(z).sum())))
        out.append(np.mean(terms) if terms else 0.0)
    return np.asarray(out)


def test_masked_char_loss_ignores_padding():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
    y = jnp.asarray([[3, 4, 5, 6, 2], [3, 1, 0, 0, 0], [0, 0, 0, 0, 0]], jnp.int32)
    loss = char.masked_char_loss(logits, y)
    np.testing.assert_allclose(loss, _np_masked_ce(logits, y), rtol=1e-5)
    # Anything at a padded position changes nothing.
    noisy = logits.at[1, 2:].add(100.0 * jnp.asarray(rng.normal(size=(3, 7)), jnp.float32))
    np.testing.assert_array_equal(char.masked_char_loss(noisy, y), loss)
    acc = char.masked_char_correct(logits, y)
    np.testing.assert_allclose(acc[1], np.mean(np.argmax(logits[1, :2], -1) == y[1, :2]))
    assert acc[2] == 0.0 and loss[2] == 0.0


@pytest.mark.parametrize("cell", ["conv", "gru"])
def test_char_model_is_causal_and_its_client_loss_masks_padding(cell):
    model = char.char_model(12, 6, embed_dim=4, hidden=8, cell=cell, kernel=3)
    params = _numpy_params(model, 0)
    x = jnp.asarray([[2, 3, 4, 5, 6, 7], [8, 9, 10, 0, 0, 0]], jnp.int32)
    y = jnp.asarray([[3, 4, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0]], jnp.int32)
    apply = jax.jit(model.apply)
    logits = apply(params, x)
    assert logits.shape == (2, 6, 12)
    later = apply(params, x.at[:, 4:].set(11))  # change the future only
    np.testing.assert_allclose(later[:, :4], logits[:, :4], rtol=1e-6, atol=1e-6)
    full = jax.jit(core.client_loss, static_argnums=0)(model, params, x, y, 2)
    np.testing.assert_allclose(full, _np_masked_ce(logits, y).mean(), rtol=1e-5)
    core.check_model_data(model, params, type("D", (), {"x": x[None], "y": y[None],
                                                        "num_examples": jnp.asarray([2])}))


# ------------------------------------------------------------------------------ dual encoder

NUM_ITEMS, DIM, CTX = 9, 4, 3


def _client():
    """One client holding items {1, 4, 6, 7}: 3 real examples and one padding row."""
    x = {"context": jnp.asarray([[-1, -1, 4], [-1, 4, 6], [4, 6, 1], [-1, -1, -1]], jnp.int32),
         "label": jnp.asarray([6, 1, 7, -1], jnp.int32)}
    items = jnp.asarray([1, 4, 6, 7, -1, -1], jnp.int32)
    return x, x["label"], 3, items


def test_inbatch_hinge_matches_a_loop():
    model = recsys.dual_encoder(NUM_ITEMS, DIM, margin=0.5)
    params = _numpy_params(model, 1, scale=0.7)
    x, y, n, _ = _client()
    got = jax.jit(lambda p: model.example_loss(model.apply(p, x), y))(params)
    table = np.asarray(params["item_table"], np.float64)
    w, b = (np.asarray(params["tower"][k], np.float64) for k in ("kernel", "bias"))
    labels = np.asarray(y)
    users = []
    for ctx in np.asarray(x["context"]):
        real = [table[i] for i in ctx if i >= 0]
        users.append((np.mean(real, 0) if real else np.zeros(DIM)) @ w + b)
    for i in range(n):
        negs = [j for j in range(len(labels)) if labels[j] >= 0 and labels[j] != labels[i]]
        s = lambda j, i=i: users[i] @ table[labels[j]]  # noqa: E731
        want = np.mean([max(0.0, 0.5 - s(i) + s(j)) for j in negs])
        np.testing.assert_allclose(got[i], want, rtol=1e-5)


def test_positive_cosine_hinge_matches_a_loop():
    model = recsys.dual_encoder(NUM_ITEMS, DIM, margin=0.5, loss="positive", cosine=True)
    params = _numpy_params(model, 1, scale=0.7)
    x, y, n, _ = _client()
    got = np.asarray(jax.jit(lambda p: model.example_loss(model.apply(p, x), y))(params))
    table = np.asarray(params["item_table"], np.float64)
    w, b = (np.asarray(params["tower"][k], np.float64) for k in ("kernel", "bias"))
    unit = lambda v: v / np.linalg.norm(v) if np.linalg.norm(v) > 0 else v  # noqa: E731
    for i, ctx in enumerate(np.asarray(x["context"])[:n]):
        real = [unit(table[j]) for j in ctx if j >= 0]
        u = unit((np.mean(real, 0) if real else np.zeros(DIM)) @ w + b)
        want = max(0.0, 0.5 - u @ unit(table[int(y[i])]))
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-6)
    assert got[n] == 0.0  # the padding row


@pytest.mark.parametrize("loss,cosine", [("inbatch", False), ("positive", True)])
def test_client_step_touches_only_its_own_rows(loss, cosine):
    model = recsys.dual_encoder(NUM_ITEMS, DIM, loss=loss, cosine=cosine)
    params = _numpy_params(model, 2)
    x, y, n, items = _client()
    own = np.asarray(items[items >= 0])
    others = np.setdiff1d(np.arange(NUM_ITEMS), own)
    grad = jax.jit(jax.grad(lambda p: core.client_loss(model, p, x, y, n)))(params)["item_table"]
    assert np.all(np.isfinite(np.asarray(grad)))  # a zero (padding) row has a zero gradient
    assert np.all(np.asarray(grad)[others] == 0.0)  # exactly zero, item 0 included
    assert np.all(np.abs(np.asarray(grad)[own]).sum(-1) > 0)
    # K local Adam steps (minibatches with a padded slot) leave other rows bit-equal.
    step = jax.jit(lambda p: client_update(model, optax.adam(0.1), p, x, y, n, jax.random.key(3),
                                           num_steps=3, batch_size=4)[0])
    new = step(params)
    np.testing.assert_array_equal(np.asarray(new["item_table"])[others],
                                  np.asarray(params["item_table"])[others])
    assert not np.array_equal(np.asarray(new["item_table"])[own],
                              np.asarray(params["item_table"])[own])
    # The client's own model is the gathered rows: same loss; its gradient scattered back
    # equals the full-table gradient.
    rows = recsys.client_rows(params, items)
    assert rows["item_table"].shape == (6, DIM) and np.all(rows["item_table"][4:] == 0)
    local = recsys.to_local(x, items)
    np.testing.assert_array_equal(local["label"], [2, 0, 3, -1])
    np.testing.assert_array_equal(local["context"][2], [1, 2, 0])
    loss = jax.jit(core.client_loss, static_argnums=(0, 4))
    np.testing.assert_allclose(loss(model, rows, local, local["label"], n),
                               loss(model, params, x, y, n), rtol=1e-6)
    g_rows = jax.jit(jax.grad(lambda p: core.client_loss(model, p, local, local["label"], n)))(
        rows)
    np.testing.assert_allclose(recsys.scatter_rows(g_rows["item_table"], items, NUM_ITEMS),
                               grad, rtol=1e-6, atol=1e-7)


def test_spreadout_and_recall_match_loops():
    rng = np.random.default_rng(4)
    table = rng.normal(size=(5, 3)).astype(np.float32)
    pairs = [(i, j) for i, j in itertools.product(range(5), repeat=2) if i != j]
    dot = np.mean([(table[i] @ table[j]) ** 2 for i, j in pairs])
    dist = np.mean([max(0.0, 2.0 - np.linalg.norm(table[i] - table[j])) ** 2 for i, j in pairs])
    np.testing.assert_allclose(recsys.spreadout_regularizer(jnp.asarray(table)), dot, rtol=1e-5)
    np.testing.assert_allclose(
        recsys.spreadout_regularizer(jnp.asarray(table), kind="distance", nu=2.0), dist,
        rtol=1e-4)
    scores = rng.normal(size=(4, 6)).astype(np.float32)
    labels = np.asarray([0, 3, 5, -1])
    for k in (1, 2, 6):
        want = [float(lab >= 0 and np.sum(s > s[lab]) < k) for s, lab in zip(scores, labels,
                                                                            strict=True)]
        np.testing.assert_array_equal(recsys.recall_at_k(jnp.asarray(scores), labels, k), want)


def test_recall_over_unwatched_candidates_matches_a_loop():
    """exclude_items drops each row's watched items (ids may repeat and be -1 padding);
    recall@k then ranks the label among the rest."""
    rng = np.random.default_rng(5)
    scores = rng.normal(size=(3, 8)).astype(np.float32)
    labels = np.asarray([2, 7, 0])
    seen = np.asarray([[5, 5, -1, 1], [0, -1, -1, -1], [3, 6, 4, 0 + 1]])
    got = np.asarray(recsys.exclude_items(jnp.asarray(scores), jnp.asarray(seen)))
    for r in range(3):
        for j in range(8):
            if j in set(seen[r][seen[r] >= 0]):
                assert got[r, j] == -np.inf
            else:
                assert got[r, j] == scores[r, j]
    for k in (1, 3):
        want = []
        for r in range(3):
            candidates = [j for j in range(8) if j not in set(seen[r])]
            above = sum(scores[r, j] > scores[r, labels[r]] for j in candidates)
            want.append(float(above < k))
        np.testing.assert_array_equal(
            recsys.recall_at_k(jnp.asarray(got), jnp.asarray(labels), k), want)


def test_batched_recall_equals_the_eval_model():
    model = recsys.dual_encoder_eval(NUM_ITEMS, DIM, k=3)
    params = _numpy_params(model, 5)
    x, y, n, _ = _client()
    per_example = core.client_accuracy(model, params, x, y, n)
    got = recsys.batched_recall(params, x["context"], y, k=3, batch_size=2)
    np.testing.assert_allclose(got, per_example, rtol=1e-6)


def test_communication_and_computation_counts_by_hand():
    # Two clients with 4 and 2 distinct rows; d = 4, tower 4·4 + 4 = 20 floats.
    assert recsys.tower_size(DIM) == 20
    np.testing.assert_array_equal(recsys.client_floats([4, 2], DIM), [4 * 4 + 20, 2 * 4 + 20])
    c = costs([4, 2], [3, 10], num_items=NUM_ITEMS, dim=DIM, context_len=CTX, steps=2,
                     batch_size=5, payloads_down=2, payloads_up=1)
    down = 2 * ((16 + 20) + (8 + 20))
    up = (16 + 20) + (8 + 20)
    full = NUM_ITEMS * DIM + 20
    assert (c.mixed_down, c.mixed_up) == (down, up)
    assert (c.all_on_client_down, c.all_on_client_up) == (2 * 2 * full, 2 * full)
    np.testing.assert_allclose(c.communication_saved, 1 - (down + up) / (6 * full), rtol=1e-6)
    # batches of 3 and 5 examples: bag b·c·d + tower b·d² + scores b²·d + hinge b²
    fwd = sum(b * CTX * DIM + b * DIM * DIM + b * b * DIM + b * b for b in (3, 5))
    reg = NUM_ITEMS**2 * DIM + NUM_ITEMS**2
    assert c.mixed_client_macs == 3 * 2 * fwd
    assert c.all_on_client_macs == 3 * 2 * (fwd + 2 * reg)
    # The positive hinge with cosine scores: pairs b·d + b, plus the unit normalisations
    # b·(c+2)·d per batch and I·d on the server's table.
    p = costs([4, 2], [3, 10], num_items=NUM_ITEMS, dim=DIM, context_len=CTX, steps=2,
                     batch_size=5, loss="positive", cosine=True)
    fwd = sum(b * CTX * DIM + b * DIM * DIM + b * DIM + b + b * (CTX + 2) * DIM for b in (3, 5))
    reg = NUM_ITEMS**2 * DIM + NUM_ITEMS**2 + NUM_ITEMS * DIM
    assert p.mixed_client_macs == 3 * 2 * fwd
    assert p.all_on_client_macs == 3 * 2 * (fwd + 2 * reg)
    # XLA's own count of the regularizer's Gram matrix agrees with the hand count's I²·d.
    flops = recsys.compiled_flops(lambda t: t @ t.T, jnp.zeros((NUM_ITEMS, DIM)))
    assert flops == 2 * NUM_ITEMS**2 * DIM or np.isnan(flops)


def test_cosine_spreadout_is_scale_free():
    table = np.random.default_rng(3).normal(size=(NUM_ITEMS, DIM)).astype(np.float32)
    unit = table / np.linalg.norm(table, axis=1, keepdims=True)
    np.testing.assert_allclose(recsys.spreadout_regularizer(jnp.asarray(3.0 * table), cosine=True),
                               recsys.spreadout_regularizer(jnp.asarray(unit)), rtol=1e-5)


def test_spreadout_loss_is_a_server_term_on_the_table():
    params = _numpy_params(recsys.dual_encoder(NUM_ITEMS, DIM), 6)
    loss = recsys.spreadout_loss(kind="dot")
    np.testing.assert_allclose(loss(params, None, jax.random.key(0)),
                               recsys.spreadout_regularizer(params["item_table"]), rtol=1e-6)
    grad = jax.grad(lambda p: loss(p, None, None))(params)
    assert np.all(np.asarray(grad["tower"]["kernel"]) == 0)  # the towers are not regularized
    assert np.all(np.abs(np.asarray(grad["item_table"])).sum(-1) > 0)  # every row is


def test_dual_encoder_init_shapes():
    params = recsys.init_dual_encoder(jax.random.key(7), NUM_ITEMS, DIM, tower=False)
    assert list(params) == ["item_table"] and params["item_table"].shape == (NUM_ITEMS, DIM)
    with pytest.raises(ValueError, match="num_items"):
        recsys.dual_encoder(0, DIM)
    with pytest.raises(ValueError, match="cell"):
        char.char_model(12, cell="transformer")


def test_model_and_data_agree_on_the_pad_id():
    from fedjax_sim.data import text as char_data

    assert char.PAD_ID == char_data.PAD_ID
