"""IFCA on the synthetic mixture of linear regressions (Ghosh et al. 2020, Fig. 3).

Two experiments live here:

- `SyntheticRun` (presets ifca-synthetic, fedavg-synthetic, local-synthetic,
  ...): one algorithm trained on one data seed with `restarts` random inits at
  once, reporting the restart with the lowest final training loss; its
  comparison trains IFCA, FedAvg, local models and one-shot clustering side by
  side over `seeds` seeds.
- `SuccessSweep` (presets ifca-success-*): the official success-probability
  protocol, whose cell vmaps data seeds × learning rates × restarts.

Protocol of the official code (docs/protocols.md#ifca-synthetic): squared loss without ½,
θ^(0) ~ Bernoulli(0.5)^d not scaled by R, option I full-batch gradient
averaging divided by m, constant lr, 300 iterations. Success: for each data
seed the best final min_dist over (restart, lr) is < 0.6σ (+0.001 in the R–σ
grids). A seed whose runs all diverge is a failure (the official summary
counts it as a success through a placeholder; that is a bug).
"""

from __future__ import annotations

import functools
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, logs, parallel, plots, simulate
from fedjax_sim.algorithms import (
    cfl,
    fedavg,
    hypcluster,
    ifca,
    local_models,
    one_shot_clustering,
    with_restarts,
    with_seeds,
)
from fedjax_sim.compare import MethodRun
from fedjax_sim.data import check_mixture_settings, linear_mixture
from fedjax_sim.experiments.base import (
    DATA,
    INIT,
    ROUNDS,
    Experiment,
    Preset,
    RunContext,
    client_mean,
    stream_key,
)
from fedjax_sim.experiments.settings import Setting, count, seed_setting
from fedjax_sim.memory import choose_client_chunk, estimate_bytes_per_client, tree_bytes
from fedjax_sim.metrics import cluster_identity_accuracies, cluster_identity_accuracy, min_dist
from fedjax_sim.models import linear_regression

ALGORITHM_NAMES = ("ifca", "fedavg", "local", "oneshot", "hypcluster", "cfl")
TRIAL_METRICS = ("train_loss", "test_loss", "cluster_accuracy", "min_dist")
CLUSTERING = ("ifca", "oneshot", "hypcluster", "cfl")


def success_threshold(sigma: float, offset: float = 0.0) -> float:
    """The official success threshold on min_dist: 0.6σ (+offset)."""
    return 0.6 * sigma + offset


def least_squares_floor(s: dict) -> float:
    """σ·√(d / (N − d)), N = m·n/k: the error of least squares with the true clusters.

    JSON has no infinity: None when N <= d (no finite floor).
    """
    big_n = s["m"] * s["n"] / s["k"]
    if big_n <= s["d"]:
        return None
    return s["sigma"] * math.sqrt(s["d"] / (big_n - s["d"]))


def _machine_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40


def _problem_shapes(s: dict, n_test: int):
    return jax.eval_shape(
        lambda key: linear_mixture(key, k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=0.0,
                                   R=0.0, n_test=n_test),
        jax.random.key(0),
    )


