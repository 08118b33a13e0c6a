"""Mixed FL experiments, the shared part (Augenstein et al., arXiv:2205.13655; PAPERS.md
§6–§7, §9).

Every preset is a side-by-side comparison over vmapped seeds (`with_seeds`) of

* `fedavg`: FL only, FedAvg on the federated data alone (the table's baseline);
* `mixed_parallel` (PT), `mixed_gt1` (1-GT), `mixed_gt2` (2-GT) on the mixed loss
  f = w_f f_f + w_c f_c;
* `oracle`: the centrally trained oracle, K minibatch-SGD steps per round on the
  mixed loss with all data pooled on the server (`mixed_centralized`),

with curves vs rounds (comparison.png, dissimilarity.png) and a table of final
metrics. Each round logs the sampled G̃_t, B̃_t (§6.4) at its round-start
model; the table reports their mean and median over rounds per seed (Table 2),
and the floats each client receives and sends per round. Every method runs
through `simulate.run` (seeds as its copies axis, every round's metrics kept).
The tasks are one module each: synthetic, smile, charlm, movielens.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import plots, simulate
from fedjax_sim.algorithms import fedavg, with_seeds
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.algorithms.mixed import (
    COMBINES,
    TRANSFERS,
    mixed_centralized,
    mixed_gt1,
    mixed_gt2,
    mixed_parallel,
    on_federated_data,
)
from fedjax_sim.experiments.base import Comparison, Experiment, RunContext, seed_mean_rows
from fedjax_sim.experiments.settings import Setting, count, seed_setting

# Stream ids folded into the user's seed, so data and rounds never share keys.
DATA_STREAM, ROUNDS_STREAM = 0, 2

METHODS = ("fedavg", "mixed_parallel", "mixed_gt1", "mixed_gt2", "oracle")
MIXED = ("mixed_parallel", "mixed_gt1", "mixed_gt2")
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
    with value <= target (NaN when never)."""
    hit = values <= target
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
        Setting("lr", float, d["lr"], "client (and central-step) SGD learning rate η",
                minimum=0.0),
        Setting("server_lr", float, 1.0, "server SGD learning rate η_s on −Δ", minimum=0.0),
        count("local_steps", d["local_steps"], "K: client steps (and central steps) per round",
              maximum=10**5),
        count("clients_per_round", d["clients_per_round"], "S, the cohort size; 0: every client",
              minimum=0),
        count("batch_size", d["batch_size"], "client minibatch; 0: full batch", minimum=0),
        count("central_batch_size", d["central_batch_size"],
              "datacenter minibatch drawn on the server; 0: every row", minimum=0),
        Setting("combine", str, "half", "2-GT's combination: half (α=½, §6.2's text) or "
                "mixing (α = w_f/(w_f+w_c))", choices=COMBINES),
        Setting("transfer", str, "current", "2-GT's ĝ_f in the central steps: current "
                "(this round's) or stale (last round's; zeros in round 0)", choices=TRANSFERS),
        count("rounds", d["rounds"], "communication rounds"),
        count("seeds", d["seeds"], "seeds compared side by side (one vmapped axis)",
              maximum=1000),
        seed_setting(),
        count("eval_every", d["eval_every"], "evaluate every this many rounds"),
    )


def none_if_zero(value: int):
    return None if value == 0 else value


def build_method(name: str, s: dict, model, central_loss=None) -> Algorithm:
    """The method `name` of a mixed-FL comparison with the experiment's settings."""
    common = dict(learning_rate=s["lr"], local_steps=s["local_steps"],
                  batch_size=none_if_zero(s["batch_size"]))
    mixed = dict(common, server_learning_rate=s["server_lr"], w_f=s["w_f"], w_c=s["w_c"],
                 central_batch_size=none_if_zero(s["central_batch_size"]),
                 clients_per_round=none_if_zero(s["clients_per_round"]),
                 central_loss=central_loss)
    if name == "fedavg":
        return on_federated_data(fedavg(model, **common, participation=s["participation"]))
    if name == "mixed_parallel":
        return mixed_parallel(model, **mixed)
    if name == "mixed_gt1":
        return mixed_gt1(model, **mixed)
    if name == "mixed_gt2":
        return mixed_gt2(model, **mixed, combine=s["combine"], transfer=s["transfer"])
    if name == "oracle":
        return mixed_centralized(model, **mixed)
    raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}.")


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


