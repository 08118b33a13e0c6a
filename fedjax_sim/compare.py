"""Methods side by side over vmapped seeds: the one comparison loop.

Every experiment's comparison (IFCA and its baselines, DRFA/DRFLM, Mixed FL)
and every single-method `run` of a comparison preset goes through here. An
experiment declares each method as a `MethodRun` (its algorithm with a leading
[seeds] axis from `with_seeds`, its data, its key, its evaluation); this module
trains it through `simulate.run` and keeps the books:

- **checkpoints and resume**: method M checkpoints into ``checkpoints/M/``
  every ``checkpoint_every`` rounds; once it finishes, ``methods/M.json`` holds
  its per-seed finals and per-seed history and the checkpoints go. A resumed
  comparison skips every method with a ``methods/M.json`` and continues the one
  in flight from its newest intact checkpoint, so its outputs equal an
  uninterrupted comparison's.
- **divergence**: a seed has diverged when a metric that was finite at round 0
  becomes NaN or ±inf (or, when every seed went, where `simulate.run` stopped).
  It is counted, recorded (round, metric, value) in the method's result and
  ``methods/M.json``, and left out of the method's means and paired
  differences: its finals are NaN. Training prints nothing per seed: a
  comparison says what diverged in one line once it is done
  (`divergence_summary`, `MethodsDiverged`), however many methods and seeds.
- **per-seed histories**: every evaluated round of every seed, for curves with
  bands (``per_seed_metrics.csv``).

Nothing here knows an experiment's metric names.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_sim import logs, parallel, simulate, stats
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.data.federated import is_client_source
from fedjax_sim.execution import Checkpoints, Execution
from fedjax_sim.io import read_json, write_json


class MethodRun(NamedTuple):
    """One method of a comparison, ready for `simulate.run` over its vmapped seeds.

    Attributes:
      algorithm: the method with a leading [seeds] axis on every state leaf
        (`with_seeds`, possibly around `with_restarts`).
      data: the algorithm's inputs.
      key: simulate.run's key (the same for every method of a comparison, so
        seed s gets the same initialisation and round keys in each).
      rounds: rounds to train.
      evaluate: state -> one history row's values ([seeds] arrays; a row may
        leave out metrics that are only computed on some rounds).
      eval_every: rounds between `evaluate` calls (and checkpoints' chunks).
      seed_rows: history -> per-seed rows {"round": t, metric: [seeds]}, for
        histories whose values carry more than the seeds axis (restarts);
        None: the history rows already are.
      finals: (per-seed rows, every round's metrics or None) -> further
        finals {metric: [seeds]} beside each metric's last logged value.
      round_metrics: keep every round's metrics (`Execution(round_metrics=True)`)
        and hand them to `finals`.
      progress_summary: how a progress line sums up a row over the copies
        (`logs.best_copy` for restarts); None: the mean of the seeds.
      data_copies: leading copies axes of the client data (`FederatedData`)
        before its client axis: 1 for a data set per seed ([seeds, m, ...],
        `stack_seeds`), 0 for one data set every seed shares
        (`with_seeds(shared_data=True)`). Over several devices the client
        axis, not the seeds axis, is sharded.
      copies: leading copies axes of the state and of the evaluation's values: 1
        ([seeds]), 2 for a grid outside the seeds ([grid points, seeds],
        `experiments.tuned`: a run stops only when every point of every seed has
        diverged; `seed_rows` then picks a point per seed).
    """

    algorithm: Algorithm
    data: Any
    key: Any
    rounds: int
    evaluate: Callable[[Any], dict]
    eval_every: int = 1
    seed_rows: Callable[[list[dict]], list[dict]] | None = None
    finals: Callable[[list[dict], dict | None], dict] | None = None
    round_metrics: bool = False
    progress_summary: Callable | None = None
    data_copies: int = 1
    copies: int = 1


def method_clients(spec: MethodRun) -> int:
    """The number of clients of a method's data (its first client source).

    Raises:
      ValueError: the data holds no client source, or one whose shape does not
        have `spec.data_copies` copies axes before the client axis.
    """
    found = [node for node in jax.tree.leaves(spec.data, is_leaf=is_client_source)
             if is_client_source(node)]
    if not found:
        raise ValueError("a method's data holds no client data (FederatedData, views or "
                         "generated clients).")
    counts = [parallel.num_clients(node, spec.data_copies) for node in found]
    return counts[0]


@dataclass
class MethodResult:
    """A finished method: what methods/<name>.json holds.

    per_seed: metric -> [seeds] final values (NaN for a diverged seed).
    rows: per-seed history rows {"round": t, metric: [seeds] float64}.
    diverged: per seed, None or {"round", "metric", "value"} of its divergence.
    timing: compile and run seconds (not compared on resume).
    """

    name: str
    per_seed: dict
    rows: list
    diverged: list
    timing: dict = field(default_factory=dict)

    @property
    def seeds(self) -> int:
        return len(self.diverged)

    @property
    def diverged_seeds(self) -> int:
        return sum(d is not None for d in self.diverged)

    def to_json(self) -> dict:
        return {
            "method": self.name,
            "per_seed": {m: _floats(v) for m, v in self.per_seed.items()},
            "diverged": self.diverged,
            "history": [{k: (v if k == "round" else _floats(v)) for k, v in row.items()}
                        for row in self.rows],
            "timing": self.timing,
        }

    @classmethod
    def from_json(cls, record: dict) -> MethodResult:
        return cls(
            name=record["method"],
            per_seed={m: _array(v) for m, v in record["per_seed"].items()},
            rows=[{k: (v if k == "round" else _array(v)) for k, v in row.items()}
                  for row in record["history"]],
            diverged=list(record["diverged"]),
            timing=dict(record.get("timing", {})),
        )

    def seed_mean_rows(self) -> list[dict]:
        """History rows averaged over the seeds that did not diverge (NaN: none left)."""
        keep = np.array([d is None for d in self.diverged])
        out = []
        for row in self.rows:
            mean = {}
            for k, v in row.items():
                if k == "round":
                    continue
                x = np.asarray(v, np.float64)[keep]
                x = x[np.isfinite(x)]
                mean[k] = float(x.mean()) if x.size else math.nan
            out.append({"round": row["round"], **mean})
        return out

    def long_rows(self) -> list[dict]:
        """One row per (round, seed): the per_seed_metrics.csv rows of this method."""
        return [{"method": self.name, "seed": i, "round": row["round"],
                 **{k: float(np.asarray(v)[i]) for k, v in row.items() if k != "round"}}
                for row in self.rows for i in range(self.seeds)]


def _floats(values) -> list:
    return np.asarray(values, np.float64).reshape(-1).tolist()


def _array(values) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], np.float64)


def _per_seed(value, seeds: int) -> np.ndarray:
    """A row value as [seeds] float64 (a value without the seeds axis counts for every seed)."""
    x = np.asarray(value, np.float64)
    if x.ndim == 0:
        return np.full(seeds, float(x))
    if x.shape[0] != seeds or x.ndim != 1:
        raise ValueError(
            f"a per-seed history value must have shape [{seeds}] (one per seed); got "
            f"{x.shape}: reduce restarts or other copies in the method's seed_rows.")
    return x


def _kind(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def find_divergence(rows: list[dict], seeds: int, stopped=None) -> list:
    """Per seed: None, or {"round", "metric", "value"} where it first went non-finite.

    A metric is watched for a seed when its round-0 value there is finite. A
    seed with no such failure in `rows` but a `simulate.Diverged` (`stopped`:
    every seed went, and rows end at the last good evaluation) diverged where
    the run stopped.
    """
    out: list = [None] * seeds
    if not rows:
        return out
    watched = [{k for k, v in rows[0].items() if k != "round" and np.isfinite(v[i])}
               for i in range(seeds)]
    for row in rows[1:]:
        for i in range(seeds):
            if out[i] is not None:
                continue
            for k in sorted(watched[i] & row.keys()):
                x = float(row[k][i])
                if not math.isfinite(x):
                    out[i] = {"round": int(row["round"]), "metric": k, "value": _kind(x)}
                    break
    if stopped is not None:
        out = [d if d is not None else {"round": stopped.round, "metric": stopped.metric,
                                        "value": stopped.value} for d in out]
    return out


def train_method(name: str, spec: MethodRun, seeds: int,
                 execution: Execution | None = None) -> MethodResult:
    """Trains one method over its seeds through `simulate.run`; never raises `Diverged`.

    execution: how (`Execution`: mesh, checkpoints, resume, progress; its on_rows,
      when given, gets the per-seed rows as they come, only for a method without
      `seed_rows`, whose history rows already are per seed; its timing dict, default a
      new one, is filled by `simulate.run`). The method's own axes, description, round
      metrics and progress summary come from `spec`. The result keeps the compile and
      run seconds, rounds run, kernel form and client chunk.
    """
    execution = execution or Execution()
    timing = {} if execution.timing is None else execution.timing
    stopped = None
    per_round = None
    method_clients(spec)  # the declared copies axes match the data, with or without a mesh
    try:
        out = simulate.run(
            spec.algorithm, spec.data, spec.key, rounds=spec.rounds,
            eval_every=spec.eval_every, evaluate=spec.evaluate, execution=execution.replace(
                description=name, copies=spec.copies, data_copies=spec.data_copies,
                on_rows=execution.on_rows if spec.seed_rows is None else None, timing=timing,
                progress_summary=spec.progress_summary or logs.mean_of_copies("seeds"),
                round_metrics=spec.round_metrics))
        history = out[1]
        if spec.round_metrics:
            per_round = out[2]
    except simulate.Diverged as err:
        history, stopped = err.history, err
        per_round = err.round_metrics
    rows = spec.seed_rows(history) if spec.seed_rows is not None else history
    rows = [{"round": int(row["round"]),
             **{k: _per_seed(v, seeds) for k, v in row.items() if k != "round"}}
            for row in rows]
    diverged = find_divergence(rows, seeds, stopped)
    finals: dict = {}
    for row in rows:  # each metric's last logged value
        finals.update({k: v.copy() for k, v in row.items() if k != "round"})
    if spec.finals is not None:
        finals.update({k: _per_seed(v, seeds)
                       for k, v in spec.finals(rows, per_round).items()})
    gone = np.array([d is not None for d in diverged])
    for value in finals.values():
        value[gone] = math.nan
    return MethodResult(name, finals, rows, diverged, {
        k: timing.get(k) for k in ("compile_seconds", "run_seconds", "evaluate_seconds",
                                  "rounds_run", "kernel_form", "client_chunk")})


def first_divergence(results: Mapping[str, MethodResult]) -> tuple[str, int, dict] | None:
    """(method, seed, its divergence) of the earliest round any seed diverged at (ties: the
    first method in order, then the lowest seed); None when none did."""
    found = [(d["round"], order, seed, name, d)
             for order, (name, r) in enumerate(results.items())
             for seed, d in enumerate(r.diverged) if d is not None]
    if not found:
        return None
    _, _, seed, name, d = min(found, key=lambda f: f[:3])
    return name, seed, d


def divergence_summary(results: Mapping[str, MethodResult]) -> str | None:
    """What diverged in a comparison, as one clause (None: nothing did).

    However many methods and seeds there are, a comparison reports its
    divergence in one line built from this (a 10-seed, 11-method comparison in
    a SLURM log stays readable): how many seeds of how many methods went, each
    such method's count, and the first round and metric. Each seed's own round
    and metric are in its method's result (methods/<method>.json).
    """
    gone = [r for r in results.values() if r.diverged_seeds]
    if not gone:
        return None
    total = sum(r.seeds for r in results.values())
    count = sum(r.diverged_seeds for r in gone)
    name, seed, d = first_divergence(results)
    if count == total:
        which = (f"every seed of every method ({len(results)} method"
                 f"{'s' if len(results) > 1 else ''} × {gone[0].seeds} seed"
                 f"{'s' if gone[0].seeds > 1 else ''})"
                 if len({r.seeds for r in results.values()}) == 1 else f"all {total} seeds")
    else:
        which = (f"{count} of {total} seeds in {len(gone)} of {len(results)} methods ("
                 + ", ".join(f"{r.name} {r.diverged_seeds}/{r.seeds}" for r in gone) + ")")
    return (f"{which} diverged, the first at round {d['round']} (method {name} seed {seed}: "
            f"{d['metric']} is {d['value']})")


def run_methods(methods: Mapping[str, Callable[[], MethodRun]], seeds: int, out_dir, *,
                execution: Execution | None = None, resume: bool = False,
                checkpoint_every: int | None = None, primary: bool = True,
                on_method: Callable[[MethodResult], None] | None = None) -> dict:
    """Trains each method in turn (built lazily: a finished one is never rebuilt on resume).

    Args:
      methods: name -> a function building its MethodRun (its data planned:
        `Execution.planned`).
      seeds: the size of every method's seeds axis.
      out_dir: the comparison's directory (methods/, checkpoints/); None: in memory
        only (no files, no checkpoints, no resume).
      execution: how each method runs (`Execution`: mesh, progress; its checkpoints
        and resume are the comparison's, below).
      resume: load finished methods from methods/<name>.json, continue the
        one in flight from checkpoints/<name>/.
      checkpoint_every: rounds between a method's checkpoints; None or 0: none.
      primary: this process writes files (several processes: process 0).
      on_method: called with each MethodResult as it is finished or loaded.

    Returns:
      name -> MethodResult, in `methods`' order.
    """
    execution = execution or Execution()
    if out_dir is None:
        primary, resume, checkpoint_every = False, False, None
        out_dir = Path("<none>")
    out_dir = Path(out_dir)
    results = {}
    for name, build in methods.items():
        path = out_dir / "methods" / f"{name}.json"
        checkpoints = out_dir / "checkpoints" / name
        if resume and path.exists():
            result = MethodResult.from_json(read_json(path))
        else:
            spec = build()
            saved = Checkpoints(checkpoints, checkpoint_every) if checkpoint_every else None
            result = train_method(name, spec, seeds, execution.replace(
                checkpoints=saved, resume=resume and saved is not None))
            if primary:
                write_json(path, result.to_json())
        if primary and checkpoints.exists():
            shutil.rmtree(checkpoints, ignore_errors=True)
        results[name] = result
        if on_method is not None:
            on_method(result)
    if primary and (out_dir / "checkpoints").is_dir() and not any(
            (out_dir / "checkpoints").iterdir()):
        (out_dir / "checkpoints").rmdir()
    return results


def table_per_seed(results: Mapping[str, MethodResult], metrics) -> dict:
    """method -> metric -> [seeds] finals, every table metric present (NaN where a method
    has no such metric: local models have no cluster accuracy)."""
    return {name: {**{m: np.full(r.seeds, math.nan) for m in metrics}, **r.per_seed}
            for name, r in results.items()}


def results_table(results: Mapping[str, MethodResult], baseline: str, metrics) -> list[dict]:
    """results.csv rows: `stats.paired_comparison` over the seeds that did not diverge,
    with `diverged_seeds` and `seeds_used` per method; a method with no seed left has no
    "significant" verdict."""
    rows = stats.paired_comparison(table_per_seed(results, metrics), baseline, metrics)
    for row in rows:
        r = results[row["method"]]
        row["diverged_seeds"] = r.diverged_seeds
        row["seeds_used"] = r.seeds - r.diverged_seeds
        if row["seeds_used"] == 0:
            for m in metrics:
                if row[f"{m}_significant"] is not None:
                    row[f"{m}_significant"] = False
    return rows


def results_columns(metrics) -> list[str]:
    return ["method", "diverged_seeds", "seeds_used", *stats.results_columns(metrics)[1:]]


class MethodsDiverged(RuntimeError):
    """Some method diverged in some seed (every output is written by then): exit code 3.

    Its message is the comparison's one line about divergence (`divergence_summary`,
    and where each seed's details are), whatever the experiment; a comparison whose
    every seed of every method diverged is one of these, not an error.
    """

    def __init__(self, results: Mapping[str, MethodResult], out_dir=None):
        self.counts = {n: r.diverged_seeds for n, r in results.items() if r.diverged_seeds}
        where = "" if out_dir is None else f"{Path(out_dir)}/"
        super().__init__(
            f"comparison finished with diverged seeds: {divergence_summary(results)}; they "
            f"are left out of means and differences ({where}per_seed.csv marks each seed, "
            f"{where}methods/<method>.json gives its round and metric)")


__all__ = ["MethodResult", "MethodRun", "MethodsDiverged", "divergence_summary",
           "find_divergence", "first_divergence", "method_clients", "results_table",
           "run_methods", "train_method"]