def plan_memory(s: dict, *, copies: int, per_client_models: bool,
                local_training: bool) -> int | None:
    """client_chunk for the setting's memory budget, after refusing what cannot fit.

    Shapes only (nothing is built). Without a budget (memory_budget_gb = 0)
    the whole round must fit in this machine's memory; with one, the data
    must fit the budget and the round is chunked to fit.

    Raises:
      ValueError naming the settings, before anything is written.
    """
    shapes = _problem_shapes(s, s.get("n_test", 0))
    model = linear_regression(s["d"])
    resident = tree_bytes(shapes.train) + tree_bytes(shapes.test)
    if per_client_models:
        resident += 2 * copies * s["m"] * s["d"] * 4
    per_client = copies * estimate_bytes_per_client(
        model, shapes.train, local_training=local_training, num_clusters=s["k"])
    machine = _machine_bytes()
    budget = s.get("memory_budget_gb", 0.0) * 2**30
    if budget > 0:
        chunk = choose_client_chunk(
            model, shapes.train, budget, local_training=local_training, num_clusters=s["k"],
            copies=copies,
            per_client_models=per_client_models)
    else:
        chunk = None
    peak = resident + per_client * (chunk or s["m"])
    if peak > 0.8 * machine:
        raise ValueError(
            f"this run needs about {peak / 2**30:.3g} GiB (m={s['m']}, n={s['n']}, "
            f"n_test={s.get('n_test', 0)}, d={s['d']}, {copies} copies: restarts × seeds), more "
            f"than this machine's {machine / 2**30:.3g} GiB allow; lower m, n, n_test, d, "
            "restarts or seeds, or set memory_budget_gb to process the clients in chunks."
        )
    return chunk


def make_problem(s: dict, key, mesh=None):
    """One data seed; with a mesh under several processes each builds only its own clients."""
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


# The step-size setting each algorithm reads: a local model fits n < d rows alone, whose
# Hessian 2XᵀX/n has eigenvalues up to ~2(√d + √n)²/n (35 at d = 1000, n = 100), so the
# IFCA/FedAvg step γ = 0.1, stable for cluster-pooled data, diverges there.
LR_SETTING = {"ifca": "lr", "fedavg": "lr", "local": "local_lr", "hypcluster": "lr", "cfl": "lr"}


def build_algorithm(name: str, s: dict, client_chunk=None):
    """The registered algorithm `name` with the experiment's settings (its own step size)."""
    model = linear_regression(s["d"])
    if name in LR_SETTING and LR_SETTING[name] in s:
        s = {**s, "lr": s[LR_SETTING[name]]}
    if name == "ifca":
        local = {"local_steps": s["local_steps"]} if s["option"] == "model" else {
            "divide_by": s["divide_by"]}
        return ifca(model, num_clusters=s["k"], learning_rate=s["lr"], option=s["option"],
                    participation=s["participation"], client_chunk=client_chunk, **local)
    if name == "fedavg":
        return fedavg(model, learning_rate=s["lr"], local_steps=s["local_steps"],
                      participation=s["participation"], client_chunk=client_chunk)
    if name == "local":
        return local_models(model, learning_rate=s["lr"], local_steps=s["local_steps"],
                            client_chunk=client_chunk)
    if name == "oneshot":
        return one_shot_clustering(
            model, num_clusters=s["k"], learning_rate=s["lr"], local_steps=s["local_steps"],
            pretrain_steps=s["pretrain_steps"], participation=s["participation"],
            client_chunk=client_chunk, pretrain_learning_rate=s.get("oneshot_lr"))
    if name == "hypcluster":  # k hypotheses, each client trains the one of lowest loss
        return hypcluster(model, num_clusters=s["k"], learning_rate=s["lr"],
                          local_steps=s["local_steps"], participation=s["participation"],
                          client_chunk=client_chunk)
    if name == "cfl":  # up to k clusters by recursive bi-partitioning (its ε₁, ε₂ defaults)
        return cfl(model, learning_rate=s["lr"], max_clusters=s["k"],
                   local_steps=s["local_steps"], participation=s["participation"],
                   client_chunk=client_chunk)
    raise ValueError(f"setting algorithm must be one of {ALGORITHM_NAMES}; got {name!r}.")


def _cluster_models(name: str, state):
    """[..., k, d] models to measure min_dist on; None for local models."""
    if name in CLUSTERING:
        return state.cluster_params
    if name == "fedavg":
        return state.params[..., None, :]
    return None


