"""The FedNova comparison on quadratic clients and its preset: settings, checks, notes.

Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020 (arXiv 2007.07481), §2–3: with
different local work τ_i, FedAvg's average weighs client i by p_i τ_i and converges
to the minimiser of the surrogate Σ p_i τ_i F_i, FedNova's normalised average to that
of the true objective Σ p_i F_i. One comparison, every method from the method table:

    each seed s:  clients (X_i, y_i) with their own optima θ_i    (`data`)
                  w*, w̃ ← the two closed forms (float64)
    τ_i ← tau_min, ..., tau_max evenly spaced over the clients     (every seed and round)
    each method M ∈ {fedavg, fednova, fedprox}, every seed at once (one vmapped axis):
        w ← M's init (the same per seed for every method)
        repeat rounds:  each client i: τ_i full-batch GD steps from w at lr
                        (fedprox: on F_i + μ/2 ‖· − w‖²); w ← M's average
        report ‖w − w*‖, ‖w − w̃‖, F(w), F(w) − F(w*)               (`metrics`)

Choices [I]: full participation (the fixed points are those of deterministic rounds);
full-batch local steps (the fixed points are the closed forms as lr → 0); τ_i the same
table in every seed, so one compiled round serves every seed.
"""

from __future__ import annotations

import numpy as np

from fedjax_sim.algorithms import ClientTraining, Work, sgd
from fedjax_sim.experiments.base import Experiment, Preset
from fedjax_sim.experiments.fednova_quadratic.data import (
    argmin_per_seed,
    build_problem,
    work_table,
)
from fedjax_sim.experiments.fednova_quadratic.metrics import metrics_fn
from fedjax_sim.experiments.methods import METHODS
from fedjax_sim.experiments.settings import (
    Setting,
    count,
    eval_every_setting,
    lr_setting,
    method_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)
from fedjax_sim.models import linear_regression

COMPARED = ("fedavg", "fednova", "fedprox")
# FedProx weighs its clients as the others do here (the shared entry reads only μ).
TABLE = {**METHODS, "fedprox": METHODS["fedprox"].replace(
    reads={**METHODS["fedprox"].reads, "weighting": "weighting"})}


def proximal_work(tau, lr: float, mu: float) -> np.ndarray:
    """‖a_i‖₁ of τ_i proximal GD steps, [1 − (1 − ημ)^τ_i] / (ημ) (τ_i when ημ = 0), float64:
    FedProx's small-lr fixed point is argmin Σ p_i ‖a_i‖₁ F_i."""
    tau = np.asarray(tau, np.float64)
    decay = lr * mu
    return tau if decay == 0 else (1.0 - (1.0 - decay) ** tau) / decay


def validate(s: dict, command: str = "compare") -> None:
    if s["tau_min"] > s["tau_max"]:
        raise ValueError(f"setting tau_min={s['tau_min']} exceeds tau_max={s['tau_max']}: "
                         "give tau_min <= tau_max (the local steps of the least and the "
                         "most working client).")
    if s["n_min"] > s["n_max"]:
        raise ValueError(f"setting n_min={s['n_min']} exceeds n_max={s['n_max']}: give "
                         "n_min <= n_max.")
    if s["num_clients"] * s["n_min"] < s["d"]:
        raise ValueError(f"settings num_clients={s['num_clients']} × n_min={s['n_min']} "
                         f"rows may be fewer than d={s['d']}: w* would not be unique; "
                         "raise n_min or num_clients, or lower d.")


def problem(s: dict) -> dict:
    """Every seed's clients, work table and closed forms, and the linear model."""
    return {**build_problem(s), "model": linear_regression(s["d"])}


def client_training(s: dict, learning_rate) -> ClientTraining:
    """Full-batch GD at `learning_rate`: a scan of tau_max steps, client i stepping τ_i of
    them (`Work(per_client=...)`)."""
    return sgd(learning_rate, steps=s["tau_max"], work=Work(per_client=work_table(s)))


