"""Old vs new checkout in one process, timed by wall clock AND by the process's CPU time.

On a shared machine whose load is far above its core count, wall-clock times of a round
move by 2-5× from block to block (the process waits for a core), while the CPU time it
spends (`time.process_time`, all its threads) moves much less. For rounds that run
mostly on one thread (these do: CPU ≈ wall on a quiet machine) the CPU time is the
steadier A/B. Rows: IFCA option-I synthetic rounds (n = 10, d = 10, k = 4) at the m
given, 20 chained rounds per sample (`--wide`: also (m, n, d, k) = (100, 100, 1000, 2), the
fourth `rounds_per_sec.py` row); `mixed_gt2` (the `ab_algorithms.py` row), 3 calls
per sample; `--eval-m`: IFCA's evaluation with 10 restarts vmapped (`with_restarts`) on m
clients of n = 100 rows (the synthetic runs' test sets: n_test = 100), d = 10, k = 4, 3
calls per sample. Samples alternate old/new, order reversed every repetition; min and median
are printed. Before timing, the two checkouts' first rounds are checked to agree.

    python benchmarks/ab_cpu_time.py --old /tmp/fedjax_old --ifca-m 1000,10000 --reps 16
    python benchmarks/ab_cpu_time.py --old /tmp/fedjax_old --ifca-m '' --mixed --reps 12
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ab_algorithms  # noqa: E402
import harness  # noqa: E402


def ifca_arm(lib, m: int, n: int = 10, d: int = 10, k: int = 4):
    data = lib["data"].linear_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1,
                                      R=1.0).train
    alg = lib["algorithms"].ifca(lib["models"].linear_regression(d), num_clusters=k,
                                 learning_rate=0.1)
    state = alg.init(jax.random.key(1), data)
    compiled = lib["backend"].jit(alg.round, d).lower(state, data, jax.random.key(2)).compile()
    first = jax.block_until_ready(compiled(state, data, jax.random.key(2))[0])
    keys = list(jax.random.split(jax.random.key(5), 20))

    def run():
        s = state
        for key in keys:
            s, _ = compiled(s, data, key)
        return s
    return run, 20, (first.assignment, first.cluster_params)


def eval_arm(lib, m: int, n: int = 100, d: int = 10, k: int = 4, restarts: int = 10):
    data = lib["data"].linear_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1,
                                      R=1.0).train
    alg = lib["algorithms"].with_restarts(
        lib["algorithms"].ifca(lib["models"].linear_regression(d), num_clusters=k,
                               learning_rate=0.1), restarts)
    state = jax.jit(alg.init)(jax.random.key(1), data)
    compiled = lib["backend"].jit(alg.evaluate, d).lower(state, data).compile()
    first = jax.block_until_ready(compiled(state, data))

    def run():
        for _ in range(3):
            out = compiled(state, data)
        return out
    return run, 3, (first["client_loss"], first["assignment"])


def mixed_arm(lib):
    alg, inputs = ab_algorithms.build(lib, "mixed_gt2")
    state = jax.jit(alg.init)(jax.random.key(1), inputs)
    compiled = jax.jit(alg.round).lower(state, inputs, jax.random.key(2)).compile()
    first = jax.block_until_ready(compiled(state, inputs, jax.random.key(2))[0])

    def run():
        for _ in range(3):
            out = compiled(state, inputs, jax.random.key(2))
        return out
    return run, 3, jax.tree.leaves(first.params)


def time_pair(arms: dict, reps: int) -> dict:
    wall = {a: [] for a in arms}
    cpu = {a: [] for a in arms}
    for r in range(reps):
        for arm in (("old", "new") if r % 2 == 0 else ("new", "old")):
            run, calls, _ = arms[arm]
            t, p = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            wall[arm].append((time.perf_counter() - t) / calls)
            cpu[arm].append((time.process_time() - p) / calls)
    return {arm: {"wall_min_s": min(wall[arm]), "wall_median_s": float(np.median(wall[arm])),
                  "cpu_min_s": min(cpu[arm]), "cpu_median_s": float(np.median(cpu[arm]))}
            for arm in arms}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", default=None)
    parser.add_argument("--ifca-m", default="1000,10000", help="comma list of m ('' for none)")
    parser.add_argument("--wide", action="store_true",
                        help="also the IFCA round at (m, n, d, k) = (100, 100, 1000, 2)")
    parser.add_argument("--mixed", action="store_true", help="also the 2-GT round")
    parser.add_argument("--eval-m", default="", help="comma list of m: IFCA's evaluation "
                        "with 10 restarts on m clients of 100 rows")
    parser.add_argument("--reps", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    new = harness.resolve_checkout(args.new)
    meta = harness.collect_meta(new, old_checkout=harness.source_provenance(Path(args.old)))
    libs = {arm: harness.import_fresh(path, ("backend", "algorithms", "algorithms.mixed",
                                             "data", "models"))
            for arm, path in (("old", Path(args.old)), ("new", new))}
    rows = []
    specs = [(f"ifca m={m}", lambda lib, m=int(m): ifca_arm(lib, m))
             for m in args.ifca_m.split(",") if m]
    if args.wide:
        specs.append(("ifca m=100 n=100 d=1000 k=2",
                      lambda lib: ifca_arm(lib, 100, n=100, d=1000, k=2)))
    if args.mixed:
        specs.append(("mixed_gt2", mixed_arm))
    specs += [(f"ifca evaluate, 10 restarts, m={m}, n=100", lambda lib, m=int(m): eval_arm(lib, m))
              for m in args.eval_m.split(",") if m]
    for name, build in specs:
        arms = {arm: build(lib) for arm, lib in libs.items()}
        for a, b in zip(arms["old"][2], arms["new"][2], strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        result = time_pair(arms, args.reps)
        rows.append({"row": name, "reps": args.reps, **result})
        for arm in ("old", "new"):
            r = result[arm]
            print(f"{name} {arm}: wall min {r['wall_min_s'] * 1e6:.1f} med "
                  f"{r['wall_median_s'] * 1e6:.1f} µs | cpu min {r['cpu_min_s'] * 1e6:.1f} med "
                  f"{r['cpu_median_s'] * 1e6:.1f} µs", flush=True)
    payload = {"meta": harness.finish_meta(meta, started), "rows": rows}
    if args.out:
        harness.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
