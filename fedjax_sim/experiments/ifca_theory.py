"""IFCA's theory measured on the mixture of linear regressions (docs/protocols.md#ifca-theory).

Ghosh et al. (NeurIPS 2020) prove, for Gaussian features and noise, that from an
initialisation close enough to θ* (for k = 2 only slightly better than random) IFCA's
parameter error contracts at a linear rate down to a statistical floor near the minimax
σ√(d/N) (N examples per cluster). The analysis uses sample splitting: each client's n
rows are cut into 2T disjoint parts of n' = ⌊n/2T⌋ rows, and iteration t takes part 2t
for the cluster assignment and part 2t + 1 for the gradient step. One `run` measures the
three claims, each data variant of `VARIANTS` beside the others:

    fixed         every iteration assigns and steps on the client's same n rows (practice)
    split         the paper's sample splitting of the same fixed n rows:
                    ĵ_i ← argmin_j F_i(θ_j; Z_i^(2t)),  θ ← IFCA step on Z_i^(2t+1)
                  (no row is read twice in a run; the n mod 2T rows left over are unused)
    fresh_stream  n new rows per client at every iteration (T·n rows in all: a data
                  stream, not splitting; `GeneratedClients` with the iteration folded in)

(a) the error ‖θ_t − θ*‖ (`matched_error`) per iteration from θ_j⁰ = θ*_j + δ·u_j·Δ_j
    (u_j a random unit direction, Δ_j the distance of θ*_j to the nearest other θ*),
    for each δ of `deltas` and each variant, with the fitted linear-phase rate beside
    the population contraction (option I: 1 − 2γ/k);
(b) the final error against N = m·n/k over `n_grid`, with the fitted log-log slope beside
    the minimax −½;
(c) for k = 2, the probability (over `success_seeds` data seeds) that the final error on
    fixed data is below `threshold`, against δ over `success_deltas`, beside the official
    random init.

Seeds and δ are vmapped, and the iterations are one `lax.scan` (the split variant indexes
the fixed [m, n] rows by the iteration's part inside it); n changes the data's shapes, so
(b) compiles once per n (and variant): no padding.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms import ifca, sgd
from fedjax_sim.data import check_mixture_settings, generated_mixture
from fedjax_sim.data.synthetic import bernoulli_init
from fedjax_sim.experiments.base import DATA, INIT, ROUNDS, Experiment, Preset, RunContext
from fedjax_sim.experiments.settings import (
    Setting,
    count,
    lr_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)
from fedjax_sim.io import write_csv
from fedjax_sim.models import linear_regression
from fedjax_sim.ops import assign_clusters, cluster_losses

VARIANTS = ("fixed", "split", "fresh_stream")
MAX_K = 6  # the error matches clusters over all k! permutations


# ----------------------------------------------------------------------------- measures


def matched_error(params, theta_star):
    """min over permutations π of mean_j ‖θ_j − θ*_π(j)‖₂: each cluster model's distance
    to its matched true model, averaged over clusters. params, theta_star: [k, d]."""
    k = theta_star.shape[0]
    dist = jnp.sqrt(jnp.sum(jnp.square(params[:, None, :] - theta_star[None]), -1))  # [k, k]
    perms = jnp.asarray(list(itertools.permutations(range(k))), jnp.int32)  # [k!, k]
    per_perm = dist[jnp.arange(k)[None, :], perms].mean(-1)
    return jnp.min(per_perm)


def loglog_slope(x, y) -> float:
    """The least-squares slope of log y against log x (a power law y ∝ x^slope)."""
    x, y = np.log(np.asarray(x, np.float64)), np.log(np.asarray(y, np.float64))
    return float(np.polyfit(x, y, 1)[0])


def linear_rate(errors, floor_factor: float = 3.0) -> tuple[float | None, int]:
    """The per-iteration factor ρ of a linear phase e_t ≈ e_0 ρ^t: exp of the least-squares
    slope of log e_t over the iterations before e_t first falls below floor_factor × the
    floor (the mean of the last quarter of the curve). Returns (ρ, iterations fitted);
    ρ is None when fewer than 3 iterations lie above the floor."""
    e = np.asarray(errors, np.float64)
    floor = float(np.mean(e[-max(1, len(e) // 4):]))
    below = np.nonzero(e <= floor_factor * floor)[0]
    stop = int(below[0]) if below.size else len(e)
    if stop < 3 or not np.all(np.isfinite(e[:stop])) or np.any(e[:stop] <= 0):
        return None, stop
    t = np.arange(stop)
    return float(np.exp(np.polyfit(t, np.log(e[:stop]), 1)[0])), stop


def close_init(key, theta_star, delta):
    """θ_j⁰ = θ*_j + δ·u_j·Δ_j, u_j uniform on the sphere, Δ_j = min_{j'≠j} ‖θ*_j − θ*_j'‖."""
    k = theta_star.shape[0]
    u = jax.random.normal(key, theta_star.shape)
    u = u / jnp.linalg.norm(u, axis=-1, keepdims=True)
    dist = jnp.sqrt(jnp.sum(jnp.square(theta_star[:, None] - theta_star[None]), -1))
    gap = jnp.min(jnp.where(jnp.eye(k, dtype=bool), jnp.inf, dist), axis=-1)
    return theta_star + delta * u * gap[:, None]


def population_contraction(s: dict) -> float:
    """The error's factor per iteration on the population loss (x ~ N(0, I), squared loss
    without ½, so Hessian 2I) with every client assigned right: option I steps a cluster
    by (γ/m)·Σ of its m/k clients' gradients, 1 − 2γ/k; option II averages τ local steps
    from the cluster model, (1 − 2γ)^τ."""
    if s["option"] == "gradient":
        return 1.0 - 2.0 * s["lr"] / s["k"]
    return (1.0 - 2.0 * s["lr"]) ** s["local_steps"]


def least_squares_floor(sigma: float, d: int, big_n: float) -> float:
    """σ√(d/(N − d)): the error of least squares on one cluster's N examples."""
    return sigma * math.sqrt(d / (big_n - d))


