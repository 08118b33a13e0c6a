"""The rotated-image experiments' entries of the method table, and their client training.

Every method of the one table (`experiments.methods`) can be compared here, all with
the same local training (`client_training`: SGD, CIFAR's L2 on fc1/fc2); the protocol
trains three its own way:

- local models: each client from its own init, for `local_rounds` rounds of τ steps;
- one-shot clustering: the local pre-training is `local_rounds` × τ steps of that
  training, and its cluster means are uniform over members;
- CFL has up to k clusters.

`client_training` trains at the rotated-CIFAR schedule lr·lr_decay^t by the round.
"""

from __future__ import annotations

import optax

from fedjax_sim.algorithms import ClientTraining, round_decay, sgd
from fedjax_sim.experiments.methods import METHODS, Build
from fedjax_sim.models.zoo import cifar_weight_decay_mask


def _local_rounds_pretraining(value, b: Build) -> dict:
    """One-shot's pre-training: local_rounds × τ steps of the clients' training."""
    return {"pretraining": b.training.replace(steps=value * b.s["local_steps"])}


TABLE = {
    **METHODS,
    "local": METHODS["local"].replace(options={"shared_init": False}, rounds="local_rounds"),
    "oneshot": METHODS["oneshot"].replace(
        options={"weighting": "uniform"},
        reads={"k": "num_clusters", "local_rounds": _local_rounds_pretraining}),
}
CLUSTERING = tuple(n for n, m in TABLE.items() if m.kind in ("clustered", "fixed"))


def client_training(s: dict, learning_rate) -> ClientTraining:
    """SGD at `learning_rate`·lr_decay^t in round t (`round_decay`: the rotated-CIFAR
    schedule; lr_decay 1 or absent: a constant rate), declared linear in its gradients
    (the MLP's input layer trains in its rows' span), or with CIFAR's tutorial L2 on
    fc1/fc2 chained before it; τ = local_steps, batch_size (0: full batch), sampling."""
    steps, batch, sampling = s["local_steps"], s["batch_size"] or None, s["sampling"]
    rate = round_decay(learning_rate, s.get("lr_decay", 1.0))
    if s["dataset"] == "cifar" and s["weight_decay"] > 0:
        def decayed(rate):
            return optax.chain(optax.add_decayed_weights(s["weight_decay"],
                                                         cifar_weight_decay_mask),
                               optax.sgd(rate))

        if callable(rate):  # the optimizer follows the round's rate
            return ClientTraining(lambda t: decayed(rate(t)), steps, batch, sampling)
        return ClientTraining(decayed(rate), steps, batch, sampling)
    return sgd(rate, steps=steps, batch_size=batch, sampling=sampling)
