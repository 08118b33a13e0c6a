"""Asynchronous FL in virtual time: the clock, FedBuff and FedAsync against an event loop.

The reference (`EventLoop`) is the papers' server written plainly, in float64: a heap of
the clients' event times, each client training on the model version it downloaded
(full-batch gradient steps on the linear model), the server stepping after B arrivals
(FedBuff: the staleness-weighted mean of the deltas; FedAsync, B = 1: the mixing
x ← (1 − α_t) x + α_t y), the trip lengths and online windows computed from their
definitions (docs/async.md). Each step's draws of new clients are read from our state
(which slots got a new key) and checked to be exactly the allowed ones; everything else
(arrival order, times, staleness, discarded updates, the model) the loop computes itself.
"""

from __future__ import annotations

import heapq
import math
from types import SimpleNamespace

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import local_gd

from conftest import make_ragged, np_client_grad, np_client_loss
from fedjax_sim.algorithms import Work, async_ifca, fedasync, fedavg, fedbuff, sgd, with_systems
from fedjax_sim.algorithms.fedavg import FedAvgState
from fedjax_sim.models import linear_regression
from fedjax_sim.ops.clock import (
    Clock,
    next_online,
    online,
    read_trace,
    sync_round,
    sync_round_seconds,
    trip_events,
    window_end,
)
from fedjax_sim.ops.work import time_zones
from fedjax_sim.systems import Systems

D = 3
SIZES = (4, 1, 0, 3, 2, 5, 2, 3)  # client 2 holds no data: never drawn
TAUS = (3, 1, 2, 4, 2, 3, 1, 2)  # Work(per_client=...): τ_i
STEP_SECONDS = (1.0, 1.7, 0.9, 2.9, 0.55, 7.3, 1.3, 3.1)  # client 5 is the straggler
BANDWIDTH = (1e3, 2e3, 1e3, 500.0, 4e3, 1e3, 800.0, 2e3)  # bytes/s; the model is 12 bytes
LR = 0.05


def _data():
    return make_ragged(seed=4, sizes=SIZES, clusters=(0, 1, 0, 1, 0, 1, 0, 1))


def _training():
    return sgd(LR, steps=max(TAUS), work=Work(per_client=TAUS))


# --------------------------------------------------------------------------- the reference


