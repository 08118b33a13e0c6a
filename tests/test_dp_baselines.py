"""`with_dp` / `with_dp_ftrl` on FedProx, FedNova, SCAFFOLD, Ditto and HypCluster.

Each DP round is checked against a plain float64 loop over the clients written here from
the papers and from DP-FedAvg (McMahan et al. 2018): local full-batch GD, each client's
change clipped to L2 norm C (flat over what it sends), summed, plus Gaussian noise of
standard deviation σC, divided by the expected cohort D (D/k per cluster). The noise is
redrawn here from the documented key rule (`algorithms.private`, `ops.privacy`):

    k = fold_in(round_key, PRIVACY_STREAM);  key_sum, key_clip = split(k)
    key_noise, key_count = split(key_sum)
    leaf j's noise = σ·C·normal(split(key_noise, n_leaves)[j], leaf.shape, leaf.dtype)

(DP-FTRL: node noise σ·C·normal(split(k, n_leaves)[j]) of the tree's node drawn at step
t.) Also: noise 0 with a clip above every norm is the plain round, and the refusals
(CFL, HypCluster's "kmeans++", and the algorithms whose server reads client losses).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import (
    afl,
    cfl,
    ditto,
    drfa,
    fednova,
    fedprox,
    hypcluster,
    qffl,
    robust_ifca,
    scaffold,
    sgd,
    with_dp,
    with_dp_ftrl,
    with_initial_params,
    with_systems,
)
from fedjax_sim.algorithms.private import PRIVACY_STREAM
from fedjax_sim.ops.work import Work
from fedjax_sim.systems import Systems

LR, TAU, MU, LAMBDA = 0.05, 3, 0.5, 0.5
CLIP, SIGMA = 0.3, 0.7  # (each loop test picks a C between its clients' norms)
D = 5.0  # the ragged fixture's cohort at full participation: 5 slots (one client is empty)
N_DATA = 4  # clients holding data
BIG_CLIP = 1e6


def _np_data(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _holding(n):
    return [i for i in range(len(n)) if n[i] > 0]


def _local_gd(ref, theta, x, y, n, lr, steps, extra=None):
    """`steps` full-batch GD steps at `lr` (float64); extra(θ): a term added to ∇F_i."""
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(steps):
        grad = ref.grad(theta, x, y, n)
        theta = theta - lr * (grad if extra is None else grad + extra(theta))
    return theta


def _clip(parts, clip):
    """The client's message (a list of arrays) scaled by min(1, C / ‖message‖₂)."""
    norm = np.sqrt(sum(float(np.sum(p**2)) for p in parts))
    return [p * min(1.0, clip / norm) if norm > 0 else p for p in parts], norm


def _gaussian_noise(key, shapes, stddev):
    """Leaf j: stddev · normal(split(key, n_leaves)[j], shape_j, float32), as float64."""
    keys = jax.random.split(key, len(shapes))
    return [
        stddev * np.asarray(jax.random.normal(k, s, jnp.float32), np.float64)
        for k, s in zip(keys, shapes, strict=True)
    ]


def _dp_noise(round_key, shapes, clip, sigma=SIGMA):
    """with_dp's noise of a round's sums (the module docstring's rule)."""
    key_sum, _ = jax.random.split(jax.random.fold_in(round_key, PRIVACY_STREAM))
    key_noise, _ = jax.random.split(key_sum)
    return _gaussian_noise(key_noise, shapes, sigma * clip)


def _fixed_params(params):
    params = jnp.asarray(params, jnp.float32)
    return lambda key: params


def _round_keys(count):
    return jax.random.split(jax.random.key(7), count)


def _assert_some_clipped(norms, clip):
    """The loops must exercise both sides of the clip (or the test could not fail)."""
    norms = np.asarray(norms)
    assert np.any(norms > clip) and np.any(norms < clip), norms


# --------------------------------------------------------------------------- vs float64 loops


