"""How many local steps each client takes in a round, and the per-slot draws of `Systems`.

A client's local steps are one `lax.scan` of `steps` (static) iterations; a
client whose own work τ_i is smaller stops stepping at τ_i (its params and
optimizer state are carried unchanged through the remaining iterations). So
per-client work costs no Python loop and no extra program per distinct τ_i,
and a round costs about what a uniform round of `steps` steps costs.

Every draw here comes from a key the round already has, on its own stream:

- a slot's key (`Cohort.keys`) folded with `WORK_STREAM` (τ_i redrawn every
  round), `STRAGGLE_STREAM` (whether it straggles: its uniform, or its rank among the
  cohort's under the "fixed" draw), `STRAGGLE_WORK_STREAM`
  (how much of its work a straggler does), `REPORT_STREAM` (dropout);
- `PRNGKey(work.seed)` folded with the client's id: τ_i drawn once per
  client, the same every round, for every method of a comparison. A round that
  knows m reads these from a table computed once on the host (`Work.table`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

WORK_STREAM = 3
STRAGGLE_STREAM = 4
STRAGGLE_WORK_STREAM = 5
REPORT_STREAM = 6
AVAILABILITY_STREAM = 7


@dataclass(frozen=True)
class Work:
    """τ_i, the local steps of client i in a round, at most `ClientTraining.steps`.

    Exactly one of three forms (or none of them: every client takes all the steps):

    - `low`: τ_i uniform on {low, ..., steps}, drawn once per client from its id
      and `seed` (a client's speed), or afresh every round with `per_round`;
    - `per_client`: τ_i read from a table with one entry per client (length m);
    - `epochs`: τ_i = ⌈epochs · n_i / b⌉, the steps of `epochs` passes over the
      client's n_i rows in batches of b (FedNova's heterogeneous τ_i; b is the
      batch size, or n_i for full-batch steps), capped at `steps`.

    Examples:
      >>> from fedjax_sim.ops.work import Work
      >>> Work(low=1).uniform, Work().uniform
      (False, True)
      >>> Work(low=2, per_client=(1, 2))
      Traceback (most recent call last):
      ...
      ValueError: Work takes one of low, per_client or epochs; got low and per_client.
    """

    low: int | None = None
    per_round: bool = False
    per_client: tuple[int, ...] | None = None
    epochs: float | None = None
    seed: int = 0

    def __post_init__(self):
        given = [n for n in ("low", "per_client", "epochs") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"Work takes one of low, per_client or epochs; got "
                             f"{' and '.join(given)}.")
        if self.low is not None and (not isinstance(self.low, int) or isinstance(self.low, bool)
                                     or self.low < 0):
            raise ValueError(f"Work low (the fewest local steps) must be an integer >= 0; "
                             f"got {self.low!r}.")
        if self.per_client is not None:
            table = tuple(self.per_client)
            if not table or any(not isinstance(t, int) or isinstance(t, bool) or t < 0
                                for t in table):
                raise ValueError("Work per_client must be a non-empty sequence of integers "
                                 f">= 0 (local steps, one per client); got {self.per_client!r}.")
            object.__setattr__(self, "per_client", table)
        if self.epochs is not None and not (isinstance(self.epochs, int | float)
                                            and self.epochs > 0):
            raise ValueError(f"Work epochs must be a number > 0; got {self.epochs!r}.")
        if self.per_round and self.low is None:
            raise ValueError("Work per_round redraws τ_i uniform on {low, ..., steps} every "
                             "round: give low too.")

    @property
    def uniform(self) -> bool:
        """Every client takes all the steps (the scan needs no mask)."""
        return self.low is None and self.per_client is None and self.epochs is None

    def check(self, steps: int) -> None:
        """ValueError unless this work fits `steps` local steps."""
        if self.low is not None and self.low > steps:
            raise ValueError(f"Work low={self.low} exceeds the local steps ({steps}).")
        if self.per_client is not None and max(self.per_client) > steps:
            raise ValueError(f"Work per_client holds {max(self.per_client)} local steps, more "
                             f"than the training's steps ({steps}): raise steps to at least "
                             "that (it is the scan's length).")

    def needs_ids(self) -> bool:
        """τ_i depends on the client alone (its id), the same every round."""
        return self.per_client is not None or (self.low is not None and not self.per_round)

    def table(self, steps: int, num_clients: int):
        """[m] int32 numpy array: τ_i of every client, for work drawn once per client
        (`needs_ids`).

        The same values as `steps_of` draws in a round, computed once on the host and
        cached, so a round reads τ_i with a gather instead of drawing it afresh (on a
        0.9 ms linear round of 1000 clients the per-round draw cost 11 %).
        """
        return _work_table(self, steps, num_clients)

    def steps_of(self, key, client_id, num_examples, steps: int, batch_size: int | None):
        """τ_i (int32 scalar) of one client: its slot `key`, its `client_id`."""
        if self.uniform:
            return jnp.asarray(steps, jnp.int32)
        if self.epochs is not None:
            n = num_examples.astype(jnp.float32)
            b = n if batch_size is None else jnp.minimum(float(batch_size), n)
            tau = jnp.ceil(self.epochs * n / jnp.maximum(b, 1.0))
            return jnp.minimum(tau, steps).astype(jnp.int32)
        if client_id is None:
            raise ValueError("this Work draws τ_i per client, from its id, and the caller "
                             "passed none (client_id=)")
        if self.per_client is not None:
            return jnp.asarray(self.per_client, jnp.int32)[client_id]
        draw = (jax.random.fold_in(key, WORK_STREAM) if self.per_round
                else jax.random.fold_in(jax.random.key(self.seed), client_id))
        return jax.random.randint(draw, (), self.low, steps + 1, jnp.int32)


UNIFORM_WORK = Work()
TABLE_MAX_CLIENTS = 1 << 16  # beyond this the round draws τ_i itself (no [m] constant)


@functools.lru_cache(maxsize=64)
def _work_table(work: Work, steps: int, num_clients: int):
    if not work.needs_ids():
        raise ValueError("Work.table holds τ_i of work drawn once per client (low without "
                         f"per_round, or per_client); this work is {work!r}.")
    with jax.ensure_compile_time_eval():
        ids = jnp.arange(num_clients, dtype=jnp.int32)
        tau = jax.vmap(lambda i: work.steps_of(None, i, None, steps, None))(ids)
        return np.asarray(tau, np.int32)


def straggler_steps(key, tau):
    """A straggler's steps: uniform on {1, ..., τ_i − 1}, strictly less than its full work
    (the FedProx code's 1..E − 1 epochs); τ_i itself when τ_i ≤ 1 (no partial work is
    possible: one step or none)."""
    u = jax.random.uniform(jax.random.fold_in(key, STRAGGLE_WORK_STREAM))
    partial = (1 + jnp.floor(u * (tau - 1)).astype(jnp.int32)).clip(max=tau - 1)
    return jnp.where(tau >= 2, partial, tau)


@functools.lru_cache(maxsize=64)
def _full_work_counts(size: int, rate: float):
    """[size + 1] int32 numpy: round(K · (1 − rate)) for K = 0..size, in Python (the FedProx
    code's count of devices doing full work; round half to even)."""
    counts = np.asarray([round(k * (1.0 - rate)) for k in range(size + 1)], np.int32)
    counts.setflags(write=False)
    return counts


def fixed_stragglers(u, rate: float, filled=None):
    """[s] bool: the FedProx code's stragglers among a cohort's slots.

    Of the K slots in `filled` ([s] bool; None: all s), the round(K · (1 − rate)) whose
    uniform `u` ([s]) is smallest do their full work and the other K − round(K · (1 − rate))
    straggle (a uniformly random subset of that size); a slot outside `filled` never does.
    """
    size = u.shape[0]
    full = _full_work_counts(size, float(rate))
    if filled is None:
        rank = jnp.argsort(jnp.argsort(u))
        return rank >= int(full[size])
    rank = jnp.argsort(jnp.argsort(jnp.where(filled, u, 2.0)))  # the filled slots first
    count = jnp.sum(filled.astype(jnp.int32))
    return filled & (rank >= jnp.asarray(full)[count])


def slot_flags(keys, systems, filled=None):
    """(straggles [s], reports [s]) of a cohort's slots under `systems`, from their keys.

    filled: [s] bool, the slots holding an available client (None: every slot), among
    which the "fixed" draw chooses its stragglers (`fedjax_sim.systems`)."""
    def draws(k):
        return (jax.random.uniform(jax.random.fold_in(k, STRAGGLE_STREAM)),
                jax.random.uniform(jax.random.fold_in(k, REPORT_STREAM)))

    u_straggle, u_report = jax.vmap(draws)(keys)
    if systems.straggler_draw == "independent":
        straggles = u_straggle < systems.stragglers
    else:
        straggles = fixed_stragglers(u_straggle, systems.stragglers, filled)
    reports = u_report >= systems.dropout
    if systems.straggler_policy == "drop":
        reports = reports & ~straggles
    return straggles, reports


@functools.lru_cache(maxsize=64)
def _time_zones(num_clients: int, period: int, seed: int):
    order = np.random.default_rng(seed).permutation(num_clients)
    zones = (order * period // num_clients).astype(np.int32)
    zones.setflags(write=False)
    return zones


def time_zones(num_clients: int, systems):
    """[m] int32 numpy: client i's time zone z_i = ⌊π(i) · period / m⌋, π the permutation of
    the m clients `numpy.random.default_rng(systems.zone_seed).permutation(m)`.

    The zones hold as many clients each as ⌊i · period / m⌋ would, placed independently of
    the clients' numbering (clients numbered cluster by cluster share no zone by cluster).
    """
    if not systems.period:
        raise ValueError("time zones need Systems with a period (a day/night cycle).")
    return _time_zones(num_clients, systems.period, systems.zone_seed)


def available(key, num_clients: int, systems, round_=None):
    """[m] bool: which clients are available in round `round_` (`systems.availability`;
    its day/night cycle needs the round, and places client i in `time_zones`)."""
    p = systems.availability
    if isinstance(p, tuple):
        if len(p) != num_clients:
            raise ValueError(f"Systems availability holds {len(p)} probabilities for "
                             f"{num_clients} clients: give one per client.")
        p = jnp.asarray(p, jnp.float32)
    if systems.period:
        if round_ is None:
            raise ValueError("Systems with a period (a day/night cycle) need the round: "
                             "draw_cohort(..., round=state.round).")
        zone = jnp.asarray(time_zones(num_clients, systems))
        day = (round_ + zone) % systems.period < systems.period / 2
        p = jnp.where(day, p, systems.night)
    u = jax.random.uniform(jax.random.fold_in(key, AVAILABILITY_STREAM), (num_clients,))
    return u < p
