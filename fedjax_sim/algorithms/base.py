"""An algorithm is a NamedTuple of pure functions, like optax's GradientTransformation.

This module also holds what every factory shares, so that a factory is its own
maths: the checks of the settings every algorithm takes (`participation`,
`weighting`) and the round's cohort draw, both in `Cohorts`, the weighted means over a
cohort, and the combinators that wrap a whole algorithm (`with_restarts`,
`with_seeds`, `with_grid`, `with_server_optimizer`, `with_systems`). How a client trains is
`training.ClientTraining`; how a round is executed (chunks, kernel forms) is the
executor's (`fedjax_sim.execution`) and appears in no factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.data.federated import copies_axes
from fedjax_sim.models.core import Model, check_model_data
from fedjax_sim.ops import (
    divide_segments,
    mean_or_keep,
    sample_cohort,
    segment_totals,
    weighted_sum,
)
from fedjax_sim.systems import Systems, systems_of
from fedjax_sim.systems import attach as attach_systems

State = Any
NOT_PER_CLIENT = -1


def no_client_axes(state):
    """Every state leaf is shared (replicated over devices)."""
    return jax.tree.map(lambda _: NOT_PER_CLIENT, state)


class Algorithm(NamedTuple):
    """init(key, data) -> state; round(state, data, key) -> (state, metrics);
    evaluate(state, data) -> per-client metrics.

    `round` is one communication round: pure and jit-able. Its metrics describe
    the round itself and never share a name with an evaluation's: every training
    algorithm reports `cohort_loss`, the mean loss of the round's cohort at the
    models it received (before local training). `evaluate` returns a
    dict with `client_loss` [m], `assignment` [m] (the cluster model each
    client uses, -1 where the notion does not apply), `client_weight` [m]
    (its weight in averages over clients: 0 for a client without data), and
    `client_accuracy` [m] for classification models.

    `client_axes(state)` says, for every state leaf, which axis is the client
    axis (NOT_PER_CLIENT for shared leaves): devices shard per-client state
    by this declaration, never by guessing from shapes.
    """

    init: Callable[..., State]
    round: Callable[..., tuple[State, dict]]
    evaluate: Callable[..., dict]
    client_axes: Callable[[State], Any] = no_client_axes


def per_client_fields(*names: str) -> Callable[[State], Any]:
    """client_axes for a NamedTuple state whose fields `names` have the client axis first."""

    def client_axes(state):
        return type(state)(*(
            jax.tree.map(lambda _, axis=0 if field in names else NOT_PER_CLIENT: axis, value)
            for field, value in zip(state._fields, state, strict=True)
        ))

    return client_axes


def cohort_size(num_clients: int, participation: float) -> int:
    """Clients per round for a participation fraction: participation · m rounded to the
    nearest integer (Python's `round`: a half goes to the even neighbour), at least 1."""
    return max(1, int(round(participation * num_clients)))


def check_fraction(name: str, value: float) -> None:
    if not (0.0 < float(value) <= 1.0):
        raise ValueError(f"{name} must be in (0, 1]; got {value!r}.")


def check_steps(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}; got {value!r}.")


WEIGHTINGS = ("uniform", "examples")


def check_participation(participation) -> None:
    """ValueError unless participation, the fraction of clients in a round, is in (0, 1]."""
    check_fraction("participation", participation)


def check_weighting(weighting) -> None:
    """ValueError unless weighting is "uniform" (every client alike) or "examples" (∝ rows)."""
    check_choice("weighting", weighting, WEIGHTINGS)


def draw_cohort(key, data, participation: float, *, weights=None, round=None):  # noqa: A002
    """The round's cohort: `cohort_size(m, participation)` of the m clients, drawn uniformly
    without replacement (every client, in order, at participation 1), or i.i.d. with
    replacement ∝ `weights` ([m]); a key per slot (`ops.sample_cohort`). The data's
    `Systems` (`with_systems`) decide who is available (in `round`, for a day/night
    cycle), reports and straggles."""
    m = data.num_clients
    return sample_cohort(key, m, cohort_size(m, participation), weights=weights,
                         systems=systems_of(data), round_=round)


def check_inputs(model: Model, params, data) -> None:
    """Shape checks of a model against the client data (trace time, shapes only)."""
    check_model_data(model, params, data)


def check_same_clients(what: str, kept, data) -> None:
    """ValueError naming both client counts when `data` holds another number of clients
    than the state's per-client values `kept` (a pytree of [m, ...] leaves: personal
    models, fixed cluster assignments), which are evaluated client by client (trace
    time, shapes only).

    what: those values in words, e.g. "Ditto's personal models".
    """
    count = jax.tree.leaves(kept)[0].shape[0]
    if count != data.num_clients:
        raise ValueError(
            f"{what} are per client: the state holds {count} clients, the evaluated data "
            f"{data.num_clients}; evaluate on the clients it was trained on (their test "
            "rows, in the same order).")


def num_params(params) -> int:
    """Floats in one model (static)."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def mean_over(values, weights):
    """Σ_i w_i values_i / Σ_i w_i over [s]; 0 when every weight is 0."""
    w = weights.astype(values.dtype)
    # One reduction for both sums: on CPU each [s] reduction is a chain of kernels.
    total, weight = jnp.sum(jnp.stack([jnp.where(w > 0, values, 0.0) * w, w]), axis=1)
    return total / jnp.maximum(weight, 1e-30)


def participants(data, active) -> dict:
    """The round metric `participants` (how many of the cohort's slots held data and
    reported) where the data carry `Systems` (`with_systems`); {} otherwise, so a round
    without them reports what it always did."""
    if systems_of(data).trivial:
        return {}
    return {"participants": jnp.sum(active).astype(jnp.float32)}


class Cohorts(NamedTuple):
    """Who takes part in a round, and how much each counts: the bookkeeping every
    algorithm shares, written once so that a round reads as its paper's pseudocode.

    participation: the fraction of the m clients drawn each round, in (0, 1].
    weighting: "uniform" (p_i = 1) or "examples" (p_i = n_i) in the cohort's means;
      None for an algorithm that weighs clients its own way.

    Build it with `cohorts(participation, weighting)`, which checks both settings.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms.base import cohorts
      >>> from fedjax_sim.data import linear_mixture
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> cohort = cohorts(0.5, "uniform").draw(jax.random.key(1), data, round=0)
      >>> cohort.ids.shape
      (4,)
      >>> cohorts(1.5)
      Traceback (most recent call last):
      ...
      ValueError: participation must be in (0, 1]; got 1.5.
    """

    participation: float
    weighting: str | None = None

    def draw(self, key, data, *, round, weights=None):  # noqa: A002
        """The round's cohort (`draw_cohort`): uniform without replacement, or i.i.d. ∝
        `weights` ([m]); `round` is the state's round counter (the systems' clock)."""
        return draw_cohort(key, data, self.participation, weights=weights, round=round)

    def weights(self, active, num_examples):
        """[c] p_i of a batch's slots in the cohort's mean (`client_weights`): 0 where inactive."""
        return client_weights(active, num_examples, self.weighting)

    @staticmethod
    def participants(data, active) -> dict:
        """The round metric `participants` where the data carry `Systems`; {} otherwise."""
        return participants(data, active)

    # The server's aggregation of the cohort's updates. `aggregation` is the state's field
    # of that name: () for the plain weighted mean (the paper's rule, unchanged), or a rule
    # a combinator put there (`with_dp`'s clipped, noised sum), which then decides both
    # halves. The first half adds over clients (a chunked round adds chunks); the second
    # runs once per round.

    @staticmethod
    def sums(aggregation, trained, start, weights, batch=None):
        """What a batch of slots adds to the server's aggregate: (Σ_i w_i θ̃_i, Σ_i w_i).

        trained: the slots' trained values (leaves [c, ...]); start: what each started
          from (broadcastable to trained; None: `trained` are already changes Δ_i);
          weights: [c] `Cohorts.weights` (0 for a slot that does not count); batch: the
          `CohortBatch` (a rule that keeps every update, a robust aggregator, places it
          by the batch's slots).
        A rule sums its own view of the changes θ̃_i − start_i instead.
        """
        if is_plain(aggregation):
            return weighted_sum(trained, weights), jnp.sum(weights)
        return aggregation.sums(_changes(trained, start), weights, batch)

    @staticmethod
    def mean(aggregation, sums, base, key, cohort, data):
        """The round's aggregate from the summed `sums`: (new value, new aggregation, metrics).

        Plain: Σ_i w_i θ̃_i / Σ_i w_i, or `base` when nobody counted (a model nobody
        trained). A rule returns base + its estimate of the mean change (with `start` None
        in `sums`, pass zeros as `base`). `key` is the round's key (a rule folds in a stream
        of its own); `cohort` and `data` tell it the cohort's expected size.
        """
        if is_plain(aggregation):
            total, weight = sums
            return mean_or_keep(total, weight, base), aggregation, {}
        return aggregation.mean(sums, base, key, expected_clients(cohort, data))

    @staticmethod
    def cluster_sums(aggregation, trained, start, segment, num_clusters: int, weights,
                     batch=None):
        """Per cluster j: (Σ_{i: segment_i = j} w_i θ̃_i [k, ...], Σ w_i [k]); ids outside
        [0, k) are dropped. start: each slot's starting value (its cluster's model)."""
        if is_plain(aggregation):
            return segment_totals(trained, segment, num_clusters, weights)
        return aggregation.cluster_sums(_changes(trained, start), segment, num_clusters,
                                        weights, batch)

    @staticmethod
    def cluster_means(aggregation, sums, base, key, cohort, data):
        """Per cluster: (new values [k, ...], new aggregation, metrics). Plain: each cluster's
        weighted mean, or its `base` (leaves [k, ...]) when nobody counted in it."""
        if is_plain(aggregation):
            totals, cluster_weight = sums
            return divide_segments(totals, cluster_weight, fallback=base), aggregation, {}
        return aggregation.cluster_means(sums, base, key, expected_clients(cohort, data))


def is_plain(aggregation) -> bool:
    """Whether a state's `aggregation` is the plain weighted mean (an empty tuple)."""
    return isinstance(aggregation, tuple) and not aggregation


