"""Seconds per IFCA round vs number of clients m, clusters k, and devices.

Each point runs in a fresh subprocess, because JAX fixes its device count
when it starts (`XLA_FLAGS=--xla_force_host_platform_device_count=N` forces N
CPU devices; on a GPU/TPU machine the real devices are used). The round is
IFCA option I on the synthetic mixture of linear regressions, clients sharded
over a 1-D mesh. Compile time is reported apart from the steady-state time
(median of several timed rounds, each ending in `block_until_ready`).

    python benchmarks/scaling.py --out scaling.json   # also writes scaling.png
    python benchmarks/scaling.py --quick --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# The fedjax_sim of this checkout (workers too), not a copy in site-packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKER = "--worker"


def measure(m: int, n: int, d: int, k: int, devices: int, repeats: int) -> dict:
    import jax
    import numpy as np

    from fedjax_sim import backend, ifca, linear_mixture, linear_regression
    from fedjax_sim.parallel import make_mesh, shard_clients

    problem = linear_mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1, R=1.0)
    data = problem.train
    if devices > 1:
        data = shard_clients(data, make_mesh(devices))
    algorithm = ifca(linear_regression(d), num_clusters=k, learning_rate=0.1)
    state = jax.jit(algorithm.init)(jax.random.key(1), data)
    step = backend.jit(algorithm.round, d)  # as fedjax_sim.simulate compiles rounds
    start = time.perf_counter()
    compiled = step.lower(state, data, jax.random.key(2)).compile()
    compile_s = time.perf_counter() - start
    state, _ = compiled(state, data, jax.random.key(2))  # warm-up
    jax.block_until_ready(state)
    times = []
    for t in range(repeats):
        start = time.perf_counter()
        state, _ = compiled(state, data, jax.random.key(3 + t))
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return {
        "m": m, "n": n, "d": d, "k": k, "devices": devices,
        "backend": jax.default_backend(),
        "s_per_round": float(np.median(times)),
        "compile_s": compile_s,
        "rounds_per_s": float(1.0 / np.median(times)),
    }


def run_point(m, n, d, k, devices, repeats) -> dict:
    env = dict(os.environ)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, __file__, WORKER, json.dumps([m, n, d, k, devices, repeats])],
        capture_output=True, text=True, env=env,
    )
    if proc.returncode != 0:
        return {"m": m, "n": n, "d": d, "k": k, "devices": devices,
                "error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
        print(json.dumps(measure(*json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file (a PNG is written beside it)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--max-devices", type=int, default=4)
    args = parser.parse_args()
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
            r = run_point(point["m"], n, d, point["k"], point["devices"], repeats)
            r["sweep"] = axis
            results.append(r)
            shown = {key: r.get(key) for key in ("sweep", "m", "k", "devices", "s_per_round",
                                                  "compile_s", "error") if key in r}
            print(json.dumps(shown), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
