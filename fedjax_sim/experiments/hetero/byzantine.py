"""ByzFL's protocol on the digits: aggregators × attacks × Byzantine share × Dirichlet α.

    each cell (aggregator, pre_aggregation, attack, byzantine, alpha) and seed:
        FedAvg with the cell's rule (`experiments.robustness`) and Byzantine clients,
        on Dirichlet(α) clients
    each (aggregator, pre_aggregation, byzantine, alpha):
        worst case = the lowest mean test accuracy over the attacks, and the attack
        achieving it                                   (summary.csv, worst_case.csv)

The cells that differ only in attack and byzantine (the settings declared traced) are one
compiled program (`study.grid_run` over a `robustness.RobustGrid`): the Byzantine count,
the rules' f and the attack are traced values of a vmapped grid axis outside the seeds,
every point on the same data, initial weights and round keys, so each cell's trials are
those of the cell trained alone (`study.sweep_of`'s run) up to float rounding. Cells with
byzantine=0 have no client to attack through: every attack of them is the grid's one point
of attack none (trained once, recorded under each attack).
"""

from __future__ import annotations

import dataclasses
import json
import math

from fedjax_sim import compare as executor
from fedjax_sim import plots
from fedjax_sim.experiments import robustness, study, tuned
from fedjax_sim.experiments.base import RunContext, Sweep
from fedjax_sim.io import write_csv

GROUP = ("aggregator", "pre_aggregation", "bucket_size", "byzantine", "alpha")
METRIC = "test_accuracy"
# What the cells of one program may differ in (besides their ids).
TRACED = ("attack", "byzantine")


def grid_trials(
    e, cells: list[dict], seed_ids: list[int], mesh=None, timing: dict | None = None
) -> list[dict]:
    """trials.csv rows (each with its cell's "cell_id") of every (cell, seed) of cells that
    differ only in attack and byzantine, trained as one program (`study.grid_run`);
    timing, when given, gets the run's compile and run seconds (`simulate.run`'s)."""
    s = {k: v for k, v in cells[0].items() if k != "cell_id"}
    name = s[e.method_key]
    ctx = RunContext(mesh=mesh, progress=False, timing={} if timing is None else timing)
    execution = ctx.execution(s)
    problem = study.problem_for(e, s)
    footprint = None if e.footprint is None else e.footprint(name, s, problem)
    problem = execution.planned(problem, footprint)
    flips = any(c["attack"] == "label_flip" for c in cells)
    classes = robustness.label_classes(study.part(problem, "train")) if flips else None
    grid = robustness.RobustGrid(cells, study.num_clients(problem), classes)
    spec = study.grid_run(e, name, s, problem, grid.points, grid.wrap_at)
    seeds = s["seeds"]
    result = executor.train_method(name, spec, len(grid) * seeds, execution)
    metrics = [m for m in study.table(e, s) if m in result.per_seed]
    return [
        {
            "cell_id": cell["cell_id"],
            "data_seed": i,
            "method": name,
            **{m: float(result.per_seed[m][point * seeds + i]) for m in metrics},
        }
        for cell, point in zip(cells, grid.cell_points, strict=True)
        for i in seed_ids
    ]


