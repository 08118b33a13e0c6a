"""Byzantine clients and robust aggregation for every algorithm whose server averages updates.

`with_aggregator(algorithm, aggregator, byzantine=f, attack=...)` puts a robust rule of
`fedjax_sim.ops.robust` (coordinate-wise median, trimmed mean, (Multi-)Krum, geometric
median, centered clipping, Bulyan; bucketing or nearest-neighbour mixing `chain`ed before
them) in place of the algorithm's weighted mean, and, with `byzantine > 0`, makes that many
clients Byzantine: in every round the Byzantine reporting clients send what `attack`
(`fedjax_sim.ops.attacks`) crafts from the round's honest updates instead of their own.
One round's server step, for clients that start from θ (their cluster's θ_j in IFCA,
HypCluster):

    Δ_i   ← θ̃_i − θ                                  (every reporting slot's change, stacked)
    Δ_B   ← attack(Δ_honest)                          (the Byzantine reporting slots, omniscient)
    θ     ← θ + Aggregate({Δ_i : i reports})          (per cluster: over that cluster's slots)

Under `attacks.label_flip(C)` the Byzantine clients' labels are flipped (y ← C − 1 − y)
before the round, and their honest updates of those labels are what the server gets.
`byzantine` and the attack may be traced (a count array; `attacks.one_of` with a traced
index), so a sweep over them is one program (`with_grid`).

A slot that does not report (no data, unavailable, dropped, chunk padding, a client of
another cluster) never enters a robust statistic (`ops.robust`'s masks): a median over a
cluster is the median of that cluster's reporting clients. The Byzantine clients are
drawn once, at init (`ops.attacks.byzantine_clients`), the same for every method of a
comparison with the same key. Every reporting client counts alike (no example weighting).
The cohort's changes are kept stacked ([s, parameters]: what a robust statistic needs),
slot by slot, so the executor may still process the cohort in chunks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import Algorithm, check_no_rule
from fedjax_sim.data.federated import FederatedData, is_client_source
from fedjax_sim.ops.attacks import LabelFlip, OneOf, byzantine_clients, flip_labels, switch
from fedjax_sim.ops.robust import Aggregator, chain

#: The stream folded into a round's key for the attack's and the aggregator's draws.
ROBUST_STREAM = 0xB12A
#: The stream folded into init's key for drawing the Byzantine clients.
BYZANTINE_STREAM = 0xB12B

__all__ = ["RobustSum", "with_aggregator"]


class Stacked(NamedTuple):
    """A cohort's changes kept slot by slot: additive over chunks (disjoint slots)."""

    updates: Any  # pytree, leaves [s, ...]: each slot's change (0 where none)
    reports: jax.Array  # [s] float32: 1 where the slot reports
    byzantine: jax.Array  # [s] float32: 1 where the slot's client is Byzantine
    segment: jax.Array  # [s] float32: cluster id + 1 (0: none); zeros for one model


