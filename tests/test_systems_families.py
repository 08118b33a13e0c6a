"""Per-client work and systems masks in DRFA, DRFLM, AFL, Mixed FL, CFL and Ditto.

Each vectorized round is checked against a float64 per-client loop written here from
the paper's update rule: client i takes exactly τ_i full-batch steps (a table holding
every τ from 0 to the scan's length, so one client with data takes none), and under
`Systems` a client that is unavailable or drops out is left out of every server sum and
keeps its per-client state. The loops take the round's random draws (which clients,
which slots report or straggle, DRFA's t′, DRFLM's mixup pairs) from the cohort and
work ops, as tests/test_systems.py does; the maths is the loop's.

DRFA with per-client work (its papers assume one τ): client j's snapshot w_j^(t′) is
the model it holds at step t′ of the round, i.e. after min(t′, τ_j) of its steps (a
client that stopped before t′ sends its final model; with `official_code` each slot's
own k_j − 1 likewise), and the λ step keeps the round's τ = `steps` (γ τ v). That is
what `client_update(snapshot_step=, active_steps=)` does, and what these tests fix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import (
    brute_bipartition,
    cohort_slots,
    local_gd,
    np_simplex_projection,
    slot_steps,
    weighted_mean,
    work_table,
)

from fedjax_sim.algorithms import Work, afl, cfl, ditto, drfa, drflm, sgd, with_systems
from fedjax_sim.algorithms.base import cohort_size
from fedjax_sim.algorithms.ditto import PERSONAL_STREAM
from fedjax_sim.algorithms.mixed import mixed
from fedjax_sim.data import ServerData
from fedjax_sim.ops import sample_batch
from fedjax_sim.ops.work import available
from fedjax_sim.systems import Systems

RTOL, ATOL = 1e-4, 1e-5
LR, STEPS, ROUNDS = 0.05, 4, 3
# Client 3 is never available; any other slot drops out with probability 0.3; of the 4
# available slots 4 − round(4 · 0.6) = 2 straggle (a uniform 1..τ_i − 1 of their steps,
# kept).
SYSTEMS = Systems(availability=(1.0, 1.0, 1.0, 0.0, 1.0), dropout=0.3, stragglers=0.4)
# (participation, systems): everyone, a sampled cohort, everyone under Systems.
CASES = [(1.0, None), (0.6, None), (1.0, SYSTEMS)]


def _np(data):
    return (np.asarray(data.x, np.float64), np.asarray(data.y, np.float64),
            np.asarray(data.num_examples))


def _training(m):
    return sgd(LR, steps=STEPS, work=Work(per_client=work_table(m, STEPS)))


def _built(algorithm, systems):
    return algorithm if systems is None else with_systems(algorithm, systems)


class _Seen:
    """What the systems masks did over a test's rounds, so a case cannot pass vacuously."""

    def __init__(self, n):
        self.n, self.unavailable, self.dropped, self.zero_steps = n, 0, 0, 0
        self.scales = []  # DRFA's λ step under Systems: (|A|, r) of every round

    def slots(self, ids, reports, taus):
        for i, rep, tau in zip(ids, reports, taus, strict=True):
            if self.n[i] > 0 and not rep:
                if SYSTEMS.availability[i] == 0.0:
                    self.unavailable += 1
                else:
                    self.dropped += 1
            self.zero_steps += int(self.n[i] > 0 and rep and tau == 0)

    def check(self, systems, participation):
        assert self.zero_steps > 0  # a client with data took no step and was counted
        if systems is not None:
            assert self.dropped > 0
            # Everyone's slots include the unavailable client's; a sampled cohort's never do.
            assert (self.unavailable > 0) == (participation == 1.0)


def _rounds(alg, inputs, state, participation, systems, seen):
    """ROUNDS rounds of `alg` from `state`; after each: (state, the slots' client ids, which
    reported, the steps each took), the draws read from the cohort and work ops."""
    table = work_table(len(seen.n), STEPS)
    round_ = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(1), ROUNDS):
        state, _ = round_(state, inputs, key)
        ids, keys, reports, straggles = cohort_slots(key, len(seen.n), participation, systems)
        taus = slot_steps([table[i] for i in ids], keys, straggles)
        seen.slots(ids, reports, taus)
        yield state, ids, reports, taus


