"""ByzFL's protocol on the digits: aggregators × attacks × Byzantine share × Dirichlet α.

    each cell (aggregator, pre_aggregation, attack, byzantine, alpha) and seed:
        FedAvg with the cell's rule (`experiments.robustness`) and Byzantine clients,
        on Dirichlet(α) clients                                        (`study.sweep_of`)
    each (aggregator, pre_aggregation, byzantine, alpha):
        worst case = the lowest mean test accuracy over the attacks, and the attack
        achieving it                                   (summary.csv, worst_case.csv)

A cell with byzantine=0 has no client to attack through: every attack of it trains the
same run, which is trained once and its trials reused (recorded under each attack).
"""

from __future__ import annotations

import dataclasses
import json
import math

from fedjax_sim.experiments import robustness, study
from fedjax_sim.experiments.base import Sweep
from fedjax_sim.io import write_csv

GROUP = ("aggregator", "pre_aggregation", "bucket_size", "byzantine", "alpha")
METRIC = "test_accuracy"


def byzantine_sweep(e) -> Sweep:
    """`study.sweep_of(e)` with the cells of byzantine=0 trained once over the attacks,
    and summary rows naming the worst case over attacks of their group."""
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
        for group in _groups(summary, cells).values():
            worst = min(group, key=lambda r: _value(r))
            for row in group:
                row[f"worst_{METRIC}"] = worst[f"{METRIC}_mean"]
                row["worst_attack"] = worst["attack"]
        return summary

    def plot(summary: list[dict], out_dir) -> None:
        write_csv(out_dir / "worst_case.csv", worst_case(summary))
        if plain.plot is not None:
            plain.plot(summary, out_dir)

    return dataclasses.replace(plain, trials=trials, summarize=summarize, plot=plot)


def _value(row: dict) -> float:
    v = row.get(f"{METRIC}_mean")
    return v if isinstance(v, float) and math.isfinite(v) else math.inf


def _groups(summary: list[dict], cells: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for row, cell in zip(summary, cells, strict=True):
        key = json.dumps([cell.get(k) for k in GROUP], default=str)
        groups.setdefault(key, []).append(row)
    return groups


def worst_case(summary: list[dict]) -> list[dict]:
    """One row per (aggregator, pre_aggregation, byzantine, alpha): the worst mean test
    accuracy over the attacks of the sweep and the attack achieving it (summary rows)."""
    out, seen = [], set()
    for row in summary:
        key = tuple(row.get(k) for k in GROUP)
        if key in seen or f"worst_{METRIC}" not in row:
            continue
        seen.add(key)
        out.append(
            {
                **{k: row[k] for k in GROUP if k in row},
                f"worst_{METRIC}": row[f"worst_{METRIC}"],
                "worst_attack": row["worst_attack"],
            }
        )
    return out
