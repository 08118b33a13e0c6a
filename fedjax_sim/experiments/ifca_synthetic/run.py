"""The synthetic experiment's record: one method on the mixture (run), all of them (compare).

Presets ifca-synthetic, fedavg-synthetic, local-synthetic, ...: `run` trains one
method on one data seed with `restarts` random inits at once and reports
the restart with the lowest final training loss; `compare` trains IFCA,
FedAvg, local models, one-shot clustering, HypCluster and CFL side by side
over `seeds` seeds (each method's rows of `COMPARE_TABLE` add the restarts);
`sweep` takes any setting as an axis (`sweep.group_trials`).
"""

from __future__ import annotations

import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import logs, plots, simulate
from fedjax_sim.algorithms import ALGORITHMS, with_restarts
from fedjax_sim.data import FederatedData, check_mixture_settings, generated_mixture
from fedjax_sim.execution import Footprint, planned
from fedjax_sim.experiments import study
from fedjax_sim.experiments.base import (
    DATA,
    ROUNDS,
    Experiment,
    Metrics,
    Preset,
    RunContext,
    Sweep,
    Trained,
    check_method,
    stream_key,
)
from fedjax_sim.experiments.ifca_synthetic import sweep
from fedjax_sim.experiments.ifca_synthetic.common import (
    ALGORITHM_NAMES,
    COMPARE_METRICS,
    PROVIDES,
    SHAPE,
    TABLE,
    best_restart,
    best_restart_rows,
    build_algorithm,
    client_sample_shapes,
    generated,
    keeping_client_state,
    keeps_client_state,
    kind_of,
    least_squares_floor,
    make_problem,
    metrics_fn,
    per_client_models,
    per_restart_rows,
    problem_shapes,
    success_threshold,
    trains_locally,
)
from fedjax_sim.experiments.methods import METHODS, Build, Method, readers
from fedjax_sim.experiments.settings import (
    MAX_COUNT,
    Setting,
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    participation_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)
from fedjax_sim.models import Model, linear_regression

# Building stored copies in one jitted draw peaks at about this many times their bytes.
BUILD_FACTOR = 5


def state_shapes(name: str, s: dict, copies: int):
    """The state of `copies` runs of algorithm `name` (shapes only): e.g. IFCA's
    [copies, m] assignments where it keeps them (participation < 1)."""
    data = jax.eval_shape(lambda key: generated_mixture(
        key, k=s["k"], m=s["m"], n=s["n"], d=s["d"], sigma=0.0, R=0.0).train,
        jax.random.key(0))
    data = planned(data, keep_client_state=keeps_client_state(s))  # as the run has it
    algorithm = with_restarts(build_algorithm(name, s), copies)
    return jax.eval_shape(algorithm.init, jax.random.key(0), data)


def _fits(s: dict, footprint: Footprint) -> None:
    """Refuses (ValueError naming the settings), before anything is written, a round the
    executor could not plan under s["memory_budget_gb"] on this machine."""
    RunContext(progress=False).execution(s).check(footprint)


# Generated clients store nothing per client, so m may pass the copies' bound (MAX_COUNT);
# chunked, the round and the evaluation hold nothing per client either (only a state that
# remembers clients, e.g. with participation < 1, which the planner counts).
MAX_GENERATED_M = 10**9

# Which methods read each setting that not every method reads (from the method table); a
# value other than the default for a method that would ignore it is refused.
_OWN = ("local_lr", "oneshot_lr", "option", "divide_by", "pretrain_steps")
_READ_BY = {
    **{k: v for k, v in readers(TABLE).items() if k in _OWN},
    "lr": tuple(n for n, m in TABLE.items() if m.lr not in _OWN),
    "participation": tuple(n for n, m in TABLE.items()
                           if "participation" in inspect.signature(
                               ALGORITHMS[m.algorithm]).parameters),
}


# ----------------------------------------------------------------------------- checks