def _merge(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


class EventLoop:
    """The asynchronous server, one event at a time, float64."""

    def __init__(self, data, x0, *, concurrency, buffer, max_staleness, server, windows=None,
                 cycle=0.0, taus=TAUS, step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH):
        self.x_, self.y_ = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
        self.n = np.asarray(data.num_examples)
        self.m = len(self.n)
        self.x = np.asarray(x0, np.float64)
        self.version, self.ring = 0, {0: self.x.copy()}
        self.heap, self.time, self.trips = [], 0.0, 0
        self.K, self.B, self.R, self.server = concurrency, buffer, max_staleness, server
        self.windows, self.cycle = windows, cycle
        self.taus, self.step_seconds, self.bandwidth = taus, step_seconds, bandwidth
        self.failures = self.discarded = 0

    def spans(self, c, t):
        """Client c's online intervals around time t, as absolute seconds."""
        if not self.cycle:
            return _merge(self.windows[c])
        k = math.floor(t / self.cycle)
        return _merge([(s + j * self.cycle, e + j * self.cycle)
                       for j in range(k - 1, k + 3) for s, e in self.windows[c]])

    def window(self, c, t):
        """(online at t, the end of its window)."""
        if self.windows is None:
            return True, math.inf
        for s, e in self.spans(c, t):
            if s <= t < e:
                return True, e
        return False, t

    def next_online(self, c, t):
        if self.window(c, t)[0]:
            return t
        return min((s for s, _ in self.spans(c, t) if s > t), default=math.inf)

    def arrive(self, c, v):
        """Client c's upload, trained from version v: (y, its start, staleness)."""
        start = self.ring[v]
        y = local_gd(_REF, start, self.x_[c], self.y_[c], self.n[c], LR, self.taus[c])
        return y, start, self.version - v

    def step(self, draws):
        """One server step; `draws`: the clients our refill started. Returns what happened."""
        t = self.time
        flying = {c for _, c, _, _ in self.heap}
        eligible = {c for c in range(self.m)
                    if self.n[c] > 0 and c not in flying and self.window(c, t)[0]}
        free = self.K - len(self.heap)
        assert len(set(draws)) == len(draws) and set(draws) <= eligible, (draws, eligible)
        assert len(draws) == min(free, len(eligible)), (draws, eligible, free)
        started = {}
        for c in draws:
            d = self.taus[c] * self.step_seconds[c] + 2 * 4 * D / self.bandwidth[c]
            _, end = self.window(c, t)
            completes = t + d <= end
            event = t + d if completes else end
            heapq.heappush(self.heap, (event, c, self.version, completes))
            started[c] = (event, completes)
        popped = [heapq.heappop(self.heap) for _ in range(min(self.B, len(self.heap)))]
        if popped:
            self.time = max(e for e, *_ in popped)
        else:
            self.time = max(t, min(self.next_online(c, t) for c in range(self.m) if self.n[c]))
        kept = []
        for _, c, v, completes in popped:
            self.trips += completes
            self.failures += not completes
            if completes and self.version - v > self.R:
                self.discarded += 1
            elif completes:
                kept.append(self.arrive(c, v))
        if kept:
            self.x = self.server(self.x, kept)
            self.version += 1
            self.ring[self.version] = self.x.copy()
        return {"started": started, "popped": sorted(c for _, c, _, _ in popped),
                "time": self.time, "trips": self.trips, "updates": len(kept),
                "staleness": np.mean([k[2] for k in kept]) if kept else 0.0}


_REF = SimpleNamespace(grad=np_client_grad)  # conftest's `ref`, outside a test function


def fedbuff_server(lr, a=0.5):
    def server(x, kept):
        return x + lr * sum((1 + s) ** -a * (y - start) for y, start, s in kept) / len(kept)
    return server


def fedasync_server(alpha, a, b):
    def server(x, kept):
        (y, _, s), = kept
        weight = alpha * (1.0 if s <= b else 1.0 / (a * (s - b) + 1.0))  # hinge
        return (1 - weight) * x + weight * y
    return server


class ClusteredEventLoop(EventLoop):
    """Asynchronous IFCA: x holds k models; an arriving client picks the one of lowest loss
    among the k of the version it downloaded (ties to the lower index) and trains it; the
    server moves each cluster by the staleness-weighted mean of the deltas that chose it."""

    def __init__(self, *args, lr, a=0.5, **kw):
        super().__init__(*args, server=self.clustered_server, **kw)
        self.lr, self.a, self.steps_by_clusters = lr, a, []

    def arrive(self, c, v):
        models = self.ring[v]
        losses = [np_client_loss(models[j], self.x_[c], self.y_[c], self.n[c])
                  for j in range(len(models))]
        chosen = int(np.argmin(losses))
        start = models[chosen]
        y = local_gd(_REF, start, self.x_[c], self.y_[c], self.n[c], LR, self.taus[c])
        return y, start, self.version - v, chosen

    def clustered_server(self, x, kept):
        x = x.copy()
        moved = sorted({j for *_, j in kept})
        for j in moved:
            mine = [(y, start, s) for y, start, s, chosen in kept if chosen == j]
            x[j] = x[j] + self.lr * sum((1 + s) ** -self.a * (y - start)
                                        for y, start, s in mine) / len(mine)
        self.steps_by_clusters.append(moved)
        return x


def _observe(before, after):
    """(clients our refill started {client: (event, uploads)}, clients popped) of one step."""
    refilled = np.any(np.asarray(before.keys) != np.asarray(after.keys), axis=1)
    popped = (np.asarray(before.flying) | refilled) & ~np.asarray(after.flying)
    clients = np.asarray(after.clients)
    started = {int(clients[j]): (float(after.events[j]), bool(after.uploads[j]))
               for j in np.flatnonzero(refilled)}
    return started, sorted(int(c) for c in clients[popped])


def _compare_with_loop(alg, loop, data, steps):
    state = alg.init(jax.random.key(0), data)
    np.testing.assert_allclose(state.params, loop.x, rtol=0, atol=0)
    round_ = jax.jit(alg.round)
    for t, key in enumerate(jax.random.split(jax.random.key(1), steps)):
        new, metrics = round_(state, data, key)
        started, popped = _observe(state, new)
        want = loop.step(sorted(started))
        where = f"step {t}"
        assert popped == want["popped"], where
        for c, (event, uploads) in started.items():
            if c not in popped:
                np.testing.assert_allclose(event, want["started"][c][0], rtol=1e-6,
                                           err_msg=where)
            assert uploads == want["started"][c][1], where
        np.testing.assert_allclose(metrics["virtual_time"], want["time"], rtol=1e-6,
                                   err_msg=where)
        assert int(metrics["trips"]) == want["trips"], where
        assert int(metrics["updates"]) == want["updates"], where
        np.testing.assert_allclose(metrics["staleness"], want["staleness"], rtol=1e-6,
                                   err_msg=where)
        np.testing.assert_allclose(new.params, loop.x, rtol=1e-4, atol=1e-5, err_msg=where)
        state = new
    return state


# Client 6 is online [0, 3) and from 8 on: a trip crossing 3 fails there; client 3 leaves at
# 10 and comes back at 25; client 0 is online only until 40.
WINDOWS = (((0.0, 40.0),), ((0.0, 1e6),), ((0.0, 1e6),), ((0.0, 10.0), (25.0, 1e6)),
           ((0.0, 1e6),), ((0.0, 1e6),), ((0.0, 3.0), (8.0, 1e6)), ((0.0, 1e6),))


@pytest.mark.parametrize("concurrency", [8, 4], ids=["every-client", "fewer-slots"])
def test_fedbuff_matches_the_event_loop(concurrency):
    """Arrival order, times, trips, staleness, discarded stale updates, offline clients and
    the model, step by step, with 8 slots (every eligible client flies) and 4 (the freed
    slots draw among the eligible)."""
    data = _data()
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=WINDOWS)
    alg = fedbuff(linear_regression(D), _training(), concurrency=concurrency, buffer_size=2,
                  server_lr=0.8, max_staleness=2, clock=clock)
    x0 = alg.init(jax.random.key(0), data).params
    loop = EventLoop(data, x0, concurrency=concurrency, buffer=2, max_staleness=2,
                     server=fedbuff_server(0.8), windows=WINDOWS)
    state = _compare_with_loop(alg, loop, data, steps=30)
    # The premises: clients went offline mid-trip, the ring's bound discarded stale
    # updates, and some kept ones were stale.
    assert loop.failures > 0 and loop.discarded > 0
    assert int(state.trips) == loop.trips


