"""Mixed FL (PT, 1-GT, 2-GT): invariants, a per-client loop reference, G̃/B̃, the synthetic claim."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from federations import assert_reported_as_finished, recording_context
from hypothesis import given, settings
from hypothesis import strategies as st

from fedjax_sim.algorithms import ALGORITHMS, fedavg, sgd
from fedjax_sim.algorithms.mixed import (
    CENTRAL_STREAM,
    datacenter_loss,
    dissimilarity,
    l2_regularizer,
    mixed,
    mixed_centralized,
    mixed_gt1,
    mixed_gt2,
    mixed_parallel,
)
from fedjax_sim.data import FederatedData, ServerData
from fedjax_sim.execution import planned
from fedjax_sim.experiments import study
from fedjax_sim.experiments.mixed import SYNTHETIC, binary_auc, rounds_to_target
from fedjax_sim.models import linear_regression
from fedjax_sim.ops import sample_batch, sample_cohort

D = 3
SIZES = (4, 1, 0, 3, 2, 4)  # a one-example client and an empty one


def make_inputs(seed=0, sizes=SIZES, n_c=7):
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=D)
    xs, ys = [], []
    for n in sizes:
        x = rng.normal(size=(n, D)).astype(np.float32)
        xs.append(x)
        ys.append((x @ theta + 0.3 * rng.normal(size=n)).astype(np.float32))
    data = FederatedData.from_clients(xs, ys)
    xc = rng.normal(size=(n_c, D)).astype(np.float32)
    yc = (xc @ (theta + 1.5) + 0.1 * rng.normal(size=n_c)).astype(np.float32)
    return data, ServerData({"x": jnp.asarray(xc), "y": jnp.asarray(yc)})


MODEL = linear_regression(D)


def np_grad(theta, x, y):
    """∇ of mean (xθ − y)² (no ½), float64; 0 for an empty client."""
    if len(y) == 0:
        return np.zeros_like(theta), 0.0
    r = x @ theta - y
    return 2.0 / len(y) * x.T @ r, float(np.mean(r**2))


def client_arrays(data):
    x, y, n = (np.asarray(a, np.float64) for a in (data.x, data.y, data.num_examples))
    return [(x[i, : int(n[i])], y[i, : int(n[i])]) for i in range(len(n))]


def loop_round(variant, params, grad_f_last, data, server, ids, *, lr, server_lr, w_f, w_c, k,
               weighting="uniform", combine="half", transfer="current"):
    """One full-batch round of PT / 1-GT / 2-GT, client by client, in float64 numpy."""
    clients = client_arrays(data)
    xc, yc = (np.asarray(server.arrays[a], np.float64) for a in ("x", "y"))
    x_t = np.asarray(params, np.float64)
    hat_g_c, loss_c = np_grad(x_t, xc, yc)
    gt = variant in ("gt1", "gt2")
    deltas, grads, weights, losses = [], [], [], []
    for i in ids:
        xi, yi = clients[i]
        if len(yi) == 0:
            continue
        y = x_t.copy()
        g0, l0 = np_grad(x_t, xi, yi)
        for _ in range(k):
            g, _ = np_grad(y, xi, yi)
            y = y - lr * ((w_f * g + w_c * hat_g_c) if gt else g)
        deltas.append(y - x_t)
        grads.append(g0)
        losses.append(l0)
        weights.append(len(yi) if weighting == "examples" else 1.0)
    w = np.asarray(weights) / np.sum(weights)
    delta_f = np.tensordot(w, np.asarray(deltas), 1)
    hat_g_f = np.tensordot(w, np.asarray(grads), 1)
    if variant == "parallel":
        y = x_t.copy()
        for _ in range(k):
            y = y - lr * np_grad(y, xc, yc)[0]
        delta = w_f * delta_f + w_c * (y - x_t)
    elif variant == "gt1":
        delta = delta_f
    else:
        transferred = hat_g_f if transfer == "current" else grad_f_last
        y = x_t.copy()
        for _ in range(k):
            y = y - lr * (w_c * np_grad(y, xc, yc)[0] + w_f * transferred)
        alpha = 0.5 if combine == "half" else w_f / (w_f + w_c)
        delta = alpha * delta_f + (1 - alpha) * (y - x_t)
    spread = w_f * hat_g_f @ hat_g_f + w_c * hat_g_c @ hat_g_c
    mixed = w_f * hat_g_f + w_c * hat_g_c
    metrics = {"G_tilde": np.sqrt(max(spread - mixed @ mixed, 0.0)),
               "B_tilde": np.sqrt(spread / (mixed @ mixed)),
               "cohort_loss": np.mean(losses), "central_loss": loss_c}
    return x_t + server_lr * delta, hat_g_f, metrics


FACTORIES = {"parallel": mixed_parallel, "gt1": mixed_gt1, "gt2": mixed_gt2}

CASES = [
    ("parallel", {}),
    ("gt1", {"weighting": "examples"}),
    ("gt2", {}),
    ("gt2", {"combine": "mixing", "transfer": "stale"}),
    ("gt2", {"combine": "half", "transfer": "stale", "weighting": "examples"}),
]


@pytest.mark.parametrize(("variant", "options"), CASES)
def test_rounds_equal_per_client_loop(variant, options):
    data, server = make_inputs()
    hyper = dict(lr=0.05, server_lr=0.7, w_f=0.6, w_c=0.4, k=3)
    alg = FACTORIES[variant](MODEL, sgd(hyper["lr"], steps=hyper["k"]),
                             server_lr=hyper["server_lr"], w_f=hyper["w_f"], w_c=hyper["w_c"],
                             participation=4 / data.num_clients, **options)
    state = alg.init(jax.random.key(0), (data, server))
    round_ = jax.jit(alg.round)
    params, grad_f = np.asarray(state.params, np.float64), np.zeros(D)
    d = float(D)
    for t in range(3):  # three rounds: 2-GT "stale" reads the previous round's ĝ_f
        key = jax.random.key(10 + t)
        ids = np.asarray(sample_cohort(key, data.num_clients, 4).ids)
        state, metrics = round_(state, (data, server), key)
        params, grad_f, want = loop_round(variant, params, grad_f, data, server, ids,
                                          **hyper, **options)
        np.testing.assert_allclose(np.asarray(state.params), params, rtol=2e-5, atol=2e-5)
        for name, value in want.items():
            np.testing.assert_allclose(float(metrics[name]), value, rtol=2e-4, atol=1e-5)
        assert float(metrics["floats_down"]) == (2 * d if variant != "parallel" else d)
        assert float(metrics["floats_up"]) == (2 * d if variant == "gt2" else d)


def _batch_rows(key, n, n_max, b, **kw):
    idx, mask = (np.asarray(a) for a in sample_batch(key, n, n_max, b, **kw))
    return idx[mask]


@pytest.mark.parametrize("variant", ["parallel", "gt1", "gt2"])
def test_minibatch_rounds_equal_per_client_loop_with_per_step_draws(variant):
    """Minibatches on both sides, drawn step by step in the loop as documented: client
    step j's batch from split(split(slot key, K)[j])[0] (FedAvg's), central step j's from
    split(fold_in(round key, CENTRAL_STREAM), K)[j] (200 rows: `lax.top_k`'s path). The
    round draws all K batches before its steps; a plain-callable central loss (drawing
    inside each step) gives the same 2-GT round."""
    data, server = make_inputs(5, sizes=(6, 1, 0, 5, 3, 6), n_c=200)
    lr, w_f, w_c, k, b, cb, s = 0.05, 0.6, 0.4, 3, 2, 16, 4
    training = sgd(lr, steps=k, batch_size=b)
    kw = dict(w_f=w_f, w_c=w_c, participation=s / data.num_clients)
    alg = FACTORIES[variant](MODEL, training, central=training.replace(batch_size=cb), **kw)
    state = alg.init(jax.random.key(0), (data, server))
    key = jax.random.key(21)
    new, _ = jax.jit(alg.round)(state, (data, server), key)
    if variant == "gt2":  # the central steps' draws: made up front, or in each step
        dc = datacenter_loss(MODEL, cb)
        plain = mixed_gt2(MODEL, training, central_loss=lambda p, a, kk: dc(p, a, kk), **kw)
        other, _ = jax.jit(plain.round)(state, (data, server), key)
        chex.assert_trees_all_equal(new.params, other.params)

    clients = client_arrays(data)
    n_max = data.max_examples
    xc, yc = (np.asarray(server.arrays[a], np.float64) for a in ("x", "y"))
    central_keys = jax.random.split(jax.random.fold_in(key, CENTRAL_STREAM), k)
    central_rows = [_batch_rows(ck, 200, 200, cb, replicated=True) for ck in central_keys]
    x_t = np.asarray(state.params, np.float64)
    hat_g_c = np_grad(x_t, xc[central_rows[0]], yc[central_rows[0]])[0]
    gt = variant in ("gt1", "gt2")
    cohort = sample_cohort(key, data.num_clients, s)
    deltas, grads = [], []
    for slot, i in enumerate(np.asarray(cohort.ids).tolist()):
        xi, yi = clients[i]
        if len(yi) == 0:
            continue
        y = x_t.copy()
        for j, kj in enumerate(jax.random.split(cohort.keys[slot], k)):
            rows = _batch_rows(jax.random.split(kj)[0], len(yi), n_max, b)
            g = np_grad(y, xi[rows], yi[rows])[0]
            if j == 0:
                grads.append(g)
            y = y - lr * ((w_f * g + w_c * hat_g_c) if gt else g)
        deltas.append(y - x_t)
    delta_f, hat_g_f = np.mean(deltas, 0), np.mean(grads, 0)
    y = x_t.copy()
    for rows in central_rows:
        g = np_grad(y, xc[rows], yc[rows])[0]
        y = y - lr * (w_c * g + w_f * hat_g_f if variant == "gt2" else g)
    want = {"parallel": x_t + w_f * delta_f + w_c * (y - x_t), "gt1": x_t + delta_f,
            "gt2": x_t + 0.5 * delta_f + 0.5 * (y - x_t)}[variant]
    np.testing.assert_allclose(np.asarray(new.params), want, rtol=2e-5, atol=2e-5)


def test_no_central_weight_is_fedavg():
    """w_c = 0 (w_f = 1): every variant is FedAvg, draw for draw (sampled cohort, minibatches).

    2-GT needs combine="mixing" for this (α = w_f/(w_f+w_c) = 1); with the §6.2 text's
    α = ½ half of the step comes from the server's K steps along ĝ_f (not FedAvg; that
    combination is checked against the loop reference above)."""
    data, server = make_inputs(1)
    training = sgd(0.1, steps=2, batch_size=2)
    ref = fedavg(MODEL, training, participation=4 / 6)
    ref_round = jax.jit(ref.round)
    keys = jax.random.split(jax.random.key(3), 2)
    ref_params = []
    ref_state = ref.init(jax.random.key(0), data)
    for key in keys:
        ref_state, _ = ref_round(ref_state, data, key)
        ref_params.append(np.asarray(ref_state.params))
    for variant, options in (("parallel", {}), ("gt1", {}), ("gt2", {"combine": "mixing"})):
        alg = FACTORIES[variant](MODEL, training, w_f=1.0, w_c=0.0, participation=4 / 6,
                                 **options)
        round_ = jax.jit(alg.round)
        state = alg.init(jax.random.key(0), (data, server))
        for key, want in zip(keys, ref_params, strict=True):
            state, _ = round_(state, (data, server), key)
            np.testing.assert_allclose(state.params, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("w_f", "w_c"), [(0.5, 0.5), (1.0, 0.25)])
def test_gt1_one_step_is_sgd_on_the_mixed_loss(w_f, w_c):
    """K = 1, server SGD at lr 1, every client, full batches: x − η(w_f ∇f_f + w_c ∇f_c)."""
    data, server = make_inputs(2)
    lr = 0.07
    alg = mixed_gt1(MODEL, sgd(lr), w_f=w_f, w_c=w_c)
    state = alg.init(jax.random.key(0), (data, server))
    new, _ = jax.jit(alg.round)(state, (data, server), jax.random.key(1))
    theta = np.asarray(state.params, np.float64)
    grads = [np_grad(theta, x, y)[0] for x, y in client_arrays(data) if len(y)]
    g_c = np_grad(theta, *(np.asarray(server.arrays[a], np.float64) for a in ("x", "y")))[0]
    want = theta - lr * (w_f * np.mean(grads, axis=0) + w_c * g_c)
    np.testing.assert_allclose(new.params, want, rtol=1e-5, atol=1e-6)


def test_regularizer_central_loss_needs_no_server_data():
    data, _ = make_inputs(3)
    lr, scale = 0.1, 0.3
    alg = mixed_gt1(MODEL, sgd(lr), central_loss=l2_regularizer(scale))
    state = alg.init(jax.random.key(0), data)
    new, metrics = jax.jit(alg.round)(state, data, jax.random.key(1))
    theta = np.asarray(state.params, np.float64)
    grads = [np_grad(theta, x, y)[0] for x, y in client_arrays(data) if len(y)]
    want = theta - lr * (0.5 * np.mean(grads, axis=0) + 0.5 * scale * theta)
    np.testing.assert_allclose(new.params, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["central_loss"]), 0.5 * scale * theta @ theta,
                               rtol=1e-5)


def test_missing_datacenter_is_refused_with_a_clear_message():
    data, _ = make_inputs()
    with pytest.raises(ValueError, match="ServerData"):
        mixed_parallel(MODEL, sgd(0.1)).init(jax.random.key(0), data)
    with pytest.raises(ValueError, match="combine"):
        mixed_gt2(MODEL, sgd(0.1), combine="third")
    # More clients per round than there are (the old clients_per_round=9 of 6): a fraction
    # above 1.
    with pytest.raises(ValueError, match="participation"):
        mixed_gt1(MODEL, sgd(0.1), participation=9 / 6)
    # The central steps draw each datacenter batch afresh; by default they do not take the
    # clients' sampling mode (clients in epochs are accepted).
    with pytest.raises(ValueError, match="central sampling"):
        mixed_parallel(MODEL, sgd(0.1), central=sgd(0.1, batch_size=2, sampling="epochs"))
    mixed_parallel(MODEL, sgd(0.1, batch_size=2, sampling="epochs")).init(
        jax.random.key(0), make_inputs())


def test_client_chunks_equal_the_whole_cohort():
    data, server = make_inputs(4)
    alg = mixed_gt2(MODEL, sgd(0.05, steps=2), participation=5 / data.num_clients)
    state = alg.init(jax.random.key(0), (data, server))
    round_ = jax.jit(alg.round)
    a, ma = round_(state, (data, server), jax.random.key(5))
    b, mb = round_(state, (planned(data, client_chunk=2), server), jax.random.key(5))
    chex.assert_trees_all_close(a.params, b.params, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(ma, mb, rtol=1e-4, atol=1e-6)


def test_oracle_step_is_sgd_on_the_mixed_loss():
    data, server = make_inputs(5)
    lr = 0.05
    alg = mixed_centralized(MODEL, sgd(lr, steps=2))
    state = alg.init(jax.random.key(0), (data, server))
    new, _ = jax.jit(alg.round)(state, (data, server), jax.random.key(1))
    theta = np.asarray(state.params, np.float64)
    xc, yc = (np.asarray(server.arrays[a], np.float64) for a in ("x", "y"))
    for _ in range(2):
        grads = [np_grad(theta, x, y)[0] for x, y in client_arrays(data) if len(y)]
        theta = theta - lr * (0.5 * np.mean(grads, axis=0) + 0.5 * np_grad(theta, xc, yc)[0])
    np.testing.assert_allclose(new.params, theta, rtol=1e-5, atol=1e-6)


def test_registered():
    for name in ("mixed_parallel", "mixed_gt1", "mixed_gt2"):
        assert name in ALGORITHMS


VECTORS = st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=4, max_size=4)


@settings(max_examples=60, deadline=None)
@given(VECTORS, VECTORS, st.floats(0.0, 1.0))
def test_dissimilarity_identity_and_b_at_least_one(g_f, g_c, w_f):
    g_f, g_c = np.asarray(g_f, np.float32), np.asarray(g_c, np.float32)
    w_c = 1.0 - w_f
    g_tilde, b_tilde = jax.jit(dissimilarity)({"a": g_f[:3], "b": g_f[3:]},
                                              {"a": g_c[:3], "b": g_c[3:]}, w_f, w_c)
    want = w_f * w_c * float(np.sum((g_f.astype(np.float64) - g_c) ** 2))
    scale = 1e-4 * (float(np.sum(g_f.astype(np.float64) ** 2 + g_c.astype(np.float64) ** 2))
                    + 1e-6)
    assert abs(float(g_tilde) ** 2 - want) <= scale
    assert float(b_tilde) >= 1.0 - 1e-4
    assert np.isfinite(float(b_tilde))


def test_dissimilarity_is_zero_for_equal_gradients():
    g = {"w": jnp.array([1.0, -2.0, 3.0])}
    g_tilde, b_tilde = dissimilarity(g, g, 0.3, 0.7)
    assert float(g_tilde) < 1e-3 and abs(float(b_tilde) - 1.0) < 1e-5
    zero = optax.tree.zeros_like(g)
    assert float(dissimilarity(zero, zero, 0.5, 0.5)[1]) == 1.0


# --------------------------------------------------------------------------- the synthetic preset


def test_synthetic_preset_pt_matches_gt_at_gap_zero_and_lags_at_a_large_gap():
    experiment = SYNTHETIC.replace(methods=("mixed_parallel", "mixed_gt1"))
    small = {**experiment.defaults(), "m": 5, "n_c": 100, "rounds": 40, "eval_every": 40,
             "seeds": 2}
    runs = {}
    for gap in (0.0, 3.0):
        s = {**small, "gap": gap}
        experiment.validate(s)
        ctx, finished = recording_context()
        comparison = study.compare(experiment, s, ctx)
        assert_reported_as_finished(finished, comparison, experiment.methods)
        runs[gap] = comparison.per_seed
    pt0, gt0 = runs[0.0]["mixed_parallel"], runs[0.0]["mixed_gt1"]
    pt3, gt3 = runs[3.0]["mixed_parallel"], runs[3.0]["mixed_gt1"]
    # Gap 0: G̃ near 0 (only label noise and sampling separate the two optima), and PT
    # reaches the target within a few rounds of 1-GT.
    assert np.all(gt0["G_tilde_median"] < 0.2) and np.all(pt0["G_tilde_median"] < 0.2)
    assert np.all(np.isfinite(pt0["rounds_to_target"]))
    assert np.all(np.abs(pt0["rounds_to_target"] - gt0["rounds_to_target"]) <= 3)
    # Gap 3: G̃ is large; 1-GT still reaches the target, PT stalls at a biased point.
    assert np.all(gt3["G_tilde_median"] > 10 * gt0["G_tilde_median"])
    assert np.all(np.isfinite(gt3["rounds_to_target"]))
    assert np.all(np.isnan(pt3["rounds_to_target"]))
    assert np.all(pt3["excess_loss"] > 5 * gt3["excess_loss"])
    assert np.all(pt3["floats_down"] == 10) and np.all(gt3["floats_down"] == 20)


def test_binary_auc_and_rounds_to_target_equal_loops():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 30).astype(np.float32)  # ties on purpose
    labels = rng.integers(0, 2, 30).astype(np.int32)
    pos, neg = scores[labels == 1], scores[labels == 0]
    want = np.mean([1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in neg])
    np.testing.assert_allclose(float(binary_auc(jnp.asarray(scores), jnp.asarray(labels))),
                               want, rtol=1e-6)
    values = np.array([[3.0, 5.0], [0.5, 4.0], [0.2, 3.0]])  # [rounds, seeds]
    got = rounds_to_target(values, 1.0)
    assert got[0] == 2 and np.isnan(got[1])
    # No round kept (every seed diverged in the first chunk): NaN per seed, not an error.
    got = rounds_to_target(np.zeros((0, 3)), 1.0)
    assert got.shape == (3,) and np.all(np.isnan(got))


def test_movielens_client_update_touches_only_its_own_rows():
    """PT with w_c = 0 and a one-client cohort: the new table differs from the old only on
    that client's movies (its hinge gradient is exactly zero elsewhere), and the payload
    of the client's rows matches a hand count."""
    from fedjax_sim.data.movielens import Ratings, movielens_clients
    from fedjax_sim.models import recsys

    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(4), 6).astype(np.int32)
    items = np.concatenate([rng.choice(12, 6, replace=False) for _ in range(4)]).astype(
        np.int32)
    ratings = Ratings(users, items, np.ones(24, np.float32), np.tile(np.arange(6), 4),
                      4, 12)
    clients = movielens_clients(ratings, context_len=3)
    data = FederatedData.from_arrays(clients.x_train, clients.y_train, clients.n_train)
    model = recsys.dual_encoder(12, 4)
    alg = mixed_parallel(model, sgd(0.5, steps=3), w_f=1.0, w_c=0.0,
                         participation=1 / data.num_clients,
                         central_loss=recsys.spreadout_loss())
    state = alg.init(jax.random.key(0), data)
    key = jax.random.key(4)
    (client,) = np.asarray(sample_cohort(key, data.num_clients, 1).ids)
    new, _ = jax.jit(alg.round)(state, data, key)
    changed = np.flatnonzero(np.any(np.asarray(new.params["item_table"])
                                    != np.asarray(state.params["item_table"]), axis=1))
    own = clients.items[client][clients.items[client] >= 0]
    assert set(changed) <= set(own) and len(changed) > 0
    # Hand count: the client's rows × d plus the d×d + d tower, each way.
    hand = len(own) * 4 + 4 * 4 + 4
    assert int(recsys.client_floats(clients.num_client_items[client], 4)) == hand


