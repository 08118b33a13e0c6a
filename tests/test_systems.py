"""Heterogeneous systems: per-client local work, stragglers, availability, dropout, FedNova.

Each vectorized round is checked against a float64 per-client loop written here from
the papers: client i takes exactly τ_i full-batch gradient steps, and the server
averages what arrived. The loops take the round's random draws (which clients, which
τ_i, who straggles or reports) from the cohort op, whose sampling is tested on its own
below; the maths is the loop's.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import cohort_slots, local_gd, slot_steps, weighted_mean, work_table

from fedjax_sim.algorithms import (
    Work,
    fedavg,
    fednova,
    fedprox,
    ifca,
    local_models,
    scaffold,
    sgd,
    with_systems,
)
from fedjax_sim.algorithms.fednova import work_norm
from fedjax_sim.execution import planned
from fedjax_sim.ops import client_update
from fedjax_sim.ops.work import (
    STRAGGLE_STREAM,
    available,
    straggler_steps,
    time_zones,
)
from fedjax_sim.systems import Systems

RTOL, ATOL = 1e-4, 1e-5
LR, STEPS = 0.05, 4


def _np(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


# --------------------------------------------------------------------------- per-client work


@pytest.mark.parametrize("participation,weighting", [(1.0, "uniform"), (0.6, "examples")])
@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
def test_per_client_work_rounds_equal_loop(ragged, linear_model, ref, participation,
                                           weighting, algorithm):
    """Client i takes exactly τ_i of the 4 steps (one takes none: it sends w back)."""
    m = ragged.num_clients
    table = work_table(m, STEPS)
    training = sgd(LR, steps=STEPS, work=Work(per_client=table))
    mu = 0.5 if algorithm == "fedprox" else 0.0
    kw = dict(participation=participation, weighting=weighting)
    alg = (fedprox(linear_model, training, mu=mu, **kw) if algorithm == "fedprox"
           else fedavg(linear_model, training, **kw))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        ids, *_ = cohort_slots(key, m, participation)
        trained = [local_gd(ref, w, x[i], y[i], n[i], LR, table[i],
                       extra=lambda th, w_t=w: mu * (th - w_t)) for i in ids]
        weights = [float(n[i] > 0) * (n[i] if weighting == "examples" else 1.0) for i in ids]
        w = weighted_mean(trained, weights, w)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)


def test_per_client_work_scaffold_uses_each_clients_steps(ragged, linear_model, ref):
    """Option II with K_i: c_i⁺ = c_i − c + (x − y_i)/(K_i η); a client with K_i = 0 keeps c_i."""
    m = ragged.num_clients
    table = work_table(m, STEPS)
    alg = scaffold(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)))
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    holding = [i for i in range(m) if n[i] > 0]
    xs = np.asarray(state.params, np.float64)
    c, ci = np.zeros_like(xs), np.zeros((m, xs.size))
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        new_ci, dys, dcs = ci.copy(), [], []
        for i in holding:
            yi = local_gd(ref, xs, x[i], y[i], n[i], LR, table[i],
                          extra=lambda th, i=i: c - ci[i])
            if table[i] > 0:
                new_ci[i] = ci[i] - c + (xs - yi) / (table[i] * LR)
            dys.append(yi - xs)
            dcs.append(new_ci[i] - ci[i])
        xs = xs + np.mean(dys, axis=0)
        c = c + np.mean(dcs, axis=0)
        ci = new_ci
        np.testing.assert_allclose(state.params, xs, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(state.client_controls, ci, rtol=RTOL, atol=ATOL)


def test_per_client_work_local_models(ragged, linear_model, ref):
    table = work_table(ragged.num_clients, STEPS)
    alg = local_models(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)))
    state = alg.init(jax.random.key(0), ragged)
    start = np.asarray(state.params, np.float64)
    state, _ = jax.jit(alg.round)(state, ragged, jax.random.key(1))
    x, y, n = _np(ragged)
    for i, tau in enumerate(table):
        want = local_gd(ref, start[i], x[i], y[i], n[i], LR, tau)
        np.testing.assert_allclose(state.params[i], want, rtol=RTOL, atol=ATOL)


def test_per_client_work_ifca_model_averaging(ragged, linear_model, ref):
    """IFCA option II: each client picks its lowest-loss model, takes τ_i steps, and the
    cluster models become their members' means."""
    m, k = ragged.num_clients, 2
    table = work_table(m, STEPS)
    alg = ifca(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)), num_clusters=k,
               option="model")
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    models = np.asarray(state.cluster_params, np.float64)
    for key in jax.random.split(jax.random.key(1), 2):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        members = {j: [] for j in range(k)}
        for i in range(m):
            if n[i] == 0:
                continue
            j = int(np.argmin([ref.loss(models[j], x[i], y[i], n[i]) for j in range(k)]))
            members[j].append(local_gd(ref, models[j], x[i], y[i], n[i], LR, table[i]))
        models = np.stack([np.mean(members[j], axis=0) if members[j] else models[j]
                           for j in range(k)])
        np.testing.assert_allclose(state.cluster_params, models, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_per_client_work_qffl_equals_loop(ragged, linear_model, ref, participation):
    """q-FFL's Algorithm 2 with w̄_k after client k's own τ_k steps: Δ_k = F_k^q L(w − w̄_k),
    h_k = q F_k^{q−1}‖L(w − w̄_k)‖² + L F_k^q, w ← w − ΣΔ_k / Σh_k, L = 1/η."""
    from fedjax_sim.algorithms import qffl

    m, q = ragged.num_clients, 2.0
    table = work_table(m, STEPS)
    alg = qffl(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)), q=q,
               participation=participation)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    big_l = 1.0 / LR
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        ids, *_ = cohort_slots(key, m, participation)
        deltas, hs = [], []
        for i in ids:
            if n[i] == 0:
                continue
            loss = ref.loss(w, x[i], y[i], n[i]) + 1e-10
            dw = big_l * (w - local_gd(ref, w, x[i], y[i], n[i], LR, table[i]))
            deltas.append(loss**q * dw)
            hs.append(q * loss ** (q - 1) * dw @ dw + big_l * loss**q)
        w = w - sum(deltas) / sum(hs)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)


