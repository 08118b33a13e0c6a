"""Algorithms as NamedTuples of pure functions, and their registry."""

from fedjax_sim.algorithms.afl import afl
from fedjax_sim.algorithms.base import Algorithm, with_restarts, with_seeds
from fedjax_sim.algorithms.cfl import cfl
from fedjax_sim.algorithms.ditto import ditto
from fedjax_sim.algorithms.drfa import drfa, drflm
from fedjax_sim.algorithms.fedavg import FedAvgState, fedavg
from fedjax_sim.algorithms.fedprox import fedprox
from fedjax_sim.algorithms.hypcluster import hypcluster
from fedjax_sim.algorithms.ifca import IFCAState, ifca
from fedjax_sim.algorithms.local import LocalState, local_models
from fedjax_sim.algorithms.mixed import mixed_gt1, mixed_gt2, mixed_parallel
from fedjax_sim.algorithms.oneshot import one_shot_clustering
from fedjax_sim.algorithms.qffl import QFFLState, qffl
from fedjax_sim.algorithms.robust_ifca import robust_ifca
from fedjax_sim.algorithms.scaffold import ScaffoldState, scaffold

# name -> factory. Every factory takes the model first and its settings as keywords.
ALGORITHMS = {
    "ifca": ifca,
    "fedavg": fedavg,
    "local": local_models,
    "oneshot": one_shot_clustering,
    "mixed_parallel": mixed_parallel,
    "mixed_gt1": mixed_gt1,
    "mixed_gt2": mixed_gt2,
    "drfa": drfa,
    "drflm": drflm,
    # Personalised, clustered and agnostic baselines (issue 19).
    "afl": afl,
    "hypcluster": hypcluster,
    "cfl": cfl,
    "ditto": ditto,
    "robust_ifca": robust_ifca,
    # Baselines (issue 19): FedProx, SCAFFOLD, q-FFL; FedOpt is fedavg's server_optimizer.
    "fedprox": fedprox,
    "scaffold": scaffold,
    "qffl": qffl,
}


def get_algorithm(name: str):
    """The factory registered under `name`; ValueError listing the names otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; known: {', '.join(sorted(ALGORITHMS))}."
        ) from None


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "FedAvgState",
    "IFCAState",
    "LocalState",
    "QFFLState",
    "ScaffoldState",
    "fedavg",
    "fedprox",
    "get_algorithm",
    "ifca",
    "local_models",
    "one_shot_clustering",
    "qffl",
    "scaffold",
    "with_restarts",
    "with_seeds",
]
