"""IFCA: the Iterative Federated Clustering Algorithm.

Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran. "An Efficient
Framework for Clustered Federated Learning". NeurIPS 2020, arXiv:2006.04088.
See docs/protocols.md#ifca.

One round (the paper's Algorithm 1):

    S    ← round(participation · m) clients (at least 1), uniformly without replacement
    each i ∈ S:  ĵ_i ← argmin_j F_i(θ_j)           (a pinned client keeps its cluster)
    option I  (gradient averaging):
                 θ_j ← θ_j − (γ/m) Σ_{i∈S: ĵ_i=j} ∇F_i(θ_j)
    option II (model averaging):
                 θ̃_i ← LocalUpdate(θ_ĵi)           (`training`: τ steps)
                 θ_j ← Σ_{i: ĵ_i=j} p_i θ̃_i / Σ_{i: ĵ_i=j} p_i   (an empty cluster keeps θ_j)

m counts the clients holding data (the official code's γ/m; `divide_by="cohort"`
divides by the cohort's instead), and p_i is 1 or n_i (`weighting`). A client
is pinned to its cluster once its assignment has been stable for
`stable_rounds` rounds (the paper's communication reduction: it downloads one
model, not k), and while the state says so (`pinned_until`: a warm start, a
fixed assignment).

The variants are combinators over this round, each changing only how the
state starts or how it is evaluated:

- `with_weight_sharing`: the trunk of a split model is shared by every
  cluster and averaged over every client (FedAvg on the trunk); only the k
  heads are clustered;
- `with_frozen_trunk`: a given (pretrained) trunk in every cluster that no
  client trains; only the heads are clustered (the FEMNIST run);
- `with_warm_start`: k random groups of equal size train for some rounds
  before clients choose by loss;
- `with_fixed_assignment`: clients never re-assign (one-shot clustering);
- `with_balanced_init`: the official code's search for an initialisation
  every cluster is picked by;
- `with_initial_params`: given cluster models to start from.

A client without data (num_examples 0) takes no part: it is not assigned, has
no weight in any average and is not counted in cluster sizes or the mean loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    Cohorts,
    broadcast_to_clients,
    check_choice,
    check_inputs,
    check_same_clients,
    check_steps,
    cohorts,
    is_plain,
    num_params,
    per_client_fields,
)
from fedjax_sim.algorithms.training import ClientTraining, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.execution import plan_of
from fedjax_sim.models.core import Model, client_accuracy, combine, partition
from fedjax_sim.ops import (
    assign_clusters,
    cluster_gradient_sums,
    cluster_losses,
    cohort_sums,
    map_client_chunks,
    mean_or_keep,
    put,
    sample_cohort,
    take,
    taking_part,
    weighted_sum,
)
from fedjax_sim.ops.cohort import Cohort

OPTIONS = ("gradient", "model")
DIVISORS = ("m", "cohort")
ALWAYS = jnp.iinfo(jnp.int32).max  # pinned_until for an assignment that never changes


class IFCAState(NamedTuple):
    cluster_params: object  # pytree, leaves [k, ...]: each cluster's own part of the model
    #                         (the whole model; the heads with a shared or frozen trunk)
    shared_params: object  # the trunk every client trains, averaged over all ({}: none)
    frozen_params: object  # the trunk no client trains (a pretrained one; {}: none)
    opt_state: object  # option I: the training optimizer's state on cluster_params; ()
    assignment: jax.Array  # [m] int32, each client's most recent cluster (set in the rounds it
    #                        takes part with data; a warm start's groups from init); -1 while
    #                        it has none (cluster-identity accuracy under partial participation
    #                        is taken over the clients >= 0); None where the execution plan
    #                        keeps no per-client state (`Plan.keep_client_state`)
    stable: jax.Array  # [m] int32, consecutive rounds with an unchanged assignment (or None)
    pinned_until: jax.Array  # int32: every client keeps its cluster while round < this
    round: jax.Array  # int32, rounds done
    server_state: object = ()  # `with_server_optimizer`'s, one per cluster; () without one
    aggregation: object = ()  # the server's rule (`with_dp`'s); (): each cluster's mean


def _trunk(state: IFCAState):
    """The trunk the clusters' heads sit on ({} when every cluster holds a whole model)."""
    return state.frozen_params if jax.tree.leaves(state.frozen_params) else state.shared_params


