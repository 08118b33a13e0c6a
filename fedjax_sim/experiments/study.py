"""The one path from a declared experiment to what it trains: methods, runs, comparisons
(tuned or not) and sweeps, the same for every `base.Experiment`.

    method_run(e, name, s, problem):
      s      ← e.derived(s, problem)                       (settings the problem decides)
      model  ← problem's model (the split one where the method needs it)
      rule   ← server_rule(e, name, s, problem)       (DP or a robust rule, or none)
      A      ← with_seeds(build(name, e.method_table, model, training_of(e, name, s), s,
                                server_rule=rule.wrap))
      return MethodRun(A, problem's train, key(seed, ROUNDS), the method's rounds,
                       e.metrics(Trained(...)))

`compare` trains `compared(e, s)` side by side over the seeds (`compare.run_methods`),
over each method's tune_* grid where one is set (`tuned.tuned_run`); `run` trains one
(or calls the experiment's own `run`); `sweep_of` gives a comparison experiment a sweep
whose cells train the method of a run. How a run is executed (client chunks, devices,
memory, checkpoints, resume, progress) is the executor's (`execution.Execution`).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Mapping

import jax
import numpy as np

from fedjax_sim import compare as executor
from fedjax_sim import logs
from fedjax_sim.algorithms import ClientTraining, sgd, with_grid, with_seeds
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.data.holdout import validation_split
from fedjax_sim.execution import Execution
from fedjax_sim.experiments import methods as catalog
from fedjax_sim.experiments import privacy, robustness, tuned
from fedjax_sim.experiments.base import (
    ROUNDS,
    Comparison,
    Experiment,
    Metrics,
    RunContext,
    Sweep,
    Trained,
    check_method,
    seed_mean,
    stream_key,
)


def part(problem, name: str, default=None):
    """A part of a problem: a mapping's key or a record's field."""
    if isinstance(problem, Mapping):
        return problem.get(name, default)
    return getattr(problem, name, default)


def training_of(e: Experiment, name: str, s: dict, learning_rate=None) -> ClientTraining:
    """Method `name`'s client training: the experiment's, at the method's own learning
    rate (or `learning_rate`); plain SGD at it, with the same steps, batches and
    per-client work, for a method whose maths assume it."""
    method = e.method_table[name]
    if learning_rate is None:
        learning_rate = s.get(catalog.setting_of(method, "lr", s))
    training = e.client_training(s, learning_rate)
    if method.sgd:  # at the training's own rate where it has one (a schedule of the round)
        rate = learning_rate if training.learning_rate is None else training.learning_rate
        training = sgd(rate, steps=training.steps, batch_size=training.batch_size,
                       sampling=training.sampling, work=training.work)
    return training


def build_method(e: Experiment, name: str, s: dict, model, learning_rate=None,
                 problem=None, server_rule=None) -> Algorithm:
    """Method `name` (unvmapped) with these settings, through the one method table (its
    row's combinators see `problem`); server_rule: the algorithm's one server aggregation
    rule (`server_rule(...).wrap`: DP or a robust rule), applied before the row's combinators
    (restarts, ...)."""
    check_method(e, name)
    return catalog.build(name, e.method_table, model,
                         training_of(e, name, s, learning_rate), s, problem=problem,
                         server_rule=server_rule)


def method_rounds(e: Experiment, name: str, s: dict) -> int:
    return s[catalog.setting_of(e.method_table[name], "rounds", s)]


def model_of(e: Experiment, name: str, problem):
    """The model method `name` trains: the problem's, split where the method needs it."""
    model = part(problem, "model")
    if isinstance(model, Mapping):
        return model[catalog.SPLIT_MODEL in e.method_table[name].needs]
    return model


def method_run(e: Experiment, name: str, s: dict, problem, wrap=None) -> executor.MethodRun:
    """Method `name` over s["seeds"] vmapped seeds, ready to train: the same data, init and
    round keys as every other method (the paired differences need them). wrap: a server
    rule's wrap in place of the one the settings ask for (a grid point's: `grid_run`)."""
    s, model, rounds, rule, built, algorithm = _built(e, name, s, problem, wrap)
    copies = part(problem, "copies", 1)
    metrics = e.metrics(Trained(name, e.method_table[name], s, problem, model, algorithm,
                                built, rounds, training_of(e, name, s)))
    if not isinstance(metrics, Metrics):
        metrics = Metrics(metrics)
    every = metrics.every or s["eval_every"]
    evaluate = metrics.evaluate
    if isinstance(rule, privacy.PrivateRule):
        evaluate = _with_epsilon(evaluate, rule.table(every))
    return executor.MethodRun(
        algorithm, part(problem, "train"), stream_key(s["seed"], ROUNDS), rounds,
        evaluate, every, seed_rows=metrics.seed_rows,
        finals=metrics.finals, round_metrics=metrics.round_metrics,
        progress_summary=metrics.progress_summary, data_copies=copies)


def _built(e: Experiment, name: str, s: dict, problem, wrap=None):
    """(settings, model, rounds, server rule, the method for one seed, over the seeds)."""
    check_method(e, name)
    s = {**s, **e.method_table[name].settings}
    if e.derived is not None:
        s = e.derived(s, problem)
    model = model_of(e, name, problem)
    rule = server_rule(e, name, s, problem) if wrap is None else None
    if rule is not None:
        wrap = rule.wrap
    built = build_method(e, name, s if rule is None else rule.settings(s), model,
                         problem=problem, server_rule=wrap)
    algorithm = with_seeds(built, s["seeds"], shared_data=part(problem, "copies", 1) == 0)
    return s, model, method_rounds(e, name, s), rule, built, algorithm


def grid_run(e: Experiment, name: str, s: dict, problem, points: dict,
             wrap_at) -> executor.MethodRun:
    """Method `name` at every point of a grid of its server rule's values, one compiled
    program (`with_grid` outside the seeds: state [G, seeds, ...]); every point gets the
    seeds' data, initial weights and round keys, as `method_run` gives each point's run.

    Args:
      points: name -> [G] numbers (`algorithms.with_grid`).
      wrap_at: {name: scalar} -> that point's server rule wrap (its values traced).

    Returns:
      The run; its history rows hold [G · seeds] values, point-major (point g, seed i at
      g · seeds + i): train it as G · seeds seeds.
    """
    first = {k: v[0] for k, v in points.items()}
    base = method_run(e, name, s, problem, wrap=wrap_at(first))
    count, seeds = len(next(iter(points.values()))), s["seeds"]

    def build_at(point):
        return _built(e, name, s, problem, wrap_at(point))[-1]

    def evaluate(state):  # an experiment's metrics are host code over one [seeds] copy
        rows = [base.evaluate(jax.tree.map(lambda a, g=g: a[g], state)) for g in range(count)]
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}

    def seed_rows(history: list[dict]) -> list[dict]:
        def flat(value):
            x = np.asarray(value)
            return x.reshape((-1,) + x.shape[2:]) if x.shape[:2] == (count, seeds) else x

        rows = [{"round": row["round"], **{k: flat(v) for k, v in row.items() if k != "round"}}
                for row in history]
        return base.seed_rows(rows) if base.seed_rows is not None else rows

    return base._replace(algorithm=with_grid(build_at, points), evaluate=evaluate,
                         seed_rows=seed_rows, copies=2,
                         progress_summary=logs.mean_of_copies(
                             f"{count} grid points × {seeds} seeds"))


