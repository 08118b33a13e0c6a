"""Evaluating generated clients: one drawn chunk (old) vs cache-sized blocks (new), one process.

    python benchmarks/generated_eval.py --out benchmarks/results/generated_eval.json
    python benchmarks/generated_eval.py --quick --out /tmp/generated_eval.json

A run over generated synthetic clients (`clients=generated`, the population-scale
runs: `fedjax-sim run ifca-synthetic --set m=100000000 n=10 d=10 k=4 rounds=3`)
evaluates its clients a host chunk at a time (`evaluate_in_chunks`: 17,893 clients
for that command). Each row below is one such chunk's program, IFCA's evaluation
with 10 restarts vmapped (`with_restarts`), compiled both ways in this process:

- old: the chunk's rows drawn at once (`data.take(ids)`: [17 893, n, d] from
  per-client threefry streams), then evaluated (the code before this script);
- new: the chunk kept as generated clients (`data.subset(ids)`), which the
  evaluation draws and evaluates `ClientSource.map_chunk()` clients at a time
  (`data.synthetic.MAP_DRAW_FLOATS` floats: 2 MiB).

Both give every client's loss and chosen cluster; the script checks they agree
(assignments equal but for near-ties, losses to 1e-5: the drawn targets round
differently inside another program) and times the two executables in alternating
blocks (`harness.old_new_blocks`), compile time apart, each call ending in
`block_until_ready`. The `normal` rows time the PRNG alone: `jax.random.normal`
of one chunk's test rows as one array (old) and in blocks of the new size (new).

"Fraction of stream": the bytes of drawn rows (x and y, f32) the chunk produces,
over its time, against the stream probe of the same run: how far a draw-bound
evaluation is from moving its rows at the machine's bandwidth (it is bound by
threefry's integer work, which XLA:CPU runs as a loop over the drawn array).

Writes the rows and `meta` (CPU model, git HEAD, probes) as JSON.
"""

from __future__ import annotations

import argparse
import time

import harness
import numpy as np

CHUNK = 17_893  # the host chunk `run` plans for the m = 10⁸ command (benchmarks/MEMORY.md)


def _rows(quick: bool):
    if quick:
        return [("test", 100, 600, 2), ("train", 10, 600, 2)]
    # (split, n rows per client, clients in the chunk, restarts)
    return [("test", 100, CHUNK, 10), ("train", 10, CHUNK, 10)]


def _evaluation_row(split, n, chunk, restarts, blocks):
    import jax
    import jax.numpy as jnp

    from fedjax_sim import ALGORITHMS, backend
    from fedjax_sim.algorithms import with_restarts
    from fedjax_sim.data import generated_mixture, synthetic
    from fedjax_sim.models.core import linear_regression

    k, d, m = 4, 10, 4 * chunk
    problem = generated_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1, R=1.0,
                                n_test=n)
    data = problem.test if split == "test" else problem.train
    algorithm = with_restarts(ALGORITHMS["ifca"](linear_regression(d), num_clusters=k,
                                                 learning_rate=0.1, client_chunk=chunk),
                              restarts)
    state = jax.jit(algorithm.init)(jax.random.key(1), data)

    def part(take):
        def fn(state, data, start):
            ids = jnp.minimum(start + jnp.arange(chunk, dtype=jnp.int32), m - 1)
            return algorithm.evaluate(state, take(data, ids))
        return backend.jit(fn, d)

    start = jnp.int32(chunk)  # the second chunk: clients of cluster 1
    programs, compile_s = {}, {}
    for arm, take in (("old", lambda data, ids: data.take(ids)),
                      ("new", lambda data, ids: data.subset(ids))):
        t0 = time.perf_counter()
        programs[arm] = part(take).lower(state, data, start).compile()
        compile_s[arm] = time.perf_counter() - t0
    outs = {arm: jax.block_until_ready(p(state, data, start)) for arm, p in programs.items()}
    old, new = outs["old"], outs["new"]
    losses_old = np.asarray(old["client_loss"], np.float64)
    losses_new = np.asarray(new["client_loss"], np.float64)
    agree = {
        "assignments_differing": int((np.asarray(old["assignment"])
                                      != np.asarray(new["assignment"])).sum()),
        "client_loss_max_rel_diff": float(np.max(np.abs(losses_new - losses_old)
                                                 / np.maximum(np.abs(losses_old), 1e-30))),
    }
    if agree["client_loss_max_rel_diff"] > 1e-5 or agree["assignments_differing"] > 1e-4 * (
            chunk * restarts):
        raise AssertionError(f"old and new evaluations disagree: {agree}")
    arms = {arm: harness.Arm(lambda p=p: p(state, data, start), min_calls=3)
            for arm, p in programs.items()}
    times = harness.old_new_blocks(arms, blocks)
    summary = harness.new_over_old([float(np.median(b)) for b in times["old"]],
                                   [float(np.median(b)) for b in times["new"]])
    return {
        "row": f"ifca evaluate, {split} rows: {chunk} generated clients × n = {n}, d = {d}, "
               f"k = {k}, {restarts} restarts",
        "clients": chunk, "n": n, "d": d, "k": k, "restarts": restarts,
        "drawn_bytes": chunk * n * (d + 1) * 4,
        "map_chunk_new": data.subset(jnp.arange(chunk)).map_chunk(),
        "map_draw_floats": synthetic.MAP_DRAW_FLOATS,
        "compile_s": compile_s, "agreement": agree, **summary,
        "block_seconds": times,
    }


