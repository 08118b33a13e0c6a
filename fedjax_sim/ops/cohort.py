"""The one cohort path: who takes part in a round, and how their work is laid out.

Every algorithm's round calls `sample_cohort` and `cohort_sums` and reads like
its paper's pseudocode; the plumbing lives here, once:

- sampling the cohort: everyone (no gather at all), uniformly without
  replacement, or by weights with replacement (DRFA samples ∝ λ);
- a key per cohort slot, `fold_in(key, slot)`: a client drawn twice gets two
  keys, so its two copies train differently, and keys do not depend on how
  clients are laid over devices;
- gathering the cohort's rows (`take`, and `put` to write per-client state
  back); client data may be any `ClientSource` (stored copies, views into a
  shared dataset, generated clients), whose rows are built here, per chunk;
- systems heterogeneity (`fedjax_sim.systems.Systems`, riding on the data):
  the cohort drawn among the clients available this round, and each slot's
  flags: whether it straggles and whether it reports. A slot that does not
  report is inactive in every sum (`CohortBatch.active`);
- processing the cohort in chunks under a memory budget (a `lax.scan` over
  chunks, padding the last one, strided chunks on a device mesh, see
  `chunking.scan_client_chunks`), accumulating additive sums so m trained
  models never exist at once. The chunk is the executor's choice, carried by
  the data's execution plan (`execution.Plan.client_chunk`): no algorithm
  names it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from fedjax_sim.data.federated import ClientSource, FederatedData
from fedjax_sim.execution import plan_of
from fedjax_sim.ops.chunking import materialize, scan_client_chunks, take_clients, unchunked
from fedjax_sim.ops.local_update import client_keys, lowest
from fedjax_sim.ops.sampling import sample_uniform, sample_weighted
from fedjax_sim.ops.work import available, slot_flags
from fedjax_sim.systems import NO_SYSTEMS, Systems


@struct.dataclass
class Cohort:
    """The clients of one round.

    Attributes:
      ids: [s] int32 client ids, slot order (repeats allowed when drawn with
        replacement).
      keys: [s] PRNG keys, one per slot.
      everyone: static; True when the cohort is all m clients in order (then
        `take`/`put` are the identity and nothing is gathered).
      reports: [s] bool, the slots whose update reaches the server (an available
        client that neither dropped out nor straggled under the "drop" policy);
        None: every slot (no `Systems`).
      straggles: [s] bool, the slots that do part of their local work; None: none.
      num_available: int32 scalar, how many of the m clients were available this
        round; None: all of them (no availability below 1).
    """

    ids: jax.Array
    keys: jax.Array
    everyone: bool = struct.field(pytree_node=False, default=False)
    reports: jax.Array | None = None
    straggles: jax.Array | None = None
    num_available: jax.Array | None = None

    @property
    def size(self) -> int:
        return self.ids.shape[0]


def sample_cohort(key, num_clients: int, size: int, *, weights=None,
                  systems: Systems = NO_SYSTEMS, round_=None) -> Cohort:
    """A cohort of `size` slots.

    Args:
      key: the round's key for sampling and training (split here).
      num_clients: m.
      size: s, static. s = m without weights means every client, in order.
      weights: None: uniform without replacement; else [m] non-negative
        sampling probabilities, drawn i.i.d. with replacement (a client drawn
        twice appears twice, with two keys).
      systems: availability, dropout and stragglers (`fedjax_sim.systems`).
        With availability < 1 the cohort is drawn among the available clients
        only (∝ weights restricted to them); when fewer than s are available,
        the remaining slots hold unavailable clients and do not report. Every
        client taking part (s = m, no weights) is every available one.
      round_: the round (int32), read by a day/night availability cycle and by
        cyclic participation (`Systems.cyclic`: group round_ mod m / s).
    """
    key_ids, key_slots = jax.random.split(key)
    everyone = weights is None and size == num_clients
    reports = straggles = num_available = None
    if systems.cyclic and not everyone:
        ids = cyclic_group(num_clients, size, round_, weights)
    elif systems.always_available:
        if everyone:
            ids = jnp.arange(num_clients, dtype=jnp.int32)
        elif weights is None:
            ids = sample_uniform(key_ids, num_clients, size)
        else:
            ids = sample_weighted(key_ids, jnp.asarray(weights), size)
    else:
        here = available(key_ids, num_clients, systems, round_)
        if everyone:
            ids = jnp.arange(num_clients, dtype=jnp.int32)
        elif weights is None:  # uniform without replacement among the available first
            scores = jnp.where(here, jax.random.uniform(key_ids, (num_clients,)), 2.0)
            # argsort(scores)[:size] without its full sort (`lowest`: the same ids, ties to
            # the lower index): on CPU the sort of m = 10⁶ scores took 0.58 s, top_k 0.03 s.
            # The scores are drawn from the round's key, held whole by every device.
            ids = lowest(scores, size, replicated=True)
        else:
            w = jnp.where(here, jnp.asarray(weights, jnp.float32), 0.0)
            total = jnp.sum(w)
            p = jnp.where(total > 0, w / jnp.maximum(total, 1e-30), 1.0 / num_clients)
            ids = sample_weighted(key_ids, p, size)
        reports = here[ids]
        num_available = jnp.sum(here.astype(jnp.int32))
    keys = client_keys(key_slots, jnp.arange(size))
    if not systems.trivial:
        # The "fixed" stragglers are chosen among the slots holding an available client.
        straggles, reported = slot_flags(keys, systems, filled=reports)
        reports = reported if reports is None else reports & reported
        if systems.stragglers == 0.0:
            straggles = None  # no straggler: the local steps need no mask
    return Cohort(ids, keys, everyone, reports, straggles, num_available)


def cyclic_group(num_clients: int, size: int, round_, weights=None) -> jax.Array:
    """[s] int32: the ids of round `round_`'s group under cyclic participation, clients
    g·s … g·s + s − 1 for g = round_ mod (m / s) (`Systems.cyclic`)."""
    if weights is not None:
        raise ValueError("Systems cyclic takes the clients in fixed groups: it cannot be "
                         "combined with sampling weights.")
    if num_clients % size:
        raise ValueError(f"Systems cyclic splits the m = {num_clients} clients into groups of "
                         f"the cohort's s = {size}: m must be a multiple of s.")
    if round_ is None:
        raise ValueError("Systems cyclic needs the round: draw_cohort(..., "
                         "round=state.round).")
    group = jnp.asarray(round_, jnp.int32) % (num_clients // size)
    return group * size + jnp.arange(size, dtype=jnp.int32)


def take(cohort: Cohort, per_client):
    """Per-client values (leaves [m, ...]) of the cohort's slots ([s, ...]).

    A client source among them (views, generated clients) comes back as the
    slots' FederatedData.
    """
    if cohort.everyone:
        return materialize(per_client)
    return take_clients(per_client, cohort.ids)


def put(cohort: Cohort, per_client, values):
    """per_client with the cohort's slots set to values (a repeated client: the last slot)."""
    if cohort.everyone:
        return values
    # Scatters with repeated indices apply in an unspecified order: only a
    # client's last slot writes.
    slot = jnp.arange(cohort.size)
    later = (cohort.ids[None, :] == cohort.ids[:, None]) & (slot[None, :] > slot[:, None])
    m = jax.tree.leaves(per_client)[0].shape[0]
    target = jnp.where(jnp.any(later, axis=1), m, cohort.ids)
    return jax.tree.map(lambda a, v: a.at[target].set(v, mode="drop"), per_client, values)


