"""JAX's threefry PRNG on CPU: its rolled lowering (JAX's default) vs unrolled (tried, not kept).

    python benchmarks/ab_threefry.py --out benchmarks/results/ab_threefry.json
    python benchmarks/ab_threefry.py --quick --out /tmp/ab_threefry.json

`unroll_threefry` below registers JAX's straight-line lowering of
threefry2x32 for CPU (the one JAX uses on GPU) instead of its 5-iteration
while loop; both compute the same bits. fedjax_sim does not do this (it
would patch JAX internals for every program, and the generated-client round
got slower: benchmarks/README.md); this script measures it. Each row is
compiled twice in one process, once under each lowering
(`unroll_threefry(False)`, then `(True)`: a lowering applies to programs
compiled afterwards), compile time apart; the two outputs are checked to be
equal bit for bit, then the two executables are timed in alternating blocks
(`harness.old_new_blocks`, old = rolled), each call ending in
`block_until_ready`.

Rows:
- `normal`: `jax.random.normal(key, (10⁷,))`: the PRNG alone; its "fraction of
  stream" counts the 40 MB it writes over the stream probe.
- `generated_round`: one IFCA option-I round over generated synthetic clients
  (`clients=generated`: each chunk's rows drawn inside the round from
  fold_in(key, i)), m = 10⁵, n = d = 10, k = 4, chunks of 17,893 clients
  (the chunk `run` planned for the m = 10⁸ command), 10 restarts vmapped:
  what the population-scale runs spend their time on.
- `copies_round`: the same round over stored copies, one restart, no chunk:
  no PRNG inside (a control: its ratio should be 1).
- `mixed_gt2`: the 2-GT Mixed FL round (S = 100, K = 10; benchmarks/mixed.py's
  sizes), whose batch draws use the PRNG every local step.

Writes the rows and `meta` (CPU model, git HEAD, probes) as JSON.
"""

from __future__ import annotations

import argparse
import functools
import time

import harness
import numpy as np

SIZES = {"k": 4, "n": 10, "d": 10, "sigma": 0.1, "R": 1.0}


def unroll_threefry(unrolled: bool) -> None:
    """Lowers threefry2x32 on CPU unrolled (True) or as JAX's rolled loop (False, its default),
    for programs compiled afterwards (JAX internals: jax >= 0.7's module layout)."""
    from jax._src.random import threefry2x32 as module
    from jax.interpreters import mlir

    rule = mlir.lower_fun(functools.partial(module._threefry2x32_lowering,
                                            use_rolled_loops=not unrolled),
                          multiple_results=True)
    mlir.register_lowering(module.threefry2x32_p, rule, platform="cpu")


def both_lowerings(build):
    """build() -> (jitted fn, args); compiled under the rolled, then the unrolled lowering."""
    import jax

    out = {}
    for arm, unrolled in (("old", False), ("new", True)):
        unroll_threefry(unrolled)
        jax.clear_caches()
        fn, args = build()
        compiled, compile_s = harness.compile_ahead(fn, *args)
        out[arm] = (compiled, compile_s, args)
    unroll_threefry(False)
    return out


def row(name: str, build, blocks: int, probe: dict, written_bytes: int | None = None,
        log=print) -> dict:
    import jax

    built = both_lowerings(build)
    outputs = {arm: jax.block_until_ready(c(*args)) for arm, (c, _, args) in built.items()}
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(outputs["old"]), jax.tree.leaves(outputs["new"]), strict=True))
    if not same:
        raise AssertionError(f"{name}: the two lowerings gave different outputs")
    arms = {arm: harness.Arm(lambda c=c, args=args: c(*args), min_calls=3, budget_s=1.0,
                             max_calls=50)
            for arm, (c, _, args) in built.items()}
    per_block = harness.old_new_blocks(arms, blocks)
    medians = {arm: [float(np.median(b)) for b in per_block[arm]] for arm in per_block}
    summary = harness.new_over_old(medians["old"], medians["new"])
    result = {
        "row": name, "outputs_equal": True, "blocks": blocks,
        "rolled_s": summary["old_s"], "unrolled_s": summary["new_s"],
        "unrolled_over_rolled": summary["new_over_old"],
        "block_ratio_q1": summary["block_ratio_q1"], "block_ratio_q3": summary["block_ratio_q3"],
        "compile_s": {"rolled": built["old"][1], "unrolled": built["new"][1]},
    }
    if written_bytes is not None:
        result.update({f"{label}_fraction_of_stream": written_bytes / result[f"{label}_s"]
                       / (probe["stream_GBps"] * 1e9) for label in ("rolled", "unrolled")})
    log(f"{name}: rolled {result['rolled_s'] * 1e3:.2f} ms, unrolled "
        f"{result['unrolled_s'] * 1e3:.2f} ms, unrolled/rolled "
        f"{result['unrolled_over_rolled']:.3f} (blocks IQR {result['block_ratio_q1']:.3f}–"
        f"{result['block_ratio_q3']:.3f}); compile {result['compile_s']['rolled']:.2f} / "
        f"{result['compile_s']['unrolled']:.2f} s")
    return result


