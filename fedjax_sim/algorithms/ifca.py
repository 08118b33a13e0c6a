"""IFCA: the Iterative Federated Clustering Algorithm.

Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran. "An Efficient
Framework for Clustered Federated Learning". NeurIPS 2020, arXiv:2006.04088.

Each round every participating client evaluates all k cluster models on its
data and picks the one with the lowest loss; the cluster models are then
updated from the clients that picked them, by gradient averaging (option I) or
model averaging after τ local steps (option II). See PAPERS.md §1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    check_fraction,
    client_optimizer,
    cohort_size,
    num_params,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_accuracy
from fedjax_sim.ops import (
    assign_clusters,
    check_client_chunk,
    client_keys,
    cluster_gradient_sums,
    cluster_losses,
    divide_segments,
    local_update,
    map_client_chunks,
    sample_uniform,
    scan_client_chunks,
    segment_totals,
)

OPTIONS = ("gradient", "model")
WEIGHTINGS = ("uniform", "examples")


class IFCAState(NamedTuple):
    cluster_params: object  # pytree, leaves [k, ...]
    opt_state: object  # server optimizer state for option I (leaves [k, ...]); () for option II
    assignment: jax.Array  # [m] int32, last cluster of each client; -1 before it took part
    stable: jax.Array  # [m] int32, consecutive rounds with an unchanged assignment
    round: jax.Array  # int32, rounds done


def _check(num_clusters, option, local_steps, batch_size, participation, weighting, stable_rounds):
    if not isinstance(num_clusters, int) or num_clusters < 1:
        raise ValueError(f"num_clusters (k) must be an integer >= 1; got {num_clusters!r}.")
    if option not in OPTIONS:
        raise ValueError(f"option must be one of {OPTIONS}; got {option!r}.")
    if not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps (τ) must be an integer >= 1; got {local_steps!r}.")
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None (full batch) or >= 1; got {batch_size!r}.")
    check_fraction("participation", participation)
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}; got {weighting!r}.")
    if stable_rounds is not None and (not isinstance(stable_rounds, int) or stable_rounds < 1):
        raise ValueError(f"stable_rounds must be None or an integer >= 1; got {stable_rounds!r}.")


def evaluate_clusters(
    model: Model, cluster_params, data: FederatedData, client_chunk: int | None = None
) -> dict:
    """Each client uses the cluster model with the lowest loss on `data`.

    This is the official IFCA evaluation: on test data each test client picks
    its argmin-loss model on its own test data (PAPERS.md §1.5). With
    client_chunk set, clients are evaluated that many at a time.
    """

    def evaluate_part(part: FederatedData) -> dict:
        losses = cluster_losses(model, cluster_params, part)
        assignment = assign_clusters(losses)
        out = {
            "client_loss": jnp.take_along_axis(losses, assignment[:, None], axis=1)[:, 0],
            "assignment": assignment,
        }
        if model.correct is not None:
            params = jax.tree.map(lambda p: p[assignment], cluster_params)
            out["client_accuracy"] = jax.vmap(
                lambda p, x, y, n: client_accuracy(model, p, x, y, n)
            )(params, part.x, part.y, part.num_examples)
        return out

    return map_client_chunks(evaluate_part, data, client_chunk)


def ifca(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    num_clusters: int,
    learning_rate=None,
    option: str = "gradient",
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    stable_rounds: int | None = None,
    init_params=None,
    fixed_assignment: bool = False,
    client_chunk: int | None = None,
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
      option: "gradient" (option I: one full-batch gradient per client, the
        sum over a cluster divided by the number of participating clients,
        not by the cluster size, as in the official code) or "model"
        (option II: τ local steps, then the per-cluster mean of the models).
      local_steps: τ for option II.
      batch_size: None for full-batch local steps, else the minibatch size.
      participation: fraction of clients sampled per round (uniformly,
        without replacement).
      weighting: option II cluster mean, "uniform" (the MNIST/CIFAR code) or
        "examples" (sample-weighted, the FEMNIST code).
      stable_rounds: communication reduction; once a client's assignment has
        not changed for this many rounds it receives only its own cluster
        model (downlink d instead of k·d floats) and keeps that assignment.
        None disables it.
      init_params: optional key -> cluster params (leaves [k, ...]); default
        k independent `model.init` draws.
      fixed_assignment: used by one-shot clustering: never re-assign; the
        state's assignment is kept as given by init.
      client_chunk: None processes the whole cohort at once; else this many
        clients at a time inside the round (and in evaluate), so peak memory
        is O(client_chunk × model size): option I sums the chunks' gradient
        contributions, option II the chunks' per-cluster weighted sums of
        trained models, never holding [m, ...] trained models. Same result up
        to float summation order (see `fedjax_sim.memory` to pick a size).

    Returns:
      Algorithm(init, round, evaluate) with state IFCAState.
    """
    _check(num_clusters, option, local_steps, batch_size, participation, weighting, stable_rounds)
    check_client_chunk(client_chunk)
    k = num_clusters
    opt = client_optimizer(optimizer, learning_rate)

    def init(key, data: FederatedData) -> IFCAState:
        if init_params is None:
            params = jax.vmap(model.init)(jax.random.split(key, k))
        else:
            params = init_params(key)
        m = data.num_clients
        return IFCAState(
            cluster_params=params,
            opt_state=opt.init(params) if option == "gradient" else (),
            assignment=jnp.full((m,), -1, jnp.int32),
            stable=jnp.zeros((m,), jnp.int32),
            round=jnp.zeros((), jnp.int32),
        )

    def round_(state: IFCAState, data: FederatedData, key):
        m = data.num_clients
        s = cohort_size(m, participation)
        key_cohort, key_local = jax.random.split(key)
        ids = sample_uniform(key_cohort, m, s) if s < m else jnp.arange(m, dtype=jnp.int32)
        params = state.cluster_params

        def cohort_of(per_client):  # [m] -> [s]; no gather when everyone takes part
            return per_client[ids] if s < m else per_client

        prev = cohort_of(state.assignment)
        prev_stable = cohort_of(state.stable)
        if stable_rounds is None:
            frozen = jnp.zeros((s,), bool)
        else:
            frozen = prev_stable >= stable_rounds
        if fixed_assignment:
            frozen = jnp.ones((s,), bool)

        def choose(losses, frozen, prev):
            return jnp.where(frozen, prev, assign_clusters(losses))

        # Both options reduce the cohort to sums that add over clients, so a
        # chunk of clients contributes its part and padding clients (valid
        # False) contribute nothing.
        def gradient_part(cohort, ids, prev, frozen, valid):
            # One forward pass gives the [s, k] loss matrix and, with the
            # assignment, Σ_i s_ij ∇F_i(θ_j) for all j at once.
            weights = None if valid is None else valid.astype(jnp.float32)
            losses, assignment, grad_sum = cluster_gradient_sums(
                model, params, cohort, lambda losses: choose(losses, frozen, prev), weights
            )
            return grad_sum, (losses, assignment)

        def model_part(cohort, ids, prev, frozen, valid):
            losses = cluster_losses(model, params, cohort)
            assignment = choose(losses, frozen, prev)
            start = jax.tree.map(lambda p: p[assignment], params)
            trained, _, _ = local_update(
                model,
                opt,
                start,
                cohort,
                client_keys(key_local, ids),
                num_steps=local_steps,
                batch_size=batch_size,
            )
            weights = (
                cohort.num_examples.astype(jnp.float32)
                if weighting == "examples"
                else jnp.ones((ids.shape[0],), jnp.float32)
            )
            # Segment id k is out of range: segment_totals drops padding clients.
            segment = assignment if valid is None else jnp.where(valid, assignment, k)
            return segment_totals(trained, segment, k, weights), (losses, assignment)

        part_sums = gradient_part if option == "gradient" else model_part
        if client_chunk is None:
            cohort = data.take(ids) if s < m else data
            sums, (losses, assignment) = part_sums(cohort, ids, prev, frozen, None)
        else:

            # With everyone taking part the chunks slice `data` itself, so on a
            # device mesh each chunk reads its rows where they live; a sampled
            # cohort gathers its rows by id.
            def add_chunk(acc, part, valid):
                data_c, ids_c, prev_c, frozen_c = part
                if data_c is None:
                    data_c = data.take(ids_c)
                sums_c, out = part_sums(data_c, ids_c, prev_c, frozen_c, valid)
                return optax.tree.add(acc, sums_c), out

            zero = optax.tree.zeros_like(params)
            if option == "model":
                zero = (zero, jnp.zeros((k,), jnp.float32))
            sums, (losses, assignment) = scan_client_chunks(
                add_chunk, zero, (data if s == m else None, ids, prev, frozen), client_chunk
            )

        if option == "gradient":
            grads = jax.tree.map(lambda g: g / s, sums)
            updates, opt_state = opt.update(grads, state.opt_state, params)
            new_params = optax.apply_updates(params, updates)
        else:
            totals, seg_weight = sums
            new_params = divide_segments(totals, seg_weight, fallback=params)
            opt_state = state.opt_state
        counts = jnp.zeros((k,)).at[assignment].add(1.0)

        same = assignment == prev
        stable_cohort = jnp.where(same, prev_stable + 1, 0)
        if s < m:
            stable = state.stable.at[ids].set(stable_cohort)
            new_assignment = state.assignment.at[ids].set(assignment)
        else:  # the whole federation took part: no scatter needed
            stable, new_assignment = stable_cohort, assignment
        d = num_params(jax.tree.map(lambda p: p[0], params))
        chosen = jnp.take_along_axis(losses, assignment[:, None], axis=1)[:, 0]
        metrics = {
            "train_loss": jnp.mean(chosen),
            "cluster_sizes": counts,
            "downlink_floats": jnp.sum(jnp.where(frozen, d, k * d)).astype(jnp.float32),
            "frozen_clients": jnp.sum(frozen).astype(jnp.int32),
        }
        new_state = IFCAState(
            cluster_params=new_params,
            opt_state=opt_state,
            assignment=new_assignment,
            stable=stable,
            round=state.round + 1,
        )
        return new_state, metrics

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        return evaluate_clusters(model, state.cluster_params, data, client_chunk)

    return Algorithm(init, round_, evaluate)