@pytest.mark.parametrize(("variant", "factory"), [("parallel", mixed_parallel),
                                                   ("gt1", mixed_gt1), ("gt2", mixed_gt2),
                                                   ("centralized", mixed_centralized)])
def test_one_factory_with_a_variant_is_the_registered_alias(variant, factory):
    data, server = make_inputs(6)
    kw = dict(participation=4 / data.num_clients, w_f=0.3, w_c=2.0,
              central_loss=l2_regularizer(0.5))
    training = sgd(0.05, steps=2, batch_size=2)
    a, b = mixed(MODEL, training, variant=variant, **kw), factory(MODEL, training, **kw)
    state = a.init(jax.random.key(0), (data, server))
    chex.assert_trees_all_equal(jax.jit(a.round)(state, (data, server), jax.random.key(2)),
                                jax.jit(b.round)(state, (data, server), jax.random.key(2)))


def test_a_setting_the_variant_does_not_read_is_refused():
    with pytest.raises(ValueError, match="does not read combine"):
        mixed(MODEL, sgd(0.1), variant="parallel", combine="mixing")
    with pytest.raises(ValueError, match="variant"):
        mixed(MODEL, sgd(0.1), variant="gt3")


def _dissimilarity_from_definition(g_f, g_c, w_f, w_c):
    """G̃, B̃ in float64 from the definition on the normalised weights p = w/(w_f + w_c)."""
    g_f, g_c = np.asarray(g_f, np.float64), np.asarray(g_c, np.float64)
    p_f, p_c = w_f / (w_f + w_c), w_c / (w_f + w_c)
    spread = p_f * g_f @ g_f + p_c * g_c @ g_c
    mean = p_f * g_f + p_c * g_c
    return np.sqrt(max(spread - mean @ mean, 0.0)), np.sqrt(spread / (mean @ mean))


