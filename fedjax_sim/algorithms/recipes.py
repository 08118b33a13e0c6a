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
    """FedAvgM (Hsu et al. 2019): FedAvg with server momentum 0.9 on the mean delta.

    Args:
      model: the shared model.
      training: how each client trains (`ClientTraining`, e.g. `sgd(0.1, steps=5)`).
      participation, weighting: as in `fedavg`.
      server_lr: the server optimizer's η (None: 1); may be traced.

    Returns:
      Algorithm with state FedAvgState (`server_state`: the server optimizer's).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import fedavgm, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedavgm(linear_regression(3), sgd(0.1, steps=5), server_lr=1.0)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)
      >>> jax.tree.map(jnp.shape, state.server_state)[0]  # the server's momentum
      TraceState(trace=(3,))

    References:
      Tzu-Ming Harry Hsu, Hang Qi, Matthew Brown, "Measuring the Effects of
      Non-Identical Data Distribution for Federated Visual Classification", arXiv
      2019, https://arxiv.org/abs/1909.06335; as a FedOpt server optimizer:
      Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
      Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan, "Adaptive Federated
      Optimization", ICLR 2021, https://arxiv.org/abs/2003.00295.
    """
    return _fedopt("sgdm", model, training, participation, weighting, server_lr)


def fedadam(model: Model, training: ClientTraining, *, participation: float = 1.0,
            weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedAdam (Reddi et al. 2021, Algorithm 2): Adam on the server, on the mean delta.

    Args:
      model: the shared model.
      training: how each client trains (`ClientTraining`, e.g. `sgd(0.1, steps=5)`).
      participation, weighting: as in `fedavg`.
      server_lr: the server optimizer's η (None: 1e-2); may be traced.

    Returns:
      Algorithm with state FedAvgState (`server_state`: the server optimizer's).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import fedadam, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedadam(linear_regression(3), sgd(0.1, steps=5), server_lr=0.01)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)
      >>> jax.tree.map(jnp.shape, state.server_state)[0]  # the server's moments
      AdaptiveState(m=(3,), v=(3,))

    References:
      Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
      Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan, "Adaptive Federated
      Optimization", ICLR 2021, https://arxiv.org/abs/2003.00295.
    """
    return _fedopt("adam", model, training, participation, weighting, server_lr)


def fedyogi(model: Model, training: ClientTraining, *, participation: float = 1.0,
            weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedYogi (Reddi et al. 2021, Algorithm 2): Yogi on the server, on the mean delta.

    Args:
      model: the shared model.
      training: how each client trains (`ClientTraining`, e.g. `sgd(0.1, steps=5)`).
      participation, weighting: as in `fedavg`.
      server_lr: the server optimizer's η (None: 1e-2); may be traced.

    Returns:
      Algorithm with state FedAvgState (`server_state`: the server optimizer's).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import fedyogi, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedyogi(linear_regression(3), sgd(0.1, steps=5), server_lr=0.01)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)
      >>> jax.tree.map(jnp.shape, state.server_state)[0]  # the server's moments
      AdaptiveState(m=(3,), v=(3,))

    References:
      Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
      Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan, "Adaptive Federated
      Optimization", ICLR 2021, https://arxiv.org/abs/2003.00295.
    """
    return _fedopt("yogi", model, training, participation, weighting, server_lr)


def fedadagrad(model: Model, training: ClientTraining, *, participation: float = 1.0,
               weighting: str = "uniform", server_lr=None) -> Algorithm:
    """FedAdagrad (Reddi et al. 2021, Algorithm 2): Adagrad on the server, on the mean delta.

    Args:
      model: the shared model.
      training: how each client trains (`ClientTraining`, e.g. `sgd(0.1, steps=5)`).
      participation, weighting: as in `fedavg`.
      server_lr: the server optimizer's η (None: 1e-2); may be traced.

    Returns:
      Algorithm with state FedAvgState (`server_state`: the server optimizer's).

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from fedjax_sim.algorithms import fedadagrad, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = fedadagrad(linear_regression(3), sgd(0.1, steps=5), server_lr=0.01)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)
      >>> jax.tree.map(jnp.shape, state.server_state)[0]  # the server's moments
      AdaptiveState(m=(3,), v=(3,))

    References:
      Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
      Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan, "Adaptive Federated
      Optimization", ICLR 2021, https://arxiv.org/abs/2003.00295.
    """
    return _fedopt("adagrad", model, training, participation, weighting, server_lr)
