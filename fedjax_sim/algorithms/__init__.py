"""Algorithms as NamedTuples of pure functions, their combinators, and their registry.

Every factory takes the model, then how clients train (`ClientTraining`, e.g.
`sgd(0.1, steps=5)`), then its own settings as keywords; none takes an execution
setting (chunks, devices, kernel forms: `fedjax_sim.execution`). A variant is a
combinator around a built algorithm (`with_restarts`, `with_seeds`,
`with_server_optimizer`, IFCA's `with_weight_sharing`, ...).
"""

from fedjax_sim.algorithms.afl import AFLState, afl
from fedjax_sim.algorithms.async_ifca import async_ifca
from fedjax_sim.algorithms.asynchronous import AsyncState
from fedjax_sim.algorithms.base import (
    Algorithm,
    with_grid,
    with_restarts,
    with_seeds,
    with_server_optimizer,
    with_systems,
)
from fedjax_sim.algorithms.byzantine import with_aggregator
from fedjax_sim.algorithms.cfl import CFLState, cfl
from fedjax_sim.algorithms.clocked import ClockedState, with_clock
from fedjax_sim.algorithms.ditto import DittoState, ditto
from fedjax_sim.algorithms.drfa import DRFAState, drfa, drflm
from fedjax_sim.algorithms.fedasync import fedasync
from fedjax_sim.algorithms.fedavg import FedAvgState, fedavg
from fedjax_sim.algorithms.fedbuff import fedbuff
from fedjax_sim.algorithms.fednova import fednova
from fedjax_sim.algorithms.fedprox import fedprox
from fedjax_sim.algorithms.hypcluster import HypClusterState, hypcluster
from fedjax_sim.algorithms.ifca import (
    IFCAState,
    ifca,
    pretrained_trunk,
    with_balanced_init,
    with_fixed_assignment,
    with_frozen_trunk,
    with_initial_params,
    with_warm_start,
    with_weight_sharing,
)
from fedjax_sim.algorithms.local import LocalState, local_models
from fedjax_sim.algorithms.mixed import (
    MixedState,
    mixed_centralized,
    mixed_gt1,
    mixed_gt2,
    mixed_parallel,
)
from fedjax_sim.algorithms.oneshot import one_shot_clustering
from fedjax_sim.algorithms.private import AdaptiveClipping, with_dp, with_dp_ftrl
from fedjax_sim.algorithms.qffl import QFFLState, qffl
from fedjax_sim.algorithms.recipes import fedadagrad, fedadam, fedavgm, fedyogi
from fedjax_sim.algorithms.robust_ifca import RobustIFCAState, robust_ifca
from fedjax_sim.algorithms.scaffold import ScaffoldState, scaffold
from fedjax_sim.algorithms.training import SAMPLINGS, ClientTraining, round_decay, sgd
from fedjax_sim.ops.work import Work

# name -> factory: factory(model, training, **its settings) -> Algorithm.
ALGORITHMS = {
    "ifca": ifca,
    "fedavg": fedavg,
    "local": local_models,
    "oneshot": one_shot_clustering,
    "mixed_parallel": mixed_parallel,
    "mixed_gt1": mixed_gt1,
    "mixed_gt2": mixed_gt2,
    "oracle": mixed_centralized,
    "drfa": drfa,
    "drflm": drflm,
    "afl": afl,
    "hypcluster": hypcluster,
    "cfl": cfl,
    "ditto": ditto,
    "robust_ifca": robust_ifca,
    "fedprox": fedprox,
    "fednova": fednova,
    "scaffold": scaffold,
    "qffl": qffl,
    "fedavgm": fedavgm,
    "fedadam": fedadam,
    "fedyogi": fedyogi,
    "fedadagrad": fedadagrad,
    "fedbuff": fedbuff,
    "fedasync": fedasync,
    "async_ifca": async_ifca,
}


# The registered algorithms whose server averages the clients' model changes (their state
# has an `aggregation`): `with_dp` privatises them; the others use more (the clients'
# losses, λ) and are refused.
PRIVATE_READY = frozenset({"fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox",
                           "fednova", "scaffold", "ditto", "ifca", "hypcluster"})
# Those whose state's `aggregation` takes `with_aggregator`'s robust rule (every slot's
# change kept: the round passes its CohortBatch to Cohorts.sums); IFCA with option "model".
# CFL takes no rule (its splits read every member's raw update).
ROBUST_READY = PRIVATE_READY


# Other names of registered algorithms: alias -> its registry name (the name the method
# table, the command line and every results file use).
ALIASES = {"mixed_centralized": "oracle"}


def get_algorithm(name: str):
    """The factory registered under `name` (or an alias of it, `ALIASES`, with a warning
    naming the registry name); ValueError listing the names otherwise."""
    if name in ALIASES:
        import warnings

        warnings.warn(f"algorithm {name} is registered as {ALIASES[name]}; use that name.",
                      FutureWarning, stacklevel=2)
        name = ALIASES[name]
    try:
        return ALGORITHMS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(ALGORITHMS), n=3)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        raise ValueError(
            f"unknown algorithm {name!r}{hint}; known: {', '.join(sorted(ALGORITHMS))}."
        ) from None


__all__ = [
    "ALGORITHMS",
    "ALIASES",
    "PRIVATE_READY",
    "ROBUST_READY",
    "AFLState",
    "AdaptiveClipping",
    "Algorithm",
    "AsyncState",
    "CFLState",
    "ClientTraining",
    "ClockedState",
    "DRFAState",
    "DittoState",
    "FedAvgState",
    "HypClusterState",
    "IFCAState",
    "LocalState",
    "MixedState",
    "QFFLState",
    "RobustIFCAState",
    "SAMPLINGS",
    "Work",
    "ScaffoldState",
    "afl",
    "async_ifca",
    "cfl",
    "ditto",
    "drfa",
    "drflm",
    "fedadagrad",
    "fedadam",
    "fedasync",
    "fedavg",
    "fedavgm",
    "fedbuff",
    "fedprox",
    "fednova",
    "fedyogi",
    "get_algorithm",
    "hypcluster",
    "ifca",
    "local_models",
    "mixed_centralized",
    "mixed_gt1",
    "mixed_gt2",
    "mixed_parallel",
    "one_shot_clustering",
    "pretrained_trunk",
    "qffl",
    "robust_ifca",
    "round_decay",
    "scaffold",
    "sgd",
    "with_aggregator",
    "with_balanced_init",
    "with_clock",
    "with_dp",
    "with_dp_ftrl",
    "with_fixed_assignment",
    "with_frozen_trunk",
    "with_grid",
    "with_initial_params",
    "with_restarts",
    "with_seeds",
    "with_server_optimizer",
    "with_systems",
    "with_warm_start",
    "with_weight_sharing",
]
