"""What the FedNova comparison measures, per seed, of the global model w:

    dist_to_optimum    ‖w − w*‖, w* = argmin Σ p_i F_i   (the true objective's minimiser)
    dist_to_surrogate  ‖w − w̃‖, w̃ = argmin Σ p_i τ_i F_i (FedAvg's fixed point as lr → 0)
    train_loss         F(w) = Σ p_i F_i(w), the model's loss on every client's rows
    excess_loss        F(w) − F(w*) = (w − w*)ᵀ H_p (w − w*), exact (no cancellation)

The distances and the excess loss are computed on the host in float64 from w and the
closed forms of `data`; the train loss by the method's own evaluation.
"""

from __future__ import annotations

import jax
import numpy as np

from fedjax_sim import parallel


def metrics_fn(algorithm, problem: dict):
    """state -> {metric: [seeds]} for a method with one global model [seeds, d]: the one
    its evaluation reads (`params`, or AFL's averaged iterate `params_avg`)."""
    evaluate = jax.jit(algorithm.evaluate)

    def metrics(state):
        w = np.asarray(parallel.to_host(getattr(state, "params_avg", state.params)),
                       np.float64)
        gap = w - problem["optimum"]
        loss = np.asarray(parallel.to_host(evaluate(state, problem["train"])["client_loss"]),
                          np.float64)
        return {"dist_to_optimum": np.linalg.norm(gap, axis=-1),
                "dist_to_surrogate": np.linalg.norm(w - problem["surrogate"], axis=-1),
                "train_loss": (problem["p"] * loss).sum(-1),
                "excess_loss": np.einsum("sd,sde,se->s", gap, problem["hessian"], gap)}

    return metrics
