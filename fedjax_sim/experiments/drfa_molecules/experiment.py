"""The DRFA / DRFLM comparison and its presets: settings, checks, notes and plots."""

from __future__ import annotations

import math

import numpy as np
import optax

from fedjax_sim.algorithms import ClientTraining
from fedjax_sim.experiments.base import Comparison, Experiment, Preset, Trained
from fedjax_sim.experiments.drfa_molecules.data import (
    DATASET_NAMES,
    MOLECULES,
    Problem,
    build_problem,
)
from fedjax_sim.experiments.drfa_molecules.metrics import final_metrics, metrics_fn
from fedjax_sim.experiments.methods import FLOAT_TARGETS
from fedjax_sim.experiments.methods import METHODS as TABLE
from fedjax_sim.experiments.settings import (
    Setting,
    batch_size_setting,
    checkpoint_setting,
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    method_setting,
    participation_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)
from fedjax_sim.extras import require

# The paper's ESOL worst-client test RMSE (arXiv 2204.07742; docs/protocols.md#drflm-experiments).
PAPER_ESOL_WORST = {"drfa": 1.357, "fedavg": 1.232, "drflm": 1.121}
METHODS = ("fedavg", "drfa", "drflm", "fedavg_mixup", "afl", "qffl")
# The methods that read a method-scoped setting (`Setting.methods`: another value for a
# run or comparison of none of them is refused) where the method table does not say it:
# the client optimizer and its lr (not q-FFL, which steps plain SGD at qffl_lr), mixup's β.
_CLIENT_OPTIMIZER = tuple(m for m, method in TABLE.items() if not method.sgd)
# Every method but q-FFL trains at lr (SCAFFOLD too; local models: no local_lr here).
_CLIENT_LR = tuple(m for m, method in TABLE.items() if method.lr != "qffl_lr")
_MIXUP = tuple(m for m, method in TABLE.items() if "mixup_alpha" in method.reads)
# Settings of one kind of data (`Setting.when`).
_ON_MOLECULES = ("dataset", MOLECULES)
_SYNTHETIC = ("dataset", ("synthetic",))


def validate(s: dict, command: str = "compare") -> None:
    if s["dataset"] in MOLECULES:
        require("rdkit", "molecules", f"dataset={s['dataset']}")
    if s["noisy_clients"] > s["num_clients"]:
        raise ValueError(f"setting noisy_clients={s['noisy_clients']} exceeds num_clients="
                         f"{s['num_clients']}.")
    if s["noisy_clients"] and s["noise_std"] == 0:
        raise ValueError("setting noise_std must be > 0 when noisy_clients > 0.")
    if s["official_code"] and s["local_steps"] < 2:
        raise ValueError("setting local_steps must be >= 2 with official_code (FedTorch "
                         "draws the snapshot step from {1, ..., τ − 1}).")
    if s["lambda_floor"] * s["num_clients"] > 1:
        raise ValueError(f"setting lambda_floor={s['lambda_floor']} times num_clients="
                         f"{s['num_clients']} exceeds 1.")
    if s["dataset"] == "synthetic" and s["batch_size"] > s["n"]:
        raise ValueError(f"setting batch_size={s['batch_size']} exceeds n={s['n']}.")


def client_training(s: dict, learning_rate) -> ClientTraining:
    """The setting optimizer (Adam or plain SGD) at the setting lr, τ = local_steps,
    minibatches of batch_size (a fresh optimizer state on every client every round)."""
    optimizer = (optax.adam if s["optimizer"] == "adam" else optax.sgd)(learning_rate)
    return ClientTraining(optimizer, s["local_steps"], s["batch_size"])


def metrics(t: Trained):
    """`metrics_fn` with the client weights a method without λ reports: its fixed ones
    (none: q-FFL's change every round)."""
    method = t.method
    weighting = (None if method.adaptive_weights else t.s["weighting"]
                 if "weighting" in method.reads else "uniform")
    return metrics_fn(t.algorithm, t.problem, weighting)