def _net(model: Model, state: IFCAState) -> Model:
    """The model the state's cluster params are of: split (heads on a trunk) or whole."""
    return model if jax.tree.leaves(_trunk(state)) else model.unsplit()


def evaluate_clusters(model: Model, cluster_params, data: FederatedData, shared=None,
                      assignment=None) -> dict:
    """Per-client loss (and accuracy) with each client's cluster model.

    By default each client uses the model with the lowest loss on `data`:
    the official IFCA evaluation, where each test client picks its argmin-loss
    model on its own test data (docs/protocols.md#ifca-evaluation). With `assignment` ([m]) the
    clients use those clusters instead (one-shot clustering's fixed ones).
    Clients without data get assignment -1 and weight 0. `shared`: the trunk
    the cluster params are heads of ({} or None: whole models).
    """
    shared = {} if shared is None else shared
    if assignment is not None:
        check_same_clients("The clients' cluster assignments", assignment, data)

    def evaluate_part(part) -> dict:
        part, given = part
        losses = cluster_losses(model, cluster_params, part, shared=shared)
        chosen = assign_clusters(losses) if given is None else jnp.maximum(given, 0)
        active = part.active()
        out = {
            "client_loss": jnp.take_along_axis(losses, chosen[:, None], axis=1)[:, 0],
            "assignment": jnp.where(active, chosen, -1),
            "client_weight": active.astype(jnp.float32),
        }
        if model.correct is not None:
            params = jax.tree.map(lambda p: p[chosen], cluster_params)
            out["client_accuracy"] = jax.vmap(
                lambda p, x, y, n: client_accuracy(model, combine(model, shared, p), x, y, n)
            )(params, part.x, part.y, part.num_examples)
        return out

    return map_client_chunks(evaluate_part, (data, assignment))


def _pinned(state: IFCAState, batch):
    """[c] whether each slot keeps its cluster: every slot while the state pins them all
    (`pinned_until`: a warm start, a fixed assignment), a stable one (`stable_rounds`)."""
    _, stable = batch.inputs
    # Broadcast here, per batch: a [cohort] array of the state's scalar would be per-client
    # memory (and [copies, cohort] under `with_restarts`) even where no client state is kept.
    pinned = jnp.broadcast_to(state.round < state.pinned_until, batch.real.shape)
    return pinned if stable is None else pinned | stable


def _choose(losses, batch, pinned):
    """ĵ_i = argmin_j F_i(θ_j); a pinned client keeps its cluster."""
    prev, _ = batch.inputs
    if prev is None:  # no client remembers a cluster (the plan keeps no client state)
        return assign_clusters(losses)
    return jnp.where(pinned, prev, assign_clusters(losses))


def _metric_sums(losses, assignment, batch, pinned) -> dict:
    """What the round metrics add up over a batch of slots (a chunk, or the whole cohort):
    the chosen losses and cluster sizes of the slots holding data, and the pinned slots.
    Counts are int32 (float32 counts are exact only up to 2**24 clients)."""
    k = losses.shape[1]
    chosen = jnp.take_along_axis(losses, jnp.maximum(assignment, 0)[:, None], axis=1)[:, 0]
    # A sum over clients of one-hot columns, not a segment sum (a scatter: a serial loop on
    # XLA:CPU); slots without data (and chunk padding) count in no cluster.
    in_cluster = batch.active[:, None] & (assignment[:, None] == jnp.arange(k))
    pinned = pinned & batch.real
    return {
        "loss": jnp.sum(jnp.where(batch.active, chosen, 0.0)),
        "counts": jnp.sum(in_cluster, axis=0, dtype=jnp.int32),
        "frozen_with_data": jnp.sum(batch.active & pinned).astype(jnp.int32),
        "frozen": jnp.sum(pinned).astype(jnp.int32),
    }


