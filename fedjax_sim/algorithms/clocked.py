"""A synchronous algorithm in virtual time: `with_clock` keeps the clock beside its state.

A synchronous round waits for its cohort (`ops.clock.sync_round`): every slot's trip
(download, τ_i local steps, upload) starts when the round does, and

    d_j      ← τ_j · step_seconds_j + 2 · model_bytes / bandwidth_j         (`ops.clock`)
    reports_j  the slot's client holds data, reports (`Systems`) and stays online
    seconds  ← max_j{d_j : reports_j}              (0 when no slot reports)
    deadline:  seconds ← min(seconds, deadline); the slots with d_j > deadline are dropped
    t        ← t + seconds;   trips ← trips + #{j : reports_j}

A dropped slot counts as a trip (its client uploaded, too late, as FedBuff counts a
discarded stale upload) and is left out of the round's sums as a client without data is
(its num_examples read as 0 by the wrapped round). When no slot of a round reports
and clients have windows, the clock jumps to the first moment one of the cohort comes
online again.

The cohort is the one the wrapped round draws: `draw_cohort(key, data, participation,
round=state.round)`, drawn again here from the same key. So `with_clock` fits an
algorithm whose round draws its cohort that way from the key it is given (FedAvg,
FedProx).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.asynchronous import _trip_steps
from fedjax_sim.algorithms.base import NOT_PER_CLIENT, Algorithm, draw_cohort
from fedjax_sim.algorithms.training import ClientTraining
from fedjax_sim.models.core import Model
from fedjax_sim.ops.clock import (
    Clock,
    model_bytes,
    next_online,
    sync_round_seconds,
    trip_events,
)
from fedjax_sim.systems import systems_of


class ClockedState(NamedTuple):
    """A synchronous algorithm's state under `with_clock`: its own, and the clock's."""

    inner: Any  # the wrapped algorithm's state
    time: jax.Array  # float32: virtual seconds elapsed
    trips: jax.Array  # int32: client uploads so far (deadline-dropped ones included)

    @property
    def round(self):
        return self.inner.round


def with_clock(algorithm: Algorithm, model: Model, training: ClientTraining, clock: Clock, *,
               participation: float = 1.0, deadline: float | None = None) -> Algorithm:
    """`algorithm` with its rounds timed by `clock` (and stragglers past `deadline` dropped).

    Args:
      algorithm: a synchronous algorithm whose round draws its cohort with
        `draw_cohort(key, data, participation, round=state.round)`.
      model: its model (for the bytes a trip moves).
      training: its client training (τ_i of each slot, drawn as the round draws it).
      clock: the clients' speeds and windows (`ops.clock.Clock`).
      participation: the fraction of clients the wrapped round draws.
      deadline: None, or seconds after which the server stops waiting (> 0).

    Returns:
      Algorithm with state `ClockedState`; every round's metrics gain `virtual_time`
      and `trips` (after the round) and `dropped` (slots past the deadline).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd
      >>> from fedjax_sim.algorithms.clocked import with_clock
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops.clock import Clock
      >>> data = linear_mixture(jax.random.key(0), k=2, m=4, n=10, d=3, sigma=0.1, R=1.0).train
      >>> model, training = linear_regression(3), sgd(0.1, steps=5)
      >>> clock = Clock(step_seconds=(1.0, 2.0, 3.0, 4.0))
      >>> alg = with_clock(fedavg(model, training), model, training, clock, deadline=12.0)
      >>> state, metrics = alg.round(alg.init(jax.random.key(1), data), data, jax.random.key(2))
      >>> float(state.time), int(state.trips), int(metrics["dropped"])  # 5·4 s > 12 s
      (12.0, 4, 2)
    """
    if deadline is not None and not (float(deadline) > 0 and jnp.isfinite(deadline)):
        raise ValueError(f"with_clock's deadline must be a finite number of seconds > 0 "
                         f"(or None); got {deadline!r}.")
    if not isinstance(clock, Clock):
        raise ValueError(f"with_clock takes a fedjax_sim.ops.clock.Clock; got {clock!r}.")
    nbytes = model_bytes(jax.eval_shape(model.init, jax.random.key(0)))

    def init(key, data) -> ClockedState:
        clock.check(data.num_clients)
        return ClockedState(algorithm.init(key, data), jnp.zeros((), jnp.float32),
                            jnp.zeros((), jnp.int32))

    def round_(state: ClockedState, data, key):
        m = data.num_clients
        systems = systems_of(data)
        if systems.stragglers:
            raise ValueError("with_clock makes slow clients slow by its clock: give Systems "
                             f"stragglers=0; got {systems.stragglers}.")
        tables = clock.tables(m, systems)
        cohort = draw_cohort(key, data, participation, round=state.inner.round)
        ids = cohort.ids
        steps = _trip_steps(training, cohort.keys, ids, data.num_examples[ids], m)
        reports = data.active()[ids]
        if cohort.reports is not None:
            reports &= cohort.reports
        start = jnp.full(ids.shape, state.time)
        event, completes = trip_events(tables, ids, steps, start, nbytes)
        uploads = reports & completes
        seconds, kept = sync_round_seconds(event - start, uploads, deadline)
        windows = tables.starts.shape[1] > 0
        if windows:  # nobody reported: wait for the first of the cohort to come online
            reopen = jnp.min(next_online(tables, ids, start))
            seconds = jnp.where(jnp.any(uploads), seconds,
                                jnp.where(jnp.isfinite(reopen), reopen - state.time, 0.0))
        inner_data = data
        if deadline is not None or windows:
            gone = jnp.zeros((m,), bool).at[jnp.where(reports & ~kept, ids, m)].set(
                True, mode="drop")
            inner_data = data.replace(num_examples=jnp.where(gone, 0, data.num_examples))
        inner, metrics = algorithm.round(state.inner, inner_data, key)
        time = state.time + seconds
        trips = state.trips + jnp.sum(uploads.astype(jnp.int32))
        metrics = {**metrics, "virtual_time": time, "trips": trips.astype(jnp.float32),
                   "dropped": jnp.sum((uploads & ~kept).astype(jnp.float32))}
        return ClockedState(inner, time, trips), metrics

    def evaluate(state: ClockedState, data) -> dict:
        return algorithm.evaluate(state.inner, data)

    def client_axes(state: ClockedState):
        return ClockedState(algorithm.client_axes(state.inner), NOT_PER_CLIENT,
                            NOT_PER_CLIENT)

    return Algorithm(init, round_, evaluate, client_axes)
