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
the patches form at the full cohort of 50 twice: the cohort vmapped whole (`chunk`
"whole": no execution plan) and in the client chunk the executor plans for the preset
(`chunk` "executor": `study.method_spec`, the experiment's footprint under
`Execution()`; its `client_chunk` is recorded), timed in alternating rounds. For each
row: `jax.jit(round)` compiled apart
(`.lower().compile()`), then rounds timed one by one (`block_until_ready`) until
`--budget` seconds have passed (at least one), median (the first dropped when there
are three or more); GFLOP/s by the CNN's FLOP count (`standard_workloads.flops`:
forward, weight gradients and input gradients of the layers but the first, ×2) and its
fraction of the matmul peak (`harness.matmul_peak`) measured in the same run. The two
forms' parameters after one round from the same state at the small cohort are compared
(max |Δ|): the same numbers to float rounding; so are the whole and the executor's
chunked round at the full cohort (`max_abs_param_difference_chunked_vs_whole`).

Usage:
  nice -n 5 python benchmarks/conv_round.py                   # a few minutes on 2 cores
  python benchmarks/conv_round.py --dry-run --out /tmp/cr.json   # tiny, seconds
  nice -n 5 python benchmarks/conv_round.py --skip-small --budget 60   # the chunk rows only
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


def build(form: str, size: dict, chunk: str = "whole", log=print):
    """The preset's round in this conv form, compiled apart: (compiled, state, data,
    compile seconds, the data's client chunk). chunk "whole": the cohort vmapped whole
    (no plan); "executor": the plan `study.method_spec` gives the data by default."""
    import jax

    from fedjax_sim.execution import plan_of
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
    if chunk == "executor":
        spec = study.method_spec(PFL, "fedavg", s, problem)
    else:
        spec = study.method_run(PFL, "fedavg", s, problem)
    key = jax.random.key(0)
    state = jax.block_until_ready(jax.jit(spec.algorithm.init)(key, spec.data))
    compiled, compile_s = harness.compile_ahead(
        jax.jit(spec.algorithm.round), state, spec.data, key
    )
    client_chunk = plan_of(spec.data).client_chunk
    log(f"{form} ({chunk}, client_chunk={client_chunk}): round compiled in {compile_s:.1f} s")
    return compiled, state, spec.data, compile_s, client_chunk, s


def measure(form: str, size: dict, budget_s: float, log=print, chunks=("whole",)):
    """(rows, params after the first round of each) of the preset's round in this conv
    form, one row per chunk of `chunks` ("whole", "executor"), timed in alternating
    rounds."""
    import jax
    from standard_workloads import flops

    built = {c: build(form, size, c, log) for c in chunks}
    key = jax.random.key(0)
    times = {c: [] for c in chunks}
    first = {}
    began = time.perf_counter()
    while not times[chunks[0]] or (
        time.perf_counter() - began < budget_s and len(times[chunks[0]]) < 20
    ):
        order = chunks if len(times[chunks[0]]) % 2 == 0 else chunks[::-1]
        for c in order:
            compiled, state, data = built[c][:3]
            seconds, (new, _) = harness.timed_call(compiled, state, data, key)
            first.setdefault(c, new.params)
            times[c].append(seconds)
            log(f"{form} ({c}): round {len(times[c])}: {seconds:.3f} s")
    rows = []
    for c in chunks:
        steady = times[c][1:] if len(times[c]) > 2 else times[c]
        round_s = float(np.median(steady))
        work = flops({**built[c][5], "test_images": 0})
        rows.append({
            "form": form,
            "cohort": size["cohort_size"],
            "chunk": c,
            "client_chunk": built[c][4],
            "compile_s": built[c][3],
            "round_s_each": times[c],
            "round_s": round_s,
            "round_s_median_of": len(steady),
            "round_flops": work["round_flops"],
            "round_GFLOPs": work["round_flops"] / round_s / 1e9,
        })
    return rows, first


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
    parser.add_argument(
        "--skip-small", action="store_true",
        help="only the full cohort's rows (whole and the executor's chunk)",
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
    runs = [("xla", small, ("whole",)), ("patches", small, ("whole",)),
            ("patches", full, ("whole", "executor"))]
    if args.skip_small:
        runs = runs[2:]
    for form, size, chunks in runs:
        measured, after = measure(form, size, args.budget, chunks=chunks)
        for row in measured:
            row["fraction_of_matmul_peak"] = row["round_GFLOPs"] / peak["matmul_peak_GFLOPs"]
            rows.append(row)
        params[form, size["cohort_size"]] = after
    results = {"meta": meta, "matmul_peak": peak, "rows": rows}

    def max_diff(a, b):
        return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
                   for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    if not args.skip_small:
        cohort = small["cohort_size"]
        results["max_abs_param_difference_after_one_round"] = max_diff(
            params["xla", cohort]["whole"], params["patches", cohort]["whole"])
        results["speedup_patches_over_xla"] = rows[0]["round_s"] / rows[1]["round_s"]
    whole = params["patches", full["cohort_size"]]
    results["max_abs_param_difference_chunked_vs_whole"] = max_diff(
        whole["whole"], whole["executor"])
    results["speedup_executor_chunk_over_whole"] = rows[-2]["round_s"] / rows[-1]["round_s"]
    harness.finish_meta(meta, started)
    harness.write_json(args.out, results)
    for r in rows:
        print(
            f"{r['form']:8s} cohort {r['cohort']:3d} client_chunk {r['client_chunk']}  "
            f"round {r['round_s']:.3f} s  "
            f"compile {r['compile_s']:.1f} s  {r['round_GFLOPs']:.1f} GFLOP/s = "
            f"{r['fraction_of_matmul_peak']:.1%} of the matmul peak"
        )
    if not args.skip_small:
        print(
            f"patches / xla at cohort {small['cohort_size']}: "
            f"{results['speedup_patches_over_xla']:.1f}x faster; max |param diff| "
            f"{results['max_abs_param_difference_after_one_round']:.1e}"
        )
    print(
        f"the executor's chunk / the whole cohort at {full['cohort_size']}: "
        f"{results['speedup_executor_chunk_over_whole']:.2f}x faster; max |param diff| "
        f"{results['max_abs_param_difference_chunked_vs_whole']:.1e}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
