"""Krum and the geometric median on a large cohort: time, and fraction of the machine's ceilings.

Usage:
  nice -n 5 python benchmarks/robust_aggregators.py    # writes results/robust_aggregators.json
  python benchmarks/robust_aggregators.py --quick --out /tmp/robust.json   # a smoke run

The cohort: s = 1,000 updates of P = 10⁵ float32 parameters (400 MB), every slot
reporting, one leaf. Each rule is `jax.jit(rule.aggregate)`, compiled apart, then timed
over steady calls that end in `block_until_ready` (`harness.compile_then_time`):

1. Krum (f = 100, `ops.robust.krum`): the [s, s] squared distances as one Gram matrix
   product (2 s² P flops) of the centred updates, then a sort of each row for the
   scores. Reported against the matmul peak measured in the same run; the distances
   alone (`ops.robust.pairwise_sq_distances`) are timed too, to show the product's share.
2. The geometric median (RFA, `ops.robust.geometric_median`, T = 3 smoothed Weiszfeld
   iterations from the mean): 1 + 2T passes over the updates (the mean; per iteration
   the distances and the weighted sum), about (2 + 5T) s P flops. It is bandwidth-bound:
   reported against the stream bandwidth (for those 1 + 2T reads, the least it must
   move; the program also writes one masked copy of the updates) and the matmul peak,
   both measured in the same run.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness

FULL = dict(s=1000, P=100_000, f=100, iterations=3, reps=3)
QUICK = dict(s=50, P=1000, f=5, iterations=3, reps=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" /
                                             "robust_aggregators.json"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    cfg = QUICK if args.quick else FULL

    import jax
    import jax.numpy as jnp

    from fedjax_sim.ops import robust

    meta = harness.collect_meta(args.checkout, quick=args.quick, **cfg)
    meta.update(harness.machine_ceilings(args.quick))
    s, p, t = cfg["s"], cfg["P"], cfg["iterations"]
    updates = jax.block_until_ready(
        jax.random.normal(jax.random.key(0), (s, p), jnp.float32))
    mask = jnp.ones((s,), bool)
    key = jax.random.key(1)
    peak = meta["matmul_peak_GFLOPs"]

    def timed(fn, *extra, reps=cfg["reps"]):
        timing = harness.compile_then_time(jax.jit(fn), updates, mask, *extra, reps=reps)
        return timing.median_s, timing.compile_s, timing.times

    krum = robust.krum(f=cfg["f"])
    krum_s, krum_compile, krum_times = timed(lambda x, m, k: krum.aggregate(x, m, k, ())[0], key)
    gram_s, _, gram_times = timed(robust.pairwise_sq_distances, reps=max(cfg["reps"] - 1, 1))
    gram_flops = 2 * s * s * p
    gm = robust.geometric_median(iterations=t)
    gm_s, gm_compile, gm_times = timed(lambda x, m, k: gm.aggregate(x, m, k, ())[0], key)
    gm_flops = (2 + 5 * t) * s * p
    gm_bytes = (1 + 2 * t) * s * p * 4

    figures = {
        "krum": {"median_s": krum_s, "times_s": krum_times, "compile_s": krum_compile,
                 "gram_flops": gram_flops,
                 "fraction_of_matmul_peak": gram_flops / krum_s / 1e9 / peak,
                 "distances_alone_s": gram_s, "distances_alone_times_s": gram_times,
                 "distances_fraction_of_matmul_peak": gram_flops / gram_s / 1e9 / peak},
        "geometric_median": {"median_s": gm_s, "times_s": gm_times, "compile_s": gm_compile,
                             "flops": gm_flops,
                             "bytes_read": gm_bytes,
                             "fraction_of_matmul_peak": gm_flops / gm_s / 1e9 / peak,
                             "fraction_of_stream": gm_bytes / gm_s / 1e9 / meta["stream_GBps"]},
    }
    payload = {"meta": harness.finish_meta(meta, started), "figures": figures}
    harness.write_json(args.out, payload)
    k, g = figures["krum"], figures["geometric_median"]
    print(f"s = {s}, P = {p}: Krum {k['median_s']:.2f} s ({100 * k['fraction_of_matmul_peak']:.0f} "
          f"% of the matmul peak, {peak:.0f} GFLOP/s; the distances alone "
          f"{k['distances_alone_s']:.2f} s, "
          f"{100 * k['distances_fraction_of_matmul_peak']:.0f} %); geometric median "
          f"(T = {t}) {g['median_s']:.3f} s ({100 * g['fraction_of_stream']:.0f} % of the "
          f"stream bandwidth, {meta['stream_GBps']:.1f} GB/s; "
          f"{100 * g['fraction_of_matmul_peak']:.1f} % of the matmul peak); compile "
          f"{k['compile_s']:.2f} s and {g['compile_s']:.2f} s; load average "
          f"{meta['loadavg_start'][0]:.1f} → {payload['meta']['loadavg_end'][0]:.1f}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
