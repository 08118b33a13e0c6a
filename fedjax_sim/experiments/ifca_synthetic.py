"""IFCA on the synthetic mixture of linear regressions (Ghosh et al. 2020, Fig. 3).

Protocol of the official code (PAPERS.md §2.1): squared loss without ½,
θ^(0) ~ Bernoulli(0.5)^d not scaled by R, option I full-batch gradient
averaging divided by m, constant lr, 300 iterations.

Success-probability protocol: for each data seed, run every (restart, lr) pair;
the seed succeeds when the best final min_dist over them is < 0.6σ
(+0.001 in the R–σ grids). A seed whose runs all diverge is a failure (the
official summary counts it as a success through a placeholder; that is a bug).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, parallel, simulate
from fedjax_sim.algorithms import ifca, with_restarts
from fedjax_sim.data import check_mixture_settings, linear_mixture
from fedjax_sim.experiments.settings import require_float, require_int, require_seed
from fedjax_sim.memory import choose_client_chunk
from fedjax_sim.metrics import cluster_identity_accuracy, min_dist
from fedjax_sim.models import linear_regression

# Stream ids folded into the user's seed, so data, inits and rounds never share keys.
_DATA, _INIT, _ROUNDS = 0, 1, 2

RUN_DEFAULTS = {
    "k": 2,
    "m": 100,
    "n": 100,
    "d": 1000,
    "sigma": 0.1,
    "R": 0.5,
    "lr": 0.1,
    "rounds": 300,
    "restarts": 10,
    "seed": 0,
    "eval_every": 10,
    "n_test": 100,
    "option": "gradient",
    "local_steps": 1,
    "participation": 1.0,
    "checkpoint_every": 50,  # rounds between checkpoints; 0: none
    "memory_budget_gb": 0.0,  # GiB for the client axis; 0: no limit
}


def validate_run(s: dict) -> None:
    for key in ("rounds", "restarts", "eval_every", "local_steps", "n_test"):
        require_int(s, key)
    check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"], s["n_test"])
    require_float(s, "lr")
    require_seed(s)
    require_int(s, "checkpoint_every", minimum=0)
    require_float(s, "memory_budget_gb")
    if s["option"] not in ("gradient", "model"):
        raise ValueError(f"setting option must be 'gradient' or 'model'; got {s['option']!r}.")
    if not 0 < s["participation"] <= 1:
        raise ValueError(f"setting participation must be in (0, 1]; got {s['participation']!r}.")
    plan_client_chunk(s)  # a budget below the data itself fails here, before any write


def plan_client_chunk(s: dict):
    """The client_chunk that fits memory_budget_gb (None: no budget, or all fits).

    Uses only shapes (`jax.eval_shape`), so it runs before anything is built.
    """
    if s["memory_budget_gb"] <= 0:
        return None
    shapes = jax.eval_shape(
        lambda key: linear_mixture(
            key, k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=s["sigma"], R=s["R"],
            n_test=s["n_test"],
        ),
        jax.random.key(0),
    )
    return choose_client_chunk(
        linear_regression(s["d"]), shapes.train, s["memory_budget_gb"] * 2**30,
        option=s["option"], num_clusters=s["k"], copies=s["restarts"],
    )


def success_threshold(sigma: float, offset: float = 0.0) -> float:
    """The official success threshold on min_dist: 0.6σ (+offset)."""
    return 0.6 * sigma + offset


def make_problem(s: dict, mesh=None):
    """The run's data seed; with a mesh, each process builds only its own clients."""
    key = jax.random.fold_in(jax.random.key(s["seed"]), _DATA)
    sizes = dict(k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=s["sigma"], R=s["R"],
                 n_test=s["n_test"])
    if mesh is None or jax.process_count() == 1:
        return linear_mixture(key, **sizes)
    ids = parallel.process_client_ids(s["m"], mesh)
    local = linear_mixture(key, client_ids=jnp.asarray(ids), **sizes)
    return local._replace(
        train=parallel.assemble_clients(local.train, s["m"], mesh),
        test=parallel.assemble_clients(local.test, s["m"], mesh),
    )