def test_fedprox_dp_rounds_equal_loop(ragged, linear_model, ref):
    """w ← w + (Σ_i clip(w_i − w) + N(0, σ²C²)) / D, w_i: τ GD steps on F_i + μ/2‖·−w‖²."""
    clip = 0.12  # between the clients' norms (asserted below)
    alg = with_dp(fedprox(linear_model, sgd(LR, steps=TAU), mu=MU), clip, SIGMA)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    w = np.asarray(state.params, np.float64)
    norms = []
    for key in _round_keys(2):
        state, metrics = jax.jit(alg.round)(state, ragged, key)
        total = np.zeros_like(w)
        for i in _holding(n):
            wi = _local_gd(ref, w, x[i], y[i], n[i], LR, TAU, extra=lambda th: MU * (th - w))
            (clipped,), norm = _clip([wi - w], clip)
            total += clipped
            norms.append(norm)
        (noise,) = _dp_noise(key, [w.shape], clip)
        w = w + (total + noise) / D
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        assert float(metrics["dp_clip_norm"]) == pytest.approx(clip)
    _assert_some_clipped(norms, clip)


def test_fednova_dp_rounds_equal_loop(ragged, linear_model, ref):
    """Per-client τ_i: d_i = (x − y_i)/τ_i is clipped; x ← x − τ (Σ clip(d_i) + noise)/D
    with τ the configured steps (the fixed τ_eff), whatever the τ_i and the weighting."""
    clip = 0.04  # between the clients' norms (asserted below)
    work = (3, 1, 2, 1, 2)  # τ_i per client; client 2 holds no data
    alg = with_dp(
        fednova(linear_model, sgd(LR, steps=TAU, work=Work(per_client=work))), clip, SIGMA
    )
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    xs = np.asarray(state.params, np.float64)
    norms = []
    for key in _round_keys(2):
        state, metrics = jax.jit(alg.round)(state, ragged, key)
        total = np.zeros_like(xs)
        for i in _holding(n):
            yi = _local_gd(ref, xs, x[i], y[i], n[i], LR, work[i])
            (clipped,), norm = _clip([(xs - yi) / work[i]], clip)
            total += clipped
            norms.append(norm)
        (noise,) = _dp_noise(key, [xs.shape], clip)
        xs = xs - TAU * (total + noise) / D
        np.testing.assert_allclose(state.params, xs, rtol=1e-5, atol=1e-6)
        assert float(metrics["tau_eff"]) == TAU
    _assert_some_clipped(norms, clip)


def _scaffold_client(ref, xs, c, ci, x, y, n):
    """SCAFFOLD option II for one client (K = TAU steps of SGD at LR): (Δy_i, Δc_i)."""
    yi = _local_gd(ref, xs, x, y, n, LR, TAU, extra=lambda th: c - ci)
    return yi - xs, -c + (xs - yi) / (TAU * LR)


def test_scaffold_dp_rounds_equal_loop(ragged, linear_model, ref):
    """(Δy_i, Δc_i) clipped as one message; x ← x + S̃_y / D, c ← c + S̃_c / N (N the
    clients holding data); c_i ← c_i + Δc_i unclipped (it stays on the client)."""
    clip = 0.3  # between the clients' norms (asserted below)
    alg = with_dp(scaffold(linear_model, sgd(LR, steps=TAU)), clip, SIGMA)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    xs = np.asarray(state.params, np.float64)
    c, ci = np.zeros_like(xs), np.zeros((len(n), xs.size))
    norms = []
    for key in _round_keys(2):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        sum_y, sum_c, new_ci = np.zeros_like(xs), np.zeros_like(xs), ci.copy()
        for i in _holding(n):
            dy, dc = _scaffold_client(ref, xs, c, ci[i], x[i], y[i], n[i])
            (cy, cc), norm = _clip([dy, dc], clip)
            sum_y, sum_c = sum_y + cy, sum_c + cc
            new_ci[i] = ci[i] + dc
            norms.append(norm)
        noise_y, noise_c = _dp_noise(key, [xs.shape, c.shape], clip)  # leaves (Δy, Δc) in order
        xs = xs + (sum_y + noise_y) / D
        c = c + (sum_c + noise_c) / N_DATA
        ci = new_ci
        np.testing.assert_allclose(state.params, xs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.control, c, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state.client_controls, ci, rtol=1e-5, atol=1e-4)
    _assert_some_clipped(norms, clip)


