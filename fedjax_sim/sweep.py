"""The host loop of a sweep: cells × data seeds, in compiled chunks, rows appended as they finish.

Inside a chunk every data seed, restart and learning rate is an array axis of
one compiled function (see experiments/ifca_synthetic.py); this loop only walks
the cells and the chunks, appends each finished chunk's rows to trials.csv
(fsynced), and skips (cell, seed) pairs already there, so a killed sweep
resumes without losing or duplicating a row.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from fedjax_sim.io import append_csv, read_csv, write_csv

SUMMARY_COLUMNS = ["k", "m", "n", "d", "sigma", "R", "seeds", "success_prob"]


def expand_cells(settings: dict, axes: Sequence[str]) -> list[dict]:
    """One dict per point of the product of the list-valued `axes`."""
    lists = [settings[a] if isinstance(settings[a], list) else [settings[a]] for a in axes]
    cells = []
    for values in itertools.product(*lists):
        cell = dict(settings)
        cell.update(zip(axes, values, strict=True))
        cells.append(cell)
    return cells


def _key(row: dict, axes: Sequence[str]) -> tuple:
    return tuple(float(row[a]) for a in axes)


def run_sweep(
    cells: list[dict],
    trial_rows: Callable[[dict, list[int]], list[dict]],
    chunk_size: Callable[[dict], int],
    out_dir,
    *,
    axes: Sequence[str],
    trial_columns: list[str],
    progress: bool = True,
    write: bool = True,
) -> list[dict]:
    """Runs every cell over data seeds 0..seeds−1; returns the summary rows.

    Args:
      cells: settings of each cell (validated by the caller before any write).
      trial_rows: (cell, data seed ids) -> one trials.csv row per seed.
      chunk_size: cell -> how many seeds go into one compiled call.
      out_dir: directory of trials.csv / summary.csv.
      axes: the settings that identify a cell in trials.csv.
      trial_columns: trials.csv columns.
      write: append to trials.csv (False on every process but the first of a
        multi-process run, which then keeps its rows in memory).
    """
    out_dir = Path(out_dir)
    trials_path = out_dir / "trials.csv"
    existing = read_csv(trials_path)
    done = {(_key(r, axes), int(r["data_seed"])) for r in existing}
    kept: list[dict] = []
    total = sum(c["seeds"] for c in cells)
    with tqdm(total=total, disable=not progress, desc="trials", unit="seed") as bar:
        bar.update(sum(1 for c in cells for s in range(c["seeds"]) if (_key(c, axes), s) in done))
        for cell in cells:
            todo = [s for s in range(cell["seeds"]) if (_key(cell, axes), s) not in done]
            size = chunk_size(cell)
            for start in range(0, len(todo), size):
                seeds = todo[start : start + size]
                rows = trial_rows(cell, seeds)
                if write:
                    append_csv(trials_path, rows, trial_columns)
                else:
                    kept.extend(rows)
                bar.update(len(seeds))
                bar.set_postfix({a: cell[a] for a in axes if isinstance(cell[a], (int, float))})
    rows = read_csv(trials_path) if write else existing + kept
    return summarize(rows, cells, axes)


def summarize(trials: list[dict], cells: list[dict], axes: Sequence[str]) -> list[dict]:
    """One row per cell: success probability over its data seeds."""
    by_cell: dict[tuple, list[dict]] = {}
    for row in trials:
        by_cell.setdefault(_key(row, axes), []).append(row)
    summary = []
    for cell in cells:
        rows = [r for r in by_cell.get(_key(cell, axes), []) if int(r["data_seed"]) < cell["seeds"]]
        success = np.array([int(r["success"]) for r in rows])
        summary.append({
            **{a: cell[a] for a in axes},
            "seeds": len(rows),
            "success_prob": float(success.mean()) if len(rows) else float("nan"),
            "all_diverged_seeds": sum(int(r.get("all_diverged", 0) or 0) for r in rows),
            "median_best_min_dist": float(np.nanmedian([float(r["best_min_dist"]) for r in rows]))
            if rows and not all(np.isnan(float(r["best_min_dist"])) for r in rows)
            else float("nan"),
        })
    return summary


def write_summary(summary: list[dict], out_dir) -> None:
    columns = SUMMARY_COLUMNS + [c for c in summary[0] if c not in SUMMARY_COLUMNS]
    write_csv(Path(out_dir) / "summary.csv", summary, columns)