def run(s: dict, progress: bool = True, mesh=None, checkpoint_dir=None, resume: bool = False):
    """Trains IFCA (with `restarts` random inits in parallel) on one data seed.

    The restart reported is the one with the lowest final training loss: a
    choice a user could make without knowing θ* (the sweep protocol instead
    takes the best min_dist, as the official code does). A restart whose
    state or loss goes NaN/inf is a failed restart; the run diverges only
    when every restart has, and then reports the last good evaluation.

    Args:
      s: resolved settings (see RUN_DEFAULTS).
      progress: draw a progress bar.
      mesh: optional device mesh; the client axis is sharded over it.
      checkpoint_dir: where to checkpoint every `checkpoint_every` rounds
        (None or checkpoint_every=0: no checkpoints).
      resume: continue from the latest checkpoint in checkpoint_dir.

    Returns:
      (rows for metrics.csv, summary dict). A diverged run's summary has
      "diverged": true, "diverged_round", "diverged_metric", "diverged_value"
      and "last_checkpoint_round" (None: no checkpoint was written).
    """
    validate_run(s)
    key = jax.random.key(s["seed"])
    problem = make_problem(s, mesh)
    model = linear_regression(s["d"])
    client_chunk = plan_client_chunk(s)
    base = ifca(
        model, num_clusters=s["k"], learning_rate=s["lr"], option=s["option"],
        local_steps=s["local_steps"], participation=s["participation"],
        client_chunk=client_chunk,
    )
    algorithm = with_restarts(base, s["restarts"])
    evaluate = backend.jit(algorithm.evaluate, s["d"])
    dist = jax.jit(jax.vmap(min_dist, in_axes=(0, None)))
    truth = parallel.to_host(problem.train.cluster)

    def metrics(state):
        train, test = evaluate(state, problem.train), evaluate(state, problem.test)
        train_loss = parallel.to_host(train["client_loss"])  # [restarts, m]
        test_loss = parallel.to_host(test["client_loss"])
        return {
            "train_loss": train_loss.mean(axis=1),
            "train_loss_worst": train_loss.max(axis=1),
            "test_loss": test_loss.mean(axis=1),
            "test_loss_worst": test_loss.max(axis=1),
            "cluster_accuracy": np.array([
                cluster_identity_accuracy(a, truth, s["k"])
                for a in parallel.to_host(train["assignment"])
            ]),
            "min_dist": parallel.to_host(dist(state.cluster_params, problem.theta_star)),
        }

    every = s.get("checkpoint_every", 0)
    start = time.perf_counter()
    diverged = None
    try:
        _, history = simulate.run(
            algorithm, problem.train, jax.random.fold_in(key, _ROUNDS), rounds=s["rounds"],
            eval_every=s["eval_every"], evaluate=metrics, progress=progress,
            description="ifca-synthetic", mesh=mesh,
            checkpoint_dir=checkpoint_dir if every else None,
            checkpoint_every=every or None, resume=resume and bool(every), copies_axis=True,
        )
    except simulate.Diverged as err:
        history, diverged = err.history, err
    seconds = time.perf_counter() - start
    final = history[-1]
    losses = np.where(np.isfinite(final["train_loss"]), final["train_loss"], np.inf)
    best = int(np.argmin(losses))
    rows = [
        {"round": h["round"], **{k: float(v[best]) for k, v in h.items() if k != "round"}}
        for h in history
    ]
    threshold = success_threshold(s["sigma"])
    summary = {
        "best_restart": best,
        "client_chunk": client_chunk,
        "final": rows[-1],
        "success": bool(diverged is None and rows[-1]["min_dist"] < threshold),
        "success_threshold": threshold,
        "diverged": bool(diverged is not None or not np.isfinite(rows[-1]["train_loss"])),
        "restarts_final_train_loss": final["train_loss"].tolist(),
        "restarts_final_min_dist": final["min_dist"].tolist(),
        "least_squares_floor": least_squares_floor(s),
        "seconds": seconds,
        "rounds_per_second": s["rounds"] / seconds if seconds > 0 else float("nan"),
    }
    if diverged is not None:
        summary.update(
            diverged_round=diverged.round,
            diverged_metric=diverged.metric,
            diverged_value=diverged.value,
            last_checkpoint_round=diverged.checkpoint_round,
        )
    return rows, summary


def least_squares_floor(s: dict) -> float:
    """σ·√(d / (N − d)), N = m·n/k: the error of least squares with the true clusters."""
    big_n = s["m"] * s["n"] / s["k"]
    if big_n <= s["d"]:
        return float("inf")
    return s["sigma"] * math.sqrt(s["d"] / (big_n - s["d"]))


# ----------------------------------------------------------------------------- sweeps

SWEEP_KEYS = ("k", "m", "n", "d", "sigma", "R")


def validate_cell(cell: dict) -> None:
    check_mixture_settings(cell["k"], cell["m"], cell["n"], cell["d"], cell["sigma"], cell["R"])
    if not cell["lr"]:
        raise ValueError("setting lr needs at least one learning rate.")
    require_float(cell, "lr")
    for key in ("rounds", "restarts", "seeds"):
        require_int(cell, key)
    require_seed(cell)
    require_float(cell, "threshold_offset")


