"""What an experiment declares, and what the runner hands it.

An experiment is one module under `experiments/` holding an `Experiment`
subclass: its settings (`Setting`: name, type, default, range, help), its
checks, how it builds data, model and algorithm(s), the methods it compares,
its metrics and its plots. `runner.py` turns any registered experiment into
run directories, sweeps and comparisons; nothing else needs editing to add one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, compare, parallel
from fedjax_sim.algorithms import ALIASES, ClientTraining, sgd
from fedjax_sim.algorithms.base import NOT_PER_CLIENT, Algorithm
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.execution import Checkpoints, Execution, Footprint
from fedjax_sim.experiments import methods as catalog
from fedjax_sim.experiments import tuned
from fedjax_sim.experiments.settings import Setting, did_you_mean


@dataclass
class RunContext:
    """What the runner gives an experiment's run.

    on_rows: called with history rows as they are produced (the runner
      appends them to metrics.csv, fsynced, and to TensorBoard).
    on_method: a comparison calls it as each method finishes, with the
      method's name, its per-seed finals {metric: [seeds]} and its history
      (rows averaged over seeds); the runner writes methods/<name>.json at
      once, so a long comparison that crashes or is stopped keeps the methods
      it finished.
    timing: filled by `simulate.run` (rounds_run, compile_seconds, run_seconds,
      evaluate_seconds).
    """

    mesh: Any = None
    progress: bool = True
    checkpoint_dir: Any = None
    resume: bool = False
    on_rows: Callable[[list[dict]], None] = lambda rows: None
    on_method: Callable[[str, dict, list[dict]], None] = lambda name, per_seed, history: None
    timing: dict = field(default_factory=dict)

    def execution(self, s: dict, **changes) -> Execution:
        """How the run goes (`execution.Execution`): the runner's mesh, progress, resume and
        timing; checkpoints into checkpoint_dir (none without one) every
        s["checkpoint_every"] rounds (absent or 0: every evaluation); the memory budget
        s["memory_budget_gb"] (GiB; 0 or absent: the machine's default). `changes` set
        further fields (e.g. on_rows, copies)."""
        every = s.get("checkpoint_every") or None
        checkpoints = (None if self.checkpoint_dir is None
                       else Checkpoints(self.checkpoint_dir, every))
        return Execution(mesh=self.mesh, memory_budget=s.get("memory_budget_gb", 0.0) * 2**30,
                         checkpoints=checkpoints, resume=self.resume and checkpoints is not None,
                         progress=self.progress, timing=self.timing).replace(**changes)


# Streams folded into the user's seed, so data, inits and rounds never share keys: every
# experiment derives its keys as fold_in(key(seed), stream); ADAPT: the minibatches of an
# evaluation that trains clients first (fine-tuning, adapting unseen clients).
DATA, INIT, ROUNDS, ADAPT = 0, 1, 2, 3


def stream_key(seed: int, stream: int):
    """The PRNG key of one stream (DATA, INIT, ROUNDS) of a user's seed."""
    return jax.random.fold_in(jax.random.key(seed), stream)


def client_mean(values, weights) -> np.ndarray:
    """Σ_i w_i v_i / Σ_i w_i over the client axis (last), on the host in float64; a client
    of weight 0 (no data) is left out even where its value is NaN; NaN where every weight
    is 0."""
    v, w = np.asarray(values, np.float64), np.asarray(weights, np.float64)
    total = w.sum(-1)
    return (np.where(w > 0, v, 0.0) * w).sum(-1) / np.where(total > 0, total, np.nan)


def evaluate_in_chunks(algorithm: Algorithm, data, client_chunk: int,
                       feature_size: int | None = None, extra: Callable = lambda rows: ()):
    """state -> the evaluation of `client_chunk` clients at a time, on the host.

    For metrics that only add up over clients (means, maxima, confusion
    counts): no [copies..., m] evaluation array exists at once, on the device
    or the host. Chunk j is clients [j·c, (j+1)·c): their rows (`data.subset`:
    copies are gathered, generated clients drawn by the evaluation, a block at
    a time), the state's declared per-client leaves
    at those clients (`algorithm.client_axes`) and the shared ones, evaluated
    by `algorithm.evaluate` (which must treat each client on its own). The
    next chunk is dispatched before the host reads this one.

    Args:
      algorithm: its evaluate's per-client outputs have the client axis last.
      data: the clients (any ClientSource with m clients, no leading copies axis).
      client_chunk: clients per chunk (the last is padded, and cut on the host).
      feature_size: picks compiler options (`backend.jit`).
      extra: rows -> per-client values of the chunk's data (e.g. its true
        clusters), client axis last, also brought to the host.

    Returns:
      chunks(state): an iterator of (evaluation, extra) per chunk, numpy arrays
      whose last axis is the chunk's clients.
    """
    m = data.num_clients
    chunk = min(client_chunk, m)

    def part(state, data, start):
        ids = jnp.minimum(start + jnp.arange(chunk, dtype=jnp.int32), m - 1)
        state = jax.tree.map(
            lambda leaf, axis: leaf if axis == NOT_PER_CLIENT else jnp.take(leaf, ids, axis=axis),
            state, algorithm.client_axes(state))
        rows = data.subset(ids)  # generated clients stay generated: drawn block by block
        return algorithm.evaluate(state, rows), extra(rows)

    evaluate = backend.jit(part, feature_size)

    def chunks(state):
        starts = range(0, m, chunk)
        ahead = evaluate(state, data, jnp.int32(0))
        for start in starts:
            out = ahead
            if start + chunk < m:
                ahead = evaluate(state, data, jnp.int32(start + chunk))
            count = min(chunk, m - start)
            yield jax.tree.map(lambda a: parallel.to_host(a)[..., :count], out)

    return chunks


def stack_seeds(parts: list):
    """Per-seed data (FederatedData, or pytrees holding them) stacked on a leading [seeds]
    axis; FederatedData of different row counts are padded (zeros past num_examples) to the
    largest n_max first, so seeds may differ in their clients' sizes."""

    def is_data(node) -> bool:
        return isinstance(node, FederatedData)

    def padded(datasets: tuple) -> list:
        if not is_data(datasets[0]):
            return list(datasets)
        width = max(d.max_examples for d in datasets)

        def pad(a):
            a = np.asarray(a)
            return np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2))

        return [d.replace(x=jax.tree.map(pad, d.x), y=pad(d.y)) for d in datasets]

    structure = jax.tree.structure(parts[0], is_leaf=is_data)
    columns = [padded(nodes) for nodes in zip(
        *(jax.tree.leaves(p, is_leaf=is_data) for p in parts), strict=True)]
    seeds = [jax.tree.unflatten(structure, [c[i] for c in columns]) for i in range(len(parts))]
    return jax.tree.map(lambda *a: jnp.stack([jnp.asarray(x) for x in a]), *seeds)


