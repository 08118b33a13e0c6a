"""IFCA: the Iterative Federated Clustering Algorithm.

Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran. "An Efficient
Framework for Clustered Federated Learning". NeurIPS 2020, arXiv:2006.04088.

Each round every participating client evaluates all k cluster models on its
data and picks the one with the lowest loss; the cluster models are then
updated from the clients that picked them, by gradient averaging (option I) or
model averaging after τ local steps (option II). With weight sharing (a split
model), the trunk is shared by every cluster and averaged over every
participating client, and only the heads are clustered; with a frozen trunk
(the FEMNIST run: a pretrained trunk in every cluster, only the last layer
trained) the trunk never changes. See docs/protocols.md#ifca.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_choice,
    check_fraction,
    check_inputs,
    check_steps,
    client_optimizer,
    client_weights,
    cohort_size,
    num_params,
    per_client_fields,
)
from fedjax_sim.algorithms.server import apply_server_update, make_server_optimizer
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy, combine, partition
from fedjax_sim.ops import (
    assign_clusters,
    check_client_chunk,
    check_sampling,
    cluster_gradient_sums,
    cluster_losses,
    cohort_sums,
    divide_segments,
    local_update,
    map_client_chunks,
    mean_or_keep,
    put,
    sample_cohort,
    segment_totals,
    take,
    weighted_sum,
)
from fedjax_sim.ops.cohort import Cohort

OPTIONS = ("gradient", "model")
WEIGHTINGS = ("uniform", "examples")
DIVISORS = ("m", "cohort")


class IFCAState(NamedTuple):
    cluster_params: object  # pytree, leaves [k, ...] (with weight sharing: the heads)
    shared_params: object  # the trunk every cluster shares (weight sharing); {} otherwise
    opt_state: object  # server optimizer state, leaves [k, ...] (option I; FedOpt in II) or ()
    assignment: jax.Array  # [m] int32, each client's most recent cluster (set in the rounds it
    #                        takes part with data; a warm start's groups from init); -1 while
    #                        it has none (cluster-identity accuracy under partial participation
    #                        is taken over the clients >= 0); None with keep_assignments=False
    stable: jax.Array  # [m] int32, consecutive rounds with an unchanged assignment (or None)
    round: jax.Array  # int32, rounds done


def _check(num_clusters, option, local_steps, batch_size, participation, weighting, divide_by,
           stable_rounds, weight_sharing, model, freeze_shared=False, warm_start_rounds=0,
           sampling=None):
    if freeze_shared and not weight_sharing:
        raise ValueError("freeze_shared needs weight_sharing=True (a trunk shared by every "
                         "cluster to keep frozen).")
    if not isinstance(warm_start_rounds, int) or warm_start_rounds < 0:
        raise ValueError(f"warm_start_rounds must be an integer >= 0; got {warm_start_rounds!r}.")
    if not isinstance(num_clusters, int) or isinstance(num_clusters, bool) or num_clusters < 1:
        raise ValueError(f"num_clusters (k) must be an integer >= 1; got {num_clusters!r}.")
    check_choice("option", option, OPTIONS)
    check_fraction("participation", participation)
    if option == "gradient":
        # Option I takes one full-batch gradient per client: these would be ignored.
        ignored = {"local_steps": local_steps, "batch_size": batch_size, "weighting": weighting,
                   "weight_sharing": weight_sharing or None, "sampling": sampling}
        given = [name for name, value in ignored.items() if value is not None]
        if given:
            raise ValueError(
                f"option 'gradient' (IFCA option I) takes one full-batch gradient per client "
                f"and has no {', '.join(given)}; use option 'model' for local training."
            )
        check_choice("divide_by", divide_by, DIVISORS)
    else:
        if divide_by != "m":
            raise ValueError("divide_by applies to option 'gradient' only.")
        check_steps("local_steps (τ)", 1 if local_steps is None else local_steps)
        if batch_size is not None:
            check_steps("batch_size", batch_size)
        check_choice("weighting", weighting or "uniform", WEIGHTINGS)
        check_sampling(sampling or "with_replacement")
    if weight_sharing and not model.is_split:
        raise ValueError("weight_sharing needs a split model (models.split_model).")
    if stable_rounds is not None:
        check_steps("stable_rounds", stable_rounds)


def evaluate_clusters(
    model: Model, cluster_params, data: FederatedData, client_chunk: int | None = None,
    shared=None, assignment=None,
) -> dict:
    """Per-client loss (and accuracy) with each client's cluster model.

    By default each client uses the model with the lowest loss on `data`:
    the official IFCA evaluation, where each test client picks its argmin-loss
    model on its own test data (docs/protocols.md#ifca-evaluation). With `assignment` ([m]) the
    clients use those clusters instead (one-shot clustering's fixed ones).
    Clients without data get assignment -1 and weight 0.
    """
    shared = {} if shared is None else shared

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

    return map_client_chunks(evaluate_part, (data, assignment), client_chunk)


def _choose(losses, batch):
    """ĵ_i = argmin_j F_i(θ_j); a frozen client keeps its cluster."""
    prev, frozen = batch.inputs
    if prev is None:  # no client remembers a cluster (keep_assignments=False)
        return assign_clusters(losses)
    return jnp.where(frozen, prev, assign_clusters(losses))


def _metric_sums(losses, assignment, batch) -> dict:
    """What the round metrics add up over a batch of slots (a chunk, or the whole cohort):
    the chosen losses and cluster sizes of the slots holding data, and the frozen slots.
    Counts are int32 (float32 counts are exact only up to 2**24 clients)."""
    k = losses.shape[1]
    _, frozen = batch.inputs
    chosen = jnp.take_along_axis(losses, jnp.maximum(assignment, 0)[:, None], axis=1)[:, 0]
    # A sum over clients of one-hot columns, not a segment sum (a scatter: a serial loop on
    # XLA:CPU); slots without data (and chunk padding) count in no cluster.
    in_cluster = batch.active[:, None] & (assignment[:, None] == jnp.arange(k))
    frozen = frozen & batch.real
    return {
        "loss": jnp.sum(jnp.where(batch.active, chosen, 0.0)),
        "counts": jnp.sum(in_cluster, axis=0, dtype=jnp.int32),
        "frozen_with_data": jnp.sum(batch.active & frozen).astype(jnp.int32),
        "frozen": jnp.sum(frozen).astype(jnp.int32),
    }


def _round_metrics(sums: dict, state: IFCAState) -> dict:
    """Mean chosen loss and cluster sizes over the cohort's clients with data; downlink floats
    (k·d to each cohort slot holding data, d to a frozen one; a slot without data gets nothing).
    """
    k = sums["counts"].shape[0]
    d = num_params(jax.tree.map(lambda p: p[0], state.cluster_params))
    d += num_params(state.shared_params)
    with_data = jnp.sum(sums["counts"]).astype(jnp.float32)
    frozen = sums["frozen_with_data"].astype(jnp.float32)
    return {
        "train_loss": sums["loss"] / jnp.maximum(with_data, 1.0),
        "cluster_sizes": sums["counts"].astype(jnp.float32),
        "downlink_floats": frozen * d + (with_data - frozen) * (k * d),
        "frozen_clients": sums["frozen"],
    }, with_data


def ifca(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    num_clusters: int,
    learning_rate=None,
    option: str = "gradient",
    local_steps: int | None = None,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str | None = None,
    divide_by: str = "m",
    stable_rounds: int | None = None,
    weight_sharing: bool = False,
    init_params=None,
    fixed_assignment: bool = False,
    client_chunk: int | None = None,
    freeze_shared: bool = False,
    warm_start_rounds: int = 0,
    sampling: str | None = None,
    server_optimizer=None,
    server_lr=None,
    keep_assignments: bool = True,
) -> Algorithm:
    """Builds IFCA.

    Args:
      model: the model of every cluster.
      optimizer: option "gradient": the server optimizer applied to each
        cluster's averaged gradient (default SGD at learning_rate, which is
        the paper's θ_j ← θ_j − γ/m Σ_i s_ij ∇F_i(θ_j)); option "model": the
        clients' local optimizer (default SGD at learning_rate).
      num_clusters: k.
      learning_rate: γ, used when `optimizer` is None; may be traced.
      option: "gradient" (option I: one full-batch gradient per client) or
        "model" (option II: τ local steps, then the per-cluster mean of the
        models).
      local_steps: τ for option II (default 1); refused for option I.
      batch_size: option II: None for full-batch local steps, else the
        minibatch size; refused for option I.
      participation: fraction of clients sampled per round (uniformly,
        without replacement).
      weighting: option II cluster mean, "uniform" (default; the MNIST/CIFAR
        code) or "examples" (sample-weighted, the FEMNIST code); refused for
        option I.
      divide_by: option I's divisor of a cluster's gradient sum: "m" (the
        paper's and the official code's γ/m, m = the clients holding data;
        with partial participation the step shrinks with the cohort) or
        "cohort" (the clients of this round's cohort holding data).
      stable_rounds: communication reduction; once a client's assignment has
        not changed for this many rounds it receives only its own cluster
        model (downlink d instead of k·d floats) and keeps that assignment.
        None disables it.
      weight_sharing: option II with a split model: one trunk shared by every
        cluster, averaged over every participating client (FedAvg on the
        trunk); only the k heads are clustered.
      init_params: optional key -> cluster params (leaves [k, ...]); default
        k independent `model.init` draws.
      fixed_assignment: used by one-shot clustering: never re-assign; the
        state's assignment is kept as given by init.
      client_chunk: None processes the whole cohort at once; else this many
        clients at a time inside the round (and in evaluate), so peak memory
        is O(client_chunk × model size). Same result up to float summation
        order (see `fedjax_sim.memory` to pick a size).
      freeze_shared: with weight_sharing, the trunk is never trained (the
        FEMNIST run, docs/protocols.md#ifca-femnist: a pretrained trunk, e.g. from
        `pretrained_trunk`, loaded into every cluster; only the heads train).
        Each client's features are computed once per round and its local
        steps train the head alone.
      warm_start_rounds: the FEMNIST warm start: init splits the clients
        into k random groups of equal size (client i's group is its
        assignment) and for this many rounds every client trains the head of
        its group instead of choosing by loss; 0: no warm start.
      sampling: option II's minibatches: "with_replacement" (default: each
        step draws its batch independently) or "epochs" (every real row once
        per epoch, a fresh permutation each epoch: the rotated-CIFAR protocol's
        "5 local epochs of batch 50"); refused for option I.
      server_optimizer, server_lr: option II without weight sharing: FedOpt
        per cluster (algorithms/server.py): each cluster model takes a server
        step on its members' mean delta, with its own optimizer state; a
        cluster nobody picked keeps model and state.
      keep_assignments: the state remembers each client's cluster and how long
        it has kept it ([m] assignment and stable). False: nothing per client
        is kept between rounds (both None), so a round over m clients holds
        O(client_chunk) of them; only where no round reads them (participation
        1, no stable_rounds, warm start or fixed assignment).

    A client without data (num_examples 0) takes no part: it is not
    assigned, has no weight in any average and is not counted in cluster
    sizes or the mean loss.

    Returns:
      Algorithm(init, round, evaluate) with state IFCAState.
    """
    _check(num_clusters, option, local_steps, batch_size, participation, weighting, divide_by,
           stable_rounds, weight_sharing, model, freeze_shared, warm_start_rounds, sampling)
    check_client_chunk(client_chunk)
    if not isinstance(keep_assignments, bool):
        raise ValueError(f"keep_assignments must be True or False; got {keep_assignments!r}.")
    if not keep_assignments and (participation < 1.0 or stable_rounds is not None
                                 or fixed_assignment or warm_start_rounds):
        raise ValueError(
            "keep_assignments=False needs participation 1 and no stable_rounds, "
            "fixed_assignment or warm_start_rounds (their rounds read the clients' "
            "previous clusters).")
    if server_optimizer is not None and (option == "gradient" or weight_sharing):
        raise ValueError("server_optimizer applies to option 'model' without weight_sharing "
                         "(option I's `optimizer` is already the server's).")
    server = make_server_optimizer(server_optimizer, server_lr)
    if not weight_sharing:  # a split model's params are then whole per cluster
        model = model.unsplit()
    k = num_clusters
    opt = client_optimizer(optimizer, learning_rate)
    local_steps = local_steps or 1
    weighting = weighting or "uniform"
    sampling = sampling or "with_replacement"
    # With a frozen trunk the local steps train the head on the trunk's features.
    head_model = Model(model.init, model.head, model.example_loss, model.correct)

    def init(key, data: FederatedData) -> IFCAState:
        if init_params is None:
            params = jax.vmap(model.init)(jax.random.split(key, k))
        else:
            params = init_params(key)
        check_inputs(model, jax.tree.map(lambda p: p[0], params), data)
        shared, heads = {}, params
        if weight_sharing:  # every cluster starts from cluster 0's trunk
            shared, heads = partition(model, params)
            shared = jax.tree.map(lambda p: p[0], shared)
        m = data.num_clients
        assignment = jnp.full((m,), -1, jnp.int32) if keep_assignments else None
        if warm_start_rounds:  # k random groups of equal size (sizes differ by at most one)
            order = jax.random.permutation(jax.random.fold_in(key, k), m)
            assignment = assignment.at[order].set(jnp.arange(m, dtype=jnp.int32) % k)
        return IFCAState(
            cluster_params=heads,
            shared_params=shared,
            opt_state=(opt.init(params) if option == "gradient"
                       else () if server is None else jax.vmap(server.init)(heads)),
            assignment=assignment,
            stable=jnp.zeros((m,), jnp.int32) if keep_assignments else None,
            round=jnp.zeros((), jnp.int32),
        )

    def gradient_step(state, batch):  # option I: s_i and ∇F_i(θ_ĵi), summed per cluster
        # A client without data has a zero gradient and no cluster: only chunk
        # padding needs weight 0 (without chunks the weights fold to a constant).
        losses, assignment, grad_sum = cluster_gradient_sums(
            model, state.cluster_params, batch.data, lambda losses: _choose(losses, batch),
            batch.real.astype(jnp.float32))
        return grad_sum, (losses, assignment)

    def gradient_server(state, grad_sum, data, cohort, cohort_clients):
        # θ_j ← θ_j − (γ/m) Σ_i s_ij ∇F_i(θ_j); m and the cohort count clients holding data.
        if divide_by == "cohort" or cohort.everyone:
            divisor = cohort_clients
        else:
            divisor = jnp.sum(data.active())
        grads = jax.tree.map(lambda g: g / jnp.maximum(divisor, 1), grad_sum)
        updates, opt_state = opt.update(grads, state.opt_state, state.cluster_params)
        return optax.apply_updates(state.cluster_params, updates), state.shared_params, opt_state

    def model_step(state, batch):  # option II: θ̃_i = LocalUpdate(θ_ĵi, γ, τ), summed per cluster
        params, shared = state.cluster_params, state.shared_params
        losses = cluster_losses(model, params, batch.data, shared=shared)
        assignment = _choose(losses, batch)
        start = jax.tree.map(lambda p: p[jnp.maximum(assignment, 0)], params)
        if freeze_shared:  # the trunk's features once, then τ steps on the head alone
            features = jax.vmap(lambda x: model.features(shared, x))(batch.data.x)
            heads, _, _ = local_update(head_model, opt, start, batch.data.replace(x=features),
                                       batch.keys, num_steps=local_steps, batch_size=batch_size,
                                       sampling=sampling)
            trunks = {}
        else:
            if weight_sharing:
                start = combine(model, broadcast_to_clients(shared, assignment.shape[0]), start)
            trained, _, _ = local_update(model, opt, start, batch.data, batch.keys,
                                         num_steps=local_steps, batch_size=batch_size,
                                         sampling=sampling)
            trunks, heads = partition(model, trained) if weight_sharing else ({}, trained)
        weights = client_weights(batch.active, batch.data.num_examples, weighting)
        segment = jnp.where(batch.active, assignment, k)  # id k is dropped
        sums = (segment_totals(heads, segment, k, weights), weighted_sum(trunks, weights),
                jnp.sum(weights))
        return sums, (losses, assignment)

    def model_server(state, sums, data, cohort, cohort_clients):
        # θ_j = Σ_i s_ij θ̃_i / Σ_i s_ij (an empty cluster keeps θ_j); FedAvg on a shared trunk.
        (totals, cluster_weight), trunk_total, weight = sums
        shared = (state.shared_params if freeze_shared
                  else mean_or_keep(trunk_total, weight, state.shared_params))
        params = divide_segments(totals, cluster_weight, fallback=state.cluster_params)
        opt_state = state.opt_state
        if server is not None:  # FedOpt per cluster, on each cluster's mean delta
            params, opt_state = jax.vmap(functools.partial(apply_server_update, server))(
                state.cluster_params, opt_state, optax.tree.sub(params, state.cluster_params),
                cluster_weight > 0)
        return params, shared, opt_state

    client_step, server_update = {
        "gradient": (gradient_step, gradient_server), "model": (model_step, model_server),
    }[option]

    def step(state, batch):  # the client step, and what the round metrics add up
        sums, (losses, assignment) = client_step(state, batch)
        kept = assignment if keep_assignments else ()  # no [m] outputs when none is kept
        return (sums, _metric_sums(losses, assignment, batch)), kept

    def round_(state: IFCAState, data: FederatedData, key):
        m = data.num_clients
        cohort = sample_cohort(key, m, cohort_size(m, participation))
        prev = prev_stable = None  # keep_assignments=False: nobody remembers a cluster
        if keep_assignments:
            prev, prev_stable = take(cohort, (state.assignment, state.stable))
        frozen = jnp.full((cohort.size,), fixed_assignment)
        if warm_start_rounds:  # a warm-start round trains each group's head
            frozen |= state.round < warm_start_rounds
        if stable_rounds is not None:  # communication reduction
            frozen |= prev_stable >= stable_rounds
        (sums, metric_sums), assignment = cohort_sums(
            lambda batch: step(state, batch), data, cohort, inputs=(prev, frozen),
            client_chunk=client_chunk)
        metrics, with_data = _round_metrics(metric_sums, state)
        params, shared, opt_state = server_update(state, sums, data, cohort, with_data)
        new_assignment = new_stable = None
        if keep_assignments:
            active = take(cohort, data.active())
            assignment = jnp.where(active, assignment, prev)  # a client without data takes no part
            stable = jnp.where(active, jnp.where(assignment == prev, prev_stable + 1, 0),
                               prev_stable)
            new_assignment = put(cohort, state.assignment, assignment)
            new_stable = put(cohort, state.stable, stable)
        return IFCAState(
            cluster_params=params,
            shared_params=shared,
            opt_state=opt_state,
            assignment=new_assignment,
            stable=new_stable,
            round=state.round + 1,
        ), metrics

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        fixed = state.assignment if fixed_assignment else None
        return evaluate_clusters(model, state.cluster_params, data, client_chunk,
                                 shared=state.shared_params, assignment=fixed)

    return Algorithm(init, round_, evaluate, per_client_fields("assignment", "stable"))


def pretrained_trunk(model: Model, trunk_params, num_clusters: int):
    """init_params for IFCA: `trunk_params` in every cluster, each with its own random head.

    The FEMNIST run's start (docs/protocols.md#ifca-femnist): the pretrained weights go into
    every cluster model except the last layer, which cluster j draws from its
    own key. Use with weight_sharing=True (and freeze_shared=True to train only
    the heads).
    """
    if not model.is_split:
        raise ValueError("pretrained_trunk needs a split model (models.split_model).")

    def init_params(key):
        heads = jax.vmap(lambda kk: partition(model, model.init(kk))[1])(
            jax.random.split(key, num_clusters))
        trunks = broadcast_to_clients(trunk_params, num_clusters)
        return combine(model, trunks, heads)

    return init_params


def with_balanced_init(algorithm: Algorithm, model: Model, *, num_clusters: int, tries: int,
                       min_fraction: float, participation: float = 1.0,
                       weight_sharing: bool = False) -> Algorithm:
    """IFCA's "find a good initializer" rule (docs/protocols.md#ifca-rotated-cifar).

    The official code re-initialises until every cluster model is chosen by at
    least `min_fraction` of the round's participating clients (35 % for k = 2,
    10 % for k = 4). Here `tries` inits are drawn at once (vmap) and the first
    that passes on a cohort drawn from the init key is kept (none passing: the
    most balanced one) [I: the cohort comes from the init key, not from round
    0's, so init stays a function of (key, data)]. `model` and `weight_sharing` are
    those the algorithm was built with.
    """
    check_steps("tries", tries)
    check_fraction("min_fraction", min_fraction)
    if not weight_sharing:
        model = model.unsplit()
    k = num_clusters

    def init(key, data: FederatedData):
        states = jax.vmap(algorithm.init, in_axes=(0, None))(jax.random.split(key, tries), data)
        m = data.num_clients
        cohort: Cohort = sample_cohort(jax.random.fold_in(key, tries), m,
                                       cohort_size(m, participation))
        members = take(cohort, data)
        active = members.active()

        def smallest_share(state):
            losses = cluster_losses(model, state.cluster_params, members,
                                    shared=state.shared_params)
            counts = jax.ops.segment_sum(active.astype(jnp.float32),
                                         jnp.where(active, assign_clusters(losses), k), k)
            return jnp.min(counts) / jnp.maximum(jnp.sum(active), 1)

        shares = jax.vmap(smallest_share)(states)
        ok = shares >= min_fraction
        choice = jnp.where(jnp.any(ok), jnp.argmax(ok), jnp.argmax(shares))
        return jax.tree.map(lambda a: a[choice], states)

    return algorithm._replace(init=init)
