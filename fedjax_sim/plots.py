"""PNG plots of runs, comparisons and sweeps (matplotlib, headless).

The plots know no metric or setting names: callers say which columns to draw
and how to label them. Every axis is labelled; a method keeps one colour
(`method_colors`) and one label in every plot of a run; a comparison draws
each method's seed mean with a band (`seed_bands`: the 95 % t interval of the
mean, or ± one standard error, named in the legend) and returns the numbers
it drew, so a test can check them against the CSV; points that share an x are
offset so no error bar hides another; a point with no value (a target never
reached) is drawn as a marker at the top of the axis, never dropped.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.transforms import blended_transform_factory
from scipy import stats as scipy_stats

from fedjax_sim.io import read_csv

#: The bands `seed_bands` can draw, with their legend wording.
INTERVALS = {
    "t95": "95% CI of the mean (t)",
    "se": "±1 standard error",
}
#: Where a missing point (a target not reached) is drawn: this fraction up the axis.
_TOP = 0.96


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


def _log_scale(values: np.ndarray, forced: bool, auto: bool, decades: float = 2.0) -> bool:
    """A log axis: `forced` (a metric the caller lists) when some value is > 0; `auto`
    when every finite value is > 0 and they span more than `decades` decades."""
    finite = np.asarray(values, np.float64)
    finite = finite[np.isfinite(finite)]
    if forced:
        return bool((finite > 0).any())
    if not auto or finite.size == 0 or not (finite > 0).all():
        return False
    return bool(np.log10(finite.max() / finite.min()) > decades)


def method_colors(methods: Iterable) -> dict:
    """One colour per method, by its place in `methods` (duplicates ignored).

    Pass every plot of a run the same list (an experiment's `methods`) and a
    method has the same colour in all of them, also in plots that show only
    some methods. tab10's colours, then tab20's, then repeated.
    """
    from matplotlib import colormaps

    palette = list(colormaps["tab10"].colors) + [
        c for i, c in enumerate(colormaps["tab20"].colors) if i % 2]
    ordered = list(dict.fromkeys(methods))
    return {m: palette[i % len(palette)] for i, m in enumerate(ordered)}


def seed_interval(values, interval: str = "t95") -> tuple[float, float, float, int]:
    """(mean, low, high, n) of the finite `values` (one per seed).

    interval: "t95", the 95 % confidence interval of the mean from Student's t
      with n − 1 degrees of freedom (mean ± t₀.₉₇₅ · s / √n, s with ddof 1), or
      "se", mean ± s / √n. low and high are NaN when n < 2; everything is NaN
      when n = 0.
    """
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {sorted(INTERVALS)}; got {interval!r}.")
    v = np.asarray([_float(x) for x in np.ravel(np.asarray(values, object))], np.float64)
    v = v[np.isfinite(v)]
    n = int(v.size)
    if n == 0:
        return np.nan, np.nan, np.nan, 0
    mean = float(v.mean())
    if n < 2:
        return mean, np.nan, np.nan, n
    half = float(v.std(ddof=1) / np.sqrt(n))
    if interval == "t95":
        half *= float(scipy_stats.t.ppf(0.975, n - 1))
    return mean, mean - half, mean + half, n


def seed_bands(
    rows: list[dict],
    metrics: Iterable[str],
    *,
    interval: str = "t95",
    x: str = "round",
    group: str = "method",
    by: str | None = None,
) -> dict:
    """Per metric and method: the seed mean and its band at each x.

    Args:
      rows: per-seed history rows {group, "seed", x, metric...} (per_seed_metrics.csv,
        as read or as written); a missing or empty cell, NaN or inf is a seed
        without a value there (a diverged seed) and is left out of that x.
      metrics: the columns to summarise; a metric no row of a method holds
        gives that method no entry.
      interval: see `seed_interval`.
      x: the column of the x axis.
      group: the column naming the method.
      by: the column whose values pool the seeds (None: `x` itself). With another
        column (x = "virtual_time", by = "round": each seed reaches a round at its
        own time), a point pools the seeds' rows of one `by` value and sits at
        the seed mean of their finite x; a row without a finite x is left out.

    Returns:
      {metric: {method: {"round": [x...], "mean": [...], "lo": [...], "hi": [...],
      "n": [seeds with a value...]}}}, x sorted, methods in order of first
      appearance (the key "round" holds the x values whatever `x` is).
    """
    by_method: dict = {}
    for row in rows:
        by_method.setdefault(row.get(group, ""), []).append(row)
    out: dict = {}
    for metric in metrics:
        per_metric = {}
        for method, method_rows in by_method.items():
            at: dict = defaultdict(list)
            where: dict = defaultdict(list)  # the x of each pooled row
            for row in method_rows:
                if metric not in row:
                    continue
                if by is None:
                    at[_float(row[x])].append(row[metric])
                elif np.isfinite(_float(row.get(x))):
                    at[_float(row[by])].append(row[metric])
                    where[_float(row[by])].append(_float(row[x]))
            if not at:
                continue
            pools = sorted(at)
            xs = pools if by is None else [float(np.mean(where[p])) for p in pools]
            order = range(len(xs)) if by is None else np.argsort(xs, kind="stable")
            stats = [seed_interval(at[pools[i]], interval) for i in order]
            per_metric[method] = {
                "round": [xs[i] for i in order], "mean": [s[0] for s in stats],
                "lo": [s[1] for s in stats], "hi": [s[2] for s in stats],
                "n": [s[3] for s in stats]}
        if per_metric:
            out[metric] = per_metric
    return out


def per_seed_rows(out_dir, histories: dict | None = None,
                  name: str = "per_seed_metrics.csv") -> list[dict]:
    """The per-seed history rows of a comparison in `out_dir`, for `plot_comparison`.

    Reads `out_dir/name` when it exists; otherwise flattens `histories`
    ({method: rows of seed means}) into rows of one "seed" each (then no band
    can be drawn: one value per round).
    """
    path = Path(out_dir) / name
    if path.exists():
        return read_csv(path)
    return [{"method": m, "seed": 0, **row} for m, rows in (histories or {}).items()
            for row in rows]


def plot_comparison(
    rows: list[dict],
    path,
    panels: list[tuple[str, str]],
    *,
    title: str = "",
    interval: str = "t95",
    methods: Iterable | None = None,
    colors: dict | None = None,
    labels: dict | None = None,
    log_y: Iterable[str] = (),
    auto_log: bool = True,
    hlines: dict[str, tuple[float, str]] | None = None,
    x: str = "round",
    xlabel: str = "round",
    by: str | None = None,
) -> dict:
    """Methods' seed means with bands against rounds (or another x), a panel per metric.

    Args:
      rows: per-seed history rows {"method", "seed", "round", metric...}
        (per_seed_metrics.csv; see `per_seed_rows`).
      path: the PNG to write.
      panels: (metric, y-axis label) pairs; a metric no row holds gets no panel.
      title: the figure's title.
      interval: the band: "t95" or "se" (`seed_interval`); the legend names it.
      methods: the methods to draw, in legend order; default every method of
        `rows` in order of first appearance.
      colors: method -> colour; default `method_colors(methods)` (before
        dropping those without rows), so passing every method of the run keeps
        each method's colour across plots.
      labels: method -> legend label; default the method's name.
      log_y: metrics drawn on a log y axis (when some mean is > 0).
      auto_log: also a log y axis for any metric whose finite means are all
        > 0 and span more than two decades.
      hlines: metric -> (y, legend label): a dashed horizontal line on that panel.
      x, xlabel: the x column and its axis label.
      by: the column pooling the seeds when each seed has its own x (`seed_bands`):
        `x="virtual_time", by="round"` draws each round's band at the seeds' mean
        virtual time.

    Returns:
      the numbers handed to matplotlib: `seed_bands(...)` restricted to the
      drawn panels and methods ({metric: {method: {"round", "mean", "lo",
      "hi", "n"}}}); {} (nothing written) when no row holds any panel's metric.
    """
    if interval not in INTERVALS:
        raise ValueError(f"interval must be one of {sorted(INTERVALS)}; got {interval!r}.")
    present = list(dict.fromkeys(row.get("method", "") for row in rows))
    colors = colors or method_colors(present if methods is None else methods)
    methods = present if methods is None else [m for m in methods if m in present]
    wanted = [row for row in rows if row.get("method", "") in methods]
    bands = seed_bands(wanted, [name for name, _ in panels], interval=interval, x=x, by=by)
    shown = [(name, label) for name, label in panels if name in bands]
    if not shown:
        return {}
    labels = labels or {}
    log_y, hlines = set(log_y), hlines or {}
    fig, axes = _figure(len(shown), 4.4, 3.5)
    drawn: dict = {}
    for ax, (name, label) in zip(axes[0], shown, strict=True):
        drawn[name] = {}
        for method in methods:
            band = bands[name].get(method)
            if band is None:
                continue
            drawn[name][method] = band
            color = colors.get(method)
            text = str(labels.get(method, method))
            means = np.asarray(band["mean"], np.float64)
            if not np.isfinite(means).any():  # kept in the legend, never silently gone
                ax.plot([], [], color=color, ls=":", label=f"{text} (no finite value)")
                continue
            ax.plot(band["round"], means, color=color, marker="." if len(means) < 30 else None,
                    label=text)
            ax.fill_between(band["round"], band["lo"], band["hi"], color=color, alpha=0.2,
                            linewidth=0)
        means = np.concatenate([np.asarray(b["mean"], np.float64)
                                for b in drawn[name].values()])
        log = _log_scale(means, name in log_y, auto_log)
        if log:
            ax.set_yscale("log")
        if name in hlines:
            y, line_label = hlines[name]
            if np.isfinite(y) and (y > 0 or not log):
                ax.axhline(y, color="gray", ls="--", label=line_label)
        ax.legend(fontsize=7, title=f"seed mean; band: {INTERVALS[interval]}",
                  title_fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return drawn


def dodge(xs: np.ndarray, index: int, count: int, *, log: bool = False,
          width: float = 0.3) -> np.ndarray:
    """`xs` shifted for series `index` of `count` that share x values, so none hides another.

    The series spread over `width` of the smallest gap between distinct x
    values (in log10 units on a log axis; 5 % of |x| when there is one x),
    centred on the true x.
    """
    xs = np.asarray(xs, np.float64)
    if count < 2 or xs.size == 0:
        return xs
    at = np.log10(xs) if log else xs
    distinct = np.unique(at[np.isfinite(at)])
    if distinct.size > 1:
        gap = float(np.diff(distinct).min())
    elif log:  # one x: spread over a tenth of a decade
        gap = 0.1 / width
    else:  # one x: spread over a fifth of |x| (or of 1)
        gap = 0.2 * max(abs(float(distinct[0])) if distinct.size else 1.0, 1.0) / width
    shift = (index - (count - 1) / 2) * width * gap / (count - 1)
    return 10 ** (at + shift) if log else at + shift


def plot_history(
    rows: list[dict],
    path,
    panels: list[tuple[str, str]],
    *,
    title: str = "",
    hlines: dict[str, tuple[float, str]] | None = None,
    log_y: set[str] | None = None,
    groups: dict[str, list[dict]] | None = None,
    colors: dict | None = None,
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
      colors: group name -> colour (see `method_colors`); default matplotlib's cycle.

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
    colors = colors or {}
    fig, axes = _figure(len(shown), 4.2, 3.4)
    for ax, (name, label) in zip(axes[0], shown, strict=True):
        drawn = []
        for group, group_rows in series.items():
            held = [row for row in group_rows if name in row]
            rounds = np.array([_float(row["round"]) for row in held])
            values = np.array([_float(row[name]) for row in held])
            ax.plot(rounds, values, marker=".", label=group or None, color=colors.get(group))
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
        ax.set_ylabel(label)
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
    log_y: bool = False,
    xlabel: str | None = None,
    ylabel: str | None = None,
    ylim: tuple[float, float] | None = None,
    colors: dict | None = None,
    missing: str | None = None,
    offset: bool = True,
    label_format: str = "{group}={value}",
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
      log_y: a log y axis, when some y is > 0.
      xlabel, ylabel: axis labels; default the column names.
      ylim: the y axis's limits.
      colors: group value -> colour (`method_colors`); default one per group
        value in sorted order, the same in every panel.
      missing: a point whose y is missing (None, empty, NaN: a target never
        reached) is drawn as a hollow marker at the top of its panel, and the
        legend says `missing` (e.g. "not reached"); None: such points are not
        drawn (a group with no y at all still gets its legend entry).
      offset: with error bars or `missing` markers and several curves, each
        curve's x values are shifted a little (`dodge`) so no point hides
        another; the tick positions stay the true x.
      label_format: a curve's legend label, from `group` and the group's value
        ("{value}" for method names).

    Returns:
      `path`, or None (nothing written) when `x` takes fewer than 2 values.
    """
    if len({row[x] for row in rows}) < 2:
        return None
    panels = list(panels)
    curves = defaultdict(lambda: defaultdict(list))
    for row in rows:
        low, high = (row.get(ci[0]), row.get(ci[1])) if ci else (np.nan, np.nan)
        point = tuple(_float(v) for v in (row[x], row.get(y), low, high))
        curves[tuple(row[p] for p in panels)][row[group]].append(point)
    log = log_x and bool(np.all(np.array([_float(row[x]) for row in rows]) > 0))
    all_y = np.array([_float(row.get(y)) for row in rows])
    log_y = log_y and bool((all_y[np.isfinite(all_y)] > 0).any())
    values = sorted({row[group] for row in rows}, key=_sort_key)
    colors = colors or method_colors(values)
    fig, axes = _figure(len(curves), 4.4, 3.6)
    ordered = sorted(curves.items(), key=lambda item: [_sort_key(v) for v in item[0]])
    for ax, (panel_values, panel_curves) in zip(axes[0], ordered, strict=True):
        top = blended_transform_factory(ax.transData, ax.transAxes)
        names = sorted(panel_curves, key=_sort_key)
        shift = offset and len(names) > 1 and (ci is not None or missing is not None)
        any_missing = False
        for index, value in enumerate(names):
            xs, ys, lows, highs = np.array(sorted(panel_curves[value])).T
            if shift:
                xs = dodge(xs, index, len(names), log=log)
            label = label_format.format(group=group, value=_text(value))
            color = colors.get(value)
            if ci:
                below = np.maximum(ys - lows, 0)
                above = np.maximum(highs - ys, 0)
                ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=label,
                            color=color)
            else:
                ax.plot(xs, ys, marker="o", label=label, color=color)
            gone = ~np.isfinite(ys)
            if missing is not None and gone.any():
                any_missing = True
                ax.plot(xs[gone], np.full(gone.sum(), _TOP), transform=top, ls="none",
                        marker="^", markersize=7, markerfacecolor="none", color=color,
                        clip_on=False)
        if log:
            ax.set_xscale("log")
        if log_y:
            ax.set_yscale("log")
        if any_missing:
            ax.plot([], [], ls="none", marker="^", markerfacecolor="none", color="gray",
                    label=f"{missing} (marker at top)")
            if ylim is None:  # headroom: the markers' row above every drawn value
                low, high = ax.get_ylim()
                if log_y:
                    ax.set_ylim(low, high * (high / low) ** 0.15)
                else:
                    ax.set_ylim(low, high + 0.15 * (high - low))
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
