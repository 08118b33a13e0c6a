"""Per-client local work: a round whose clients take τ_i ≤ τ steps vs the uniform round at τ.

Usage:
  python benchmarks/local_work.py               # writes results/local_work.json (or --out)
  python benchmarks/local_work.py --quick --out /tmp/local_work.json   # a smoke run

A client of a per-client-work round stops stepping at its own τ_i while the scan
of τ steps runs on (`ops.work`), so the round should cost about what the
uniform round at τ costs. Three rounds, each timed as two arms in interleaved
blocks (`harness.interleaved_blocks`), compile times apart:

1. IFCA option II (model averaging) on the synthetic mixture: m = 1000 clients,
   n = 10, d = 10, k = 4, τ = 10 full-batch steps;
2. FedAvg with the MLP 64-32-10 on the 8×8 digits, 20 Dirichlet(0.5) clients
   (the hetero-digits partition), τ = 10 steps of batch 10;
3. DRFLM with the GIN 3 × 64 on ESOL's 8 scaffold clients, τ = 10 steps of batch 32
   (skipped with a note when the ESOL archive is unavailable).

The per-client arm draws τ_i uniform on 1..τ once per client (`Work(low=1)`); a
third arm, stragglers under `with_systems` (50 % each round, kept), is timed beside
them. Reported: each arm's median ms per round, per-client / uniform and
stragglers / uniform (the target: within 1.10), and the block ratios' quartiles.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import harness

FULL = dict(m=1000, n=10, d=10, k=4, tau=10, blocks=5, min_calls=5, budget_s=1.0)
QUICK = dict(m=20, n=4, d=3, k=2, tau=3, blocks=1, min_calls=2, budget_s=0.0)


def _arms(build, data, cfg):
    """(name -> Arm, compile seconds per arm) for the uniform, per-client and straggler rounds."""
    import jax

    from fedjax_sim.algorithms import Work, with_systems
    from fedjax_sim.systems import Systems

    algorithms = {
        "uniform": build(Work()),
        "per_client": build(Work(low=1)),
        "stragglers": with_systems(build(Work()), Systems(stragglers=0.5)),
    }
    arms, compile_s = {}, {}
    for name, alg in algorithms.items():
        state = alg.init(jax.random.key(0), data)
        compiled, seconds = harness.compile_ahead(jax.jit(alg.round), state, data,
                                                  jax.random.key(1))
        compile_s[name] = seconds
        box = {"state": state, "i": 0}

        def step(compiled=compiled, box=box):
            box["i"] += 1
            box["state"], metrics = compiled(box["state"], data, jax.random.key(box["i"]))
            return box["state"], metrics

        step()  # warm
        arms[name] = harness.Arm(step, min_calls=cfg["min_calls"], budget_s=cfg["budget_s"])
    return arms, compile_s


def _row(kind, arms, compile_s, cfg, **extra) -> dict:
    times = harness.interleaved_blocks(arms, cfg["blocks"])
    median = {name: statistics.median(t) for name, t in times.items()}
    row = {"kind": kind, "tau": cfg["tau"], **extra,
           "round_ms": {name: s * 1e3 for name, s in median.items()},
           "compile_s": compile_s,
           "per_client_over_uniform": median["per_client"] / median["uniform"],
           "stragglers_over_uniform": median["stragglers"] / median["uniform"]}
    return row


def ifca_row(cfg) -> dict:
    import jax

    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.data import linear_mixture
    from fedjax_sim.models import linear_regression

    data = linear_mixture(jax.random.key(0), k=cfg["k"], m=cfg["m"], n=cfg["n"], d=cfg["d"],
                          sigma=0.1, R=1.0).train
    model = linear_regression(cfg["d"])

    def build(work):
        return ifca(model, sgd(0.05, steps=cfg["tau"], work=work), num_clusters=cfg["k"],
                    option="model")

    arms, compile_s = _arms(build, data, cfg)
    return _row("ifca_model_synthetic", arms, compile_s, cfg, m=cfg["m"], n=cfg["n"],
                d=cfg["d"], k=cfg["k"])


def mlp_row(cfg, quick: bool) -> dict:
    import jax.numpy as jnp

    from fedjax_sim.algorithms import fedavg, sgd
    from fedjax_sim.experiments import PRESETS
    from fedjax_sim.experiments.runner import resolve_settings

    preset = PRESETS["hetero-digits"]
    s = resolve_settings(preset, ["seeds=1", "hidden=32", "clients=copies"], "compare")
    problem = preset.experiment.problem(s)
    data = problem["train"].copy_at(0)  # the one seed's clients
    if quick:
        data = data.take(jnp.arange(4))
    batch = 10

    def build(work):
        return fedavg(problem["model"], sgd(0.1, steps=cfg["tau"], batch_size=batch, work=work))

    arms, compile_s = _arms(build, data, cfg)
    return _row("fedavg_mlp_digits", arms, compile_s, cfg, clients=data.num_clients,
                batch=batch, hidden=[64, 32, 10])


def gin_row(cfg) -> dict:
    from fedjax_sim.algorithms import drflm, sgd
    from fedjax_sim.data.archives import DataUnavailable
    from fedjax_sim.data.molecules import ATOM_FEATURES, load_molecules
    from fedjax_sim.models.graph import gin_regressor

    try:
        fed = load_molecules("esol", 8)
    except DataUnavailable as err:
        return {"kind": "drflm_gin_esol", "skipped": str(err)}
    model = gin_regressor(ATOM_FEATURES, fed.train.x["nodes"].shape[2], hidden=64, layers=3)

    def build(work):
        return drflm(model, sgd(0.05, steps=cfg["tau"], batch_size=32, work=work),
                     participation=0.5, lambda_lr=0.002)

    arms, compile_s = _arms(build, fed.train, cfg)
    return _row("drflm_gin_esol", arms, compile_s, cfg, clients=8, batch=32,
                hidden=64, layers=3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--skip-gin", action="store_true", help="leave the GIN round out")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "local_work.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(None)
    meta = harness.collect_meta(quick=args.quick)
    cfg = QUICK if args.quick else FULL
    rows = [ifca_row(cfg), mlp_row(cfg, args.quick)]
    if not args.skip_gin:
        rows.append(gin_row(cfg))
    meta = harness.finish_meta(meta, started)
    harness.write_json(args.out, [{**row, "meta": meta} for row in rows])
    for row in rows:
        print({k: v for k, v in row.items() if k != "meta"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
