"""FedAvg, FedNova and FedProx on quadratic clients with different local work.

docs/protocols.md#fednova-quadratic. The motivating example of FedNova (Wang et al.,
NeurIPS 2020, §2–3): clients with their own optima and very different τ_i, where FedAvg
converges to the minimiser of the surrogate Σ p_i τ_i F_i and FedNova to that of the
true objective Σ p_i F_i, both known in closed form.

One package: `data` (the clients, the work table, the closed forms), `metrics` (the
distances to both fixed points, the losses), and `experiment` (settings, checks, notes
and the preset); the methods come from the one method table (`experiments.methods`).
"""

from fedjax_sim.experiments.fednova_quadratic.data import build_problem, weighted_argmin, work_table
from fedjax_sim.experiments.fednova_quadratic.experiment import (
    EXPERIMENT,
    PRESETS,
    proximal_work,
)
from fedjax_sim.experiments.fednova_quadratic.metrics import metrics_fn

__all__ = ["EXPERIMENT", "PRESETS", "build_problem", "metrics_fn",
           "proximal_work", "weighted_argmin", "work_table"]