# --------------------------------------------------------------------------- DRFA, DRFLM


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _mixup_keys(key, n_max, alpha, beta):
    k_gamma, k_perm = jax.random.split(key)
    return (jax.random.beta(k_gamma, alpha, beta).astype(jnp.float32),
            jax.random.uniform(k_perm, (n_max,)))


def _mixup_draw(key, count, n_max, alpha, beta):
    """γ and the pairing π of one mixup call, drawn from its key as `ops.mixup_client` does."""
    gamma, u = _mixup_keys(key, n_max, alpha, beta)
    order = np.argsort(np.where(np.arange(n_max) < count, np.asarray(u), np.inf), kind="stable")
    return float(gamma), order[:count]


_sample_batch = jax.jit(sample_batch, static_argnums=(2, 3))


@functools.partial(jax.jit, static_argnums=1)
def _loss_keys(slot_key, steps):
    """Each local step's loss key: split(split(slot key, steps)[t])[1] (`client_update`)."""
    return jax.vmap(jax.random.split)(jax.random.split(slot_key, steps))[:, 1]


def _mixed_rows(x, y, gamma, perm):
    """γ x + (1 − γ) x[π] over the real rows, float64."""
    return gamma * x + (1 - gamma) * x[perm], gamma * y + (1 - gamma) * y[perm]


def _mixup_grad(ref, theta, x, y, n, key, mix):
    gamma, perm = _mixup_draw(key, n, x.shape[0], *mix)
    xm, ym = _mixed_rows(x[:n], y[:n], gamma, perm)
    return ref.grad(theta, xm, ym, n)


def drfa_loop(ref, w, lam, lam32, data, key, participation, systems, table, gamma, seen,
              mix=None, official=False):
    """One DRFA round (DRFLM's with `mix` = (α, β)): C_s ∝ λ with replacement, τ_j steps
    from w keeping w_j^(min(t′, τ_j)), w and w̃ the plain means over the reporting slots
    with data; U_s uniform, v_i = (N/m) f_i(w̃) (under `systems`: (|A|/r) f_i(w̃), |A| the
    clients available, r the slots of U_s that reported), λ ← Π_Δ(λ + γ τ v). `official`: FedTorch's
    form: C_s uniform, slot j's snapshot after min(k_j − 1, τ_j) steps, k_j uniform on
    1..τ−1, w ← w + Σ_j λ_j (N/m)(w_j − w), λ floored at 1e-3 by clip and renormalise."""
    x, y, n = _np(data)
    big_n = len(n)
    key_c, key_t, key_u = jax.random.split(key, 3)
    ids, keys, reports, straggles = cohort_slots(key_c, big_n, participation, systems,
                                                 weights=None if official else lam32)
    taus = slot_steps([table[i] for i in ids], keys, straggles)
    seen.slots(ids, reports, taus)
    s = len(ids)
    if official:
        t_snaps = np.asarray(jax.random.randint(key_t, (s,), 1, STEPS)) - 1
        slot_weights = [lam[i] * big_n / s for i in ids]
    else:
        t_snaps = [int(jax.random.randint(key_t, (), 1, STEPS + 1))] * s
        slot_weights = [1.0] * s
    finals, snaps, weights = [], [], []
    for i, k, rep, tau, t_snap, a in zip(ids, keys, reports, taus, t_snaps, slot_weights,
                                         strict=True):
        if n[i] == 0 or not rep:
            continue
        path = [np.array(w, np.float64)]
        loss_keys = _loss_keys(k, STEPS) if mix is not None else None
        for t in range(tau):
            theta = path[-1]
            g = (ref.grad(theta, x[i], y[i], n[i]) if mix is None else
                 _mixup_grad(ref, theta, x[i], y[i], n[i], loss_keys[t], mix))
            path.append(theta - LR * g)
        finals.append(path[-1])
        snaps.append(path[min(t_snap, tau)])
        weights.append(a)
    if official:
        new_w = w + sum(a * (wj - w) for a, wj in zip(weights, finals, strict=True))
    else:
        new_w = weighted_mean(finals, weights, w)
    w_tilde = weighted_mean(snaps, [1.0] * len(snaps), w)
    u_ids, u_keys, u_reports, _ = cohort_slots(key_u, big_n, participation, systems)
    seen.slots(u_ids, u_reports, [None] * len(u_ids))
    if systems is None:
        scale = big_n / len(u_ids)
    else:  # the clients available this round (as the cohort op draws them from its key)
        here = np.asarray(available(jax.random.split(key_u)[0], big_n, systems))
        scale = here.sum() / max(int(np.sum(u_reports)), 1)
        seen.scales.append((int(here.sum()), int(np.sum(u_reports))))
    v = np.zeros(big_n)
    for i, k, rep in zip(u_ids, u_keys, u_reports, strict=True):
        if n[i] == 0 or not rep:
            continue
        if mix is None:
            loss = ref.loss(w_tilde, x[i], y[i], n[i])
        else:  # the probe's one full batch: its rows in a drawn order, then a mixup
            k_batch, k_loss = jax.random.split(k)
            idx, _ = _sample_batch(k_batch, n[i], x.shape[1], x.shape[1])
            rows = np.asarray(idx)[: n[i]]
            gamma_m, perm = _mixup_draw(k_loss, n[i], x.shape[1], *mix)
            xm, ym = _mixed_rows(x[i][rows], y[i][rows], gamma_m, perm)
            loss = ref.loss(w_tilde, xm, ym, n[i])
        v[i] = scale * loss
    new_lam = np_simplex_projection(lam + gamma * STEPS * v)
    if official:
        new_lam = np.maximum(new_lam, 1e-3)
        new_lam = new_lam / new_lam.sum()
    return new_w, new_lam


