"""End-to-end `run` vs the same rounds compiled in one `scan_rounds` call, and where the gap goes.

For each preset family it measures, in this process:

* **end to end**: `fedjax_sim.experiments.run_preset` into a temporary
  directory at the preset's default cadence (evaluation, metrics.csv,
  checkpoints, progress), with the rounds/s that `simulate.run` reports
  (compilation excluded: its `timing`, the figure summary.json carries);
* **compiled**: the same algorithm, data and key, all rounds in one
  `simulate.scan_rounds` program, compiled apart and timed to
  `block_until_ready` (the median of three calls interleaved with the runs;
  the end-to-end rate is the median of two runs);
* **phases**: a second run with the library's functions wrapped by timers here
  (nothing in the library is changed to be timed): compiled chunks (each
  blocked until ready, so their time is not charged to whoever reads them
  first), evaluation, round-metric reads, divergence checks, metrics.csv
  appends and fsyncs, checkpoint saves (and the wait for them at close),
  progress; `other` is the rest of the run's wall time without compilation
  (host reads of each chunk, building rows, the CSV row writer's Python);
* **process CPU**: every thread's CPU time per round of the end-to-end runs
  (the difference from a run of a tenth of the rounds, which has the same
  compilation and setup) and of the compiled calls: on a shared, loaded machine
  wall times swing with the load, CPU times much less.
  Blocking each chunk removes the overlap of the next chunk with the host's
  work on the previous one, so the phases sum to more than an uninstrumented run.

    python benchmarks/run_overhead.py                 # 2000 rounds: ~10 min, 2 busy cores
    python benchmarks/run_overhead.py --rounds 500 --families ifca-synthetic
    python benchmarks/run_overhead.py --checkout /tmp/old   # an older fedjax_sim
    python benchmarks/run_overhead.py --rounds 10000 --families ifca-synthetic \
        --end-to-end-only --out benchmarks/results/run_overhead_long.json

Writes benchmarks/results/run_overhead.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import tempfile
import time

import harness

HERE = pathlib.Path(__file__).resolve().parent

# label: (preset, overrides, rounds per --rounds): the synthetic IFCA run of issue 20 at
# fewer rounds, a DRFA `run` over 10 seeds of tiny rounds (the overhead-bound case), and one
# `run` of each other preset family at its default cadence (evaluation, checkpoints every 50).
FAMILIES = {
    "ifca-synthetic": ("ifca-synthetic",
                       ["k=2", "m=400", "n=50", "d=200", "R=0.5", "sigma=0.1", "seed=3"], 1.0),
    "drfa-synthetic-noise": ("drfa-synthetic-noise", ["method=drfa"], 5.0),
    "ifca-rotated-digits": ("ifca-rotated-digits", [], 0.25),
    "drflm-esol": ("drflm-esol", ["seeds=1"], 0.05),  # a GIN on molecules: ~0.5 s a round
    "mixed-synthetic": ("mixed-synthetic", [], 1.0),
    "hetero-digits": ("hetero-digits", [], 0.5),
}

# (phase, module, owner (None: the module), attribute). Missing attributes (another
# version of fedjax_sim) are skipped.
PHASES = [
    ("evaluate", "fedjax_sim.simulate", "_Timer", "first_call"),
    ("round_metric_reads", "fedjax_sim.simulate", None, "_row_value"),
    ("divergence_check", "fedjax_sim.simulate", "_Watch", "check"),
    ("metrics_csv", "fedjax_sim.logs", "MetricsCSV", "append"),
    ("metrics_csv", "fedjax_sim.logs", "MetricsCSV", "sync"),
    ("checkpoint", "fedjax_sim.checkpoint", "RunCheckpoints", "save"),
    ("checkpoint", "fedjax_sim.checkpoint", "RunCheckpoints", "close"),
    ("progress", "fedjax_sim.logs", "Progress", "advance"),
]


class Phases:
    """Seconds per phase, from wrappers that are not re-entrant within one phase."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._active: set[str] = set()

    def timed(self, phase, fn):
        def wrapped(*args, **kwargs):
            if phase in self._active:
                return fn(*args, **kwargs)
            self._active.add(phase)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._active.discard(phase)
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
                self.calls[phase] = self.calls.get(phase, 0) + 1

        return wrapped


