"""An asynchronous server step (FedBuff, K = 1,000 in flight, B = 100) beside a FedAvg round of 100.

Usage:
  nice -n 5 python benchmarks/async_step.py    # writes results/async_step.json
  python benchmarks/async_step.py --quick --out /tmp/async_step.json   # a smoke run

Both train the same clients the same way: the MLP 64-32-10 on m = 2,000 clients of
16 rows of the 8×8 digits each (rows dealt with replacement, seed 0), τ = 10 local
steps of batch 10 at learning rate 0.1, so each trains 100 clients per call:

1. `fedbuff`: one server step (one round) with K = 1,000 clients in flight, B = 100,
   max_staleness = 50 (a ring of 51 models), heavy-tailed speeds (lognormal, σ = 1);
   besides training the B arrivals it refills the empty slots (a uniform draw among
   the m clients), pops the B earliest of the K events (a top-k) and gathers each
   arrival's model from the ring. Timed after 20 warm-up steps, so the slots are
   full and the staleness is at its steady state.
2. `fedavg` at participation 100 / 2,000: a synchronous round of 100 clients.

Each round is `jax.jit(alg.round)` compiled apart (`.lower().compile()`), then timed in
interleaved blocks (`harness.interleaved_blocks`), every call ending in
`block_until_ready`. Reported: each round's median ms, the ratio fedbuff / fedavg
(the target: within 1.2), its block quartiles, the compile seconds, the mean
staleness of the timed steps, and the machine (CPU model, load average) and git HEAD.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import harness

FULL = dict(m=2000, n=16, concurrency=1000, buffer=100, steps=10, batch=10, warmup=20,
            blocks=9, min_calls=5, budget_s=2.0)
QUICK = dict(m=60, n=4, concurrency=20, buffer=5, steps=2, batch=2, warmup=2, blocks=1,
             min_calls=2, budget_s=0.0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" /
                                             "async_step.json"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    cfg = QUICK if args.quick else FULL

    import jax
    import numpy as np

    from fedjax_sim.algorithms import fedavg, fedbuff, sgd
    from fedjax_sim.data import FederatedData
    from fedjax_sim.data.images import digits
    from fedjax_sim.models import mlp_classifier
    from fedjax_sim.ops.clock import Clock

    meta = harness.collect_meta(args.checkout, quick=args.quick, **cfg)
    images, labels = digits()
    rows = np.random.default_rng(0).integers(0, len(labels), (cfg["m"], cfg["n"]))
    data = FederatedData.from_arrays(images[rows], labels[rows])
    model = mlp_classifier((8, 8), (32,), 10)
    training = sgd(0.1, steps=cfg["steps"], batch_size=cfg["batch"])
    algorithms = {
        "fedbuff": fedbuff(model, training, concurrency=cfg["concurrency"],
                           buffer_size=cfg["buffer"], max_staleness=50,
                           clock=Clock(step_seconds=1.0, spread=1.0, seed=0)),
        "fedavg": fedavg(model, training, participation=cfg["buffer"] / cfg["m"]),
    }
    arms, compile_s, boxes = {}, {}, {}
    for name, alg in algorithms.items():
        state = jax.jit(alg.init)(jax.random.key(0), data)
        compiled, compile_s[name] = harness.compile_ahead(jax.jit(alg.round), state, data,
                                                          jax.random.key(1))
        box = boxes[name] = {"state": state, "i": 0, "staleness": []}

        def step(compiled=compiled, box=box):
            box["i"] += 1
            box["state"], metrics = compiled(box["state"], data, jax.random.key(box["i"]))
            box["metrics"] = metrics
            return box["state"], metrics

        for _ in range(cfg["warmup"]):
            jax.block_until_ready(step())
        box["warm_metrics"] = {k: float(v) for k, v in box["metrics"].items()}
        arms[name] = harness.Arm(step, min_calls=cfg["min_calls"], budget_s=cfg["budget_s"])
    times = harness.interleaved_blocks(arms, cfg["blocks"])
    median = {name: statistics.median(t) for name, t in times.items()}
    per_block = len(times["fedbuff"]) // cfg["blocks"], len(times["fedavg"]) // cfg["blocks"]
    ratios = sorted(
        statistics.median(times["fedbuff"][b * per_block[0]:(b + 1) * per_block[0]])
        / statistics.median(times["fedavg"][b * per_block[1]:(b + 1) * per_block[1]])
        for b in range(cfg["blocks"]))
    row = {
        "kind": "fedbuff_step_vs_fedavg_round_mlp_digits",
        "round_ms": {name: s * 1e3 for name, s in median.items()},
        "fedbuff_over_fedavg": median["fedbuff"] / median["fedavg"],
        "block_ratios": ratios,
        "compile_s": compile_s,
        "calls": {name: len(t) for name, t in times.items()},
        "fedbuff_after_warmup": boxes["fedbuff"]["warm_metrics"],
        "fedbuff_last": {k: float(v) for k, v in boxes["fedbuff"]["metrics"].items()},
        "clients": cfg["m"], "rows_per_client": cfg["n"], "hidden": [32],
    }
    meta = harness.finish_meta(meta, started)
    harness.write_json(args.out, [{**row, "meta": meta}])
    print({k: v for k, v in row.items()})
    print({k: meta[k] for k in ("cpu_model", "loadavg_start", "loadavg_end", "git_head")
           if k in meta})
    return 0


if __name__ == "__main__":
    sys.exit(main())
