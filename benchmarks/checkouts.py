"""This checkout against another, side by side in ONE process: the headline rounds of each family.

Two separate benchmark runs are minutes apart, and on a shared 2-core machine the
load moves times by ±30 % in that span, more than a 5 % budget. Here both
checkouts are imported into the same Python process one after the other
(`harness.import_fresh`; a compiled executable needs its modules no more), each
round is compiled ahead of time from the same data, state and key, the two
rounds are checked to agree (bit for bit, or within `--atol`), and they are timed
in alternating blocks (`harness.old_new_blocks`), so a burst of load falls on both.

Rows (the sizes of the family suites):
* `ifca_synthetic`: IFCA option I on the linear mixture, (m, n, d, k) = (10⁴, 10, 10, 4),
  20 chained rounds per call, compiled as each checkout compiles a round called alone;
* `ifca_images`: IFCA option II, m = 320 clients of 50 MNIST-sized images, k = 4,
  τ = 10 full-batch steps, MLP 784-200-10;
* `drfa`: N = 1000 linear clients, m = 100, τ = 10, batch 10;
* `mixed_gt2`: S = 100, K = 10, batch 16, MLP 64-32-10, 4096 server rows, batch 256.

A checkout's algorithms are built through whichever surface it has: factories that
take a `ClientTraining` (`algorithms.sgd`), or the earlier keyword arguments.

Usage:
  git worktree add /tmp/base <commit>
  python benchmarks/checkouts.py --other /tmp/base --out benchmarks/results/checkouts.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

ROWS = ("ifca_synthetic", "ifca_images", "drfa", "mixed_gt2")
CHAINED = 20  # rounds per timed call of the synthetic row


def build(lib: dict, row: str):
    """(round function to jit, algorithm, inputs, chained rounds per call) of one row."""
    algorithms, data_mod, models = lib["algorithms"], lib["data"], lib["models"]
    new = hasattr(algorithms, "sgd")  # factories that take a ClientTraining
    rng = np.random.default_rng(0)

    def sgd(lr, steps=1, batch_size=None):
        return algorithms.sgd(lr, steps=steps, batch_size=batch_size)

    if row == "ifca_synthetic":
        data = data_mod.linear_mixture(jax.random.key(0), k=4, m=10_000, n=10, d=10,
                                       sigma=0.1, R=0.25).train
        model = models.linear_regression(10)
        alg = (algorithms.ifca(model, sgd(0.1), num_clusters=4) if new
               else algorithms.ifca(model, num_clusters=4, learning_rate=0.1))
        return alg, data, CHAINED
    if row == "ifca_images":
        x = rng.random((320, 50, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, size=(320, 50)).astype(np.int32)
        data = data_mod.FederatedData.from_arrays(x, y, cluster=np.repeat(np.arange(4), 80))
        model = models.mlp_classifier((28, 28), [200], 10)
        alg = (algorithms.ifca(model, sgd(0.1, steps=10), num_clusters=4, option="model")
               if new else algorithms.ifca(model, num_clusters=4, option="model",
                                           local_steps=10, learning_rate=0.1))
        return alg, data, 1
    if row == "drfa":
        x = rng.normal(size=(1000, 20, 10)).astype(np.float32)
        y = (x @ rng.normal(size=10).astype(np.float32)).astype(np.float32)
        model = models.linear_regression(10)
        alg = (algorithms.drfa(model, sgd(0.01, steps=10, batch_size=10), participation=0.1,
                               lambda_lr=0.001) if new else
               algorithms.drfa(model, learning_rate=0.01, local_steps=10, batch_size=10,
                               participation=0.1, lambda_lr=0.001))
        return alg, data_mod.FederatedData.from_arrays(x, y), 1
    if row == "mixed_gt2":
        x = rng.random((100, 64, 64), np.float32)
        y = rng.integers(0, 10, (100, 64)).astype(np.int32)
        server = data_mod.ServerData({"x": jnp.asarray(rng.random((4096, 64), np.float32)),
                                      "y": jnp.asarray(rng.integers(0, 10, 4096), jnp.int32)})
        model = models.mlp_classifier((64,), (32,), 10)
        mixed = lib["algorithms.mixed"]
        alg = (mixed.mixed_gt2(model, sgd(0.05, steps=10, batch_size=16),
                               central=sgd(0.05, steps=10, batch_size=256)) if new else
               mixed.mixed_gt2(model, learning_rate=0.05, local_steps=10, batch_size=16,
                               central_batch_size=256))
        return alg, (data_mod.FederatedData.from_arrays(x, y), server), 1
    raise ValueError(f"row must be one of {ROWS}; got {row!r}")


def compiled_round(lib: dict, alg, inputs, state, key):
    """The round compiled as the checkout compiles a round called alone: through its
    kernel-form planner where it has one, else its backend's per-shape options."""
    tuning = lib.get("tuning")
    if tuning is not None:
        compiled, inputs, _ = tuning.compile_round(alg, state, inputs, key)
        return compiled, inputs
    backend = lib["backend"]
    fn = backend.jit(alg.round, backend.feature_size(inputs))
    return fn.lower(state, inputs, key).compile(), inputs