def check_no_rule(state, combinator: str, uses: str) -> None:
    """ValueError in one line unless `state` takes a server rule and has none yet (its
    `aggregation` field holds ()): for combinators that put one there (`with_dp`,
    `with_aggregator`). uses: what the rule would give the server, in words."""
    if "aggregation" not in getattr(state, "_fields", ()):
        raise ValueError(
            f"{combinator} needs an algorithm whose server averages the clients' model "
            "changes (FedAvg, FedOpt, FedProx, FedNova, SCAFFOLD, Ditto, IFCA, HypCluster); "
            f"{type(state).__name__} has no `aggregation`: its server uses more than {uses} "
            "(e.g. the clients' losses, as DRFA/DRFLM's λ, AFL and q-FFL do).")
    if not is_plain(state.aggregation):
        raise ValueError(f"{combinator}: the algorithm's aggregation is already "
                         f"{type(state.aggregation).__name__} (one aggregation rule per "
                         "algorithm).")


def _changes(trained, start):
    if start is None:
        return trained
    return jax.tree.map(lambda t, s: t - s, trained, start)


def expected_clients(cohort, data) -> float | None:
    """The number of clients a round's cohort is expected to hold (static).

    Its s slots (a fixed-size cohort), or, where the data's `Systems` make each client
    available with probability a (`with_systems`; Poisson sampling when the s slots are
    a cap above a·m), min(s, a·m). None where there is no single expectation (an
    availability per client, a day/night cycle): a rule that needs one is then given it.
    """
    systems = systems_of(data)
    size = float(cohort.size)
    if systems.always_available:
        return size
    if isinstance(systems.availability, tuple) or systems.period:
        return None
    return min(size, systems.availability * data.num_clients)