def test_per_client_work_hypcluster_equals_loop(ragged, linear_model, ref):
    """HypCluster: each client takes its lowest-loss hypothesis, τ_i steps from it, and each
    hypothesis becomes its members' example-weighted mean (its default weighting)."""
    from fedjax_sim.algorithms import hypcluster

    m, k = ragged.num_clients, 2
    table = work_table(m, STEPS)
    alg = hypcluster(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)),
                     num_clusters=k)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    models = np.asarray(state.cluster_params, np.float64)
    for key in jax.random.split(jax.random.key(1), 2):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        trained = {j: ([], []) for j in range(k)}
        for i in range(m):
            if n[i] == 0:
                continue
            j = int(np.argmin([ref.loss(models[j], x[i], y[i], n[i]) for j in range(k)]))
            trained[j][0].append(local_gd(ref, models[j], x[i], y[i], n[i], LR, table[i]))
            trained[j][1].append(float(n[i]))
        models = np.stack([weighted_mean(*trained[j], models[j]) for j in range(k)])
        np.testing.assert_allclose(state.cluster_params, models, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("batch_size,sampling", [(2, "with_replacement"), (2, "epochs"),
                                                 (None, "with_replacement")])
def test_masked_steps_are_the_first_steps_of_the_full_scan(ragged, linear_model, batch_size,
                                                            sampling):
    """τ_i masked steps of a `steps`-long scan are exactly its first τ_i steps (the same
    minibatches): the params after them equal the full scan's snapshot at τ_i."""
    training = sgd(LR, steps=STEPS, batch_size=batch_size, sampling=sampling)
    params = linear_model.init(jax.random.key(0))
    x, y, n = ragged.x[3], ragged.y[3], ragged.num_examples[3]
    key = jax.random.key(5)
    for tau in range(STEPS + 1):
        masked, _, _ = client_update(linear_model, training.optimizer, params, x, y, n, key,
                                     num_steps=STEPS, batch_size=batch_size, sampling=sampling,
                                     active_steps=tau)
        _, snap, _ = client_update(linear_model, training.optimizer, params, x, y, n, key,
                                   num_steps=STEPS, batch_size=batch_size, sampling=sampling,
                                   snapshot_step=tau)
        chex.assert_trees_all_close(masked, snap, rtol=1e-6, atol=1e-7)


def test_work_drawn_once_per_client_or_every_round():
    once = sgd(LR, steps=8, work=Work(low=1, seed=3))
    fresh = sgd(LR, steps=8, work=Work(low=1, per_round=True))
    ids = jax.numpy.arange(64)
    counts = jax.numpy.full((64,), 10)

    def taus(training, round_key):
        keys = jax.vmap(lambda i: jax.random.fold_in(round_key, i))(ids)
        data = type("D", (), {"num_examples": counts})()
        return np.asarray(training.steps_taken(data, keys, ids=ids))

    a, b = taus(once, jax.random.key(1)), taus(once, jax.random.key(2))
    np.testing.assert_array_equal(a, b)  # a client's speed, the same every round
    assert set(a.tolist()) <= set(range(1, 9)) and len(set(a.tolist())) >= 6
    c, d = taus(fresh, jax.random.key(1)), taus(fresh, jax.random.key(2))
    assert (c != d).mean() > 0.5 and set(c.tolist()) <= set(range(1, 9))


@pytest.mark.parametrize("work", [Work(low=2, seed=5), Work(per_client=tuple(range(6)) * 3)],
                         ids=["low", "per_client"])
def test_work_table_gives_the_steps_drawn_in_the_round(work):
    """A round that knows m reads τ_i from the work's table (`Work.table`); the table holds
    what the round would draw, for a sampled cohort with repeats and stragglers too."""
    m, steps = 18, 5
    training = sgd(LR, steps=steps, work=work)
    ids = jax.numpy.asarray([17, 3, 3, 0, 9, 12, 5], jax.numpy.int32)
    keys = jax.random.split(jax.random.key(4), ids.shape[0])
    data = type("D", (), {"num_examples": jax.numpy.full(ids.shape, 10)})()
    flags = jax.numpy.asarray([False, True, False, True, False, False, True])
    table = np.asarray(work.table(steps, m))
    assert table.shape == (m,) and table.min() >= (work.low or 0) and table.max() <= steps
    for straggles in (None, flags):
        drawn = training.steps_taken(data, keys, ids=ids, straggles=straggles)
        read = training.steps_taken(data, keys, ids=ids, straggles=straggles, num_clients=m)
        np.testing.assert_array_equal(np.asarray(read), np.asarray(drawn))
    np.testing.assert_array_equal(
        np.asarray(training.steps_taken(data, keys, ids=ids, num_clients=m)), table[ids])
    with pytest.raises(ValueError, match="drawn once per client"):
        Work(low=1, per_round=True).table(steps, m)


def test_epochs_work_counts_each_clients_batches(ragged, linear_model):
    training = sgd(LR, steps=6, batch_size=2, work=Work(epochs=1))
    n = np.asarray(ragged.num_examples)
    keys = jax.random.split(jax.random.key(0), ragged.num_clients)
    got = np.asarray(training.steps_taken(ragged, keys))
    np.testing.assert_array_equal(got, np.minimum(np.ceil(n / 2), 6).astype(int))


# --------------------------------------------------------------------------- systems


def test_cohort_among_available_clients_and_flag_rates():
    """Over many rounds: unavailable clients never report, availability, dropout and
    straggling happen at their rates, and a partial cohort is drawn among the available."""
    m, systems = 40, Systems(availability=0.6, dropout=0.25, stragglers=0.3)
    seen, reported, straggled, slots = 0, 0, 0, 0
    for r in range(200):
        key = jax.random.key(r)
        here = np.asarray(available(jax.random.split(key)[0], m, systems))
        seen += here.sum()
        ids, _, reports, straggles = cohort_slots(key, m, 0.25, systems)
        assert all(here[i] for i, rep in zip(ids, reports, strict=True) if rep)
        assert len(set(ids)) == len(ids)
        # Ten slots among ≈ 24 available clients: every slot is an available client.
        if here.sum() >= len(ids):
            assert all(here[i] for i in ids)
        reported += reports.sum()
        straggled += straggles.sum()
        slots += len(ids)
    assert abs(seen / (200 * m) - 0.6) < 0.03
    assert abs(straggled / slots - 0.3) < 0.04
    assert abs(reported / slots - 0.75) < 0.04  # available slots x (1 − dropout)


def fedprox_stragglers(k, rate):
    """The FedProx code's count: round(K · (1 − rate)) of the K selected devices train fully
    (`np.random.choice(selected, round(K * (1 - drop_percent)))`), the others straggle."""
    return k - round(k * (1 - rate))


@pytest.mark.parametrize("m,participation,rate,availability", [
    (20, 1.0, 0.9, 1.0), (20, 0.5, 0.9, 1.0), (20, 0.5, 0.5, 1.0), (10, 0.5, 0.5, 1.0),
    (30, 0.5, 0.3, 0.6), (20, 1.0, 0.9, 0.7)])
def test_fixed_stragglers_are_exactly_the_fedprox_count_per_round(m, participation, rate,
                                                                  availability):
    """straggler_draw "fixed" (the default): in every round, of the K slots holding an
    available client exactly K − round(K(1 − rate)) straggle (round(K·rate) but at exact
    halves with odd K: 5 slots at 0.5 give 3), a uniformly random subset; under "drop"
    the others report, so a round with K(1 − rate) >= 1 always keeps a reporter."""
    systems = Systems(availability=availability, stragglers=rate, straggler_policy="drop")
    rounds, per_slot, counts = 300, None, set()
    for r in range(rounds):
        key = jax.random.key(r)
        ids, _, reports, straggles = cohort_slots(key, m, participation, systems)
        here = np.asarray(available(jax.random.split(key)[0], m, systems))
        filled = np.array([here[i] for i in ids]) if availability < 1 else np.ones(len(ids),
                                                                                    bool)
        k = int(filled.sum())
        assert straggles.sum() == fedprox_stragglers(k, rate)
        assert not np.any(straggles & ~filled)
        np.testing.assert_array_equal(reports, filled & ~straggles)  # no dropout here
        if k * (1 - rate) >= 1:
            assert reports.sum() >= 1
        counts.add(k)
        if availability == 1.0:
            per_slot = straggles.astype(float) if per_slot is None else per_slot + straggles
    if per_slot is not None:  # every slot equally likely to straggle
        np.testing.assert_allclose(per_slot / rounds, fedprox_stragglers(len(ids), rate)
                                   / len(ids), atol=0.1)
    else:
        assert len(counts) > 1  # K varied with availability


def test_fixed_straggler_count_rounds_as_the_fedprox_code():
    """5 slots at rate 0.5: the FedProx code trains round(2.5) = 2 fully, so 3 straggle."""
    _, _, _, straggles = cohort_slots(jax.random.key(0), 5, 1.0, Systems(stragglers=0.5))
    assert straggles.sum() == 3


def test_independent_stragglers_draw_each_slot_on_its_own():
    """straggler_draw "independent": slot j straggles when its own uniform (the slot key's
    STRAGGLE_STREAM) is below the rate, so the count varies by round."""
    m, rate = 20, 0.9
    systems = Systems(stragglers=rate, straggler_policy="drop", straggler_draw="independent")
    counts, none_report = [], 0
    for r in range(200):
        _, keys, reports, straggles = cohort_slots(jax.random.key(r), m, 0.5, systems)
        expected = [float(jax.random.uniform(jax.random.fold_in(k, STRAGGLE_STREAM))) < rate
                    for k in keys]
        np.testing.assert_array_equal(straggles, expected)
        counts.append(int(straggles.sum()))
        none_report += int(reports.sum() == 0)
    assert len(set(counts)) > 2
    assert abs(np.mean(counts) / 10 - rate) < 0.03
    assert none_report > 0  # the independent draw loses whole rounds under "drop"
    with pytest.raises(ValueError, match="straggler_draw must be one of fixed, independent"):
        Systems(stragglers=0.5, straggler_draw="binomial")


def test_a_straggler_does_strictly_less_than_its_full_work():
    """A straggler's steps are uniform on 1..τ_i − 1 (never its full τ_i); τ_i <= 1 cannot
    be partial and is taken whole. Through a round's work: every straggler with τ_i >= 2
    takes fewer steps than τ_i."""
    for tau in range(0, 7):
        seen = {int(straggler_steps(jax.random.key(s), tau)) for s in range(300)}
        assert seen == (set(range(1, tau)) if tau >= 2 else {tau})
    m, steps = 12, 6
    table = tuple(int(t) for t in np.arange(m) % (steps + 1))
    training = sgd(LR, steps=steps, work=Work(per_client=table))
    systems = Systems(stragglers=0.5)
    partial = 0
    for r in range(20):
        ids, keys, _, straggles = cohort_slots(jax.random.key(r), m, 1.0, systems)
        data = make_ragged_of(m)
        taken = np.asarray(training.steps_taken(data, keys, ids=jnp.asarray(ids),
                                                straggles=jnp.asarray(straggles)))
        for i, f, got in zip(ids, straggles, taken, strict=True):
            if f and table[i] >= 2:
                assert 1 <= got < table[i]
                partial += 1
            else:
                assert got == table[i]
    assert partial > 0


def make_ragged_of(m):
    from conftest import make_ragged

    return make_ragged(sizes=(2,) * m, clusters=(0,) * m)


def test_day_night_availability_follows_each_clients_time_zone():
    """period 4, 8 clients: zone z_i = ⌊π(i)·4/8⌋, π the permutation drawn from zone_seed;
    day when (t + z_i) mod 4 < 2; available with probability 1 by day and 0 by night, so the
    mask is the day table itself."""
    m, systems = 8, Systems(availability=1.0, period=4, night=0.0)
    order = np.random.default_rng(systems.zone_seed).permutation(m)
    zones = order * 4 // m
    for t in range(8):
        here = np.asarray(available(jax.random.key(t), m, systems, t))
        np.testing.assert_array_equal(here, (t + zones) % 4 < 2)
    with pytest.raises(ValueError, match="need the round"):
        available(jax.random.key(0), m, systems)
    with pytest.raises(ValueError, match="period"):
        Systems(period=1)
    # Through an algorithm: the round's clients are the ones in their day.
    from conftest import make_ragged

    data = make_ragged(sizes=(3,) * 8, clusters=(0,) * 8)
    alg = with_systems(fedavg(linear_model_of(data), sgd(LR)), systems)
    state = alg.init(jax.random.key(0), data)
    for t in range(4):
        state, metrics = jax.jit(alg.round)(state, data, jax.random.key(t))
        assert float(metrics["participants"]) == float(np.sum((t + zones) % 4 < 2))


@pytest.mark.parametrize("period", [2, 4, 6])
def test_time_zones_do_not_follow_the_client_numbering(period):
    """Two clusters numbered in blocks (clients 0..11, then 12..23): by index the zones would
    put a whole cluster to sleep at once; permuted, each cluster has clients awake in every
    round, as many in all as the period rule gives (#{j : (t + ⌊j·P/m⌋) mod P < P/2}), and
    the placement is a fixed function of zone_seed."""
    m = 24
    cluster = np.repeat([0, 1], m // 2)
    systems = Systems(availability=1.0, period=period, night=0.0, zone_seed=3)
    by_index = np.arange(m) * period // m
    asleep_by_index = False
    for t in range(2 * period):
        here = np.asarray(available(jax.random.key(t), m, systems, t))
        rule = sum(1 for j in range(m) if (t + j * period // m) % period < period / 2)
        assert here.sum() == rule
        for c in (0, 1):
            assert here[cluster == c].any(), (t, c)
            asleep_by_index |= not ((t + by_index[cluster == c]) % period < period / 2).any()
    assert asleep_by_index  # the numbering alone would have slept a cluster (not vacuous)
    zones = time_zones(m, systems)
    np.testing.assert_array_equal(np.sort(zones), by_index)
    np.testing.assert_array_equal(zones, time_zones(m, Systems(period=period, zone_seed=3)))
    assert not np.array_equal(zones, time_zones(m, Systems(period=period, zone_seed=4)))


def linear_model_of(data):
    from fedjax_sim.models import linear_regression

    return linear_regression(data.x.shape[-1])


def test_per_client_availability_and_everyone_taking_part():
    m = 6
    systems = Systems(availability=(1.0, 0.0, 1.0, 0.0, 0.5, 1.0))
    for r in range(20):
        ids, _, reports, _ = cohort_slots(jax.random.key(r), m, 1.0, systems)
        assert ids == list(range(m))
        assert reports[0] and reports[2] and reports[5] and not reports[1] and not reports[3]


@pytest.mark.parametrize("policy", ["keep", "drop"])
@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_fedavg_under_systems_equals_loop(ragged, linear_model, ref, policy, participation):
    """Only reporting clients are averaged; a kept straggler's partial update counts, a
    dropped one's does not; unavailable and dropped-out clients add nothing."""
    m = ragged.num_clients
    table = work_table(m, STEPS)
    systems = Systems(availability=0.8, dropout=0.2, stragglers=0.5, straggler_policy=policy)
    training = sgd(LR, steps=STEPS, work=Work(per_client=table))
    alg = with_systems(fedavg(linear_model, training, participation=participation), systems)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    kept_partial = 0
    for key in jax.random.split(jax.random.key(1), 6):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        ids, keys, reports, straggles = cohort_slots(key, m, participation, systems)
        taus = slot_steps([table[i] for i in ids], keys, straggles)
        trained = [local_gd(ref, w, x[i], y[i], n[i], LR, t)
                   for i, t in zip(ids, taus, strict=True)]
        weights = [float(n[i] > 0 and rep) for i, rep in zip(ids, reports, strict=True)]
        kept_partial += sum(1 for f, rep, i in zip(straggles, reports, ids, strict=True)
                            if f and rep and table[i] > 1)
        w = weighted_mean(trained, weights, w)
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
    assert (kept_partial > 0) == (policy == "keep")


@pytest.mark.parametrize("name", ["fedavg", "ifca", "ditto", "scaffold", "hypcluster"])
def test_participants_metric_and_per_client_state_of_non_reporting_clients(ragged, linear_model,
                                                                         name):
    """Under Systems a round reports how many slots held data and reported; a client that
    did not report keeps its per-client state (assignment, personal model, control variate).
    Without Systems the metric is absent."""
    from fedjax_sim.algorithms import ditto, hypcluster

    m = ragged.num_clients
    training = sgd(LR, steps=2)
    factory = {"fedavg": lambda: fedavg(linear_model, training),
               "ifca": lambda: ifca(linear_model, training, num_clusters=2, option="model"),
               "ditto": lambda: ditto(linear_model, training),
               "scaffold": lambda: scaffold(linear_model, training),
               "hypcluster": lambda: hypcluster(linear_model, training, num_clusters=2)}[name]
    systems = Systems(dropout=0.5)
    alg = with_systems(factory(), systems)
    state = alg.init(jax.random.key(0), ragged)
    per_client = {"ifca": "assignment", "ditto": "personal", "scaffold": "client_controls",
                  "hypcluster": "assignment"}.get(name)
    n = np.asarray(ragged.num_examples)
    for key in jax.random.split(jax.random.key(1), 3):
        before = None if per_client is None else np.asarray(getattr(state, per_client))
        state, metrics = jax.jit(alg.round)(state, ragged, key)
        _, _, reports, _ = cohort_slots(key, m, 1.0, systems)
        assert float(metrics["participants"]) == float(np.sum(reports & (n > 0)))
        if per_client is not None:
            after = np.asarray(getattr(state, per_client))
            for i in np.flatnonzero(~reports):
                np.testing.assert_array_equal(after[i], before[i])
    _, plain = jax.jit(factory().round)(factory().init(jax.random.key(0), ragged), ragged,
                                        jax.random.key(1))
    assert "participants" not in plain


def test_systems_rounds_chunked_equal_whole(ragged, linear_model):
    systems = Systems(availability=0.7, dropout=0.2, stragglers=0.5)
    training = sgd(LR, steps=STEPS, batch_size=2, work=Work(low=0, per_round=True))
    alg = with_systems(fedavg(linear_model, training, participation=0.6), systems)
    a, b = ragged, planned(ragged, client_chunk=2)
    sa, sb = alg.init(jax.random.key(0), a), alg.init(jax.random.key(0), b)
    for key in jax.random.split(jax.random.key(1), 3):
        sa, _ = jax.jit(alg.round)(sa, a, key)
        sb, _ = jax.jit(alg.round)(sb, b, key)
    chex.assert_trees_all_close(sa.params, sb.params, rtol=1e-5, atol=1e-6)


def test_trivial_systems_and_uniform_work_are_bit_for_bit_the_plain_round(ragged, linear_model):
    training = sgd(LR, steps=STEPS, batch_size=2)
    plain = fedavg(linear_model, training, participation=0.6)
    wrapped = with_systems(fedavg(linear_model, training.replace(work=Work()),
                                  participation=0.6), Systems())
    sa, sb = plain.init(jax.random.key(0), ragged), wrapped.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 3):
        sa, ma = jax.jit(plain.round)(sa, ragged, key)
        sb, mb = jax.jit(wrapped.round)(sb, ragged, key)
        chex.assert_trees_all_equal((sa, ma), (sb, mb))


# --------------------------------------------------------------------------- FedNova


@pytest.mark.parametrize("solver", [{}, {"momentum": 0.5}, {"mu": 0.5}])
@pytest.mark.parametrize("participation", [1.0, 0.6])
def test_fednova_rounds_equal_loop(ragged, linear_model, ref, solver, participation):
    """d_i = (x − y_i)/‖a_i‖₁, τ_eff = Σ p_i ‖a_i‖₁, x ← x − τ_eff Σ p_i d_i (p_i ∝ n_i over
    the contributors), ‖a_i‖₁ of the paper's Appendix for SGD, momentum and proximal steps."""
    m = ragged.num_clients
    table = work_table(m, STEPS)
    rho, mu = solver.get("momentum", 0.0), solver.get("mu", 0.0)
    alg = fednova(linear_model, sgd(LR, steps=STEPS, work=Work(per_client=table)),
                  participation=participation, **solver)
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)

    def local(i, tau):  # heavy-ball SGD / proximal SGD, float64
        theta, buf = w.copy(), np.zeros_like(w)
        for _ in range(tau):
            g = ref.grad(theta, x[i], y[i], n[i]) + mu * (theta - w)
            buf = rho * buf + g
            theta = theta - LR * buf
        return theta

    def norm(tau):
        if rho:
            return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)
        if mu:
            return (1 - (1 - LR * mu) ** tau) / (LR * mu)
        return float(tau)

    for key in jax.random.split(jax.random.key(1), 3):
        state, metrics = jax.jit(alg.round)(state, ragged, key)
        ids, *_ = cohort_slots(key, m, participation)
        parts = [i for i in ids if n[i] > 0 and table[i] > 0]
        p = np.array([n[i] for i in parts], np.float64)
        p = p / p.sum()
        d = [(w - local(i, table[i])) / norm(table[i]) for i in parts]
        tau_eff = sum(pi * norm(table[i]) for pi, i in zip(p, parts, strict=True))
        w = w - tau_eff * sum(pi * di for pi, di in zip(p, d, strict=True))
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(metrics["tau_eff"], tau_eff, rtol=1e-5)


def test_work_norm_matches_its_sums():
    """‖a‖₁ closed forms equal the sums of the aggregation vectors' entries."""
    for tau in range(0, 7):
        a_mom = [sum(0.5**j for j in range(t + 1)) for t in range(tau)]  # (1 − ρ^{t+1})/(1 − ρ)
        a_prox = [(1 - 0.1 * 0.5) ** t for t in range(tau)]
        np.testing.assert_allclose(work_norm(tau, momentum=0.5), sum(a_mom), rtol=1e-6)
        np.testing.assert_allclose(work_norm(tau, learning_rate=0.1, mu=0.5), sum(a_prox),
                                   rtol=1e-6, atol=1e-7)
        assert float(work_norm(tau)) == tau


def test_work_norm_of_the_proximal_solver_is_stable_at_small_eta_mu():
    """‖a‖₁ = [1 − (1 − ημ)^τ]/(ημ) against float64 from its sum Σ_t (1 − ημ)^t; at ημ = 5e-9
    the float32 difference 1 − (1 − ημ)^τ rounds to 0, the closed form must not."""
    for decay in (5e-9, 1e-8, 1e-6, 1e-3, 0.1, 0.5, 0.9):
        for tau in (0, 1, 2, 7, 20):
            exact = sum((1.0 - decay) ** t for t in range(tau))  # float64
            got = float(work_norm(tau, learning_rate=1.0, mu=decay))
            np.testing.assert_allclose(got, exact, rtol=1e-6, atol=1e-7)
    assert float(work_norm(20, learning_rate=0.5, mu=jnp.float32(0.0))) == 20.0


@pytest.mark.parametrize("mu", [1e-9, 1e-6, 1e-3])
def test_fednova_proximal_at_small_mu_equals_loop_and_tends_to_mu_zero(ragged, linear_model,
                                                                        ref, mu):
    """FedNova over FedProx's solver with tiny μ, 3 rounds, against a float64 loop (proximal
    GD, ‖a_i‖₁ = Σ_t (1 − ημ)^t); as μ → 0 it is the μ = 0 run to 1e-6."""
    m = ragged.num_clients
    table = work_table(m, STEPS)
    training = sgd(LR, steps=STEPS, work=Work(per_client=table))
    alg, plain = fednova(linear_model, training, mu=mu), fednova(linear_model, training)
    state = alg.init(jax.random.key(0), ragged)
    base = plain.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    for key in jax.random.split(jax.random.key(1), 3):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        base, _ = jax.jit(plain.round)(base, ragged, key)
        parts = [i for i in range(m) if n[i] > 0 and table[i] > 0]
        p = np.array([n[i] for i in parts], np.float64)
        p = p / p.sum()
        norms = [sum((1.0 - LR * mu) ** t for t in range(table[i])) for i in parts]
        ds = [(w - local_gd(ref, w, x[i], y[i], n[i], LR, table[i],
                            extra=lambda v, w_t=w: mu * (v - w_t))) / a
              for i, a in zip(parts, norms, strict=True)]
        tau_eff = float(np.dot(p, norms))
        w = w - tau_eff * sum(pi * di for pi, di in zip(p, ds, strict=True))
        np.testing.assert_allclose(state.params, w, rtol=RTOL, atol=ATOL)
    if mu <= 1e-6:
        np.testing.assert_allclose(state.params, base.params, rtol=1e-6, atol=1e-6)
    assert not np.allclose(state.params, np.asarray(alg.init(jax.random.key(0), ragged).params))


def test_fednova_with_equal_work_is_fedavg(ragged, linear_model):
    training = sgd(LR, steps=3, batch_size=2)
    kw = dict(participation=0.6, weighting="examples")
    a, b = fednova(linear_model, training, **kw), fedavg(linear_model, training, **kw)
    sa, sb = a.init(jax.random.key(0), ragged), b.init(jax.random.key(0), ragged)
    for key in jax.random.split(jax.random.key(1), 4):
        sa, _ = jax.jit(a.round)(sa, ragged, key)
        sb, _ = jax.jit(b.round)(sb, ragged, key)
        np.testing.assert_allclose(sa.params, sb.params, rtol=1e-5, atol=1e-6)


def test_fednova_reaches_the_true_optimum_fedavg_the_work_weighted_one(linear_model):
    """Quadratic clients F_i(w) = mean (x·w − y)² with very different τ_i, full-batch GD:
    FedAvg's fixed point is near argmin Σ p_i τ_i F_i (the surrogate the paper's Theorem 1
    names), FedNova's near argmin Σ p_i F_i, the example-weighted objective."""
    from conftest import make_ragged

    sizes, clusters = (8, 8, 8, 8), (0, 1, 0, 1)
    data = make_ragged(seed=3, sizes=sizes, clusters=clusters)
    table = (1, 10, 1, 10)
    training = sgd(0.01, steps=10, work=Work(per_client=table))
    x, y, n = _np(data)
    p = n / n.sum()

    def argmin(weights):
        a = sum(wi * x[i].T @ x[i] / n[i] for i, wi in enumerate(weights))
        b = sum(wi * x[i].T @ y[i] / n[i] for i, wi in enumerate(weights))
        return np.linalg.solve(a, b)

    truth, surrogate = argmin(p), argmin(p * np.asarray(table))
    finals = {}
    for name, factory in (("fedavg", fedavg), ("fednova", fednova)):
        alg = factory(linear_model, training, weighting="examples")
        state = alg.init(jax.random.key(0), data)
        step = jax.jit(alg.round)
        for r in range(400):
            state, _ = step(state, data, jax.random.key(r))
        finals[name] = np.asarray(state.params, np.float64)
    gap = np.linalg.norm(truth - surrogate)
    assert gap > 0.1  # the two objectives are far apart here
    assert np.linalg.norm(finals["fednova"] - truth) < 0.05 * gap
    assert np.linalg.norm(finals["fedavg"] - surrogate) < 0.25 * gap
    assert np.linalg.norm(finals["fedavg"] - truth) > 0.5 * gap


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs,match", [
    ({"low": -1}, "low"), ({"low": 1, "per_client": (1,)}, "one of"),
    ({"per_client": (1, -2)}, "per_client"), ({"epochs": 0}, "epochs"),
    ({"per_round": True}, "give low"),
])
def test_work_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Work(**kwargs)


def test_work_larger_than_steps_is_refused():
    with pytest.raises(ValueError, match="raise steps"):
        sgd(0.1, steps=2, work=Work(per_client=(1, 3)))
    with pytest.raises(ValueError, match="exceeds"):
        sgd(0.1, steps=2, work=Work(low=3))


@pytest.mark.parametrize("kwargs,match", [
    ({"availability": 1.5}, "availability"), ({"dropout": 1.0}, r"\[0, 1\)"),
    ({"stragglers": -0.1}, "stragglers"), ({"straggler_policy": "wait"}, "keep, drop"),
    ({"availability": ()}, "one probability per client"),
])
def test_systems_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Systems(**kwargs)


def test_fednova_rejects_bad_settings(linear_model):
    import optax

    from fedjax_sim.algorithms import ClientTraining

    with pytest.raises(ValueError, match="plain SGD"):
        fednova(linear_model, ClientTraining(optax.adam(0.1)))
    with pytest.raises(ValueError, match="momentum"):
        fednova(linear_model, sgd(0.1), momentum=1.0)
    with pytest.raises(ValueError, match="not both"):
        fednova(linear_model, sgd(0.1), momentum=0.5, mu=0.1)
