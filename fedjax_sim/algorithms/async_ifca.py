"""Asynchronous IFCA: FedBuff's buffered server step applied per cluster, in virtual time.

Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran. "An Efficient Framework for
Clustered Federated Learning". NeurIPS 2020, arXiv:2006.04088 (the clusters, each
client choosing the model of lowest loss); John Nguyen et al. "Federated Learning with
Buffered Asynchronous Aggregation". AISTATS 2022, arXiv:2106.06639 (the buffer).

K clients train at once, each on the k cluster models of the version it downloaded;
the server steps once B updates have arrived, each cluster on the updates that chose it:

    each arriving client j:  ĵ ← argmin_c F_j(x^c_{v_j})              (IFCA's choice, on
                                                                      what it downloaded)
                             Δ_j ← LocalUpdate(x^ĵ_{v_j}) − x^ĵ_{v_j}  (`training`)
                             τ_j ← v − v_j                             (staleness)
    after B arrivals, each cluster c chosen by n_c ≥ 1 of them:
                             x^c ← x^c + η_g · (1/n_c) Σ_{j: ĵ=c} s(τ_j) Δ_j
                             (a cluster none chose keeps its model)
    v ← v + 1

When the clients arrive, which ones the freed slots draw, and how past versions are
kept are the event rule of `algorithms.asynchronous` (one round = one server step; the
round metrics `virtual_time`, `trips`, `staleness`, `updates`, `clusters_moved`).

Choices [I]:
- One buffer of B arrivals for all clusters, one version counter (staleness counts
  server steps, whichever clusters they moved), one ring of R versions of the k models:
  a client trains on exactly the cluster model it downloaded. (Per-cluster buffers would
  let a rarely chosen cluster hold its arrivals back for long; with one buffer, every
  cluster steps as soon as any B arrivals are in, on the mean of its own.)
- A client chooses when its upload is computed, from the models of its download: the
  same choice as at download time, since F_j and x_{v_j} do not change in between.
- A trip downloads k models and uploads one: the clock's communication time is
  (k + 1) · model bytes / bandwidth.
- As in FedBuff: an update staler than `max_staleness` is discarded; a failed trip is
  an event of the B but brings no update; SGD server step at η_g.
"""

from __future__ import annotations

import jax

from fedjax_sim.algorithms.asynchronous import (
    asynchronous,
    check_buffered,
    check_count,
    delta,
    staleness_weight,
)
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.training import ClientTraining
from fedjax_sim.models.core import Model
from fedjax_sim.ops.clock import Clock


def async_ifca(model: Model, training: ClientTraining, *, num_clusters: int,
               concurrency: int = 100, buffer_size: int = 10, server_lr=None,
               staleness: str = "polynomial", staleness_a=0.5, staleness_b=4.0,
               max_staleness: int = 50, clock: Clock | None = None) -> Algorithm:
    """Builds asynchronous IFCA (FedBuff per cluster).

    Args:
      model: the model of every cluster.
      training: each client's local steps (`ClientTraining`).
      num_clusters: k, the cluster models (static).
      concurrency: K, the clients in flight (static).
      buffer_size: B ≤ K, the updates one server step waits for (static).
      server_lr: η_g (None: 1; may be traced).
      staleness: s(τ): "polynomial" (1 + τ)^−a, "hinge" or "constant" (as `fedbuff`).
      staleness_a, staleness_b: a and b of s.
      max_staleness: the largest staleness applied (static); the server keeps
        max_staleness + 1 versions of its k models.
      clock: the clients' speeds and windows (`ops.clock.Clock`; None: every client
        one second per step, free communication, always online).

    Returns:
      Algorithm(init, round, evaluate) with state AsyncState whose params have leaves
      [k, ...]; one round is one server step; evaluation serves each client the cluster
      model of lowest loss on its data (IFCA's).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import async_ifca, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops.clock import Clock
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = async_ifca(linear_regression(3), sgd(0.1, steps=5), num_clusters=2,
      ...                  concurrency=6, buffer_size=2, clock=Clock(spread=1.0))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state.params.shape  # k models of d parameters
      (2, 3)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> int(state.version), int(metrics["trips"]), alg.evaluate(state, data)["assignment"].shape
      (1, 2, (8,))

    References:
      Avishek Ghosh, Jichan Chung, Dong Yin, Kannan Ramchandran, "An Efficient Framework
      for Clustered Federated Learning", NeurIPS 2020, https://arxiv.org/abs/2006.04088;
      John Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
      AISTATS 2022, https://arxiv.org/abs/2106.06639.
    """
    check_count("async_ifca", "num_clusters", num_clusters)
    eta, clock = check_buffered("async_ifca", training, concurrency=concurrency,
                                buffer_size=buffer_size, max_staleness=max_staleness,
                                staleness=staleness, staleness_a=staleness_a,
                                staleness_b=staleness_b, server_lr=server_lr, clock=clock)

    def server_step(x, total, total_weight, count):  # x^c + η_g Σ_{j: ĵ=c} s(τ_j) Δ_j / n_c
        del total_weight

        def step(p, t):
            shape = (count.shape[0],) + (1,) * (p.ndim - 1)
            return p + eta * t / count.reshape(shape).astype(p.dtype)

        return jax.tree.map(step, x, total)  # n_c = 0: Δ sum 0, the model kept

    return asynchronous("async_ifca", model, training, concurrency=concurrency,
                        buffer_size=buffer_size, max_staleness=max_staleness, clock=clock,
                        weight=staleness_weight(staleness, staleness_a, staleness_b),
                        client_value=delta, server_step=server_step,
                        num_clusters=num_clusters)
