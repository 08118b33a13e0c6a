"""One-shot clustering: local models, k-means on their parameters, then per-cluster FedAvg.

The "one-shot centralized clustering" baseline of Ghosh et al. 2020
(arXiv:2006.04088, §5; official code femnist/oneshot). The official FEMNIST
run clusters per-client logistic-regression coefficients fitted with
scikit-learn; here the local models are the simulated model itself, trained
with `pretrain_steps` local steps from a shared init [I: a choice that keeps
the baseline model-agnostic]. The cluster models start from the mean of
their members' local models [I].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import Algorithm, client_optimizer
from fedjax_sim.algorithms.ifca import IFCAState, ifca
from fedjax_sim.algorithms.local import local_models
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import kmeans, segment_average


def one_shot_clustering(
    model: Model,
    optimizer: optax.GradientTransformation | None = None,
    *,
    num_clusters: int,
    learning_rate=None,
    pretrain_steps: int = 100,
    local_steps: int = 1,
    batch_size: int | None = None,
    participation: float = 1.0,
    weighting: str = "uniform",
    kmeans_restarts: int = 8,
    client_chunk: int | None = None,
) -> Algorithm:
    """Builds one-shot clustering; its rounds are per-cluster FedAvg with fixed assignments.

    client_chunk (None: all clients at once) bounds the memory of the local
    pre-training, the rounds and evaluation as in `local_models` and `ifca`;
    k-means itself still sees all m flattened local models.
    """
    if not isinstance(pretrain_steps, int) or pretrain_steps < 1:
        raise ValueError(f"pretrain_steps must be an integer >= 1; got {pretrain_steps!r}.")
    opt = client_optimizer(optimizer, learning_rate)
    local = local_models(
        model, opt, local_steps=pretrain_steps, batch_size=batch_size, client_chunk=client_chunk
    )
    clustered = ifca(
        model, opt, num_clusters=num_clusters, option="model", local_steps=local_steps,
        batch_size=batch_size, participation=participation, weighting=weighting,
        fixed_assignment=True, client_chunk=client_chunk,
    )

    def init(key, data: FederatedData) -> IFCAState:
        if num_clusters > data.num_clients:
            raise ValueError(
                f"num_clusters={num_clusters} exceeds the number of clients {data.num_clients}."
            )
        k_init, k_train, k_means = jax.random.split(key, 3)
        state, _ = local.round(local.init(k_init, data), data, k_train)
        flat = jax.vmap(lambda p: jnp.concatenate([a.ravel() for a in jax.tree.leaves(p)]))(
            state.params
        )
        labels, _ = kmeans(k_means, flat, num_clusters, restarts=kmeans_restarts)
        fallback = jax.tree.map(
            lambda a: jnp.broadcast_to(a[0], (num_clusters,) + a.shape[1:]), state.params
        )
        cluster_params, _ = segment_average(state.params, labels, num_clusters, fallback=fallback)
        base = clustered.init(k_init, data)
        return base._replace(cluster_params=cluster_params, assignment=labels)

    return Algorithm(init, clustered.round, clustered.evaluate)
