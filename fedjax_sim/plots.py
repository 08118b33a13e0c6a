"""PNG plots of runs and sweeps (matplotlib, headless).

The plots know no metric or setting names: callers say which columns to draw
and how to label them.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure


def _figure(panels: int, width: float, height: float):
    # A bare Figure (Agg canvas) leaves pyplot's global backend alone, so
    # importing fedjax_sim does not break inline plots in a notebook.
    fig = Figure(figsize=(width * panels, height))
    return fig, fig.subplots(1, panels, squeeze=False)


def _float(value) -> float:
    """`value` as a float; NaN for what is not a number (a CSV's empty cell)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return np.nan


def _sort_key(value):
    # Numbers in numeric order, then anything else by its text.
    number = _float(value)
    return (0, number, "") if np.isfinite(number) else (1, 0.0, str(value))


def _text(value) -> str:
    return f"{value:g}" if isinstance(value, (int, float, np.number)) else str(value)


def _all_positive(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return finite.size > 0 and bool(np.all(finite > 0))


def plot_history(
    rows: list[dict],
    path,
    panels: list[tuple[str, str]],
    *,
    title: str = "",
    hlines: dict[str, tuple[float, str]] | None = None,
    log_y: set[str] | None = None,
    groups: dict[str, list[dict]] | None = None,
) -> Path | None:
    """Metrics against rounds, a panel per metric.

    Args:
      rows: history rows, each with a "round" and some metrics.
      path: the PNG to write.
      panels: (metric, panel title) pairs; a metric no row holds gets no panel.
      title: the figure's title.
      hlines: metric -> (y, legend label): a dashed horizontal line on that panel.
      log_y: metrics drawn on a log y axis, when all their finite values are > 0.
      groups: name -> history rows (a compared method, say): a line per group on
        every panel, with a legend; `rows` is then not drawn.

    Returns:
      `path`, or None (nothing written) when no row holds any of the metrics.
    """
    series = groups if groups is not None else {"": rows}
    hlines = hlines or {}
    log_y = log_y or set()
    shown = [
        (name, label) for name, label in panels
        if any(name in row for group_rows in series.values() for row in group_rows)
    ]
    if not shown:
        return None
    fig, axes = _figure(len(shown), 4.2, 3.4)
    for ax, (name, label) in zip(axes[0], shown, strict=True):
        drawn = []
        for group, group_rows in series.items():
            held = [row for row in group_rows if name in row]
            rounds = np.array([_float(row["round"]) for row in held])
            values = np.array([_float(row[name]) for row in held])
            ax.plot(rounds, values, marker=".", label=group or None)
            drawn.append(values)
        log = name in log_y and _all_positive(np.concatenate(drawn))
        if log:
            ax.set_yscale("log")
        if name in hlines:
            y, line_label = hlines[name]
            if np.isfinite(y) and (y > 0 or not log):
                ax.axhline(y, color="gray", ls="--", label=line_label)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.set_xlabel("round")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_curves(
    rows: list[dict],
    path,
    *,
    x: str,
    y: str,
    group: str,
    panels: list[str] | tuple = (),
    ci: tuple[str, str] | None = None,
    log_x: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    ylim: tuple[float, float] | None = None,
) -> Path | None:
    """`y` against `x`, a curve per value of `group`, a panel per combination of `panels`.

    Args:
      rows: summary rows, one point each (a sweep cell, say).
      path: the PNG to write.
      x, y: the columns on the axes.
      group: the column whose values (sorted) get a curve each.
      panels: the columns whose combinations of values (sorted) get a panel each.
      ci: (low column, high column): an interval around `y`, drawn as error bars.
      log_x: a log x axis, when every x is > 0 (otherwise linear).
      xlabel, ylabel: axis labels; default the column names.
      ylim: the y axis's limits.

    Returns:
      `path`, or None (nothing written) when `x` takes fewer than 2 values.
    """
    if len({row[x] for row in rows}) < 2:
        return None
    panels = list(panels)
    curves = defaultdict(lambda: defaultdict(list))
    for row in rows:
        low, high = (row[ci[0]], row[ci[1]]) if ci else (np.nan, np.nan)
        point = tuple(_float(v) for v in (row[x], row[y], low, high))
        curves[tuple(row[p] for p in panels)][row[group]].append(point)
    log = log_x and bool(np.all(np.array([_float(row[x]) for row in rows]) > 0))
    fig, axes = _figure(len(curves), 4.4, 3.6)
    ordered = sorted(curves.items(), key=lambda item: [_sort_key(v) for v in item[0]])
    for ax, (panel_values, panel_curves) in zip(axes[0], ordered, strict=True):
        for value in sorted(panel_curves, key=_sort_key):
            xs, ys, lows, highs = np.array(sorted(panel_curves[value])).T
            label = f"{group}={_text(value)}"
            if ci:
                below = np.maximum(ys - lows, 0)
                above = np.maximum(highs - ys, 0)
                ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=label)
            else:
                ax.plot(xs, ys, marker="o", label=label)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel or x)
        ax.set_ylabel(ylabel or y)
        if ylim is not None:
            ax.set_ylim(*ylim)
        if panels:
            ax.set_title(
                ", ".join(f"{p}={_text(v)}" for p, v in zip(panels, panel_values, strict=True)),
                fontsize=9,
            )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