def cohorts(participation: float, weighting: str | None = None) -> Cohorts:
    """`Cohorts(participation, weighting)` after `check_participation` and, unless None,
    `check_weighting` (ValueError naming the setting)."""
    check_participation(participation)
    if weighting is not None:
        check_weighting(weighting)
    return Cohorts(participation, weighting)


def client_weights(batch_active, num_examples, weighting: str):
    """[c] weights of a batch's clients in an average: 0 for inactive slots."""
    base = num_examples.astype(jnp.float32) if weighting == "examples" else 1.0
    return jnp.where(batch_active, base, 0.0).astype(jnp.float32)


def broadcast_to_clients(params, count: int):
    """One model copied to `count` clients (leaves [count, ...])."""
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (count,) + p.shape), params)


def _copies(algorithm: Algorithm, count: int, data_axis) -> Algorithm:
    """`count` independent copies as one vmap; copy r's keys are fold_in(key, r)."""
    ids = jnp.arange(count)

    def fold(key):
        return jax.vmap(lambda r: jax.random.fold_in(key, r))(ids)

    def axes(data):  # a shared base (stacked views) is not mapped
        return data_axis(data) if callable(data_axis) else data_axis

    def init(key, data):
        return jax.vmap(algorithm.init, in_axes=(0, axes(data)))(fold(key), data)

    def round_(state, data, key):
        return jax.vmap(algorithm.round, in_axes=(0, axes(data), 0))(state, data, fold(key))

    def evaluate(state, data):
        return jax.vmap(algorithm.evaluate, in_axes=(0, axes(data)))(state, data)

    return Algorithm(init, round_, evaluate, _behind_one_axis(algorithm.client_axes))