def validate(s: dict, command: str = "run") -> None:
    """Raises ValueError naming the setting; a run's clients=auto becomes copies or
    generated here, in `s` (what config.json then records)."""
    check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"], s["n_test"])
    if s["k"] > s["m"]:
        raise ValueError(f"setting k={s['k']} exceeds m={s['m']}.")
    if command == "run" and s.get("clients") == "auto":
        s["clients"] = "copies" if copies_fit(s) else "generated"
    if s["m"] > MAX_COUNT and not generated(s):
        raise ValueError(
            f"setting m={s['m']} exceeds {MAX_COUNT:.0e} with clients=copies (every client "
            "stored); set clients=generated (run only) to draw the clients inside the "
            "round.")
    defaults = EXPERIMENT.defaults()
    if command != "compare":
        check_method(EXPERIMENT, s["algorithm"])
    if command == "compare":  # every method runs: each setting is read by one of them
        # (`algorithm`, the method of a run, is the one setting compare does not read.)
        for name in study.compared(EXPERIMENT, s):
            _fits(s, footprint_of(s, copies=s["restarts"] * s["seeds"], algorithm=name,
                                  command=command))
        return
    for key, reading in _READ_BY.items():
        if s[key] != defaults[key] and s["algorithm"] not in reading:
            raise ValueError(
                f"setting {key} is not read by algorithm {s['algorithm']} (only by "
                f"{', '.join(reading)}); leave it at {defaults[key]!r}."
            )
    if s["algorithm"] == "ifca":
        if s["option"] == "gradient" and s["local_steps"] != 1:
            raise ValueError(
                "setting local_steps is not read by IFCA option gradient (one full-batch "
                "gradient per client); use option=model for local training."
            )
        if s["option"] == "model" and s["divide_by"] != "m":
            raise ValueError("setting divide_by applies to IFCA option gradient only.")
    _fits(s, footprint_of(s, copies=s["restarts"], command=command))


def copies_fit(s: dict) -> bool:
    """Whether a run over stored copies fits this machine (and memory_budget_gb)."""
    if s["m"] > MAX_COUNT:
        return False
    try:
        _fits(s, footprint_of({**s, "clients": "copies"}, copies=s["restarts"]))
    except ValueError:
        return False
    return True


def footprint_of(s: dict, copies: int, algorithm: str | None = None,
                 command: str = "run") -> Footprint:
    """What `copies` runs side by side of the algorithm (default: s["algorithm"]) hold,
    for the executor's client chunk under memory_budget_gb (0: none).

    Shapes only (nothing is built). Checked against this machine
    (`Footprint.fit_machine`): without a budget the whole round must fit it; with
    one, the data must fit the budget and the round is chunked to fit.
    """
    name = algorithm or s["algorithm"]
    remedy = "lower m, n, n_test, d, restarts or seeds, or set memory_budget_gb to " \
             "process the clients in chunks"
    if generated(s):
        # One client's rows stand for m drawn per chunk; a chunk is always chosen
        # when they do not all fit (the whole-cohort path would draw all m at once).
        train, test = client_sample_shapes(s, s.get("n_test", 0))
        data, resident, more = train, None, {"generated_clients": s["m"]}
    else:
        shapes = problem_shapes(s, s.get("n_test", 0))
        data, test = shapes.train, shapes.test
        resident = test
        # One jitted draw of every client: its threefry bits and the sliced and
        # reshaped x are live at once (5.0x the data at m = 2·10⁵, n = 10, d = 10,
        # n_test = 100: benchmarks/MEMORY.md).
        more = {"build_factor": BUILD_FACTOR}
        # Suggested where setting clients is read (a run; not ifca_success's cells,
        # whose run settings carry clients=None).
        if command == "run" and s.get("clients") == "copies":
            remedy += ", or set clients=generated (nothing per client stored)"
    per_client = per_client_models(name)
    return Footprint(
        linear_regression(s["d"]), data, copies=copies, num_clusters=s["k"],
        local_training=trains_locally(name, s), per_client_models=per_client,
        evaluated=test, fit_machine=True, resident=resident,
        state=None if per_client else state_shapes(name, s, copies),
        budget_name="memory_budget_gb",
        describe=f"m={s['m']}, n={s['n']}, n_test={s.get('n_test', 0)}, d={s['d']}, "
                 f"{copies} copies: restarts × seeds"
                 + (", generated clients" if generated(s) else ""),
        remedy=remedy + ".", **more)