def _stack(changes, weights, batch, segment=None) -> Stacked:
    if batch is None or batch.slots is None or batch.cohort_size is None:
        raise ValueError("a robust aggregator keeps every slot's update: the round must pass "
                         "its CohortBatch to Cohorts.sums (batch=batch).")
    s, slots, real = batch.cohort_size, batch.slots, batch.real

    def place(values, dtype=None):
        values = values if dtype is None else values.astype(dtype)
        shape = (s,) + values.shape[1:]
        keep = real.reshape(real.shape + (1,) * (values.ndim - 1))
        return jnp.zeros(shape, values.dtype).at[slots].add(jnp.where(keep, values, 0))

    reports = (weights > 0).astype(jnp.float32)
    segment = (jnp.zeros_like(reports) if segment is None
               else jnp.where(weights > 0, segment + 1, 0).astype(jnp.float32))
    return Stacked(jax.tree.map(place, changes), place(reports), jnp.zeros((s,), jnp.float32),
                   place(segment))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RobustSum:
    """A robust rule: a state's `aggregation` under `with_aggregator`."""

    state: Any  # the aggregator's state (per cluster: leaves [k, ...])
    byzantine: jax.Array  # [m] bool: the Byzantine clients
    aggregator: Aggregator = dataclasses.field(metadata={"static": True})
    attack: Any = dataclasses.field(default=None, metadata={"static": True})
    # With attack a tuple of attacks (None: honest), which one: an int32 scalar (traced in
    # a sweep whose attack is a vmapped axis; `ops.attacks.one_of`).
    attack_index: Any = None

    def sums(self, changes, weights, batch=None):
        stacked = _stack(changes, weights, batch)
        return stacked._replace(byzantine=self._byzantine_slots(batch))

    def cluster_sums(self, changes, segment, num_clusters: int, weights, batch=None):
        stacked = _stack(changes, weights, batch, segment)
        return stacked._replace(byzantine=self._byzantine_slots(batch))

    def _byzantine_slots(self, batch):
        flags = (self.byzantine[batch.ids] & batch.real).astype(jnp.float32)
        return jnp.zeros((batch.cohort_size,), jnp.float32).at[batch.slots].add(flags)

    def _attacked(self, sums: Stacked, key):
        reports = sums.reports > 0
        byzantine = (sums.byzantine > 0) & reports
        updates = sums.updates
        if isinstance(self.attack, tuple):
            updates = switch(OneOf(self.attack, self.attack_index), updates, byzantine, key,
                             mask=reports)
        elif self.attack is not None and not isinstance(self.attack, LabelFlip):
            updates = self.attack(updates, byzantine, key, mask=reports)
        return updates, reports, {"byzantine_reports": jnp.sum(byzantine).astype(jnp.float32)}

    def label_flipped(self) -> jax.Array:
        """[m] bool: the clients whose labels the attack flips (Byzantine, under label_flip)."""
        if isinstance(self.attack, LabelFlip):
            return self.byzantine
        at = [i for i, a in enumerate(self.attack) if isinstance(a, LabelFlip)]
        return self.byzantine & jnp.any(self.attack_index == jnp.asarray(at, jnp.int32))

    def divisor(self, sums: Stacked, expected: float | None):
        """The clients the rule's aggregate stands for: the reporting ones."""
        return jnp.sum(sums.reports)

    def mean(self, sums: Stacked, base, key, expected: float):
        key_attack, key_rule = jax.random.split(jax.random.fold_in(key, ROBUST_STREAM))
        updates, reports, metrics = self._attacked(sums, key_attack)
        update, state = self.aggregator.aggregate(updates, reports, key_rule, self.state)
        params = jax.tree.map(lambda b, u: b + u.astype(b.dtype), base, update)
        return params, dataclasses.replace(self, state=state), metrics

    def cluster_means(self, sums: Stacked, base, key, expected: float):
        key_attack, key_rule = jax.random.split(jax.random.fold_in(key, ROBUST_STREAM))
        updates, reports, metrics = self._attacked(sums, key_attack)
        k = jax.tree.leaves(base)[0].shape[0]

        def one(j, state, key):  # cluster j's reporting slots only
            mask = reports & (sums.segment == j + 1)
            return self.aggregator.aggregate(updates, mask, key, state)

        update, state = jax.vmap(one)(jnp.arange(k), self.state, jax.random.split(key_rule, k))
        params = jax.tree.map(lambda b, u: b + u.astype(b.dtype), base, update)
        return params, dataclasses.replace(self, state=state), metrics


def with_flipped_labels(data, flags: jax.Array, num_classes: int) -> FederatedData:
    """The clients with labels y ← C − 1 − y where `flags` ([m] bool) is set; a source that
    gathers its rows (views) is gathered whole first (`materialize`: O(m) memory)."""
    if not isinstance(data, FederatedData):
        if not is_client_source(data):
            raise ValueError("attack label_flip needs a round whose data are the clients "
                             f"(FederatedData or views); got {type(data).__name__}.")
        data = data.materialize()
    return data.replace(y=flip_labels(data.y, num_classes, flags))


def _model_like(state):
    """(the summed changes' shape, whether one model per cluster)."""
    if "cluster_params" in state._fields:
        return state.cluster_params, True
    if "control" in state._fields:  # SCAFFOLD: the model and its control variate
        return (state.params, state.control), False
    return state.params, False