@pytest.mark.parametrize("method,participation,systems",
                         [("drfa", *case) for case in CASES]
                         + [pytest.param("drflm", 0.6, None, marks=pytest.mark.slow),
                            ("drflm", 1.0, SYSTEMS),
                            ("official", 0.6, None), ("official", 1.0, SYSTEMS)])
def test_drfa_and_drflm_per_client_work_equal_loop(ragged, linear_model, ref, method,
                                                   participation, systems):
    """A client stops at its own τ_j (its snapshot: after min(t′, τ_j) steps); the λ step
    reads the losses of w̃ (DRFLM: mixup losses) of the reporting clients of U_s. The
    official code's form (γ decaying by 0.9 a round) likewise."""
    m, gamma, mix = ragged.num_clients, 0.1, (0.4, 0.4)
    table = work_table(m, STEPS)
    kw = dict(participation=participation, lambda_lr=gamma, official_code=method == "official")
    alg = (drflm(linear_model, _training(m), mixup=mix, **kw) if method == "drflm" else
           drfa(linear_model, _training(m), **kw))
    alg = _built(alg, systems)
    state = alg.init(jax.random.key(0), ragged)
    w, lam = np.asarray(state.params, np.float64), np.asarray(state.lam, np.float64)
    seen = _Seen(np.asarray(ragged.num_examples))
    for r, key in enumerate(jax.random.split(jax.random.key(3), ROUNDS + 1)):
        lam32 = state.lam
        state, _ = jax.jit(alg.round)(state, ragged, key)
        gamma_r = gamma * 0.9 ** (r + 1) if method == "official" else gamma
        w, lam = drfa_loop(ref, w, lam, lam32, ragged, key, participation, systems, table,
                           gamma_r, seen, mix if method == "drflm" else None,
                           official=method == "official")
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.lam, lam, atol=1e-5)
    seen.check(systems, participation)
    assert not np.allclose(lam, lam[0])  # λ moved


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_drfa_lambda_step_under_availability_scales_by_the_available(ragged, linear_model, ref,
                                                                     participation):
    """Clients available with probability 0.6, dropping out with 0.3: U_s is drawn among
    the available A, and v_i = (|A|/r) f_i(w̃) for the r slots that reported (N/m without
    Systems), so given A it estimates the available clients' losses without bias."""
    m, gamma = ragged.num_clients, 0.1
    systems = Systems(availability=0.6, dropout=0.3)
    table = work_table(m, STEPS)
    alg = with_systems(drfa(linear_model, _training(m), participation=participation,
                            lambda_lr=gamma), systems)
    state = alg.init(jax.random.key(0), ragged)
    w, lam = np.asarray(state.params, np.float64), np.asarray(state.lam, np.float64)
    seen = _Seen(np.asarray(ragged.num_examples))
    for key in jax.random.split(jax.random.key(5), 6):
        lam32 = state.lam
        state, _ = jax.jit(alg.round)(state, ragged, key)
        w, lam = drfa_loop(ref, w, lam, lam32, ragged, key, participation, systems, table,
                           gamma, seen)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.lam, lam, atol=1e-5)
    slots = cohort_size(m, participation)
    # Not vacuous: some rounds had fewer than N available, and r differed from |A| and m.
    assert any(a < m for a, _ in seen.scales)
    assert any(r not in (a, slots) and r > 0 for a, r in seen.scales)
    assert not np.allclose(lam, lam[0])