@contextlib.contextmanager
def patched(patches):
    """Sets (owner, attribute, value) for the duration, restoring the originals."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def instrument(phases: Phases):
    """The patches that time each phase of `simulate.run`."""
    import importlib

    import jax

    simulate = importlib.import_module("fedjax_sim.simulate")
    patches = []
    original_scan = simulate._Timer.scan

    def scan(self, *args):
        if args[-1] not in self._compiled:  # compiling (timed by simulate as compilation)
            return original_scan(self, *args)
        t0 = time.perf_counter()
        out = jax.block_until_ready(original_scan(self, *args))
        phases.seconds["rounds"] = phases.seconds.get("rounds", 0.0) + time.perf_counter() - t0
        phases.calls["rounds"] = phases.calls.get("rounds", 0) + 1
        return out

    patches.append((simulate._Timer, "scan", scan))
    for phase, module, owner, name in PHASES:
        target = importlib.import_module(module)
        target = getattr(target, owner) if owner else target
        if name not in target.__dict__:
            continue
        original = target.__dict__[name]
        if phase == "evaluate":  # the evaluate function first_call returns; its 1st call compiles
            def first_call(self, fn, _original=original):
                calls = [0]

                def counted(*args):
                    calls[0] += 1
                    return fn(*args) if calls[0] == 1 else timed_fn(*args)

                timed_fn = phases.timed("evaluate", fn)
                return _original(self, counted)

            patches.append((target, name, first_call))
        else:
            patches.append((target, name, phases.timed(phase, original)))
    return patches


def capture_run():
    """(patches, calls): simulate.run wrapped to keep its arguments and timing."""
    from fedjax_sim import simulate

    calls = []
    original = simulate.run

    def run(algorithm, data, key, **kwargs):
        timing = kwargs.get("timing")
        if timing is None:
            timing = kwargs["timing"] = {}
        calls.append({"algorithm": algorithm, "data": data, "key": key,
                      "rounds": kwargs["rounds"], "timing": timing})
        return original(algorithm, data, key, **kwargs)

    return [(simulate, "run", run)], calls


def run_once(preset, overrides, phases: Phases | None):
    from fedjax_sim.experiments import run_preset

    patches, calls = capture_run()
    if phases is not None:
        patches += instrument(phases)
    with tempfile.TemporaryDirectory() as tmp, patched(patches):
        t0, cpu0 = time.perf_counter(), time.process_time()
        run_preset(preset, overrides, out_dir=pathlib.Path(tmp) / "run", progress=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    (call,) = calls
    timing = call["timing"]
    return call, {
        "wall_s": wall,
        "process_cpu_s": cpu,  # every thread's CPU, compilation included
        "rounds_run": timing["rounds_run"],
        "compile_s": timing["compile_seconds"],
        "run_s": timing["run_seconds"],
        "rounds_per_s": timing["rounds_run"] / timing["run_seconds"],
        # simulate.run's own count of evaluation time (compilation excluded)
        "evaluate_s": timing.get("evaluate_seconds"),
    }


def cpu_timed_call(fn, *args) -> tuple[float, float]:
    """(seconds, process CPU seconds) of one call that ends in `jax.block_until_ready`."""
    cpu0 = time.process_time()
    seconds, _ = harness.timed_call(fn, *args)
    return seconds, time.process_time() - cpu0


def compiled_rounds(call) -> dict:
    """The run's rounds in one scan_rounds program: compile apart, then time one call."""
    import jax

    from fedjax_sim import simulate

    algorithm, data, key, rounds = call["algorithm"], call["data"], call["key"], call["rounds"]
    key_init, key_rounds = jax.random.split(key)
    state = jax.block_until_ready(jax.jit(algorithm.init)(key_init, data))
    t0 = time.perf_counter()
    compiled = simulate._compiled_scan(data).lower(
        algorithm, state, data, key_rounds, 0, rounds).compile()
    compile_s = time.perf_counter() - t0
    seconds, cpu_s = cpu_timed_call(compiled, state, data, key_rounds, 0)
    return {"rounds": rounds, "compile_s": compile_s, "seconds": seconds, "cpu_s": cpu_s,
            "rounds_per_s": rounds / seconds}, (compiled, state, data, key_rounds, 0)


