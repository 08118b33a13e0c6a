"""Memory and time of an IFCA synthetic round over stored copies vs generated clients.

Usage:
  python benchmarks/memory_sources.py --out benchmarks/results/memory_sources.json
  python benchmarks/memory_sources.py --ladder 10000,1000000 --copies-max 1000000 --out /tmp/m.json

One IFCA option-I round (gradient averaging, linear regression, k = 4,
n = 10, d = 10, σ = 0.1, R = 1, one restart, `client_chunk` clients at a
time) at each m of the ladder, for two kinds of clients:

  copies: `linear_mixture(...).train`, every client's rows stored (440 B each);
  generated: `generated_mixture(...).train` (`GeneratedClients`): nothing per
    client stored, each chunk's rows drawn inside the round from fold_in(key, i).

Every (m, mode) runs in a fresh subprocess (peak RSS is per process): it
builds the data, compiles the jitted round apart (`.lower().compile()`,
reported as compile_s), runs it once (first_call_s) and, when that took
under 5 s, once more (round_s: the second call; else the first), each ending in
`block_until_ready`. It reports the process's peak RSS (VmHWM, data building
and compilation included), its RSS after building the data, and XLA's
`memory_analysis()` of the compiled round (argument, temp and output bytes).
Copies run up to --copies-max clients (their data alone is 440 B per client);
past --run-max a point is only built and compiled (its memory_analysis and
the peak RSS so far), not run: drawing 110 normals per client costs ~25 s of
2-core CPU per 10⁶ clients and round.
The JSON written to --out holds the rows and `meta` (CPU model, git HEAD, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import harness

SIZES = {"k": 4, "n": 10, "d": 10, "sigma": 0.1, "R": 1.0}


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def point(m: int, mode: str, chunk: int, run: bool = True) -> dict:
    """One (m, mode) in this process: its timings and memory (run=False: compile only)."""
    import jax

    from fedjax_sim import ALGORITHMS
    from fedjax_sim.data import generated_mixture, linear_mixture
    from fedjax_sim.models.core import linear_regression

    key = jax.random.key(0)
    t0 = time.perf_counter()
    make = generated_mixture if mode == "generated" else linear_mixture
    data = jax.block_until_ready(make(key, m=m, **SIZES).train)
    build_s = time.perf_counter() - t0
    rss_data_kib = _status_kib("VmRSS")
    algorithm = ALGORITHMS["ifca"](linear_regression(SIZES["d"]), num_clusters=SIZES["k"],
                                   learning_rate=0.1, client_chunk=min(chunk, m))
    state = jax.block_until_ready(jax.jit(algorithm.init)(key, data))
    round_ = jax.jit(algorithm.round)
    if not run:
        compiled, compile_s = harness.compile_ahead(round_, state, data, jax.random.key(1))
        analysis = compiled.memory_analysis()
        return {
            "m": m, "mode": mode, "client_chunk": min(chunk, m), "ran": False,
            "build_s": build_s, "compile_s": compile_s,
            "peak_rss_gb": _status_kib("VmHWM") * 1024 / 1e9,
            "argument_bytes": analysis.argument_size_in_bytes,
            "temp_bytes": analysis.temp_size_in_bytes,
            "output_bytes": analysis.output_size_in_bytes,
        }
    timing = harness.compile_then_time(round_, state, data, jax.random.key(1), reps=1,
                                       min_reps=0, budget_s=5.0)
    analysis = timing.compiled.memory_analysis()
    return {
        "m": m, "mode": mode, "client_chunk": min(chunk, m), "ran": True,
        "build_s": build_s,
        "compile_s": timing.compile_s,
        "first_call_s": timing.first_call_s,
        "round_s": timing.median_s if timing.count else timing.first_call_s,
        "peak_rss_gb": _status_kib("VmHWM") * 1024 / 1e9,
        "rss_after_data_gb": rss_data_kib * 1024 / 1e9,
        "argument_bytes": analysis.argument_size_in_bytes,
        "temp_bytes": analysis.temp_size_in_bytes,
        "output_bytes": analysis.output_size_in_bytes,
        "train_loss": float(timing.output[1]["train_loss"]),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ladder", default="10000,1000000,10000000,100000000",
                        help="comma-separated m values")
    parser.add_argument("--copies-max", type=float, default=1e6,
                        help="largest m run with stored copies")
    parser.add_argument("--run-max", type=float, default=1e7,
                        help="larger m are compiled (memory_analysis, peak RSS) but not run")
    parser.add_argument("--chunk", type=int, default=65536, help="client_chunk")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    parser.add_argument("--out", default="benchmarks/results/memory_sources.json")
    parser.add_argument("--point", nargs=4, metavar=("M", "MODE", "CHUNK", "RUN"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point:
        m, mode, chunk, run = args.point
        print(json.dumps(point(int(float(m)), mode, int(chunk), run == "run")), flush=True)
        return
    started = time.perf_counter()
    meta = harness.collect_meta(sizes=SIZES, client_chunk=args.chunk, restarts=1,
                                run_max=args.run_max, copies_max=args.copies_max)
    rows = []
    for m in (int(float(v)) for v in args.ladder.split(",")):
        for mode in ("copies", "generated"):
            if mode == "copies" and m > args.copies_max:
                continue
            row = harness.run_point_subprocess(
                __file__, ["--point", str(m), mode, str(args.chunk),
                           "run" if m <= args.run_max else "compile"], timeout=args.timeout)
            row.setdefault("m", m)
            row.setdefault("mode", mode)
            rows.append(row)
            print(json.dumps(harness.strict_json(row)), file=sys.stderr, flush=True)
    harness.write_json(args.out, {"meta": harness.finish_meta(meta, started), "rows": rows})


if __name__ == "__main__":
    main()
