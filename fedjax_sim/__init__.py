"""fedjax_sim: a JAX-vectorized, high-throughput simulator of heterogeneous federated learning.

Every client, cluster model, restart and sweep trial lives on a leading array
axis; one round of an algorithm is one jit-compiled function.

The names below are imported on first use (PEP 562), so `import fedjax_sim` (and the
`fedjax-sim` command, which checks its settings before anything else) does not import JAX.
"""

__version__ = "0.1.0"

import importlib
from typing import TYPE_CHECKING

# name -> the module it comes from; a submodule is its own entry.
_LAZY = {
    **{m: f"fedjax_sim.{m}" for m in ("algorithms", "data", "metrics", "models", "ops",
                                      "simulate")},
    **dict.fromkeys(("ALGORITHMS", "Algorithm", "ClientTraining", "afl", "async_ifca", "cfl",
                     "ditto",
                     "drfa", "drflm", "fedadagrad", "fedadam", "fedasync", "fedavg", "fedavgm",
                     "fedbuff", "fednova",
                     "fedprox", "fedyogi", "hypcluster", "ifca", "local_models",
                     "mixed_centralized", "mixed_gt1", "mixed_gt2", "mixed_parallel",
                     "one_shot_clustering", "qffl", "robust_ifca", "scaffold", "sgd",
                     "with_aggregator", "with_dp", "with_dp_ftrl", "with_restarts", "with_seeds",
                     "with_systems", "AdaptiveClipping"), "fedjax_sim.algorithms"),
    **dict.fromkeys(("FederatedData", "ServerData", "linear_mixture"), "fedjax_sim.data"),
    **dict.fromkeys(("Model", "linear_regression", "mlp_classifier"), "fedjax_sim.models"),
    "Clock": "fedjax_sim.ops.clock",
    **dict.fromkeys(("Checkpoints", "Execution"), "fedjax_sim.execution"),
    "Work": "fedjax_sim.ops.work",
    "Systems": "fedjax_sim.systems",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedjax_sim' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"fedjax_sim.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from fedjax_sim import algorithms, data, metrics, models, ops, simulate  # noqa: F401
    from fedjax_sim.algorithms import (  # noqa: F401
        ALGORITHMS,
        AdaptiveClipping,
        Algorithm,
        ClientTraining,
        afl,
        async_ifca,
        cfl,
        ditto,
        drfa,
        drflm,
        fedadagrad,
        fedadam,
        fedasync,
        fedavg,
        fedavgm,
        fedbuff,
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
        with_aggregator,
        with_dp,
        with_dp_ftrl,
        with_restarts,
        with_seeds,
        with_systems,
    )
    from fedjax_sim.data import FederatedData, ServerData, linear_mixture  # noqa: F401
    from fedjax_sim.execution import Checkpoints, Execution  # noqa: F401
    from fedjax_sim.models import Model, linear_regression, mlp_classifier  # noqa: F401
    from fedjax_sim.ops.clock import Clock  # noqa: F401
    from fedjax_sim.ops.work import Work  # noqa: F401
    from fedjax_sim.systems import Systems  # noqa: F401

__all__ = [
    "ALGORITHMS",
    "AdaptiveClipping",
    "Algorithm",
    "Checkpoints",
    "ClientTraining",
    "Clock",
    "Execution",
    "FederatedData",
    "Model",
    "ServerData",
    "Systems",
    "Work",
    "afl",
    "algorithms",
    "async_ifca",
    "cfl",
    "data",
    "ditto",
    "drfa",
    "drflm",
    "fedadagrad",
    "fedadam",
    "fedasync",
    "fedavg",
    "fedavgm",
    "fedbuff",
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
    "with_aggregator",
    "with_dp",
    "with_dp_ftrl",
    "with_restarts",
    "with_seeds",
    "with_systems",
]