def notes(s: dict, problem: Problem, results: dict) -> dict:
    per_seed = {name: r.per_seed for name, r in results.items()}
    federations = ("a new federation per seed" if s["resplit_per_seed"]
                   else "one federation for all seeds")
    weights = ("by training rows" if s["weighting"] == "examples" else "uniformly")
    fixed = ("∝ training rows" if s["weighting"] == "examples" else "uniform")
    form = ("FedTorch form (official_code)" if s["official_code"] else "paper form")
    notes = {
        "protocol": (
            f"{s['seeds']} seeds as one vmapped axis; every method gets the same "
            f"federation and initial weights within a seed ({federations}); RMSE in "
            f"target units ({problem.units}); average RMSE = mean over clients of "
            "each client's RMSE"),
        "methods": (
            "fedavg: registered FedAvg (uniform cohort without replacement, clients "
            f"weighted {weights}); drfa, drflm: {form}; fedavg_mixup: DRFLM with "
            f"lambda_lr = 0 and λ fixed {fixed} ({form})"),
        "choices": (
            "t' uniform on {1..τ} (paper form; official_code: each client's model after "
            "k − 1 local steps, k uniform on {1..τ−1} per client, as FedTorch); U_s uniform "
            "without replacement; one γ ~ "
            "Beta per minibatch, pairs within the minibatch; mixup after g = "
            + ("the identity (inputs mixed)" if s["dataset"] == "synthetic"
               else "the GNN's graph embedding (trained through the mixed embeddings)")
            + f"; DRFLM's λ probe uses the {s['lambda_loss']} loss"),
        **problem.notes,
    }
    if s["dataset"] == "esol":
        measured = {m: float(np.nanmean(per_seed[m]["test_rmse_worst"]))
                    for m in PAPER_ESOL_WORST if m in per_seed}
        order = " < ".join(sorted(measured, key=measured.get))
        notes["paper_reference_esol_worst_rmse"] = (
            "paper: DRFLM 1.121 < FedAvg 1.232 < DRFA 1.357 (its N, split, GNN and "
            "hyper-parameters are unknown); measured here: " + ", ".join(
                f"{m} {v:.3f}" for m, v in measured.items()) + f" (order {order})")
    elif s["dataset"] == "freesolv":
        notes["paper_reference"] = ("paper: DRFLM has the best worst-client RMSE on FreeSolv "
                                    "(its Table 1 numbers were not retrieved)")
    return notes


def plot_compare(comparison: Comparison, out_dir) -> None:
    """lambda.png: λ per client of DRFA and DRFLM per round and how often each client
    was sampled (seed means); worst_client_loss.png: the worst-client training loss
    per round, each method's seed mean with its 95 % band (per_seed_metrics.csv)."""
    from matplotlib.figure import Figure

    from fedjax_sim import plots

    colors = plots.method_colors(METHODS)
    robust = [m for m in ("drfa", "drflm") if m in comparison.histories]
    lam_cols = sorted({k for m in robust for row in comparison.histories[m] for k in row
                       if k.startswith("lambda_") and k[7:].isdigit()},
                      key=lambda k: int(k[7:]))
    if lam_cols:
        fig = Figure(figsize=(4.4 * (len(robust) + 1), 3.5))
        axes = fig.subplots(1, len(robust) + 1, squeeze=False)
        for ax, m in zip(axes[0], robust, strict=False):
            rows = comparison.histories[m]
            rounds = [r["round"] for r in rows]
            for c in lam_cols:
                ax.plot(rounds, [r[c] for r in rows], label=c.replace("lambda_", "client "))
            ax.set_title(f"{m}: λ per client (mean over seeds)", fontsize=9)
            ax.set_xlabel("round")
            ax.set_ylabel("λ (client weight)")
            ax.legend(fontsize=6, ncol=2)
        ax = axes[0][-1]
        width = 0.8 / max(len(robust), 1)
        clients = np.arange(len(lam_cols))
        for j, m in enumerate(robust):
            last = comparison.histories[m][-1]
            counts = [last.get(c.replace("lambda_", "sampled_"), math.nan) for c in lam_cols]
            ax.bar(clients + (j - (len(robust) - 1) / 2) * width, counts, width, label=m,
                   color=colors.get(m))
        ax.set_xticks(clients, [c[7:] for c in lam_cols], fontsize=7)
        ax.set_title("sampling by the final round (mean over seeds)", fontsize=9)
        ax.set_xlabel("client")
        ax.set_ylabel("times sampled in C_s")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "lambda.png", dpi=110)
    plots.plot_comparison(
        plots.per_seed_rows(out_dir, comparison.histories), out_dir / "worst_client_loss.png",
        [("train_loss_worst", "worst-client train loss")],
        title="worst-client training loss per round", methods=METHODS, colors=colors)


