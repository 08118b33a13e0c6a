"""Seconds per IFCA round: the vectorized fedjax_sim round vs a per-client numpy loop.

Usage:
  python benchmarks/rounds_per_sec.py --out rounds_per_sec.json
  python benchmarks/rounds_per_sec.py --quick --no-compare --out /tmp/quick.json  # smoke run
  # another checkout and this one, side by side, with this script:
  git worktree add /tmp/fedjax_base main
  python benchmarks/rounds_per_sec.py --checkout /tmp/fedjax_base --out base.json
  python benchmarks/rounds_per_sec.py --out mine.json
  python benchmarks/rounds_per_sec.py --pair base.json mine.json   # Markdown table

In one run this measures, on whatever JAX backend is the default:

1. Two machine ceilings (`harness.stream_bandwidth`, `harness.matmul_peak`):
   streaming memory bandwidth (a jitted triad b = a*s + b, b donated, 2 reads
   + 1 write per element) and a matmul peak (a large square f32 `jnp.dot`).
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
   blocks (`harness.interleaved_blocks`: vectorized, chunked, scan, loop,
   then again) so that other load on a shared machine falls on both sides of
   the ratio. Extras: 20 rounds in one `lax.scan` through fedjax_sim's own
   `simulate.scan_rounds` (`run_rounds` in checkouts before the rename), and
   ifca's `client_chunk` (clients processed a cache-sized chunk at a time)
   where this fedjax_sim has that option, and the round as the executor runs
   rounds called one by one (`tuning.compile_round`, where this fedjax_sim has
   it: the kernel form and client chunk its timing takes on this machine;
   `executor_choice`, `executor_s_per_round`, `executor_fraction_of_stream`).
3. One official sweep cell of the IFCA synthetic experiment (k=2, m=n=100,
   d=1000, σ=0.1, R=0.25; 40 data seeds × 3 lrs × 10 restarts × 300
   iterations), timed through the package's own compiled cell,
   `fedjax_sim.experiments.ifca_synthetic.cell_min_dist`, one data seed per
   call. `--sweep-seeds N` times N seeds and extrapolates to 40.
4. Optionally (`--compare-preset`, the default; `--no-compare` skips it), the
   end-to-end wall time of `python -m fedjax_sim.cli compare ifca-synthetic
   --set seeds=10` run from the measured checkout in a subprocess. Skipped
   when that checkout's CLI has no `compare` command; a failure is recorded
   as an error string.

It imports only long-standing APIs, so the same script measures another checkout
(`--checkout DIR`).

The JSON written to --out is a list: one object per (m, n, d, k) (`"kind":
"config"`; the one whose shape matches the sweep cell also carries a
`sweep_cell` object), then, unless --no-compare, one `"kind": "comparison"`
object. Every object carries the run's `meta`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import re
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import harness
import jax
import jax.numpy as jnp
import numpy as np

FULL_CONFIGS = ((100, 100, 1000, 2), (1000, 10, 10, 4), (10000, 10, 10, 4), (100000, 10, 10, 4))
QUICK_CONFIGS = ((10, 10, 20, 2), (100, 5, 5, 4))

# The official sweep cell (docs/protocols.md#ifca-success, run_p2_m_n.py / run_p2_r_noise.py grids).
FULL_CELL = dict(
    k=2, m=100, n=100, d=1000, sigma=0.1, R=0.25, lrs=(1.0, 0.1, 0.01), restarts=10, iterations=300
)
QUICK_CELL = dict(
    k=2, m=10, n=10, d=20, sigma=0.1, R=0.25, lrs=(1.0, 0.1, 0.01), restarts=10, iterations=20
)
OFFICIAL_SEEDS = 40
CELL_SEED = 0  # the cell's seed_key is jax.random.key(CELL_SEED), as the sweep's default seed

DATA_SIGMA, DATA_R = 0.1, 0.25
ROUND_LR = 0.1  # stable for X ~ N(0, 1) (Hessian ≈ 2I), so timed rounds stay finite
RTOL, ATOL = 1e-4, 1e-5  # float32: sums over m·n terms in a different order
SCAN_LEN = 20

# The comparison row: the lead's end-to-end command, run from the measured checkout.
COMPARE_ARGS = ("compare", "ifca-synthetic", "--set", "seeds=10")
COMPARE_TIMEOUT_S = 1800.0


class Library(NamedTuple):
    """The pieces of the measured fedjax_sim this script uses (present in old and new)."""

    ifca: Callable
    linear_mixture: Callable
    linear_regression: Callable
    backend: Any
    cell_min_dist: Callable
    scan_rounds: Callable  # simulate.scan_rounds, or run_rounds before the rename
    scan_rounds_name: str
    sgd: Callable | None  # algorithms.sgd where the factories take a ClientTraining
    planned: Callable | None  # execution.planned where the executor plans client chunks
    compile_round: Callable | None  # tuning.compile_round: the executor's form and chunk


def load_library(checkout) -> Library:
    """Imports fedjax_sim from `checkout` (verified) and picks out what is measured."""
    harness.use_checkout(checkout)
    backend = importlib.import_module("fedjax_sim.backend")
    simulate = importlib.import_module("fedjax_sim.simulate")
    ifca = importlib.import_module("fedjax_sim.algorithms").ifca
    if not callable(ifca):  # fedjax_sim.algorithms.ifca as a module
        ifca = ifca.ifca
    name = "scan_rounds" if hasattr(simulate, "scan_rounds") else "run_rounds"
    return Library(
        ifca=ifca,
        linear_mixture=importlib.import_module("fedjax_sim.data").linear_mixture,
        linear_regression=importlib.import_module("fedjax_sim.models").linear_regression,
        backend=backend,
        cell_min_dist=importlib.import_module(
            "fedjax_sim.experiments.ifca_synthetic"
        ).cell_min_dist,
        scan_rounds=getattr(simulate, name),
        scan_rounds_name=f"fedjax_sim.simulate.{name}",
        sgd=getattr(importlib.import_module("fedjax_sim.algorithms"), "sgd", None),
        planned=_optional("fedjax_sim.execution", "planned"),
        compile_round=_optional("fedjax_sim.tuning", "compile_round"),
    )


def _optional(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def build_ifca(lib: Library, d: int, k: int):
    """IFCA option I at ROUND_LR through whichever surface the checkout has."""
    if lib.sgd is not None:
        return lib.ifca(lib.linear_regression(d), lib.sgd(ROUND_LR), num_clusters=k)
    return lib.ifca(lib.linear_regression(d), num_clusters=k, learning_rate=ROUND_LR)


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


def bench_config(
    lib: Library, m, n, d, k, *, vec_budget_s, loop_budget_s, loop_max_rounds, blocks, log
) -> dict:
    """Times one (m, n, d, k); see the module docstring."""
    mixture = jax.jit(lib.linear_mixture, static_argnames=("k", "m", "n", "d", "n_test"))
    data = mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=DATA_SIGMA, R=DATA_R).train
    alg = build_ifca(lib, d, k)
    state0 = alg.init(jax.random.key(1), data)
    key_list = list(jax.random.split(jax.random.key(2), 512))  # no indexing op in the timed loop
    jax.block_until_ready((data, state0, key_list))

    # Vectorized: compiled apart (AOT), then a first call.
    compiled, compile_s = harness.compile_ahead(
        lib.backend.jit(alg.round, d), state0, data, key_list[0]
    )
    first_call_s, (state1, _) = harness.timed_call(compiled, state0, data, key_list[0])

    # SCAN_LEN rounds in one lax.scan, through the simulator's own compiled
    # scan (no per-round dispatch). An extra; the headline is jit(alg.round).
    scan_key = jax.random.key(3)

    def scanned():
        return lib.scan_rounds(alg, state1, data, scan_key, 0, SCAN_LEN)[0]

    scan_first_s, _ = harness.timed_call(scanned)  # traces and compiles

    # The same round processing `client_chunk` clients at a time (the executor's
    # memory plan, where this fedjax_sim has one): a chunk's X is reused from cache
    # between the forward pass and the VJP. An extra.
    chunk = _cache_chunk(m, n, d)
    chunked = state1_c = None
    if lib.planned is not None:
        data_c = lib.planned(data, client_chunk=chunk)
        chunked, _ = harness.compile_ahead(
            lib.backend.jit(alg.round, d), state0, data_c, key_list[0]
        )
        _, (state1_c, _) = harness.timed_call(chunked, state0, data_c, key_list[0])

    # The round as the executor compiles rounds called one by one: the kernel form and
    # client chunk its timing takes on this machine (timed, or read from its store).
    executor = state1_e = choice = None
    if lib.compile_round is not None:
        t0 = time.perf_counter()
        executor, data_e, choice = lib.compile_round(alg, state0, data, key_list[0])
        executor_compile_s = time.perf_counter() - t0
        _, (state1_e, _) = harness.timed_call(executor, state0, data_e, key_list[0])

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

    executor_diff = None
    if executor is not None:
        theta1_e = np.asarray(state1_e.cluster_params)
        executor_diff = float(np.max(np.abs(theta1_e - theta1)))
        assert np.allclose(theta1_e, theta1, rtol=RTOL, atol=ATOL), (
            f"(m,n,d,k)={(m, n, d, k)}: the executor's round differs from the loop "
            f"(max |diff| = {executor_diff:.3g})"
        )

    # Steady state, in interleaved blocks; each arm chains its own state.
    box = {"vec": state1, "chunk": state1_c, "exec": state1_e, "theta": theta1, "i": 1}

    def next_key():
        box["i"] += 1
        return key_list[box["i"] % len(key_list)]

    def vec_step():
        box["vec"], _ = compiled(box["vec"], data, next_key())
        return box["vec"]

    def chunk_step():
        box["chunk"], _ = chunked(box["chunk"], data_c, next_key())
        return box["chunk"]

    def executor_step():
        box["exec"], _ = executor(box["exec"], data_e, next_key())
        return box["exec"]

    def loop_step():
        box["theta"], _ = loop_round(box["theta"], clients, ROUND_LR)

    loop_per_block = int(
        max(1, min(loop_max_rounds, (loop_budget_s / blocks) // max(loop_first_s, 1e-9)))
    )
    block_s = vec_budget_s / blocks
    arms = {"vectorized": harness.Arm(vec_step, 5, block_s, 500)}
    if chunked is not None:
        arms["chunked"] = harness.Arm(chunk_step, 5, block_s / 2, 500)
    if executor is not None:
        arms["executor"] = harness.Arm(executor_step, 5, block_s, 500)
    arms["scan"] = harness.Arm(scanned, 1, block_s / 2, 10)
    arms["loop"] = harness.Arm(loop_step, loop_per_block, 0.0, loop_per_block)
    times = harness.interleaved_blocks(arms, blocks)

    vec_s = float(np.median(times["vectorized"]))
    scan_s = float(np.median(times["scan"])) / SCAN_LEN
    loop_s = float(np.median(times["loop"]))
    chunk_s = float(np.median(times["chunked"])) if chunked is not None else None
    executor_s = float(np.median(times["executor"])) if executor is not None else None

    x_bytes = int(x_np.nbytes)
    round_bytes = harness.linear_round_bytes(m, n, d)
    # k forward products X·θ_j, then one gradient X^T r for each client's chosen model
    # (the fused kernel; `xla_cost_flops` is XLA's own count of the compiled round).
    flops = 2 * m * n * d * (k + 1)
    xla_cost = compiled.cost_analysis()
    xla_cost = xla_cost[0] if isinstance(xla_cost, list) else xla_cost
    row = {
        "kind": "config",
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
        "vectorized_rounds_timed": len(times["vectorized"]),
        "timing_blocks": blocks,
        "scan_rounds_timed": len(times["scan"]) * SCAN_LEN,
        "scan_function": lib.scan_rounds_name,
        "scan_first_call_s": scan_first_s,
        "vectorized_s_per_round_min": float(np.min(times["vectorized"])),
        "vectorized_first_call_s": first_call_s,
        "vectorized_scan_s_per_round": scan_s,
        "scan_speedup": loop_s / scan_s,
        "client_chunk": chunk if chunked is not None else None,
        "vectorized_chunked_s_per_round": chunk_s,
        "chunked_speedup": loop_s / chunk_s if chunk_s else None,
        "chunked_max_abs_param_diff": chunk_diff,
        "executor_choice": None if choice is None else choice.record(),
        "executor_s_per_round": executor_s,
        "executor_compile_and_choice_s": None if executor is None else executor_compile_s,
        "executor_speedup": loop_s / executor_s if executor_s else None,
        "executor_max_abs_param_diff": executor_diff,
        "loop_rounds_timed": len(times["loop"]),
        "loop_s_per_round_min": float(np.min(times["loop"])),
        "loop_first_round_s": loop_first_s,
        "x_bytes": x_bytes,
        "round_bytes": round_bytes,
        "round_bytes_model": harness.LINEAR_ROUND_BYTES_MODEL,
        "round_GBps": round_bytes / vec_s / 1e9,
        "round_flops": flops,
        "round_flops_model": "2·m·n·d·(k + 1): k forward products, one gradient per client "
        "(4·m·n·d·k would count a gradient for every cluster model)",
        "xla_cost_flops": float(xla_cost.get("flops", float("nan"))),
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
        + (f", executor {executor_s * 1e3:8.3f} ms" if executor_s else "")
        + f")  loop {loop_s * 1e3:10.2f} ms  "
        f"speedup {row['speedup']:7.1f}  compile {compile_s:.2f} s  "
        f"max|Δθ| {max_abs_diff:.1e}"
    )
    return row


# --------------------------------------------------------------------------- sweep cell


def bench_sweep_cell(lib: Library, cell: dict, seeds: int, matmul_gflops: float, log) -> dict:
    """Times `cell_min_dist`, one data seed per call: a warm-up (compiles), then seeds 0..N−1."""
    k, m, n, d = cell["k"], cell["m"], cell["n"], cell["d"]
    runs = len(cell["lrs"]) * cell["restarts"]
    seed_key = jax.random.key(CELL_SEED)
    sigma, R = jnp.float32(cell["sigma"]), jnp.float32(cell["R"])
    lrs = jnp.asarray(cell["lrs"], jnp.float32)

    def one_seed(seed_ids):
        return lib.cell_min_dist(
            seed_key, seed_ids, sigma, R, lrs,
            k=k, m=m, n=n, d=d, rounds=cell["iterations"], restarts=cell["restarts"],
        )

    best = []

    def on_call(i, seconds, min_dist):
        if i == 0:
            log(f"  sweep cell warm-up (seed 0, compiles): {seconds:.2f} s")
            return
        md = np.asarray(min_dist)
        best.append(float(np.nanmin(md)) if np.isfinite(md).any() else float("nan"))
        log(
            f"  sweep cell seed {i - 1}: {runs} runs × {cell['iterations']} iterations "
            f"(data included) {seconds:.2f} s, best min_dist {best[-1]:.4f}"
        )

    timing = harness.compile_then_time(
        one_seed, jnp.asarray([0], jnp.int32), reps=seeds,
        next_args=lambda i, args, out: (jnp.asarray([i - 1], jnp.int32),),
        on_call=on_call,
    )
    seconds = float(np.sum(timing.times))
    per_seed = seconds / seeds
    compile_s = max(timing.first_call_s - timing.median_s, 0.0)
    flops_iter_run = 4 * m * n * d * k
    flops_seed = flops_iter_run * cell["iterations"] * runs
    gflops = flops_seed * seeds / seconds / 1e9
    return {
        "cell": {kk: (list(v) if isinstance(v, tuple) else v) for kk, v in cell.items()},
        "timed_function": "fedjax_sim.experiments.ifca_synthetic.cell_min_dist",
        "timed_call": f"cell_min_dist(jax.random.key({CELL_SEED}), [seed], sigma, R, lrs, ...): "
        "one data seed per call, its data generated inside",
        "runs_per_seed": runs,
        "seeds_official": OFFICIAL_SEEDS,
        "seeds_measured": seeds,
        "measured_seconds": seconds,
        "measured_seconds_note": f"wall time of the {seeds} measured seed(s), data generation "
        "included, after a warm-up call on seed 0 that compiles",
        "measured_seconds_per_seed": timing.times,
        "seconds_per_seed": per_seed,
        "official_40_seed_seconds": per_seed * OFFICIAL_SEEDS,
        "official_40_seed_seconds_is": "measured"
        if seeds >= OFFICIAL_SEEDS
        else f"extrapolated: mean seconds per seed over {seeds} measured seed(s) × 40",
        "official_40_seed_seconds_incl_compile": per_seed * OFFICIAL_SEEDS + compile_s,
        "compile_s": compile_s,
        "compile_s_is": "first call (seed 0) minus the median seed: cell_min_dist compiles "
        "inside its first call",
        "first_call_s": timing.first_call_s,
        "flop_count": "per iteration per run: forward X@Θ 2·m·n·d·k + backward (VJP) "
        "2·m·n·d·k = 4·m·n·d·k; elementwise work, argmin and data "
        "generation not counted",
        "flops_per_iteration_per_run": flops_iter_run,
        "flops_per_seed": flops_seed,
        "flops_40_seeds": flops_seed * OFFICIAL_SEEDS,
        "achieved_GFLOPs": gflops,
        "matmul_peak_GFLOPs": matmul_gflops,
        "fraction_of_matmul_peak": gflops / matmul_gflops,
        "best_min_dist_per_seed": best,
    }


# --------------------------------------------------------------------------- comparison row


def _cli_sources(root: pathlib.Path) -> str:
    package = root / "fedjax_sim"
    paths = [package / "cli.py", *sorted((package / "cli").rglob("*.py"))]
    return "".join(p.read_text() for p in paths if p.is_file())


def cli_has_command(root: pathlib.Path, command: str) -> tuple[bool, str]:
    """Whether the checkout's `fedjax_sim.cli` has `command`, and how that was decided.

    The source must name it as a string literal; then `--help` decides (the
    source alone when `--help` itself fails).
    """
    source = _cli_sources(root)
    if not source:
        return False, "no fedjax_sim/cli.py (or fedjax_sim/cli/) in the checkout"
    if not re.search(rf"""["']{re.escape(command)}["']""", source):
        return False, f"fedjax_sim.cli's source has no {command!r} command"
    done = harness.run_subprocess(
        [sys.executable, "-m", "fedjax_sim.cli", "--help"],
        cwd=root, env=harness.checkout_env(root), timeout=300,
    )
    if done.error() is not None:
        return True, f"named in fedjax_sim.cli's source (--help failed: {done.error()})"
    if re.search(rf"\b{re.escape(command)}\b", done.stdout):
        return True, "listed by `python -m fedjax_sim.cli --help`"
    return False, f"`python -m fedjax_sim.cli --help` does not list {command!r}"


def bench_comparison(root: pathlib.Path, timeout_s: float, log) -> dict:
    """End-to-end seconds of the CLI's `compare` command, or why there are none."""
    row = {
        "kind": "comparison",
        "command": "python -m fedjax_sim.cli " + " ".join(COMPARE_ARGS)
        + " --out TMPDIR --no-progress",
        "cwd": str(root),
        "comparison_seconds": None,
    }
    available, why = cli_has_command(root, COMPARE_ARGS[0])
    row["detected"] = why
    if not available:
        row["skipped"] = why
        log(f"comparison row skipped: {why}")
        return row
    log(f"comparison row: {row['command']} ...")
    with tempfile.TemporaryDirectory(prefix="fedjax_compare_") as tmp:
        cmd = [sys.executable, "-m", "fedjax_sim.cli", *COMPARE_ARGS,
               "--out", os.path.join(tmp, "out"), "--no-progress"]
        done = harness.run_subprocess(
            cmd, cwd=root, env=harness.checkout_env(root), timeout=timeout_s
        )
    row["wall_seconds"] = done.wall_s
    row["returncode"] = done.returncode
    if done.error() is None:
        row["comparison_seconds"] = done.wall_s
        log(f"comparison row: {done.wall_s:.1f} s")
    else:
        row["error"] = done.error()
        row["stderr_tail"] = done.stderr[-2000:]
        log(f"comparison row failed: {row['error']}")
    return row


# --------------------------------------------------------------------------- main


def _fmt_table(rows) -> str:
    def sec(x):
        return f"{x:>11.3e}" if x else f"{'-':>11}"

    head = (
        f"{'m':>7} {'n':>4} {'d':>5} {'k':>2} | {'vec s/rnd':>11} {'speedup':>8} | "
        f"{'scan s/rnd':>11} {'chunk':>6} {'chunk s/rnd':>11} | {'loop s/rnd':>11} | "
        f"{'X GB/s':>7} {'stream':>7} {'%1X':>5} {'%rnd':>5} | {'compile s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['m']:>7} {r['n']:>4} {r['d']:>5} {r['k']:>2} | "
            f"{sec(r['vectorized_s_per_round'])} {r['speedup']:>8.1f} | "
            f"{sec(r['vectorized_scan_s_per_round'])} {str(r['client_chunk'] or '-'):>6} "
            f"{sec(r['vectorized_chunked_s_per_round'])} | {sec(r['loop_s_per_round'])} | "
            f"{r['achieved_GBps']:>7.2f} {r['stream_GBps']:>7.2f} "
            f"{100 * r['achieved_fraction_of_stream']:>5.1f} "
            f"{100 * r['fraction_of_stream']:>5.1f} | {r['compile_s']:>9.2f}"
        )
    return "\n".join(lines)


# Algorithm suites measured in the same run: benchmarks/<name>.py, each with rows(quick).
SUITES = ("images", "drfa", "mixed")


def bench_suites(names, root: pathlib.Path, quick: bool, log) -> list[dict]:
    """Rows of each suite (`"kind": "suite:<name>"`); an error row where a suite fails."""
    import importlib

    out = []
    for name in names:
        if not (root / "fedjax_sim").is_dir() or not (pathlib.Path(__file__).parent
                                                      / f"{name}.py").is_file():
            continue
        log(f"\nsuite {name}")
        try:
            module = importlib.import_module(name)
            rows = module.rows(quick)
        except Exception as err:  # noqa: BLE001 -- one failing suite must not lose the others
            log(f"suite {name} failed: {type(err).__name__}: {err}")
            rows = [{"error": f"{type(err).__name__}: {err}"}]
        out += [{"kind": f"suite:{name}", **row} for row in rows]
    return out


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the JSON results here")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes, a smoke run for tests (~20-30 s on 2 CPU cores, mostly XLA compiles)",
    )
    parser.add_argument(
        "--sweep-seeds",
        type=int,
        default=None,
        help="data seeds of the sweep cell to time (default 40 on an "
        "accelerator, 2 on CPU, 1 with --quick; 0 skips the cell); "
        "fewer than 40 are extrapolated to 40",
    )
    parser.add_argument(
        "--compare-preset", dest="compare", action=argparse.BooleanOptionalAction, default=True,
        help="time `python -m fedjax_sim.cli " + " ".join(COMPARE_ARGS) + "` end to end from "
        "the measured checkout (default on; skipped where its CLI has no `compare`); "
        "--no-compare-preset or --no-compare skips it",
    )
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help=argparse.SUPPRESS)
    parser.add_argument("--compare-timeout", type=float, default=COMPARE_TIMEOUT_S,
                        help="seconds before the comparison command is killed (an error row)")
    parser.add_argument(
        "--pair", nargs=2, metavar=("OLD_JSON", "NEW_JSON"),
        help="measure nothing: print a Markdown table of two runs (see compare_runs.py)",
    )
    parser.add_argument(
        "--suites", default=",".join(SUITES),
        help="comma list of the algorithm suites measured in the same run, each a sibling "
        f"module with rows(quick) ({', '.join(SUITES)}; '' for none). Skipped with --checkout "
        "of a tree that lacks them.",
    )
    parser.add_argument("--configs", nargs="*", default=None,
                        help="m,n,d,k of each row (default: the full or --quick rows)")
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    suites = [name for name in args.suites.split(",") if name]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        parser.error(f"--suites: unknown {', '.join(unknown)}; known: {', '.join(SUITES)}")

    if args.pair:
        import compare_runs

        print(compare_runs.markdown(*args.pair))
        return []

    root = harness.resolve_checkout(args.checkout)
    lib = load_library(root)
    platform_name = jax.default_backend()
    if args.sweep_seeds is None:
        args.sweep_seeds = 1 if args.quick else (2 if platform_name == "cpu" else OFFICIAL_SEEDS)
    if args.sweep_seeds < 0:
        parser.error(f"--sweep-seeds must be >= 0; got {args.sweep_seeds}")

    def log(msg):
        print(msg, flush=True)

    started = time.perf_counter()
    meta = harness.collect_meta(root, quick=args.quick, scan_function=lib.scan_rounds_name)
    if argv is not None:
        meta["command"] = f"main({argv!r})"
    log(
        f"fedjax_sim rounds/s benchmark — {meta['date_utc']}, backend {platform_name} "
        f"({meta['cpu_model']}), {meta['host_cpus']} host CPUs, jax {jax.__version__}"
        f"{' [quick]' if args.quick else ''}\n"
        f"measuring {meta['fedjax_sim_file']} (git {meta['git_head']}"
        f"{', dirty' if meta['git_dirty'] else ''}, sources {meta['fedjax_sim_sources_sha256']})"
    )

    probes = harness.machine_ceilings(quick=args.quick)
    if args.configs:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.configs]
    if args.quick:
        configs, cell = configs if args.configs else QUICK_CONFIGS, QUICK_CELL
        budgets = dict(vec_budget_s=0.05, loop_budget_s=0.05, loop_max_rounds=2, blocks=1)
    else:
        configs, cell = configs if args.configs else FULL_CONFIGS, FULL_CELL
        budgets = dict(vec_budget_s=3.0, loop_budget_s=6.0, loop_max_rounds=3, blocks=3)
    log(
        f"stream (triad) {probes['stream_GBps']:.2f} GB/s; matmul {probes['matmul_size']}² "
        f"{probes['matmul_peak_GFLOPs']:.1f} GFLOP/s"
    )

    rows = []
    stream_Bps = probes["stream_GBps"] * 1e9
    for m, n, d, k in configs:
        row = bench_config(lib, m, n, d, k, log=log, **budgets)
        row["stream_GBps"] = probes["stream_GBps"]
        row["achieved_fraction_of_stream"] = row["achieved_GBps"] * 1e9 / stream_Bps
        row["fraction_of_stream"] = row["round_bytes"] / row["vectorized_s_per_round"] / stream_Bps
        if row["executor_s_per_round"]:
            row["executor_fraction_of_stream"] = (
                row["round_bytes"] / row["executor_s_per_round"] / stream_Bps)
        row["matmul_peak_GFLOPs"] = probes["matmul_peak_GFLOPs"]
        rows.append(row)

    sweep = None
    if args.sweep_seeds > 0:
        sweep = bench_sweep_cell(lib, cell, args.sweep_seeds, probes["matmul_peak_GFLOPs"], log)
        shape = (cell["m"], cell["n"], cell["d"], cell["k"])
        for row in rows:
            if (row["m"], row["n"], row["d"], row["k"]) == shape:
                row["sweep_cell"] = sweep

    comparison = bench_comparison(root, args.compare_timeout, log) if args.compare else None
    suite_rows = bench_suites(suites, root, args.quick, log)

    harness.finish_meta(meta, started)
    meta["probes"] = probes
    out_rows = rows + ([comparison] if comparison is not None else []) + suite_rows
    for row in out_rows:
        row["meta"] = meta

    log("")
    log(_fmt_table(rows))
    log("(%1X: one pass of X over the stream probe; %rnd: fraction_of_stream, "
        f"{harness.LINEAR_ROUND_BYTES_MODEL})")
    if sweep is not None:
        log(
            f"\nsweep cell k={cell['k']} m={cell['m']} n={cell['n']} d={cell['d']}, "
            f"{sweep['runs_per_seed']} runs × {cell['iterations']} iterations per seed: "
            f"{sweep['seeds_measured']} seed(s) measured in {sweep['measured_seconds']:.1f} s "
            f"(compile ≈ {sweep['compile_s']:.1f} s); 40 seeds: "
            f"{sweep['official_40_seed_seconds']:.1f} s ({sweep['official_40_seed_seconds_is']}); "
            f"{sweep['achieved_GFLOPs']:.1f} GFLOP/s = "
            f"{100 * sweep['fraction_of_matmul_peak']:.0f}% of the matmul probe "
            f"({sweep['matmul_peak_GFLOPs']:.1f} GFLOP/s)"
        )
    if comparison is not None and comparison["comparison_seconds"] is not None:
        log(f"comparison ({comparison['command']}): {comparison['comparison_seconds']:.1f} s")
    log(f"total {meta['total_seconds']:.1f} s")

    if args.out:
        harness.write_json(args.out, out_rows)
        log(f"wrote {args.out}")
    return out_rows


if __name__ == "__main__":
    main()