def _normal_row(n, chunk, blocks):
    import jax

    from fedjax_sim.data import synthetic

    floats = chunk * n * 11
    block = max(1, synthetic.MAP_DRAW_FLOATS // (n * 11))
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(np.arange(chunk))

    def one(k):
        return jax.random.normal(k, (n * 11,))

    programs = {
        "old": jax.jit(lambda ks: jax.vmap(one)(ks)).lower(keys).compile(),
        "new": jax.jit(lambda ks: jax.lax.map(one, ks, batch_size=block)).lower(keys).compile(),
    }
    a, b = (np.asarray(programs[arm](keys)) for arm in ("old", "new"))
    if not np.array_equal(a, b):
        raise AssertionError("blocked draws differ from one draw")
    arms = {arm: harness.Arm(lambda p=p: p(keys), min_calls=3) for arm, p in programs.items()}
    times = harness.old_new_blocks(arms, blocks)
    summary = harness.new_over_old([float(np.median(b)) for b in times["old"]],
                                   [float(np.median(b)) for b in times["new"]])
    return {"row": f"jax.random.normal: {chunk} client streams × {n * 11} floats "
                   f"(new: lax.map blocks of {block} clients)",
            "drawn_bytes": floats * 4, **summary, "block_seconds": times}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--blocks", type=int, default=None, help="alternating blocks per row")
    parser.add_argument("--out", default="benchmarks/results/generated_eval.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    meta = harness.collect_meta(quick=args.quick)
    meta.update(harness.machine_ceilings(quick=args.quick))
    blocks = args.blocks or (2 if args.quick else 8)
    rows = []
    for split, n, chunk, restarts in _rows(args.quick):
        rows.append(_evaluation_row(split, n, chunk, restarts, blocks))
        rows.append(_normal_row(n, chunk, blocks))
    for row in rows:
        for arm in ("old", "new"):
            row[f"fraction_of_stream_{arm}"] = (
                row["drawn_bytes"] / row[f"{arm}_s"] / 1e9 / meta["stream_GBps"])
        print(f"{row['row']}: old {row['old_s'] * 1e3:.1f} ms, new {row['new_s'] * 1e3:.1f} ms, "
              f"new/old {row['new_over_old']:.2f} (blocks {row['block_ratio_q1']:.2f}–"
              f"{row['block_ratio_q3']:.2f}); stream {row['fraction_of_stream_old']:.1%} → "
              f"{row['fraction_of_stream_new']:.1%}", flush=True)
    harness.write_json(args.out, {"meta": harness.finish_meta(meta, started), "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
