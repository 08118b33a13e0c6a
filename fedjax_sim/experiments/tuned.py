"""Comparisons tuned as papers tune them: a grid per method, chosen on validation rows.

A paper tunes each method's step size (and its own key hyper-parameter: FedProx's
μ, q-FFL's q, the λ step of the robust methods) on held-out data before it
reports the method. A comparison does the same when a grid is set:

- `tune_X` (a comma list; empty: none) is a grid of setting X, for X in
  `TUNABLE` that the experiment declares; every method that reads X (its own
  learning-rate setting, or X among its `Method.reads`) trains at every value.
  A method reading several gridded settings trains at their product.
- The grid is one more vmapped axis of the method's one program
  (`algorithms.with_grid`, outside its seeds: state [G, seeds, ...]); every
  point gets the seed's data, initial weights and round keys.
- Each client's training rows lose a validation share (`val_fraction`,
  `data.holdout.validation_split`, dealt per seed): every method of the
  comparison, tuned or not, trains on the rest.
- Per method and seed, the point with the best validation value of the
  experiment's headline metric (`Experiment.tune_metric`, measured on the
  validation rows as the experiment measures it on the test rows, at the last
  evaluation) is chosen; ties and a seed whose points all diverged take the
  first point. Only the validation rows decide: the test rows are evaluated
  for the report, never read by the choice.
- The method's history and finals are the chosen point's; `chosen_X` per seed
  rides along (per_seed.csv, results.csv's mean, a line of the notes).
- `tune_dp_clip` (an experiment with the DP settings, `experiments.privacy`): every
  method trains with DP at each clip of the grid (values > 0; DP on, whatever dp_clip
  says), the clip traced like a learning rate. The choice reads the validation rows
  without any privacy: tuning is not privatised, as in the DP papers (ε accounts for
  the training of one grid point).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_sim import logs
from fedjax_sim.algorithms import PRIVATE_READY, with_grid
from fedjax_sim.compare import MethodRun
from fedjax_sim.experiments import methods as catalog
from fedjax_sim.experiments.settings import Setting

# The settings a grid can tune (each a float its factory takes traced).
TUNABLE = ("lr", "qffl_lr", "local_lr", "prox_mu", "q", "lambda_lr", "ditto_lambda", "dp_clip")
VAL_FRACTION = 0.2
MAX_POINTS = 1000  # grid points of one method (a product past this is refused)


class Tuned(NamedTuple):
    """The problem of a tuned comparison, in the experiment's own form each.

    full: as the experiment built it (its notes read it).
    fit: every method trains here: each client's training rows less its validation rows.
    val: `fit` with the validation rows where the test rows were (the choice reads it).
    """

    full: Any
    fit: Any
    val: Any


def tune_settings(declared: Mapping[str, Setting], metric: str) -> list[Setting]:
    """`tune_X` for every X of `TUNABLE` in `declared` (read by X's readers, within X's
    range), and `val_fraction`."""
    out = [Setting(f"tune_{x}", float, [], f"a grid of {x} (a comma list; none: no grid): "
                   f"each method reading {x} trains at every value, one vmapped axis, and per "
                   f"seed the value of best {validation_name(metric)} ({metric} on validation "
                   "rows) is reported (docs/protocols.md#tuned-comparisons)",
                   minimum=st.minimum, maximum=st.maximum, listable=True, methods=st.methods)
           for x, st in declared.items() if x in TUNABLE]
    if out:
        out.append(Setting("val_fraction", float, VAL_FRACTION, "with a tune_* grid: each "
                           "client's share of training rows held out to choose the grid "
                           "point (every method trains on the rest)", minimum=0.05,
                           maximum=0.5))
    return out


def grid_values(value) -> list[float]:
    """A tune_X value as a list: [] (none), one value, or a comma list's values."""
    if value is None or value == []:
        return []
    return [float(v) for v in (value if isinstance(value, list) else [value])]


def tunes(s: dict) -> bool:
    """Whether a comparison with settings `s` tunes some method (some grid is set)."""
    return any(grid_values(s.get(f"tune_{x}")) for x in TUNABLE)


def gridded(s: dict) -> list[str]:
    """The settings X with a grid in `s`, in `TUNABLE` order."""
    return [x for x in TUNABLE if grid_values(s.get(f"tune_{x}"))]


