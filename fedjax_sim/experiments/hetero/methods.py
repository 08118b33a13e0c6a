"""The compared methods of the heterogeneous-FL experiments: one declaration each.

Every method is a registered algorithm (`fedjax_sim.algorithms.ALGORITHMS`)
with fixed options and the experiment settings it reads; a method whose
algorithm is not registered (yet) is declared but not offered.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import optax

from fedjax_sim.algorithms import ALGORITHMS


class Method(NamedTuple):
    """One compared method: a registered algorithm, fixed options, the settings it reads.

    reads: setting -> the factory keyword it goes to.
    client_optimizer: the factory takes the client `optimizer` (else plain SGD at
      `learning_rate`: SCAFFOLD's option II and q-FedAvg's L = 1/lr assume SGD).
    """

    algorithm: str
    options: dict
    reads: dict
    help: str
    client_optimizer: bool = True


_LAMBDA = {"lambda_lr": "lambda_lr"}
_FEDOPT = {"server_lr": "server_lr"}
_K = {"k": "num_clusters"}
METHODS = {
    "fedavg": Method("fedavg", {}, {}, "FedAvg"),
    "fedavgm": Method("fedavg", {"server_optimizer": "sgdm"}, _FEDOPT, "FedAvgM (FedOpt, SGDM)"),
    "fedadam": Method("fedavg", {"server_optimizer": "adam"}, _FEDOPT, "FedAdam (FedOpt)"),
    "fedyogi": Method("fedavg", {"server_optimizer": "yogi"}, _FEDOPT, "FedYogi (FedOpt)"),
    "fedadagrad": Method("fedavg", {"server_optimizer": "adagrad"}, _FEDOPT,
                         "FedAdagrad (FedOpt)"),
    "fedprox": Method("fedprox", {}, {"prox_mu": "mu"}, "FedProx"),
    "scaffold": Method("scaffold", {}, {}, "SCAFFOLD (option II variates)",
                       client_optimizer=False),
    "qffl": Method("qffl", {}, {"q": "q"}, "q-FFL (q-FedAvg)", client_optimizer=False),
    "afl": Method("afl", {}, _LAMBDA, "Agnostic FL"),
    "ditto": Method("ditto", {}, {"ditto_lambda": "ditto_lambda"}, "Ditto (personal models)"),
    "hypcluster": Method("hypcluster", {}, _K, "HypCluster"),
    "cfl": Method("cfl", {}, {}, "clustered FL (Sattler et al.)"),
    "ifca": Method("ifca", {"option": "model"}, _K, "IFCA (option II)"),
    "robust_ifca": Method("robust_ifca", {}, {**_K, **_LAMBDA}, "IFCA with DRFA's per-cluster λ"),
    "drfa": Method("drfa", {}, _LAMBDA, "DRFA"),
    "local": Method("local", {}, {}, "local models (each client alone)"),
}
HETERO_METHODS = ("fedavg", "fedavgm", "fedadam", "fedprox", "scaffold", "qffl", "afl", "ditto",
                  "hypcluster", "cfl", "ifca")
ROBUST_METHODS = ("ifca", "robust_ifca", "drfa", "fedavg")


def _parameters(factory) -> tuple[set, bool]:
    params = inspect.signature(factory).parameters
    return set(params), any(p.kind is p.VAR_KEYWORD for p in params.values())


def registered(name: str) -> bool:
    """Whether method `name` can be built now: its algorithm is registered and takes its options."""
    method = METHODS[name]
    if method.algorithm not in ALGORITHMS:
        return False
    names, any_keyword = _parameters(ALGORITHMS[method.algorithm])
    return any_keyword or set(method.options) <= names


AVAILABLE = tuple(m for m in METHODS if registered(m))  # at import, from the registry


def method_readers() -> dict[str, tuple[str, ...]]:
    """setting -> the methods that read it."""
    out: dict[str, list] = {}
    for name, method in METHODS.items():
        for setting in method.reads:
            out.setdefault(setting, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def build_algorithm(name: str, model, s: dict):
    """Method `name` (unvmapped) from the registry with the experiment's settings."""
    method = METHODS[name]
    factory = ALGORITHMS[method.algorithm]
    names, any_keyword = _parameters(factory)
    kwargs = ({"optimizer": optax.sgd(s["lr"])} if method.client_optimizer
              else {"learning_rate": s["lr"]})
    kwargs.update(method.options)
    # The client-training settings go where the factory takes them (local has no cohort).
    common = {"local_steps": s["local_steps"], "batch_size": s["batch_size"] or None,
              "participation": s["participation"]}
    kwargs.update({k: v for k, v in common.items() if k in names or any_keyword})
    for setting, keyword in method.reads.items():
        if setting == "server_lr" and not s[setting]:
            continue  # 0: the server optimizer's own default
        kwargs[keyword] = s[setting]
    return factory(model, **kwargs)
