"""Mixed FL on two linear regressions whose optima differ by `gap` (`mixed-synthetic`).

A sweep over `gap` plots rounds-to-target per method against mean G̃.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import plots
from fedjax_sim.data import FederatedData, ServerData
from fedjax_sim.experiments.base import DATA, Preset, Sweep, stream_key
from fedjax_sim.experiments.mixed.base import (
    LABELS,
    METHODS,
    MIXED,
    Task,
    mixed_task,
    rounds_to_target,
    run_methods,
    shared_settings,
)
from fedjax_sim.experiments.settings import Setting, count
from fedjax_sim.models import linear_regression


def mixed_linear(key, *, m: int, n: int, n_c: int, d: int, gap, sigma, spread):
    """Two linear-regression objectives whose optima differ by `gap`.

    The federated clients (homogeneous, Assumption 4.1) hold y = xᵀθ_f + ε,
    the datacenter y = xᵀθ_c + ε with θ_c = θ_f + gap·u, u a random unit
    vector; θ_f ~ N(0, I). The two feature distributions have different
    covariances (coordinate j has std spread^(t_j) for the clients and
    spread^(−t_j) in the datacenter, t_j evenly spaced in [−½, ½]): with
    equal Hessians PT would be exact on quadratics whatever the gap, so
    `spread` > 1 is what lets the gap show as client/server drift.

    Returns:
      (FederatedData [m, n, d], ServerData {"x": [n_c, d], "y": [n_c]}).
    """
    ks = jax.random.split(key, 6)
    theta_f = jax.random.normal(ks[0], (d,))
    u = jax.random.normal(ks[1], (d,))
    theta_c = theta_f + gap * u / jnp.linalg.norm(u)
    std_f = jnp.asarray(spread, jnp.float32) ** jnp.linspace(-0.5, 0.5, d)
    std_c = std_f[::-1]
    x_f = jax.random.normal(ks[2], (m, n, d)) * std_f
    x_c = jax.random.normal(ks[3], (n_c, d)) * std_c
    y_f = x_f @ theta_f + sigma * jax.random.normal(ks[4], (m, n))
    y_c = x_c @ theta_c + sigma * jax.random.normal(ks[5], (n_c,))
    data = FederatedData(x_f, y_f, jnp.full((m,), n, jnp.int32), jnp.full((m,), -1, jnp.int32))
    return data, ServerData({"x": x_c, "y": y_c})


def _linear_optimum(data: FederatedData, server: ServerData, w_f: float, w_c: float):
    """f*, the minimum of the exact mixed loss (uniform over clients), per seed (float64)."""
    x_f, y_f = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    x_c, y_c = np.asarray(server.arrays["x"], np.float64), np.asarray(server.arrays["y"],
                                                                        np.float64)
    out = []
    for i in range(x_f.shape[0]):
        m, n, _ = x_f[i].shape
        a = w_f * np.einsum("mnd,mne->de", x_f[i], x_f[i]) / (m * n) + w_c * x_c[i].T @ x_c[
            i] / len(y_c[i])
        b = w_f * np.einsum("mnd,mn->d", x_f[i], y_f[i]) / (m * n) + w_c * x_c[i].T @ y_c[
            i] / len(y_c[i])
        theta = np.linalg.solve(a, b)
        out.append(w_f * np.mean((x_f[i] @ theta - y_f[i]) ** 2)
                   + w_c * np.mean((x_c[i] @ theta - y_c[i]) ** 2))
    return np.asarray(out)


def seed_data(s: dict, seed_ids: list[int]):
    """Each seed's clients and datacenter (from its DATA stream) and its f*."""
    base = stream_key(s["seed"], DATA)
    keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray(seed_ids))
    sizes = {k: s[k] for k in ("m", "n", "n_c", "d")}
    data, server = jax.jit(jax.vmap(lambda k: mixed_linear(
        k, **sizes, gap=s["gap"], sigma=s["sigma"], spread=s["spread"])))(keys)
    f_star = jnp.asarray(_linear_optimum(data, server, s["w_f"], s["w_c"]), jnp.float32)
    return (data, server, f_star), {"num_params": float(s["d"])}


def functions(s: dict):
    """The linear model; its losses are both the per-round objective and the evaluation."""
    w_f, w_c = s["w_f"], s["w_c"]

    def losses(params, inputs):
        data, server, f_star = inputs
        fed = jnp.mean(jnp.square(data.x @ params - data.y))  # every client holds n rows
        cen = jnp.mean(jnp.square(server.arrays["x"] @ params - server.arrays["y"]))
        mixed = w_f * fed + w_c * cen
        return {"excess_loss": mixed - f_star, "mixed_loss": mixed, "federated_loss": fed,
                "central_loss": cen}

    return linear_regression(s["d"]), losses, losses, None


def finals(s, name, rows, per_round, info):
    return {"rounds_to_target": rounds_to_target(per_round["excess_loss"], s["target"])}


def notes(s, info):
    return {
        "task": "federated clients share θ_f* (homogeneous), the datacenter holds θ_c* = "
                f"θ_f* + gap·u (gap={s['gap']}); feature scales differ (spread="
                f"{s['spread']}) so the two Hessians differ; squared loss without ½",
        "rounds_to_target": f"first round whose model has mixed loss − f* <= {s['target']} "
                            "(f* solved exactly per seed); NaN: not reached in "
                            f"{s['rounds']} rounds",
    }