def _round_metrics(sums: dict, state: IFCAState) -> dict:
    """Mean chosen loss and cluster sizes over the cohort's clients with data; downlink floats
    (k·d to each cohort slot holding data, d to a pinned one; a slot without data gets nothing).
    """
    k = sums["counts"].shape[0]
    d = num_params(jax.tree.map(lambda p: p[0], state.cluster_params))
    d += num_params(state.shared_params) + num_params(state.frozen_params)
    with_data = jnp.sum(sums["counts"]).astype(jnp.float32)
    pinned = sums["frozen_with_data"].astype(jnp.float32)
    return {
        "cohort_loss": sums["loss"] / jnp.maximum(with_data, 1.0),
        "cluster_sizes": sums["counts"].astype(jnp.float32),
        "downlink_floats": pinned * d + (with_data - pinned) * (k * d),
        "frozen_clients": sums["frozen"],
    }, with_data


def _check(training, num_clusters, option, participation, weighting, divide_by,
           stable_rounds) -> Cohorts:
    """ValueError naming the first bad setting; the round's `Cohorts` otherwise."""
    check_training("ifca", training)
    if not isinstance(num_clusters, int) or isinstance(num_clusters, bool) or num_clusters < 1:
        raise ValueError(f"num_clusters (k) must be an integer >= 1; got {num_clusters!r}.")
    check_choice("option", option, OPTIONS)
    clients = cohorts(participation, weighting)
    check_choice("divide_by", divide_by, DIVISORS)
    if option == "gradient" and (training.steps != 1 or training.batch_size is not None):
        raise ValueError(
            "option 'gradient' (IFCA option I) takes one full-batch gradient per client: "
            "its training must have steps=1 and batch_size=None (its optimizer steps the "
            "cluster models); use option 'model' for local training.")
    if option == "model" and divide_by != "m":
        raise ValueError("divide_by applies to option 'gradient' only.")
    if stable_rounds is not None:
        check_steps("stable_rounds", stable_rounds)
    return clients