def _behind_one_axis(client_axes):
    """client_axes of a state stacked on one more leading axis: each client axis one later
    (the inner declaration reads only the state's structure)."""

    def shifted(state):
        return jax.tree.map(lambda a: a + 1 if a != NOT_PER_CLIENT else a, client_axes(state))

    return shifted


def with_restarts(algorithm: Algorithm, restarts: int) -> Algorithm:
    """Runs `restarts` independent copies of an algorithm at once (vmap).

    Every copy shares the data; copy r's keys are fold_in(key, r). The state,
    round metrics and evaluation outputs gain a leading [restarts] axis.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import ifca, sgd, with_restarts
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_restarts(ifca(linear_regression(3), sgd(0.1), num_clusters=2), 4)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape  # [restarts, k, d]
      (4, 2, 3)
      >>> jax.jit(alg.evaluate)(state, data)["client_loss"].shape  # [restarts, m]
      (4, 8)
    """
    if not isinstance(restarts, int) or restarts < 1:
        raise ValueError(f"restarts must be >= 1; got {restarts}.")
    return _copies(algorithm, restarts, None)


def with_seeds(algorithm: Algorithm, seeds: int, *, shared_data: bool = False) -> Algorithm:
    """Runs an algorithm on `seeds` seeds at once (vmap), like `with_restarts`.

    Seed s's keys are fold_in(key, s) in every call: init(key) of seed s is
    the plain init(fold_in(key, s)) and round(key) of seed s the plain
    round(fold_in(key, s)). Through `scan_rounds`/`simulate.run` round t of
    seed s therefore gets fold_in(fold_in(round_key, t), s), not what a
    plain run with key fold_in(key, s) uses (there the seed is folded in
    first); to reproduce seed s alone, pass those per-call keys. Each seed has its own data (a data
    seed, a split): the data's leaves carry a leading [seeds] axis, unless
    shared_data=True. Several algorithms run with the same key and data get
    the same data and the same initialisation keys seed by seed, which is what
    a paired comparison needs.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_seeds
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> def one_seed(seed):  # one data seed of the mixture
      ...     key = jax.random.key(seed)
      ...     return linear_mixture(key, k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> data = jax.tree.map(lambda *a: jnp.stack(a), *map(one_seed, range(3)))
      >>> data.x.shape  # [seeds, m, n, d]
      (3, 8, 10, 3)
      >>> alg = with_seeds(fedavg(linear_regression(3), sgd(0.1, steps=5)), 3)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, alg.evaluate(state, data)["client_loss"].shape
      ((3, 3), (3, 8))
      >>> shared = with_seeds(fedavg(linear_regression(3), sgd(0.1)), 3, shared_data=True)
      >>> shared.init(jax.random.key(1), one_seed(0)).params.shape
      (3, 3)
    """
    if not isinstance(seeds, int) or seeds < 1:
        raise ValueError(f"seeds must be >= 1; got {seeds}.")
    return _copies(algorithm, seeds, None if shared_data else copies_axes)


