"""Seconds per IFCA round vs number of clients m, clusters k, and devices.

Each point runs in a fresh subprocess (`harness.run_point_subprocess`),
because JAX fixes its device count when it starts
(`XLA_FLAGS=--xla_force_host_platform_device_count=N` forces N CPU devices;
on a GPU/TPU machine the real devices are used). The round is IFCA option I
on the synthetic mixture of linear regressions, clients sharded over a 1-D
mesh. `harness.compile_then_time` reports compile time apart from the
steady-state time (median of several timed rounds after a warm-up, each
ending in `block_until_ready`). Each point also gets `fraction_of_stream`:
the round's bytes (`harness.linear_round_bytes`: 2 passes over X + y) per
second over the stream probe, measured once in the parent.

    python benchmarks/scaling.py --out scaling.json   # also writes scaling.png
    python benchmarks/scaling.py --quick --out /tmp/s.json
    python benchmarks/scaling.py --quick --checkout /tmp/fedjax_old --out /tmp/s_old.json

The JSON is a list with one object per point, each carrying the run's `meta`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import harness

WORKER = "--worker"


def measure(m: int, n: int, d: int, k: int, devices: int, repeats: int) -> dict:
    """One point, in this (fresh) process; fedjax_sim must already be imported by the caller."""
    import jax

    from fedjax_sim import backend, ifca, linear_mixture, linear_regression, sgd
    from fedjax_sim.parallel import make_mesh, shard_clients

    problem = linear_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1, R=1.0)
    data = problem.train
    if devices > 1:
        data = shard_clients(data, make_mesh(devices))
    algorithm = ifca(linear_regression(d), sgd(0.1), num_clusters=k)
    state = jax.jit(algorithm.init)(jax.random.key(1), data)
    # A warm-up round on key 2, then `repeats` rounds on keys 3, 4, ..., chained.
    timing = harness.compile_then_time(
        backend.jit(algorithm.round, d),  # as fedjax_sim.simulate compiles rounds
        state, data, jax.random.key(2),
        reps=repeats,
        next_args=lambda i, args, out: (out[0], args[1], jax.random.key(2 + i)),
    )
    return {
        "m": m, "n": n, "d": d, "k": k, "devices": devices,
        "backend": jax.default_backend(),
        "s_per_round": timing.median_s,
        "compile_s": timing.compile_s,
        "rounds_per_s": 1.0 / timing.median_s,
        "s_per_round_min": timing.min_s,
        "rounds_timed": timing.count,
        "first_round_s": timing.first_call_s,
        "round_bytes": harness.linear_round_bytes(m, n, d),
    }


def run_point(m, n, d, k, devices, repeats, checkout: Path) -> dict:
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"} if devices > 1 else {}
    r = harness.run_point_subprocess(
        __file__, [WORKER, json.dumps([m, n, d, k, devices, repeats]), "--checkout", str(checkout)],
        env=env,
    )
    if "error" in r:
        return {"m": m, "n": n, "d": d, "k": k, "devices": devices, "error": r["error"]}
    return r


def plot(results: list[dict], path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    for ax, axis in zip(axes, ("m", "k", "devices"), strict=True):
        points = sorted(
            (r[axis], r["s_per_round"]) for r in results
            if r.get("sweep") == axis and "s_per_round" in r
        )
        if points:
            ax.plot(*zip(*points, strict=True), marker="o")
        ax.set_xlabel(axis)
        ax.set_ylabel("seconds per round")
        if axis == "m":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.set_title(f"IFCA option I round vs {axis}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == WORKER:
        module = harness.use_checkout(harness.checkout_from_argv())
        point = measure(*json.loads(sys.argv[2]))
        point["fedjax_sim_file"] = module.__file__
        print(json.dumps(harness.strict_json(point)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (a PNG is written beside it)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--max-devices", type=int, default=4)
    harness.add_checkout_arg(parser)
    args = parser.parse_args()
    root = harness.resolve_checkout(args.checkout)
    started = time.perf_counter()
    meta = harness.collect_meta(root, quick=args.quick)
    probes = harness.machine_ceilings(quick=args.quick)
    n, d = 10, 10
    if args.quick:
        grid = {"m": [100, 1000], "k": [1, 4], "devices": [1, 2]}
        base_m, repeats = 1000, 3
    else:
        grid = {"m": [1_000, 10_000, 100_000, 1_000_000], "k": [1, 2, 4, 8, 16],
                "devices": [d_ for d_ in (1, 2, 4, 8) if d_ <= args.max_devices]}
        base_m, repeats = 100_000, 10
    results = []
    for axis, values in grid.items():
        for value in values:
            point = {"m": base_m, "k": 4, "devices": 1, axis: value}
            r = run_point(point["m"], n, d, point["k"], point["devices"], repeats, root)
            r["sweep"] = axis
            if "s_per_round" in r:
                r["fraction_of_stream"] = (
                    r["round_bytes"] / r["s_per_round"] / (probes["stream_GBps"] * 1e9)
                )
            results.append(r)
            shown = {key: r.get(key) for key in ("sweep", "m", "k", "devices", "s_per_round",
                                                  "compile_s", "fraction_of_stream", "error")
                     if key in r}
            print(json.dumps(shown), flush=True)
    harness.finish_meta(meta, started)
    meta["probes"] = probes
    meta["round_bytes_model"] = harness.LINEAR_ROUND_BYTES_MODEL
    for r in results:
        r["meta"] = meta
    out = Path(args.out)
    harness.write_json(out, results)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