def test_async_ifca_matches_the_event_loop():
    """FedBuff per cluster: each arrival's choice among the k models of the version it
    downloaded, each cluster's step on its own arrivals, a cluster none chose kept, with
    offline clients, stale and discarded updates, step by step."""
    data = _data()
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=WINDOWS)
    alg = async_ifca(linear_regression(D), _training(), num_clusters=2, concurrency=6,
                     buffer_size=2, server_lr=0.8, max_staleness=2, clock=clock)
    x0 = alg.init(jax.random.key(0), data).params
    assert x0.shape == (2, D)
    # A trip downloads both models and uploads one: 3 models' bytes over the link.
    loop = ClusteredEventLoop(data, x0, concurrency=6, buffer=2, max_staleness=2,
                              windows=WINDOWS, lr=0.8, bandwidth=tuple(b * 2 / 3
                                                                       for b in BANDWIDTH))
    _compare_with_loop(alg, loop, data, steps=30)
    assert loop.failures > 0 and loop.discarded > 0
    moved = loop.steps_by_clusters
    assert [0, 1] in moved and ([0] in moved or [1] in moved), moved  # and one kept


def test_fedasync_matches_the_event_loop():
    """FedAsync (hinge staleness) with periodic windows: every 20 s, clients 3 and 6 are
    online in two windows, one of them across the cycle's end."""
    data = _data()
    cycle = 20.0
    windows = tuple(((0.0, 20.0),) if c not in (3, 6) else ((0.0, 4.0), (9.0, 20.0))
                    if c == 3 else ((0.0, 2.5), (6.0, 20.0)) for c in range(8))
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=windows, cycle=cycle)
    alg = fedasync(linear_regression(D), _training(), concurrency=5, alpha=0.6,
                   staleness="hinge", staleness_a=2.0, staleness_b=1.0, max_staleness=6,
                   clock=clock)
    x0 = alg.init(jax.random.key(0), data).params
    loop = EventLoop(data, x0, concurrency=5, buffer=1, max_staleness=6,
                     server=fedasync_server(0.6, 2.0, 1.0), windows=windows, cycle=cycle)
    _compare_with_loop(alg, loop, data, steps=40)
    assert loop.failures > 0 and loop.discarded > 0