def bench_row(checkouts: dict, row: str, blocks: int, log, atol: float) -> dict:
    """Each checkout imported afresh, its round built and compiled, before the next is
    imported (a program is built by the modules of the checkout it measures); then both
    timed in alternating blocks."""
    probe = harness.machine_ceilings()
    built, firsts = {}, {}
    for arm, path in checkouts.items():
        lib = import_checkout(path)
        alg, inputs, chain = build(lib, row)
        state = jax.jit(alg.init)(jax.random.key(1), inputs)
        keys = list(jax.random.split(jax.random.key(2), chain))
        t0 = time.perf_counter()
        compiled, inputs = compiled_round(lib, alg, inputs, state, keys[0])
        compile_s = time.perf_counter() - t0

        def step(c=compiled, s=state, i=inputs, ks=keys):
            out = s
            for k in ks:
                out, _ = c(out, i, k)
            return out

        firsts[arm] = jax.block_until_ready(compiled(state, inputs, keys[0])[0])
        built[arm] = (step, compile_s, chain)
    # The fields both states have (a redesign may add some): each compared leaf by leaf.
    a, b = (f._asdict() if hasattr(f, "_asdict") else {"state": f}
            for f in (firsts["other"], firsts["this"]))
    pairs = [pair for name in a.keys() & b.keys()
             for pair in zip(jax.tree.leaves(a[name]), jax.tree.leaves(b[name]), strict=True)]
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)),
                            initial=0.0)) for a, b in pairs)
    if diff > atol:
        raise AssertionError(f"{row}: the two checkouts' first rounds differ by up to "
                             f"{diff:.3g} (allowed: --atol {atol:g})")
    arms = {"old": harness.Arm(built["other"][0], min_calls=3, budget_s=1.0, max_calls=200),
            "new": harness.Arm(built["this"][0], min_calls=3, budget_s=1.0, max_calls=200)}
    per_block = harness.old_new_blocks(arms, blocks)
    chain = built["this"][2]
    summary = harness.new_over_old(*(
        [statistics.median(seconds) / chain for seconds in per_block[arm]]
        for arm in ("old", "new")))
    log(f"  {row}: other {summary['old_s'] * 1e3:.3f} ms, this {summary['new_s'] * 1e3:.3f} ms "
        f"a round, this/other {summary['new_over_old']:.3f} (blocks IQR "
        f"{summary['block_ratio_q1']:.3f}–{summary['block_ratio_q3']:.3f}); max |diff| {diff:.2g}")
    return {"row": row, "blocks": blocks, "rounds_per_call": chain,
            "other_s_per_round": summary["old_s"], "this_s_per_round": summary["new_s"],
            "this_over_other": summary["new_over_old"],
            "block_ratio_median": summary["block_ratio_median"],
            "block_ratio_q1": summary["block_ratio_q1"],
            "block_ratio_q3": summary["block_ratio_q3"],
            "compile_s": {"other": built["other"][1], "this": built["this"][1]},
            "max_abs_diff_first_round": diff, "ceilings": probe}


MODULES = ("algorithms", "algorithms.mixed", "data", "models", "backend")


def import_checkout(path) -> dict:
    """The checkout's modules (its kernel-form planner `tuning` too, where it has one)."""
    try:
        return harness.import_fresh(path, (*MODULES, "tuning"))
    except ModuleNotFoundError:
        return {**harness.import_fresh(path, MODULES), "tuning": None}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--this", default=None, help="this checkout (default: the repository)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="largest |this − other| allowed in the first round's state "
                        "(default 0: bit for bit)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    started = time.perf_counter()
    other, this = Path(args.other), harness.resolve_checkout(args.this)
    meta = harness.collect_meta(this, other_checkout=harness.source_provenance(other))
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    results = [bench_row({"other": other, "this": this}, row, args.blocks, log, args.atol)
               for row in rows]
    payload = {"meta": harness.finish_meta(meta, started), "rows": results}
    if args.out:
        harness.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