def cell_min_dist(seed_key, seed_ids, sigma, R, lrs, *, k, m, n, d, rounds, restarts):
    """Final min_dist of every (data seed, lr, restart) of one sweep cell.

    Data seeds, learning rates and restarts are vmap axes; all runs of one data
    seed share its X. Restart r's init depends only on r (as in the official
    code, the same inits serve every data seed and lr).

    Jit-compiled with `backend.compiler_options(d)`.

    Returns:
      [len(seed_ids), len(lrs), restarts] final min_dist (NaN/inf if diverged).
    """
    compiled = backend.jit(_cell_min_dist, d, static_argnames=_CELL_STATIC)
    return compiled(
        seed_key, seed_ids, sigma, R, lrs,
        k=k, m=m, n=n, d=d, rounds=rounds, restarts=restarts,
    )


_CELL_STATIC = ("k", "m", "n", "d", "rounds", "restarts")


def _cell_min_dist(seed_key, seed_ids, sigma, R, lrs, *, k, m, n, d, rounds, restarts):
    """The body of `cell_min_dist`."""
    model = linear_regression(d)
    data_key = jax.random.fold_in(seed_key, _DATA)
    init_key = jax.random.fold_in(seed_key, _INIT)
    round_key = jax.random.fold_in(seed_key, _ROUNDS)

    def one_seed(seed_id):
        problem = linear_mixture(
            jax.random.fold_in(data_key, seed_id), k=k, m=m, n=n, d=d, sigma=sigma, R=R
        )

        def one_run(lr, restart):
            algorithm = ifca(model, num_clusters=k, learning_rate=lr)
            state = algorithm.init(jax.random.fold_in(init_key, restart), problem.train)

            def body(st, t):
                st, _ = algorithm.round(st, problem.train, jax.random.fold_in(round_key, t))
                return st, None

            state, _ = jax.lax.scan(body, state, jnp.arange(rounds))
            return min_dist(state.cluster_params, problem.theta_star)

        per_lr = jax.vmap(one_run, in_axes=(None, 0))
        return jax.vmap(per_lr, in_axes=(0, None))(lrs, jnp.arange(restarts))

    return jax.vmap(one_seed)(seed_ids)


def seed_trials(cell: dict, seed_ids: list[int], mesh=None) -> list[dict]:
    """trials.csv rows of the given data seeds of one cell.

    With a mesh, the seed axis is sharded over its devices (padded with extra
    seeds to a multiple of the device count; their results are dropped).
    """
    ids = np.asarray(seed_ids, np.int32)
    if mesh is not None:
        pad = -len(ids) % mesh.size
        ids = np.concatenate([ids, ids.max() + 1 + np.arange(pad, dtype=np.int32)])
        ids = jax.device_put(ids, parallel.client_sharding(mesh))
    dists = parallel.to_host(
        cell_min_dist(
            jax.random.key(cell["seed"]),
            jnp.asarray(ids),
            jnp.float32(cell["sigma"]),
            jnp.float32(cell["R"]),
            jnp.asarray(cell["lr"], jnp.float32),
            k=cell["k"], m=cell["m"], n=cell["n"], d=cell["d"],
            rounds=cell["rounds"], restarts=cell["restarts"],
        )
    ).astype(np.float64)[: len(seed_ids)]
    threshold = success_threshold(cell["sigma"], cell["threshold_offset"])
    rows = []
    for seed_id, runs in zip(seed_ids, dists, strict=True):
        finite = np.isfinite(runs)
        diverged = int((~finite).sum())
        if finite.any():
            flat = np.where(finite, runs, np.inf)
            lr_i, restart_i = np.unravel_index(np.argmin(flat), flat.shape)
            best = float(flat[lr_i, restart_i])
            best_lr, best_restart = cell["lr"][lr_i], int(restart_i)
        else:  # every run diverged: a failure, not the official code's false success
            best, best_lr, best_restart = float("nan"), float("nan"), -1
        rows.append({
            **{key: cell[key] for key in SWEEP_KEYS},
            "data_seed": int(seed_id),
            "best_min_dist": best,
            "success": int(finite.any() and best < threshold),
            "best_lr": best_lr,
            "best_restart": best_restart,
            "diverged_runs": diverged,
            "all_diverged": int(not finite.any()),
        })
    return rows


def seeds_per_chunk(cell: dict, memory_budget_bytes: float) -> int:
    """Data seeds per compiled chunk: X (and its gradient traffic) must fit the budget."""
    per_seed = 4 * cell["m"] * cell["n"] * (cell["d"] + 1) * 3
    per_seed += 4 * cell["m"] * cell["n"] * cell["k"] * len(cell["lr"]) * cell["restarts"] * 4
    return int(max(1, min(cell["seeds"], memory_budget_bytes // per_seed)))