def test_scaffold_dp_ftrl_rounds_equal_loop(ragged, linear_model, ref):
    """DP-FTRL on (x, c): round t adds (S_t + n_t − n_{t−1}) / D to x and (…)·D/N / D to c,
    n_t the tree's noise of the prefix sum (n_3 = node(2) + node(3): two nodes)."""
    clip = 0.3  # between the clients' norms (asserted below)
    rounds = 3
    alg = with_dp_ftrl(scaffold(linear_model, sgd(LR, steps=TAU)), clip, SIGMA, rounds=rounds)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    xs = np.asarray(state.params, np.float64)
    c, ci = np.zeros_like(xs), np.zeros((len(n), xs.size))
    nodes, previous = {}, [np.zeros_like(xs), np.zeros_like(xs)]
    for t, key in enumerate(_round_keys(rounds), start=1):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        sum_y, sum_c, new_ci = np.zeros_like(xs), np.zeros_like(xs), ci.copy()
        for i in _holding(n):
            dy, dc = _scaffold_client(ref, xs, c, ci[i], x[i], y[i], n[i])
            (cy, cc), _ = _clip([dy, dc], clip)
            sum_y, sum_c = sum_y + cy, sum_c + cc
            new_ci[i] = ci[i] + dc
        level = (t & -t).bit_length() - 1  # the node completed at step t
        nodes[level] = _gaussian_noise(
            jax.random.fold_in(key, PRIVACY_STREAM), [xs.shape, c.shape], SIGMA * clip
        )
        noise = [sum(nodes[lv][j] for lv in nodes if (t >> lv) & 1) for j in range(2)]
        xs = xs + (sum_y + noise[0] - previous[0]) / D
        c = c + (sum_c + noise[1] - previous[1]) / N_DATA
        ci, previous = new_ci, noise
        np.testing.assert_allclose(state.params, xs, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.control, c, rtol=1e-5, atol=1e-5)


def test_fednova_dp_ftrl_rounds_equal_loop(ragged, linear_model, ref):
    """DP-FTRL on FedNova: x_t = x_{t−1} − τ (S_t + n_t − n_{t−1}) / D, S_t the clipped d_i."""
    clip, rounds = 0.04, 3
    work = (3, 1, 2, 1, 2)
    alg = with_dp_ftrl(
        fednova(linear_model, sgd(LR, steps=TAU, work=Work(per_client=work))),
        clip,
        SIGMA,
        rounds=rounds,
    )
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    xs = np.asarray(state.params, np.float64)
    nodes, previous = {}, np.zeros_like(xs)
    for t, key in enumerate(_round_keys(rounds), start=1):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        total = np.zeros_like(xs)
        for i in _holding(n):
            yi = _local_gd(ref, xs, x[i], y[i], n[i], LR, work[i])
            (clipped,), _ = _clip([(xs - yi) / work[i]], clip)
            total += clipped
        level = (t & -t).bit_length() - 1
        (nodes[level],) = _gaussian_noise(
            jax.random.fold_in(key, PRIVACY_STREAM), [xs.shape], SIGMA * clip
        )
        noise = sum(nodes[lv] for lv in nodes if (t >> lv) & 1)
        xs = xs - TAU * (total + noise - previous) / D
        previous = noise
        np.testing.assert_allclose(state.params, xs, rtol=1e-5, atol=1e-6)


def test_ditto_dp_rounds_equal_loop(ragged, linear_model, ref):
    """The global w by DP-FedAvg; each personal v_k by τ GD steps on F_k + λ/2‖v − w^t‖²
    from its own v_k, pulled toward the noised w^t it received (never noised itself)."""
    clip = 0.12  # between the clients' norms (asserted below)
    alg = with_dp(ditto(linear_model, sgd(LR, steps=TAU), ditto_lambda=LAMBDA), clip, SIGMA)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    w = np.asarray(state.params, np.float64)
    v = np.tile(w, (len(n), 1))
    norms = []
    for key in _round_keys(2):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        total = np.zeros_like(w)
        for i in _holding(n):
            wi = _local_gd(ref, w, x[i], y[i], n[i], LR, TAU)
            (clipped,), norm = _clip([wi - w], clip)
            total += clipped
            norms.append(norm)
            v[i] = _local_gd(
                ref, v[i], x[i], y[i], n[i], LR, TAU, extra=lambda th: LAMBDA * (th - w)
            )
        (noise,) = _dp_noise(key, [w.shape], clip)
        w = w + (total + noise) / D
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.personal, v, rtol=1e-5, atol=1e-6)
    _assert_some_clipped(norms, clip)


