"""Old vs new checkout in ONE process: the IFCA option-I round and the sweep cell, interleaved.

Two `rounds_per_sec.py` runs, one per checkout, are minutes apart; on the shared
2-core machine the load moves the times by ±30 % in that span, so they cannot
resolve the 5 % the "no regression" target asks for. Here both checkouts are
imported into the same Python process, one after the other (the `fedjax_sim`
modules are dropped from `sys.modules` between them; a compiled XLA executable
does not depend on them afterwards), each round is compiled ahead of time, and
the two are timed in alternating blocks (`harness.interleaved_blocks`, order
reversed every block), so a burst of other load falls on both.

Usage:
  git worktree add /tmp/fedjax_old b9b1bc9
  python benchmarks/ab_rounds.py --old /tmp/fedjax_old --out benchmarks/results/ab_rounds.json
  python benchmarks/ab_rounds.py --old /tmp/fedjax_old --cell-seeds 0   # rounds only

Rows: the rounds_per_sec.py configs (m, n, d, k) = (100, 100, 1000, 2), (1000, 10, 10, 4),
(10⁴, 10, 10, 4), (10⁵, 10, 10, 4): median seconds per round (blocks of `--rounds`
chained rounds, each block ending in `block_until_ready`), new/old of the medians, and
the median and quartiles of the per-block new/old ratios. The sweep cell
(`experiments.ifca_synthetic.cell_min_dist`, k = 2, m = n = 100, d = 1000, 3 lrs × 10
restarts × 300 iterations, one data seed per call) alternates old/new `--cell-seeds`
times after a warm-up call each (compile_s is that call minus the median). Both
checkouts' rounds start from the same data and state, and the script checks that they
give the same assignments and cluster params to 1e-5 before timing. Each row runs a
stream probe (`harness.stream_bandwidth`) first and states both arms as
`fraction_of_stream` (`harness.linear_round_bytes` per round over it).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

CONFIGS = ((100, 100, 1000, 2), (1000, 10, 10, 4), (10000, 10, 10, 4), (100000, 10, 10, 4))


def import_checkout(path: Path):
    """fedjax_sim of `path`, freshly imported (any other fedjax_sim modules dropped first)."""
    mods = harness.import_fresh(path, ("algorithms", "data", "models", "backend",
                                       "experiments.ifca_synthetic"))
    algorithms = mods["algorithms"]
    try:  # a checkout that chooses its kernel form per machine (fedjax_sim.tuning)
        compile_round = importlib.import_module("fedjax_sim.tuning").compile_round
    except ImportError:
        compile_round = None
    return {
        "compile_round": compile_round,
        "ifca": algorithms.ifca if callable(algorithms.ifca) else algorithms.ifca.ifca,
        "linear_mixture": mods["data"].linear_mixture,
        "linear_regression": mods["models"].linear_regression,
        "backend": mods["backend"],
        "cell_min_dist": mods["experiments.ifca_synthetic"].cell_min_dist,
    }


def compiled_round(lib, m, n, d, k):
    """(compiled round, state0, data, keys) of one checkout at (m, n, d, k)."""
    mixture = jax.jit(lib["linear_mixture"], static_argnames=("k", "m", "n", "d", "n_test"))
    data = mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1, R=0.25).train
    alg = lib["ifca"](lib["linear_regression"](d), num_clusters=k, learning_rate=0.1)
    state = alg.init(jax.random.key(1), data)
    keys = list(jax.random.split(jax.random.key(2), 64))
    if lib["compile_round"] is not None:  # in the form timed fastest for calls one by one
        t0 = time.perf_counter()
        compiled, data, _ = lib["compile_round"](alg, state, data, keys[0])
        return compiled, time.perf_counter() - t0, state, data, keys
    compiled, compile_s = harness.compile_ahead(lib["backend"].jit(alg.round, d), state, data,
                                                keys[0])
    return compiled, compile_s, state, data, keys


def chained(compiled, state, data, keys, rounds):
    def step():
        s = state
        for i in range(rounds):
            s, metrics = compiled(s, data, keys[i % len(keys)])
        return s, metrics
    return step


def bench_rounds(libs, m, n, d, k, blocks, rounds, log):
    probe = harness.stream_bandwidth()  # this row's ceiling, measured beside it
    built = {arm: compiled_round(lib, m, n, d, k) for arm, lib in libs.items()}
    (c_old, _, s0, data_old, keys), (c_new, _, s0n, data_new, _) = built["old"], built["new"]
    old1, _ = c_old(s0, data_old, keys[0])
    new1, _ = c_new(s0n, data_new, keys[0])
    same_assignment = bool(np.array_equal(np.asarray(old1.assignment),
                                          np.asarray(new1.assignment)))
    diff = float(np.max(np.abs(np.asarray(old1.cluster_params) -
                               np.asarray(new1.cluster_params))))
    if not same_assignment or diff > 1e-5:
        raise AssertionError(f"old and new rounds differ at {(m, n, d, k)}: assignments equal "
                             f"{same_assignment}, max param diff {diff}")
    steps = {arm: chained(c, s, data, keys, rounds) for arm, (c, _, s, data, keys) in built.items()}
    for step in steps.values():  # warm
        jax.block_until_ready(step())
    per_block = harness.old_new_blocks(
        {a: harness.Arm(steps[a], min_calls=1, max_calls=1) for a in steps}, blocks)
    times = {arm: [seconds[0] / rounds for seconds in per_block[arm]] for arm in per_block}
    summary = harness.new_over_old(times["old"], times["new"])
    old_s, new_s = summary["old_s"], summary["new_s"]
    row = {
        "m": m, "n": n, "d": d, "k": k, "blocks": blocks, "rounds_per_block": rounds,
        "old_s_per_round": old_s, "new_s_per_round": new_s,
        **{key: summary[key] for key in ("new_over_old", "block_ratio_median",
                                         "block_ratio_q1", "block_ratio_q3")},
        "compile_s": {arm: b_[1] for arm, b_ in built.items()},
        "verified_equal": True, "max_abs_param_diff": diff,
        "stream_GBps": probe["stream_GBps"],
        **{f"{arm}_fraction_of_stream": harness.linear_round_bytes(m, n, d) / seconds
           / (probe["stream_GBps"] * 1e9) for arm, seconds in (("old", old_s), ("new", new_s))},
    }
    log(f"  {(m, n, d, k)}: old {old_s * 1e6:.1f} µs, new {new_s * 1e6:.1f} µs, new/old "
        f"{row['new_over_old']:.3f} (blocks: median {row['block_ratio_median']:.3f}, "
        f"IQR {row['block_ratio_q1']:.3f}–{row['block_ratio_q3']:.3f}); stream "
        f"{probe['stream_GBps']:.1f} GB/s, fraction old {row['old_fraction_of_stream']:.3f} "
        f"new {row['new_fraction_of_stream']:.3f}")
    return row


def bench_cell(libs, seeds, log):
    def one_seed(lib):
        def call(seed):
            return lib["cell_min_dist"](
                jax.random.key(0), jnp.asarray([seed], jnp.int32), jnp.float32(0.1),
                jnp.float32(0.25), jnp.asarray([1.0, 0.1, 0.01], jnp.float32),
                k=2, m=100, n=100, d=1000, rounds=300, restarts=10)
        return call

    calls = {arm: one_seed(lib) for arm, lib in libs.items()}
    first = {}
    for arm, call in calls.items():
        start = time.perf_counter()
        jax.block_until_ready(call(0))
        first[arm] = time.perf_counter() - start
    times, best = {"old": [], "new": []}, {"old": [], "new": []}
    for b in range(seeds):
        for arm in (("old", "new") if b % 2 == 0 else ("new", "old")):
            start = time.perf_counter()
            out = jax.block_until_ready(calls[arm](b + 1))
            times[arm].append(time.perf_counter() - start)
            best[arm].append(float(np.nanmin(np.asarray(out))))
        log(f"  sweep cell seed {b + 1}: old {times['old'][-1]:.2f} s, "
            f"new {times['new'][-1]:.2f} s")
    old_s, new_s = statistics.median(times["old"]), statistics.median(times["new"])
    return {
        "cell": "k=2 m=n=100 d=1000 sigma=0.1 R=0.25 lrs=(1, 0.1, 0.01) restarts=10 "
                "iterations=300, one data seed per call",
        "seeds_timed": seeds, "old_s_per_seed": old_s, "new_s_per_seed": new_s,
        "new_over_old": new_s / old_s, "times": times,
        "compile_s": {arm: max(first[arm] - statistics.median(times[arm]), 0.0) for arm in first},
        "best_min_dist": best,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout (e.g. a git worktree)")
    parser.add_argument("--new", default=None, help="the new checkout (default: this one)")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=20, help="chained rounds per block")
    parser.add_argument("--cell-seeds", type=int, default=4, help="0 skips the sweep cell")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    old, new = Path(args.old), harness.resolve_checkout(args.new)
    meta = harness.collect_meta(new, old_checkout=harness.source_provenance(old))
    libs = {"old": import_checkout(old), "new": import_checkout(new)}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = []
    for m, n, d, k in CONFIGS:
        blocks = max(args.blocks // 4, 6) if m >= 100000 else args.blocks
        rows.append(bench_rounds(libs, m, n, d, k, blocks, args.rounds, log))
    cell = bench_cell(libs, args.cell_seeds, log) if args.cell_seeds else None
    payload = {"meta": harness.finish_meta(meta, started), "rows": rows, "sweep_cell": cell}
    if args.out:
        harness.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
