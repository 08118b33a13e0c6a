"""IFCA on the synthetic mixture of linear regressions (Ghosh et al. 2020, Fig. 3).

- `common`: the data, the algorithms with the experiment's settings, their
  metrics and the restart reported;
- `run`: the record `EXPERIMENT` (presets ifca-synthetic, fedavg-synthetic,
  local-synthetic, ...): one algorithm trained on one data seed with
  `restarts` random inits at once, reporting the restart with the lowest final
  training loss; its comparison trains IFCA, FedAvg, local models, one-shot
  clustering, HypCluster and CFL side by side over `seeds` seeds;
- `sweep`: the vmapped programs of its generic sweep and of the
  success-probability protocol (`cell_min_dist`, presets ifca-success-* in
  `experiments.ifca_success`, whose cell vmaps data seeds × learning rates ×
  restarts).

Protocol of the official code (docs/protocols.md#ifca-synthetic): squared loss without ½,
θ^(0) ~ Bernoulli(0.5)^d not scaled by R, option I full-batch gradient
averaging divided by m, constant lr, 300 iterations. Success: for each data
seed the best final min_dist over (restart, lr) is < 0.6σ (+0.001 in the R–σ
grids). A seed whose runs all diverge is a failure (the official summary
counts it as a success through a placeholder; that is a bug).
"""

from fedjax_sim.experiments.base import DATA, ROUNDS
from fedjax_sim.experiments.ifca_synthetic.common import (
    SHAPE,
    SHAPE_NAMES,
    build_algorithm,
    make_problem,
    success_threshold,
)
from fedjax_sim.experiments.ifca_synthetic.run import (
    EXPERIMENT,
    PRESETS,
    copies_fit,
    footprint_of,
)
from fedjax_sim.experiments.ifca_synthetic.sweep import (
    SWEEP_KEYS,
    _final_runs,
    cell_min_dist,
    rows_by_cell,
)

__all__ = ["DATA", "EXPERIMENT", "PRESETS", "ROUNDS", "SHAPE", "SHAPE_NAMES",
           "SWEEP_KEYS", "_final_runs", "build_algorithm", "cell_min_dist", "copies_fit",
           "footprint_of", "make_problem", "rows_by_cell", "success_threshold"]