def taking_part(cohort: Cohort, data) -> jax.Array:
    """[s] bool: the slots whose client holds data and reports (`Cohort.reports`), the
    clients whose per-client state a round may change."""
    active = take(cohort, data.active())
    return active if cohort.reports is None else active & cohort.reports


@struct.dataclass
class CohortBatch:
    """Some slots of a cohort, as a round's client step sees them.

    Attributes:
      data: the slots' client data (leaves [c, n_max, ...]).
      keys: [c] per-slot keys.
      inputs: the per-slot values the round passed (leaves [c, ...]).
      active: [c] bool: a real slot (not chunk padding) whose client holds
        data and reports (`Cohort.reports`). An inactive slot must get weight 0
        in every sum.
      real: [c] bool: a real slot, not chunk padding (a constant True
        without chunks, which XLA folds away). Enough as a weight where a
        client without data contributes exactly 0 anyway (a masked gradient).
      ids: [c] int32 client ids of the slots.
      straggles: [c] bool, the slots that do part of their work; None: none.
      num_clients: m, static: the federation's clients (per-client work tables).
      slots: [c] int32, each slot's position in the cohort (0 … s − 1; chunk padding
        repeats the last one): where a rule that keeps every update (a robust
        aggregator) puts it.
      cohort_size: s, static: the cohort's slots.
    """

    data: FederatedData
    keys: jax.Array
    inputs: Any
    active: jax.Array
    real: jax.Array
    ids: jax.Array
    straggles: jax.Array | None = None
    num_clients: int | None = struct.field(pytree_node=False, default=None)
    slots: jax.Array | None = None
    cohort_size: int | None = struct.field(pytree_node=False, default=None)

    def work(self) -> dict:
        """What a `ClientTraining` needs of the slots beyond their data and keys:
        `training.update_clients(model, params, batch.data, batch.keys, **batch.work())`."""
        return {"ids": self.ids, "straggles": self.straggles, "num_clients": self.num_clients}

    def slot_work(self) -> dict:
        """The same per slot (leaves [c]), for a round that vmaps `training.update` itself:
        `jax.vmap(lambda ..., work: training.update(..., **work))(..., batch.slot_work())`."""
        return {"client_id": self.ids, "straggles": self.straggles}


