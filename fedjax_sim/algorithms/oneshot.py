"""One-shot clustering: local models, k-means on their parameters, then per-cluster FedAvg.

The "one-shot centralized clustering" baseline of Ghosh et al. 2020
(arXiv:2006.04088, §5; official code femnist/oneshot). The official FEMNIST
run clusters per-client logistic-regression coefficients fitted with
scikit-learn; here the local models are the simulated model itself, trained
with `pretrain_steps` local steps from a shared init [I: a choice that keeps
the baseline model-agnostic]. The cluster models start from the mean of
their members' local models [I].

As in the official code, the clusters are fixed once: every client, in
training and in evaluation (its test twin), uses the cluster k-means gave it
(the official code evaluates with the training cluster labels), never the
lowest-loss model; averages over clients (the cluster models' updates and the
reported loss/accuracy) are sample-weighted, as the official FEMNIST code
weights by client sample counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import Algorithm, check_steps, client_optimizer
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
    weighting: str = "examples",
    kmeans_restarts: int = 8,
    client_chunk: int | None = None,
    sampling: str = "with_replacement",
    pretrain_learning_rate=None,
) -> Algorithm:
    """Builds one-shot clustering; its rounds are per-cluster FedAvg with fixed assignments.

    client_chunk (None: all clients at once) bounds the memory of the local
    pre-training, the cluster means of the local models, the rounds and evaluation
    as in `local_models` and `ifca`; k-means itself still sees all m local models
    (in place, leaf by leaf). Clients without
    data take no part in k-means (assignment -1) nor in any average.
    `sampling` draws the minibatches of both phases ("with_replacement" or
    "epochs", see `ops.client_update`).

    pretrain_learning_rate: plain SGD's step for the local pre-training
    (None: the rounds' optimizer). One client's rows alone can need a smaller
    step than a cluster's pooled data.
    """
    check_steps("pretrain_steps", pretrain_steps)
    opt = client_optimizer(optimizer, learning_rate)
    pre_opt = opt if pretrain_learning_rate is None else client_optimizer(
        None, pretrain_learning_rate)
    local = local_models(
        model, pre_opt, local_steps=pretrain_steps, batch_size=batch_size,
        client_chunk=client_chunk, sampling=sampling,
    )
    clustered = ifca(
        model, opt, num_clusters=num_clusters, option="model", local_steps=local_steps,
        batch_size=batch_size, participation=participation, weighting=weighting,
        fixed_assignment=True, client_chunk=client_chunk, sampling=sampling,
    )

    def init(key, data: FederatedData) -> IFCAState:
        if num_clusters > data.num_clients:
            raise ValueError(
                f"num_clusters={num_clusters} exceeds the number of clients {data.num_clients}."
            )
        k_init, k_train, k_means = jax.random.split(key, 3)
        state, _ = local.round(local.init(k_init, data), data, k_train)
        active = data.active()
        # k-means on the flattened models, read leaf by leaf (no [m, P] copy).
        labels, _ = kmeans(k_means, state.params, num_clusters, restarts=kmeans_restarts,
                           weights=active)
        labels = jnp.where(active, labels, -1)
        fallback = jax.tree.map(
            lambda a: jnp.broadcast_to(a[0], (num_clusters,) + a.shape[1:]), state.params
        )
        cluster_params, _ = segment_average(
            state.params, labels, num_clusters, weights=data.num_examples.astype(jnp.float32),
            fallback=fallback, client_chunk=client_chunk,
        )
        base = clustered.init(k_init, data)
        return base._replace(cluster_params=cluster_params, assignment=labels)

    def evaluate(state: IFCAState, data: FederatedData) -> dict:
        out = clustered.evaluate(state, data)
        return {**out, "client_weight": data.num_examples.astype(jnp.float32)}

    return Algorithm(init, clustered.round, evaluate, clustered.client_axes)
