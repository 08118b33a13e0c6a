"""q-FFL by q-FedAvg: fair federated learning that weighs clients by their loss to the q.

Tian Li, Maziar Sanjabi, Ahmad Beirami, Virginia Smith. "Fair Resource
Allocation in Federated Learning". ICLR 2020, arXiv:1905.10497.

q-FFL minimises f_q(w) = Σ_k p_k F_k^{q+1}(w) / (q + 1): the larger q, the
more weight on the clients with the largest loss. One round of q-FedAvg (the
paper's Algorithm 2):

    S_t   ← a cohort of the clients
    each k ∈ S_t:  F_k ← F_k(w_t) on its training data
                   w̄_k ← τ local SGD steps from w_t
                   ΔW_k ← L (w_t − w̄_k)
                   Δ_k  ← F_k^q ΔW_k
                   h_k  ← q F_k^{q−1} ‖ΔW_k‖² + L F_k^q
    w_{t+1} ← w_t − Σ_k Δ_k / Σ_k h_k

with L = 1/η, η the local learning rate (the paper's estimate of the
Lipschitz constant of ∇F_k). At q = 0, Δ_k = ΔW_k and h_k = L, so w_{t+1} is
the uniform mean of the w̄_k: FedAvg, equal up to rounding (not bit for bit).

Choices, following the authors' code (`flearn/trainers/qffedavg.py`) [I]:
- F_k is the loss on the client's whole training data at w_t, and F_k^q is
  (F_k + 1e-10)^q, so a client with zero loss gives no 0·∞.
- ‖ΔW_k‖² is the squared norm of all the model's parameters together.
- The cohort is uniform without replacement (the code samples ∝ examples
  without replacement; the objective's p_k are then uniform here); the sums
  over S_t are unweighted, as in the paper.
- A client without data takes no part (it is left out of both sums); a
  round whose cohort holds no data keeps w.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    check_inputs,
    cohorts,
    mean_over,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.training import (
    ClientTraining,
    check_learning_rate,
    check_training,
    sgd_rate,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model, client_loss
from fedjax_sim.ops import cohort_sums, weighted_sum

DEFAULT_Q = 1.0  # from the paper's grid (q ∈ {0.001, …, 1, 2, 5, 15}); tune it
LOSS_FLOOR = 1e-10  # the authors' code: np.float_power(loss + 1e-10, q)


class QFFLState(NamedTuple):
    params: object  # pytree, the global model w_t
    round: jax.Array  # int32


def qffl(model: Model, training: ClientTraining, *, q=DEFAULT_Q,
         participation: float = 1.0) -> Algorithm:
    """Builds q-FedAvg.

    Args:
      model: the shared model.
      training: the clients' local steps, plain SGD at η > 0 (`sgd(η, ...)`): the
        Lipschitz estimate is L = 1/η.
      q: q ≥ 0, the fairness exponent (0: FedAvg); may be traced.
      participation: |S_t| / N, uniform without replacement.

    Returns:
      Algorithm(init, round, evaluate) with state QFFLState. Round metrics:
      cohort_loss (the cohort's mean F_k(w_t)) and fair_weight_max (the largest
      share F_k^q / Σ_S F^q of a cohort client).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import qffl, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = qffl(linear_regression(3), sgd(0.1, steps=5), q=1.0)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

      Its maths assume plain SGD at a known rate:

      >>> import optax
      >>> from fedjax_sim.algorithms import ClientTraining
      >>> qffl(linear_regression(3), ClientTraining(optax.adam(0.1)))
      Traceback (most recent call last):
      ...
      ValueError: qffl trains its clients with plain SGD (...): give training=sgd(...).

    References:
      Tian Li, Maziar Sanjabi, Ahmad Beirami, Virginia Smith, "Fair Resource
      Allocation in Federated Learning", ICLR 2020, https://arxiv.org/abs/1905.10497.
    """
    check_training("qffl", training)
    check_learning_rate("q", q)
    sgd_rate(training, "qffl", "its Lipschitz estimate is L = 1/η")
    clients = cohorts(participation)

    def init(key, data: FederatedData) -> QFFLState:
        params = model.init(key)
        check_inputs(model, params, data)
        return QFFLState(params, jnp.zeros((), jnp.int32))

    def client(training_t, w, x, y, count, key, work):  # one client's Δ_k, h_k and F_k^q
        lipschitz = 1.0 / training_t.learning_rate  # L = 1/η of the round
        loss = client_loss(model, w, x, y, count) + LOSS_FLOOR
        trained, _, _ = training_t.update(model, w, x, y, count, key, **work)
        delta_w = jax.tree.map(lambda a, b: lipschitz * (a - b), w, trained)
        fq = loss**q
        h = q * loss ** (q - 1.0) * optax.tree.norm(delta_w, squared=True) + lipschitz * fq
        return optax.tree.scale(fq, delta_w), h, fq, loss - LOSS_FLOOR

    def round_(state: QFFLState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        training_t = training.at_round(state.round)  # the round's rate η_t

        def client_step(batch):
            delta, h, fq, loss = jax.vmap(functools.partial(client, training_t),
                                          in_axes=(None, 0, 0, 0, 0, 0))(
                state.params, batch.data.x, batch.data.y, batch.data.num_examples, batch.keys,
                batch.slot_work())
            taking_part = batch.active.astype(jnp.float32)
            sums = (weighted_sum(delta, taking_part), jnp.sum(taking_part * h),
                    jnp.sum(taking_part * fq))
            return sums, (loss, fq, batch.active)

        (delta_total, h_total, fq_total), (losses, fq, active) = cohort_sums(
            client_step, data, cohort)
        # w_{t+1} = w_t − Σ Δ_k / Σ h_k (kept when no client with data took part)
        params = jax.tree.map(
            lambda w, d: jnp.where(h_total > 0, w - d / jnp.maximum(h_total, 1e-30), w),
            state.params, delta_total)
        metrics = {
            "cohort_loss": mean_over(losses, active),
            **clients.participants(data, active),
            "fair_weight_max": jnp.max(jnp.where(active, fq, 0.0))
            / jnp.maximum(fq_total, 1e-30),
        }
        return QFFLState(params, state.round + 1), metrics

    def evaluate(state: QFFLState, data: FederatedData) -> dict:
        return evaluate_shared(model, state.params, data)

    return Algorithm(init, round_, evaluate)
