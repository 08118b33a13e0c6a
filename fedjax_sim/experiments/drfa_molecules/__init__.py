"""DRFA and DRFLM against FedAvg: molecular regression and synthetic noisy clients.

docs/protocols.md#drflm-experiments. The methods trained side by side over seeds run as
one vmapped axis, the same federation and initial weights for every method
within a seed:

One package: `data` (the federations: molecules or noisy synthetic clients),
`metrics` (test RMSE, losses, λ), and `experiment` (settings, checks, notes,
plots and the presets); the methods come from the one method table
(`experiments.methods`).
"""

from fedjax_sim.experiments.drfa_molecules.data import (
    DATASET_NAMES,
    MOLECULES,
    Problem,
    build_problem,
)
from fedjax_sim.experiments.drfa_molecules.experiment import (
    EXPERIMENT,
    METHODS,
    PAPER_ESOL_WORST,
    PRESETS,
)
from fedjax_sim.experiments.drfa_molecules.metrics import (
    FINAL_METRICS,
    final_metrics,
    metrics_fn,
)

__all__ = ["DATASET_NAMES", "EXPERIMENT", "FINAL_METRICS", "METHODS", "MOLECULES",
           "PAPER_ESOL_WORST", "PRESETS", "Problem", "build_problem", "final_metrics",
           "metrics_fn"]
