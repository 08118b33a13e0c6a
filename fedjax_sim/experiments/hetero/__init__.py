"""Heterogeneous-classification baselines over Flower's partitioners, and robust clustered FL.

- `hetero-digits` / `hetero-mnist`: the baselines heterogeneous-FL papers
  report (FedAvg, FedAvgM, FedAdam, FedProx, SCAFFOLD, q-FFL, AFL, Ditto,
  HypCluster, CFL, IFCA), each one declaration in `METHODS` built from the
  algorithm registry by name, on clients cut by the Flower Datasets
  partitioners of `data/partition.py` under their Flower names.
- `robust-clusters-digits`: rotation clusters with clients of unequal
  difficulty inside (label noise on the last few clients of every cluster):
  IFCA, robust_ifca, DRFA and FedAvg on worst-client and mean test loss per cluster.

One package: `methods` (the compared methods, one declaration each), `data`
(the clients: partitions, rotations, noise, test splits), `metrics`, and
`experiment` (settings, checks, results table, notes and the presets).
"""

from fedjax_sim.experiments.hetero.data import build_problem, client_indices, seed_clients
from fedjax_sim.experiments.hetero.experiment import HETERO, PRESETS, ROBUST, Hetero
from fedjax_sim.experiments.hetero.methods import (
    AVAILABLE,
    HETERO_METHODS,
    METHODS,
    ROBUST_METHODS,
    Method,
    build_algorithm,
    registered,
)
from fedjax_sim.experiments.hetero.metrics import metrics_fn

__all__ = ["AVAILABLE", "HETERO", "HETERO_METHODS", "METHODS", "PRESETS", "ROBUST",
           "ROBUST_METHODS", "Hetero", "Method", "build_algorithm", "build_problem",
           "client_indices", "metrics_fn", "registered", "seed_clients"]
