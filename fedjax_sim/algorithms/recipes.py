"""FedOpt's named server optimizers as one-line recipes over `fedavg` (Reddi et al., ICLR 2021).

Each is `with_server_optimizer(fedavg(...), name, server_lr)`; server_lr None takes the
optimizer's default (`server.DEFAULT_SERVER_LR`: 1 for FedAvgM, 1e-2 for the adaptive
ones, the order of the paper's tuned η on its image tasks). Tune it.
"""

from __future__ import annotations

from fedjax_sim.algorithms.base import Algorithm, with_server_optimizer
from fedjax_sim.algorithms.fedavg import fedavg
from fedjax_sim.algorithms.training import ClientTraining
from fedjax_sim.models.core import Model


def _fedopt(name: str, model, training, participation, weighting, server_lr) -> Algorithm:
    return with_server_optimizer(
        fedavg(model, training, participation=participation, weighting=weighting), name,
        server_lr)


def fedavgm(model: Model, training: ClientTraining, *, participation: float = 1.0,
            weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedAvgM (Hsu et al. 2019): FedAvg with server momentum 0.9 on the mean delta."""
    return _fedopt("sgdm", model, training, participation, weighting, server_lr)


def fedadam(model: Model, training: ClientTraining, *, participation: float = 1.0,
            weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedAdam (Reddi et al. 2021, Algorithm 2)."""
    return _fedopt("adam", model, training, participation, weighting, server_lr)


def fedyogi(model: Model, training: ClientTraining, *, participation: float = 1.0,
            weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedYogi (Reddi et al. 2021, Algorithm 2)."""
    return _fedopt("yogi", model, training, participation, weighting, server_lr)


def fedadagrad(model: Model, training: ClientTraining, *, participation: float = 1.0,
               weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedAdagrad (Reddi et al. 2021, Algorithm 2)."""
    return _fedopt("adagrad", model, training, participation, weighting, server_lr)