def measure(label, preset, overrides, rounds: int) -> dict:
    """Two end-to-end runs, one instrumented run and three compiled calls, interleaved
    (e2e, compiled, instrumented, compiled, e2e, compiled) so that a burst of load on a
    shared machine falls on both sides; the ratio is of the medians."""
    import numpy as np

    overrides = [*overrides, f"rounds={rounds}"]
    print(f"[{label}] end-to-end run 1 ...", file=sys.stderr, flush=True)
    call, e2e_1 = run_once(preset, overrides, None)
    first, (compiled, *args) = compiled_rounds(call)
    print(f"[{label}] instrumented run ...", file=sys.stderr, flush=True)
    phases = Phases()
    _, instrumented = run_once(preset, overrides, phases)
    second, second_cpu = cpu_timed_call(compiled, *args)
    print(f"[{label}] end-to-end run 2 ...", file=sys.stderr, flush=True)
    _, e2e_2 = run_once(preset, overrides, None)
    third, third_cpu = cpu_timed_call(compiled, *args)
    # The same run at a tenth of the rounds (same compilation, data and setup): the
    # process CPU per round of the run loop is the difference over the rounds between.
    short_rounds = rounds // 10
    print(f"[{label}] short run ({short_rounds} rounds) ...", file=sys.stderr, flush=True)
    _, short = run_once(preset, [*overrides[:-1], f"rounds={short_rounds}"], None)
    compiled_times = [first["seconds"], second, third]
    compiled_cpu = [first["cpu_s"], second_cpu, third_cpu]
    compiled_s = float(np.median(compiled_times))
    rate = rounds / compiled_s
    e2e_rates = [e2e_1["rounds_per_s"], e2e_2["rounds_per_s"]]
    e2e_rate = float(np.median(e2e_rates))
    if "evaluate" not in phases.seconds and instrumented["evaluate_s"] is not None:
        # Versions whose evaluation timer is not `_Timer.first_call`: simulate.run's count.
        phases.seconds["evaluate"] = instrumented["evaluate_s"]
    run_s = instrumented["run_s"]
    accounted = sum(phases.seconds.values())
    shares = {k: v / run_s for k, v in sorted(phases.seconds.items())}
    shares["other"] = max(run_s - accounted, 0.0) / run_s
    e2e_cpu = float(np.median([e2e_1["process_cpu_s"], e2e_2["process_cpu_s"]]))
    cpu_per_round = (e2e_cpu - short["process_cpu_s"]) / (rounds - short_rounds)
    compiled_cpu_per_round = float(np.median(compiled_cpu)) / rounds
    out = {
        "preset": preset,
        "overrides": overrides,
        "end_to_end": {"runs": [e2e_1, e2e_2], "rounds_per_s": e2e_rate},
        "compiled": {"rounds": rounds, "compile_s": first["compile_s"],
                     "seconds_calls": compiled_times, "seconds": compiled_s,
                     "process_cpu_s_calls": compiled_cpu,
                     "rounds_per_s": rate, "best_rounds_per_s": rounds / min(compiled_times)},
        "ratio_compiled_over_end_to_end": rate / e2e_rate,
        "short_run": short,
        "process_cpu": {"end_to_end_per_round_s": cpu_per_round,
                        "compiled_per_round_s": compiled_cpu_per_round,
                        "ratio_end_to_end_over_compiled": cpu_per_round / compiled_cpu_per_round},
        "instrumented": {**instrumented, "phase_seconds": phases.seconds,
                         "phase_calls": phases.calls, "phase_shares": shares},
    }
    print(f"[{label}] end-to-end {e2e_rate:.1f} rounds/s, compiled {rate:.1f} "
          f"rounds/s, ratio {out['ratio_compiled_over_end_to_end']:.2f} (process CPU per round "
          f"{cpu_per_round * 1e3:.3f} vs {compiled_cpu_per_round * 1e3:.3f} ms, ratio "
          f"{cpu_per_round / compiled_cpu_per_round:.2f}); shares "
          + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()), file=sys.stderr, flush=True)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_checkout_arg(parser)
    parser.add_argument("--rounds", type=int, default=2000,
                        help="rounds of the ifca-synthetic run (the other families: the factor in "
                             "FAMILIES times as many)")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", default=str(HERE / "results" / "run_overhead.json"))
    parser.add_argument("--label", default=None, help="a note stored in the JSON (e.g. before)")
    parser.add_argument("--end-to-end-only", action="store_true",
                        help="one uninstrumented run per family, no compiled calls (long runs, "
                             "where the history a checkpoint holds has grown)")
    args = parser.parse_args(argv)
    harness.use_checkout(args.checkout)
    started = time.perf_counter()
    meta = harness.collect_meta(args.checkout, rounds=args.rounds, label=args.label)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    results = {}
    for label in args.families.split(","):
        preset, overrides, factor = FAMILIES[label]
        rounds = max(int(args.rounds * factor), 10)
        if args.end_to_end_only:
            _, results[label] = run_once(preset, [*overrides, f"rounds={rounds}"], None)
            print(f"[{label}] end-to-end {results[label]['rounds_per_s']:.1f} rounds/s",
                  file=sys.stderr, flush=True)
        else:
            results[label] = measure(label, preset, overrides, rounds)
    harness.finish_meta(meta, started)
    harness.write_json(args.out, {"meta": meta, "results": results})
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