def server_rule(e: Experiment, name: str, s: dict,
                problem) -> privacy.PrivateRule | robustness.RobustRule | None:
    """The run's one server aggregation rule where its settings ask for one: DP
    (`experiments.privacy`) or a robust rule with Byzantine clients
    (`experiments.robustness`), never both (refused); None: the plain algorithm.

    A rule has `settings(s)` (what the method is built with), `wrap(algorithm)` (applied
    to the factory's algorithm before the method row's combinators) and `record()` (what
    summary.json says of it)."""
    private, robust = privacy.enabled(s), robustness.enabled(s)
    if not (private or robust):
        return None
    m = num_clients(problem)
    if robust:
        robustness.check(e.method_table, (name,), s)
        return robustness.RobustRule(s, m, _classes(s, problem))
    privacy.check(e.method_table, (name,), s, m)
    return privacy.PrivateRule(s, m, method_rounds(e, name, s))


def _classes(s: dict, problem) -> int | None:
    """C of attack=label_flip (`robustness.label_classes`); None for another attack."""
    if s.get("attack", "none") != "label_flip":
        return None
    return robustness.label_classes(part(problem, "train"))


def num_clients(problem) -> int:
    """The clients of the problem's training data (its first client source; one copy's
    where they are stacked per seed)."""
    import jax

    from fedjax_sim.data.federated import is_client_source

    train = part(problem, "train")
    source = next(n for n in jax.tree.leaves(train, is_leaf=is_client_source)
                  if is_client_source(n))
    if part(problem, "copies", 1):  # stacked per seed
        source = source.copy_at(0)
    return source.num_clients