@settings(max_examples=60, deadline=None)
@given(VECTORS, VECTORS, st.sampled_from([(0.9, 100.0), (0.3, 2.0), (5.0, 0.25), (1.0, 1.0)]))
def test_dissimilarity_on_normalised_weights_for_any_positive_weights(g_f, g_c, weights):
    """w_f + w_c ≠ 1 (the movielens preset's 0.9 and 100 among them): G̃ and B̃ equal the
    definition on w/(w_f + w_c) in float64, and B̃ >= 1."""
    w_f, w_c = weights
    g_f, g_c = np.asarray(g_f, np.float32), np.asarray(g_c, np.float32)
    g_tilde, b_tilde = jax.jit(dissimilarity)({"a": g_f[:3], "b": g_f[3:]},
                                              {"a": g_c[:3], "b": g_c[3:]}, w_f, w_c)
    want_g, want_b = _dissimilarity_from_definition(g_f, g_c, w_f, w_c)
    scale = float(np.sum(g_f.astype(np.float64) ** 2 + g_c.astype(np.float64) ** 2))
    assert abs(float(g_tilde) ** 2 - want_g**2) <= 1e-5 * scale + 1e-12
    assert float(b_tilde) >= 1.0
    mean = (w_f * g_f.astype(np.float64) + w_c * g_c) / (w_f + w_c)
    # B̃ is well conditioned, and the squares are normal float32 numbers (an entry of
    # 1e-25 squares to 0 in float32, where the round computes).
    if mean @ mean > 1e-3 * scale and scale > 1e-30:
        np.testing.assert_allclose(float(b_tilde), want_b, rtol=1e-4)


