"""What an experiment declares, and what the runner hands it.

An experiment is one frozen `Experiment` record: its settings (`Setting`: name,
type, default, range, help), a problem built from them, its metrics, the methods it
compares (rows of the one method table, `experiments.methods`) and its baseline,
results table and notes; one with a run of its own (a theory check, a success sweep)
declares `run` and `sweep` instead. `study` turns any record into runs, comparisons
and sweeps, and `runner` into their directories; nothing else needs editing to add
one. Also here: the PRNG streams of a seed, the host-side means and stacks the
experiments share, and `Preset` (a name, a record, its defaults).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, parallel
from fedjax_sim.algorithms import ALIASES, ROBUST_READY, ClientTraining, sgd
from fedjax_sim.algorithms.base import NOT_PER_CLIENT, Algorithm
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.execution import Checkpoints, Execution, Footprint
from fedjax_sim.experiments import methods as catalog
from fedjax_sim.experiments import privacy, robustness, tuned
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


class Trained(NamedTuple):
    """What an experiment's `metrics` sees of one method it trains (`study.method_run`).

    name: the method's name; method: its row of the experiment's method table; s: the
    settings it trains with (`Experiment.derived` applied); problem: what every method
    shares (`Experiment.problem`); model: the model it trains (the split one where it
    needs a split model); algorithm: the method over every seed (`with_seeds`: a leading
    [seeds] axis on every state leaf); built: the method for one seed (before
    `with_seeds`); rounds: the rounds it trains; training: its client training
    (`study.training_of`).
    """

    name: str
    method: Any
    s: dict
    problem: Any
    model: Any
    algorithm: Algorithm
    built: Algorithm
    rounds: int
    training: ClientTraining


class Metrics(NamedTuple):
    """A method's evaluation, where it says more than `state -> {metric: [seeds]}`.

    evaluate: state -> one history row's values ([seeds] arrays).
    every: rounds between evaluations (None: the setting eval_every); an evaluation that
      is partly cheap (cluster identity every round, the whole test every eval_every
      rounds) takes every=1 and leaves out what a round does not compute.
    seed_rows, finals, round_metrics, progress_summary: as `compare.MethodRun`'s
      (histories with more than a seeds axis, finals over every round's metrics).
    """

    evaluate: Callable[[Any], dict]
    every: int | None = None
    seed_rows: Callable | None = None
    finals: Callable | None = None
    round_metrics: bool = False
    progress_summary: Callable | None = None


@dataclass(frozen=True)
class Sweep:
    """What a sweep of an experiment writes (`fedjax-sim sweep`): trials.csv rows of
    every (cell, seed), summary.csv rows of every cell, plots. `study.sweep_of` gives
    every comparison experiment one (a cell trains the method of a run); an experiment
    with a faster sweep of its own declares it.

    trials: (cell, seed_ids, mesh) -> one trials.csv row per seed of a cell.
    columns: (the sweep's axes, its settings) -> trials.csv's columns.
    summarize: (trials, cells, axes) -> summary.csv's rows.
    group: cells that differ only in traced settings go to `group_trials` together
      (one compiled, vmapped program); False: one cell at a time.
    group_trials: (cells, seed_ids, mesh) -> rows (each with its cell's "cell_id") of
      every (cell, seed); None: `trials` cell by cell.
    seeds_per_chunk: cell -> the seeds one call trains.
    trials_per_program: group of cells -> how many trials (cell × seed) one compiled
      program holds: XLA compiles programs of other sizes differently, so the numbers
      may depend on it (in their last bits), and a resume keeps it (None:
      `seeds_per_chunk`).
    cell_cost: cell -> the relative cost of one seed (for the ETA).
    plot: (summary, out_dir) -> plots of a finished sweep.
    """

    trials: Callable[..., list[dict]]
    columns: Callable[[list[str], dict], list[str]]
    summarize: Callable[[list[dict], list[dict], list[str]], list[dict]]
    group: bool = False
    group_trials: Callable | None = None
    seeds_per_chunk: Callable[[dict], int] = lambda cell: 1
    trials_per_program: Callable[[list[dict]], int] | None = None
    cell_cost: Callable[[dict], float] = lambda cell: 1.0
    plot: Callable | None = None

    def run_group(self, cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
        """Rows (each with its cell's "cell_id") of every (cell, seed) of a group."""
        if self.group_trials is not None:
            return self.group_trials(cells, seed_ids, mesh)
        return [{"cell_id": cell["cell_id"], **row}
                for cell in cells for row in self.trials(cell, seed_ids, mesh)]

    def program_size(self, group: list[dict]) -> int:
        if self.trials_per_program is not None:
            return self.trials_per_program(group)
        return self.seeds_per_chunk(group[0])


def plain_sgd(s: dict, learning_rate) -> ClientTraining:
    """Plain SGD (declared linear in its gradients) at `learning_rate` with the settings
    local_steps, batch_size (0 or absent: full batch) and sampling."""
    return sgd(learning_rate, steps=s["local_steps"], batch_size=s.get("batch_size") or None,
               sampling=s.get("sampling", "with_replacement"))


@dataclass(frozen=True)
class Experiment:
    """One experiment, declared: what it is, never how it runs.

    `study` turns any declaration into runs, comparisons (tuned or not), sweeps and
    their outputs, and the executor (`simulate`, `compare`) decides how: chunks,
    devices, memory, checkpoints, progress. An experiment that compares methods
    declares its settings, `problem` and `metrics`; one with a run of its own (a
    theory check, a success-probability sweep) declares `run` and `sweep`.

    Attributes:
      name, description: as `describe` shows them.
      settings: its own settings (`Setting`); `declared` adds those of the methods it
        can train, the `methods` setting and the tune_* grids.
      problem: settings -> what every method of a comparison shares, a mapping (or a
        record with these fields) holding "train" (the clients the methods train on, a
        leading [seeds] axis) and "model" (a `Model`, or {False: whole, True: split}
        for methods that need a split model); "copies": 0 where every seed shares one
        data set (default 1: a data set per seed).
      metrics: `Trained` -> the method's evaluation: state -> {metric: [seeds]}, or a
        `Metrics` saying more.
      methods: what `compare` trains by default, from `method_table` (what `run` trains
        by default is its method setting's default); baseline: the method the others are
        compared with.
      table: settings -> the metrics of results.csv, in order (default: the panels').
      notes: (settings, problem, results) -> caption lines of a finished comparison.
      validate: (settings, command) -> None, raising ValueError for what spans settings
        (each value is already checked against its Setting).
      panels: (metric, label) of metrics.png / comparison.png; log_metrics: those drawn
        on a log axis; labels: method -> legend label.
      method_table: the methods it can train (`methods.METHODS`, with its own entries
        where its protocol trains a method its own way); provides: what its data offer
        the methods (`methods.SERVER_DATA`, `methods.SPLIT_MODEL`); kinds: the kinds of
        method its metrics evaluate; method_key: the setting naming the method a run
        trains; method_defaults: its defaults of the method settings it gains;
        unscoped: its own settings that its problem reads too (never scoped to the
        methods that read them).
      client_training: (settings, learning rate) -> how its clients train (default
        `plain_sgd`).
      derived: (settings, problem) -> the settings with values the problem decides (a
        cohort from the clients it holds), before a method is built.
      footprint: (method, settings, problem) -> what the method's round holds
        (`execution.Footprint`), from which the executor plans its client chunk.
      tune_metric: (metric, "min" or "max"): a tuned comparison (settings tune_*) chooses
        each method's grid point by it, measured on validation rows;
        validation_problems: (problem, settings) -> (fit, val) (`tuned.Tuned`; default
        `study.validation_problems`: each client's training rows less a validation
        share, which then stand in for the test rows).
      run: (settings, RunContext) -> (rows, summary), for an experiment whose run is its
        own (None: `run` trains a method of the comparison); run_facts: (summary,
        settings) -> clauses of the paragraph a run ends with; plot_run, plot_compare:
        plots beyond metrics.png / comparison.png.
      sweep: its own `Sweep` (None: `study.sweep_of`'s, for a comparison).
    """

    name: str
    description: str
    settings: tuple[Setting, ...]
    problem: Callable[[dict], Any] | None = None
    metrics: Callable[[Trained], Any] | None = None
    methods: tuple[str, ...] = ()
    baseline: str | None = None
    table: Callable[[dict], list[str]] | None = None
    notes: Callable[[dict, Any, dict], dict] | None = None
    validate: Callable[[dict, str], None] | None = None
    panels: tuple[tuple[str, str], ...] = ()
    log_metrics: tuple[str, ...] = ()
    labels: Mapping | None = None
    method_table: Mapping = field(default_factory=lambda: catalog.METHODS)
    provides: frozenset = frozenset()
    kinds: tuple[str, ...] = catalog.BASIC_KINDS
    method_key: str = "method"
    method_defaults: Mapping = field(default_factory=dict)
    unscoped: tuple[str, ...] = ()
    client_training: Callable[[dict, Any], ClientTraining] = plain_sgd
    derived: Callable[[dict, Any], dict] | None = None
    footprint: Callable[[str, dict, Any], Footprint | None] | None = None
    tune_metric: tuple[str, str] | None = None
    validation_problems: Callable[[Any, dict], tuple[Any, Any]] | None = None
    run: Callable[[dict, Any], tuple[list[dict], dict]] | None = None
    run_facts: Callable[[dict, dict], list[str]] | None = None
    plot_run: Callable | None = None
    plot_compare: Callable | None = None
    sweep: Sweep | None = None

    def __post_init__(self):
        object.__setattr__(self, "methods", tuple(self.methods))
        object.__setattr__(self, "_declared", {st.name: st for st in _complete(self)})

    @property
    def compares(self) -> bool:
        """Whether it trains methods side by side (`problem`, `metrics` and methods)."""
        return bool(self.methods) and self.problem is not None

    @property
    def declared(self) -> dict[str, Setting]:
        """Every setting it takes, by name: its own, then those of the methods it can
        train, the tune_* grids and the `methods` setting."""
        return self._declared

    def defaults(self) -> dict:
        return {name: st.default for name, st in self._declared.items()}

    def replace(self, **changes) -> Experiment:
        """A copy with some fields changed (its settings completed again)."""
        return dataclasses.replace(self, **changes)


def available(e: Experiment) -> tuple[str, ...]:
    """The methods of its table that fit its data: its declared ones first."""
    fitting = [n for n, m in e.method_table.items()
               if catalog.fits(m, e.provides) is None and m.kind in e.kinds]
    return tuple(dict.fromkeys([*(n for n in e.methods if n in fitting), *fitting]))


def unfit(e: Experiment, name: str) -> str | None:
    """Why method `name` of its table cannot be trained here, in one line naming the
    methods that can (None: it can)."""
    method = e.method_table[name]
    why = catalog.fits(method, e.provides)
    if why is None and method.kind not in e.kinds:
        why = ("an evaluation that fine-tunes each client's copy of the model before its "
               "test" if method.kind == "fine_tuned" else
               f"an evaluation of {method.kind} models")
    if why is None:
        return None
    return (f"method {name} needs {why}, which {e.name} does not have; it can train "
            f"{', '.join(available(e))}.")


def check_method(e: Experiment, name: str) -> None:
    """ValueError in one line when method `name` cannot be trained here, saying why."""
    if name not in e.method_table:
        raise ValueError(f"unknown method {name!r}{did_you_mean(name, available(e))}; "
                         f"{e.name} can train {', '.join(available(e))}.")
    why = unfit(e, name)
    if why is not None:
        raise ValueError(why)


def _complete(e: Experiment) -> list[Setting]:
    """Its settings, completed where it compares methods: the settings of every method
    it can train that it does not declare itself (`methods.METHOD_SETTINGS`, at its
    `method_defaults`), each method setting scoped to the methods that read it
    (`Setting.methods`: `describe` marks them and the runner refuses them where no
    trained method reads them), the tune_* grids, the `methods` setting, and the
    settings that name methods offering the methods it can train (one of its table
    that does not fit is refused saying why; an older name, `algorithms.ALIASES`, is
    read as the method's; the generic sweep's cells read the method a run trains)."""
    if not e.compares:
        return list(e.settings)
    offered = available(e)
    names = {st.name for st in e.settings}
    readers = catalog.readers({n: e.method_table[n] for n in offered})
    added = [dataclasses.replace(st, default=e.method_defaults.get(st.name, st.default))
             for name, st in catalog.METHOD_SETTINGS.items()
             if name in readers and name not in names]
    # The server rules (DP, robust aggregation with Byzantine clients) wrap the methods the
    # generic path builds (`study.server_rule`): offered wherever one of them can take one.
    if e.run is None and any(isinstance(e.method_table[n].algorithm, str)
                             and e.method_table[n].algorithm in ROBUST_READY for n in offered):
        added += [st for group in (privacy.PRIVACY_SETTINGS, robustness.ROBUST_SETTINGS)
                  for name, st in group.items() if name not in names]

    def scoped(st: Setting) -> Setting:
        if st.name in readers and st.methods is None and st.name not in e.unscoped:
            return dataclasses.replace(st, methods=readers[st.name])
        return st

    settings = [scoped(st) for st in (*e.settings, *added)]
    if e.tune_metric is not None:
        settings += tuned.tune_settings({st.name: st for st in settings}, e.tune_metric[0])
    if "methods" not in names:
        settings.append(methods_setting(offered, e.methods))
    refused = {n: unfit(e, n) for n in e.method_table if n not in offered}
    aliases = {old: new for old, new in ALIASES.items() if new in offered}

    def offering(st: Setting) -> Setting:
        if st.name not in (e.method_key, "methods") or st.choices is None:
            return st
        commands = st.commands
        if st.name == e.method_key and e.sweep is None and commands is not None:
            commands = tuple(dict.fromkeys((*commands, "sweep")))  # the generic sweep's cells
        return dataclasses.replace(st, choices=offered, refused=refused or None,
                                   aliases=aliases or None, commands=commands)

    return [offering(st) for st in settings]


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
    """A name, an experiment and its defaults: what `fedjax-sim run NAME` runs."""

    name: str
    experiment: Experiment
    description: str
    overrides: dict = field(default_factory=dict)  # preset defaults over the experiment's

    @property
    def defaults(self) -> dict:
        return {**self.experiment.defaults(), **self.overrides}

    @property
    def commands(self) -> tuple[str, ...]:
        e = self.experiment
        return tuple(c for c, ok in (("run", e.run is not None or e.compares),
                                     ("sweep", e.sweep is not None or e.compares),
                                     ("compare", e.compares)) if ok)