def privacy_plan(e: Experiment, name: str, s: dict, problem) -> privacy.PrivateRule | None:
    """The run's DP (`experiments.privacy`) where its settings ask for it; None otherwise."""
    rule = server_rule(e, name, s, problem) if privacy.enabled(s) else None
    return rule if isinstance(rule, privacy.PrivateRule) else None


def _with_epsilon(evaluate, table):
    """The evaluation with the column `epsilon`: ε after the state's round (`table`)."""
    import jax.numpy as jnp

    epsilons = jnp.asarray(table)

    def evaluate_(state):
        return {**evaluate(state), "epsilon": epsilons[state.round]}

    return evaluate_


def compared(e: Experiment, s: dict) -> tuple[str, ...]:
    """The methods a comparison trains, the baseline among them: the `methods` setting (a
    narrowed or reordered list) where the experiment takes one, else its methods.

    Raises:
      ValueError: the setting repeats a method or leaves out the baseline (the paired
        differences are taken to it).
    """
    chosen = s.get("methods") if "methods" in e.declared else None
    if chosen is None:
        return tuple(e.methods)
    names = (chosen,) if isinstance(chosen, str) else tuple(chosen)
    for name in names:
        check_method(e, name)
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"setting methods names {', '.join(repeated)} twice; give each "
                         "method once.")
    if e.baseline in e.methods and e.baseline not in names:
        raise ValueError(
            f"setting methods must include the baseline {e.baseline} (the paired "
            f"differences are taken to it); got {','.join(names)}.")
    return names


def table(e: Experiment, s: dict) -> list[str]:
    """The metrics of results.csv, in order (with DP, the final ε last)."""
    out = e.table(s) if e.table is not None else [metric for metric, _ in e.panels]
    if privacy.enabled(s) and "epsilon" not in out:
        out = [*out, "epsilon"]
    return out


def with_parts(problem, **parts):
    """A problem (mapping or record) with some parts replaced."""
    if isinstance(problem, Mapping):
        return {**problem, **parts}
    return problem._replace(**parts)


def validation_problems(e: Experiment, problem, s: dict):
    """(fit, val) of a tuned comparison: the experiment's own, or `problem` with each
    training client's rows less a validation share (`data.holdout.validation_split`,
    s["val_fraction"], dealt by the seed), and the same with those validation rows as its
    test rows; a mapping's unseen_* parts (held-out clients) stay out of the validation
    problem, so the choice reads no test rows, theirs included."""
    if e.validation_problems is not None:
        return e.validation_problems(problem, s)
    fit, val = validation_split(part(problem, "train"), s["val_fraction"], s["seed"])
    seen = ({k: v for k, v in problem.items() if not k.startswith("unseen")}
            if isinstance(problem, Mapping) else problem)
    return with_parts(problem, train=fit), with_parts(seen, train=fit, test=val)


def problem_for(e: Experiment, s: dict):
    """The problem its methods train on: `e.problem(s)`, or with a tune_* grid set the
    `tuned.Tuned` of it."""
    problem = e.problem(s)
    if e.tune_metric is None or not tuned.tunes(s):
        return problem
    return tuned.Tuned(problem, *validation_problems(e, problem, s))