def test_ditto_dp_partial_participation_and_dropout(ragged, linear_model, ref):
    """3 of 5 slots a round, each chosen client dropping out with probability 0.4: only the
    clients that report add their clipped change (the reporters are the clients whose
    personal model moved), and D stays the cohort's 3 slots."""
    clip, slots = 0.12, 3
    alg = with_dp(
        with_systems(
            ditto(linear_model, sgd(LR, steps=TAU), ditto_lambda=LAMBDA, participation=0.6),
            Systems(dropout=0.4),
        ),
        clip,
        SIGMA,
    )
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    w = np.asarray(state.params, np.float64)
    reporters_per_round = []
    for key in _round_keys(4):
        before = np.asarray(state.personal, np.float64)
        state, metrics = jax.jit(alg.round)(state, ragged, key)
        moved = np.any(np.asarray(state.personal) != before.astype(np.float32), axis=1)
        reporters = [i for i in range(len(n)) if moved[i]]
        assert all(n[i] > 0 for i in reporters)
        assert int(metrics["participants"]) == len(reporters)
        reporters_per_round.append(len(reporters))
        total = np.zeros_like(w)
        for i in reporters:
            wi = _local_gd(ref, w, x[i], y[i], n[i], LR, TAU)
            (clipped,), _ = _clip([wi - w], clip)
            total += clipped
        (noise,) = _dp_noise(key, [w.shape], clip)
        w = w + (total + noise) / slots
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-6)
    assert min(reporters_per_round) < slots  # a round in which someone did not report
    assert max(reporters_per_round) > 0


def test_hypcluster_dp_rounds_equal_loop(ragged, linear_model, ref):
    """f(i) = argmin_j F_i(h_j); h_j ← h_j + (Σ_{f(i)=j} clip(h̃_i − h_j) + N(0, σ²C²)) /
    (D/k): k independent draws (one [k, d] leaf); the empty hypothesis moves by noise only."""
    clip = 0.09  # between the clients' norms (asserted below)
    k = 3
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])
    alg = with_dp(
        with_initial_params(
            hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=k), _fixed_params(theta0)
        ),
        clip,
        SIGMA,
    )
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np_data(ragged)
    h = theta0.copy()
    norms, chosen = [], set()
    for key in _round_keys(2):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        totals = np.zeros_like(h)
        for i in _holding(n):
            j = int(np.argmin([ref.loss(h[c], x[i], y[i], n[i]) for c in range(k)]))
            trained = _local_gd(ref, h[j], x[i], y[i], n[i], LR, TAU)
            (clipped,), norm = _clip([trained - h[j]], clip)
            totals[j] += clipped
            norms.append(norm)
            chosen.add(j)
        (noise,) = _dp_noise(key, [h.shape], clip)
        h = h + (totals + noise) / (D / k)
        np.testing.assert_allclose(state.cluster_params, h, rtol=1e-5, atol=1e-5)
    assert chosen == {0, 1}  # two clusters trained, the third one empty
    _assert_some_clipped(norms, clip)


# --------------------------------------------------------------------------- σ = 0: the plain round


def _plain_and_private(build, ragged, rounds=2, **dp):
    """The plain algorithm's and its with_dp(σ = 0, C above every norm) twin's states."""
    plain, private = build(), with_dp(build(), BIG_CLIP, 0.0, **dp)
    states = [a.init(jax.random.key(0), ragged) for a in (plain, private)]
    for key in _round_keys(rounds):
        states = [
            jax.jit(a.round)(s, ragged, key)[0]
            for a, s in zip((plain, private), states, strict=True)
        ]
    return states