def test_fedbuff_with_equal_speeds_and_a_full_buffer_is_fedavg():
    """Equal speeds, B = K, no staleness: every server step is a FedAvg round of the clients
    in flight: of every client (K = m), and of the 4 drawn (K = 4), each step compared with
    `fedavg` on those clients from the same model."""
    data = _data()
    training = sgd(0.1, steps=3)  # full batch: no key reaches the result
    steps = 4
    everyone = fedbuff(linear_regression(D), training, concurrency=8, buffer_size=8)
    avg = fedavg(linear_regression(D), training)
    a = everyone.init(jax.random.key(0), data)
    b = avg.init(jax.random.key(0), data)
    keys = jax.random.split(jax.random.key(1), steps)
    for t, key in enumerate(keys):
        a, metrics = jax.jit(everyone.round)(a, data, key)
        b, _ = jax.jit(avg.round)(b, data, key)
        np.testing.assert_allclose(a.params, b.params, rtol=1e-6, atol=1e-7)
        assert float(metrics["staleness"]) == 0.0 and int(metrics["updates"]) == 7
        np.testing.assert_allclose(metrics["virtual_time"], 3.0 * (t + 1))

    four = fedbuff(linear_regression(D), training, concurrency=4, buffer_size=4)
    state = four.init(jax.random.key(0), data)
    cohorts = set()
    for key in keys:
        new, _ = jax.jit(four.round)(state, data, key)
        cohort, _ = _observe(state, new)
        cohorts.add(tuple(sorted(cohort)))
        part = data.take(jnp.asarray(sorted(cohort)))
        want, _ = avg.round(FedAvgState(state.params, jnp.zeros((), jnp.int32)), part, key)
        np.testing.assert_allclose(new.params, want.params, rtol=1e-6, atol=1e-7)
        state = new
    assert len(cohorts) > 1  # the cohorts were drawn, not fixed


def test_same_seed_same_numbers_and_other_seeds_differ():
    data = _data()
    alg = with_systems(
        fedbuff(linear_regression(D), sgd(0.05, steps=3, batch_size=2), concurrency=5,
                buffer_size=2, clock=Clock(step_seconds=1.0, spread=1.0, seed=3)),
        Systems(availability=0.7, dropout=0.1))

    @jax.jit
    def scan(seed):
        state = alg.init(jax.random.key(seed), data)
        return jax.lax.scan(lambda s, k: alg.round(s, data, k), state,
                            jax.random.split(jax.random.key(seed + 1), 12))

    chex.assert_trees_all_equal(scan(0), scan(0))
    assert not np.array_equal(scan(0)[0].clients, scan(5)[0].clients)


# --------------------------------------------------------------------------- the clock


def test_trip_events_from_their_definition():
    """d_i = τ_i · step_i + 2 · bytes / bandwidth_i; a trip leaving its window fails there."""
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=WINDOWS)
    tables = clock.tables(8)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 8, 50)
    steps = rng.integers(0, 5, 50)
    start = rng.uniform(0, 30, 50).astype(np.float32)
    event, completes = trip_events(tables, jnp.asarray(ids), jnp.asarray(steps),
                                   jnp.asarray(start), model_bytes=12)
    loop = EventLoop(_data(), np.zeros(D), concurrency=8, buffer=1, max_staleness=0,
                     server=None, windows=WINDOWS)
    for j, (c, s, t) in enumerate(zip(ids, steps, start, strict=True)):
        d = s * STEP_SECONDS[c] + 24.0 / BANDWIDTH[c]
        here, end = loop.window(c, float(t))
        done = here and t + d <= end
        assert bool(completes[j]) == done, j
        np.testing.assert_allclose(event[j], t + d if done else (end if here else t),
                                   rtol=1e-6)
    assert 0 < int(jnp.sum(completes)) < 50


def test_periodic_windows_wrap_and_reopen():
    clock = Clock(windows=(((0.0, 2.0), (8.0, 10.0)), ((3.0, 4.0),)), cycle=10.0)
    tables = clock.tables(2)
    t = jnp.array([1.0, 9.0, 5.0, 19.5, 25.0])
    here, end = window_end(tables, jnp.zeros(5, jnp.int32), t)
    assert here.tolist() == [True, True, False, True, False]
    np.testing.assert_allclose(end[here], [2.0, 12.0, 22.0])  # 8..10 goes on as 10..12
    np.testing.assert_allclose(next_online(tables, jnp.zeros(5, jnp.int32), t),
                               [1.0, 9.0, 8.0, 19.5, 28.0])
    np.testing.assert_allclose(next_online(tables, jnp.ones(2, jnp.int32),
                                           jnp.array([4.5, 2.0])), [13.0, 3.0])