def method_spec(e: Experiment, name: str, s: dict, problem,
                execution: Execution | None = None) -> executor.MethodRun:
    """`method_run` on `problem` planned by the executor for the method's footprint
    (`Execution.planned`, under `execution`'s memory budget; default: none), over its
    tune_* grid where `problem` is a `tuned.Tuned`."""
    build = functools.partial(method_run, e)
    if isinstance(problem, tuned.Tuned):
        return tuned.tuned_run(e, name, s, problem, build)
    footprint = None if e.footprint is None else e.footprint(name, s, problem)
    return build(name, s, (execution or Execution()).planned(problem, footprint))


def comparison_notes(e: Experiment, s: dict, problem, results: dict) -> dict:
    """The experiment's notes, and the grids and chosen values of a tuned comparison."""
    full = problem.full if isinstance(problem, tuned.Tuned) else problem
    metric = e.tune_metric[0] if e.tune_metric else ""
    notes = e.notes(s, full, results) if e.notes is not None else {}
    return {**notes, **tuned.notes(s, results, metric)}


def compare(e: Experiment, s: dict, ctx: RunContext | None = None) -> Comparison:
    """Every compared method over s["seeds"] seeds, in memory (no files): the Python API
    of `fedjax-sim compare` (which also checkpoints and writes its directory).

    Diverged seeds are reported as the command reports them: one line on stderr for the
    whole comparison (`compare.divergence_summary`); each seed's round and metric are in
    the returned `results[method].diverged`.
    """
    ctx = ctx or RunContext(progress=False)
    tuned.check(s)
    problem = problem_for(e, s)
    metrics = table(e, s)
    execution = ctx.execution(s)
    results = executor.run_methods(
        {m: functools.partial(method_spec, e, m, s, problem, execution)
         for m in compared(e, s)},
        s["seeds"], None, execution=execution,
        on_method=lambda r: ctx.on_method(
            r.name, executor.table_per_seed({r.name: r}, metrics)[r.name],
            r.seed_mean_rows()))
    summary = executor.divergence_summary(results)
    if summary is not None:
        print(f"fedjax-sim: comparison finished with diverged seeds: {summary}; they are "
              "left out of means and differences (results[method].diverged gives each "
              "seed's round and metric)", file=sys.stderr)
    return Comparison(executor.table_per_seed(results, metrics),
                      {n: r.seed_mean_rows() for n, r in results.items()}, metrics,
                      e.baseline, comparison_notes(e, s, problem, results), results)


