"""The quadratic clients of the FedNova comparison, their local work and the closed forms.

Client i of seed s (numpy, seed sequence [seed, s]):

    θ_i ~ N(0, R² I_d)                       its own optimum
    n_i ~ uniform on {n_min, ..., n_max}     its examples
    X_i ~ N(0, 1)^{n_i × d},  y_i = X_i θ_i + σ ε,  ε ~ N(0, 1)^{n_i}
    F_i(w) = (1/n_i) ‖X_i w − y_i‖²           the model's squared error, its mean

Its local work τ_i is the same in every seed and round: tau_min, ..., tau_max evenly
spaced over the clients (client 0 the fewest steps, client m − 1 the most), rounded.

The two fixed points, in float64 from the float32 rows the methods train on, with
p_i ∝ n_i (weighting=examples) or 1 (uniform), Σ p_i = 1, and
H_q = Σ q_i X_iᵀX_i / n_i:

    w* = argmin Σ p_i F_i      = H_p⁻¹ Σ p_i X_iᵀy_i / n_i        (FedNova's, lr → 0)
    w̃  = argmin Σ p_i τ_i F_i  = H_pτ⁻¹ Σ p_i τ_i X_iᵀy_i / n_i   (FedAvg's, lr → 0)

With weighting=examples, w* is the least-squares fit of every client's rows pooled.
"""

from __future__ import annotations

import numpy as np

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.experiments.base import stack_seeds


def work_table(s: dict) -> tuple[int, ...]:
    """τ_i per client: tau_min, ..., tau_max evenly spaced over the clients, rounded."""
    steps = np.linspace(s["tau_min"], s["tau_max"], s["num_clients"])
    return tuple(int(t) for t in np.rint(steps))


def client_weights(n, weighting: str) -> np.ndarray:
    """p_i (float64, Σ p_i = 1): ∝ n_i ("examples") or uniform."""
    n = np.asarray(n, np.float64)
    p = n if weighting == "examples" else np.ones_like(n)
    return p / p.sum(-1, keepdims=True)


def _real_rows(x, n) -> np.ndarray:
    """x [m, n_max, d] in float64, the rows past each client's n_i zeroed."""
    real = np.arange(x.shape[1]) < np.asarray(n)[:, None]
    return np.where(real[..., None], np.asarray(x, np.float64), 0.0)


def _per_row(q, n) -> np.ndarray:
    return np.asarray(q, np.float64) / np.maximum(np.asarray(n, np.float64), 1.0)


def curvature(x, n, q) -> np.ndarray:
    """H_q = Σ_i q_i X_iᵀX_i / n_i over the clients' first n_i rows (float64; x [m, n_max, d],
    n [m], q [m]): F(w) − F(w*) = (w − w*)ᵀ H_p (w − w*)."""
    x = _real_rows(x, n)
    return np.einsum("i,ind,ine->de", _per_row(q, n), x, x)


def weighted_argmin(x, y, n, q) -> np.ndarray:
    """argmin_w Σ_i q_i (1/n_i) ‖X_i w − y_i‖² (float64; q [m] >= 0): the normal equations
    H_q w = Σ q_i X_iᵀy_i / n_i, solved."""
    moment = np.einsum("i,ind,in->d", _per_row(q, n), _real_rows(x, n),
                       np.asarray(y, np.float64))
    return np.linalg.solve(curvature(x, n, q), moment)


def seed_clients(s: dict, i: int) -> FederatedData:
    """Seed i's clients (float32 rows, zero-padded to n_max)."""
    rng = np.random.default_rng([s["seed"], i])
    m, d = s["num_clients"], s["d"]
    theta = s["R"] * rng.normal(size=(m, d))
    sizes = rng.integers(s["n_min"], s["n_max"] + 1, size=m)
    xs, ys = [], []
    for theta_i, n_i in zip(theta, sizes, strict=True):
        x = rng.normal(size=(n_i, d))
        y = x @ theta_i + s["sigma"] * rng.normal(size=n_i)
        xs.append(x.astype(np.float32))
        ys.append(y.astype(np.float32))
    return FederatedData.from_clients(xs, ys, n_max=s["n_max"])


def argmin_per_seed(problem: dict, factor) -> np.ndarray:
    """[seeds, d]: each seed's argmin Σ_i p_i factor_i F_i (factor [m] >= 0), float64."""
    train = problem["train"]
    x, y, n = np.asarray(train.x), np.asarray(train.y), np.asarray(train.num_examples)
    return np.stack([weighted_argmin(x[i], y[i], n[i], problem["p"][i] * factor)
                     for i in range(x.shape[0])])


def build_problem(s: dict) -> dict:
    """Every seed's clients stacked on a leading [seeds] axis ("train"), the work table, and
    per seed the weights p [seeds, m], w* and w̃ [seeds, d] and H_p [seeds, d, d]."""
    train = stack_seeds([seed_clients(s, i) for i in range(s["seeds"])])
    x, n = np.asarray(train.x), np.asarray(train.num_examples)
    p = client_weights(n, s["weighting"])
    problem = {"train": train, "work": work_table(s), "p": p,
               "hessian": np.stack([curvature(x[i], n[i], p[i]) for i in range(len(p))])}
    problem["optimum"] = argmin_per_seed(problem, 1.0)
    problem["surrogate"] = argmin_per_seed(problem, np.asarray(problem["work"], np.float64))
    return problem
