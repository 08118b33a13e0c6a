"""fedjax_sim: a JAX-vectorized, high-throughput simulator of heterogeneous federated learning.

Every client, cluster model, restart and sweep trial lives on a leading array
axis; one round of an algorithm is one jit-compiled function.
"""

__version__ = "0.1.0"

from fedjax_sim import algorithms, data, metrics, models, ops, simulate  # noqa: E402
from fedjax_sim.algorithms import (  # noqa: E402
    ALGORITHMS,
    Algorithm,
    ClientTraining,
    afl,
    cfl,
    ditto,
    drfa,
    drflm,
    fedadagrad,
    fedadam,
    fedavg,
    fedavgm,
    fednova,
    fedprox,
    fedyogi,
    hypcluster,
    ifca,
    local_models,
    mixed_centralized,
    mixed_gt1,
    mixed_gt2,
    mixed_parallel,
    one_shot_clustering,
    qffl,
    robust_ifca,
    scaffold,
    sgd,
    with_restarts,
    with_seeds,
    with_systems,
)
from fedjax_sim.data import FederatedData, ServerData, linear_mixture  # noqa: E402
from fedjax_sim.execution import Checkpoints, Execution  # noqa: E402
from fedjax_sim.models import Model, linear_regression, mlp_classifier  # noqa: E402
from fedjax_sim.ops.work import Work  # noqa: E402
from fedjax_sim.systems import Systems  # noqa: E402

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Checkpoints",
    "ClientTraining",
    "Execution",
    "FederatedData",
    "Model",
    "ServerData",
    "Systems",
    "Work",
    "afl",
    "algorithms",
    "cfl",
    "data",
    "ditto",
    "drfa",
    "drflm",
    "fedadagrad",
    "fedadam",
    "fedavg",
    "fedavgm",
    "fednova",
    "fedprox",
    "fedyogi",
    "hypcluster",
    "ifca",
    "linear_mixture",
    "linear_regression",
    "local_models",
    "metrics",
    "mixed_centralized",
    "mixed_gt1",
    "mixed_gt2",
    "mixed_parallel",
    "mlp_classifier",
    "models",
    "one_shot_clustering",
    "ops",
    "qffl",
    "robust_ifca",
    "scaffold",
    "sgd",
    "simulate",
    "with_restarts",
    "with_seeds",
    "with_systems",
]