def footprint(name: str, s: dict, problem) -> Footprint:
    """A comparison's method `name`: restarts × seeds copies."""
    return footprint_of(s, copies=s["restarts"] * s["seeds"], algorithm=name,
                        command="compare")


# ----------------------------------------------------------------------------- run


def run(s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
    """Trains the algorithm (with `restarts` random inits in parallel) on one data seed.

    The restart reported is the one with the lowest final training loss
    among those that stayed finite: a choice a user could make without
    knowing θ* (the sweep protocol instead takes the best min_dist, as the
    official code does). metrics.csv gets one row per (round, restart).
    """
    key = jax.random.key(s["seed"])
    mixture = make_problem(s, jax.random.fold_in(key, DATA), ctx.mesh)
    name = s["algorithm"]
    execution = ctx.execution(
        s, description=f"{name}-synthetic", copies=1,
        on_rows=lambda rows: ctx.on_rows(per_restart_rows(rows)),
        progress_summary=logs.best_copy("train_loss"))
    mixture = execution.planned(keeping_client_state(mixture, s),
                                footprint_of(s, copies=s["restarts"]))
    algorithm = with_restarts(build_algorithm(name, s), s["restarts"])
    diverged = None
    try:
        _, history = simulate.run(
            algorithm, mixture.train, jax.random.fold_in(key, ROUNDS), rounds=s["rounds"],
            eval_every=s["eval_every"],
            evaluate=metrics_fn(name, algorithm, mixture, s["k"], progress=ctx.progress,
                                description=f"{name}-synthetic"),
            execution=execution)
    except simulate.Diverged as err:
        history, diverged = err.history, err
    final = history[-1]
    best, restart_diverged = best_restart(final)
    rows = [r for r in per_restart_rows(history) if r["restart"] == (best or 0)]
    threshold = success_threshold(s["sigma"])
    timing = ctx.timing
    seconds = timing.get("run_seconds", 0.0)
    summary = {
        "algorithm": name,
        "best_restart": best,
        "client_chunk": ctx.timing.get("client_chunk"),
        "final": rows[-1] if best is not None else None,
        "success": bool(best is not None and kind_of(name) != "personal"
                        and rows[-1].get("min_dist", math.inf) < threshold),
        "success_threshold": threshold,
        "diverged": bool(diverged is not None or best is None),
        "restarts_diverged": restart_diverged.tolist(),
        "restarts_final_train_loss": np.asarray(final["train_loss"]).tolist(),
        "least_squares_floor": least_squares_floor(s),
        "rounds_run": timing.get("rounds_run"),
        "compile_seconds": timing.get("compile_seconds"),
        "seconds": seconds,
        "evaluate_seconds": timing.get("evaluate_seconds"),
        "kernel_form": timing.get("kernel_form"),
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


PANELS = (
    ("train_loss", "train loss (avg client)"),
    ("test_loss", "test loss (avg client)"),
    ("cluster_accuracy", "cluster-identity accuracy"),
    ("min_dist", "min_dist to θ*"),
)
LOG_METRICS = ("train_loss", "test_loss", "min_dist")


def plot_run(rows, summary, out_dir) -> None:
    threshold = summary["success_threshold"]
    name = summary["algorithm"]
    plots.plot_history(
        rows, out_dir / "metrics.png", list(PANELS),
        title=f"{name} (restart {summary['best_restart']}, lowest final train loss)",
        hlines={"min_dist": (threshold, "success threshold")} if threshold > 0 else None,
        log_y=set(LOG_METRICS), groups={name: rows},
        colors=plots.method_colors(ALGORITHM_NAMES),
    )


def run_facts(summary: dict, s: dict) -> list[str]:
    """The restart reported, its training loss against the noise floor σ² (the squared
    loss has no ½), its min_dist against the least-squares floor, and success."""
    name, best, final = summary["algorithm"], summary["best_restart"], summary["final"]
    restarts = len(summary["restarts_final_train_loss"])
    if best is None or final is None:
        return [f"every one of {name}'s {restarts} restarts diverged"]
    facts = [f"{name}'s restart {best} of {restarts} has the lowest final training loss, "
             f"{final['train_loss']:.4g}, against the noise floor σ² = {s['sigma'] ** 2:.4g}"]
    if "min_dist" in final:
        floor = summary.get("least_squares_floor")
        facts.append(
            f"its min_dist to θ* is {final['min_dist']:.4g}"
            + (f" (least-squares floor {floor:.4g})" if floor is not None else "")
            + f" against the success threshold {summary['success_threshold']:.4g}: "
            + ("success" if summary["success"] else "no success"))
    return facts


# ----------------------------------------------------------------------------- comparison


class Problem(NamedTuple):
    """What the methods of a comparison share: `seeds` data seeds on a leading axis."""

    train: FederatedData  # [seeds, m, n, ...]
    test: FederatedData  # [seeds, m, n_test, ...]
    theta_star: jax.Array  # [seeds, k, d]
    model: Model  # linear regression without bias


def problem(s: dict) -> Problem:
    """`seeds` data seeds stacked on a leading axis: seed i's data comes from
    fold_in(fold_in(key(seed), DATA), i); the training clients keep per-client state
    only where a round reads it back (`keeping_client_state`)."""
    key = stream_key(s["seed"], DATA)
    data_keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(s["seeds"]))
    mixture = jax.jit(jax.vmap(lambda kk: make_problem(s, kk)))(data_keys)
    return keeping_client_state(Problem(*mixture, model=linear_regression(s["d"])), s)


def restarted(method: Method) -> Method:
    """`method` trained from s["restarts"] random inits at once (`with_restarts`, after
    its own combinators): as a run trains it, so a comparison's seed is a run's."""
    inner = method.wrap

    def wrap(algorithm, b: Build):
        if inner is not None:
            algorithm = inner(algorithm, b)
        return with_restarts(algorithm, b.s["restarts"])

    return method.replace(wrap=wrap)


# The comparison's rows: the catalog's (`methods.METHODS`; a run builds from `TABLE`, the
# rows that fit, and adds the restarts itself), each with its restarts.
COMPARE_TABLE = {name: restarted(m) for name, m in METHODS.items()}


def method_metrics(t: Trained) -> Metrics:
    """Every method's losses, cluster identity and min_dist; within a seed the restart of
    lowest final training loss is kept (as `run` does)."""
    return Metrics(metrics_fn(t.name, t.algorithm, t.problem, t.s["k"]),
                   seed_rows=best_restart_rows,
                   progress_summary=logs.best_copy("train_loss", noun="restarts",
                                                   outer="seeds"))


# ----------------------------------------------------------------------------- sweep
# Any setting as an axis; cells that differ only in traced settings (lr, σ, R) and their
# seeds are one vmapped, compiled program.


def _group_trials(cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
    """trials.csv rows of every (cell, seed) as one vmapped program (`sweep.group_trials`)."""
    del mesh  # the pairs axis is small; clients are not sharded here
    return sweep.group_trials(EXPERIMENT.declared, cells, seed_ids)


SWEEP = Sweep(
    trials=lambda cell, seed_ids, mesh=None: _group_trials([cell], seed_ids, mesh),
    columns=lambda axes, s: [*axes, "cell_id", "data_seed", "train_loss", "test_loss",
                             "cluster_accuracy", "min_dist", "diverged"],
    summarize=sweep.summarize_cells,
    group=True,
    group_trials=_group_trials,
    trials_per_program=lambda group: sweep.pairs_per_program(group, 1),
    cell_cost=lambda cell: (cell["m"] * cell["n"] * cell["d"] * cell["k"] * cell["rounds"]
                            * cell["restarts"]),
)


EXPERIMENT = Experiment(
    name="ifca_synthetic",
    description="IFCA and its baselines on the synthetic mixture of linear regressions.",
    settings=(
        Setting("algorithm", str, "ifca", "the method of a run (any of the method table that "
                "fits)", choices=tuple(METHODS), commands=("run", "sweep")),  # narrowed: fits
        *(count("m", st.default, st.help + f" (up to {MAX_GENERATED_M:.0e} with clients="
                "generated)", maximum=MAX_GENERATED_M) if st.name == "m" else st
          for st in SHAPE),
        Setting("clients", str, "auto", "copies: every client's rows stored for the whole "
                "run; generated: drawn from the client's key inside the round, chunk by chunk "
                "(nothing per client stored; the same numbers); auto: copies where they fit "
                "this machine (and memory_budget_gb), else generated",
                choices=("auto", "copies", "generated"), commands=("run",), result=False),
        lr_setting(0.1, "learning rate γ of IFCA and FedAvg (option I step; local SGD "
                   "otherwise)", traced=True),
        Setting("local_lr", float, 0.02, "learning rate of the local-models baseline (one "
                "client's n rows alone need a smaller step than cluster-pooled data)",
                minimum=0.0, traced=True),
        Setting("oneshot_lr", float, 0.02, "learning rate of one-shot clustering's local "
                "pretraining (it fits one client's rows alone; its clustered rounds use lr)",
                minimum=0.0, traced=True),
        rounds_setting(300, "communication rounds (option I: iterations)"),
        count("restarts", 10, "random initialisations trained at once; the lowest final "
              "training loss is reported", maximum=10_000),
        seeds_setting(5, "seeds of a comparison or sweep (seed, seed+1, ... as folded keys)",
                      commands=("compare", "sweep")),
        seed_setting(),
        eval_every_setting(10),
        count("n_test", 100, "test examples per client (its test twin)"),
        Setting("option", str, "gradient", "IFCA option: gradient (I) or model (II) averaging",
                choices=("gradient", "model")),
        Setting("divide_by", str, "m", "IFCA option I divisor: the paper's m or the cohort size",
                choices=("m", "cohort")),
        local_steps_setting(1, "local steps τ per round (option II, FedAvg, local, one-shot)"),
        count("pretrain_steps", 100, "one-shot: local steps before k-means", maximum=10**6),
        participation_setting(),
        count("checkpoint_every", 50, "rounds between checkpoints; 0: none", minimum=0,
              result=False),
        Setting("memory_budget_gb", float, 0.0, "GiB for the client axis; 0: no limit (the "
                "machine's memory)", minimum=0.0, result=False),
    ),
    problem=problem,
    metrics=method_metrics,
    methods=ALGORITHM_NAMES,
    baseline="fedavg",
    table=lambda s: list(COMPARE_METRICS),
    validate=validate,
    panels=PANELS,
    log_metrics=LOG_METRICS,
    method_table=COMPARE_TABLE,
    provides=PROVIDES,
    method_key="algorithm",
    unscoped=("k",),  # the mixture's components as well as the cluster models
    footprint=footprint,
    run=run,
    run_facts=run_facts,
    plot_run=plot_run,
    sweep=SWEEP,
)



_TINY = {"m": 20, "n": 50, "d": 10, "R": 1.0, "rounds": 60, "restarts": 10, "eval_every": 10,
         "n_test": 20}

PRESETS = [
    Preset("ifca-synthetic", EXPERIMENT,
           "IFCA (option I, gradient averaging) on the synthetic mixture of linear regressions."),
    Preset("ifca-synthetic-tiny", EXPERIMENT,
           "A seconds-long IFCA synthetic run (k=2, m=20, n=50, d=10) for smoke tests.", _TINY),
    Preset("fedavg-synthetic", EXPERIMENT,
           "FedAvg (one global model) on the synthetic mixture of linear regressions.",
           {"algorithm": "fedavg"}),
    Preset("local-synthetic", EXPERIMENT,
           "Local models (each client alone) on the synthetic mixture of linear regressions.",
           {"algorithm": "local"}),
    Preset("oneshot-synthetic", EXPERIMENT,
           "One-shot clustering (k-means of local models) on the synthetic mixture.",
           {"algorithm": "oneshot"}),
]