EXPERIMENT = Experiment(
    name="drfa_molecules",
    description="FedAvg, DRFA, DRFLM and FedAvg+mixup on molecules or noisy synthetic clients.",
    settings=(
        Setting("dataset", str, "esol", "molecules (scaffold clients, a GIN) or synthetic "
                "(noisy linear clients)", choices=DATASET_NAMES),
        count("num_clients", 8, "N, the number of clients", minimum=2, maximum=100_000),
        participation_setting(0.5, "m / N: the size of C_s and of U_s (and FedAvg's cohort)",
                              minimum=1e-6),
        rounds_setting(100, "communication rounds S", maximum=10**6),
        local_steps_setting(10, "τ local minibatch SGD steps per sampled client",
                            maximum=10**4),
        batch_size_setting(32, "minibatch size (local steps and the λ probe)", minimum=1),
        Setting("optimizer", str, "adam", "client optimizer (fresh state every round)",
                choices=("adam", "sgd"), methods=_CLIENT_OPTIMIZER),
        lr_setting(0.001, "client learning rate η", methods=_CLIENT_LR),
        Setting("lambda_lr", float, 0.002, "λ step size γ of DRFA / DRFLM / AFL", minimum=0.0),
        Setting("q", float, 1.0, "q-FFL's fairness exponent q (0: FedAvg)", minimum=0.0),
        Setting("qffl_lr", float, 0.05, "q-FFL's client SGD step (its Lipschitz estimate is "
                "1/qffl_lr; it takes no Adam)", minimum=1e-9),
        Setting("lambda_floor", float, 0.0, "lower bound on every λ_i (exact floored "
                "projection; 0: none; official_code: 1e-3 clipped when 0)", minimum=0.0,
                maximum=0.5),
        Setting("weighting", str, "examples", "FedAvg's (and FedAvg+mixup's) client weights: "
                "examples (∝ training rows, DRFLM's objective) or uniform",
                choices=("examples", "uniform")),
        Setting("official_code", bool, False, "reproduce FedTorch's deviations (docs/"
                "protocols.md#drfa-fedtorch) instead of the paper form"),
        Setting("mixup_alpha", float, 1.0, "α of γ ~ Beta(α, β) (DRFLM, FedAvg+mixup)",
                minimum=1e-6),
        Setting("mixup_beta", float, 1.0, "β of γ ~ Beta(α, β)", minimum=1e-6, methods=_MIXUP),
        Setting("lambda_loss", str, "mixup", "DRFLM's λ probe loss (FedAvg+mixup logs it): "
                "mixup (its objective) or clean", choices=("mixup", "clean")),
        seeds_setting(10, "seeds, one vmapped axis (same federation and init across methods "
                      "within a seed)"),
        seed_setting(),
        eval_every_setting(10, "evaluate (and log λ) every this many rounds"),
        checkpoint_setting(50),
        method_setting(tuple(TABLE), "drflm"),
        Setting("resplit_per_seed", bool, True, "a new federation (80/20 split, noise; the "
                "Dirichlet split) per seed; false: one federation for every seed"),
        Setting("noisy_clients", int, 0, "the last this many clients get label noise on their "
                "training targets", minimum=0, maximum=100_000),
        Setting("noise_std", float, 0.0, "std of that noise (molecules: in standard deviations "
                "of the targets)", minimum=0.0),
        Setting("split", str, "round_robin", "scaffold groups to clients", choices=(
            "round_robin", "contiguous", "dirichlet"), when=_ON_MOLECULES),
        Setting("split_alpha", float, 1.0, "Dirichlet α of the dirichlet split", minimum=1e-6,
                when=("split", ("dirichlet",))),
        count("max_atoms", 0, "pad graphs to this many atoms, skipping larger molecules "
              "(0: the largest molecule)", minimum=0, maximum=1000, when=_ON_MOLECULES),
        count("hidden", 64, "GIN width", when=_ON_MOLECULES),
        count("layers", 3, "GIN layers", maximum=32, when=_ON_MOLECULES),
        Setting("pooling", str, "mean", "graph pooling", choices=("mean", "sum"),
                when=_ON_MOLECULES),
        count("d", 10, "synthetic: dimension", maximum=10**5, when=_SYNTHETIC),
        count("n", 20, "synthetic: training examples per client", when=_SYNTHETIC),
        count("n_test", 100, "synthetic: clean test examples per client", when=_SYNTHETIC),
        Setting("clean_noise", float, 0.1, "synthetic: label noise std of clean clients",
                minimum=0.0, when=_SYNTHETIC),
        Setting("cache_dir", str, "", "archive / featurisation cache (empty: the default)",
                result=False),
    ),
    problem=build_problem,
    metrics=metrics,
    methods=METHODS,
    baseline="fedavg",
    table=final_metrics,
    notes=notes,
    validate=validate,
    panels=(
        ("test_rmse_worst", "worst-client test RMSE"),
        ("test_rmse_avg", "average-client test RMSE"),
        ("train_loss_worst", "worst-client train loss"),
        ("lambda_hat_max", "max λ̂"),
    ),
    method_table=TABLE,
    provides=frozenset({FLOAT_TARGETS}),
    client_training=client_training,
    # A tuned comparison (tune_* settings) chooses each method's grid point by its
    # worst-client RMSE on the validation rows.
    tune_metric=("test_rmse_worst", "min"),
    plot_compare=plot_compare,
)