def with_grid(build_at: Callable[[dict], Algorithm], points) -> Algorithm:
    """An algorithm at every point of a hyper-parameter grid at once (one vmap).

    A learning rate, μ, q or λ step is a traced input of its factory (DESIGN's
    sweepable floats), so the points of a grid are one more vmapped axis of one
    compiled program rather than one program each. Every point gets the same keys
    and the same data: the points differ by their values alone, so choosing among
    them compares like with like. The state, round metrics and evaluation outputs
    gain a leading [G] axis.

    Args:
      build_at: {name: scalar} -> the algorithm at that point (called with traced
        scalars inside the returned functions, and once with the first point's
        floats to read the state's structure).
      points: name -> [G] values, the grid's points spelled out (a product of
        grids is the caller's).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_grid
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_grid(lambda p: fedavg(linear_regression(3), sgd(p["lr"], steps=2)),
      ...                 {"lr": [0.01, 0.1, 0.3]})
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, alg.evaluate(state, data)["client_loss"].shape  # [G, ...]
      ((3, 3), (3, 8))
    """
    names = list(points)
    grid = {k: jnp.asarray(points[k], jnp.float32) for k in names}
    shapes = {v.shape for v in grid.values()}
    if not names or len(shapes) != 1 or len(next(iter(shapes))) != 1 or not min(shapes)[0]:
        raise ValueError("with_grid takes name -> [G] values, G >= 1 and the same G for "
                         f"every name; got shapes {({k: v.shape for k, v in grid.items()})}.")
    first = build_at({k: float(points[k][0]) for k in names})

    def init(key, data):
        return jax.vmap(lambda p: build_at(p).init(key, data))(grid)

    def round_(state, data, key):
        return jax.vmap(lambda st, p: build_at(p).round(st, data, key))(state, grid)

    def evaluate(state, data):
        return jax.vmap(lambda st, p: build_at(p).evaluate(st, data))(state, grid)

    return Algorithm(init, round_, evaluate, _behind_one_axis(first.client_axes))


SERVER_MODEL_FIELDS = ("params", "cluster_params")


def _server_field(state) -> str:
    for name in SERVER_MODEL_FIELDS:
        if name in getattr(state, "_fields", ()):
            if "server_state" not in state._fields:
                break
            return name
    raise ValueError(
        "with_server_optimizer needs a state with a server model (a field `params`, or "
        "`cluster_params` with one model per cluster) and a `server_state` field; "
        f"{type(state).__name__} has {getattr(state, '_fields', ())}.")


def _moved(delta) -> jax.Array:
    """Whether a server model changed in the round (some client holding data trained)."""
    return jnp.any(jnp.stack([jnp.any(d != 0) for d in jax.tree.leaves(delta)]))


