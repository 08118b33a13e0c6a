"""One FedAvg round of a CNN in both convolution forms, side by side in one run.

The round of the `fedavg-cifar10-pfl` preset (built by its own experiment: users of 50
images, one local epoch of batch 10 = 5 local steps at lr 0.1, the cohort vmapped), on
synthetic CIFAR-shaped data (random uint8 images: the time does not depend on the
pixels), with pfl-research's `simple_cnn` (`models.zoo.simple_cnn`, flax `nn.Conv`
layers as a user writes them), in each convolution form (`models.conv`):

  "xla":     XLA's convolution, the module as written;
  "patches": each nn.Conv as its input's shifted slices × the kernel, one dot_general
             (the default on CPU).

Rows: both forms at a cohort of `--small-cohort` users (default 2: XLA's form takes
about 10 s per user on a 2-core CPU, so a 50-user round would take many minutes), and
the patches form at the full cohort of 50. For each row: `jax.jit(round)` compiled apart
(`.lower().compile()`), then rounds timed one by one (`block_until_ready`) until
`--budget` seconds have passed (at least one), median (the first dropped when there
are three or more); GFLOP/s by the CNN's FLOP count (`standard_workloads.flops`:
forward, weight gradients and input gradients of the layers but the first, ×2) and its
fraction of the matmul peak (`harness.matmul_peak`) measured in the same run. The two
forms' parameters after one round from the same state at the small cohort are compared
(max |Δ|): the same numbers to float rounding.

Usage:
  nice -n 5 python benchmarks/conv_round.py                   # a few minutes on 2 cores
  python benchmarks/conv_round.py --dry-run --out /tmp/cr.json   # tiny, seconds
Results: `results/conv_round.json` beside this script (or --out), strict JSON with the CPU
model and git HEAD (`harness.collect_meta`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import harness
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "conv_round.json"
# The round's workload: users of 50 images, cohort 50, batch 10 (5 local steps).
FULL = {"datapoints_per_user": 50, "cohort_size": 50, "batch_size": 10}
DRY = {"datapoints_per_user": 5, "cohort_size": 3, "batch_size": 5}


def measure(form: str, size: dict, budget_s: float, log=print):
    """(row, params after the first round) of the preset's round in this conv form."""
    import jax
    from standard_workloads import flops

    from fedjax_sim.experiments import PRESETS, study
    from fedjax_sim.experiments.pfl_cifar10 import PFL

    os.environ["FEDJAX_SIM_CONV_FORM"] = form  # read when the model is built
    s = dict(PRESETS["fedavg-cifar10-pfl"].defaults)
    s.update({k: v for k, v in size.items() if k in s})
    rng = np.random.default_rng(0)
    train = size["cohort_size"] * size["datapoints_per_user"]  # every user in the cohort
    arrays = (
        rng.integers(0, 256, (train, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, 10, train).astype(np.int32),
        rng.integers(0, 256, (10, 32, 32, 3), dtype=np.uint8),
        rng.integers(0, 10, 10).astype(np.int32),
    )
    problem = PFL.problem(s, arrays)
    spec = study.method_run(PFL, "fedavg", s, problem)
    key = jax.random.key(0)
    state = jax.block_until_ready(jax.jit(spec.algorithm.init)(key, spec.data))
    compiled, compile_s = harness.compile_ahead(
        jax.jit(spec.algorithm.round), state, spec.data, key
    )
    log(f"{form}: round compiled in {compile_s:.1f} s")
    times, first = [], None
    began = time.perf_counter()
    while not times or (time.perf_counter() - began < budget_s and len(times) < 20):
        seconds, (new, _) = harness.timed_call(compiled, state, spec.data, key)
        first = new.params if first is None else first
        times.append(seconds)
        log(f"{form}: round {len(times)}: {seconds:.3f} s")
    steady = times[1:] if len(times) > 2 else times
    round_s = float(np.median(steady))
    s = {**s, "test_images": 0}
    work = flops(s)
    return {
        "form": form,
        "cohort": size["cohort_size"],
        "compile_s": compile_s,
        "round_s_each": times,
        "round_s": round_s,
        "round_s_median_of": len(steady),
        "round_flops": work["round_flops"],
        "round_GFLOPs": work["round_flops"] / round_s / 1e9,
    }, first


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--budget",
        type=float,
        default=30.0,
        help="seconds of rounds to time per form (at least one round)",
    )
    parser.add_argument(
        "--small-cohort", type=int, default=2, help="users of the side-by-side rows"
    )
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(args.checkout)
    sys.path.insert(0, str(HERE))
    import jax

    full = DRY if args.dry_run else FULL
    small = {**full, "cohort_size": min(args.small_cohort, full["cohort_size"])}
    meta = harness.collect_meta(
        args.checkout, dry_run=args.dry_run, workload=full, backend=jax.default_backend()
    )
    peak = harness.matmul_peak(256, 3) if args.dry_run else harness.matmul_peak()
    print(f"matmul peak: {peak['matmul_peak_GFLOPs']:.1f} GFLOP/s", flush=True)
    rows, params = [], {}
    for form, size in (("xla", small), ("patches", small), ("patches", full)):
        row, after = measure(form, size, args.budget)
        params.setdefault(form, after)
        row["fraction_of_matmul_peak"] = row["round_GFLOPs"] / peak["matmul_peak_GFLOPs"]
        rows.append(row)
    results = {"meta": meta, "matmul_peak": peak, "rows": rows}
    results["max_abs_param_difference_after_one_round"] = max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(
            jax.tree.leaves(params["xla"]), jax.tree.leaves(params["patches"]), strict=True
        )
    )
    results["speedup_patches_over_xla"] = rows[0]["round_s"] / rows[1]["round_s"]
    harness.finish_meta(meta, started)
    harness.write_json(args.out, results)
    for r in rows:
        print(
            f"{r['form']:8s} cohort {r['cohort']:3d}  round {r['round_s']:.3f} s  "
            f"compile {r['compile_s']:.1f} s  {r['round_GFLOPs']:.1f} GFLOP/s = "
            f"{r['fraction_of_matmul_peak']:.1%} of the matmul peak"
        )
    print(
        f"patches / xla at cohort {small['cohort_size']}: "
        f"{results['speedup_patches_over_xla']:.1f}x faster; max |param diff| "
        f"{results['max_abs_param_difference_after_one_round']:.1e}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
