"""FedBuff: buffered asynchronous aggregation, in virtual time.

John Nguyen, Kshitiz Malik, Hongyuan Zhan, Ashkan Yousefpour, Michael Rabbat, Mani
Malek, Dzmitry Huba. "Federated Learning with Buffered Asynchronous Aggregation".
AISTATS 2022, arXiv:2106.06639.

K clients train at once, each from the server model of the version it downloaded;
the server steps once B updates have arrived (the paper's Algorithm 1, its K being
the buffer B here), each update scaled by its staleness:

    each arriving client j:  Δ_j ← LocalUpdate(x_{v_j}) − x_{v_j}     (`training`)
                             τ_j ← v − v_j                            (staleness)
    after B arrivals:        x ← x + η_g · (1/B) Σ_j s(τ_j) Δ_j        s(τ) = 1/√(1 + τ)
                             v ← v + 1

When the clients arrive, which ones the freed slots draw, and how the past versions
are kept are the event rule of `algorithms.asynchronous` (one round = one server
step; the round metrics `virtual_time`, `trips`, `staleness`, `updates`).

Choices [I]:
- An update staler than `max_staleness` is discarded (its version has left the ring
  of the max_staleness + 1 versions kept); its slot draws a new client like any other.
- A server step takes the B earliest *events*, and a trip that failed (its client
  went offline, or dropped out) is one: the step then averages the uploads among
  them, dividing by their number (the paper's 1/B when none failed).
- The server step is SGD at η_g = server_lr (the paper's experiments also use
  server momentum; FedOpt around FedBuff is not offered, because the ring must hold
  the models the server actually produced).
"""

from __future__ import annotations

import jax

from fedjax_sim.algorithms.asynchronous import (
    asynchronous,
    check_buffered,
    delta,
    staleness_weight,
)
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.training import ClientTraining
from fedjax_sim.models.core import Model
from fedjax_sim.ops.clock import Clock


def fedbuff(model: Model, training: ClientTraining, *, concurrency: int = 100,
            buffer_size: int = 10, server_lr=None, staleness: str = "polynomial",
            staleness_a=0.5, staleness_b=4.0, max_staleness: int = 50,
            clock: Clock | None = None) -> Algorithm:
    """Builds FedBuff.

    Args:
      model: the shared model.
      training: each client's local steps (`ClientTraining`); its `work` decides τ_i,
        which the clock turns into time.
      concurrency: K, the clients in flight (static).
      buffer_size: B ≤ K, the updates one server step waits for (static; B = K with
        equal speeds is synchronous FedAvg).
      server_lr: η_g (None: 1; may be traced).
      staleness: s(τ), "polynomial" (1 + τ)^−a (a = 1/2: the paper's 1/√(1 + τ)),
        "hinge" (1 if τ ≤ b, else 1/(a (τ − b) + 1)) or "constant" (1).
      staleness_a, staleness_b: a and b of s.
      max_staleness: the largest staleness applied (static); the server keeps
        max_staleness + 1 versions of its model.
      clock: the clients' speeds and windows (`ops.clock.Clock`; None: every client
        one second per step, free communication, always online).

    Returns:
      Algorithm(init, round, evaluate) with state AsyncState; one round is one server
      step.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedbuff, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops.clock import Clock
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedbuff(linear_regression(3), sgd(0.1, steps=5), concurrency=6, buffer_size=2,
      ...               clock=Clock(step_seconds=1.0, spread=1.0))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> sorted(metrics)
      ['cohort_loss', 'staleness', 'trips', 'updates', 'virtual_time']
      >>> int(state.version), int(metrics["trips"])
      (1, 2)
      >>> fedbuff(linear_regression(3), sgd(0.1), concurrency=4, buffer_size=5)
      Traceback (most recent call last):
      ...
      ValueError: fedbuff's buffer_size (B=5) must be at most its concurrency (K=4): ...

    References:
      John Nguyen, Kshitiz Malik, Hongyuan Zhan, Ashkan Yousefpour, Michael Rabbat, Mani
      Malek, Dzmitry Huba, "Federated Learning with Buffered Asynchronous Aggregation",
      AISTATS 2022, https://arxiv.org/abs/2106.06639.
    """
    eta, clock = check_buffered("fedbuff", training, concurrency=concurrency,
                                buffer_size=buffer_size, max_staleness=max_staleness,
                                staleness=staleness, staleness_a=staleness_a,
                                staleness_b=staleness_b, server_lr=server_lr, clock=clock)

    def server_step(x, total, total_weight, count):  # x + η_g Σ_j s(τ_j) Δ_j / count
        del total_weight
        return jax.tree.map(lambda p, t: p + eta * t / count, x, total)

    return asynchronous("fedbuff", model, training, concurrency=concurrency,
                        buffer_size=buffer_size, max_staleness=max_staleness, clock=clock,
                        weight=staleness_weight(staleness, staleness_a, staleness_b),
                        client_value=delta, server_step=server_step)