def byzantine_sweep(e) -> Sweep:
    """`study.sweep_of(e)` with the cells that differ only in attack and byzantine trained
    as one program (`grid_trials`; a cell alone: its own program, byzantine=0 trained once
    over the attacks), and summary rows naming the worst case over attacks of their
    group, with plots (`plot_fractions`)."""
    plain = study.sweep_of(dataclasses.replace(e, sweep=None))
    trained: dict[str, list[dict]] = {}

    def trials(cell: dict, seed_ids: list[int], mesh=None) -> list[dict]:
        no_attack = robustness.byzantine_count(cell, robustness.training_clients(cell)) == 0
        if not no_attack:
            return plain.trials(cell, seed_ids, mesh)
        key = json.dumps(
            {
                **{k: v for k, v in cell.items() if k != "cell_id"},
                "attack": "none",
                "attack_scale": 0.0,
                "seeds_run": seed_ids,
            },
            sort_keys=True,
            default=str,
        )
        if key not in trained:
            trained[key] = plain.trials(
                {**cell, "attack": "none", "attack_scale": 0.0}, seed_ids, mesh
            )
        return [dict(row) for row in trained[key]]

    def summarize(rows: list[dict], cells: list[dict], axes: list[str]) -> list[dict]:
        summary = plain.summarize(rows, cells, axes)
        for row, cell in zip(summary, cells, strict=True):
            row["attack"] = cell["attack"]
            row.update({k: cell[k] for k in GROUP if k not in row and k in cell})
            row["rule"] = rule_name(cell)
            mine = [r.get(METRIC) for r in rows if r["cell_id"] == cell["cell_id"]]
            _, row[f"{METRIC}_lo"], row[f"{METRIC}_hi"], _ = plots.seed_interval(mine, "se")
        for group in _groups(summary, cells).values():
            worst = min(group, key=lambda r: _value(r))
            for row in group:
                row[f"worst_{METRIC}"] = worst[f"{METRIC}_mean"]
                row["worst_attack"] = worst["attack"]
                for end in ("lo", "hi"):
                    row[f"worst_{METRIC}_{end}"] = worst[f"{METRIC}_{end}"]
        return summary

    def one_program(cells: list[dict]) -> bool:
        apart = {k for c in cells for k in c if c.get(k) != cells[0].get(k)} - {"cell_id"}
        return len(cells) > 1 and apart <= set(TRACED) and not tuned.tunes(cells[0])

    def group_trials(cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
        if not one_program(cells):
            return [
                {"cell_id": c["cell_id"], **row} for c in cells for row in trials(c, seed_ids, mesh)
            ]
        return grid_trials(e, cells, seed_ids, mesh)

    def trials_per_program(cells: list[dict]) -> int:
        if not one_program(cells):
            return cells[0]["seeds"]
        m = robustness.training_clients(cells[0])
        return len(robustness.RobustGrid(cells, m, num_classes=10)) * cells[0]["seeds"]

    def plot(summary: list[dict], out_dir) -> None:
        worst = worst_case(summary)
        write_csv(out_dir / "worst_case.csv", worst)
        plot_fractions(worst, summary, out_dir)
        if plain.plot is not None:
            plain.plot(summary, out_dir)

    return dataclasses.replace(
        plain,
        trials=trials,
        summarize=summarize,
        plot=plot,
        group=True,
        group_trials=group_trials,
        trials_per_program=trials_per_program,
    )


def _value(row: dict) -> float:
    v = row.get(f"{METRIC}_mean")
    return v if isinstance(v, float) and math.isfinite(v) else math.inf


def _groups(summary: list[dict], cells: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row, cell in zip(summary, cells, strict=True):
        key = json.dumps([cell.get(k) for k in GROUP], default=str)
        groups.setdefault(key, []).append(row)
    return groups


def rule_name(cell: dict) -> str:
    """A rule as a legend names it: the aggregator, after its pre-aggregation if any."""
    pre = cell.get("pre_aggregation", "none")
    return cell["aggregator"] if pre == "none" else f"{pre}+{cell['aggregator']}"


def plot_fractions(worst: list[dict], summary: list[dict], out_dir) -> list:
    """worst_case.png: each rule's worst-case test accuracy over the attacks against the
    Byzantine share, a panel per α, error bars the worst attack's ±1 standard error over
    seeds; accuracy_by_attack.png: each rule's accuracy against the share, a panel per
    attack and α. Written where the share takes two values or more (the paths written)."""
    label = "Byzantine share of the clients"
    panels = ["alpha"] if any("alpha" in r for r in worst) else []
    written = [
        plots.plot_curves(
            worst,
            out_dir / "worst_case.png",
            x="byzantine",
            y=f"worst_{METRIC}",
            group="rule",
            panels=panels,
            ci=(f"worst_{METRIC}_lo", f"worst_{METRIC}_hi"),
            ylim=(0.0, 1.0),
            xlabel=label,
            ylabel="worst-case test accuracy over attacks\n(bars: ±1 standard error over seeds)",
            label_format="{value}",
        ),
        plots.plot_curves(
            summary,
            out_dir / "accuracy_by_attack.png",
            x="byzantine",
            y=f"{METRIC}_mean",
            group="rule",
            panels=[*panels, "attack"],
            ci=(f"{METRIC}_lo", f"{METRIC}_hi"),
            ylim=(0.0, 1.0),
            xlabel=label,
            ylabel="test accuracy\n(bars: ±1 standard error over seeds)",
            label_format="{value}",
        ),
    ]
    return [p for p in written if p is not None]


def worst_case(summary: list[dict]) -> list[dict]:
    """One row per (aggregator, pre_aggregation, byzantine, alpha): the worst mean test
    accuracy over the attacks of the sweep, its ±1 standard error over seeds and the
    attack achieving it (summary rows)."""
    out, seen = [], set()
    for row in summary:
        key = tuple(row.get(k) for k in GROUP)
        if key in seen or f"worst_{METRIC}" not in row:
            continue
        seen.add(key)
        out.append(
            {
                **{k: row[k] for k in GROUP if k in row},
                "rule": row.get("rule"),
                f"worst_{METRIC}": row[f"worst_{METRIC}"],
                f"worst_{METRIC}_lo": row.get(f"worst_{METRIC}_lo"),
                f"worst_{METRIC}_hi": row.get(f"worst_{METRIC}_hi"),
                "worst_attack": row["worst_attack"],
            }
        )
    return out
