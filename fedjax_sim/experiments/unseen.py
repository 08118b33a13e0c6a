"""Unseen clients (setting unseen_clients): the clients held out of training and how a
method serves one, shared by the experiments that offer them (hetero, ifca_images).

Seed i of an experiment holds out `held_out_count(share, m)` of its m clients, drawn
without replacement from the seed's own stream (seed sequence [seed, i,
UNSEEN_STREAM]), the same for every method; the methods train on the others only. A
clustered method serves an unseen client the cluster model of lowest loss on its
training part (`assign_unseen`); a personal one adapts the global model by a few local
steps (`adapt`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import ClientTraining
from fedjax_sim.algorithms.base import broadcast_to_clients
from fedjax_sim.data.federated import ClientViews
from fedjax_sim.models.core import Model, client_accuracy, client_loss
from fedjax_sim.ops import assign_clusters, client_keys, cluster_losses, map_client_chunks

# The entropy word of the held-out clients' stream (seed i's: [seed, i, UNSEEN_STREAM]),
# apart from the experiments' own data streams ([seed, i, c], [seed, i], seed + i).
UNSEEN_STREAM = 2**32 - 1


def held_out_count(share: float, m: int, clients: str = "num_clients") -> int:
    """The clients held out of training: share · m rounded, at least 1 when share > 0
    (0 when it is 0); `clients` names m in the refusal.

    Raises:
      ValueError: that leaves no client to train on.
    """
    if not share:
        return 0
    count = max(1, round(share * m))
    if count >= m:
        raise ValueError(f"setting unseen_clients={share} holds out {count} of {clients}={m} "
                         "clients, leaving none to train on; give a smaller share or more "
                         "clients.")
    return count


def held_out_ids(seed: int, i: int, m: int, count: int) -> np.ndarray:
    """Seed i's held-out clients (sorted ids, `count` of the m): a draw without replacement
    from the seed's own stream, whatever the methods."""
    rng = np.random.default_rng([seed, i, UNSEEN_STREAM])
    return np.sort(rng.choice(m, count, replace=False))


def split_ids(seed: int, seeds: int, m: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(seen [seeds, m − count], unseen [seeds, count]) client ids of every seed."""
    unseen = np.stack([held_out_ids(seed, i, m, count) for i in range(seeds)])
    seen = np.stack([np.setdiff1d(np.arange(m), u) for u in unseen])
    return seen, unseen


def pick_clients(data, ids: np.ndarray):
    """Seed-stacked clients ([seeds, m, ...] leaves) at per-seed ids ([seeds, c]): copies
    or views of the same base (nothing is gathered)."""
    seeds = np.arange(ids.shape[0])[:, None]
    if isinstance(data, ClientViews):
        rows, transform, count, cluster = (a[seeds, ids] for a in data.client_leaves())
        return data.replace(rows=rows, transform=transform, num_examples=count,
                            cluster=cluster)
    return jax.tree.map(lambda a: a[seeds, ids], data)


def assign_unseen(model: Model, state, train, shared=None) -> jax.Array:
    """[m] each client's cluster model of lowest loss on its training part `train` (ties:
    the lowest index; CFL: among its clusters in use; -1 for a client without data).
    shared: the trunk the cluster models sit on (None: the state's shared_params, if any)."""
    if shared is None:
        shared = getattr(state, "shared_params", None)
    losses = cluster_losses(model, state.cluster_params, train,
                            shared={} if shared is None else shared)
    if hasattr(state, "num_clusters"):  # CFL: slots num_clusters.. are not in use
        losses = jnp.where(jnp.arange(losses.shape[1]) < state.num_clusters, losses, jnp.inf)
    return jnp.where(train.active(), assign_clusters(losses), -1)


def adapt(model: Model, training: ClientTraining, params, data, key, ids) -> object:
    """Each client of `data` after `training`'s local steps from the one model `params`.

    One vmapped `ClientTraining.update_clients` over the clients (their minibatches keyed
    by `client_keys(key, ids)`, ids [m] the clients' own ids). Returns leaves [m, ...].
    """
    start = broadcast_to_clients(params, data.num_clients)
    adapted, _, _ = training.update_clients(model, start, data.materialize(),
                                            client_keys(key, ids))
    return adapted


def evaluate_each(model: Model, params, data) -> dict:
    """Client i of `data` with its own model (params leaves [m, ...]): client_loss,
    client_accuracy, client_weight (1 for a client holding data)."""

    def evaluate_part(part) -> dict:
        p, rows = part

        def per_client(fn):
            return jax.vmap(lambda p, x, y, n: fn(model, p, x, y, n))(
                p, rows.x, rows.y, rows.num_examples)

        out = {"client_loss": per_client(client_loss),
               "client_weight": rows.active().astype(jnp.float32)}
        if model.correct is not None:
            out["client_accuracy"] = per_client(client_accuracy)
        return out

    return map_client_chunks(evaluate_part, (params, data))


def adapt_start(method, state):
    """The model a personal method adapts for an unseen client: its global model (Ditto's
    `params`); local models (personal "params"): the mean of the seen clients' models."""
    if method.personal == "params":
        return jax.tree.map(lambda p: p.mean(0), state.params)
    return state.params
