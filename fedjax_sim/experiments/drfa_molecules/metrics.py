"""What the DRFA / DRFLM comparison measures.

Metrics: the worst-client and the average (over clients) test RMSE in the
target's own units, the mean training loss, and the λ̂ mass on the noisy
clients. The paper's ESOL worst-client RMSE (DRFA 1.357 > FedAvg 1.232 >
DRFLM 1.121) is printed in the notes next to what is measured.
"""

from __future__ import annotations

import jax
import numpy as np

from fedjax_sim import parallel
from fedjax_sim.experiments.drfa_molecules.data import Problem

_MAX_LAMBDA_COLUMNS = 64  # λ_i / sampled_i history columns only for this many clients or fewer


def _mean(values, active):
    """[seeds, N] -> [seeds]: the unweighted mean over the clients with data (0 if none)."""
    return np.where(active, values, 0).sum(-1) / np.maximum(active.sum(-1), 1)


def _worst(values, active):
    """[seeds, N] -> [seeds]: the largest value over the clients with data (-inf if none)."""
    return np.where(active, values, -np.inf).max(-1)


def metrics_fn(algorithm, problem: Problem, weighting: str | None = "uniform"):
    """state -> {metric: [seeds] host array}: test RMSE (target units), losses, λ, sampled.

    FedAvg keeps no λ: its fixed client weights (`weighting`) stand in for λ and λ̂.
    A method with neither (q-FFL: weights that change every round; weighting None)
    reports NaN there; one without a sampling counter (AFL) NaN sampled counts."""
    evaluate = jax.jit(algorithm.evaluate)
    std = np.asarray(problem.target_std, np.float64)[:, None]
    noisy = np.asarray(problem.noisy, bool)
    n_clients = noisy.shape[0]

    def metrics(state):
        test = jax.tree.map(np.asarray, evaluate(state, problem.test))
        train = jax.tree.map(np.asarray, evaluate(state, problem.train))
        active = test["client_weight"] > 0
        rmse = np.sqrt(np.maximum(test["client_loss"].astype(np.float64), 0.0)) * std
        tr_active = train["client_weight"] > 0
        tr_loss = train["client_loss"].astype(np.float64)
        out = {"test_rmse_worst": _worst(rmse, active), "test_rmse_avg": _mean(rmse, active),
               "train_loss": _mean(tr_loss, tr_active),
               "train_loss_worst": _worst(tr_loss, tr_active)}
        seeds = rmse.shape[0]
        if hasattr(state, "lam_avg"):
            lam = np.asarray(parallel.to_host(state.lam), np.float64)
            lam_hat = np.asarray(parallel.to_host(state.lam_avg), np.float64)
            sampled = (np.asarray(parallel.to_host(state.sampled), np.float64)
                       if hasattr(state, "sampled") else np.full((seeds, n_clients), np.nan))
        elif weighting is None:
            lam = lam_hat = sampled = np.full((seeds, n_clients), np.nan)
        else:  # FedAvg: its fixed client weights; it keeps no sampling counter
            if weighting == "examples":
                rows = np.broadcast_to(np.asarray(problem.train.num_examples, np.float64),
                                       (seeds, n_clients))
                lam = lam_hat = rows / np.maximum(rows.sum(-1, keepdims=True), 1.0)
            else:
                lam = lam_hat = np.full((seeds, n_clients), 1.0 / n_clients)
            sampled = np.full((seeds, n_clients), np.nan)
        # Rounded: a λ that never moved would otherwise differ from 1/N by float rounding.
        out["lambda_hat_noisy"] = (np.round(lam_hat[:, noisy].sum(-1), 6)
                                   if noisy.any() else np.full(seeds, np.nan))
        out["lambda_hat_max"] = lam_hat.max(-1)
        if n_clients <= _MAX_LAMBDA_COLUMNS:
            for i in range(n_clients):
                out[f"lambda_{i}"] = lam[:, i]
                out[f"sampled_{i}"] = sampled[:, i]
        return out

    return metrics


FINAL_METRICS = ["test_rmse_worst", "test_rmse_avg", "train_loss"]


def final_metrics(s: dict) -> list[str]:
    """The results table's metrics: λ̂'s mass on the noisy clients when there are any."""
    return FINAL_METRICS + (["lambda_hat_noisy"] if s["noisy_clients"] else ["lambda_hat_max"])
