"""An ε sweep of dp-hetero-digits as one program against its cells one by one.

Usage:
  nice -n 5 python benchmarks/dp_epsilon_sweep.py    # writes results/dp_epsilon_sweep.json
  python benchmarks/dp_epsilon_sweep.py --quick --out /tmp/eps.json   # tiny sizes, a smoke run

The sweep `fedjax-sim sweep dp-hetero-digits --set method=fedavg target_epsilon=1,3,8
rounds=20 seeds=3` (FedAvg, 100 Dirichlet(0.5) clients each taking part with
probability 0.2): its cells differ only in target_epsilon, so the sweep trains them as
one program (`experiments.privacy.grid_trials`: σ calibrated per cell on the host,
then traced). Each arm runs in a fresh process (its own compilations), the grouped
arm first: the cells' trials through the sweep's `run_group`, and one by one through
`trials` (a cell's own run, `study.run_method`). The calibrations of σ are done
before the clock starts in both. Reported: each arm's seconds and whether the two
give the same trials (to 1e-5).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import harness

SETTINGS = ["method=fedavg", "rounds=20", "eval_every=10", "seeds=3",
            "target_epsilon=1,3,8"]
QUICK = ["method=fedavg", "num_clients=20", "rounds=2", "eval_every=1", "seeds=2",
         "hidden=8", "local_steps=2", "target_epsilon=1,3"]


def arm(mode: str, settings: list[str]) -> dict:
    """One arm, in this process: seconds and the trials."""
    from fedjax_sim.experiments import PRESETS, privacy, runner, study

    preset = PRESETS["dp-hetero-digits"]
    s = runner.resolve_settings(preset, settings, "sweep")
    cells = runner.expand_cells(s, runner.sweep_axes(preset, s))
    for cell in cells:
        cell["cell_id"] = runner.cell_id(preset, cell)
        privacy.calibrated_noise(cell["target_epsilon"], cell["dp_delta"], cell["rounds"],
                                 accountant=cell["dp_accountant"], sampling="poisson",
                                 q=cell["participation"])
    sweep = study.sweep_of(preset.experiment)
    seeds = list(range(s["seeds"]))
    started = time.perf_counter()
    if mode == "grouped":
        rows = sweep.run_group(cells, seeds)
    else:
        rows = [{"cell_id": c["cell_id"], **r} for c in cells for r in sweep.trials(c, seeds)]
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "cells": len(cells), "trials": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--arm", choices=("grouped", "alone"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "dp_epsilon_sweep.json"))
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else SETTINGS
    if args.arm:  # a child: one arm, its JSON on stdout
        print(json.dumps(arm(args.arm, settings), default=float))
        return 0
    root = harness.resolve_checkout(args.checkout)
    env = {**os.environ, **harness.checkout_env(root), "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    meta = harness.collect_meta(root, settings=settings)
    out = {}
    for mode in ("grouped", "alone"):
        done = subprocess.run([sys.executable, __file__, "--arm", mode,
                               *(["--quick"] if args.quick else [])],
                              env=env, capture_output=True, text=True, check=True)
        out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{mode:<8} {out[mode]['seconds']:.1f} s for {out[mode]['cells']} cells")
    key = lambda r: (r["cell_id"], r["data_seed"])  # noqa: E731
    alone = {key(r): r for r in out["alone"]["trials"]}
    def close(a, b) -> bool:
        a, b = float(a), float(b)
        return a == b or abs(a - b) <= 1e-5 * max(1.0, abs(a))

    same = all(close(r[m], alone[key(r)][m]) for r in out["grouped"]["trials"]
               for m in ("test_accuracy", "train_loss", "test_loss", "epsilon"))
    print(f"same trials: {same}; alone / grouped "
          f"{out['alone']['seconds'] / out['grouped']['seconds']:.2f}")
    harness.write_json(args.out, {"arms": out, "same_trials": same,
                                  "meta": harness.finish_meta(meta, started)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
