"""Heterogeneous-classification baselines over Flower's partitioners, and robust clustered FL.

- `hetero-digits` / `hetero-mnist`: the baselines heterogeneous-FL papers
  report (FedAvg, FedAvgM, FedAdam, FedProx, SCAFFOLD, q-FFL, AFL, Ditto,
  HypCluster, CFL, IFCA), from the one method table (`experiments.methods`),
  on clients cut by the Flower Datasets partitioners of `data/partition.py`
  under their Flower names.
- `robust-clusters-digits`: rotation clusters with clients of unequal
  difficulty inside (label noise on the last few clients of every cluster):
  IFCA, robust_ifca, DRFA and FedAvg on worst-client and mean test loss per cluster.
- `byzantine-digits` (a sweep) and `robust-ifca-byzantine-digits`: robust
  aggregation rules against Byzantine clients' attacks (the settings of
  `experiments.robustness`, which every preset here takes), the worst case over
  attacks per rule (`byzantine`); IFCA with a robust rule per cluster.
- `hetero-systems-digits`: systems heterogeneity (per-client local work,
  stragglers, availability, dropout: the settings of `experiments.methods.
  SYSTEMS_SETTINGS`, which every preset here takes): FedAvg dropping
  stragglers against FedAvg and FedProx keeping their partial work, FedNova
  and SCAFFOLD, as in the FedProx paper's Figure 1.

One package: `data` (the clients: partitions, rotations, noise, test splits),
`metrics`, `byzantine` (the Byzantine sweep's worst case), and `experiment`
(settings, checks, results table, notes, the experiments `hetero_experiment` makes,
and the presets).
"""

from fedjax_sim.experiments.hetero.data import build_problem, client_indices, seed_clients
from fedjax_sim.experiments.hetero.experiment import (
    HETERO,
    HETERO_METHODS,
    PRESETS,
    ROBUST,
    ROBUST_METHODS,
    SYSTEMS,
    SYSTEMS_METHODS,
    hetero_experiment,
)
from fedjax_sim.experiments.hetero.metrics import metrics_fn

__all__ = ["HETERO", "HETERO_METHODS", "PRESETS", "ROBUST", "ROBUST_METHODS", "SYSTEMS",
           "SYSTEMS_METHODS", "build_problem", "client_indices", "hetero_experiment", "metrics_fn",
           "seed_clients"]