# --------------------------------------------------------------------------- AFL


@pytest.mark.parametrize("participation,systems", CASES + [(0.6, SYSTEMS)])
def test_afl_per_client_work_equals_loop(ragged, linear_model, ref, participation, systems):
    """w ← Σ λ_i w_i / Σ λ_i over the reporting slots with data, w_i after τ_i steps (w
    itself at τ_i = 0); v_i = (m/s) F_i(w) for them, λ ← Π_Δ(λ + γ v) over the clients
    holding data."""
    m, gamma = ragged.num_clients, 0.3
    alg = _built(afl(linear_model, _training(m), participation=participation,
                     lambda_lr=gamma), systems)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w, lam = np.asarray(state.params, np.float64), np.asarray(state.lam, np.float64)
    seen = _Seen(n)
    for after, ids, reports, taus in _rounds(alg, ragged, state, participation, systems,
                                             seen):
        trained, weights, v = [], [], np.zeros(m)
        for i, rep, tau in zip(ids, reports, taus, strict=True):
            if n[i] == 0 or not rep:
                continue
            trained.append(local_gd(ref, w, x[i], y[i], n[i], LR, tau))
            weights.append(lam[i])
            v[i] = m / len(ids) * ref.loss(w, x[i], y[i], n[i])
        w = weighted_mean(trained, weights, w)
        new_lam = np.zeros(m)
        new_lam[n > 0] = np_simplex_projection((lam + gamma * v)[n > 0])
        lam = new_lam
        np.testing.assert_allclose(after.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(after.lam, lam, atol=1e-6)
    seen.check(systems, participation)


# --------------------------------------------------------------------------- Ditto


@pytest.mark.parametrize("participation,systems", CASES)
def test_ditto_global_and_personal_steps_follow_the_same_work(ragged, linear_model, ref,
                                                              participation, systems):
    """w ← mean of the reporting clients' τ_i-step models; each of them also takes τ_i
    personal steps v ← v − η(∇F_i(v) + λ(v − w^t)) from its own v_i (the same τ_i, a
    straggler's share included); every other client keeps v_i."""
    m, pull = ragged.num_clients, 0.5
    alg = _built(ditto(linear_model, _training(m), ditto_lambda=pull,
                       participation=participation), systems)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    personal = np.tile(w, (m, 1))
    seen = _Seen(n)
    for after, ids, reports, taus in _rounds(alg, ragged, state, participation, systems,
                                             seen):
        trained, new_personal = [], personal.copy()
        for i, rep, tau in zip(ids, reports, taus, strict=True):
            if n[i] == 0 or not rep:
                continue
            trained.append(local_gd(ref, w, x[i], y[i], n[i], LR, tau))
            new_personal[i] = local_gd(ref, personal[i], x[i], y[i], n[i], LR, tau,
                                       extra=lambda v, w_t=w: pull * (v - w_t))
        w = weighted_mean(trained, [1.0] * len(trained), w)
        personal = new_personal
        np.testing.assert_allclose(after.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(after.personal, personal, rtol=RTOL, atol=ATOL)
    seen.check(systems, participation)


def test_ditto_personal_steps_draw_the_global_steps_work_regression(ragged, linear_model, ref):
    """Regression: τ_i redrawn every round and a straggler's share were drawn from the
    personal steps' own key, so a client took, say, 1 global and 3 personal steps. Now both
    are drawn from the slot's key: the personal steps take the global steps' τ."""
    m, pull = ragged.num_clients, 0.5
    training = sgd(LR, steps=STEPS, work=Work(low=0, per_round=True))
    systems = Systems(stragglers=0.5)
    alg = with_systems(ditto(linear_model, training, ditto_lambda=pull), systems)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    personal = np.tile(w, (m, 1))
    differ = 0
    for key in jax.random.split(jax.random.key(1), ROUNDS):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        ids, keys, _, straggles = cohort_slots(key, m, 1.0, systems)
        taus = [int(training.client_steps(k, i, n[i], f))
                for i, k, f in zip(ids, keys, straggles, strict=True)]
        # What the personal key alone would have drawn: not the same work.
        own = [int(training.client_steps(jax.random.fold_in(k, PERSONAL_STREAM), i, n[i], f))
               for i, k, f in zip(ids, keys, straggles, strict=True)]
        differ += sum(a != b for a, b, i in zip(taus, own, ids, strict=True) if n[i] > 0)
        trained = []
        for i, tau in zip(ids, taus, strict=True):
            if n[i] == 0:
                continue
            trained.append(local_gd(ref, w, x[i], y[i], n[i], LR, tau))
            personal[i] = local_gd(ref, personal[i], x[i], y[i], n[i], LR, tau,
                                   extra=lambda v, w_t=w: pull * (v - w_t))
        w = weighted_mean(trained, [1.0] * len(trained), w)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.personal, personal, rtol=RTOL, atol=ATOL)
    assert differ > 0  # the old draw would have failed this test


# --------------------------------------------------------------------------- CFL


def cfl_loop(ref, params, cid, used, data, ids, taus, reports, eps1):
    """One CFL round (ε₂ = 0): Δθ_i = τ_i steps from θ_c(i), minus θ_c(i), for the reporting
    slots with data; a cluster with mean ‖Σ p_i Δθ_i‖ < ε₁ and two members splits by the
    brute-force optimal bipartition; θ_c += Σ p_i Δθ_i within the clusters after the
    splits (p_i ∝ n_i). Other clients keep their cluster."""
    x, y, n = _np(data)
    slots = len(params)
    params, cid = params.copy(), cid.copy()
    act = [i for i, rep in zip(ids, reports, strict=True) if n[i] > 0 and rep]
    tau_of = dict(zip(ids, taus, strict=True))
    delta = {i: local_gd(ref, params[cid[i]], x[i], y[i], n[i], LR, tau_of[i]) - params[cid[i]]
             for i in act}

    def members(c):
        return [i for i in act if cid[i] == c]

    def mean_delta(mem):
        return sum(n[i] * delta[i] for i in mem) / sum(n[i] for i in mem)

    wants = {c: bool(members(c)) and np.linalg.norm(mean_delta(members(c))) < eps1
             and max(np.linalg.norm(delta[i]) for i in members(c)) > 0 and len(members(c)) >= 2
             for c in range(slots)}
    for c in range(slots):
        if wants[c] and used < slots:
            mem = members(c)
            norms = {i: np.linalg.norm(delta[i]) for i in mem}
            sim = np.zeros((len(n), len(n)))
            for i in mem:
                for j in mem:
                    # a zero update (τ_i = 0) is similar to nothing, as the kernel's ε says
                    sim[i, j] = delta[i] @ delta[j] / (norms[i] * norms[j] + 1e-12)
            _, c2, ties = brute_bipartition(sim, [i for i in ids if i in mem])
            assert ties == 1  # the problem's own precondition: one optimal split
            for i in c2:
                cid[i] = used
            params[used] = params[c]
            used += 1
    for c in range(slots):
        if members(c):
            params[c] = params[c] + mean_delta(members(c))
    return params, cid, used


@pytest.mark.parametrize("participation,systems,eps1",
                         [(*case, 1e3) for case in CASES] + [(0.6, None, 0.0)])
def test_cfl_per_client_work_equals_loop(ragged, linear_model, ref, participation, systems,
                                         eps1):
    """ε₁ = 10³: every cluster with two reporting members splits while slots are free, on
    the cosine similarities of updates of τ_i steps (a τ_i = 0 client's update is 0);
    ε₁ = 0: never, each cluster moves by its members' example-weighted mean update."""
    m = ragged.num_clients
    alg = _built(cfl(linear_model, _training(m), participation=participation, max_clusters=3,
                     eps1=eps1, eps2=0.0), systems)
    state = alg.init(jax.random.key(0), ragged)
    params = np.asarray(state.cluster_params, np.float64)
    cid, used = np.zeros(m, int), 1
    seen = _Seen(np.asarray(ragged.num_examples))
    for after, ids, reports, taus in _rounds(alg, ragged, state, participation, systems,
                                             seen):
        params, cid, used = cfl_loop(ref, params, cid, used, ragged, ids, taus, reports, eps1)
        np.testing.assert_array_equal(after.assignment, cid)
        assert int(after.num_clusters) == used
        np.testing.assert_allclose(after.cluster_params, params, rtol=RTOL, atol=ATOL)
    seen.check(systems, participation)
    assert used == (3 if eps1 > 0 else 1)


# --------------------------------------------------------------------------- Mixed FL


def _server(seed=0, rows=6):
    rng = np.random.default_rng(seed)
    xc = rng.normal(size=(rows, 3)).astype(np.float32)
    yc = (xc @ np.array([1.0, -1.0, 0.5]) + 0.1 * rng.normal(size=rows)).astype(np.float32)
    return ServerData({"x": jnp.asarray(xc), "y": jnp.asarray(yc)})


def mixed_loop(ref, variant, x_t, data, server, ids, taus, reports, w_f, w_c):
    """One full-batch Mixed FL round (server lr 1, uniform weights, 2-GT: α = ½ and this
    round's ĝ_f). A reporting client with data takes its own τ_i steps on g_i (PT) or on
    w_f g_i + w_c ĝ_c (GT) and sends Δ_i and ĝ_i = g_i(x^(t)) (sent at τ_i = 0 too: it is
    the first step's gradient, taken whether or not the step is applied); the server
    takes `steps` central steps."""
    x, y, n = _np(data)
    xc, yc = (np.asarray(server.arrays[a], np.float64) for a in ("x", "y"))
    nc = len(yc)
    hat_g_c = ref.grad(x_t, xc, yc, nc)
    gt = variant != "parallel"
    deltas, grads = [], []
    for i, rep, tau in zip(ids, reports, taus, strict=True):
        if n[i] == 0 or not rep:
            continue
        extra = (lambda th: 0.0) if not gt else (
            lambda th, i=i: (w_f - 1.0) * ref.grad(th, x[i], y[i], n[i]) + w_c * hat_g_c)
        deltas.append(local_gd(ref, x_t, x[i], y[i], n[i], LR, tau, extra=extra) - x_t)
        grads.append(ref.grad(x_t, x[i], y[i], n[i]))
    ones = [1.0] * len(deltas)
    zero = np.zeros_like(x_t)
    delta_f, hat_g_f = weighted_mean(deltas, ones, zero), weighted_mean(grads, ones, zero)
    if variant == "gt1":
        return x_t + delta_f
    if variant == "parallel":
        y_c = local_gd(ref, x_t, xc, yc, nc, LR, STEPS)
        return x_t + w_f * delta_f + w_c * (y_c - x_t)
    y_c = local_gd(ref, x_t, xc, yc, nc, LR, STEPS,
                   extra=lambda th: (w_c - 1.0) * ref.grad(th, xc, yc, nc) + w_f * hat_g_f)
    return x_t + 0.5 * delta_f + 0.5 * (y_c - x_t)


@pytest.mark.parametrize("variant,participation,systems",
                         [("parallel", *case) for case in CASES]
                         + [(v, *case) for v in ("gt1", "gt2") for case in CASES[1:]])
def test_mixed_fl_per_client_work_equals_loop(ragged, linear_model, ref, variant,
                                              participation, systems):
    """Each client's K_i = τ_i local steps (PT: on f_i; 1-/2-GT: with the transferred ĝ_c);
    the central steps keep K; only reporting clients enter Δ_f and ĝ_f."""
    m, w_f, w_c = ragged.num_clients, 0.6, 0.4
    server = _server()
    alg = _built(mixed(linear_model, _training(m), variant=variant, w_f=w_f, w_c=w_c,
                       participation=participation), systems)
    state = alg.init(jax.random.key(0), (ragged, server))
    params = np.asarray(state.params, np.float64)
    seen = _Seen(np.asarray(ragged.num_examples))
    for after, ids, reports, taus in _rounds(alg, (ragged, server), state, participation,
                                             systems, seen):
        params = mixed_loop(ref, variant, params, ragged, server, ids, taus, reports, w_f, w_c)
        np.testing.assert_allclose(after.params, params, rtol=RTOL, atol=ATOL)
    seen.check(systems, participation)