class MixedTask(Experiment):
    """Base of the mixed-FL comparisons; subclasses build the problem and its metrics."""

    supports_run = False
    supports_sweep = False
    methods = METHODS
    baseline = "fedavg"
    #: metrics of the results table, in order (subclasses).
    table: tuple[str, ...] = ()

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

    def problem(self, s: dict, seed_ids: list[int]):
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

    def method(self, name: str, s: dict, seeds: int, model, objective, central_loss):
        """The method `name` over the seeds (vmapped), on inputs (clients, server, extras)."""
        # The inputs are (clients, server, metric-only extras): the method sees the pair.
        method = split_extra(build_method(name, s, model, central_loss))
        return with_seeds(with_objective(method, objective), seeds)

    def train(self, name: str, algorithm, inputs, key, s: dict, evaluate, progress: bool):
        """One method through `simulate.run` (seeds are its copies axis): (eval rows
        {"round": t, metric: [seeds]}, every round's metrics {name: [rounds, seeds]} float64).

        A diverged seed is a failed copy (its values NaN) and the run goes on; a
        method diverged in every seed is named on stderr and its rows after the
        last good evaluation, and its per-round metrics, are NaN.
        """
        names = []

        def evaluate_row(state):
            row = jax.tree.map(np.asarray, evaluate(state.params, inputs))
            names[:] = list(row)
            return row

        try:
            _, rows, per_round = simulate.run(
                algorithm, inputs, key, rounds=s["rounds"], eval_every=s["eval_every"],
                evaluate=evaluate_row, progress=progress,
                description=f"{self.name} {name}", copies_axis=1, round_metrics=True)
        except simulate.Diverged as error:
            print(f"fedjax-sim: {self.name} {name} diverged in every seed: {error}",
                  file=sys.stderr)
            rows = list(error.history)
            nan = {k: np.full_like(np.asarray(v, np.float64), np.nan)
                   for k, v in rows[-1].items() if k != "round"}
            rows.append({"round": s["rounds"], **nan})
            per_round = {k: np.full((s["rounds"], *np.shape(v)), np.nan)
                         for k, v in nan.items()}
        # Round 0 holds the evaluation only (no round has run).
        rows[0] = {"round": 0, **{k: rows[0][k] for k in names}}
        return rows, {k: np.asarray(v, np.float64) for k, v in per_round.items()}

    def finals(self, s: dict, name: str, rows, per_round, info) -> dict:
        """Extra per-seed table metrics of a method (default: none)."""
        return {}

    def notes(self, s: dict, info) -> dict:
        return {}

    # ---------------------------------------------------------------------------
    def participation(self, s: dict) -> float:
        m = self.num_clients(s)
        return 1.0 if s["clients_per_round"] == 0 else s["clients_per_round"] / m

    def run_methods(self, s: dict, seed_ids: list[int], progress: bool = False,
                    on_method=None):
        """Every method on the seeds' data: (per_seed, histories, per-round metrics, info).

        on_method(name, per_seed, history), when given, is called as each method finishes
        (`RunContext.on_method`); the table's missing metrics are NaN there too.
        """
        s = {**s, "participation": self.participation(s)}
        inputs, info = self.problem(s, seed_ids)
        model, objective, evaluate, central_loss = self.functions(s)
        evaluate = jax.jit(jax.vmap(evaluate))
        key = jax.random.fold_in(jax.random.key(s["seed"]), ROUNDS_STREAM)
        per_seed, histories, rounds_of = {}, {}, {}
        for name in self.methods:
            algorithm = self.method(name, s, len(seed_ids), model, objective, central_loss)
            rows, per_round = self.train(name, algorithm, inputs, key, s, evaluate, progress)
            final = {k: np.asarray(v, np.float64) for k, v in rows[-1].items() if k != "round"}
            for stat in ROUND_STATS:
                values = per_round.get(stat)
                if values is not None:
                    final[f"{stat}_mean"] = _nanstat(np.nanmean, values)
                    final[f"{stat}_median"] = _nanstat(np.nanmedian, values)
            d = info["num_params"]
            down, up = {"fedavg": (d, d), "oracle": (0.0, 0.0)}.get(name, (None, None))
            if down is None:
                down, up = (per_round[k][-1] for k in ("floats_down", "floats_up"))
            final["floats_down"] = np.broadcast_to(np.asarray(down, np.float64),
                                                   (len(seed_ids),)).copy()
            final["floats_up"] = np.broadcast_to(np.asarray(up, np.float64),
                                                 (len(seed_ids),)).copy()
            final.update(self.finals(s, name, rows, per_round, info))
            per_seed[name] = final
            histories[name] = seed_mean_rows(rows)
            rounds_of[name] = per_round
            for metric in self.table:  # NaN where a method has no such metric (FL only: no G̃)
                final.setdefault(metric, np.full(len(seed_ids), np.nan))
            if on_method is not None:
                on_method(name, final, histories[name])
        return per_seed, histories, rounds_of, info

    def compare(self, s: dict, ctx: RunContext) -> Comparison:
        """Every method on the same data seeds, splits and init keys; seeds are one vmap axis.

        Seed i's data comes from fold_in(fold_in(key(seed), DATA), i); every
        method gets the same data and per-seed keys (`with_seeds`).
        """
        per_seed, histories, _, info = self.run_methods(s, list(range(s["seeds"])),
                                                        ctx.progress, ctx.on_method)
        notes = {
            "methods": ", ".join(f"{m} = {LABELS[m]}" for m in self.methods),
            "2-GT": f"combine={s['combine']} (α = ½ is §6.2's reconstruction; mixing: "
                    f"α = w_f/(w_f+w_c)), transfer={s['transfer']} (current: the central "
                    "steps use this round's ĝ_f; stale: last round's)",
            "central steps": "the server's K central steps use the client SGD at lr η "
                             "(§6.2: the same η); ServerOpt is SGD at server_lr on −Δ",
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
            **self.notes(s, info),
        }
        return Comparison(per_seed, histories, list(self.table), self.baseline, notes)

    def plot_compare(self, comparison: Comparison, out_dir) -> None:
        groups = {LABELS.get(k, k): v for k, v in comparison.histories.items()
                  if k in MIXED or k == "oracle"}
        plots.plot_history([], out_dir / "dissimilarity.png",
                           [("G_tilde", "G̃_t (B = 1)"), ("B_tilde", "B̃_t (G = 0)")],
                           title=f"{self.name}: sampled gradient dissimilarity", groups=groups,
                           log_y={"G_tilde", "B_tilde"})

