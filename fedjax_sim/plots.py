"""PNG plots of runs and sweeps (matplotlib, headless)."""

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


def plot_run(rows: list[dict], path, title: str = "", threshold: float | None = None) -> None:
    """Loss, cluster-identity accuracy and min_dist against rounds, one panel each."""
    panels = [
        (name, label)
        for name, label in (
            ("train_loss", "train loss (avg client)"),
            ("test_loss", "test loss (avg client)"),
            ("cluster_accuracy", "cluster-identity accuracy"),
            ("min_dist", "min_dist to θ*"),
        )
        if any(name in r for r in rows)
    ]
    rounds = np.array([r["round"] for r in rows])
    fig, axes = _figure(len(panels), 4.2, 3.4)
    for ax, (name, label) in zip(axes[0], panels, strict=True):
        values = np.array([r.get(name, np.nan) for r in rows], dtype=float)
        ax.plot(rounds, values, marker=".")
        if name.endswith("loss") or name == "min_dist":
            if np.all(values[np.isfinite(values)] > 0):
                ax.set_yscale("log")
        if name == "min_dist" and threshold is not None and threshold > 0:
            ax.axhline(threshold, color="gray", ls="--", label="success threshold")
            ax.legend()
        ax.set_xlabel("round")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _curves(summary, x, group, fixed):
    """{fixed values: {group value: [(x, p)]}} from summary rows."""
    out = defaultdict(lambda: defaultdict(list))
    for row in summary:
        out[tuple(row[f] for f in fixed)][row[group]].append((row[x], row["success_prob"]))
    return out


def plot_success(summary: list[dict], out_dir) -> list[Path]:
    """Success probability vs R (a curve per σ) and vs m (a curve per n).

    One figure per varying axis that has more than one value; a panel per
    combination of the other settings.
    """
    out_dir = Path(out_dir)
    written = []
    for x, group, name in (("R", "sigma", "success_vs_R.png"), ("m", "n", "success_vs_m.png")):
        if len({row[x] for row in summary}) < 2:
            continue
        fixed = [f for f in ("k", "m", "n", "d", "sigma", "R") if f not in (x, group)]
        panels = _curves(summary, x, group, fixed)
        fig, axes = _figure(len(panels), 4.4, 3.6)
        for ax, (fixed_values, curves) in zip(axes[0], sorted(panels.items()), strict=True):
            for value, points in sorted(curves.items()):
                points.sort()
                ax.plot(*zip(*points, strict=True), marker="o", label=f"{group}={value:g}")
            ax.set_xlabel(x)
            ax.set_ylabel("success probability")
            ax.set_ylim(-0.03, 1.03)
            ax.set_title(", ".join(f"{f}={v:g}" for f, v in zip(fixed, fixed_values, strict=True)),
                         fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        written.append(out_dir / name)
    return written
