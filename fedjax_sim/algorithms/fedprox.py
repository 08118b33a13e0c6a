"""FedProx: FedAvg whose local steps minimise a proximal objective.

Tian Li, Anit Kumar Sahu, Manzil Zaheer, Maziar Sanjabi, Ameet Talwalkar,
Virginia Smith. "Federated Optimization in Heterogeneous Networks". MLSys
2020, arXiv:1812.06127.

Algorithm 2 of the paper: each selected device k approximately minimises

    h_k(w; w_t) = F_k(w) + μ/2 ‖w − w_t‖²

from w_t, and the server averages the results (`with_dp`: the clipped, noised
mean of the changes w_k − w_t instead, FedAvg's). Here "approximately" is τ
steps of the client optimizer on h_k, whose gradient is
∇F_k(w) + μ (w − w_t): the proximal term is in every local step. μ = 0 is
FedAvg exactly (the same arithmetic plus an exact zero).

Choices [I]:
- The proximal gradient μ (w − w_t) is added to the minibatch gradient before
  the client optimizer (`proximal_term`, an optax transformation whose state
  holds w_t, the params the client optimizer starts from), so any optax
  client optimizer minimises h_k; with SGD it is the paper's local solver.
- Systems heterogeneity (the paper's stragglers doing fewer epochs, kept as
  γ-inexact solutions) is the shared machinery of every algorithm:
  per-client local work in the training (`ops.work.Work`) and stragglers
  under `with_systems(fedprox(...), Systems(stragglers=..., straggler_policy=
  "keep"))`; FedAvg dropping them is the policy "drop".
- The cohort is uniform without replacement and the average uniform or by
  examples, as in `fedavg` (the paper samples ∝ p_k and averages uniformly;
  its code averages by examples). A server optimizer (FedOpt) may replace the
  average: `with_server_optimizer(fedprox(...), ...)`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.fedavg import fedavg
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.models.core import Model

DEFAULT_MU = 0.01  # from the paper's grid {0.001, 0.01, 0.1, 1}; tune it


class ProximalState(NamedTuple):
    anchor: Any  # pytree like params: w_t, the params the client started from


def proximal_term(mu) -> optax.GradientTransformation:
    """g ↦ g + μ (w − w_t): the gradient of μ/2 ‖w − w_t‖² added to the loss's.

    w_t is the params the transformation was initialised with (a client
    optimizer is initialised at the round's start model), so chained before
    the client optimizer it makes the local steps minimise FedProx's h_k.
    μ may be traced.
    """

    def init(params):
        return ProximalState(params)

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("proximal_term needs the params in update(grads, state, params).")
        return jax.tree.map(lambda g, w, w_t: g + mu * (w - w_t), grads, params,
                            state.anchor), state

    return optax.GradientTransformation(init, update)


def fedprox(model: Model, training: ClientTraining, *, mu=DEFAULT_MU,
            participation: float = 1.0, weighting: str = "uniform") -> Algorithm:
    """Builds FedProx: FedAvg with μ/2 ‖w − w_t‖² in every local step.

    Args:
      model: the shared model.
      training: how each client trains; its optimizer is applied to the
        proximal objective's gradient (`proximal_term` chained before it).
      mu: μ ≥ 0, the proximal coefficient; may be traced (a sweep vmaps it).
      participation, weighting: as in `fedavg`.

    Returns:
      Algorithm(init, round, evaluate) with state FedAvgState.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedprox, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedprox(linear_regression(3), sgd(0.1, steps=5), mu=0.01)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

    References:
      Tian Li, Anit Kumar Sahu, Manzil Zaheer, Maziar Sanjabi, Ameet Talwalkar,
      Virginia Smith, "Federated Optimization in Heterogeneous Networks", MLSys 2020,
      https://arxiv.org/abs/1812.06127.
    """
    check_training("fedprox", training)
    check_learning_rate("mu", mu)
    proximal = training.preceded_by(proximal_term(mu))
    return fedavg(model, proximal, participation=participation, weighting=weighting)