def _metrics_fn(name: str, algorithm, problem, k: int):
    """state -> {metric: [copies...]} on train and test data, for a (vmapped) algorithm."""
    evaluate = backend.jit(algorithm.evaluate, problem.train.x.shape[-1])
    truth = parallel.to_host(problem.train.cluster)
    lead = truth.ndim - 1  # a leading seed axis on the data

    @jax.jit
    def dist(models, theta_star):
        fn = min_dist
        for _ in range(models.ndim - 2 - lead):
            fn = jax.vmap(fn, in_axes=(0, None))
        for _ in range(lead):
            fn = jax.vmap(fn, in_axes=(0, 0))
        return fn(models, theta_star)

    def averages(evaluation):
        loss = parallel.to_host(evaluation["client_loss"]).astype(np.float64)
        weight = parallel.to_host(evaluation["client_weight"]).astype(np.float64)
        worst = np.where(weight > 0, loss, -np.inf).max(-1)
        return client_mean(loss, weight), worst

    def metrics(state):
        train, test = evaluate(state, problem.train), evaluate(state, problem.test)
        out = {}
        out["train_loss"], out["train_loss_worst"] = averages(train)
        out["test_loss"], out["test_loss_worst"] = averages(test)
        if name in CLUSTERING:
            assignment = parallel.to_host(train["assignment"])
            shape = truth.shape[:-1] + (1,) * (assignment.ndim - truth.ndim) + truth.shape[-1:]
            truths = np.broadcast_to(truth.reshape(shape), assignment.shape)
            out["cluster_accuracy"] = cluster_identity_accuracies(assignment, truths, k)
        models = _cluster_models(name, state)
        if models is not None:
            out["min_dist"] = parallel.to_host(dist(models, problem.theta_star))
        return out

    return metrics


def _best_restart(final: dict) -> tuple[int | None, np.ndarray]:
    """(index of the lowest final train loss among restarts that stayed finite, diverged mask)."""
    diverged = np.zeros(np.shape(final["train_loss"]), bool)
    for value in final.values():
        if np.ndim(value) == diverged.ndim and np.shape(value) == diverged.shape:
            diverged |= ~np.isfinite(np.asarray(value, np.float64))
    losses = np.where(diverged, np.inf, np.asarray(final["train_loss"], np.float64))
    if diverged.all():
        return None, diverged
    return int(np.argmin(losses)), diverged


def _per_restart_rows(rows: list[dict]) -> list[dict]:
    """History rows with [restarts] values -> one metrics.csv row per (round, restart)."""
    out = []
    for row in rows:
        values = {k: np.asarray(v) for k, v in row.items() if k != "round"}
        restarts = max((v.shape[0] for v in values.values() if v.ndim), default=1)
        for r in range(restarts):
            out.append({"round": row["round"], "restart": r, **{
                k: float(v[r]) if v.ndim else float(v) for k, v in values.items()}})
    return out


def _best_restart_rows(history: list[dict]) -> list[dict]:
    """History rows with [seeds, restarts] values -> per-seed rows of each seed's restart
    of lowest final training loss; a seed whose every restart diverged keeps restart 0
    (whose values go non-finite where it diverged)."""
    final = history[-1]
    seeds = np.shape(final["train_loss"])[0]
    chosen = [_best_restart({m: np.asarray(v)[i] for m, v in final.items() if m != "round"})[0]
              or 0 for i in range(seeds)]
    out = []
    for row in history:
        picked = {}
        for m, v in row.items():
            if m == "round":
                continue
            v = np.asarray(v, np.float64)
            picked[m] = v[np.arange(seeds), chosen] if v.ndim == 2 else v
        for metric in COMPARE_METRICS:  # NaN where a method has none (local: no min_dist)
            picked.setdefault(metric, np.full(seeds, np.nan))
        out.append({"round": row["round"], **picked})
    return out


# ----------------------------------------------------------------------------- one run

COMPARE_METRICS = ("test_loss", "train_loss", "cluster_accuracy", "min_dist")  # table order