def run(e: Experiment, s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
    """`fedjax-sim run`: the experiment's own run, or method s[method_key] over s["seeds"]
    seeds (`run_method`)."""
    if e.run is not None:
        return e.run(s, ctx)
    return run_method(e, s, ctx)


def run_method(e: Experiment, s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
    """Method s[method_key] over s["seeds"] seeds.

    metrics.csv gets one row per (round, seed); summary.json each final metric per seed
    and its mean over the seeds that did not diverge. The run has diverged (exit 3) when
    every seed has: the runner's `simulate.Diverged` is then its one line. When only
    some seeds have, one line on stderr says how many and where the first went
    (summary.json's "diverged" holds each seed's round and metric), never one per seed.
    """
    name = s[e.method_key]
    execution = ctx.execution(s)
    spec = method_spec(e, name, s, problem_for(e, s), execution)
    seeds = s["seeds"]

    def stream(rows):
        ctx.on_rows([{"seed": i, "round": int(row["round"]),
                      **{k: float(np.asarray(v, np.float64).reshape(-1)[i]
                                  if np.ndim(v) else v)
                         for k, v in row.items() if k != "round"}}
                     for row in rows for i in range(seeds)])

    result = executor.train_method(name, spec, seeds, execution.replace(
        on_rows=stream if spec.seed_rows is None else None))
    ctx.timing.update(result.timing)
    rows = [{"seed": r.pop("seed"), **{k: v for k, v in r.items() if k != "method"}}
            for r in result.long_rows()]
    if spec.seed_rows is not None:
        ctx.on_rows(rows)
    if 0 < result.diverged_seeds < seeds:
        _, seed, first = executor.first_divergence({name: result})
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
    problem = problem_for(e, s) if privacy.enabled(s) or robustness.enabled(s) else None
    if isinstance(problem, tuned.Tuned):  # the clients trained: the fit rows'
        problem = problem.fit
    rule = (server_rule(e, name, {**s, **e.method_table[name].settings}, problem)
            if problem is not None else None)
    if rule is not None:
        what = "privacy" if isinstance(rule, privacy.PrivateRule) else "robustness"
        summary[what] = rule.record()
    if result.diverged_seeds == seeds:
        last = max(result.diverged, key=lambda d: d["round"])
        summary.update(diverged_round=last["round"], diverged_metric=last["metric"],
                       diverged_value=last["value"], last_checkpoint_round=None)
    return rows, summary


def run_facts(e: Experiment, summary: dict, s: dict) -> list[str]:
    """What a finished run found, as clauses of the paragraph `fedjax-sim run` ends with
    (`runner.run_summary` adds the files written): the experiment's own, or a method's
    run: its method and seeds and the mean final value of each metric of its results
    table, over the seeds that did not diverge."""
    if e.run_facts is not None:
        return e.run_facts(summary, s)
    final = summary.get("final_mean")
    if not isinstance(final, dict):
        return []
    seeds = summary.get("seeds", 1)
    shown = [f"{m} {_number(final[m])}" for m in table(e, s) if m in final]
    facts = [f"{summary.get('method', s.get(e.method_key))} over {seeds} "
             f"seed{'s' if seeds != 1 else ''}" + (
                 f": final {', '.join(shown)}" if shown else "")]
    if summary.get("diverged_seeds"):
        facts.append(f"{summary['diverged_seeds']} diverged seed"
                     f"{'s' if summary['diverged_seeds'] != 1 else ''} left out of the means")
    return facts


def _number(value) -> str:
    """A metric's value in a sentence: 4 significant digits, or as it is (None, NaN)."""
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def sweep_of(e: Experiment) -> Sweep:
    """The experiment's sweep: its own, or for a comparison one whose cells each train
    method s[method_key] over the cell's seeds; a trial is one seed's final value of each
    metric of the results table, and a cell's summary their mean and standard deviation
    over the seeds that did not diverge."""
    if e.sweep is not None:
        return e.sweep

    def trials(cell: dict, seed_ids: list[int], mesh=None) -> list[dict]:
        _, summary = run_method(e, cell, RunContext(mesh=mesh, progress=False))
        finals = summary["final_per_seed"]
        return [{"data_seed": i, "method": summary["method"],
                 **{m: finals[m][i] for m in table(e, cell) if m in finals}}
                for i in seed_ids]

    def columns(axes: list[str], s: dict) -> list[str]:
        return ["cell_id", "data_seed", *axes, "method", *table(e, s)]

    def summarize(trials: list[dict], cells: list[dict], axes: list[str]) -> list[dict]:
        rows = []
        for cell in cells:
            mine = [t for t in trials if t["cell_id"] == cell["cell_id"]]
            row = {"cell_id": cell["cell_id"], **{a: cell[a] for a in axes},
                   "method": cell[e.method_key], "seeds": len(mine)}
            for m in table(e, cell):
                values = [float(t[m]) for t in mine if t.get(m) not in (None, "")]
                finite = [v for v in values if math.isfinite(v)]
                row[f"{m}_mean"] = float(np.mean(finite)) if finite else math.nan
                row[f"{m}_std"] = float(np.std(finite)) if finite else math.nan
            rows.append(row)
        return rows

    # Cells differing only in ε (target_epsilon, dp_noise): one program (`privacy.grouped`).
    return privacy.grouped(e, Sweep(trials, columns, summarize,
                                    seeds_per_chunk=lambda cell: cell["seeds"]))


__all__ = ["build_method", "compare", "compared", "grid_run", "method_run", "method_spec",
           "model_of", "num_clients",
           "part", "problem_for", "run", "run_facts", "run_method", "server_rule", "sweep_of",
           "table",
           "training_of", "validation_problems", "with_parts"]