def ifca(model: Model, training: ClientTraining, *, num_clusters: int, option: str = "gradient",
         participation: float = 1.0, weighting: str = "uniform", divide_by: str = "m",
         stable_rounds: int | None = None) -> Algorithm:
    """Builds IFCA.

    Args:
      model: the model of every cluster.
      training: option "model": how each client trains (τ steps from its
        cluster's model); option "gradient": every client takes one full-batch
        gradient (steps=1, batch_size=None) and `training.optimizer` steps each
        cluster model on its clients' summed gradients over m (`sgd(γ)` is the
        paper's θ_j ← θ_j − γ/m Σ_i s_ij ∇F_i(θ_j)).
      num_clusters: k.
      option: "gradient" (option I) or "model" (option II).
      participation: fraction of clients sampled per round (uniformly,
        without replacement).
      weighting: option II cluster mean, "uniform" (the MNIST/CIFAR code) or
        "examples" (sample-weighted, the FEMNIST code); option I's sum is
        unweighted.
      divide_by: option I's divisor of a cluster's gradient sum: "m" (the
        paper's and the official code's γ/m, m = the clients holding data;
        with partial participation the step shrinks with the cohort) or
        "cohort" (the clients of this round's cohort holding data).
      stable_rounds: communication reduction; once a client's assignment has
        not changed for this many rounds it receives only its own cluster
        model (downlink d instead of k·d floats) and keeps that assignment.
        None disables it.

    Returns:
      Algorithm(init, round, evaluate) with state IFCAState.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import ifca, sgd, with_restarts
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_restarts(ifca(linear_regression(3), sgd(0.1), num_clusters=2), 3)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.cluster_params.shape, metrics["cluster_sizes"].shape  # [R, k, d], [R, k]
      ((3, 2, 3), (3, 2))
      >>> state.assignment.shape  # each client's cluster, per restart
      (3, 8)

    References:
      Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran, "An Efficient
      Framework for Clustered Federated Learning", NeurIPS 2020,
      https://arxiv.org/abs/2006.04088.
    """
    clients = _check(training, num_clusters, option, participation, weighting, divide_by,
                     stable_rounds)
    k = num_clusters
    whole = model.unsplit()
    # With a frozen trunk the local steps train the head on the trunk's features.
    head_model = (Model(model.init, model.head, model.example_loss, model.correct)
                  if model.is_split else None)

    def init(key, data: FederatedData) -> IFCAState:
        params = jax.vmap(whole.init)(jax.random.split(key, k))
        check_inputs(whole, jax.tree.map(lambda p: p[0], params), data)
        m = data.num_clients
        keep = plan_of(data).keep_client_state
        if not keep and (participation < 1.0 or stable_rounds is not None):
            raise ValueError(
                "an execution plan that keeps no per-client state needs IFCA at participation "
                "1 and no stable_rounds (their rounds read the clients' previous clusters).")
        return IFCAState(
            cluster_params=params, shared_params={}, frozen_params={},
            opt_state=(training.at_round(0).optimizer.init(params) if option == "gradient"
                       else ()),
            assignment=jnp.full((m,), -1, jnp.int32) if keep else None,
            stable=jnp.zeros((m,), jnp.int32) if keep else None,
            pinned_until=jnp.zeros((), jnp.int32), round=jnp.zeros((), jnp.int32))

    def gradient_step(state, batch):  # option I: s_i and ∇F_i(θ_ĵi), summed per cluster
        if not is_plain(state.aggregation):
            raise ValueError("with_dp on IFCA clips each client's change of its cluster's "
                             "model: it needs option 'model' (option 'gradient' sums "
                             "gradients into one step).")
        if jax.tree.leaves(_trunk(state)):
            raise ValueError("a shared or frozen trunk needs IFCA option 'model' (option "
                             "'gradient' averages whole models' gradients).")
        # A client without data has a zero gradient and no cluster: only chunk
        # padding needs weight 0 (without chunks the weights fold to a constant).
        pinned = _pinned(state, batch)
        losses, assignment, grad_sum = cluster_gradient_sums(
            whole, state.cluster_params, batch.data, lambda losses: _choose(losses, batch, pinned),
            batch.real.astype(jnp.float32))
        return grad_sum, (losses, assignment)

    def gradient_server(state, grad_sum, data, cohort, cohort_clients, key):
        # θ_j ← θ_j − (γ/m) Σ_i s_ij ∇F_i(θ_j); m and the cohort count clients holding data.
        if divide_by == "cohort" or cohort.everyone:
            divisor = cohort_clients
        else:
            divisor = jnp.sum(data.active())
        grads = jax.tree.map(lambda g: g / jnp.maximum(divisor, 1), grad_sum)
        opt = training.at_round(state.round).optimizer  # at the round's rate γ_t
        updates, opt_state = opt.update(grads, state.opt_state, state.cluster_params)
        return (optax.apply_updates(state.cluster_params, updates), state.shared_params,
                opt_state, state.aggregation, {})

    def model_step(state, batch):  # option II: θ̃_i = LocalUpdate(θ_ĵi, γ, τ), summed per cluster
        net, heads, shared, frozen = (_net(model, state), state.cluster_params,
                                      state.shared_params, state.frozen_params)
        training_t = training.at_round(state.round)  # the round's rate γ_t
        losses = cluster_losses(net, heads, batch.data, shared=_trunk(state))
        assignment = _choose(losses, batch, _pinned(state, batch))
        start = jax.tree.map(lambda p: p[jnp.maximum(assignment, 0)], heads)
        if jax.tree.leaves(frozen):  # the trunk's features once, then τ steps on the head alone
            features = jax.vmap(lambda x: net.features(frozen, x))(batch.data.x)
            trained, _, _ = training_t.update_clients(head_model, start,
                                                      batch.data.replace(x=features),
                                                      batch.keys, **batch.work())
            trunks = {}
        else:
            sharing = bool(jax.tree.leaves(shared))
            if sharing:
                start = combine(net, broadcast_to_clients(shared, assignment.shape[0]), start)
            trained, _, _ = training_t.update_clients(net, start, batch.data, batch.keys,
                                                      **batch.work())
            trunks, trained = partition(net, trained) if sharing else ({}, trained)
        weights = clients.weights(batch.active, batch.data.num_examples)
        segment = jnp.where(batch.active, assignment, k)  # id k is dropped
        if not is_plain(state.aggregation) and jax.tree.leaves(_trunk(state)):
            raise ValueError("with_dp on IFCA clips each client's change of its cluster's "
                             "whole model; a shared or frozen trunk is not supported.")
        sums = (clients.cluster_sums(state.aggregation, trained, start, segment, k, weights,
                                     batch),
                weighted_sum(trunks, weights), jnp.sum(weights))
        return sums, (losses, assignment)

    def model_server(state, sums, data, cohort, cohort_clients, key):
        # θ_j = Σ_i s_ij θ̃_i / Σ_i s_ij (an empty cluster keeps θ_j); FedAvg on a shared trunk.
        cluster_sums, trunk_total, weight = sums
        shared = mean_or_keep(trunk_total, weight, state.shared_params)
        params, aggregation, server_metrics = clients.cluster_means(
            state.aggregation, cluster_sums, state.cluster_params, key, cohort, data)
        return params, shared, state.opt_state, aggregation, server_metrics

    client_step, server_update = {
        "gradient": (gradient_step, gradient_server), "model": (model_step, model_server),
    }[option]

    def step(state, batch):  # the client step, and what the round metrics add up
        sums, (losses, assignment) = client_step(state, batch)
        kept = assignment if state.assignment is not None else ()  # no [m] outputs when none
        return (sums, _metric_sums(losses, assignment, batch, _pinned(state, batch))), kept

    def round_(state: IFCAState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        prev = prev_stable = None  # no per-client state: nobody remembers a cluster
        if state.assignment is not None:
            prev, prev_stable = take(cohort, (state.assignment, state.stable))
        stable = None  # the slots pinned by the communication reduction ([s]; None: none)
        if stable_rounds is not None:
            stable = prev_stable >= stable_rounds
        (sums, metric_sums), assignment = cohort_sums(
            lambda batch: step(state, batch), data, cohort, inputs=(prev, stable))
        metrics, with_data = _round_metrics(metric_sums, state)
        # (with_data: the slots that reported)
        metrics.update(clients.participants(data, with_data))
        params, shared, opt_state, aggregation, server_metrics = server_update(
            state, sums, data, cohort, with_data, key)
        metrics.update(server_metrics)
        new_assignment, new_stable = state.assignment, state.stable
        if state.assignment is not None:
            active = taking_part(cohort, data)
            assignment = jnp.where(active, assignment, prev)  # a client without data takes no part
            stable = jnp.where(active, jnp.where(assignment == prev, prev_stable + 1, 0),
                               prev_stable)
            new_assignment = put(cohort, state.assignment, assignment)
            new_stable = put(cohort, state.stable, stable)
        return state._replace(cluster_params=params, shared_params=shared, opt_state=opt_state,
                              assignment=new_assignment, stable=new_stable,
                              round=state.round + 1, aggregation=aggregation), metrics

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        return evaluate_clusters(_net(model, state), state.cluster_params, data,
                                 shared=_trunk(state))

    return Algorithm(init, round_, evaluate, per_client_fields("assignment", "stable"))


# ----------------------------------------------------------------------------- variants


def with_initial_params(algorithm: Algorithm, init_params) -> Algorithm:
    """A clustered algorithm (IFCA, robust IFCA: a state with `cluster_params`) starting
    from `init_params(key)` (leaves [k, ...], whole models) instead of k `model.init`
    draws. Option I's optimizer state is kept: an optax state starts from the params'
    shapes (zeros), not their values.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_initial_params
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> start = lambda key: np.zeros((2, 3), np.float32)  # k = 2 models of d = 3
      >>> alg = with_initial_params(ifca(linear_regression(3), sgd(0.1), num_clusters=2), start)
      >>> alg.init(jax.random.key(1), data).cluster_params.tolist()
      [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """

    def init(key, data):
        return algorithm.init(key, data)._replace(cluster_params=init_params(key))

    return algorithm._replace(init=init)


def with_weight_sharing(algorithm: Algorithm, model: Model) -> Algorithm:
    """IFCA with one trunk shared by every cluster: the trunk is trained by every client of
    the cohort and averaged over all of them (FedAvg on the trunk), the k heads by IFCA.

    `model` (the one IFCA was built with) must be split (`models.split_model`); every
    cluster starts from cluster 0's trunk. Needs option "model".

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_weight_sharing
      >>> from fedjax_sim.data import FederatedData
      >>> from fedjax_sim.models import mlp_classifier
      >>> rng = np.random.default_rng(0)
      >>> data = FederatedData.from_arrays(rng.normal(size=(8, 10, 4)).astype(np.float32),
      ...                                  rng.integers(0, 3, size=(8, 10)))  # [m, n, ...]
      >>> model = mlp_classifier((4,), [8], 3, split=True)  # trunk 4→8, head 8→3
      >>> alg = with_weight_sharing(
      ...     ifca(model, sgd(0.1, steps=2), num_clusters=2, option="model"), model)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> jax.tree.map(jnp.shape, state.cluster_params)  # k heads
      {'bias': (2, 3), 'kernel': (2, 8, 3)}
      >>> jax.tree.map(jnp.shape, state.shared_params)  # one trunk, averaged over all
      {'Dense_0': {'bias': (8,), 'kernel': (4, 8)}}

    References:
      Weight sharing is §5.3 of Avishek Ghosh, Jichan Chung, Dong Yin, Kannan
      Ramchandran, "An Efficient Framework for Clustered Federated Learning",
      NeurIPS 2020, https://arxiv.org/abs/2006.04088.
    """
    _check_split(model, "with_weight_sharing")

    def init(key, data):
        state = algorithm.init(key, data)
        trunks, heads = partition(model, state.cluster_params)
        return state._replace(cluster_params=heads,
                              shared_params=jax.tree.map(lambda p: p[0], trunks))

    return algorithm._replace(init=init)


def with_frozen_trunk(algorithm: Algorithm, model: Model, trunk_params) -> Algorithm:
    """IFCA on a trunk no client trains: `trunk_params` (e.g. pretrained by FedAvg) in
    every cluster, each cluster with its own head from its init; only the heads train,
    on the trunk's features computed once per round (the FEMNIST run,
    docs/protocols.md#ifca-femnist). Needs option "model".

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_frozen_trunk
      >>> from fedjax_sim.data import FederatedData
      >>> from fedjax_sim.models import mlp_classifier
      >>> rng = np.random.default_rng(0)
      >>> data = FederatedData.from_arrays(rng.normal(size=(8, 10, 4)).astype(np.float32),
      ...                                  rng.integers(0, 3, size=(8, 10)))  # [m, n, ...]
      >>> model = mlp_classifier((4,), [8], 3, split=True)  # trunk 4→8, head 8→3
      >>> trunk = jax.jit(model.init)(jax.random.key(3))["trunk"]  # e.g. pretrained by FedAvg
      >>> alg = with_frozen_trunk(
      ...     ifca(model, sgd(0.1, steps=2), num_clusters=2, option="model"), model, trunk)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> jax.tree.map(jnp.shape, state.cluster_params)  # only the k heads train
      {'bias': (2, 3), 'kernel': (2, 8, 3)}
      >>> bool((state.frozen_params["Dense_0"]["kernel"] == trunk["Dense_0"]["kernel"]).all())
      True

    References:
      The FEMNIST experiment of Avishek Ghosh, Jichan Chung, Dong Yin, Kannan
      Ramchandran, "An Efficient Framework for Clustered Federated Learning",
      NeurIPS 2020, https://arxiv.org/abs/2006.04088.
    """
    _check_split(model, "with_frozen_trunk")

    def init(key, data):
        state = algorithm.init(key, data)
        _, heads = partition(model, state.cluster_params)
        return state._replace(cluster_params=heads, frozen_params=trunk_params)

    return algorithm._replace(init=init)


def with_warm_start(algorithm: Algorithm, rounds: int) -> Algorithm:
    """The FEMNIST warm start: init splits the clients into k random groups of equal size
    (client i's group is its assignment; sizes differ by at most one) and for `rounds`
    rounds every client trains its group's model instead of choosing by loss.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_warm_start
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_warm_start(ifca(linear_regression(3), sgd(0.1), num_clusters=2), 5)
      >>> state = alg.init(jax.random.key(1), data)
      >>> np.bincount(state.assignment).tolist(), int(state.pinned_until)  # 2 groups of 4
      ([4, 4], 5)
    """
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ValueError(f"warm start rounds must be an integer >= 0; got {rounds!r}.")

    def init(key, data):
        state = _remembering(algorithm.init(key, data), data)
        m = data.num_clients
        k = jax.tree.leaves(state.cluster_params)[0].shape[0]
        order = jax.random.permutation(jax.random.fold_in(key, k), m)
        assignment = state.assignment.at[order].set(jnp.arange(m, dtype=jnp.int32) % k)
        return state._replace(assignment=assignment,
                              pinned_until=jnp.asarray(rounds, jnp.int32))

    return algorithm._replace(init=init) if rounds else algorithm


def with_fixed_assignment(algorithm: Algorithm, model: Model) -> Algorithm:
    """IFCA whose clients never re-assign: each keeps the cluster its init state holds
    (one-shot clustering's k-means clusters), in every round and in evaluation.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_fixed_assignment, with_warm_start
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> model = linear_regression(3)
      >>> groups = with_warm_start(ifca(model, sgd(0.1), num_clusters=2), 1)  # random groups
      >>> alg = with_fixed_assignment(groups, model)
      >>> state = alg.init(jax.random.key(1), data)
      >>> after, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> bool((after.assignment == state.assignment).all())  # kept in every round
      True
      >>> served = jax.jit(alg.evaluate)(after, data)["assignment"]  # and in evaluation
      >>> bool((served == state.assignment).all())
      True
    """

    def init(key, data):
        state = _remembering(algorithm.init(key, data), data)
        return state._replace(pinned_until=jnp.asarray(ALWAYS, jnp.int32))

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        return evaluate_clusters(_net(model, state), state.cluster_params, data,
                                 shared=_trunk(state), assignment=state.assignment)

    return algorithm._replace(init=init, evaluate=evaluate)


def _remembering(state: IFCAState, data) -> IFCAState:
    """The state with each client's assignment kept, whatever the execution plan allows: a
    pinned client's round reads its cluster back."""
    if state.assignment is not None:
        return state
    m = data.num_clients
    return state._replace(assignment=jnp.full((m,), -1, jnp.int32),
                          stable=jnp.zeros((m,), jnp.int32))


def _check_split(model: Model, what: str) -> None:
    if not model.is_split:
        raise ValueError(f"{what} needs a split model (models.split_model).")


def pretrained_trunk(model: Model, trunk_params, num_clusters: int):
    """Cluster params with `trunk_params` in every cluster, each with its own random head
    (`init_params` for `with_initial_params`: k whole models from one pretrained trunk).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import pretrained_trunk
      >>> from fedjax_sim.models import mlp_classifier
      >>> model = mlp_classifier((4,), [8], 3, split=True)
      >>> trunk = jax.jit(model.init)(jax.random.key(0))["trunk"]
      >>> init_params = pretrained_trunk(model, trunk, num_clusters=2)
      >>> params = jax.jit(init_params)(jax.random.key(1))
      >>> jax.tree.map(jnp.shape, params["trunk"])  # the trunk, k times
      {'Dense_0': {'bias': (2, 8), 'kernel': (2, 4, 8)}}
    """
    _check_split(model, "pretrained_trunk")

    def init_params(key):
        heads = jax.vmap(lambda kk: partition(model, model.init(kk))[1])(
            jax.random.split(key, num_clusters))
        trunks = broadcast_to_clients(trunk_params, num_clusters)
        return combine(model, trunks, heads)

    return init_params


def with_balanced_init(algorithm: Algorithm, model: Model, *, tries: int, min_fraction: float,
                       participation: float = 1.0) -> Algorithm:
    """IFCA's "find a good initializer" rule (docs/protocols.md#ifca-rotated-cifar).

    The official code re-initialises until every cluster model is chosen by at
    least `min_fraction` of the round's participating clients (35 % for k = 2,
    10 % for k = 4). Here `tries` inits are drawn at once (vmap) and the first
    that passes on a cohort drawn from the init key is kept (none passing: the
    most balanced one) [I: the cohort comes from the init key, not from round
    0's, so init stays a function of (key, data)]. `model` is the one the
    algorithm was built with.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import ifca, sgd, with_balanced_init
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> model = linear_regression(3)
      >>> alg = with_balanced_init(ifca(model, sgd(0.1), num_clusters=2), model, tries=4,
      ...                          min_fraction=0.25)
      >>> state = jax.jit(alg.init)(jax.random.key(1), data)  # the first of 4 draws that passes
      >>> state.cluster_params.shape
      (2, 3)

    References:
      The initialisation rule of the official code of Avishek Ghosh, Jichan Chung,
      Dong Yin, Kannan Ramchandran, "An Efficient Framework for Clustered Federated
      Learning", NeurIPS 2020, https://arxiv.org/abs/2006.04088.
    """
    check_steps("tries", tries)
    if not (0.0 < float(min_fraction) <= 1.0):
        raise ValueError(f"min_fraction must be in (0, 1]; got {min_fraction!r}.")

    def init(key, data: FederatedData):
        states = jax.vmap(algorithm.init, in_axes=(0, None))(jax.random.split(key, tries), data)
        m = data.num_clients
        k = jax.tree.leaves(states.cluster_params)[0].shape[1]
        cohort: Cohort = sample_cohort(jax.random.fold_in(key, tries), m,
                                       max(1, int(round(participation * m))))
        members = take(cohort, data)
        active = members.active()

        def smallest_share(state):
            losses = cluster_losses(_net(model, state), state.cluster_params, members,
                                    shared=_trunk(state))
            counts = jax.ops.segment_sum(active.astype(jnp.float32),
                                         jnp.where(active, assign_clusters(losses), k), k)
            return jnp.min(counts) / jnp.maximum(jnp.sum(active), 1)

        shares = jax.vmap(smallest_share)(states)
        ok = shares >= min_fraction
        choice = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmax(shares))
        return jax.tree.map(lambda a: a[choice], states)

    return algorithm._replace(init=init)
