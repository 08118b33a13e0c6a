"""A tuned comparison's grid: one vmapped program against the grid values one at a time.

Usage:
  python benchmarks/tuning.py             # writes results/tuning.json here (or --out)
  python benchmarks/tuning.py --quick --out /tmp/tuning.json   # a smoke run

The method is the `hetero-digits` preset's FedAvg (MLP 64-32-10 on the 8×8 digits,
20 Dirichlet(0.5) clients, τ = 5 full-batch SGD steps, 3 seeds) with the preset's
learning-rate grid (3 values), built as `fedjax-sim compare hetero-digits` builds
it (`experiments.tuned`: every client's training rows less the validation share).
Two arms, timed in interleaved blocks (`harness.interleaved_blocks`), compile
times apart:

- grid: one round of the tuned method, every grid value at once (state [G, seeds]);
- one at a time: a round of each value's own program (its own compile), the G
  rounds in turn: what running the grid as G comparisons costs per round.

Reported: ms per round of the whole grid in each arm, their ratio and its block
quartiles, the compile seconds of each arm, and the grid round's matmul flops
(forward and backward of every client's padded rows at every step, every seed and
grid point: `harness.dense_flops`) as a fraction of the machine's matmul peak
measured in the same run. Then one whole tuned run of the method (its rounds and
evaluations, the choice included) against the G untuned runs one after another.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

import harness

FULL = dict(blocks=5, min_calls=5, budget_s=1.0, rounds=None)
QUICK = dict(blocks=1, min_calls=2, budget_s=0.0, rounds=4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" /
                                             "tuning.json"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    cfg = QUICK if args.quick else FULL

    import jax
    import numpy as np

    from fedjax_sim import experiments, simulate
    from fedjax_sim.execution import Execution
    from fedjax_sim.experiments import study, tuned

    preset = experiments.get_preset("hetero-digits", "compare")
    overrides = {"methods": "fedavg"} | ({"rounds": cfg["rounds"]} if cfg["rounds"] else {})
    s = experiments.resolve_settings(preset, overrides, "compare")
    experiment = preset.experiment
    meta = harness.collect_meta(args.checkout, quick=args.quick, preset="hetero-digits",
                                method="fedavg", grid=s["tune_lr"], seeds=s["seeds"],
                                rounds=s["rounds"])
    meta.update(harness.machine_ceilings(args.quick))
    problem = study.problem_for(experiment, s)
    grid_spec = tuned.tuned_run(experiment, "fedavg", s, problem,
                               functools.partial(study.method_run, experiment))
    alone = [study.method_run(experiment, "fedavg", {**s, "lr": lr}, problem.fit)
             for lr in s["tune_lr"]]
    key = jax.random.key(0)

    def compiled_round(spec):
        state = jax.jit(spec.algorithm.init)(key, spec.data)
        compiled, seconds = harness.compile_ahead(jax.jit(spec.algorithm.round), state,
                                                  spec.data, key)
        return (lambda: compiled(state, spec.data, key)), seconds

    grid_step, grid_compile = compiled_round(grid_spec)
    steps, compiles = zip(*(compiled_round(spec) for spec in alone), strict=True)

    def one_at_a_time():
        return [step() for step in steps]

    for step in (grid_step, one_at_a_time):  # a first call of an executable is no steady call
        harness.timed_call(step)

    arms = {"grid": harness.Arm(grid_step, cfg["min_calls"], cfg["budget_s"]),
            "one_at_a_time": harness.Arm(one_at_a_time, cfg["min_calls"], cfg["budget_s"])}
    times = harness.interleaved_blocks(arms, cfg["blocks"])
    per_block = len(times["grid"]) // cfg["blocks"], len(times["one_at_a_time"]) // cfg["blocks"]
    ratios = [statistics.median(times["one_at_a_time"][b * per_block[1]:(b + 1) * per_block[1]])
              / statistics.median(times["grid"][b * per_block[0]:(b + 1) * per_block[0]])
              for b in range(cfg["blocks"])]
    grid_s, loop_s = statistics.median(times["grid"]), statistics.median(times["one_at_a_time"])

    data = problem.fit["train"].materialize() if hasattr(problem.fit["train"], "materialize") \
        else problem.fit["train"]
    n_max = int(np.shape(data.y)[-1])
    clients = int(np.shape(data.num_examples)[-1])
    widths = [int(np.prod(problem.fit["input_shape"])), s["hidden"], 10]
    flops = (len(s["tune_lr"]) * s["seeds"] * clients * s["local_steps"]
             * harness.dense_flops(widths, steps=n_max))
    round_figures = {
        "grid_points": len(s["tune_lr"]), "seeds": s["seeds"], "clients": clients,
        "rows_per_client_padded": n_max, "mlp_widths": widths,
        "grid_ms_per_round": 1e3 * grid_s, "one_at_a_time_ms_per_round": 1e3 * loop_s,
        "speedup": loop_s / grid_s,
        "speedup_block_quartiles": [float(q) for q in np.quantile(ratios, [0.25, 0.5, 0.75])],
        "grid_compile_s": grid_compile, "one_at_a_time_compile_s": sum(compiles),
        "grid_round_matmul_flops": flops,
        "grid_GFLOPs": flops / grid_s / 1e9,
        "grid_fraction_of_matmul_peak": flops / grid_s / 1e9 / meta["matmul_peak_GFLOPs"],
        "one_at_a_time_fraction_of_matmul_peak":
            flops / loop_s / 1e9 / meta["matmul_peak_GFLOPs"],
    }

    def whole(spec):
        t0 = time.perf_counter()
        out = simulate.run(spec.algorithm, spec.data, spec.key, rounds=spec.rounds,
                           eval_every=spec.eval_every, evaluate=spec.evaluate,
                           execution=Execution(progress=False, copies=spec.copies,
                                               data_copies=spec.data_copies))
        if spec.seed_rows is not None:
            spec.seed_rows(out[1])  # the choice
        return time.perf_counter() - t0

    run_figures = {"rounds": s["rounds"], "eval_every": s["eval_every"],
                   "tuned_run_s": whole(grid_spec),
                   "one_at_a_time_runs_s": sum(whole(spec) for spec in alone)}
    run_figures["speedup"] = run_figures["one_at_a_time_runs_s"] / run_figures["tuned_run_s"]
    payload = {"meta": harness.finish_meta(meta, started), "round": round_figures,
               "whole_run": run_figures}
    harness.write_json(args.out, payload)
    r = round_figures
    print(f"grid of {r['grid_points']} lrs × {r['seeds']} seeds: {r['grid_ms_per_round']:.2f} ms "
          f"per round vs {r['one_at_a_time_ms_per_round']:.2f} ms one at a time "
          f"({r['speedup']:.2f}×); {100 * r['grid_fraction_of_matmul_peak']:.1f} % of the "
          f"matmul peak ({meta['matmul_peak_GFLOPs']:.0f} GFLOP/s); compile "
          f"{r['grid_compile_s']:.2f} s vs {r['one_at_a_time_compile_s']:.2f} s; whole run "
          f"{run_figures['tuned_run_s']:.1f} s vs {run_figures['one_at_a_time_runs_s']:.1f} s; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
