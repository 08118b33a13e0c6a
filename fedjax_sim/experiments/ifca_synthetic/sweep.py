"""Two vmapped sweep programs on the synthetic mixture.

- `group_trials` (the sweep of the `ifca_synthetic` record: any setting as an axis):
  every (cell, seed) pair of cells that differ only in traced settings (lr, σ,
  R), restarts included, is one vmap of one compiled program (`_final_runs`).
- `cell_min_dist` (the success protocol, `ifca_success`): data seeds ×
  learning rates × restarts of IFCA option I in one compiled program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, memory, simulate
from fedjax_sim.algorithms import ifca, sgd, with_restarts
from fedjax_sim.data import linear_mixture
from fedjax_sim.experiments.base import DATA, INIT, ROUNDS, client_mean
from fedjax_sim.experiments.ifca_synthetic.common import (
    TRIAL_METRICS,
    best_restart,
    build_algorithm,
    cluster_models,
    clustering,
    make_problem,
    problem_shapes,
    trains_locally,
)
from fedjax_sim.metrics import cluster_identity_accuracy, min_dist
from fedjax_sim.models import linear_regression


def group_trials(declared: dict, cells: list[dict], seed_ids: list[int]) -> list[dict]:
    """trials.csv rows of every (cell, seed); the cells differ only in traced settings.

    Seed i of a cell is the run with seed = cell's seed + i: the same
    numbers as `fedjax-sim run` with that seed (to float rounding), its
    lowest-final-training-loss restart among those that stayed finite.
    All (cell, seed) pairs, restarts included, are one vmap of one
    compiled program, in chunks that fit the memory budget (default: half
    the machine).

    Args:
      declared: the experiment's settings by name (which are traced, which
        only another command reads).
      cells: the cells' settings, each with its "cell_id".
      seed_ids: the seeds i to run of every cell.
    """
    base = cells[0]
    pairs = [(c, i) for c in cells for i in seed_ids]
    traced = [name for name, st in declared.items() if st.traced]
    # The settings the cells share (not seeds, nor what only another command reads).
    static = tuple(sorted((k, v) for k, v in base.items()
                          if k in declared and k not in traced and k != "seeds"
                          and "sweep" in (declared[k].commands or ("sweep",))))
    size = pairs_per_program(cells, len(seed_ids))
    rows = []
    for start in range(0, len(pairs), size):
        chunk = pairs[start : start + size]
        values = [jnp.asarray([c[t] for c, _ in chunk], jnp.float32) for t in traced]
        seeds = jnp.asarray([c["seed"] + i for c, i in chunk], jnp.uint32)
        out = jax.tree.map(np.asarray, _final_runs(static, tuple(traced), *values, seeds))
        for j, (cell, seed_id) in enumerate(chunk):
            rows.append({"cell_id": cell.get("cell_id"), "data_seed": seed_id,
                         **_trial_row(base["algorithm"], base["k"],
                                      jax.tree.map(lambda a, j=j: a[j], out))})
    return rows


def summarize_cells(trials: list[dict], cells: list[dict], axes: list[str]) -> list[dict]:
    """One row per cell: mean and std over its seeds of each trial metric (finite values)."""
    summary = []
    for cell, rows in rows_by_cell(trials, cells):
        out = {**{a: cell[a] for a in axes}, "seeds": len(rows)}
        for metric in TRIAL_METRICS:
            values = np.array([float(r[metric]) if r[metric] != "" else np.nan
                               for r in rows])
            finite = values[np.isfinite(values)]
            out[f"{metric}_mean"] = float(finite.mean()) if finite.size else None
            out[f"{metric}_std"] = float(finite.std(ddof=1)) if finite.size > 1 else None
        summary.append(out)
    return summary


def rows_by_cell(trials, cells):
    """(cell, its trials.csv rows of seeds below the cell's seeds) for every cell."""
    by_cell: dict[str, list] = {}
    for row in trials:
        by_cell.setdefault(row["cell_id"], []).append(row)
    for cell in cells:
        rows = [r for r in by_cell.get(cell["cell_id"], [])
                if int(r["data_seed"]) < cell["seeds"]]
        yield cell, rows


def pairs_per_program(cells: list[dict], seeds: int) -> int:
    """(cell, seed) pairs per compiled program of `group_trials` over `seeds` seeds of
    `cells`: as many as fit memory_budget_gb (0: half the machine), at least 1."""
    return memory.items_per_chunk(len(cells) * seeds, pair_bytes(cells[0]),
                                  cells[0]["memory_budget_gb"] * 2**30)


def pair_bytes(s: dict) -> int:
    """Bytes one (cell, seed) of a vectorized sweep holds: its data and every restart's round."""
    shapes = problem_shapes(s, s["n_test"])
    return memory.run_bytes(
        linear_regression(s["d"]), shapes.train, copies=s["restarts"],
        extra_resident_bytes=memory.tree_bytes(shapes.test),
        local_training=trains_locally(s["algorithm"], s), num_clusters=s["k"])


@functools.partial(jax.jit, static_argnames=("static", "traced"))
def _final_runs(static, traced, *args):
    """Final evaluation of every (cell, seed) pair of a sweep group, as one vmap.

    Args:
      static: the group's settings that are not traced, as sorted (key, value) pairs.
      traced: names of the traced settings, in the order of args.
      args: one [pairs] array per traced setting, then [pairs] uint32 seeds.
    """
    s = dict(static)
    name = s["algorithm"]

    def one(*values):
        *traced_values, seed = values
        cell = {**s, **dict(zip(traced, traced_values, strict=True))}
        key = jax.random.key(seed)
        problem = make_problem(cell, jax.random.fold_in(key, DATA))
        algorithm = with_restarts(build_algorithm(name, cell), s["restarts"])
        # As simulate.run: the key splits into the init key and the rounds' key.
        key_init, key_rounds = jax.random.split(jax.random.fold_in(key, ROUNDS))
        state = algorithm.init(key_init, problem.train)
        state, _ = simulate.scan_rounds(algorithm, state, problem.train, key_rounds, 0,
                                        s["rounds"])
        train = algorithm.evaluate(state, problem.train)
        test = algorithm.evaluate(state, problem.test)
        out = {"train": (train["client_loss"], train["client_weight"]),
               "test": (test["client_loss"], test["client_weight"]),
               "assignment": train["assignment"], "truth": problem.train.cluster}
        models = cluster_models(name, state)
        if models is not None:
            out["min_dist"] = jax.vmap(min_dist, in_axes=(0, None))(models, problem.theta_star)
        return out

    return jax.vmap(one)(*args)


def _trial_row(name: str, k: int, out: dict) -> dict:
    """One trial's metrics (its best finite restart) from `_final_runs`' per-restart arrays."""
    final = {"train_loss": client_mean(*out["train"]), "test_loss": client_mean(*out["test"])}
    if "min_dist" in out:
        final["min_dist"] = out["min_dist"].astype(np.float64)
    if clustering(name):
        final["cluster_accuracy"] = np.array([
            cluster_identity_accuracy(a, out["truth"], k) for a in out["assignment"]])
    best, _ = best_restart(final)
    row = {metric: math.nan for metric in TRIAL_METRICS}
    if best is not None:
        row.update({metric: float(values[best]) for metric, values in final.items()})
    return {**row, "diverged": int(best is None)}


# ----------------------------------------------------------------------------- success sweeps

SWEEP_KEYS = ("k", "m", "n", "d", "sigma", "R")


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
    data_key = jax.random.fold_in(seed_key, DATA)
    init_key = jax.random.fold_in(seed_key, INIT)
    round_key = jax.random.fold_in(seed_key, ROUNDS)

    def one_seed(seed_id):
        problem = linear_mixture(
            jax.random.fold_in(data_key, seed_id), k=k, m=m, n=n, d=d, sigma=sigma, R=R
        )

        def one_run(lr, restart):
            algorithm = ifca(model, sgd(lr), num_clusters=k)
            state = algorithm.init(jax.random.fold_in(init_key, restart), problem.train)
            state, _ = simulate.scan_rounds(algorithm, state, problem.train, round_key, 0, rounds)
            return min_dist(state.cluster_params, problem.theta_star)

        per_lr = jax.vmap(one_run, in_axes=(None, 0))
        return jax.vmap(per_lr, in_axes=(0, None))(lrs, jnp.arange(restarts))

    return jax.vmap(one_seed)(seed_ids)