def check(s: dict, given: tuple[str, ...] = ()) -> None:
    """ValueError naming the setting: a grid repeating a value, or a setting of `given`
    (values the user changed) that is not read: one its grid replaces (lr with tune_lr
    set), or val_fraction without a grid."""
    if "val_fraction" in given and not tunes(s):
        raise ValueError("setting val_fraction is read only with a tune_* grid (the "
                         "validation rows choose a grid point); this comparison has none: "
                         "leave it alone or give a grid, e.g. tune_lr=0.01,0.1.")
    for x in gridded(s):
        if x in given:
            raise ValueError(f"setting {x} is not read while tune_{x} is set (each method "
                             f"reading it trains at every value of the grid); give "
                             f"tune_{x}=none to train at {x}={s[x]!r}, or leave {x} alone.")
    for x in gridded(s):
        values = grid_values(s[f"tune_{x}"])
        if len(set(values)) != len(values):
            raise ValueError(f"setting tune_{x} repeats a value: {values!r}; give each once.")
    if any(v <= 0 for v in grid_values(s.get("tune_dp_clip"))):
        raise ValueError(f"setting tune_dp_clip must hold clips > 0 (every point trains with "
                         f"DP); got {s['tune_dp_clip']!r}.")
    if math.prod(len(grid_values(s[f"tune_{x}"])) for x in gridded(s)) > MAX_POINTS:
        raise ValueError(f"the tune_* grids make more than {MAX_POINTS} points for one "
                         "method; narrow them.")


def method_grid(method: catalog.Method | None, s: dict) -> dict[str, list[float]]:
    """setting -> values: the grids of the settings `method` reads ({}: it is not tuned)."""
    if method is None:
        return {}
    read = [catalog.setting_of(method, "lr", s), *method.reads]
    if reads_clip(method):
        read.append("dp_clip")
    return {x: grid_values(s[f"tune_{x}"]) for x in TUNABLE
            if x in read and grid_values(s.get(f"tune_{x}"))}


def reads_clip(method: catalog.Method) -> bool:
    """Whether the method reads dp_clip: the server rule of every method that can be
    trained with DP (a tune_dp_clip grid turns DP on; the others are then refused)."""
    return isinstance(method.algorithm, str) and method.algorithm in PRIVATE_READY


def validation_name(metric: str) -> str:
    """The history column of a metric measured on the validation rows."""
    return "val_" + metric.removeprefix("test_")