def with_aggregator(algorithm: Algorithm, aggregator, *, byzantine=0, attack=None) -> Algorithm:
    """The algorithm with a robust aggregation rule, and optionally Byzantine clients.

    Args:
      algorithm: one whose state has an `aggregation` field (FedAvg and the FedOpt
        family, FedProx, FedNova, SCAFFOLD, Ditto's global model, IFCA option "model" and
        HypCluster per cluster); others are refused at `init` in one line.
      aggregator: an `ops.robust.Aggregator` (e.g. `robust.trimmed_mean(f=2)`), or a
        sequence of pre-aggregations ending in one (`robust.chain`'d here: e.g.
        `[robust.bucketing(bucket_size=2), robust.krum(f=1)]`).
      byzantine: how many of the m clients are Byzantine (an int, or an integer scalar
        array that may be traced: a sweep's Byzantine count as a vmapped axis), or which
        share of them (a float in [0, 1): ⌊share·m⌋), drawn once at init from its key
        (`ops.attacks.byzantine_clients`: for one key, a larger count keeps the clients
        of a smaller one).
      attack: an `ops.attacks` attack (e.g. `attacks.a_little_is_enough()`), what the
        Byzantine reporting clients send each round; `attacks.label_flip(C)`: they train
        on labels y ← C − 1 − y (their rows' labels flipped before every round, the data
        gathered whole where it is views) and send that honest update;
        `attacks.one_of(attacks, index)`: the one its (possibly traced) index picks,
        each round by `lax.switch`; None: they behave honestly (a defence measured on
        heterogeneous data alone).

    Returns:
      The algorithm; its rounds also report `byzantine_reports` (the Byzantine clients
      among the round's reporting ones).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_aggregator
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops import attacks, robust
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_aggregator(fedavg(linear_regression(3), sgd(0.1, steps=5)),
      ...                       robust.coordinate_median(), byzantine=2,
      ...                       attack=attacks.sign_flip(scale=10.0))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> int(metrics["byzantine_reports"])
      2
    """
    if isinstance(aggregator, (list, tuple)) and not isinstance(aggregator, Aggregator):
        aggregator = chain(*aggregator)
    if not isinstance(aggregator, Aggregator):
        raise ValueError("with_aggregator takes an ops.robust Aggregator (or a list of "
                         f"pre-aggregations ending in one); got {aggregator!r}.")
    counted = isinstance(byzantine, jax.Array) and not isinstance(byzantine, bool)
    if counted and (byzantine.shape or not jnp.issubdtype(byzantine.dtype, jnp.integer)):
        raise ValueError("byzantine as an array must be an integer scalar (a count of "
                         f"clients); got {byzantine.dtype}{list(byzantine.shape)}.")
    if not counted and (isinstance(byzantine, bool) or not isinstance(byzantine, (int, float))
                        or not (byzantine >= 0
                                and (isinstance(byzantine, int) or byzantine < 1))):
        raise ValueError("byzantine must be a number of clients (an int >= 0) or a share in "
                         f"[0, 1); got {byzantine!r}.")
    if attack is not None and not (callable(attack) or isinstance(attack, OneOf | LabelFlip)):
        raise ValueError(f"attack must be None or an ops.attacks attack; got {attack!r}.")
    if attack is not None and not counted and byzantine == 0:
        raise ValueError("an attack needs Byzantine clients: give byzantine > 0.")
    chosen, index = (attack.attacks, attack.index) if isinstance(attack, OneOf) else (attack,
                                                                                      None)
    flips = [a for a in (chosen if isinstance(chosen, tuple) else (chosen,))
             if isinstance(a, LabelFlip)]

    def init(key, data):
        state = algorithm.init(key, data)
        check_no_rule(state, "with_aggregator", "the clients' model changes")
        m = data.num_clients
        count = (byzantine if counted or isinstance(byzantine, int)
                 else int(byzantine * m))
        if not counted and count > m:
            raise ValueError(f"byzantine={byzantine} exceeds the {m} clients.")
        flags = byzantine_clients(jax.random.fold_in(key, BYZANTINE_STREAM), m, count)
        like, per_cluster = _model_like(state)
        rule_state = (jax.vmap(aggregator.init)(like) if per_cluster else aggregator.init(like))
        return state._replace(aggregation=RobustSum(rule_state, flags, aggregator, chosen,
                                                    index))

    if not flips:
        return algorithm._replace(init=init)

    def round_(state, data, key):  # the Byzantine clients train on flipped labels
        flags = state.aggregation.label_flipped()
        return algorithm.round(state, with_flipped_labels(data, flags, flips[0].num_classes),
                               key)

    return algorithm._replace(init=init, round=round_)