@pytest.mark.parametrize("name", ["fedprox", "fednova", "scaffold", "ditto"])
def test_noiseless_unclipped_dp_is_the_plain_round(name, ragged, linear_model):
    """σ = 0, C above every norm, D = the clients holding data (uniform weights, equal
    τ_i): the DP round is the plain one (x, c and c_i, personal models)."""
    training = sgd(LR, steps=TAU)
    build = {
        "fedprox": lambda: fedprox(linear_model, training, mu=MU),
        "fednova": lambda: fednova(linear_model, training, weighting="uniform"),
        "scaffold": lambda: scaffold(linear_model, training),
        "ditto": lambda: ditto(linear_model, training, ditto_lambda=LAMBDA),
    }[name]
    plain, private = _plain_and_private(build, ragged, expected_clients=float(N_DATA))
    fields = {
        "scaffold": ("params", "control", "client_controls"),
        "ditto": ("params", "personal"),
    }.get(name, ("params",))
    for field in fields:
        np.testing.assert_allclose(
            getattr(private, field), getattr(plain, field), rtol=1e-5, atol=1e-6
        )
    assert not np.allclose(plain.params, _initial(build, ragged))  # the rounds moved it


def _initial(build, ragged):
    return build().init(jax.random.key(0), ragged).params


def test_noiseless_unclipped_dp_is_the_plain_round_hypcluster(ragged, linear_model):
    """Per cluster with the count as denominator (the plain rule's own, uniform weights):
    each hypothesis is its members' mean, an empty one kept, as in the plain round."""
    theta0 = np.array([[0.0, 0.0, 0.0], [1.0, -1.0, 0.5], [50.0, 50.0, 50.0]])

    def build():
        return with_initial_params(
            hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=3, weighting="uniform"),
            _fixed_params(theta0),
        )

    plain, private = _plain_and_private(build, ragged, denominator="count")
    np.testing.assert_allclose(private.cluster_params, plain.cluster_params, rtol=1e-5, atol=1e-6)
    assert not np.allclose(plain.cluster_params[:2], theta0[:2])
    np.testing.assert_array_equal(private.cluster_params[2], theta0[2])


# --------------------------------------------------------------------------- refusals


def _refusal(alg, ragged):
    with pytest.raises(ValueError) as info:
        state = alg.init(jax.random.key(0), ragged)
        alg.round(state, ragged, jax.random.key(1))
    message = str(info.value)
    assert "\n" not in message
    return message


def test_cfl_refuses_dp_in_one_line(ragged, linear_model):
    message = _refusal(with_dp(cfl(linear_model, sgd(LR, steps=TAU)), CLIP, SIGMA), ragged)
    assert message.startswith(
        "CFL takes no aggregation rule (with_dp, with_aggregator): its splits read every "
        "member's raw update")


def test_hypcluster_kmeans_init_refuses_dp_in_one_line(ragged, linear_model):
    alg = hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=2, init="kmeans++")
    message = _refusal(with_dp(alg, CLIP, SIGMA), ragged)
    assert "needs init='random': 'kmeans++' makes clients' own trained models" in message


def test_dp_ftrl_refuses_clustered_algorithms(ragged, linear_model):
    alg = hypcluster(linear_model, sgd(LR, steps=TAU), num_clusters=2)
    message = _refusal(with_dp_ftrl(alg, CLIP, SIGMA, rounds=3), ragged)
    assert "holds one model per cluster: use with_dp" in message


@pytest.mark.parametrize("name", ["drfa", "afl", "qffl", "robust_ifca"])
def test_dp_refused_where_the_server_reads_client_losses(name, ragged, linear_model):
    training = sgd(LR, steps=TAU)
    alg = {
        "drfa": lambda: drfa(linear_model, training),
        "afl": lambda: afl(linear_model, training),
        "qffl": lambda: qffl(linear_model, training),
        "robust_ifca": lambda: robust_ifca(linear_model, training, num_clusters=2),
    }[name]()
    message = _refusal(with_dp(alg, CLIP, SIGMA), ragged)
    assert "has no `aggregation`: its server uses more than the clipped sum" in message
