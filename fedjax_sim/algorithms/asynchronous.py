"""Asynchronous federated learning in virtual time: the event rule FedBuff, FedAsync and
asynchronous IFCA share.

K clients are in flight at once, each training on the server model of the version it
downloaded; the server takes a step whenever B of them have come back (FedBuff's
buffer; FedAsync: B = 1). Time is the virtual clock's (`ops.clock`): a client's trip
lasts τ_i · step_seconds_i + 2 · model_bytes / bandwidth_i and fails when the client
leaves its online window first. One call of `round` is one server step:

    t       ← the server's time
    refill  every empty slot ← a client drawn uniformly among those online at t,
            reachable (Systems' availability), holding data and not in flight; it
            downloads x_v (v = the current version), its trip starts at t and its event
            (upload or failure) is at e = min(t + d_i, end of its window)
    pop     the B slots of earliest events (a top-k over the K event times; ties to the
            lower slot); t ← the latest of them
    each popped upload j, staleness s_j = v − v_j:
            s_j > max_staleness: discarded (x_{v_j} has left the ring of kept versions)
            else y_j ← LocalUpdate(x_{v_j}) (`ClientTraining`, the key drawn at dispatch)
    x       ← the algorithm's server step over the kept uploads; v ← v + 1 if any
    the popped slots are emptied (refilled at the next step, at time t)

With k cluster models (asynchronous IFCA), x is the k models, a client downloads all
k of version v_j, trains the one of lowest loss on its data (IFCA's choice, made on
the models it downloaded) and its upload counts toward that cluster alone; the
server step then sees per-cluster totals, and a cluster no kept upload chose keeps
its model. The version counter and the ring are shared by the k models.

The ring holds x_{v − R + 1} .. x_v (R = max_staleness + 1 versions, version u at u
mod R), so a client trains on the model it downloaded without K copies of it. A slot
left empty because no client was eligible is filled at a later step; when no slot is
in flight, the clock jumps to the first moment an idle client is online again.
Systems' dropout makes a trip fail (its event is the upload that never comes);
stragglers (a share of a synchronous cohort) do not apply: slow clients are the
clock's. No Python loop runs over clients or events: a run is the scan over server
steps that every algorithm's rounds are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import Algorithm, check_inputs, mean_over
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.ifca import evaluate_clusters
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.models.core import Model, client_loss
from fedjax_sim.ops import (
    Cohort,
    assign_clusters,
    client_keys,
    cohort_sums,
    segment_totals,
    weighted_sum,
)
from fedjax_sim.ops.clock import Clock, model_bytes, next_online, online, trip_events
from fedjax_sim.ops.work import TABLE_MAX_CLIENTS, available, slot_flags
from fedjax_sim.systems import systems_of

STALENESS = ("polynomial", "hinge", "constant")


class AsyncState(NamedTuple):
    params: object  # pytree: x, the server model (version `version`); [k, ...]: k clusters'
    versions: object  # pytree, leaves [R, ...] ([R, k, ...]): x of versions v − R + 1 .. v
    # (version u at u mod R)
    version: jax.Array  # int32: server updates applied so far
    flying: jax.Array  # [K] bool: the slot holds a client in flight (else it is empty)
    clients: jax.Array  # [K] int32: each slot's client (its last one when empty; −1: none yet)
    started: jax.Array  # [K] int32: the version each slot's client downloaded
    events: jax.Array  # [K] float32: when each slot's trip ends (upload or failure)
    uploads: jax.Array  # [K] bool: the trip ends in an upload (else it fails)
    keys: jax.Array  # [K, ...] uint32: key data of each trip's key
    time: jax.Array  # float32: virtual seconds
    trips: jax.Array  # int32: uploads received so far (discarded stale ones included)
    round: jax.Array  # int32: server steps taken


def check_staleness(algorithm: str, staleness, a, b) -> None:
    """ValueError unless the staleness function and its a, b are valid."""
    if staleness not in STALENESS:
        raise ValueError(f"{algorithm}'s staleness must be one of {', '.join(STALENESS)}; "
                         f"got {staleness!r}.")
    for name, value in (("staleness_a", a), ("staleness_b", b)):
        if isinstance(value, jax.core.Tracer):
            continue
        try:
            ok = float(value) >= 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{algorithm}'s {name} must be a number >= 0; got {value!r}.")


def staleness_weight(staleness: str, a, b) -> Callable:
    """s(τ) of FedAsync (Xie et al., section 5.2), τ the staleness (int array):

    "polynomial": (1 + τ)^−a (FedBuff's 1/√(1 + τ) is a = 1/2);
    "hinge": 1 if τ ≤ b, else 1 / (a (τ − b) + 1);
    "constant": 1.
    """
    def weight(tau):
        tau = tau.astype(jnp.float32)
        if staleness == "polynomial":
            return jnp.power(1.0 + tau, -jnp.asarray(a, jnp.float32))
        if staleness == "hinge":
            return jnp.where(tau <= b, 1.0, 1.0 / (a * (tau - b) + 1.0))
        return jnp.ones_like(tau)

    return weight


def check_count(algorithm: str, name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{algorithm}'s {name} must be an integer >= {minimum}; got {value!r}.")


def check_clock(algorithm: str, clock) -> Clock:
    if clock is None:
        return Clock()
    if not isinstance(clock, Clock):
        raise ValueError(f"{algorithm}'s clock must be a fedjax_sim.ops.clock.Clock; got "
                         f"{clock!r}.")
    return clock


def check_buffered(algorithm: str, training, *, concurrency, buffer_size, max_staleness,
                   staleness, staleness_a, staleness_b, server_lr, clock) -> tuple:
    """A buffered server's arguments (FedBuff's and async IFCA's) checked in one line each:
    (η_g, the clock)."""
    check_training(algorithm, training)
    check_count(algorithm, "concurrency", concurrency)
    check_count(algorithm, "buffer_size", buffer_size)
    if buffer_size > concurrency:
        raise ValueError(f"{algorithm}'s buffer_size (B={buffer_size}) must be at most its "
                         f"concurrency (K={concurrency}): a server step waits for B of the K "
                         "clients in flight.")
    check_count(algorithm, "max_staleness", max_staleness, minimum=0)
    check_staleness(algorithm, staleness, staleness_a, staleness_b)
    eta = 1.0 if server_lr is None else server_lr
    check_learning_rate(f"{algorithm}'s server_lr", eta)
    return eta, check_clock(algorithm, clock)


def _trip_steps(training: ClientTraining, keys, ids, num_examples, m: int):
    """[c] int32: the local steps of each trip, as its training will draw them."""
    if training.work.uniform:
        return jnp.full(ids.shape, training.steps, jnp.int32)
    tau = None
    if training.work.needs_ids() and m <= TABLE_MAX_CLIENTS:
        tau = jnp.asarray(training.work.table(training.steps, m))[ids]
    return jax.vmap(lambda k, i, n, t: training.client_steps(k, i, n, tau=t))(
        keys, ids, num_examples, tau)


def _check_systems(algorithm: str, systems) -> None:
    if systems.stragglers:
        raise ValueError(f"{algorithm} makes slow clients slow by its clock (Clock "
                         "step_seconds): give Systems stragglers=0 (a share of a synchronous "
                         f"cohort); got {systems.stragglers}.")


def _choose_clusters(model: Model, downloaded, data):
    """Each slot's cluster of lowest loss among the k models it downloaded (leaves
    [c, k, ...]), ties to the lower index: ([c] int32, its model with leaves [c, ...])."""
    def losses(models, x, y, n):  # [k]
        return jax.vmap(lambda p: client_loss(model, p, x, y, n))(models)

    chosen = assign_clusters(jax.vmap(losses)(downloaded, data.x, data.y, data.num_examples))
    start = jax.tree.map(lambda p: jax.vmap(lambda q, j: q[j])(p, chosen), downloaded)
    return chosen, start


def asynchronous(name: str, model: Model, training: ClientTraining, *, concurrency: int,
                 buffer_size: int, max_staleness: int, clock: Clock, weight: Callable,
                 client_value: Callable, server_step: Callable,
                 num_clusters: int | None = None) -> Algorithm:
    """The algorithm whose round is one server step of the event rule above.

    Args:
      name: the algorithm's name, for messages.
      concurrency: K, the slots of clients in flight (static).
      buffer_size: B ≤ K, the uploads a server step waits for (static).
      max_staleness: R − 1; the ring keeps R versions (static).
      clock: the virtual clock.
      weight: staleness [B] int32 -> [B] weights of the uploads.
      client_value: (start params, trained params) -> what a client contributes (a
        pytree like the params): summed over the kept uploads with their weights.
      server_step: (x, Σ w_j value_j, Σ w_j, number kept) -> the new x (called with
        at least one kept upload). With clusters, each sum is per cluster (leaves
        [k, ...]; [k] weights and counts, a cluster nobody chose at 0).
      num_clusters: None, one server model; k, k cluster models each client chooses
        among (IFCA's argmin loss) and trains one of (static).
    """
    K, B, R, k = concurrency, buffer_size, max_staleness + 1, num_clusters

    def init(key, data) -> AsyncState:
        if k is None:
            params = model.init(key)
            check_inputs(model, params, data)
        else:  # IFCA's k initial models, one key each
            params = jax.vmap(model.init)(jax.random.split(key, k))
            check_inputs(model, jax.tree.map(lambda p: p[0], params), data)
        clock.check(data.num_clients)
        ring = jax.tree.map(lambda p: jnp.broadcast_to(p, (R,) + p.shape), params)
        key_data = jax.random.key_data(client_keys(key, jnp.arange(K)))
        return AsyncState(params, ring, jnp.zeros((), jnp.int32), jnp.zeros((K,), bool),
                          jnp.full((K,), -1, jnp.int32), jnp.zeros((K,), jnp.int32),
                          jnp.zeros((K,), jnp.float32), jnp.zeros((K,), bool),
                          key_data, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                          jnp.zeros((), jnp.int32))

    def refill(state: AsyncState, data, key) -> AsyncState:
        """Every empty slot draws an eligible client whose trip starts now."""
        m = data.num_clients
        systems = systems_of(data)
        _check_systems(name, systems)
        tables = clock.tables(m, systems)
        key_draw, key_slots = jax.random.split(key)
        everyone = jnp.arange(m, dtype=jnp.int32)
        t = state.time
        free = ~state.flying
        in_flight = jnp.where(free, m, state.clients)  # m: dropped by the scatter
        busy = jnp.zeros((m,), bool).at[in_flight].set(True, mode="drop")
        eligible = data.active() & ~busy & online(tables, everyone, jnp.full((m,), t))
        if not systems.always_available:
            eligible &= available(key_draw, m, systems.replace(period=0))
        # Uniform without replacement among the eligible (the cohort op's draw).
        scores = jnp.where(eligible, jax.random.uniform(key_draw, (m,)), 2.0)
        drawn = jnp.argsort(scores)[:min(K, m)].astype(jnp.int32)
        rank = jnp.cumsum(free.astype(jnp.int32)) - 1
        fill = free & (rank < jnp.sum(eligible.astype(jnp.int32)))
        ids = jnp.where(fill, drawn[jnp.clip(rank, 0, drawn.shape[0] - 1)], -1)
        keys = client_keys(key_slots, jnp.arange(K))
        safe = jnp.maximum(ids, 0)
        steps = _trip_steps(training, keys, safe, data.num_examples[safe], m)
        # Down and up, each way on average: a clustered client downloads k models and
        # uploads the one it trained.
        traffic = model_bytes(state.params) * (1.0 if k is None else (k + 1) / (2 * k))
        when, completes = trip_events(tables, safe, steps, jnp.full((K,), t), traffic)
        if not systems.trivial:  # Systems' dropout: the upload never comes
            completes &= slot_flags(keys, systems.replace(stragglers=0.0))[1]
        return state._replace(
            flying=state.flying | fill,
            clients=jnp.where(fill, ids, state.clients),
            started=jnp.where(fill, state.version, state.started),
            events=jnp.where(fill, when, state.events),
            uploads=jnp.where(fill, completes, state.uploads),
            keys=jnp.where(fill[:, None], jax.random.key_data(keys), state.keys))

    def round_(state: AsyncState, data, key):
        state = refill(state, data, key)
        m = data.num_clients
        # The B earliest events (ties to the lower slot), empty slots last.
        _, slots = jax.lax.top_k(-jnp.where(state.flying, state.events, jnp.inf), B)
        when = state.events[slots]
        ids = state.clients[slots]
        here = state.flying[slots]
        staleness = state.version - state.started[slots]
        uploaded = here & state.uploads[slots]
        kept = uploaded & (staleness <= max_staleness)
        tables = clock.tables(m, systems_of(data))
        idle = jnp.arange(m, dtype=jnp.int32)
        reopen = jnp.min(jnp.where(data.active(),
                                   next_online(tables, idle, jnp.full((m,), state.time)),
                                   jnp.inf))
        time = jnp.where(jnp.any(here), jnp.max(jnp.where(here, when, -jnp.inf)),
                         jnp.maximum(state.time, jnp.where(jnp.isfinite(reopen), reopen,
                                                           state.time)))

        starts = jax.tree.map(lambda ring: ring[state.started[slots] % R], state.versions)
        cohort = Cohort(ids=jnp.maximum(ids, 0),
                        keys=jax.random.wrap_key_data(state.keys[slots]), reports=kept)
        training_t = training.at_round(state.round)  # the rate of this server step

        def client_step(batch):  # the popped uploads, each from the version it downloaded
            start, tau = batch.inputs
            if k is not None:  # the cluster each chooses on what it downloaded: [c]
                chosen, start = _choose_clusters(model, start, batch.data)
            trained, _, losses = training_t.update_clients(model, start, batch.data,
                                                           batch.keys, **batch.work())
            w = jnp.where(batch.active, weight(tau), 0.0)
            value = client_value(start, trained)
            active = batch.active.astype(jnp.float32)
            if k is None:
                sums = (weighted_sum(value, w), jnp.sum(w), jnp.sum(active))
            else:  # per cluster, IFCA's segment sums; a slot not reporting is dropped (id k)
                segment = jnp.where(batch.active, chosen, k)
                totals, seg_weight = segment_totals(value, segment, k, w)
                sums = (totals, seg_weight, jax.ops.segment_sum(active, segment, k))
            return sums, (losses[:, 0], batch.active, tau)

        (total, total_weight, count), (first_losses, active, taus) = cohort_sums(
            client_step, data, cohort, inputs=(starts, staleness))
        moved = jnp.sum(count) > 0
        stepped = server_step(state.params, total, total_weight, jnp.maximum(count, 1.0))
        params = jax.tree.map(lambda new, old: jnp.where(moved, new, old), stepped,
                              state.params)
        version = state.version + moved.astype(jnp.int32)
        # x_v sits at v mod R: unchanged params at an unchanged version rewrite the same.
        versions = jax.tree.map(lambda ring, p: ring.at[version % R].set(p), state.versions,
                                params)
        popped = jnp.zeros((K,), bool).at[slots].set(here)
        trips = state.trips + jnp.sum(uploaded.astype(jnp.int32))
        new = state._replace(
            params=params, versions=versions, version=version,
            flying=state.flying & ~popped,
            time=time, trips=trips, round=state.round + 1)
        metrics = {"cohort_loss": mean_over(first_losses, active),
                   "virtual_time": time,
                   "trips": trips.astype(jnp.float32),
                   "staleness": mean_over(taus.astype(jnp.float32), active),
                   "updates": jnp.sum(count)}
        if k is not None:
            metrics["clusters_moved"] = jnp.sum((count > 0).astype(jnp.float32))
        return new, metrics

    def evaluate(state: AsyncState, data) -> dict:
        if k is None:
            return evaluate_shared(model, state.params, data)
        return evaluate_clusters(model, state.params, data)  # each client's argmin-loss model

    return Algorithm(init, round_, evaluate)


def mixed(x, total, total_weight):
    """(1 − Σ w_j) x + Σ w_j y_j: FedAsync's x ← (1 − α_t) x + α_t y for one arrival."""
    return jax.tree.map(lambda p, t: (1.0 - total_weight) * p + t, x, total)


def delta(start, trained):
    """Δ = y − x_start, a client's change of the model it downloaded."""
    return optax.tree.sub(trained, start)