TASK = Task(
    num_clients=lambda s: s["m"],
    seed_data=seed_data,
    functions=functions,
    table_metrics=("excess_loss", "rounds_to_target", "mixed_loss", "federated_loss",
                   "central_loss", "G_tilde_mean", "G_tilde_median", "B_tilde_mean",
                   "B_tilde_median", "floats_down", "floats_up"),
    finals=finals,
    notes=notes,
)


# ---- sweep over gap (or any setting): rounds-to-target per method vs mean G̃
_PER_METHOD = ("rounds_to_target", "excess_loss", "G_tilde_mean")


def trial_columns(axes: list[str], s: dict | None = None) -> list[str]:
    per_method = [f"{metric}_{m}" for m in METHODS for metric in _PER_METHOD]
    return [*axes, "cell_id", "data_seed", "G_tilde_mean", "B_tilde_median", *per_method]


def trials(cell: dict, seed_ids: list[int], mesh=None) -> list[dict]:
    """One row per data seed: rounds-to-target, final excess and mean G̃ of every method.

    The cell's G_tilde_mean is the mean over the mixed methods (PT, 1-GT,
    2-GT) of their per-round G̃ averaged over rounds.
    """
    del mesh
    SYNTHETIC.validate(cell)
    per_seed, _, _, _ = run_methods(SYNTHETIC, cell, list(seed_ids))
    rows = []
    for j, seed_id in enumerate(seed_ids):
        row = {"data_seed": int(seed_id)}
        for m in METHODS:
            for metric in _PER_METHOD:
                row[f"{metric}_{m}"] = float(per_seed[m][metric][j])
        row["G_tilde_mean"] = float(np.mean([per_seed[m]["G_tilde_mean"][j] for m in MIXED]))
        row["B_tilde_median"] = float(np.mean([per_seed[m]["B_tilde_median"][j]
                                               for m in MIXED]))
        rows.append({"cell_id": cell.get("cell_id"), **row})
    return rows


def summarize_cells(trials: list[dict], cells: list[dict], axes: list[str]) -> list[dict]:
    by_cell: dict = {}
    for row in trials:
        by_cell.setdefault(row["cell_id"], []).append(row)
    summary = []
    for cell in cells:
        rows = [r for r in by_cell.get(cell["cell_id"], [])
                if int(r["data_seed"]) < cell["seeds"]]
        out = {**{a: cell[a] for a in axes}, "seeds": len(rows)}
        for column in trial_columns([])[2:]:
            values = np.array([_float(r.get(column)) for r in rows])
            finite = values[np.isfinite(values)]
            out[f"{column}"] = float(finite.mean()) if finite.size else None
            if column.startswith("rounds_to_target"):
                out[f"{column}_reached"] = int(finite.size)
        summary.append(out)
    return summary


def plot_sweep(summary: list[dict], out_dir) -> list:
    points = [{"G_tilde_mean": row["G_tilde_mean"], "method": LABELS[m],
               "rounds_to_target": row.get(f"rounds_to_target_{m}")}
              for row in summary for m in METHODS
              if row.get("G_tilde_mean") is not None]
    colors = {LABELS[m]: c for m, c in plots.method_colors(METHODS).items()}
    path = plots.plot_curves(points, out_dir / "rounds_to_target_vs_G.png",
                             x="G_tilde_mean", y="rounds_to_target", group="method",
                             log_x=True, missing="not reached", colors=colors,
                             label_format="{value}", xlabel="mean G̃ (PT, 1-GT, 2-GT)",
                             ylabel="rounds to target (mean over seeds that reached it)")
    return [path] if path is not None else []


def _float(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


SYNTHETIC = mixed_task(
    TASK,
    name="mixed_synthetic",
    description=("Mixed FL on two linear regressions whose optima differ by `gap`: FL only, "
                 "PT, 1-GT, 2-GT and the oracle."),
    settings=(
        Setting("gap", float, 2.0, "‖θ_c* − θ_f*‖, the distance between the two optima",
                minimum=0.0),
        count("m", 20, "federated clients"),
        count("n", 20, "examples per client"),
        count("n_c", 200, "datacenter examples"),
        count("d", 10, "dimension", maximum=10**5),
        Setting("sigma", float, 0.1, "label noise std", minimum=0.0),
        Setting("spread", float, 4.0, "feature-scale ratio across coordinates; the clients' "
                "and datacenter's are reversed (1: equal Hessians)", minimum=1.0),
        Setting("target", float, 1e-3, "rounds-to-target: first round with mixed loss − f* <= "
                "this", minimum=0.0),
        *shared_settings(rounds=150, lr=0.02, local_steps=5, eval_every=5),
    ),
    panels=(("excess_loss", "mixed loss − f*"), ("federated_loss", "federated loss f_f"),
            ("central_loss", "centralized loss f_c"), ("G_tilde", "G̃_t")),
    log_metrics=("excess_loss", "G_tilde"),
    sweep=Sweep(
        trials=trials,
        columns=trial_columns,
        summarize=summarize_cells,
        seeds_per_chunk=lambda cell: cell["seeds"],
        cell_cost=lambda cell: (cell["m"] * cell["n"] * cell["d"] * cell["rounds"]
                                * cell["local_steps"]),
        plot=plot_sweep,
    ),
)

PRESET = Preset("mixed-synthetic", SYNTHETIC,
                "Mixed FL, two linear objectives with optima `gap` apart: FL only, PT, 1-GT, 2-GT, "
                "oracle (compare; sweep gap=0,1,2,4 for rounds-to-target vs mean G̃).")