def test_movielens_weights_round_logs_the_normalised_dissimilarity():
    """A full-batch 1-GT round at w_f = 0.9, w_c = 100: G̃, B̃ of the cohort's first-step
    gradient and the central gradient equal the float64 definition (raw weights would give
    a negative G̃², read as 0, and B̃ < 1)."""
    data, server = make_inputs(7)
    w_f, w_c = 0.9, 100.0
    alg = mixed_gt1(MODEL, sgd(1e-3, steps=2), w_f=w_f, w_c=w_c)
    state = alg.init(jax.random.key(0), (data, server))
    _, metrics = jax.jit(alg.round)(state, (data, server), jax.random.key(1))
    theta = np.asarray(state.params, np.float64)
    g_f = np.mean([np_grad(theta, x, y)[0] for x, y in client_arrays(data) if len(y)], axis=0)
    g_c = np_grad(theta, *(np.asarray(server.arrays[a], np.float64) for a in ("x", "y")))[0]
    want_g, want_b = _dissimilarity_from_definition(g_f, g_c, w_f, w_c)
    assert want_g > 0.1 and want_b > 1.0
    np.testing.assert_allclose(float(metrics["G_tilde"]), want_g, rtol=1e-4)
    np.testing.assert_allclose(float(metrics["B_tilde"]), want_b, rtol=1e-4)
    with pytest.raises(ValueError, match="both be 0"):
        mixed_gt1(MODEL, sgd(0.1), w_f=0.0, w_c=0.0)
