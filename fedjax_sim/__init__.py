"""fedjax_sim: a JAX-vectorized, high-throughput simulator of heterogeneous federated learning.

Every client, cluster model, restart and sweep trial lives on a leading array
axis; one round of an algorithm is one jit-compiled function.
"""

__version__ = "0.1.0"

from fedjax_sim import algorithms, data, metrics, models, ops, simulate  # noqa: E402
from fedjax_sim.algorithms import (  # noqa: E402
    ALGORITHMS,
    Algorithm,
    fedavg,
    ifca,
    local_models,
    one_shot_clustering,
    with_restarts,
    with_seeds,
)
from fedjax_sim.data import FederatedData, ServerData, linear_mixture  # noqa: E402
from fedjax_sim.models import Model, linear_regression, mlp_classifier  # noqa: E402

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "FederatedData",
    "Model",
    "ServerData",
    "algorithms",
    "data",
    "fedavg",
    "ifca",
    "linear_mixture",
    "linear_regression",
    "local_models",
    "metrics",
    "mlp_classifier",
    "models",
    "one_shot_clustering",
    "ops",
    "simulate",
    "with_restarts",
    "with_seeds",
]
