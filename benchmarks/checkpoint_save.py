"""What one `RunCheckpoints.save` costs the caller and the process, for a small state.

A DRFA-size state (10 seeds x 10 clients x 61 floats, 10x10 lambda, 10 PRNG
keys, a few KB of history) is saved `--saves` times, each save after a jitted
computation of about `--compute-ms` (the rounds between two checkpoints:
DRFA's 50 rounds take ~27 ms), as `simulate.run` does. Per save it reports the
caller's wall time in `save` (which includes waiting for the previous save),
the caller thread's CPU time in `save`, and the process CPU time (every
thread) of the whole save less that of the computation; and the wall time of
all of it over that of the computations alone (the ratio a run with this
cadence pays for its checkpoints). `close` (the wait for the last save) is
counted in the totals.

    python benchmarks/checkpoint_save.py                       # this checkout
    python benchmarks/checkpoint_save.py --checkout /tmp/old   # another fedjax_sim

Writes benchmarks/results/checkpoint_save.json (or --out).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

import harness

HERE = pathlib.Path(__file__).resolve().parent


def _compute(target_ms: float):
    """A jitted computation (it releases the GIL, as a compiled chunk does) of ~target_ms."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def step(x, n):
        return jax.lax.fori_loop(0, n, lambda _, y: jnp.tanh(y @ x), x)

    x = jnp.eye(128) * 0.5
    jax.block_until_ready(step(x, 1))
    n = 1
    while True:
        t0 = time.perf_counter()
        jax.block_until_ready(step(x, n))
        took = time.perf_counter() - t0
        if took * 1e3 >= target_ms / 4 or n > 1 << 20:
            break
        n *= 2
    n = max(1, round(n * target_ms / (took * 1e3)))
    return lambda: jax.block_until_ready(step(x, n))


def _state():
    import jax
    import jax.numpy as jnp

    return {"w": jnp.ones((10, 10, 61), jnp.float32), "lam": jnp.full((10, 10), 0.1),
            "keys": jax.random.split(jax.random.key(0), 10)}


def measure(saves: int, compute_ms: float) -> dict:
    import jax
    import numpy as np

    from fedjax_sim.checkpoint import RunCheckpoints

    compute = _compute(compute_ms)
    state, key = _state(), jax.random.key(1)
    history = [{"round": r, "loss": np.float32(1.0 / (r + 1)), "lam": np.full(10, 0.1)}
               for r in range(0, 50 * (saves + 3), 10)]
    # The computation alone.
    alone_wall, alone_cpu = [], []
    for _ in range(saves):
        t0, c0 = time.perf_counter(), time.process_time()
        compute()
        alone_wall.append(time.perf_counter() - t0)
        alone_cpu.append(time.process_time() - c0)
    caller_wall, caller_cpu = [], []
    with tempfile.TemporaryDirectory() as tmp:
        checkpoints = RunCheckpoints(pathlib.Path(tmp) / "c")
        for step in range(1, 3):  # orbax's first saves (imports, directory) not timed
            checkpoints.save(step, state, key, history[: 5 * step])
            compute()
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(saves):
            compute()
            step = 3 + i
            s0, sc0 = time.perf_counter(), time.thread_time()
            checkpoints.save(step, state, key, history[: 5 * step])
            caller_cpu.append(time.thread_time() - sc0)
            caller_wall.append(time.perf_counter() - s0)
        checkpoints.close()
        total_wall, total_cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "saves": saves,
        "compute_ms_median": 1e3 * statistics.median(alone_wall),
        "caller_wall_ms_median": 1e3 * statistics.median(caller_wall),
        "caller_thread_cpu_ms_median": 1e3 * statistics.median(caller_cpu),
        "process_cpu_ms_per_save": 1e3 * (total_cpu - sum(alone_cpu)) / saves,
        "wall_with_saves_over_compute_alone": total_wall / sum(alone_wall),
        "total_wall_s": total_wall,
        "compute_alone_wall_s": sum(alone_wall),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_checkout_arg(parser)
    parser.add_argument("--saves", type=int, default=40)
    parser.add_argument("--compute-ms", type=float, default=27.0,
                        help="the computation between two saves (DRFA's 50 rounds: ~27 ms)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements, the median kept")
    parser.add_argument("--out", default=str(HERE / "results" / "checkpoint_save.json"))
    parser.add_argument("--label", default=None)
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    meta = harness.collect_meta(args.checkout, label=args.label)
    runs = [measure(args.saves, args.compute_ms) for _ in range(args.repeats)]
    summary = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    print(", ".join(f"{k} {v:.3g}" for k, v in summary.items()), file=sys.stderr)
    harness.finish_meta(meta, started)
    harness.write_json(args.out, {"meta": meta, "runs": runs, "median": summary})
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