def constant_step_floor(s: dict, big_n_step: float) -> float | None:
    """Option I's stationary error when every iteration's gradient reads N_s new examples per
    cluster, all assigned right: e_{t+1} = (1 − 2γ/k)·e_t + γ·g_t with independent noise g_t
    of variance 4σ²/(k²N_s) per coordinate gives σ√(d/N_s)·√(γ/k)/√(1 − γ/k). None for
    option II."""
    if s["option"] != "gradient":
        return None
    ratio = s["lr"] / s["k"]
    return s["sigma"] * math.sqrt(s["d"] / big_n_step) * math.sqrt(ratio / (1.0 - ratio))


def rows_per_step(s: dict, n: int) -> dict:
    """{variant: the examples per cluster one iteration's gradient reads}: fixed and
    fresh_stream N = m·n/k; split N' = m·⌊n/2T⌋/k."""
    big_n = s["m"] * n / s["k"]
    return {"fixed": big_n, "split": s["m"] * (n // (2 * s["rounds"])) / s["k"],
            "fresh_stream": big_n}


# ----------------------------------------------------------------------------- trajectories


def split_parts(n: int, rounds: int) -> np.ndarray:
    """[rounds, 2, n'] int32 row indices of the sample splitting, n' = ⌊n / (2·rounds)⌋:
    iteration t assigns clusters with part 2t ([t, 0]) and steps with part 2t + 1 ([t, 1])
    of the client's one fixed sample of n rows. The 2·rounds parts are disjoint."""
    size = n // (2 * rounds)
    return np.arange(2 * rounds * size, dtype=np.int32).reshape(rounds, 2, size)


def _rows(data, idx):
    """The clients of `data` (FederatedData, every client n real rows) on rows idx [n']."""
    return data.replace(x=jnp.take(data.x, idx, axis=1), y=jnp.take(data.y, idx, axis=1),
                        num_examples=jnp.full_like(data.num_examples, idx.shape[0]))


def _trajectories(seed_key, seed_ids, deltas, *, k, m, n, d, sigma, R, lr, rounds, variant,
                  option, local_steps, random_init=False):
    """[seeds, deltas, rounds + 1] matched errors of IFCA from `close_init` at each δ
    (or, random_init, from the official Bernoulli init: the δ axis then repeats it), on
    the data `variant` of `VARIANTS`."""
    model = linear_regression(d)
    training = sgd(lr) if option == "gradient" else sgd(lr, steps=local_steps)
    algorithm = ifca(model, training, num_clusters=k, option=option)

    def one_seed(seed_id):
        problem = generated_mixture(jax.random.fold_in(jax.random.fold_in(seed_key, DATA),
                                                       seed_id),
                                    k=k, m=m, n=n, d=d, sigma=sigma, R=R)
        train, theta_star = problem.train, problem.theta_star
        if variant == "split":
            train = train.materialize()  # the one fixed sample, [m, n] rows
        init_key = jax.random.fold_in(jax.random.fold_in(seed_key, INIT), seed_id)
        round_key = jax.random.fold_in(jax.random.fold_in(seed_key, ROUNDS), seed_id)

        def one_delta(delta):
            params = (bernoulli_init(init_key, k, d) if random_init
                      else close_init(init_key, theta_star, delta))
            state = algorithm.init(init_key, train)._replace(cluster_params=params)

            def body(state, step):
                t, part = step
                data = train
                if variant == "fresh_stream":
                    data = train.replace(key=jax.random.fold_in(train.key, t))
                elif variant == "split":  # assign on part 2t, then step with it pinned on 2t + 1
                    losses = cluster_losses(model, state.cluster_params, _rows(train, part[0]))
                    state = state._replace(assignment=assign_clusters(losses),
                                           pinned_until=state.round + 1)
                    data = _rows(train, part[1])
                state, _ = algorithm.round(state, data, jax.random.fold_in(round_key, t))
                return state, matched_error(state.cluster_params, theta_star)

            parts = (jnp.asarray(split_parts(n, rounds)) if variant == "split"
                     else jnp.zeros((rounds, 2, 0), jnp.int32))
            _, errors = jax.lax.scan(body, state, (jnp.arange(rounds), parts))
            return jnp.concatenate([matched_error(params, theta_star)[None], errors])

        return jax.vmap(one_delta)(deltas)

    return jax.vmap(one_seed)(seed_ids)


_STATIC = ("k", "m", "n", "d", "rounds", "variant", "option", "local_steps", "random_init")
_compiled = jax.jit(_trajectories, static_argnames=_STATIC)


def trajectories(s: dict, *, n: int, deltas, seeds: int, variant: str = "fixed",
                 seed_offset: int = 0, random_init: bool = False) -> np.ndarray:
    """Host [seeds, len(deltas), rounds + 1] errors at n examples per client, on the data
    `variant` of `VARIANTS`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}: give one of {', '.join(VARIANTS)}.")
    if variant == "split" and n < 2 * s["rounds"]:
        raise ValueError(f"n={n}: sample splitting needs n >= 2·rounds = {2 * s['rounds']} "
                         "(at least one row per part).")
    out = _compiled(jax.random.key(s["seed"]),
                    jnp.arange(seed_offset, seed_offset + seeds, dtype=jnp.int32),
                    jnp.asarray(deltas, jnp.float32), sigma=jnp.float32(s["sigma"]),
                    R=jnp.float32(s["R"]), lr=jnp.float32(s["lr"]), k=s["k"], m=s["m"], n=n,
                    d=s["d"], rounds=s["rounds"], variant=variant, option=s["option"],
                    local_steps=s["local_steps"], random_init=random_init)
    return np.asarray(out, np.float64)


def _geomean(errors, axis=0):
    """The geometric mean over seeds (NaN when a seed diverged)."""
    return np.exp(np.mean(np.log(np.maximum(errors, 1e-300)), axis=axis))


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ----------------------------------------------------------------------------- experiment


SETTINGS = (
    count("k", 2, "clusters", maximum=MAX_K),
    count("m", 20, "clients (m/k per cluster)", maximum=100_000),
    count("n", 800, "examples per client in (a) and (c) (split: n/(2·rounds) rows per "
          "part, at least 1)", maximum=100_000),
    count("d", 20, "dimension", maximum=10_000),
    Setting("sigma", float, 0.5, "noise standard deviation (> 0: the floor σ√(d/N))",
            minimum=0.0),
    Setting("R", float, 1.0, "scale of θ* = R·Bernoulli(½)^d", minimum=0.0),
    lr_setting(0.1, "step γ of option I (option II: the local SGD step)"),
    Setting("option", str, "gradient", "IFCA option: gradient (I) or model (II)",
            choices=("gradient", "model")),
    count("local_steps", 5, "option II's local full-batch steps τ", maximum=10_000),
    rounds_setting(80, "iterations"),
    seeds_setting(8, "data seeds of (a) and (b), one vmapped axis"),
    seed_setting(),
    Setting("deltas", float, [0.1, 0.3, 0.45], "(a) init closeness δ (a comma list)",
            minimum=0.0, listable=True),
    Setting("n_grid", int, [160, 480, 1600, 4800], "(b) examples per client n (a comma "
            "list, each >= 2·rounds; N = m·n/k; compiled once per n)", minimum=1,
            maximum=100_000, listable=True),
    Setting("delta_n", float, 0.1, "(b) init closeness δ", minimum=0.0),
    Setting("success_deltas", float, [0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0],
            "(c) init closeness δ (a comma list; k = 2 only)", minimum=0.0,
            listable=True),
    count("success_seeds", 64, "(c) data seeds per δ", maximum=100_000),
    Setting("threshold", float, 0.3, "(c) success when the final error is below this",
            minimum=0.0),
)


def validate(s: dict, command: str = "run") -> None:
    check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"])
    if s["k"] < 2:
        raise ValueError(f"setting k={s['k']}: the theory is about k >= 2 clusters.")
    if s["sigma"] <= 0:
        raise ValueError(f"setting sigma={s['sigma']}: the statistical floor σ√(d/N) is 0 "
                         "without noise; give sigma > 0.")
    if s["R"] <= 0:
        raise ValueError(f"setting R={s['R']}: the clusters coincide; give R > 0.")
    if s["threshold"] <= 0:
        raise ValueError(f"setting threshold={s['threshold']}: give a threshold > 0.")
    n_grid = _as_list(s["n_grid"])
    if len(n_grid) < 2:
        raise ValueError(f"setting n_grid={s['n_grid']}: the slope needs two n or more.")
    parts = 2 * s["rounds"]
    for name, n in [("n", s["n"]), *(("n_grid", n) for n in n_grid)]:
        if n < parts:
            shown = s["n_grid"] if name == "n_grid" else n
            raise ValueError(f"setting {name}={shown}: sample splitting cuts n into 2·rounds "
                             f"= {parts} parts, and n={n} leaves n/(2T) = {n / parts:.3g} "
                             f"< 1 row per part; give n >= {parts} or fewer rounds.")
    for n in [s["n"], *n_grid]:
        if s["m"] * n / s["k"] <= s["d"]:
            raise ValueError(f"setting n_grid={s['n_grid']} (or n={s['n']}): n={n} gives "
                             f"N = m·n/k = {s['m'] * n / s['k']:g} examples per cluster, "
                             f"not above d={s['d']}; raise n or m.")

def run(s: dict, ctx: RunContext) -> tuple[list[dict], dict]:
    k, d, sigma = s["k"], s["d"], s["sigma"]
    deltas = _as_list(s["deltas"])
    population_rate = population_contraction(s)
    big_n = s["m"] * s["n"] / k
    # (a) error against iterations, each data variant
    curves, rates = {}, []
    for variant in VARIANTS:
        errors = trajectories(s, n=s["n"], deltas=deltas, seeds=s["seeds"],
                              variant=variant)
        mean = _geomean(errors)  # [deltas, rounds + 1]
        for i, delta in enumerate(deltas):
            curves[f"{variant}_delta{delta:g}"] = mean[i]
            rate, fitted = linear_rate(mean[i])
            rates.append({"variant": variant, "delta": delta, "rate": rate,
                          "iterations_fitted": fitted,
                          "final_error": float(mean[i, -1])})
    rows = [{"round": t, **{name: float(c[t]) for name, c in curves.items()}}
            for t in range(s["rounds"] + 1)]
    ctx.on_rows(rows)
    # (b) final error against N
    vs_n = []
    for n in _as_list(s["n_grid"]):
        row = {"n": n, "N": s["m"] * n / k, "split_part_rows": n // (2 * s["rounds"]),
               "least_squares_floor": least_squares_floor(sigma, d, s["m"] * n / k),
               "minimax": sigma * math.sqrt(d / (s["m"] * n / k))}
        for variant in ("split", "fresh_stream"):
            row[f"constant_step_floor_{variant}"] = constant_step_floor(
                s, rows_per_step(s, n)[variant])
        for variant in VARIANTS:
            errors = trajectories(s, n=n, deltas=[s["delta_n"]], seeds=s["seeds"],
                                  variant=variant)
            row[f"final_error_{variant}"] = float(_geomean(errors[:, 0, -1]))
        vs_n.append(row)
    big_ns = [r["N"] for r in vs_n]
    slopes = {v: loglog_slope(big_ns, [r[f"final_error_{v}"] for r in vs_n])
              for v in VARIANTS}
    # (c) success against δ, k = 2
    success = []
    random_prob = None
    if k == 2:
        grid = _as_list(s["success_deltas"])
        final = trajectories(s, n=s["n"], deltas=grid, seeds=s["success_seeds"])[:, :, -1]
        for i, delta in enumerate(grid):
            hits = np.isfinite(final[:, i]) & (final[:, i] < s["threshold"])
            success.append({"delta": delta, "success_prob": float(hits.mean()),
                            "seeds": s["success_seeds"],
                            "median_final_error": float(np.nanmedian(final[:, i]))})
        rand = trajectories(s, n=s["n"], deltas=[0.0], seeds=s["success_seeds"],
                            random_init=True)
        random_prob = float(np.mean(np.isfinite(rand[:, 0, -1])
                                    & (rand[:, 0, -1] < s["threshold"])))
    summary = {
        "linear_phase": rates,
        "population_rate": population_rate,
        "least_squares_floor": least_squares_floor(sigma, d, big_n),
        "minimax": sigma * math.sqrt(d / big_n),
        "split_part_rows": s["n"] // (2 * s["rounds"]),
        "constant_step_floor": {v: constant_step_floor(s, rows_per_step(s, s["n"])[v])
                                for v in ("split", "fresh_stream")},
        "error_vs_N": vs_n,
        "slope_vs_N": slopes,
        "minimax_slope": -0.5,
        "success_vs_delta": success,
        "random_init_success_prob": random_prob,
        "threshold": s["threshold"],
        "compiled": "one program per (n, variant): n changes the data's shapes; seeds "
                    "and δ are vmapped",
    }
    return rows, summary

def run_facts(summary: dict, s: dict) -> list[str]:
    """The final error's slope against N (the minimax rate's is −0.5), and how often an
    init δ-close to θ* succeeds against a random one."""
    slopes = summary["slope_vs_N"]
    facts = ["the final error falls with N at slope " + " and ".join(
        f"{slope:.3g} ({variant})" for variant, slope in slopes.items())
        + f" against the minimax {summary['minimax_slope']}"]
    success = summary["success_vs_delta"]
    if success:
        facts.append("success " + ", ".join(f"{row['success_prob']:.2g} at δ = {row['delta']:g}"
                                             for row in success)
                     + f" against {summary['random_init_success_prob']:.2g} from a random init")
    return facts

def plot_run(rows, summary, out_dir) -> None:
    write_csv(out_dir / "error_vs_N.csv", summary["error_vs_N"])
    write_csv(out_dir / "linear_phase.csv", summary["linear_phase"])
    if summary["success_vs_delta"]:
        write_csv(out_dir / "success_vs_delta.csv", summary["success_vs_delta"])
    plot(rows, summary, out_dir / "theory.png")


def plot(rows, summary, path) -> None:
    """(a) error vs iteration (log y), (b) final error vs N (log-log), (c) success vs δ."""
    from matplotlib.figure import Figure

    panels = 3 if summary["success_vs_delta"] else 2
    fig = Figure(figsize=(5 * panels, 4))
    ax = fig.add_subplot(1, panels, 1)
    t = [r["round"] for r in rows]
    for name in (c for c in rows[0] if c != "round"):
        style = {"fixed": "-", "split": "-.", "fresh_stream": "--"}[name.rsplit("_delta", 1)[0]]
        ax.plot(t, [r[name] for r in rows], style,
                label=name.replace("_delta", ", δ="))
    ax.axhline(summary["least_squares_floor"], color="grey", lw=0.8, label="σ√(d/(N−d))")
    ax.set(yscale="log", xlabel="iteration t", ylabel="‖θ_t − θ*‖ (geometric mean)",
           title="(a) linear phase and floor")
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, panels, 2)
    vs_n = summary["error_vs_N"]
    big_n = [r["N"] for r in vs_n]
    for v in VARIANTS:
        ax.plot(big_n, [r[f"final_error_{v}"] for r in vs_n], "o-",
                label=f"{v} (slope {summary['slope_vs_N'][v]:.2f})")
    ax.plot(big_n, [r["minimax"] for r in vs_n], "k:", label="σ√(d/N) (slope −0.5)")
    ax.set(xscale="log", yscale="log", xlabel="N (examples per cluster)",
           ylabel="final error", title="(b) statistical error")
    ax.legend(fontsize=7)
    if panels == 3:
        ax = fig.add_subplot(1, panels, 3)
        sv = summary["success_vs_delta"]
        ax.plot([r["delta"] for r in sv], [r["success_prob"] for r in sv], "o-", label="close init")
        if summary["random_init_success_prob"] is not None:
            ax.axhline(summary["random_init_success_prob"], color="grey", ls="--",
                       label="random (Bernoulli) init")
        ax.set(xlabel="δ (init distance / separation)", ylabel="success probability",
               ylim=(-0.03, 1.03), title="(c) k = 2")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# IFCA's theory measured (docs/protocols.md#ifca-theory): a run of its own, no comparison
# and no sweep.
THEORY = Experiment(
    name="ifca_theory",
    description=("IFCA's theory measured: linear-rate error decay from close inits (fixed "
                 "data, the paper's sample splitting of it, a fresh-data stream), final "
                 "error against N, success against δ."),
    settings=SETTINGS,
    validate=validate,
    run=run,
    run_facts=run_facts,
    plot_run=plot_run,
)

PRESETS = [
    Preset("ifca-theory", THEORY, "IFCA's theory measured (k = 2, d = 20): linear rate and "
           "floor, final error against N with its slope, success against init closeness."),
]
