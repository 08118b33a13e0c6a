"""The compared methods of the rotated-image experiments, built from its settings.

IFCA (option II), with weight sharing or a frozen pretrained trunk, FedAvg,
local models, one-shot clustering, HypCluster and CFL, all with the same
local training (`build_method`), and the rotated-CIFAR learning-rate decay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_sim import simulate
from fedjax_sim.algorithms import cfl, fedavg, hypcluster, ifca, local_models, one_shot_clustering
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.ifca import pretrained_trunk, with_balanced_init
from fedjax_sim.models.zoo import cifar_weight_decay_mask
from fedjax_sim.ops import linear_in_gradients

CLUSTERING = ("ifca", "ifca_ws", "ifca_frozen", "oneshot", "hypcluster", "cfl")
SHARING = ("ifca_ws", "ifca_frozen")  # methods on the split model (shared trunk)
PER_CLIENT_MODELS = ("local", "oneshot")  # the state holds one model per client
METHOD_HELP = {
    "ifca": "IFCA (option II, model averaging)",
    "fedavg": "global model (FedAvg)",
    "local": "local models (each client alone)",
    "oneshot": "one-shot clustering (k-means of local models, then fixed clusters)",
    "ifca_ws": "IFCA with weight sharing (trunk by FedAvg over every client, k heads by IFCA)",
    "ifca_frozen": "IFCA, frozen pretrained trunk, only the last layer clustered (FEMNIST)",
    "hypcluster": "HypCluster (k hypotheses, each client trains its lowest-loss one)",
    "cfl": "clustered FL (Sattler et al.: recursive bi-partitioning, up to k clusters)",
}


def _optimizer(s: dict, lr):
    sgd = optax.sgd(lr)
    if s["dataset"] == "cifar" and s["weight_decay"] > 0:  # the tutorial's L2 on fc1/fc2
        return optax.chain(optax.add_decayed_weights(s["weight_decay"], cifar_weight_decay_mask),
                           sgd)
    return linear_in_gradients(sgd)  # the MLP's input layer trains in its rows' span


def with_lr_decay(build, lr: float, decay: float) -> Algorithm:
    """build(learning_rate) -> Algorithm, with round t's clients training at lr·decay^t.

    The rotated-CIFAR schedule 0.25·0.99^t. The client optimizer starts fresh
    every round, so the decay is applied by the round (state.round), not by an
    optax schedule's step count.
    """
    base = build(lr)
    if decay == 1.0:
        return base

    def round_(state, data, key):
        rate = lr * jnp.power(jnp.float32(decay), state.round.astype(jnp.float32))
        return build(rate).round(state, data, key)

    return base._replace(round=round_)


def frozen_trunk_ifca(model, s: dict, client_chunk=None, lr=None) -> Algorithm:
    """The FEMNIST-style run (docs/protocols.md#ifca-femnist): FedAvg pretraining, its trunk frozen.

    init runs `pretrain_rounds` FedAvg rounds (the same local training) from
    the init key, loads the trunk into every cluster with random heads
    (`pretrained_trunk`) and starts IFCA with freeze_shared=True and the warm
    start on random client groups (`warm_start_rounds`).
    """
    lr = s["lr"] if lr is None else lr
    local = _local_kwargs(s)
    pre = fedavg(model, _optimizer(s, lr), client_chunk=client_chunk, **local)
    k = s["k"]

    def clustered(init_params=None):
        return ifca(model, _optimizer(s, lr), num_clusters=k, option="model",
                    weight_sharing=True, freeze_shared=True,
                    warm_start_rounds=s["warm_start_rounds"], init_params=init_params,
                    client_chunk=client_chunk, **local)

    body = clustered()

    def init(key, data):
        k_pre, k_rounds, k_heads = jax.random.split(key, 3)
        state = pre.init(k_pre, data)
        state, _ = simulate.scan_rounds(pre, state, data, k_rounds, 0, s["pretrain_rounds"])
        trunk = state.params["trunk"]
        return clustered(pretrained_trunk(model, trunk, k)).init(k_heads, data)

    return body._replace(init=init)


def _local_kwargs(s: dict) -> dict:
    return {"local_steps": s["local_steps"], "batch_size": s["batch_size"] or None,
            "participation": s["participation"], "sampling": s["sampling"]}


def build_method(name: str, model, s: dict, client_chunk=None) -> tuple[Algorithm, int]:
    """(algorithm, rounds) of one compared method with the experiment's settings."""
    k, local = s["k"], _local_kwargs(s)

    def build(lr):
        opt = _optimizer(s, lr)
        if name == "ifca":
            return ifca(model, opt, num_clusters=k, option="model", client_chunk=client_chunk,
                        **local)
        if name == "ifca_ws":
            return ifca(model, opt, num_clusters=k, option="model", weight_sharing=True,
                        client_chunk=client_chunk, **local)
        if name == "ifca_frozen":
            return frozen_trunk_ifca(model, s, client_chunk, lr)
        if name == "fedavg":
            return fedavg(model, opt, client_chunk=client_chunk, **local)
        if name == "local":
            return local_models(model, opt, local_steps=s["local_steps"],
                                batch_size=local["batch_size"], shared_init=False,
                                client_chunk=client_chunk, sampling=s["sampling"])
        if name == "oneshot":
            return one_shot_clustering(
                model, opt, num_clusters=k, pretrain_steps=s["local_rounds"] * s["local_steps"],
                weighting="uniform", client_chunk=client_chunk, **local)
        if name in ("hypcluster", "cfl"):
            if local["sampling"] != "with_replacement":
                raise ValueError(f"setting sampling={local['sampling']} is not read by method "
                                 f"{name} (its minibatches are drawn with replacement).")
            plain = {k: v for k, v in local.items() if k != "sampling"}
            if name == "hypcluster":
                return hypcluster(model, opt, num_clusters=k, client_chunk=client_chunk, **plain)
            return cfl(model, opt, max_clusters=k, eps1=s["cfl_eps1"], eps2=s["cfl_eps2"],
                       client_chunk=client_chunk, **plain)  # up to k clusters
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHOD_HELP)}.")

    algorithm = with_lr_decay(build, s["lr"], s["lr_decay"])
    if name in ("ifca", "ifca_ws") and s["init_tries"] > 1:
        algorithm = with_balanced_init(algorithm, model, num_clusters=k, tries=s["init_tries"],
                                       min_fraction=s["init_min_fraction"],
                                       participation=s["participation"],
                                       weight_sharing=name == "ifca_ws")
    rounds = s["local_rounds"] if name == "local" else s["rounds"]
    return algorithm, rounds

