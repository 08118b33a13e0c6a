"""Mixed FL experiments, the shared part (Augenstein et al., arXiv:2205.13655;
docs/protocols.md#mixed-fl).

Every preset is a side-by-side comparison over vmapped seeds (`with_seeds`) of

* `fedavg`: FL only, FedAvg on the federated data alone (the table's baseline);
* `mixed_parallel` (PT), `mixed_gt1` (1-GT), `mixed_gt2` (2-GT) on the mixed loss
  f = w_f f_f + w_c f_c;
* `oracle`: the centrally trained oracle, K minibatch-SGD steps per round on the
  mixed loss with all data pooled on the server (`mixed_centralized`),

with curves vs rounds (comparison.png, dissimilarity.png) and a table of final
metrics. Each round logs the sampled G̃_t, B̃_t (docs/protocols.md) at its round-start
model; the table reports their mean and median over rounds per seed (Table 2),
and the floats each client receives and sends per round. Every method runs
through `simulate.run` (seeds as its copies axis, every round's metrics kept).
The tasks are one module each: synthetic, smile, charlm, charlm_wiki, movielens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import compare, plots
from fedjax_sim.algorithms import with_seeds
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.mixed import COMBINES, TRANSFERS, on_federated_data
from fedjax_sim.compare import MethodRun
from fedjax_sim.execution import Execution
from fedjax_sim.experiments.base import Comparison, Experiment
from fedjax_sim.experiments.methods import METHODS as TABLE
from fedjax_sim.experiments.methods import SERVER_DATA
from fedjax_sim.experiments.settings import (
    Setting,
    batch_size_setting,
    checkpoint_setting,
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    method_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)

# Stream ids folded into the user's seed, so data and rounds never share keys.
DATA_STREAM, ROUNDS_STREAM = 0, 2

METHODS = ("fedavg", "mixed_parallel", "mixed_gt1", "mixed_gt2", "oracle")
MIXED = ("mixed_parallel", "mixed_gt1", "mixed_gt2")
SERVER_STEP = (*MIXED, "oracle")  # the methods with a server step and a datacenter batch
LABELS = {"fedavg": "FL only", "mixed_parallel": "PT", "mixed_gt1": "1-GT",
          "mixed_gt2": "2-GT", "oracle": "oracle"}
ROUND_STATS = ("G_tilde", "B_tilde")

def with_objective(algorithm: Algorithm, objective) -> Algorithm:
    """Adds objective(params, inputs) (a dict of scalars) of each round's new model to its metrics.

    Evaluated inside the compiled scan of rounds, so per-round curves (and
    rounds-to-target) cost no host round trip.
    """

    def round_(state, inputs, key):
        state, metrics = algorithm.round(state, inputs, key)
        return state, {**metrics, **objective(state.params, inputs)}

    if objective is None:
        return algorithm

    return algorithm._replace(round=round_)


def rounds_to_target(values: np.ndarray, target: float) -> np.ndarray:
    """[rounds, seeds] values of the model after rounds 1, 2, ... -> per seed the first round
    with value <= target (NaN when never, and for every seed when no round is kept: a
    comparison whose every seed diverged in its first chunk of rounds)."""
    hit = np.asarray(values) <= target
    if hit.shape[0] == 0:
        return np.full(hit.shape[1:], np.nan)
    first = np.argmax(hit, axis=0).astype(np.float64) + 1
    return np.where(hit.any(axis=0), first, np.nan)


def _nanstat(fn, values):
    values = np.asarray(values, np.float64)
    out = np.full(values.shape[1:], np.nan)
    ok = np.isfinite(values).any(axis=0)
    if ok.any():
        out[ok] = fn(values[:, ok], axis=0)
    return out


# ----------------------------------------------------------------------------- shared machinery


def shared_settings(**defaults) -> tuple[Setting, ...]:
    d = {"rounds": 100, "lr": 0.05, "local_steps": 5, "clients_per_round": 0, "batch_size": 0,
         "central_batch_size": 0, "seeds": 3, "eval_every": 5, "w_f": 0.5, "w_c": 0.5,
         **defaults}
    return (
        Setting("w_f", float, d["w_f"], "weight of the federated loss f_f in f", minimum=0.0),
        Setting("w_c", float, d["w_c"], "weight of the centralized loss f_c in f", minimum=0.0),
        lr_setting(d["lr"], "client (and central-step) SGD learning rate η"),
        Setting("server_lr", float, 0.0, "server learning rate η_s on −Δ; 0: the server "
                "optimizer's own default (the Mixed FL methods' SGD: 1)", minimum=0.0),
        local_steps_setting(d["local_steps"], "K: client steps (and central steps) per round"),
        count("clients_per_round", d["clients_per_round"], "S, the cohort size; 0: every client",
              minimum=0),
        batch_size_setting(d["batch_size"], "client minibatch; 0: full batch"),
        count("central_batch_size", d["central_batch_size"],
              "datacenter minibatch drawn on the server; 0: every row", minimum=0,
              methods=SERVER_STEP),
        Setting("combine", str, "half", "2-GT's combination: half (α=½, the text's) or "
                "mixing (α = w_f/(w_f+w_c))", choices=COMBINES, methods=("mixed_gt2",)),
        Setting("transfer", str, "current", "2-GT's ĝ_f in the central steps: current "
                "(this round's) or stale (last round's; zeros in round 0)", choices=TRANSFERS,
                methods=("mixed_gt2",)),
        rounds_setting(d["rounds"]),
        seeds_setting(d["seeds"], maximum=1000),
        seed_setting(),
        eval_every_setting(d["eval_every"]),
        checkpoint_setting(d.get("checkpoint_every", 50)),
        method_setting(tuple(TABLE), "mixed_gt2"),
    )


def split_extra(algorithm: Algorithm) -> Algorithm:
    """The algorithm on (data, server) of inputs (data, server, extra)."""

    def strip(inputs):
        return tuple(inputs[:2])

    return Algorithm(lambda key, inputs: algorithm.init(key, strip(inputs)),
                     lambda state, inputs, key: algorithm.round(state, strip(inputs), key),
                     lambda state, inputs: algorithm.evaluate(state, strip(inputs)),
                     algorithm.client_axes)


def broadcast_seeds(tree, seeds: int):
    """The same arrays for every seed (a leading [seeds] axis): the seeds then differ only in
    their initialisations, cohorts and batches."""
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a), (seeds,) + np.shape(a)),
                        tree)


def cache_dir(s: dict):
    return s["cache_dir"] or None


class MixedProblem(NamedTuple):
    """What every method of a comparison shares."""

    inputs: Any  # (FederatedData, ServerData, metric-only extras), leading [seeds] axes
    info: dict  # {"num_params": d, ...} and what the notes report
    seeds: int
    model: Any
    objective: Callable | None  # (params, inputs) -> dict of scalars, every round
    evaluate: Callable  # jitted and vmapped over seeds: (params, inputs) -> dict of [seeds]
    central_loss: Any  # None (the datacenter in ServerData) or a callable


class MixedTask(Experiment):
    """Base of the mixed-FL comparisons; subclasses build the data and their metrics.

    Every method trains through `compare` (and so `simulate.run`): the seeds
    are one vmapped axis, every round's metrics are kept (G̃/B̃ statistics,
    rounds-to-target), and seed i's data comes from the seed's DATA stream.
    """
    unscoped = ("w_f", "w_c")  # the mixed objective every method is evaluated on

    supports_sweep = False
    methods = METHODS
    provides = frozenset({SERVER_DATA})
    kinds = ("global",)  # the objective and the metrics read one global model
    baseline = "fedavg"
    headline = "mixed_gt2"
    labels = LABELS
    #: metrics of the results table, in order (subclasses).
    table_metrics: tuple[str, ...] = ()

    def validate(self, s: dict, command: str = "compare") -> None:
        if s["w_f"] + s["w_c"] <= 0:
            raise ValueError("settings w_f and w_c must not both be 0.")
        m = self.num_clients(s)
        if s["clients_per_round"] > m:
            raise ValueError(f"setting clients_per_round={s['clients_per_round']} exceeds the "
                             f"{m} clients of this task.")

    # subclasses ---------------------------------------------------------------
    def num_clients(self, s: dict) -> int:
        raise NotImplementedError

    def seed_data(self, s: dict, seed_ids: list[int]):
        """(inputs, info) of the seeds' data.

        inputs: (FederatedData, ServerData, extras) with a leading [seeds] axis;
        the extras (a test set, f*) are read only by the metrics.
        info: {"num_params": d, ...} and what the notes report.
        """
        raise NotImplementedError

    def functions(self, s: dict):
        """(model, objective, evaluate, central_loss).

        objective(params, inputs), evaluate(params, inputs): dicts of scalars
        of one seed (objective in every round, evaluate every eval_every);
        central_loss: None (the datacenter in ServerData) or a callable.
        """
        raise NotImplementedError

    def finals(self, s: dict, name: str, rows, per_round, info) -> dict:
        """Extra per-seed table metrics of a method (default: none)."""
        return {}

    def task_notes(self, s: dict, info) -> dict:
        return {}

    # the comparison (`compare.run_methods`) -------------------------------------
    def participation(self, s: dict) -> float:
        m = self.num_clients(s)
        return 1.0 if s["clients_per_round"] == 0 else s["clients_per_round"] / m

    def problem(self, s: dict, seed_ids: list[int] | None = None) -> MixedProblem:
        seed_ids = list(range(s["seeds"])) if seed_ids is None else list(seed_ids)
        inputs, info = self.seed_data(s, seed_ids)
        model, objective, evaluate, central_loss = self.functions(s)
        return MixedProblem(inputs, info, len(seed_ids), model, objective,
                            jax.jit(jax.vmap(evaluate)), central_loss)

    def method_run(self, name: str, s: dict, problem: MixedProblem) -> MethodRun:
        """Method `name` over the problem's seeds: the same data and keys as the others."""
        s = {**s, "participation": self.participation(s)}
        built = self.build_method(name, s, problem.model, central_loss=problem.central_loss)
        if SERVER_DATA not in self.method_table[name].needs:  # FL only: the clients alone
            built = on_federated_data(built)
        # The inputs are (clients, server, metric-only extras): the method sees the pair.
        method = split_extra(built)
        algorithm = with_seeds(with_objective(method, problem.objective), problem.seeds)

        def evaluate(state):
            return jax.tree.map(np.asarray, problem.evaluate(state.params, problem.inputs))

        def finals(rows, per_round):
            return self.method_finals(name, s, rows, per_round, problem)

        key = jax.random.fold_in(jax.random.key(s["seed"]), ROUNDS_STREAM)
        return MethodRun(algorithm, problem.inputs, key,
                         s["rounds"], evaluate, s["eval_every"], finals=finals,
                         round_metrics=True)

    def method_finals(self, name: str, s: dict, rows, per_round, problem) -> dict:
        """A method's finals beside its last logged values: G̃/B̃ mean and median over
        rounds, floats per client, the task's own, NaN for a table metric it lacks."""
        seeds = problem.seeds
        per_round = {k: np.asarray(v, np.float64) for k, v in (per_round or {}).items()}
        final = {}
        for stat in ROUND_STATS:
            values = per_round.get(stat)
            if values is not None and len(values):
                final[f"{stat}_mean"] = _nanstat(np.nanmean, values)
                final[f"{stat}_median"] = _nanstat(np.nanmedian, values)
        d = problem.info["num_params"]
        down, up = {"fedavg": (d, d), "oracle": (0.0, 0.0)}.get(name, (None, None))
        if down is None:
            down, up = (per_round[k][-1] if len(per_round.get(k, ())) else np.nan
                        for k in ("floats_down", "floats_up"))
        final["floats_down"] = np.broadcast_to(np.asarray(down, np.float64), (seeds,)).copy()
        final["floats_up"] = np.broadcast_to(np.asarray(up, np.float64), (seeds,)).copy()
        if per_round:
            final.update(self.finals(s, name, rows, per_round, problem.info))
        for metric in self.table_metrics:  # NaN where a method has no such metric
            if metric not in rows[-1]:
                final.setdefault(metric, np.full(seeds, np.nan))
        return final

    def table(self, s: dict) -> list[str]:
        return list(self.table_metrics)

    def notes(self, s: dict, problem, results) -> dict:
        info = problem.info
        return {
            "methods": ", ".join(f"{m} = {LABELS[m]}" for m in self.methods),
            "2-GT": f"combine={s['combine']} (α = ½ is the reconstruction's; mixing: "
                    f"α = w_f/(w_f+w_c)), transfer={s['transfer']} (current: the central "
                    "steps use this round's ĝ_f; stale: last round's)",
            "central steps": "the server's K central steps use the client SGD at lr η "
                             "(the paper: the same η); ServerOpt is SGD at server_lr on −Δ",
            "G̃/B̃": "sampled at each round-start model from the cohort's first-step gradients "
                    "and a central batch gradient, on the normalised weights w/(w_f + w_c) "
                    "(so B̃ >= 1 for any weights); mean/median over all rounds and seeds. B̃ "
                    "assumes G = 0, so it grows without bound as ∇f → 0 near the optimum of a "
                    "task whose two optima differ",
            "oracle": "K minibatch-SGD steps per round on the mixed loss with all data pooled "
                      "on the server (a fresh cohort's batches and a central batch per step); "
                      "it communicates nothing",
            "floats": "per client per round: PT d down/d up, 1-GT 2d/d, 2-GT 2d/2d, FedAvg d/d "
                      f"(d = {info['num_params']} parameters)",
            **self.task_notes(s, info),
        }

    def run_methods(self, s: dict, seed_ids: list[int], progress: bool = False):
        """Every method on the seeds' data, in memory (`compare.run_methods`):
        (per_seed, histories, every round's metrics {method: {name: [rounds, seeds]}}, info)."""
        problem = self.problem(s, seed_ids)
        per_round_of = {}

        def spec(name):
            run = self.method_run(name, s, problem)

            def finals(rows, per_round):
                per_round_of[name] = per_round
                return run.finals(rows, per_round)

            return run._replace(finals=finals)

        results = compare.run_methods(
            {m: functools.partial(spec, m) for m in self.methods}, problem.seeds, None,
            execution=Execution(progress=progress))
        return ({n: r.per_seed for n, r in results.items()},
                {n: r.seed_mean_rows() for n, r in results.items()}, per_round_of, problem.info)

    def plot_compare(self, comparison: Comparison, out_dir) -> None:
        """dissimilarity.png: G̃ and B̃ per round of the methods that sample them, seed
        means with bands, on log axes, in the colours of comparison.png."""
        rows = [row for r in comparison.results.values() for row in r.long_rows()
                if r.diverged[row["seed"]] is None]
        plots.plot_comparison(
            rows, out_dir / "dissimilarity.png",
            [("G_tilde", "G̃_t (B = 1)"), ("B_tilde", "B̃_t (G = 0)")],
            title=f"{self.name}: sampled gradient dissimilarity",
            methods=[m for m in self.methods if m in MIXED or m == "oracle"],
            colors=plots.method_colors(self.methods), labels=self.labels,
            log_y={"G_tilde", "B_tilde"})

