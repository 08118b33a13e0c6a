"""Old vs new checkout in ONE process: the DRFA, Mixed FL 2-GT and rotated-MNIST IFCA rounds.

`ab_rounds.py` does this for the synthetic IFCA round. Here, for the rounds
of the algorithm suites (`drfa.py`, `mixed.py`, `images.py`), each checkout's
`fedjax_sim` is imported in turn (`harness.import_fresh`: the modules are
dropped from `sys.modules` in between; a compiled executable does not need
them afterwards). Each round is compiled ahead of time from the same
data, state and key, and the script checks that the two checkouts' rounds
give the same params: bit for bit by default, or within `--atol` when the new
code changed float rounding (the largest difference is recorded either way).
Then the two are timed in alternating blocks, old first in even blocks and
new first in odd ones. A matmul probe (`harness.matmul_peak`) runs before
each row, so the MLP rows state both arms as a fraction of it.

Rows, all at the sizes of the suites' benchmarks:
* `drfa`: N = 1000 linear clients, m = 100, τ = 10, batch 10;
* `mixed_gt2`: S = 100, K = 10, batch 16, MLP 64-32-10, 4096 server rows, batch 256;
* `ifca_images`: m = 320, n = 50, k = 4, τ = 10 full-batch steps, MLP 784-200-10.

Usage:
  git worktree add /tmp/fedjax_old <old commit>
  python benchmarks/ab_algorithms.py --old /tmp/fedjax_old \
      --out benchmarks/results/ab_algorithms.json
  python benchmarks/ab_algorithms.py --old /tmp/fedjax_old --rows mixed_gt2 --atol 1e-6
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

ROWS = ("drfa", "mixed_gt2", "ifca_images")


def row_flops(row: str) -> int | None:
    """The multiply-adds ×2 of one round as its suite counts them (None: no matmul to speak of)."""
    if row == "mixed_gt2":  # mixed.py: SGD steps of a 64-32-10 MLP, clients and server
        clients, steps, batch, central = 100, 10, 16, 256
        return harness.dense_flops((64, 32, 10), steps=clients * steps * batch
                                   + (steps + 1) * central + clients * batch)
    if row == "ifca_images":
        import images

        return images.round_flops(320, 50, 4, 10)
    return None


def build(lib: dict, row: str):
    """(algorithm, inputs) of one row, built with one checkout's classes."""
    algorithms, data_mod, models = lib["algorithms"], lib["data"], lib["models"]
    rng = np.random.default_rng(0)
    if row == "drfa":
        x = rng.normal(size=(1000, 20, 10)).astype(np.float32)
        y = (x @ rng.normal(size=10).astype(np.float32)).astype(np.float32)
        alg = algorithms.drfa(models.linear_regression(10), learning_rate=0.01, local_steps=10,
                              batch_size=10, participation=0.1, lambda_lr=0.001)
        return alg, data_mod.FederatedData.from_arrays(x, y)
    if row == "mixed_gt2":
        x = rng.random((100, 64, 64), np.float32)
        y = rng.integers(0, 10, (100, 64)).astype(np.int32)
        server = data_mod.ServerData({"x": jnp.asarray(rng.random((4096, 64), np.float32)),
                                      "y": jnp.asarray(rng.integers(0, 10, 4096), jnp.int32)})
        model = models.mlp_classifier((64,), (32,), 10)
        alg = lib["algorithms.mixed"].mixed_gt2(model, learning_rate=0.05, local_steps=10,
                                                batch_size=16, central_batch_size=256)
        return alg, (data_mod.FederatedData.from_arrays(x, y), server)
    if row == "ifca_images":
        x = rng.random((320, 50, 28, 28), dtype=np.float32)
        y = rng.integers(0, 10, size=(320, 50)).astype(np.int32)
        data = data_mod.FederatedData.from_arrays(x, y, cluster=np.repeat(np.arange(4), 80))
        alg = algorithms.ifca(models.mlp_classifier((28, 28), [200], 10), num_clusters=4,
                              option="model", local_steps=10, learning_rate=0.1)
        return alg, data
    raise ValueError(f"row must be one of {ROWS}; got {row!r}")


def bench_row(libs: dict, row: str, blocks: int, log, atol: float = 0.0) -> dict:
    probe = harness.matmul_peak()
    built = {}
    for arm, lib in libs.items():
        alg, inputs = build(lib, row)
        state = jax.jit(alg.init)(jax.random.key(1), inputs)
        key = jax.random.key(2)
        compiled, compile_s = harness.compile_ahead(jax.jit(alg.round), state, inputs, key)
        built[arm] = (lambda c=compiled, s=state, i=inputs, k=key: c(s, i, k)), compile_s
    outs = {arm: jax.block_until_ready(step()) for arm, (step, _) in built.items()}
    pairs = list(zip(jax.tree.leaves(outs["old"][0]), jax.tree.leaves(outs["new"][0]),
                     strict=True))
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
    diff = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)),
                            initial=0.0)) for a, b in pairs)
    if not (same or diff <= atol):
        raise AssertionError(f"{row}: the old and new rounds' states differ by up to {diff:.3g} "
                             f"(allowed: --atol {atol:g})")
    per_block = harness.old_new_blocks(
        {a: harness.Arm(built[a][0], min_calls=3, budget_s=1.0, max_calls=200) for a in built},
        blocks)
    summary = harness.new_over_old(*(
        [statistics.median(seconds) for seconds in per_block[arm]] for arm in ("old", "new")))
    flops = row_flops(row)
    fractions = {} if flops is None else {
        f"{arm}_fraction_of_matmul_peak": flops / summary[f"{arm}_s"] / 1e9
        / probe["matmul_peak_GFLOPs"] for arm in ("old", "new")}
    log(f"  {row}: old {summary['old_s'] * 1e3:.2f} ms, new {summary['new_s'] * 1e3:.2f} ms, "
        f"new/old {summary['new_over_old']:.3f} (blocks IQR {summary['block_ratio_q1']:.3f}–"
        f"{summary['block_ratio_q3']:.3f}); matmul probe {probe['matmul_peak_GFLOPs']:.1f} "
        "GFLOP/s" + "".join(f", {k} {v:.3f}" for k, v in fractions.items()))
    return {"row": row, "blocks": blocks, **summary, **fractions,
            "round_gflop": None if flops is None else flops / 1e9, "probe": probe,
            "compile_s": {arm: c for arm, (_, c) in built.items()}, "identical_state": same,
            "max_abs_diff": diff}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the old checkout (e.g. a git worktree)")
    parser.add_argument("--new", default=None, help="the new checkout (default: this one)")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    parser.add_argument("--atol", type=float, default=0.0,
                        help="largest |old − new| allowed in the first round's state (default 0: "
                        "bit for bit); for changes that alter float rounding")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    started = time.perf_counter()
    old, new = Path(args.old), harness.resolve_checkout(args.new)
    meta = harness.collect_meta(new, old_checkout=harness.source_provenance(old))
    libs = {arm: harness.import_fresh(path, ("algorithms", "algorithms.mixed", "data", "models"))
            for arm, path in (("old", old), ("new", new))}
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    results = [bench_row(libs, row, args.blocks, log, args.atol) for row in rows]
    payload = {"meta": harness.finish_meta(meta, started), "rows": results}
    if args.out:
        harness.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
