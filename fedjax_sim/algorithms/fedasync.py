"""FedAsync: every arrival mixed into the server model at once, in virtual time.

Cong Xie, Sanmi Koyejo, Indranil Gupta. "Asynchronous Federated Optimization".
arXiv:1903.03934, 2019.

K clients train at once, each from the server model of the version it downloaded
(the paper's Algorithm 1, its scheduler keeping K tasks in flight); the server
updates on every arrival:

    arriving client j:  y_j ← LocalUpdate(x_{v_j})      (`training`, with the paper's
                                                          ρ/2 ‖y − x_{v_j}‖² when mu = ρ > 0)
                        α_t ← α · s(v − v_j)
                        x   ← (1 − α_t) x + α_t y_j;  v ← v + 1

s is the polynomial (1 + τ)^−a, the hinge (1 if τ ≤ b, else 1/(a (τ − b) + 1)) or
a constant. When the clients arrive and which ones the freed slots draw is the event
rule of `algorithms.asynchronous` with a buffer of one (one round = one arrival).

Choices [I]:
- An arrival staler than `max_staleness` is discarded (its version has left the
  ring of max_staleness + 1 versions kept), and so is a failed trip (its client went
  offline, or dropped out): the model is then unchanged for that step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.asynchronous import (
    asynchronous,
    check_clock,
    check_count,
    check_staleness,
    mixed,
    staleness_weight,
)
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.fedprox import proximal_term
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.models.core import Model
from fedjax_sim.ops.clock import Clock


def fedasync(model: Model, training: ClientTraining, *, concurrency: int = 100,
             alpha=0.6, staleness: str = "polynomial", staleness_a=0.5, staleness_b=4.0,
             mu=0.0, max_staleness: int = 50, clock: Clock | None = None) -> Algorithm:
    """Builds FedAsync.

    Args:
      model: the shared model.
      training: each client's local steps (`ClientTraining`).
      concurrency: K, the clients in flight (static).
      alpha: α in (0, 1], the mixing weight of a fresh arrival (may be traced).
      staleness: s(τ): "polynomial", "hinge" or "constant".
      staleness_a, staleness_b: a and b of s.
      mu: ρ ≥ 0, the proximal weight of the paper's regularised local objective
        (0: the training's plain steps; may be traced).
      max_staleness: the largest staleness applied (static); the server keeps
        max_staleness + 1 versions of its model.
      clock: the clients' speeds and windows (`ops.clock.Clock`; None: every client
        one second per step, free communication, always online).

    Returns:
      Algorithm(init, round, evaluate) with state AsyncState; one round is one arrival.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedasync, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops.clock import Clock
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedasync(linear_regression(3), sgd(0.1, steps=5), concurrency=4, alpha=0.5,
      ...                staleness="hinge", staleness_a=10.0, staleness_b=4.0,
      ...                clock=Clock(spread=1.0))
      >>> state = alg.init(jax.random.key(1), data)
      >>> round_ = jax.jit(alg.round)
      >>> for key in jax.random.split(jax.random.key(2), 3):
      ...     state, metrics = round_(state, data, key)
      >>> int(state.version), int(metrics["trips"])
      (3, 3)

    References:
      Cong Xie, Sanmi Koyejo, Indranil Gupta, "Asynchronous Federated Optimization",
      arXiv 2019, https://arxiv.org/abs/1903.03934.
    """
    check_training("fedasync", training)
    check_count("fedasync", "concurrency", concurrency)
    check_count("fedasync", "max_staleness", max_staleness, minimum=0)
    check_staleness("fedasync", staleness, staleness_a, staleness_b)
    check_learning_rate("fedasync's alpha", alpha, positive=True)
    if not isinstance(alpha, jax.core.Tracer) and jnp.ndim(alpha) == 0 and float(alpha) > 1:
        raise ValueError(f"fedasync's alpha must be in (0, 1]; got {alpha!r}.")
    check_learning_rate("mu", mu)
    clock = check_clock("fedasync", clock)
    if not (isinstance(mu, int | float) and mu == 0):
        training = training.preceded_by(proximal_term(mu))
    s = staleness_weight(staleness, staleness_a, staleness_b)

    def server_step(x, total, total_weight, count):  # (1 − α_t) x + α_t y
        del count
        return mixed(x, total, total_weight)

    return asynchronous("fedasync", model, training, concurrency=concurrency, buffer_size=1,
                        max_staleness=max_staleness, clock=clock,
                        weight=lambda tau: alpha * s(tau),
                        client_value=lambda start, trained: trained,
                        server_step=server_step)
