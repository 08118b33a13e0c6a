"""The rotated-image experiments' entries of the method table, and their client training.

Every method of the one table (`experiments.methods`) can be compared here, all with
the same local training (`client_training`: SGD, CIFAR's L2 on fc1/fc2); the protocol
trains three its own way:

- local models: each client from its own init, for `local_rounds` rounds of τ steps;
- one-shot clustering: the local pre-training is `local_rounds` × τ steps of that
  training, and its cluster means are uniform over members;
- CFL has up to k clusters.

`lr_decayed` gives every row the rotated-CIFAR schedule lr·lr_decay^t by the round.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import optax

from fedjax_sim.algorithms import ClientTraining, sgd
from fedjax_sim.experiments.methods import METHODS, Build, Method, build, setting_of, with_lr_decay
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
    """SGD at `learning_rate` (declared linear in its gradients: the MLP's input layer trains
    in its rows' span), or with CIFAR's tutorial L2 on fc1/fc2 chained before it; τ =
    local_steps, batch_size (0: full batch), sampling."""
    steps, batch, sampling = s["local_steps"], s["batch_size"] or None, s["sampling"]
    if s["dataset"] == "cifar" and s["weight_decay"] > 0:
        decayed = optax.chain(optax.add_decayed_weights(s["weight_decay"],
                                                        cifar_weight_decay_mask),
                              optax.sgd(learning_rate))
        return ClientTraining(decayed, steps, batch, sampling)
    return sgd(learning_rate, steps=steps, batch_size=batch, sampling=sampling)


def lr_decayed(table: Mapping[str, Method],
               client_training: Callable[[dict, object], ClientTraining]) -> dict[str, Method]:
    """`table` with every row's clients training at lr·lr_decay^t in round t (setting
    lr_decay; 1 or absent: the row as it is): the row's algorithm with its round rebuilt
    at that rate (`methods.with_lr_decay`), from `client_training` (plain SGD at the rate
    for a row whose maths assume it, as `study.training_of`)."""

    def decayed(name: str, row: Method) -> Method:
        def training_at(s: dict, rate) -> ClientTraining:
            training = client_training(s, rate)
            if row.sgd:
                training = sgd(rate, steps=training.steps, batch_size=training.batch_size,
                               sampling=training.sampling, work=training.work)
            return training

        def wrap(algorithm, b: Build):
            if row.wrap is not None:
                algorithm = row.wrap(algorithm, b)
            decay = b.s.get("lr_decay", 1.0)
            if decay == 1.0:
                return algorithm
            plain = {**b.table, name: row}

            def build_at(rate):
                return build(name, plain, b.model, training_at(b.s, rate), b.s,
                             problem=b.problem)

            lr = b.s[setting_of(row, "lr", b.s)]
            return algorithm._replace(round=with_lr_decay(build_at, lr, decay).round)

        return row.replace(wrap=wrap)

    return {name: decayed(name, row) for name, row in table.items()}