def build_normal(size: int):
    import jax

    def build():
        return jax.jit(lambda key: jax.random.normal(key, (size,))), (jax.random.key(0),)
    return build


def build_ifca(m: int, mode: str, restarts: int, chunk: int | None):
    import jax

    from fedjax_sim import ALGORITHMS, with_restarts
    from fedjax_sim.data import generated_mixture, linear_mixture
    from fedjax_sim.models.core import linear_regression

    def build():
        key = jax.random.key(0)
        make = generated_mixture if mode == "generated" else linear_mixture
        data = jax.block_until_ready(make(key, m=m, **SIZES).train)
        algorithm = ALGORITHMS["ifca"](linear_regression(SIZES["d"]), num_clusters=SIZES["k"],
                                       learning_rate=0.1, client_chunk=chunk,
                                       keep_assignments=False)
        if restarts > 1:
            algorithm = with_restarts(algorithm, restarts)
        state = jax.block_until_ready(jax.jit(algorithm.init)(key, data))
        return jax.jit(algorithm.round), (state, data, jax.random.key(1))
    return build


def build_mixed(quick: bool):
    """benchmarks/mixed.py's 2-GT round: S clients, K local steps of batch 16, MLP 64-32-10."""
    import jax
    import jax.numpy as jnp

    from fedjax_sim.algorithms.mixed import mixed_gt2
    from fedjax_sim.data import FederatedData, ServerData
    from fedjax_sim.models.zoo import mlp_classifier

    clients, steps, n, n_c = (8, 2, 16, 256) if quick else (100, 10, 64, 4096)

    def build():
        rng = np.random.default_rng(0)
        data = FederatedData.from_arrays(rng.random((clients, n, 64), np.float32),
                                         rng.integers(0, 10, (clients, n)).astype(np.int32))
        server = ServerData({"x": jnp.asarray(rng.random((n_c, 64), np.float32)),
                             "y": jnp.asarray(rng.integers(0, 10, n_c).astype(np.int32))})
        algorithm = mixed_gt2(mlp_classifier((64,), (32,), 10), learning_rate=0.05,
                              local_steps=steps, batch_size=16, central_batch_size=256,
                              w_f=0.5, w_c=0.5)
        state = jax.jit(algorithm.init)(jax.random.key(1), (data, server))
        return jax.jit(algorithm.round), (state, (data, server), jax.random.key(2))
    return build


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--out", default=str(harness.REPO / "benchmarks" / "results"
                                             / "ab_threefry.json"))
    args = parser.parse_args(argv)
    harness.use_checkout()
    started = time.perf_counter()
    meta = harness.collect_meta()
    probe = harness.machine_ceilings(quick=args.quick)
    print(f"stream {probe['stream_GBps']:.1f} GB/s, matmul {probe['matmul_peak_GFLOPs']:.0f} "
          f"GFLOP/s", flush=True)
    size, m, chunk, restarts = ((10**5, 2000, 700, 2) if args.quick
                                else (10**7, 10**5, 17893, 10))
    blocks = 2 if args.quick else args.blocks
    rows = [
        row("normal", build_normal(size), blocks, probe, written_bytes=4 * size),
        row("generated_round", build_ifca(m, "generated", restarts, chunk), blocks, probe),
        row("copies_round", build_ifca(m, "copies", 1, None), blocks, probe),
        row("mixed_gt2", build_mixed(args.quick), blocks, probe),
    ]
    rows[1].update({"m": m, "restarts": restarts, "client_chunk": chunk, **SIZES})
    rows[2].update({"m": m, "restarts": 1, **SIZES})
    harness.write_json(args.out, {"meta": harness.finish_meta({**meta, **probe}, started),
                                  "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