def cohort_sums(client_step, data: ClientSource, cohort: Cohort, *, inputs=()):
    """Runs `client_step` over the cohort and adds up what it returns.

    Args:
      client_step: CohortBatch -> (sums, outputs): `sums` adds over clients
        (per-cluster totals, weights) and has the same shapes for any number
        of clients; `outputs` is a pytree of per-slot values (leaves [c, ...]).
      data: all m clients: FederatedData, or any ClientSource (ClientViews,
        GeneratedClients), whose rows are then built per chunk, so only a
        chunk's rows exist at once.
      cohort: from `sample_cohort`.
      inputs: per-slot values for the step (leaves [s, ...]), e.g.
        `take(cohort, state.assignment)`.

    How many slots are processed at once is the data's execution plan
    (`execution.Plan.client_chunk`, set by the executor): None, the whole cohort;
    else at most that many at a time (a `lax.scan`, so peak memory is O(chunk ×
    model)), with the same result up to float summation order.

    Returns:
      (sums, outputs with leaves [s, ...]).
    """

    def reporting(active, reports):
        return active if reports is None else active & reports

    def whole_cohort():
        members = unchunked(take(cohort, data))
        return client_step(CohortBatch(members, cohort.keys, inputs,
                                       reporting(members.active(), cohort.reports),
                                       jnp.ones((cohort.size,), bool), cohort.ids,
                                       cohort.straggles, data.num_clients,
                                       jnp.arange(cohort.size, dtype=jnp.int32),
                                       cohort.size))

    client_chunk = plan_of(data).client_chunk
    if client_chunk is None:
        return whole_cohort()

    def add_chunk(acc, part, valid):
        data_c, ids_c, keys_c, inputs_c, reports_c, straggles_c, slots_c = part
        if data_c is None:  # a sampled cohort gathers its rows by id
            data_c = data.take(ids_c)
        data_c = unchunked(data_c)
        batch = CohortBatch(data_c, keys_c, inputs_c, reporting(valid & data_c.active(),
                                                                reports_c), valid, ids_c,
                            straggles_c, data.num_clients, slots_c, cohort.size)
        sums, out = client_step(batch)
        return optax.tree.add(acc, sums), out

    # The sums' shapes do not depend on how many clients a step sees.
    zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(whole_cohort)[0])
    # With everyone taking part the chunks slice `data` itself, so on a device
    # mesh each chunk reads its rows where they live.
    slots = (data if cohort.everyone else None, cohort.ids, cohort.keys, inputs,
             cohort.reports, cohort.straggles, jnp.arange(cohort.size, dtype=jnp.int32))
    return scan_client_chunks(add_chunk, zero, slots, client_chunk)
