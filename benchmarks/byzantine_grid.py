"""The byzantine-digits grid as one sweep program against the same cells one program each.

Usage:
  nice -n 5 python benchmarks/byzantine_grid.py     # writes results/byzantine_grid.json
  python benchmarks/byzantine_grid.py --quick --out /tmp/byz.json   # a smoke run

The cells: the `byzantine-digits` preset (FedAvg, MLP 64-32-10 on the 8×8 digits, 20
Dirichlet(α) clients, τ = 5 full-batch steps, 30 rounds, 2 seeds) at one rule and α
(trimmed mean after NNM, α = 0.1: f = ⌈b⌉ changes with the share, so the rule's f is
traced too), over attack ∈ {none, sign flip, ALIE, IPM} × byzantine ∈ {0, 0.1, 0.2,
0.3}: 16 cells, 13 distinct runs (the 4 cells of byzantine = 0 are one run). Two arms,
each after `jax.clear_caches()`, each ending in host values (the trials' metrics):

- one sweep program: the cells as `fedjax-sim sweep byzantine-digits` groups them
  (`hetero.byzantine.grid_trials`: the 13 runs as one vmapped grid axis outside the
  seeds, one compile);
- one program each: every distinct run as `fedjax-sim sweep` trains a cell alone
  (`study.run_method`: its own data build, compile and run).

Reported per arm: wall seconds, compile seconds and run seconds (`simulate.run`'s, the
rounds and evaluations after the compile; the evaluations' share apart), and the largest
difference of a trial's test accuracy and test loss between the arms (they train the
same runs).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness

FULL = dict(
    rounds=None, attacks=["none", "sign_flip", "alie", "ipm"], byzantine=[0.0, 0.1, 0.2, 0.3]
)
QUICK = dict(rounds=2, attacks=["none", "sign_flip"], byzantine=[0.0, 0.2])
RULE = {"aggregator": "trimmed_mean", "pre_aggregation": "nnm", "alpha": 0.1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(pathlib.Path(__file__).parent / "results" / "byzantine_grid.json")
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    cfg = QUICK if args.quick else FULL

    import jax

    from fedjax_sim.experiments import robustness, study
    from fedjax_sim.experiments.base import RunContext
    from fedjax_sim.experiments.hetero.byzantine import grid_trials
    from fedjax_sim.experiments.hetero.experiment import BYZANTINE
    from fedjax_sim.experiments.registry import get_preset
    from fedjax_sim.experiments.runner import SWEEP, resolve_settings

    preset = get_preset("byzantine-digits", SWEEP)
    overrides = {**RULE, "attack": cfg["attacks"], "byzantine": cfg["byzantine"]}
    if cfg["rounds"]:
        overrides.update(rounds=cfg["rounds"], eval_every=cfg["rounds"])
    s = resolve_settings(preset, overrides, SWEEP, None)
    cells = [
        {**s, "attack": a, "byzantine": b, "cell_id": f"{a}/{b}"}
        for a in cfg["attacks"]
        for b in cfg["byzantine"]
    ]
    seeds = list(range(s["seeds"]))
    grid = robustness.RobustGrid(cells, robustness.training_clients(s))
    meta = harness.collect_meta(
        args.checkout,
        quick=args.quick,
        cells=len(cells),
        runs=len(grid),
        seeds=len(seeds),
        rounds=s["rounds"],
        **RULE,
    )

    jax.clear_caches()
    timing: dict = {}
    t0 = time.perf_counter()
    grouped = grid_trials(BYZANTINE, cells, seeds, timing=timing)
    sweep = {
        "wall_s": time.perf_counter() - t0,
        "programs": 1,
        "compile_s": timing.get("compile_seconds"),
        "run_s": timing.get("run_seconds"),
        "evaluate_s": timing.get("evaluate_seconds"),
    }

    jax.clear_caches()
    alone: dict = {}
    each = {"wall_s": 0.0, "programs": 0, "compile_s": 0.0, "run_s": 0.0, "evaluate_s": 0.0}
    t0 = time.perf_counter()
    for cell in cells:
        run = {**cell, "attack": cell["attack"] if cell["byzantine"] else "none"}
        key = (run["attack"], run["byzantine"])
        if key in alone:
            continue
        ctx = RunContext(progress=False)
        _, summary = study.run_method(
            BYZANTINE, {k: v for k, v in run.items() if k != "cell_id"}, ctx
        )
        alone[key] = summary["final_per_seed"]
        each["programs"] += 1
        each["compile_s"] += ctx.timing.get("compile_seconds") or 0.0
        each["run_s"] += ctx.timing.get("run_seconds") or 0.0
        each["evaluate_s"] += ctx.timing.get("evaluate_seconds") or 0.0
    each["wall_s"] = time.perf_counter() - t0

    by_cell = {c["cell_id"]: c for c in cells}
    gaps = {"test_accuracy": 0.0, "test_loss": 0.0}
    for row in grouped:
        cell = by_cell[row["cell_id"]]
        key = (cell["attack"] if cell["byzantine"] else "none", cell["byzantine"])
        for m in gaps:
            gaps[m] = max(gaps[m], abs(row[m] - alone[key][m][row["data_seed"]]))

    figures = {
        "one_sweep_program": sweep,
        "one_program_each": each,
        "speedup_wall": each["wall_s"] / sweep["wall_s"],
        "largest_difference": gaps,
    }
    payload = {"meta": harness.finish_meta(meta, started), "figures": figures}
    harness.write_json(args.out, payload)
    print(
        f"{len(cells)} cells ({len(grid)} runs × {len(seeds)} seeds, {s['rounds']} rounds): "
        f"one sweep program {sweep['wall_s']:.1f} s (compile {sweep['compile_s']:.1f} s, "
        f"run {sweep['run_s']:.1f} s, of it evaluation {sweep['evaluate_s']:.1f} s) against "
        f"one program each {each['wall_s']:.1f} s ({each['programs']} compiles "
        f"{each['compile_s']:.1f} s, runs {each['run_s']:.1f} s, of them evaluation "
        f"{each['evaluate_s']:.1f} s)"
        f": {figures['speedup_wall']:.2f}×; largest difference of a trial's test accuracy "
        f"{gaps['test_accuracy']:.1e}, test loss {gaps['test_loss']:.1e}; load average "
        f"{meta['loadavg_start'][0]:.1f} → {payload['meta']['loadavg_end'][0]:.1f}; "
        f"wrote {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