def seed_mean(values) -> float:
    """A history value averaged over seeds, NaN seeds left out; NaN when no seed has a
    finite value (every seed diverged, a round metric in the round-0 row)."""
    v = np.asarray(values, np.float64)
    return float(np.nanmean(v)) if np.isfinite(v).any() else math.nan


def seed_mean_rows(rows: list[dict]) -> list[dict]:
    """History rows with per-seed values -> rows of `seed_mean`s (the comparison's form)."""
    return [{"round": row["round"], **{m: seed_mean(v) for m, v in row.items() if m != "round"}}
            for row in rows]


@dataclass
class Comparison:
    """Methods trained side by side over the same seeds.

    per_seed: method -> metric -> [seeds] final values (NaN: diverged seed).
    histories: method -> rows (metrics averaged over seeds, per evaluated round).
    metrics: the metrics of the results table, in order.
    baseline: the method the others are compared with.
    """

    per_seed: dict
    histories: dict
    metrics: list
    baseline: str
    #: caption lines (protocol choices, deviations from the paper, extra counts):
    #: written under the results table and to notes.json.
    notes: dict = field(default_factory=dict)
    #: method -> compare.MethodResult (per-seed histories, divergence).
    results: dict = field(default_factory=dict)


class Experiment:
    """Base class: subclasses set the attributes and override what they support."""

    name: str = ""
    description: str = ""
    settings: tuple[Setting, ...] = ()
    #: registry names of the algorithms `compare` trains side by side.
    methods: tuple[str, ...] = ()
    baseline: str | None = None
    #: panels of metrics.png / comparison.png: (metric, label).
    panels: tuple[tuple[str, str], ...] = ()
    #: metrics of those panels drawn on a log axis.
    log_metrics: tuple[str, ...] = ()
    #: method -> label in plot legends (default: the method's name).
    labels: dict | None = None
    #: the methods it can train: `methods.METHODS`, with its own entries where its
    #: protocol trains a method its own way.
    method_table = catalog.METHODS
    #: what its data provide to the methods (`methods.SERVER_DATA`, `methods.SPLIT_MODEL`).
    provides: frozenset = frozenset()
    #: the kinds of method its metrics evaluate (`methods.KINDS`; fine-tuned methods only
    #: where it declares them).
    kinds: tuple[str, ...] = catalog.BASIC_KINDS
    #: the setting that names the method a `run` trains (its choices become the methods
    #: it can train, `available`).
    method_key: str = "method"

    @property
    def declared(self) -> dict[str, Setting]:
        self.declare_methods_setting()
        self.__dict__["_settings_read"] = True
        return {s.name: s for s in self.settings}

    def defaults(self) -> dict:
        self.declare_methods_setting()
        self.__dict__["_settings_read"] = True
        return {s.name: s.default for s in self.settings}

    def __setattr__(self, name: str, value) -> None:
        # Settings resolved earlier carry the `methods` setting built from the old list,
        # and `compared` follows the setting: a later assignment would be ignored.
        if name == "methods" and self.__dict__.get("_settings_read"):
            raise AttributeError(
                f"experiment {self.name}: methods cannot change once its settings have been "
                "read (a comparison trains what the methods setting says); choose them with "
                "the setting instead, e.g. settings {'methods': 'fedavg,drflm'} or "
                "--set methods=fedavg,drflm.")
        super().__setattr__(name, value)

    def validate(self, s: dict, command: str = "run") -> None:
        """Checks across settings (each value is already checked against its Setting).

        command: "run", "sweep" (s is one cell) or "compare": which settings
        are read can depend on it.
        """

    supports_run = True

    # ---- compare: the experiment declares its methods; `compare.run_methods` trains them
    #: the method a `run` of a comparison preset trains by default (setting `method`).
    headline: str | None = None

    @property
    def supports_compare(self) -> bool:
        return bool(self.methods)

    def problem(self, s: dict) -> Any:
        """The data every method of a comparison (or a one-method run) shares."""
        raise NotImplementedError(f"{self.name} declares no comparison.")

    def method_run(self, name: str, s: dict, problem) -> compare.MethodRun:
        """Method `name` over s["seeds"] vmapped seeds, ready to train: `problem`'s clients
        carry the executor's plan for the method's `footprint` (`method_spec`)."""
        raise NotImplementedError(f"{self.name} declares no comparison.")

    def footprint(self, name: str, s: dict, problem) -> Footprint | None:
        """What method `name`'s round holds (`execution.Footprint`), from which the executor
        plans how many clients it processes at once; None (the default): all of them."""
        return None

    # ---- tuning (`experiments.tuned`): an experiment that declares both takes tune_* grids
    #: (metric, "min" or "max"): what a tuned comparison chooses each method's grid point by,
    #: measured on the validation rows as `method_run`'s evaluation measures it on the test
    #: rows; None: the experiment takes no tune_* settings.
    tune_metric: tuple[str, str] | None = None

    def validation_problems(self, problem, s: dict) -> tuple[Any, Any]:
        """(fit, val): `problem` with its training clients less their validation rows
        (`data.holdout.validation_split`, s["val_fraction"]), and the same with the
        validation rows in place of the test rows (`tuned.Tuned`)."""
        raise NotImplementedError(f"{self.name} takes no tune_* grids.")

    def problem_for(self, s: dict) -> Any:
        """The problem its methods train on: `problem(s)`, or with a tune_* grid set the
        `tuned.Tuned` of it."""
        problem = self.problem(s)
        if self.tune_metric is None or not tuned.tunes(s):
            return problem
        return tuned.Tuned(problem, *self.validation_problems(problem, s))

    def method_spec(self, name: str, s: dict, problem,
                    execution: Execution | None = None) -> compare.MethodRun:
        """`method_run` on `problem` planned by the executor for the method's `footprint`
        (`Execution.planned`, under `execution`'s memory budget; default: none), over its
        tune_* grid where `problem` is a `tuned.Tuned`."""
        if isinstance(problem, tuned.Tuned):
            return tuned.tuned_run(self, name, s, problem)
        planned = (execution or Execution()).planned(problem, self.footprint(name, s, problem))
        return self.method_run(name, s, planned)

    def comparison_notes(self, s: dict, problem, results: dict) -> dict:
        """`notes`, and the grids and chosen values of a tuned comparison."""
        full = problem.full if isinstance(problem, tuned.Tuned) else problem
        metric = self.tune_metric[0] if self.tune_metric else ""
        return {**self.notes(s, full, results), **tuned.notes(s, results, metric)}

    def available(self) -> tuple[str, ...]:
        """The methods of its table that fit its data: its declared ones first."""
        fitting = [n for n, m in self.method_table.items()
                   if catalog.fits(m, self.provides) is None and m.kind in self.kinds]
        return tuple(dict.fromkeys([*(n for n in self.methods if n in fitting or self.own(n)),
                                    *fitting]))

    def own(self, name: str) -> bool:
        """Whether `name` is a method of its own, outside the method table, that its
        `method_run` builds itself."""
        return name in self.methods and name not in self.method_table

    def check_method(self, name: str) -> None:
        """ValueError in one line when method `name` cannot be trained here, saying why."""
        if self.own(name):
            return
        if name not in self.method_table:
            raise ValueError(f"unknown method {name!r}{did_you_mean(name, self.available())}; "
                             f"{self.name} can train {', '.join(self.available())}.")
        why = self.unfit(name)
        if why is not None:
            raise ValueError(why)

    def unfit(self, name: str) -> str | None:
        """Why method `name` of its table cannot be trained here, in one line naming the
        methods that can (None: it can)."""
        method = self.method_table[name]
        why = catalog.fits(method, self.provides)
        if why is None and method.kind not in self.kinds:
            why = ("an evaluation that fine-tunes each client's copy of the model before its "
                   "test" if method.kind == "fine_tuned" else
                   f"an evaluation of {method.kind} models")
        if why is None:
            return None
        return (f"method {name} needs {why}, which {self.name} does not have; it can train "
                f"{', '.join(self.available())}.")

    def client_training(self, s: dict, learning_rate) -> ClientTraining:
        """How its clients train at `learning_rate`: plain SGD (declared linear in its
        gradients) with its local_steps, batch_size (0: full batch) and sampling."""
        return sgd(learning_rate, steps=s["local_steps"], batch_size=s.get("batch_size") or None,
                   sampling=s.get("sampling", "with_replacement"))

    def training_of(self, name: str, s: dict, learning_rate=None) -> ClientTraining:
        """Method `name`'s client training: at its own learning rate (or `learning_rate`);
        plain SGD at it, with the same steps, batches and per-client work, for a method
        whose maths assume it."""
        method = self.method_table[name]
        if learning_rate is None:
            learning_rate = s[catalog.setting_of(method, "lr", s)]
        training = self.client_training(s, learning_rate)
        if method.sgd:
            training = sgd(learning_rate, steps=training.steps, batch_size=training.batch_size,
                           sampling=training.sampling, work=training.work)
        return training

    def adapt_training(self, name: str, s: dict) -> ClientTraining:
        """Method `name`'s client training with adapt_steps steps (0: local_steps), every
        client taking all of them: how its evaluation fine-tunes or adapts a client
        (experiments with the setting adapt_steps)."""
        return self.training_of(name, s).replace(steps=s["adapt_steps"] or s["local_steps"])

    def build_method(self, name: str, s: dict, model, learning_rate=None, **extra) -> Algorithm:
        """Method `name` (unvmapped) with these settings, through the one method table."""
        self.check_method(name)
        return catalog.build(name, self.method_table, model,
                                  self.training_of(name, s, learning_rate), s, **extra)

    def method_rounds(self, name: str, s: dict) -> int:
        return s[catalog.setting_of(self.method_table[name], "rounds", s)]

    def compared(self, s: dict) -> tuple[str, ...]:
        """The methods a comparison trains, the baseline among them: the `methods` setting
        (a narrowed or reordered list, `methods_setting`) where the experiment takes one,
        else every declared method.

        Raises:
          ValueError: the setting repeats a method or leaves out the baseline (the
            paired differences are taken to it).
        """
        chosen = s.get("methods") if "methods" in self.declared else None
        if chosen is None:
            return tuple(self.methods)
        names = (chosen,) if isinstance(chosen, str) else tuple(chosen)
        for name in names:
            self.check_method(name)
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"setting methods names {', '.join(repeated)} twice; give each "
                             "method once.")
        if self.baseline in self.methods and self.baseline not in names:
            raise ValueError(
                f"setting methods must include the baseline {self.baseline} (the paired "
                f"differences are taken to it); got {','.join(names)}.")
        return names

    #: per-experiment defaults of the method settings it gains (`methods.METHOD_SETTINGS`)
    method_defaults: dict = {}
    #: its own settings that its problem reads too (IFCA's k: the clusters of the data as
    #: well as the cluster models), so they are never scoped to the methods that read them
    unscoped: tuple[str, ...] = ()

    def declare_methods_setting(self) -> None:
        """Completes the settings of an experiment that compares methods through
        `method_run` (a `Preset` calls this): the `methods` setting and the setting of the
        method a run trains (`method_key`), which offer the methods it can train
        (`available`; one of its table that does not fit is refused saying why), the
        settings of every method it can train that it does not declare itself
        (`methods.METHOD_SETTINGS`), and the methods that read each method setting
        (`Setting.methods`), so `describe` marks them and the runner refuses them where
        no trained method reads them."""
        if (not self.methods or type(self).method_run is Experiment.method_run
                or self.__dict__.get("_methods_declared")):
            return
        self.__dict__["_methods_declared"] = True
        available = self.available()
        names = {st.name for st in self.settings}
        readers = catalog.readers({n: self.method_table[n] for n in available
                                   if not self.own(n)})
        added = [dataclasses.replace(st, default=self.method_defaults.get(st.name, st.default))
                 for name, st in catalog.METHOD_SETTINGS.items()
                 if name in readers and name not in names]

        def scoped(st: Setting) -> Setting:
            if st.name in readers and st.methods is None and st.name not in self.unscoped:
                return dataclasses.replace(st, methods=readers[st.name])
            return st

        settings = [scoped(st) for st in (*self.settings, *added)]
        if self.tune_metric is not None:
            settings += tuned.tune_settings({st.name: st for st in settings},
                                            self.tune_metric[0])
        if "methods" not in names:
            settings.append(methods_setting(available, tuple(self.methods)))
        self.settings = tuple(self.offering(st, available) for st in settings)

    def offering(self, st: Setting, available: tuple[str, ...]) -> Setting:
        """A setting that names methods (`method_key`, `methods`) with the methods it can
        train as its choices: one of its table that does not fit is refused saying why
        (`unfit`), and an older name of a method (`algorithms.ALIASES`) is read as the
        method's name."""
        if st.name not in (self.method_key, "methods") or st.choices is None:
            return st
        refused = {n: self.unfit(n) for n in self.method_table if n not in available}
        aliases = {old: new for old, new in ALIASES.items() if new in available}
        return dataclasses.replace(st, choices=available, refused=refused or None,
                                   aliases=aliases or None)

    def table(self, s: dict) -> list[str]:
        """The metrics of results.csv, in order."""
        return [metric for metric, _ in self.panels]

    def notes(self, s: dict, problem, results: dict) -> dict:
        """Caption lines of a finished comparison (protocol choices, paper references)."""
        return {}

    def plot_compare(self, comparison: Comparison, out_dir) -> None:
        """Plots of a finished comparison beyond comparison.png (default: none)."""

    def compare(self, s: dict, ctx: RunContext | None = None) -> Comparison:
        """Every compared method over s["seeds"] seeds, in memory (no files): the Python
        API of `fedjax-sim compare` (which also checkpoints and writes its directory).

        Diverged seeds are reported as the command reports them: one line on stderr
        for the whole comparison (`compare.divergence_summary`); each seed's round and
        metric are in the returned `results[method].diverged`.
        """
        ctx = ctx or RunContext(progress=False)
        tuned.check(s)
        problem = self.problem_for(s)
        table = self.table(s)
        execution = ctx.execution(s)
        results = compare.run_methods(
            {m: functools.partial(self.method_spec, m, s, problem, execution)
             for m in self.compared(s)},
            s["seeds"], None, execution=execution,
            on_method=lambda r: ctx.on_method(
                r.name, compare.table_per_seed({r.name: r}, table)[r.name],
                r.seed_mean_rows()))
        summary = compare.divergence_summary(results)
        if summary is not None:
            print(f"fedjax-sim: comparison finished with diverged seeds: {summary}; they are "
                  "left out of means and differences (results[method].diverged gives each "
                  "seed's round and metric)", file=sys.stderr)
        return Comparison(compare.table_per_seed(results, table),
                          {n: r.seed_mean_rows() for n, r in results.items()}, table,
                          self.baseline, self.comparison_notes(s, problem, results), results)

    def run_method(self, s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
        """`run` of a comparison preset: method s["method"] over s["seeds"] seeds.

        metrics.csv gets one row per (round, seed); summary.json each final
        metric per seed and its mean over the seeds that did not diverge. The
        run has diverged (exit 3) when every seed has: the runner's
        `simulate.Diverged` is then its one line. When only some seeds have, one
        line on stderr says how many and where the first went (summary.json's
        "diverged" holds each seed's round and metric), never one per seed.
        """
        name = s["method"]
        execution = ctx.execution(s)
        spec = self.method_spec(name, s, self.problem_for(s), execution)
        seeds = s["seeds"]

        def stream(rows):
            ctx.on_rows([{"seed": i, "round": int(row["round"]),
                          **{k: float(np.asarray(v, np.float64).reshape(-1)[i]
                                      if np.ndim(v) else v)
                             for k, v in row.items() if k != "round"}}
                         for row in rows for i in range(seeds)])

        result = compare.train_method(name, spec, seeds, execution.replace(
            on_rows=stream if spec.seed_rows is None else None))
        ctx.timing.update(result.timing)
        rows = [{"seed": r.pop("seed"), **{k: v for k, v in r.items() if k != "method"}}
                for r in result.long_rows()]
        if spec.seed_rows is not None:
            ctx.on_rows(rows)
        if 0 < result.diverged_seeds < seeds:
            _, seed, first = compare.first_divergence({name: result})
            print(f"fedjax-sim: method {name} diverged in {result.diverged_seeds} of {seeds} "
                  f"seeds, the first at round {first['round']} (seed {seed}: "
                  f"{first['metric']} is {first['value']}); they are left out of "
                  "summary.json's final_mean (its \"diverged\" gives each seed's round and "
                  "metric)", file=sys.stderr)
        seconds = result.timing.get("run_seconds") or 0.0
        summary = {
            "method": name,
            "seeds": seeds,
            "final_mean": {m: seed_mean(v) for m, v in result.per_seed.items()},
            "final_per_seed": {m: np.asarray(v).tolist() for m, v in result.per_seed.items()},
            "diverged_seeds": result.diverged_seeds,
            "diverged": result.diverged,
            **result.timing,
            "rounds_per_second": result.timing["rounds_run"] / seconds
            if result.timing.get("rounds_run") and seconds > 0 else None,
        }
        if result.diverged_seeds == seeds:
            last = max(result.diverged, key=lambda d: d["round"])
            summary.update(diverged_round=last["round"], diverged_metric=last["metric"],
                           diverged_value=last["value"], last_checkpoint_round=None)
        return rows, summary

    def run(self, s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
        if self.methods:
            return self.run_method(s, ctx)
        raise NotImplementedError

    def plot_run(self, rows: list[dict], summary: dict, out_dir) -> None:
        """Plots of a finished run (default: none)."""

    def run_facts(self, summary: dict, s: dict) -> list[str]:
        """What a finished run found, as clauses of the paragraph `fedjax-sim run` ends with
        (`runner.run_summary` adds the files written). Default: a comparison preset's run,
        its method and seeds and the mean final value of each metric of its results table
        (`table`), over the seeds that did not diverge."""
        final = summary.get("final_mean")
        if not isinstance(final, dict):
            return []
        seeds = summary.get("seeds", 1)
        shown = [f"{m} {_number(final[m])}" for m in self.table(s) if m in final]
        facts = [f"{summary.get('method', s.get(self.method_key))} over {seeds} "
                 f"seed{'s' if seeds != 1 else ''}" + (
                     f": final {', '.join(shown)}" if shown else "")]
        if summary.get("diverged_seeds"):
            facts.append(f"{summary['diverged_seeds']} diverged seed"
                         f"{'s' if summary['diverged_seeds'] != 1 else ''} left out of the means")
        return facts

    # ---- sweep
    supports_sweep = True

    def trial_columns(self, axes: list[str]) -> list[str]:
        raise NotImplementedError

    def trials(self, cell: dict, seed_ids: list[int], mesh=None) -> list[dict]:
        """One trials.csv row per seed of a cell."""
        raise NotImplementedError

    #: cells that differ only in traced settings go to `group_trials` together
    #: (one compiled, vmapped program); False: one cell at a time.
    group_cells = False

    def group_trials(self, cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
        """Rows (each with its cell's "cell_id") of every (cell, seed); default: cell by cell."""
        return [{"cell_id": cell["cell_id"], **row}
                for cell in cells for row in self.trials(cell, seed_ids, mesh)]

    def seeds_per_chunk(self, cell: dict) -> int:
        return 1

    def trials_per_program(self, group: list[dict]) -> int:
        """How many trials (cell × seed) of this group of cells one compiled sweep program
        holds: XLA compiles programs of other sizes differently, so the numbers may depend
        on it (in their last bits), and a resume keeps it. Default: `seeds_per_chunk`."""
        return self.seeds_per_chunk(group[0])

    def cell_cost(self, cell: dict) -> float:
        """Relative cost of one seed of a cell (for the sweep's ETA)."""
        return 1.0

    def summarize_cells(self, trials: list[dict], cells: list[dict], axes: list[str]) -> list:
        raise NotImplementedError

    def plot_sweep(self, summary: list[dict], out_dir) -> None:
        """Plots of a finished sweep (default: none)."""


def _number(value) -> str:
    """A metric's value in a sentence: 4 significant digits, or as it is (None, NaN)."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def methods_setting(methods: tuple[str, ...], default: tuple[str, ...] | None = None,
                    help: str = "") -> Setting:
    """The methods a comparison trains, in order (a comma list; default `default` or all).

    Only `compare` reads it; a name outside `methods` is refused naming the allowed
    ones, and `Experiment.compared` refuses a list without the baseline.
    """
    return Setting("methods", str, list(default if default is not None else methods),
                   help or "the methods compare trains, in this order (a comma list of "
                   "these; the baseline must be among them)",
                   choices=tuple(methods), listable=True, commands=("compare",))


@dataclass(frozen=True)
class Preset:
    name: str
    experiment: Experiment
    description: str
    overrides: dict = field(default_factory=dict)  # preset defaults over the experiment's

    def __post_init__(self):
        self.experiment.declare_methods_setting()

    @property
    def defaults(self) -> dict:
        return {**self.experiment.defaults(), **self.overrides}

    @property
    def commands(self) -> tuple[str, ...]:
        e = self.experiment
        return tuple(c for c, ok in (("run", e.supports_run), ("sweep", e.supports_sweep),
                                     ("compare", e.supports_compare)) if ok)