def test_day_night_windows_are_the_systems_cycle():
    """With Systems(period=P), client i is online at t exactly in the day rounds
    ((⌊t / round_seconds⌋ + z_i) mod P < P / 2) of `Systems`, for even and odd P."""
    m = 12
    for period in (4, 5):
        systems = Systems(period=period, zone_seed=2)
        tables = Clock(round_seconds=3.0).tables(m, systems)
        zones = time_zones(m, systems)
        t = np.arange(0.0, 3.0 * 3 * period, 0.75)
        for i in range(m):
            got = online(tables, jnp.full(t.shape, i), jnp.asarray(t))
            want = (np.floor(t / 3.0) + zones[i]) % period < period / 2
            np.testing.assert_array_equal(got, want, err_msg=f"P={period} client {i}")


def test_speeds_drawn_once_from_the_seed():
    """Lognormal step times: median `step_seconds`, log-spread σ, the same for the same
    seed, another seed another draw; per-client tuples are read as given."""
    a = Clock(step_seconds=2.0, spread=0.8, seed=1).tables(20001).step_seconds
    np.testing.assert_array_equal(a, Clock(step_seconds=2.0, spread=0.8, seed=1)
                                  .tables(20001).step_seconds)
    assert abs(np.median(a) / 2.0 - 1) < 0.03 and abs(np.std(np.log(a)) - 0.8) < 0.02
    b = Clock(step_seconds=2.0, spread=0.8, seed=2).tables(20001).step_seconds
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(Clock(step_seconds=STEP_SECONDS).tables(8).step_seconds,
                                  np.float32(STEP_SECONDS))


def test_sync_round_seconds_and_a_deadline_drops_exactly_those_past_it():
    rng = np.random.default_rng(1)
    for _ in range(20):
        s = int(rng.integers(1, 9))
        durations = rng.exponential(5.0, s).astype(np.float32)
        reports = rng.random(s) < 0.7
        pairs = list(zip(durations, reports, strict=True))
        longest = max([d for d, r in pairs if r], default=0.0)
        seconds, kept = sync_round_seconds(jnp.asarray(durations), jnp.asarray(reports))
        assert float(seconds) == longest
        assert kept.tolist() == reports.tolist()
        deadline = float(rng.choice(durations))  # exactly at a slot's duration: kept
        seconds, kept = sync_round_seconds(jnp.asarray(durations), jnp.asarray(reports),
                                           deadline)
        assert kept.tolist() == [bool(r and d <= deadline) for d, r in pairs]
        assert float(seconds) == min(longest, deadline)


def test_sync_round_with_windows_and_a_deadline():
    """A synchronous round started at t: a client that leaves its window before its trip
    ends does not report; the round lasts as long as its slowest reporting client, or the
    deadline."""
    tables = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=WINDOWS).tables(8)
    ids = jnp.arange(8)
    steps = jnp.asarray(TAUS)
    reports = jnp.asarray(SIZES) > 0
    loop = EventLoop(_data(), np.zeros(D), concurrency=8, buffer=1, max_staleness=0,
                     server=None, windows=WINDOWS)
    for start, deadline in ((0.0, None), (1.0, None), (1.0, 5.0), (30.0, 6.0)):
        seconds, kept = sync_round(tables, ids, steps, reports, start, 12, deadline)
        d = [TAUS[c] * STEP_SECONDS[c] + 24.0 / BANDWIDTH[c] for c in range(8)]
        ok = [SIZES[c] > 0 and start + d[c] <= loop.window(c, start)[1]
              and loop.window(c, start)[0] for c in range(8)]
        want_kept = [o and (deadline is None or d[c] <= deadline) for c, o in enumerate(ok)]
        longest = max([d[c] for c in range(8) if ok[c]], default=0.0)
        assert kept.tolist() == want_kept, (start, deadline)
        np.testing.assert_allclose(seconds, longest if deadline is None
                                   else min(longest, deadline), rtol=1e-6)
    assert not all(ok)  # client 0 is offline from 40 s


# --------------------------------------------------------------------------- bad inputs