def tuned_run(experiment, name: str, s: dict, problem: Tuned,
              method_run: Callable[[str, dict, Any], MethodRun],
              outer: Mapping[str, list] | None = None) -> MethodRun:
    """Method `name` on `problem.fit`, over its grid when it has one (`with_grid`), its
    history and finals those of the point chosen per seed on `problem.val`;
    method_run(name, settings, problem) builds the method's run (`study.method_run`).

    outer: name -> [K] values the choice does not range over (a sweep's cells, e.g. their
    σ: `privacy.grid_trials`): the program's points are their product with the grid's,
    outer-major, the point is chosen per outer value and seed, and the rows hold
    [K · seeds] values, outer-major (train it as K · seeds seeds)."""
    grid = method_grid(experiment.method_table.get(name), s)
    if not grid:
        return method_run(name, s, problem.fit)
    names = list(grid)
    combos = list(itertools.product(*(grid[x] for x in names)))
    outer = dict(outer or {})
    outer_count = len(next(iter(outer.values()))) if outer else 1
    tune_count, seeds = len(combos), s["seeds"]
    points = [{**{x: v[k] for x, v in outer.items()}, **dict(zip(names, c, strict=True))}
              for k in range(outer_count) for c in combos]
    count = len(points)
    values = {x: [p[x] for p in points] for x in points[0]}
    base = method_run(name, {**s, **points[0]}, problem.fit)
    # An evaluation that trains clients first (fine-tuning, adapting unseen clients) trains
    # them at each point's own values; any other evaluates every point alike.
    own = points if experiment.method_table[name].kind in ("fine_tuned", "personal") \
        else points[:1]
    evaluations = [base.evaluate, *(method_run(name, {**s, **p}, problem.fit)
                                    .evaluate for p in own[1:])]
    on_val = [method_run(name, {**s, **p}, problem.val) for p in own]
    if base.round_metrics:
        raise ValueError(f"method {name} of {experiment.name} reads every round's metrics for "
                         "its finals, which a tune_* grid does not select: leave the tune_* "
                         "settings empty.")
    metric, sense = experiment.tune_metric
    val_name = validation_name(metric)

    def build_at(point):  # the point's values are traced: one program for every point
        return method_run(name, {**s, **point}, problem.fit).algorithm

    def at(state, g):
        return jax.tree.map(lambda a: a[g], state)

    def per_seed(value) -> np.ndarray:
        x = np.asarray(value, np.float64)
        return np.full(seeds, float(x)) if x.ndim == 0 else x

    def evaluate(state):
        # An experiment's metrics are host code over one [seeds] copy: a point at a time.
        rows = [evaluations[g % len(evaluations)](at(state, g)) for g in range(count)]
        out = {k: np.stack([per_seed(r[k]) for r in rows]) for k in rows[0]}
        out[val_name] = np.stack([per_seed(on_val[g % len(on_val)].evaluate(at(state, g))[
            metric]) for g in range(count)])
        return out

    def seed_rows(history: list[dict]) -> list[dict]:
        score = np.asarray(next(row[val_name] for row in reversed(history)
                                if val_name in row), np.float64)
        score = np.where(np.isfinite(score), score if sense == "min" else -score, np.inf)
        # [K, seeds]; ties and all-diverged: the first point
        choice = np.argmin(score.reshape(outer_count, tune_count, seeds), axis=1)
        ks, seed_ids = np.arange(outer_count)[:, None], np.arange(seeds)[None, :]

        def pick(value):
            x = np.asarray(value)
            if x.shape[:2] != (count, seeds):
                return x
            x = x.reshape((outer_count, tune_count) + x.shape[1:])
            return x[ks, choice, seed_ids].reshape((outer_count * seeds,) + x.shape[3:])

        rows = [{"round": row["round"], **{k: pick(v) for k, v in row.items() if k != "round"}}
                for row in history]
        if base.seed_rows is not None:
            rows = base.seed_rows(rows)
        chosen = {f"chosen_{x}": np.asarray(values[x], np.float64).reshape(
            outer_count, tune_count)[ks, choice].reshape(-1) for x in names}
        return [{**row, **chosen} for row in rows]

    return base._replace(
        algorithm=with_grid(build_at, values), evaluate=evaluate, seed_rows=seed_rows,
        copies=2, progress_summary=logs.mean_of_copies(f"grid points × {seeds} seeds"))


def chosen_columns(s: dict) -> list[str]:
    """results.csv's columns of the chosen values (mean over seeds), one per grid."""
    return [f"chosen_{x}" for x in gridded(s)]


def chosen_means(results: Mapping, s: dict) -> dict[str, dict[str, float | None]]:
    """method -> chosen_X -> its mean over the seeds that did not diverge (None: the
    method reads no such grid, or no seed is left)."""
    out = {}
    for name, r in results.items():
        keep = np.array([d is None for d in r.diverged], bool)
        out[name] = {}
        for col in chosen_columns(s):
            x = np.asarray(r.per_seed.get(col, []), np.float64)
            x = x[keep[:x.size]] if x.size else x
            x = x[np.isfinite(x)]
            out[name][col] = float(x.mean()) if x.size else None
    return out


def notes(s: dict, results: Mapping, metric: str) -> dict:
    """The notes' lines of a tuned comparison ({} when it tunes nothing)."""
    if not tunes(s):
        return {}
    grids = "; ".join(f"{x} ∈ {{{', '.join(f'{v:g}' for v in grid_values(s[f'tune_{x}']))}}}"
                      for x in gridded(s))
    chosen = []
    for name, r in results.items():
        parts = [f"{col.removeprefix('chosen_')} "
                 + ", ".join(f"{v:g}" for v in np.asarray(r.per_seed[col], np.float64))
                 for col in chosen_columns(s) if col in r.per_seed]
        chosen.append(f"{name}: {'; '.join(parts) if parts else 'not tuned'}")
    return {
        "tuning": (f"grids {grids}, each method at the product of the grids it reads, one "
                   f"vmapped axis; {s['val_fraction']:.0%} of each client's training rows "
                   f"held out (per seed) and every method trained on the rest; per method "
                   f"and seed the point of best {validation_name(metric)} ({metric} on the "
                   "validation rows) at the last evaluation is reported (the test rows are "
                   "never read by the choice)"),
        "chosen_per_seed": " | ".join(chosen),
    }


__all__ = ["TUNABLE", "Tuned", "check", "chosen_columns", "chosen_means", "grid_values",
           "gridded", "method_grid", "notes", "reads_clip", "tune_settings", "tunes",
           "tuned_run", "validation_name"]