_SHAPE = (
    Setting("k", int, 2, "clusters", minimum=1, maximum=1024),
    count("m", 100, "clients (machines); a multiple of k"),
    count("n", 100, "training examples per client"),
    count("d", 1000, "dimension of x and θ", maximum=10**6),
    Setting("sigma", float, 0.1, "noise standard deviation σ", minimum=0.0, traced=True),
    Setting("R", float, 0.5, "cluster separation: θ*_j = R · Bernoulli(0.5)^d", minimum=0.0,
            traced=True),
)

_SHAPE_NAMES = tuple(st.name for st in _SHAPE)

# Which algorithms read each setting that not every algorithm reads; a value
# other than the default for an algorithm that would ignore it is refused.
_READ_BY = {
    "lr": ("ifca", "fedavg", "oneshot", "hypcluster", "cfl"),
    "local_lr": ("local",),
    "oneshot_lr": ("oneshot",),
    "option": ("ifca",),
    "divide_by": ("ifca",),
    "pretrain_steps": ("oneshot",),
    "participation": ("ifca", "fedavg", "oneshot", "hypcluster", "cfl"),
}


class SyntheticRun(Experiment):
    name = "ifca_synthetic"
    description = "IFCA and its baselines on the synthetic mixture of linear regressions."
    settings = (
        Setting("algorithm", str, "ifca", "the algorithm of a run", choices=ALGORITHM_NAMES,
                commands=("run", "sweep")),
        *_SHAPE,
        Setting("lr", float, 0.1, "learning rate γ of IFCA and FedAvg (option I step; local "
                "SGD otherwise)", minimum=0.0, traced=True),
        Setting("local_lr", float, 0.02, "learning rate of the local-models baseline (one "
                "client's n rows alone need a smaller step than cluster-pooled data)",
                minimum=0.0, traced=True),
        Setting("oneshot_lr", float, 0.02, "learning rate of one-shot clustering's local "
                "pretraining (it fits one client's rows alone; its clustered rounds use lr)",
                minimum=0.0, traced=True),
        count("rounds", 300, "communication rounds (option I: iterations)"),
        count("restarts", 10, "random initialisations trained at once; the lowest final "
              "training loss is reported", maximum=10_000),
        count("seeds", 5, "seeds of a comparison or sweep (seed, seed+1, ... as folded keys)",
              maximum=10_000, commands=("compare", "sweep")),
        seed_setting(),
        count("eval_every", 10, "evaluate every this many rounds"),
        count("n_test", 100, "test examples per client (its test twin)"),
        Setting("option", str, "gradient", "IFCA option: gradient (I) or model (II) averaging",
                choices=("gradient", "model")),
        Setting("divide_by", str, "m", "IFCA option I divisor: the paper's m or the cohort size",
                choices=("m", "cohort")),
        count("local_steps", 1, "local steps τ per round (option II, FedAvg, local, one-shot)",
              maximum=10**5),
        count("pretrain_steps", 100, "one-shot: local steps before k-means", maximum=10**6),
        Setting("participation", float, 1.0, "fraction of clients per round", minimum=1e-9,
                maximum=1.0),
        count("checkpoint_every", 50, "rounds between checkpoints; 0: none", minimum=0,
              result=False),
        Setting("memory_budget_gb", float, 0.0, "GiB for the client axis; 0: no limit (the "
                "machine's memory)", minimum=0.0, result=False),
    )
    methods = ALGORITHM_NAMES
    baseline = "fedavg"
    panels = (
        ("train_loss", "train loss (avg client)"),
        ("test_loss", "test loss (avg client)"),
        ("cluster_accuracy", "cluster-identity accuracy"),
        ("min_dist", "min_dist to θ*"),
    )
    log_metrics = ("train_loss", "test_loss", "min_dist")

    def validate(self, s: dict, command: str = "run") -> None:
        check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"], s["n_test"])
        if s["k"] > s["m"]:
            raise ValueError(f"setting k={s['k']} exceeds m={s['m']}.")
        defaults = self.defaults()
        if command == "compare":  # every method runs: each setting is read by one of them
            # (`algorithm`, the method of a run, is the one setting compare does not read.)
            for name in self.methods:
                self.client_chunk(s, copies=s["restarts"] * s["seeds"], algorithm=name)
            return
        for key, readers in _READ_BY.items():
            if s[key] != defaults[key] and s["algorithm"] not in readers:
                raise ValueError(
                    f"setting {key} is not read by algorithm {s['algorithm']} (only by "
                    f"{', '.join(readers)}); leave it at {defaults[key]!r}."
                )
        if s["algorithm"] == "ifca":
            if s["option"] == "gradient" and s["local_steps"] != 1:
                raise ValueError(
                    "setting local_steps is not read by IFCA option gradient (one full-batch "
                    "gradient per client); use option=model for local training."
                )
            if s["option"] == "model" and s["divide_by"] != "m":
                raise ValueError("setting divide_by applies to IFCA option gradient only.")
        self.client_chunk(s, copies=s["restarts"])

    def client_chunk(self, s: dict, copies: int, algorithm: str | None = None):
        algorithm = algorithm or s["algorithm"]
        local_training = not (algorithm == "ifca" and s["option"] == "gradient")
        return plan_memory(s, copies=copies, per_client_models=algorithm in ("local", "oneshot"),
                           local_training=local_training)

    def run(self, s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
        """Trains the algorithm (with `restarts` random inits in parallel) on one data seed.

        The restart reported is the one with the lowest final training loss
        among those that stayed finite: a choice a user could make without
        knowing θ* (the sweep protocol instead takes the best min_dist, as the
        official code does). metrics.csv gets one row per (round, restart).
        """
        key = jax.random.key(s["seed"])
        problem = make_problem(s, jax.random.fold_in(key, DATA), ctx.mesh)
        name = s["algorithm"]
        client_chunk = self.client_chunk(s, copies=s["restarts"])
        algorithm = with_restarts(build_algorithm(name, s, client_chunk), s["restarts"])
        every = s["checkpoint_every"]
        diverged = None
        try:
            _, history = simulate.run(
                algorithm, problem.train, jax.random.fold_in(key, ROUNDS), rounds=s["rounds"],
                eval_every=s["eval_every"], evaluate=_metrics_fn(name, algorithm, problem, s["k"]),
                progress=ctx.progress, description=f"{name}-synthetic", mesh=ctx.mesh,
                checkpoint_dir=ctx.checkpoint_dir if every else None,
                checkpoint_every=every or None, resume=ctx.resume and bool(every),
                copies_axis=True, on_rows=lambda rows: ctx.on_rows(_per_restart_rows(rows)),
                timing=ctx.timing, progress_summary=logs.best_copy("train_loss"),
            )
        except simulate.Diverged as err:
            history, diverged = err.history, err
        final = history[-1]
        best, restart_diverged = _best_restart(final)
        rows = [r for r in _per_restart_rows(history) if r["restart"] == (best or 0)]
        threshold = success_threshold(s["sigma"])
        timing = ctx.timing
        seconds = timing.get("run_seconds", 0.0)
        summary = {
            "algorithm": name,
            "best_restart": best,
            "client_chunk": client_chunk,
            "final": rows[-1] if best is not None else None,
            "success": bool(best is not None and name in CLUSTERING + ("fedavg",)
                            and rows[-1].get("min_dist", math.inf) < threshold),
            "success_threshold": threshold,
            "diverged": bool(diverged is not None or best is None),
            "restarts_diverged": restart_diverged.tolist(),
            "restarts_final_train_loss": np.asarray(final["train_loss"]).tolist(),
            "least_squares_floor": least_squares_floor(s),
            "rounds_run": timing.get("rounds_run"),
            "compile_seconds": timing.get("compile_seconds"),
            "seconds": seconds,
            "rounds_per_second": timing["rounds_run"] / seconds
            if timing.get("rounds_run") and seconds > 0 else None,
        }
        if "min_dist" in final:
            summary["restarts_final_min_dist"] = np.asarray(final["min_dist"]).tolist()
        if diverged is not None:
            summary.update(
                diverged_round=diverged.round,
                diverged_metric=diverged.metric,
                diverged_value=diverged.value,
                last_checkpoint_round=diverged.checkpoint_round,
            )
        return rows, summary

    def plot_run(self, rows, summary, out_dir) -> None:
        threshold = summary["success_threshold"]
        name = summary["algorithm"]
        plots.plot_history(
            rows, out_dir / "metrics.png", list(self.panels),
            title=f"{name} (restart {summary['best_restart']}, lowest final train loss)",
            hlines={"min_dist": (threshold, "success threshold")} if threshold > 0 else None,
            log_y=set(self.log_metrics), groups={name: rows},
            colors=plots.method_colors(self.methods),
        )

    # ---- comparison: IFCA, FedAvg, local, one-shot over the same seeds

    def problem(self, s: dict):
        """`seeds` data seeds stacked on a leading axis: seed i's data comes from
        fold_in(fold_in(key(seed), DATA), i)."""
        key = stream_key(s["seed"], DATA)
        data_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(s["seeds"]))
        return jax.jit(jax.vmap(lambda kk: make_problem(s, kk)))(data_keys)

    def method_run(self, name: str, s: dict, problem) -> MethodRun:
        """Every method gets the same data and per-seed keys (`with_seeds`); within a seed
        it keeps its restart of lowest final training loss (as `run` does)."""
        chunk = self.client_chunk(s, copies=s["restarts"] * s["seeds"], algorithm=name)
        algorithm = with_seeds(with_restarts(build_algorithm(name, s, chunk), s["restarts"]),
                               s["seeds"])
        return MethodRun(
            algorithm, problem.train, stream_key(s["seed"], ROUNDS),
            s["rounds"], _metrics_fn(name, algorithm, problem, s["k"]), s["eval_every"],
            seed_rows=_best_restart_rows,
            progress_summary=logs.best_copy("train_loss", noun="restarts", outer="seeds"))

    def table(self, s: dict) -> list[str]:
        return list(COMPARE_METRICS)

    # ---- generic sweep: any setting as an axis; cells that differ only in traced
    # settings (lr, σ, R) and their seeds are one vmapped, compiled program

    group_cells = True

    def trial_columns(self, axes):
        return [*axes, "cell_id", "data_seed", "train_loss", "test_loss", "cluster_accuracy",
                "min_dist", "diverged"]

    def trials(self, cell, seed_ids, mesh=None):
        return self.group_trials([cell], seed_ids, mesh)

    def group_trials(self, cells, seed_ids, mesh=None):
        """trials.csv rows of every (cell, seed); the cells differ only in traced settings.

        Seed i of a cell is the run with seed = cell's seed + i: the same
        numbers as `fedjax-sim run` with that seed (to float rounding), its
        lowest-final-training-loss restart among those that stayed finite.
        All (cell, seed) pairs, restarts included, are one vmap of one
        compiled program, in chunks that fit the memory budget (default: half
        the machine).
        """
        del mesh  # the pairs axis is small; clients are not sharded here
        base = cells[0]
        pairs = [(c, i) for c in cells for i in seed_ids]
        traced = [name for name, st in self.declared.items() if st.traced]
        # The settings the cells share (not seeds, nor what only another command reads).
        static = tuple(sorted((k, v) for k, v in base.items()
                              if k in self.declared and k not in traced and k != "seeds"
                              and "sweep" in (self.declared[k].commands or ("sweep",))))
        per_pair = plan_pair_bytes(base)
        budget = base["memory_budget_gb"] * 2**30 or 0.5 * _machine_bytes()
        size = int(max(1, min(len(pairs), budget // per_pair)))
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

    def cell_cost(self, cell):
        return cell["m"] * cell["n"] * cell["d"] * cell["k"] * cell["rounds"] * cell["restarts"]

    def summarize_cells(self, trials, cells, axes):
        summary = []
        for cell, rows in _rows_by_cell(trials, cells):
            out = {**{a: cell[a] for a in axes}, "seeds": len(rows)}
            for metric in TRIAL_METRICS:
                values = np.array([float(r[metric]) if r[metric] != "" else np.nan
                                   for r in rows])
                finite = values[np.isfinite(values)]
                out[f"{metric}_mean"] = float(finite.mean()) if finite.size else None
                out[f"{metric}_std"] = float(finite.std(ddof=1)) if finite.size > 1 else None
            summary.append(out)
        return summary


def _rows_by_cell(trials, cells):
    by_cell: dict[str, list] = {}
    for row in trials:
        by_cell.setdefault(row["cell_id"], []).append(row)
    for cell in cells:
        rows = [r for r in by_cell.get(cell["cell_id"], [])
                if int(r["data_seed"]) < cell["seeds"]]
        yield cell, rows


def plan_pair_bytes(s: dict) -> int:
    """Bytes one (cell, seed) of a vectorized sweep holds: its data and every restart's round."""
    shapes = _problem_shapes(s, s["n_test"])
    model = linear_regression(s["d"])
    local_training = not (s["algorithm"] == "ifca" and s["option"] == "gradient")
    data = tree_bytes(shapes.train) + tree_bytes(shapes.test)
    work = s["restarts"] * s["m"] * estimate_bytes_per_client(
        model, shapes.train, local_training=local_training, num_clusters=s["k"])
    return data + work


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
        models = _cluster_models(name, state)
        if models is not None:
            out["min_dist"] = jax.vmap(min_dist, in_axes=(0, None))(models, problem.theta_star)
        return out

    return jax.vmap(one)(*args)


def _trial_row(name: str, k: int, out: dict) -> dict:
    """One trial's metrics (its best finite restart) from `_final_runs`' per-restart arrays."""
    final = {"train_loss": client_mean(*out["train"]), "test_loss": client_mean(*out["test"])}
    if "min_dist" in out:
        final["min_dist"] = out["min_dist"].astype(np.float64)
    if name in CLUSTERING:
        final["cluster_accuracy"] = np.array([
            cluster_identity_accuracy(a, out["truth"], k) for a in out["assignment"]])
    best, _ = _best_restart(final)
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
            algorithm = ifca(model, num_clusters=k, learning_rate=lr)
            state = algorithm.init(jax.random.fold_in(init_key, restart), problem.train)
            state, _ = simulate.scan_rounds(algorithm, state, problem.train, round_key, 0, rounds)
            return min_dist(state.cluster_params, problem.theta_star)

        per_lr = jax.vmap(one_run, in_axes=(None, 0))
        return jax.vmap(per_lr, in_axes=(0, None))(lrs, jnp.arange(restarts))

    return jax.vmap(one_seed)(seed_ids)


RUN = SyntheticRun()


_TINY = {"m": 20, "n": 50, "d": 10, "R": 1.0, "rounds": 60, "restarts": 10, "eval_every": 10,
         "n_test": 20}

PRESETS = [
    Preset("ifca-synthetic", RUN,
           "IFCA (option I, gradient averaging) on the synthetic mixture of linear regressions."),
    Preset("ifca-synthetic-tiny", RUN,
           "A seconds-long IFCA synthetic run (k=2, m=20, n=50, d=10) for smoke tests.", _TINY),
    Preset("fedavg-synthetic", RUN,
           "FedAvg (one global model) on the synthetic mixture of linear regressions.",
           {"algorithm": "fedavg"}),
    Preset("local-synthetic", RUN,
           "Local models (each client alone) on the synthetic mixture of linear regressions.",
           {"algorithm": "local"}),
    Preset("oneshot-synthetic", RUN,
           "One-shot clustering (k-means of local models) on the synthetic mixture.",
           {"algorithm": "oneshot"}),
]