def notes(s: dict, problem: dict, results: dict) -> dict:
    """The setup, the work table and the fixed points' distances (means over seeds)."""
    sizes = np.asarray(problem["train"].num_examples)
    gap = np.linalg.norm(problem["optimum"] - problem["surrogate"], axis=-1)
    notes = {
        "data": f"{s['num_clients']} clients, d = {s['d']}: θ_i ~ N(0, {s['R']}² I), n_i "
                f"uniform on {{{s['n_min']}, ..., {s['n_max']}}} ({sizes.min()}–"
                f"{sizes.max()} over seeds), x ~ N(0, I), y = xᵀθ_i + {s['sigma']} ε; "
                "F_i the mean squared error, p_i "
                + ("∝ n_i" if s["weighting"] == "examples" else "= 1/m"),
        "work": f"τ_i = {', '.join(map(str, problem['work']))} (tau_min to tau_max evenly "
                "spaced, the same every seed and round); full-batch GD at lr "
                f"{s['lr']}, full participation, {s['rounds']} rounds, {s['seeds']} seeds",
        "fixed_points": f"‖w* − w̃‖ = {gap.mean():.4g} (mean over seeds; {gap.min():.4g} "
                        f"to {gap.max():.4g}): w* = argmin Σ p_i F_i (FedNova's fixed point "
                        "as lr → 0), w̃ = argmin Σ p_i τ_i F_i (FedAvg's)",
        "methods": "; ".join(f"{m} = {TABLE[m].help}"
                             + (f" μ = {s['prox_mu']}" if m == "fedprox" else "")
                             for m in results),
    }
    if "fedprox" in results:
        norm = proximal_work(problem["work"], s["lr"], s["prox_mu"])
        far = np.linalg.norm(argmin_per_seed(problem, norm) - problem["optimum"], axis=-1)
        notes["fedprox_fixed_point"] = (
            f"argmin Σ p_i ‖a_i‖₁ F_i for small lr at ημ = {s['lr'] * s['prox_mu']:.3g}, "
            f"‖a_i‖₁ = [1 − (1 − ημ)^τ_i]/(ημ) from {norm.min():.3g} to "
            f"{norm.max():.3g}: {far.mean():.4g} from w* (mean over seeds)")
    return notes


EXPERIMENT = Experiment(
    name="fednova_quadratic",
    description=("FedAvg, FedNova and FedProx on quadratic clients with different optima "
                 "and local work τ_i: distances to the true and the surrogate optimum."),
    settings=(
        count("num_clients", 10, "m, the number of clients", minimum=2, maximum=100_000),
        count("d", 5, "features (the model: linear regression without bias)", maximum=10_000),
        count("n_min", 10, "fewest examples of a client (n_i uniform on {n_min, ..., n_max}, "
              "drawn per seed)", maximum=100_000),
        count("n_max", 50, "most examples of a client", maximum=100_000),
        Setting("R", float, 1.0, "spread of the client optima: θ_i ~ N(0, R² I_d) per seed",
                minimum=0.0),
        Setting("sigma", float, 0.1, "target noise: y = X θ_i + σ ε", minimum=0.0),
        count("tau_min", 1, "fewest local steps τ_i (client 0; τ_i evenly spaced from tau_min "
              "to tau_max over the clients, rounded, the same every seed and round)",
              maximum=10_000),
        count("tau_max", 20, "most local steps τ_i (the last client; the local scan's length)",
              maximum=10_000),
        Setting("weighting", str, "examples", "client weights p_i of every method and of the "
                "objective Σ p_i F_i: examples (∝ n_i, the paper's) or uniform",
                choices=("examples", "uniform")),
        lr_setting(0.005, "client learning rate η (full-batch GD)"),
        rounds_setting(300),
        seeds_setting(5, "seeds (optima, sizes, rows, init), one vmapped axis"),
        seed_setting(),
        eval_every_setting(10),
        method_setting(tuple(TABLE), "fednova"),
    ),
    problem=problem,
    metrics=lambda t: metrics_fn(t.algorithm, t.problem),
    methods=COMPARED,
    baseline="fedavg",
    notes=notes,
    validate=validate,
    panels=(("dist_to_optimum", "‖w − w*‖, w* = argmin Σ p_i F_i"),
            ("dist_to_surrogate", "‖w − w̃‖, w̃ = argmin Σ p_i τ_i F_i"),
            ("train_loss", "train loss F(w) = Σ p_i F_i(w)"),
            ("excess_loss", "F(w) − F(w*)")),
    log_metrics=("dist_to_optimum", "excess_loss"),
    method_table=TABLE,
    kinds=("global",),  # the metrics read one model
    # ημ τ_max = 1 at the default lr and work: the proximal term visibly shrinks the work
    # norms ‖a_i‖₁ (FedProx's partial correction); the table's 0.01 would leave FedAvg.
    method_defaults={"prox_mu": 10.0},
    client_training=client_training,
)

PRESETS = [
    Preset("fednova-quadratic", EXPERIMENT,
           "FedNova's objective inconsistency: FedAvg, FedNova, FedProx on 10 quadratic "
           "clients with τ_i from 1 to 20; FedAvg reaches argmin Σ p_i τ_i F_i, FedNova "
           "argmin Σ p_i F_i."),
]