def _one_line(err):
    assert "\n" not in str(err.value)


def test_bad_inputs_are_refused_in_one_line(tmp_path):
    model, training = linear_regression(D), sgd(0.1)
    with pytest.raises(ValueError, match=r"buffer_size \(B=5\) must be at most its "
                       r"concurrency \(K=4\)") as err:
        fedbuff(model, training, concurrency=4, buffer_size=5)
    _one_line(err)
    for bad in (-1.0, (1.0, -2.0), 0.0, math.inf):
        with pytest.raises(ValueError, match=r"^Clock step_seconds must be a finite number > 0")\
                as err:
            Clock(step_seconds=bad)
        _one_line(err)
    with pytest.raises(ValueError, match=r"^fedasync's alpha must be in \(0, 1\]") as err:
        fedasync(model, training, alpha=1.5)
    _one_line(err)
    with pytest.raises(ValueError, match=r"^fedbuff's staleness must be one of") as err:
        fedbuff(model, training, staleness="exponential")
    _one_line(err)

    data = _data()
    alg = fedbuff(model, training, concurrency=2, buffer_size=1,
                  clock=Clock(step_seconds=(1.0, 2.0, 3.0)))
    with pytest.raises(ValueError, match=r"^Clock step_seconds holds 3 entries for 8 clients")\
            as err:
        alg.init(jax.random.key(0), data)
    _one_line(err)
    state = fedbuff(model, training, concurrency=2, buffer_size=1).init(jax.random.key(0), data)
    stragglers = with_systems(fedbuff(model, training, concurrency=2, buffer_size=1),
                              Systems(stragglers=0.3))
    with pytest.raises(ValueError, match=r"^fedbuff makes slow clients slow") as err:
        stragglers.round(state, data, jax.random.key(1))
    _one_line(err)
    cycle = with_systems(fedbuff(model, training, concurrency=2, buffer_size=1),
                         Systems(period=4))
    with pytest.raises(ValueError, match=r"round_seconds") as err:
        cycle.round(state, data, jax.random.key(1))
    _one_line(err)


@pytest.mark.parametrize(("text", "match"), [
    ("client,step_seconds\n0,1.0\n2,0.5\n", r"has no row for client 1 \(of m=3\)"),
    ("client,step_seconds,bandwidth\n0,1.0,\n1,-0.5,\n2,1.0,\n",
     r"line 3: step_seconds must be a finite number > 0; got '-0.5'"),
    ("client,step_seconds,bandwidth\n0,1.0,\n1,1.0,-3\n2,1.0,\n",
     r"line 3: bandwidth must be a number > 0"),
    ("client,step_seconds\n0,1.0\n1,1.0\n7,1.0\n", r"line 4: client must be an id in 0..2"),
    ("client,bandwidth\n0,1.0\n", r"needs the columns client, step_seconds"),
    ("client,step_seconds,online_from,online_until\n0,1,5,2\n1,1,0,9\n2,1,0,9\n",
     r"line 2: a window needs 0 <= online_from < online_until"),
    ("client,step_seconds,online_from,online_until\n0,1,0,5\n1,1,,\n2,1,0,9\n",
     r"clients \[1\] have no window while others do"),
    ("client,step_seconds\n0,1.0\n0,2.0\n1,1\n2,1\n", r"line 3: client 0's speeds differ"),
])
def test_bad_traces_are_refused_in_one_line(tmp_path, text, match):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        read_trace(path, 3)
    _one_line(err)
    assert str(err.value).startswith(f"trace {path}")


def test_a_trace_gives_speeds_and_windows(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("client,step_seconds,bandwidth,online_from,online_until\n"
                    "1,2.0,500,0,10\n0,0.5,,0,100\n1,2.0,500,30,60\n1,2.0,500,5,20\n")
    clock = read_trace(path, 2, cycle=100.0)
    assert clock.step_seconds == (0.5, 2.0) and clock.bandwidth == (math.inf, 500.0)
    assert clock.windows == (((0.0, 100.0),), ((0.0, 20.0), (30.0, 60.0)))  # merged
    tables = clock.tables(2)
    here, end = window_end(tables, jnp.array([1, 1, 0]), jnp.array([12.0, 25.0, 130.0]))
    assert here.tolist() == [True, False, True]
    np.testing.assert_allclose(end[here], [20.0, math.inf])  # client 0: online all along
