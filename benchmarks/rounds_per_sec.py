"""Seconds per IFCA round: the vectorized fedjax_sim round vs a per-client numpy loop.

Usage:
  python benchmarks/rounds_per_sec.py --out rounds_per_sec.json
  python benchmarks/rounds_per_sec.py --quick --out /tmp/quick.json   # smoke run, ~20 s

In one run this measures, on whatever JAX backend is the default:

1. Two machine ceilings: streaming memory bandwidth (a jitted triad
   b = a*s + b, b donated, over arrays far larger than the caches; 2 reads +
   1 write per element) and a matmul peak (a large square f32 `jnp.dot`).
2. For each (m, n, d, k): the steady-state seconds per round of
   `fedjax_sim.backend.jit(ifca(linear_regression(d), num_clusters=k,
   learning_rate=lr).round, d)` -- jax.jit with the per-shape XLA options
   that fedjax_sim.simulate compiles rounds with (IFCA option I, gradient
   averaging; compile time measured apart with `.lower().compile()`), and of
   the same round written the way per-client simulators run it: a Python loop
   over clients, numpy float32, each client computing its k losses, its
   argmin and its own gradient, then the server's sum / m and SGD step. Both
   start from the same state on the same data, and the script asserts that
   one round of each gives the same cluster params (np.allclose, float32
   tolerance) and the same assignments. The timed rounds run in interleaved
   blocks (vectorized, loop, vectorized, ...) so that other load on a shared
   machine falls on both sides of the ratio. Extras: the same round run 20 at
   a time inside one `lax.scan` (no per-round dispatch), and with ifca's
   `client_chunk` (clients processed a cache-sized chunk at a time) where
   this fedjax_sim has that option.
3. One official sweep cell of the IFCA synthetic experiment (k=2, m=n=100,
   d=1000, σ=0.1, R=0.25; 40 data seeds × 3 lrs × 10 restarts × 300
   iterations), built self-contained here: per data seed a `linear_mixture`
   problem, then `vmap` over lrs × restarts of `lax.scan` over 300 rounds, the
   restart's init key depending only on the restart index and the data shared
   (in_axes None). `--sweep-seeds N` times N seeds and extrapolates to 40.

The JSON written to --out is a list with one object per (m, n, d, k); the
object whose shape matches the sweep cell also carries a `sweep_cell` object.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# The fedjax_sim of this checkout, not whatever copy site-packages holds
# (a stale non-editable install would otherwise be measured silently).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fedjax_sim  # noqa: E402
from fedjax_sim import backend
from fedjax_sim.algorithms.ifca import ifca
from fedjax_sim.data.synthetic import linear_mixture
from fedjax_sim.models.core import linear_regression

FULL_CONFIGS = ((100, 100, 1000, 2), (1000, 10, 10, 4), (10000, 10, 10, 4), (100000, 10, 10, 4))
QUICK_CONFIGS = ((10, 10, 20, 2), (100, 5, 5, 4))

# The official sweep cell (PAPERS.md §2.1, run_p2_m_n.py / run_p2_r_noise.py grids).
FULL_CELL = dict(
    k=2, m=100, n=100, d=1000, sigma=0.1, R=0.25, lrs=(1.0, 0.1, 0.01), restarts=10, iterations=300
)
QUICK_CELL = dict(
    k=2, m=10, n=10, d=20, sigma=0.1, R=0.25, lrs=(1.0, 0.1, 0.01), restarts=10, iterations=20
)
OFFICIAL_SEEDS = 40

# One jitted generator for every shape: compiled once per (k, m, n, d), shared
# by a round benchmark and the sweep cell of the same shape (σ, R are traced).
_mixture = jax.jit(linear_mixture, static_argnames=("k", "m", "n", "d", "n_test"))
DATA_SIGMA, DATA_R = 0.1, 0.25

ROUND_LR = 0.1  # stable for X ~ N(0, 1) (Hessian ≈ 2I), so timed rounds stay finite
RTOL, ATOL = 1e-4, 1e-5  # float32: sums over m·n terms in a different order


def _times(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


# --------------------------------------------------------------------------- probes


def stream_bandwidth(num_floats: int, reps: int) -> dict:
    """Triad b ← a*s + b: bytes moved (2 reads + 1 write) over the median time.

    b is donated, so the output reuses its buffer: without that every call
    writes a freshly mapped output and times the page faults (on the 2-core
    CPU here, ~2.5 GB/s instead of ~10).
    """
    rng = np.random.default_rng(123)  # numpy inputs: no extra XLA compile for the probe
    a = jnp.asarray(rng.standard_normal(num_floats, np.float32))
    box = [jnp.asarray(rng.standard_normal(num_floats, np.float32))]
    s = jnp.float32(1.0001)  # a traced scalar, so XLA cannot fold the multiply away
    triad = jax.jit(lambda a, b, s: a * s + b, donate_argnums=1)

    def step():
        box[0] = triad(a, box[0], s)
        jax.block_until_ready(box[0])

    step()
    t = float(np.median(_times(step, reps)))
    moved = 3 * num_floats * 4
    return {
        "stream_GBps": moved / t / 1e9,
        "stream_bytes_moved": moved,
        "stream_s": t,
        "stream_kernel": "b = a*s + b (b donated), f32, 2 reads + 1 write per element",
    }


def matmul_peak(size: int, reps: int) -> dict:
    """GFLOP/s of one large square f32 matmul (2·N³ flops), median over reps."""
    rng = np.random.default_rng(321)
    a = jnp.asarray(rng.standard_normal((size, size), np.float32))
    b = jnp.asarray(rng.standard_normal((size, size), np.float32))
    mm = jax.jit(jnp.dot)
    jax.block_until_ready(mm(a, b))
    times = _times(lambda: jax.block_until_ready(mm(a, b)), reps)
    t = float(np.median(times))
    return {"matmul_peak_GFLOPs": 2 * size**3 / t / 1e9, "matmul_size": size, "matmul_s": t}


# --------------------------------------------------------------------------- the loop


def loop_round(theta: np.ndarray, clients, lr: float):
    """One IFCA option-I round, one client at a time (no JAX; numpy float32).

    Mirrors fedjax_sim's round: F_i(θ) = mean over the client's rows of
    (y − xᵀθ)² (no ½); a NaN loss counts as +inf; ties go to the lowest index;
    θ_j ← θ_j − lr · (1/m) Σ_i s_ij ∇F_i(θ_j).

    Args:
      theta: [k, d] float32 cluster models.
      clients: m pairs (x [n_i, d], y [n_i]) of float32 arrays.
      lr: server learning rate.

    Returns:
      (new theta [k, d] float32, assignment [m] int32).
    """
    m = len(clients)
    theta_t = np.ascontiguousarray(theta.T)  # [d, k]
    grad_sum = np.zeros_like(theta)
    assignment = np.empty(m, np.int32)
    for i, (x, y) in enumerate(clients):
        n_i = max(len(y), 1)
        residual = x @ theta_t - y[:, None]  # [n_i, k]: the k models' residuals at once
        losses = (residual * residual).sum(axis=0) / n_i  # the k losses F_i(θ_j)
        losses[np.isnan(losses)] = np.inf
        j = int(losses.argmin())
        assignment[i] = j
        grad_sum[j] += (2.0 / n_i) * (residual[:, j] @ x)  # ∇F_i(θ_j) = (2/n) xᵀ(xθ_j − y)
    new_theta = theta - np.float32(lr) * (grad_sum / np.float32(m))
    return new_theta.astype(np.float32), assignment


# --------------------------------------------------------------------------- one config


def _cache_chunk(m: int, n: int, d: int, chunk_bytes: int = 2 << 20) -> int:
    """The largest divisor of m whose clients' X fits in chunk_bytes (at least 1)."""
    limit = max(1, chunk_bytes // (n * d * 4))
    return max(c for c in range(1, min(m, limit) + 1) if m % c == 0)


def bench_config(m, n, d, k, *, vec_budget_s, loop_budget_s, loop_max_rounds, blocks, log) -> dict:
    """Times one (m, n, d, k); see the module docstring.

    The timed rounds run in `blocks` interleaved blocks (vectorized, scanned,
    loop, then again), so that on a shared machine a burst of other load
    falls on both sides of the ratio rather than on one.
    """
    data = _mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=DATA_SIGMA, R=DATA_R).train
    alg = ifca(linear_regression(d), num_clusters=k, learning_rate=ROUND_LR)
    state0 = alg.init(jax.random.key(1), data)
    round_keys = jax.random.split(jax.random.key(2), 512)
    key_list = list(round_keys)  # sliced here, so no indexing op runs inside the timed loop
    jax.block_until_ready((data, state0, key_list))

    # Vectorized: compile apart (AOT), then a first call.
    t0 = time.perf_counter()
    compiled = backend.jit(alg.round, d).lower(state0, data, key_list[0]).compile()
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state1, _ = compiled(state0, data, key_list[0])
    jax.block_until_ready(state1)
    first_call_s = time.perf_counter() - t0

    # Many rounds in one lax.scan (how fedjax_sim's simulator runs them): no
    # per-round dispatch. Reported as an extra; the headline is jit(alg.round).
    scan_len = 20

    def many(state, data, keys):
        return jax.lax.scan(lambda s, key: (alg.round(s, data, key)[0], None), state, keys)[0]

    scan_keys = round_keys[:scan_len]
    scanned = backend.jit(many, d).lower(state1, data, scan_keys).compile()
    jax.block_until_ready(scanned(state1, data, scan_keys))

    # The same round processing `client_chunk` clients at a time (ifca's
    # client_chunk option, where this fedjax_sim has it): a chunk's X is
    # reused from cache between the forward pass and the VJP. An extra.
    chunk = _cache_chunk(m, n, d)
    chunked = None
    try:
        alg_c = ifca(
            linear_regression(d), num_clusters=k, learning_rate=ROUND_LR, client_chunk=chunk
        )
    except TypeError:  # a fedjax_sim without client_chunk
        alg_c = None
    if alg_c is not None:
        chunked = backend.jit(alg_c.round, d).lower(state0, data, key_list[0]).compile()
        state1_c, _ = chunked(state0, data, key_list[0])
        jax.block_until_ready(state1_c)

    # The per-client loop, on the same float32 data, from the same state; its
    # first round is checked against the vectorized first round.
    x_np = np.asarray(data.x)
    y_np = np.asarray(data.y)
    n_real = np.asarray(data.num_examples)
    clients = [(x_np[i, : n_real[i]], y_np[i, : n_real[i]]) for i in range(m)]
    theta0 = np.asarray(state0.cluster_params)

    t0 = time.perf_counter()
    theta1, assign1 = loop_round(theta0, clients, ROUND_LR)
    loop_first_s = time.perf_counter() - t0

    vec_theta1 = np.asarray(state1.cluster_params)
    vec_assign1 = np.asarray(state1.assignment)
    max_abs_diff = float(np.max(np.abs(vec_theta1 - theta1)))
    same_assignment = bool(np.array_equal(vec_assign1, assign1))
    close = bool(np.allclose(vec_theta1, theta1, rtol=RTOL, atol=ATOL))
    assert same_assignment, f"(m,n,d,k)={(m, n, d, k)}: loop and vectorized assignments differ"
    assert close, (
        f"(m,n,d,k)={(m, n, d, k)}: loop and vectorized cluster params differ "
        f"(max |diff| = {max_abs_diff:.3g})"
    )

    chunk_diff = None
    if chunked is not None:
        theta1_c = np.asarray(state1_c.cluster_params)
        chunk_diff = float(np.max(np.abs(theta1_c - theta1)))
        assert np.allclose(theta1_c, theta1, rtol=RTOL, atol=ATOL), (
            f"(m,n,d,k)={(m, n, d, k)}: client_chunk={chunk} round differs from the loop "
            f"(max |diff| = {chunk_diff:.3g})"
        )

    # Steady state, in interleaved blocks.
    state, theta = state1, theta1
    state_c = state1_c if chunked is not None else None
    times, scan_times, chunk_times, loop_times = [], [], [], []
    loop_per_block = int(
        max(1, min(loop_max_rounds, (loop_budget_s / blocks) // max(loop_first_s, 1e-9)))
    )
    i = 1
    for _ in range(blocks):
        start, count = time.perf_counter(), 0
        while count < 5 or (time.perf_counter() - start < vec_budget_s / blocks and count < 500):
            t0 = time.perf_counter()
            state, _ = compiled(state, data, key_list[i % len(key_list)])
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t0)
            i, count = i + 1, count + 1
        if chunked is not None:
            start, count = time.perf_counter(), 0
            while count < 5 or (
                time.perf_counter() - start < vec_budget_s / blocks / 2 and count < 500
            ):
                t0 = time.perf_counter()
                state_c, _ = chunked(state_c, data, key_list[i % len(key_list)])
                jax.block_until_ready(state_c)
                chunk_times.append(time.perf_counter() - t0)
                i, count = i + 1, count + 1
        per_scan = float(np.median(times)) * scan_len
        scan_reps = max(1, min(10, int(vec_budget_s / blocks / 2 // max(per_scan, 1e-9))))
        scan_times += _times(
            lambda: jax.block_until_ready(scanned(state1, data, scan_keys)), scan_reps
        )
        for _ in range(loop_per_block):
            t0 = time.perf_counter()
            theta, _ = loop_round(theta, clients, ROUND_LR)
            loop_times.append(time.perf_counter() - t0)
    vec_s = float(np.median(times))
    scan_s = float(np.median(scan_times)) / scan_len
    loop_s = float(np.median(loop_times))
    loop_rounds = len(loop_times)
    chunk_s = float(np.median(chunk_times)) if chunk_times else None

    x_bytes = int(x_np.nbytes)
    flops = 4 * m * n * d * k
    row = {
        "m": m,
        "n": n,
        "d": d,
        "k": k,
        "vectorized_s_per_round": vec_s,
        "loop_s_per_round": loop_s,
        "speedup": loop_s / vec_s,
        "achieved_GBps": x_bytes / vec_s / 1e9,
        "compile_s": compile_s,
        # extras
        "vectorized_rounds_timed": len(times),
        "timing_blocks": blocks,
        "scan_rounds_timed": len(scan_times) * scan_len,
        "vectorized_s_per_round_min": float(np.min(times)),
        "vectorized_first_call_s": first_call_s,
        "vectorized_scan_s_per_round": scan_s,
        "scan_speedup": loop_s / scan_s,
        "client_chunk": chunk if chunked is not None else None,
        "vectorized_chunked_s_per_round": chunk_s,
        "chunked_speedup": loop_s / chunk_s if chunk_s else None,
        "chunked_max_abs_param_diff": chunk_diff,
        "loop_rounds_timed": loop_rounds,
        "loop_s_per_round_min": float(np.min(loop_times)),
        "loop_first_round_s": loop_first_s,
        "x_bytes": x_bytes,
        "round_flops": flops,
        "round_GFLOPs": flops / vec_s / 1e9,
        "verified_equal": close and same_assignment,
        "max_abs_param_diff": max_abs_diff,
        "tolerance": {"rtol": RTOL, "atol": ATOL},
        "learning_rate": ROUND_LR,
    }
    log(
        f"  m={m:>6} n={n:>3} d={d:>4} k={k}: vec {vec_s * 1e3:9.3f} ms  "
        f"(scan {scan_s * 1e3:8.3f} ms"
        + (f", chunk={chunk} {chunk_s * 1e3:8.3f} ms" if chunk_s else "")
        + f")  loop {loop_s * 1e3:10.2f} ms  "
        f"speedup {row['speedup']:7.1f}  compile {compile_s:.2f} s  "
        f"max|Δθ| {max_abs_diff:.1e}"
    )
    return row


# --------------------------------------------------------------------------- sweep cell


def make_sweep_cell(cell: dict):
    """Returns (make_data, train) for one data seed of the official sweep cell.

    make_data(data_key) -> (train FederatedData, theta_star [k, d]).
    train(data, theta_star) -> min_dist [len(lrs), restarts].
    """
    k, m, n, d = cell["k"], cell["m"], cell["n"], cell["d"]
    iterations = cell["iterations"]
    model = linear_regression(d)
    lrs = jnp.asarray(cell["lrs"], jnp.float32)
    restarts = jnp.arange(cell["restarts"])
    init_root = jax.random.key(10_000)  # restart r's init key: fold_in(init_root, r), any seed/lr
    round_root = jax.random.key(20_000)

    def make_data(data_key):
        problem = _mixture(data_key, k=k, m=m, n=n, d=d, sigma=cell["sigma"], R=cell["R"])
        return problem.train, problem.theta_star

    def one_run(lr, restart, data, theta_star):
        alg = ifca(model, num_clusters=k, learning_rate=lr)
        state = alg.init(jax.random.fold_in(init_root, restart), data)

        def step(state, t):
            state, _ = alg.round(state, data, jax.random.fold_in(round_root, t))
            return state, None

        state, _ = jax.lax.scan(step, state, jnp.arange(iterations))
        theta = state.cluster_params  # [k, d]
        dist = jnp.linalg.norm(theta[:, None, :] - theta_star[None, :, :], axis=-1)
        return jnp.mean(jnp.min(dist, axis=1))  # official min_dist

    over_restarts = jax.vmap(one_run, in_axes=(None, 0, None, None))
    over_lrs = jax.vmap(over_restarts, in_axes=(0, None, None, None))

    def train(data, theta_star):
        return over_lrs(lrs, restarts, data, theta_star)

    return make_data, train


def bench_sweep_cell(cell: dict, seeds: int, matmul_gflops: float, log) -> dict:
    k, m, n, d = cell["k"], cell["m"], cell["n"], cell["d"]
    runs = len(cell["lrs"]) * cell["restarts"]
    make_data, train = make_sweep_cell(cell)
    key0 = jax.random.key(0)

    t0 = time.perf_counter()
    data0, theta_star0 = make_data(key0)  # `_mixture` compiles here, unless already cached
    train_c = backend.jit(train, d).lower(data0, theta_star0).compile()
    compile_s = time.perf_counter() - t0
    del data0, theta_star0

    data_s, train_s, best = [], [], []
    for seed in range(seeds):
        t0 = time.perf_counter()
        data, theta_star = make_data(jax.random.key(seed))
        jax.block_until_ready(data)
        t1 = time.perf_counter()
        min_dist = train_c(data, theta_star)
        jax.block_until_ready(min_dist)
        t2 = time.perf_counter()
        data_s.append(t1 - t0)
        train_s.append(t2 - t1)
        md = np.asarray(min_dist)
        best.append(float(np.nanmin(md)) if np.isfinite(md).any() else float("nan"))
        log(
            f"  sweep cell seed {seed}: data {t1 - t0:.2f} s, 30 runs × "
            f"{cell['iterations']} iterations {t2 - t1:.2f} s, best min_dist {best[-1]:.4f}"
        )

    seconds = float(np.sum(data_s) + np.sum(train_s))
    per_seed = seconds / seeds
    flops_iter_run = 4 * m * n * d * k
    flops_seed = flops_iter_run * cell["iterations"] * runs
    gflops = flops_seed * seeds / seconds / 1e9
    gflops_train = flops_seed * seeds / float(np.sum(train_s)) / 1e9
    measured_all = seeds >= OFFICIAL_SEEDS
    return {
        "cell": {kk: (list(v) if isinstance(v, tuple) else v) for kk, v in cell.items()},
        "runs_per_seed": runs,
        "seeds_official": OFFICIAL_SEEDS,
        "seeds_measured": seeds,
        "measured_seconds": seconds,
        "measured_seconds_note": f"wall time of the {seeds} measured seed(s): data generation "
        "+ training, compile excluded",
        "measured_data_seconds_per_seed": data_s,
        "measured_train_seconds_per_seed": train_s,
        "seconds_per_seed": per_seed,
        "official_40_seed_seconds": per_seed * OFFICIAL_SEEDS,
        "official_40_seed_seconds_is": "measured"
        if measured_all
        else f"extrapolated: mean seconds per seed over {seeds} measured seed(s) × 40",
        "official_40_seed_seconds_incl_compile": per_seed * OFFICIAL_SEEDS + compile_s,
        "compile_s": compile_s,
        "flop_count": "per iteration per run: forward X@Θ 2·m·n·d·k + backward (VJP) "
        "2·m·n·d·k = 4·m·n·d·k; elementwise work, argmin and data "
        "generation not counted",
        "flops_per_iteration_per_run": flops_iter_run,
        "flops_per_seed": flops_seed,
        "flops_40_seeds": flops_seed * OFFICIAL_SEEDS,
        "achieved_GFLOPs": gflops,
        "achieved_GFLOPs_training_only": gflops_train,
        "matmul_peak_GFLOPs": matmul_gflops,
        "fraction_of_matmul_peak": gflops / matmul_gflops,
        "best_min_dist_per_seed": best,
    }


# --------------------------------------------------------------------------- main


def _library_provenance() -> dict:
    """What was measured: the git HEAD and a hash of fedjax_sim's sources as run."""
    package = pathlib.Path(fedjax_sim.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    out = {"fedjax_sim_sources_sha256": digest.hexdigest()[:16]}
    try:

        def git(*cmd):
            return subprocess.run(
                ["git", *cmd], cwd=package, capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()

        top = pathlib.Path(git("rev-parse", "--show-toplevel")).resolve()
        if top == package.resolve().parent:  # the fedjax_sim checkout, not some enclosing repo
            out["git_head"] = git("rev-parse", "--short", "HEAD")
            out["git_dirty"] = bool(git("status", "--porcelain", "--", "."))
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _fmt_table(rows) -> str:
    def sec(x):
        return f"{x:>11.3e}" if x else f"{'-':>11}"

    head = (
        f"{'m':>7} {'n':>4} {'d':>5} {'k':>2} | {'vec s/rnd':>11} {'speedup':>8} | "
        f"{'scan s/rnd':>11} {'chunk':>6} {'chunk s/rnd':>11} | {'loop s/rnd':>11} | "
        f"{'X GB/s':>7} {'stream':>7} {'%':>5} | {'compile s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['m']:>7} {r['n']:>4} {r['d']:>5} {r['k']:>2} | "
            f"{sec(r['vectorized_s_per_round'])} {r['speedup']:>8.1f} | "
            f"{sec(r['vectorized_scan_s_per_round'])} {str(r['client_chunk'] or '-'):>6} "
            f"{sec(r['vectorized_chunked_s_per_round'])} | {sec(r['loop_s_per_round'])} | "
            f"{r['achieved_GBps']:>7.2f} {r['stream_GBps']:>7.2f} "
            f"{100 * r['achieved_GBps'] / r['stream_GBps']:>5.1f} | {r['compile_s']:>9.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a smoke run for tests (~10-25 s on 2 CPU cores, mostly XLA compiles)",
    )
    parser.add_argument(
        "--sweep-seeds",
        type=int,
        default=None,
        help="data seeds of the sweep cell to time (default 40 on an "
        "accelerator, 2 on CPU, 1 with --quick; 0 skips the cell); "
        "fewer than 40 are extrapolated to 40",
    )
    args = parser.parse_args(argv)

    platform_name = jax.default_backend()
    if args.sweep_seeds is None:
        args.sweep_seeds = 1 if args.quick else (2 if platform_name == "cpu" else OFFICIAL_SEEDS)
    if args.sweep_seeds < 0:
        parser.error(f"--sweep-seeds must be >= 0; got {args.sweep_seeds}")

    def log(msg):
        print(msg, flush=True)

    started = time.perf_counter()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    cpu = "cpu" if platform_name == "cpu" else str(jax.devices()[0].device_kind)
    meta = {
        "date_utc": date,
        "backend": platform_name,
        "device": str(jax.devices()[0].device_kind),
        "num_devices": jax.device_count(),
        "host_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "platform": platform.platform(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv])
        if argv is None
        else f"main({argv!r})",
        "quick": args.quick,
        "loadavg_start": list(os.getloadavg()),
        **_library_provenance(),
    }
    log(
        f"fedjax_sim rounds/s benchmark — {date}, backend {platform_name} ({cpu}), "
        f"{os.cpu_count()} host CPUs, jax {jax.__version__}{' [quick]' if args.quick else ''}"
    )

    on_cpu = platform_name == "cpu"
    if args.quick:
        probes = {**stream_bandwidth(1 << 20, 5), **matmul_peak(256, 3)}
        configs, cell = QUICK_CONFIGS, QUICK_CELL
        budgets = dict(vec_budget_s=0.05, loop_budget_s=0.05, loop_max_rounds=2, blocks=1)
    else:
        probes = {
            **stream_bandwidth((1 << 25) if on_cpu else (1 << 28), 10),
            **matmul_peak(2048 if on_cpu else 8192, 5),
        }
        configs, cell = FULL_CONFIGS, FULL_CELL
        budgets = dict(vec_budget_s=3.0, loop_budget_s=6.0, loop_max_rounds=3, blocks=3)
    log(
        f"stream (triad) {probes['stream_GBps']:.2f} GB/s; matmul {probes['matmul_size']}² "
        f"{probes['matmul_peak_GFLOPs']:.1f} GFLOP/s"
    )

    rows = []
    for m, n, d, k in configs:
        row = bench_config(m, n, d, k, log=log, **budgets)
        row["stream_GBps"] = probes["stream_GBps"]
        row["achieved_fraction_of_stream"] = row["achieved_GBps"] / probes["stream_GBps"]
        row["matmul_peak_GFLOPs"] = probes["matmul_peak_GFLOPs"]
        rows.append(row)

    if args.sweep_seeds > 0:
        sweep = bench_sweep_cell(cell, args.sweep_seeds, probes["matmul_peak_GFLOPs"], log)
        shape = (cell["m"], cell["n"], cell["d"], cell["k"])
        for row in rows:
            if (row["m"], row["n"], row["d"], row["k"]) == shape:
                row["sweep_cell"] = sweep
    else:
        sweep = None

    meta["loadavg_end"] = list(os.getloadavg())
    meta["total_seconds"] = time.perf_counter() - started
    meta["probes"] = probes
    for row in rows:
        row["meta"] = meta

    log("")
    log(_fmt_table(rows))
    if sweep is not None:
        log(
            f"\nsweep cell k={cell['k']} m={cell['m']} n={cell['n']} d={cell['d']}, "
            f"{sweep['runs_per_seed']} runs × {cell['iterations']} iterations per seed: "
            f"{sweep['seeds_measured']} seed(s) measured in {sweep['measured_seconds']:.1f} s "
            f"(compile {sweep['compile_s']:.1f} s); 40 seeds: "
            f"{sweep['official_40_seed_seconds']:.1f} s ({sweep['official_40_seed_seconds_is']}); "
            f"{sweep['achieved_GFLOPs']:.1f} GFLOP/s = "
            f"{100 * sweep['fraction_of_matmul_peak']:.0f}% of the matmul probe "
            f"({sweep['matmul_peak_GFLOPs']:.1f} GFLOP/s)"
        )
    log(f"total {meta['total_seconds']:.1f} s")

    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
        log(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