# Each method's client step size tuned per seed on validation rows (`experiments.tuned`):
# Adam's lr, and q-FFL's plain-SGD step (docs/protocols.md#tuned-comparisons).
TUNE_GRIDS = {"tune_lr": [0.0003, 0.001, 0.003], "tune_qffl_lr": [0.002, 0.01, 0.05]}
_GNN = {"num_clients": 8, "participation": 0.5, "rounds": 100, "local_steps": 10,
        "batch_size": 32, "optimizer": "adam", "lr": 0.001, "lambda_lr": 0.002, "seeds": 10,
        "eval_every": 10, "hidden": 64, "layers": 3, **TUNE_GRIDS}

PRESETS = [
    Preset("drflm-esol", EXPERIMENT,
           "DRFLM vs DRFA, FedAvg, FedAvg+mixup on ESOL (8 scaffold clients, GIN), 10 seeds.",
           {**_GNN, "dataset": "esol"}),
    Preset("drflm-freesolv", EXPERIMENT,
           "DRFLM vs DRFA, FedAvg, FedAvg+mixup on FreeSolv (4 scaffold clients, GIN), 10 seeds.",
           {**_GNN, "dataset": "freesolv", "num_clients": 4, "batch_size": 16}),
    Preset("drflm-lipophilicity", EXPERIMENT,
           "DRFLM vs DRFA, FedAvg, FedAvg+mixup on Lipophilicity (8 scaffold clients, GIN).",
           {**_GNN, "dataset": "lipophilicity", "max_atoms": 64, "resplit_per_seed": False}),
    Preset("drfa-synthetic-noise", EXPERIMENT,
           "Noisy clients: DRFA's λ chases the 2 label-noise clients and its clean test RMSE "
           "rises above FedAvg's (linear regression, 10 clients).",
           {"dataset": "synthetic", "num_clients": 10, "participation": 0.5, "rounds": 100,
            "local_steps": 10, "batch_size": 10, "optimizer": "sgd", "lr": 0.02,
            "lambda_lr": 0.01,
            "noisy_clients": 2, "noise_std": 5.0, "d": 10, "n": 20, "n_test": 100,
            "seeds": 10, "eval_every": 10}),
]