def with_systems(algorithm: Algorithm, systems) -> Algorithm:
    """The algorithm over clients that behave as `systems` says (`fedjax_sim.systems`).

    Every round's cohort is drawn among the clients available that round; a
    chosen client may drop out (its update never arrives) or straggle (a
    uniform 1..τ_i − 1 of its local steps; kept or dropped by the policy; by
    default a fixed share of the cohort every round, the FedProx code's). All of
    it is masks inside the one compiled round, drawn from the round's keys, so
    two methods of a comparison wrapped with the same `Systems` see the same
    clients available, dropping and straggling. Evaluation is unchanged.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_systems
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.systems import Systems
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_systems(fedavg(linear_regression(3), sgd(0.1, steps=5)),
      ...                    Systems(availability=0.5, stragglers=0.5, straggler_policy="drop"))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> int(state.round)
      1
    """
    if not isinstance(systems, Systems):
        raise ValueError(f"with_systems takes a fedjax_sim.systems.Systems; got {systems!r}.")

    def round_(state, data, key):
        return algorithm.round(state, attach_systems(data, systems), key)

    return algorithm._replace(round=round_)


def with_server_optimizer(algorithm: Algorithm, optimizer, server_lr=None) -> Algorithm:
    """FedOpt around an algorithm: the server steps on the round's change of its model.

    Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (algorithms/server.py):
    the round's new server model is read as x + Δ (Δ the clients' mean change), and
    the server takes x_{t+1} = ServerOpt(x_t, −Δ_t) instead. A round in which the model
    did not change (no client holding data took part) changes neither the model nor
    the optimizer state. With one model per cluster (`cluster_params`, leaves
    [k, ...]) every cluster has its own optimizer state and a cluster nobody picked
    keeps both.

    Args:
      algorithm: its state must have a server model field (`params`, or
        `cluster_params`) and a `server_state` field (fedavg, fedprox, ifca, drfa, …).
      optimizer: "sgd", "sgdm" (FedAvgM), "adam", "yogi", "adagrad" (the paper's
        Algorithm 2) or an optax transformation.
      server_lr: η of a named optimizer (None: its default); may be traced.

    Examples:
      >>> import jax
      >>> import optax
      >>> from fedjax_sim.algorithms import fedavg, ifca, sgd, with_server_optimizer
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> fedadam = with_server_optimizer(fedavg(linear_regression(3), sgd(0.1)), "adam",
      ...                                 server_lr=0.01)
      >>> state = fedadam.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(fedadam.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

      An optax transformation works as well, and a clustered algorithm gets one
      optimizer state per cluster:

      >>> clustered = with_server_optimizer(
      ...     ifca(linear_regression(3), sgd(0.1), num_clusters=2), optax.sgd(1.0, momentum=0.9))
      >>> state = clustered.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(clustered.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape
      (2, 3)

    References:
      Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
      Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan, "Adaptive Federated
      Optimization", ICLR 2021, https://arxiv.org/abs/2003.00295.
    """
    server = make_server_optimizer(optimizer, server_lr)
    if server is None:
        raise ValueError("with_server_optimizer needs an optimizer (a name or an optax "
                         "transformation).")

    def init(key, data):
        state = algorithm.init(key, data)
        field = _server_field(state)
        if field == "cluster_params" and jax.tree.leaves(getattr(state, "shared_params", {})):
            raise ValueError("with_server_optimizer steps each cluster's own model; the trunk "
                             "every cluster shares (weight sharing) has no server step.")
        params = getattr(state, field)
        init_one = server.init if field == "params" else jax.vmap(server.init)
        return state._replace(server_state=init_one(params))

    def round_(state, data, key):
        new, metrics = algorithm.round(state, data, key)
        field = _server_field(state)
        old = getattr(state, field)
        delta = optax.tree.sub(getattr(new, field), old)
        step = functools.partial(apply_server_update, server)
        if field == "params":
            params, server_state = step(old, state.server_state, delta, _moved(delta))
        else:
            params, server_state = jax.vmap(step)(old, state.server_state, delta,
                                                  jax.vmap(_moved)(delta))
        return new._replace(**{field: params, "server_state": server_state}), metrics

    return algorithm._replace(init=init, round=round_)
