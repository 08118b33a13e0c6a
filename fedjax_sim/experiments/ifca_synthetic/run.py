"""`SyntheticRun`: one algorithm on the synthetic mixture (run), or all of them (compare).

Presets ifca-synthetic, fedavg-synthetic, local-synthetic, ...: `run` trains one
algorithm on one data seed with `restarts` random inits at once and reports
the restart with the lowest final training loss; `compare` trains IFCA,
FedAvg, local models, one-shot clustering, HypCluster and CFL side by side
over `seeds` seeds; `sweep` takes any setting as an axis (`sweep.group_trials`).
"""

from __future__ import annotations

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import logs, plots, simulate
from fedjax_sim.algorithms import ALGORITHMS, with_restarts, with_seeds
from fedjax_sim.compare import MethodRun
from fedjax_sim.data import check_mixture_settings, generated_mixture
from fedjax_sim.execution import Footprint, planned
from fedjax_sim.experiments.base import DATA, ROUNDS, Experiment, Preset, RunContext, stream_key
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
from fedjax_sim.experiments.methods import METHODS, readers
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
from fedjax_sim.models import linear_regression

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


class SyntheticRun(Experiment):
    name = "ifca_synthetic"
    description = "IFCA and its baselines on the synthetic mixture of linear regressions."
    settings = (
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
    )
    methods = ALGORITHM_NAMES
    method_key = "algorithm"
    provides = PROVIDES
    unscoped = ("k",)  # the rotations / mixture components as well as the cluster models
    baseline = "fedavg"
    panels = (
        ("train_loss", "train loss (avg client)"),
        ("test_loss", "test loss (avg client)"),
        ("cluster_accuracy", "cluster-identity accuracy"),
        ("min_dist", "min_dist to θ*"),
    )
    log_metrics = ("train_loss", "test_loss", "min_dist")

    def validate(self, s: dict, command: str = "run") -> None:
        """Raises ValueError naming the setting; a run's clients=auto becomes copies or
        generated here (what config.json then records)."""
        check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"], s["n_test"])
        if s["k"] > s["m"]:
            raise ValueError(f"setting k={s['k']} exceeds m={s['m']}.")
        if command == "run" and s.get("clients") == "auto":
            s["clients"] = "copies" if self.copies_fit(s) else "generated"
        if s["m"] > MAX_COUNT and not generated(s):
            raise ValueError(
                f"setting m={s['m']} exceeds {MAX_COUNT:.0e} with clients=copies (every client "
                "stored); set clients=generated (run only) to draw the clients inside the "
                "round.")
        defaults = self.defaults()
        if command != "compare":
            self.check_method(s["algorithm"])
        if command == "compare":  # every method runs: each setting is read by one of them
            # (`algorithm`, the method of a run, is the one setting compare does not read.)
            for name in self.compared(s):
                _fits(s, self.footprint_of(s, copies=s["restarts"] * s["seeds"],
                                           algorithm=name, command=command))
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
        _fits(s, self.footprint_of(s, copies=s["restarts"], command=command))

    def copies_fit(self, s: dict) -> bool:
        """Whether a run over stored copies fits this machine (and memory_budget_gb)."""
        if s["m"] > MAX_COUNT:
            return False
        try:
            _fits(s, self.footprint_of({**s, "clients": "copies"}, copies=s["restarts"]))
        except ValueError:
            return False
        return True

    def footprint_of(self, s: dict, copies: int, algorithm: str | None = None,
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

    def footprint(self, name: str, s: dict, problem) -> Footprint:
        """A comparison's method `name`: restarts × seeds copies."""
        return self.footprint_of(s, copies=s["restarts"] * s["seeds"], algorithm=name,
                                 command="compare")

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
        execution = ctx.execution(
            s, description=f"{name}-synthetic", copies=1,
            on_rows=lambda rows: ctx.on_rows(per_restart_rows(rows)),
            progress_summary=logs.best_copy("train_loss"))
        problem = execution.planned(keeping_client_state(problem, s),
                                    self.footprint_of(s, copies=s["restarts"]))
        algorithm = with_restarts(build_algorithm(name, s), s["restarts"])
        diverged = None
        try:
            _, history = simulate.run(
                algorithm, problem.train, jax.random.fold_in(key, ROUNDS), rounds=s["rounds"],
                eval_every=s["eval_every"],
                evaluate=metrics_fn(name, algorithm, problem, s["k"], progress=ctx.progress,
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

    def run_facts(self, summary: dict, s: dict) -> list[str]:
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
        problem = keeping_client_state(problem, s)
        algorithm = with_seeds(with_restarts(build_algorithm(name, s), s["restarts"]),
                               s["seeds"])
        return MethodRun(
            algorithm, problem.train, stream_key(s["seed"], ROUNDS),
            s["rounds"], metrics_fn(name, algorithm, problem, s["k"]), s["eval_every"],
            seed_rows=best_restart_rows,
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
        """trials.csv rows of every (cell, seed) as one vmapped program (`sweep.group_trials`)."""
        del mesh  # the pairs axis is small; clients are not sharded here
        return sweep.group_trials(self.declared, cells, seed_ids)

    def trials_per_program(self, group):
        return sweep.pairs_per_program(group, self.seeds_per_chunk(group[0]))

    def cell_cost(self, cell):
        return cell["m"] * cell["n"] * cell["d"] * cell["k"] * cell["rounds"] * cell["restarts"]

    def summarize_cells(self, trials, cells, axes):
        return sweep.summarize_cells(trials, cells, axes)


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
