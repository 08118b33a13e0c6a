"""Wall time, process CPU time and peak RSS of each phase of a rotated-images comparison.

    python benchmarks/compare_phases.py --set n=50 rounds=2 eval_every=2 seeds=5 \
        --methods ifca fedavg local oneshot ifca_ws

Phases, in the order a `fedjax-sim compare` runs them: data loading, federation
building (`build_problem`), then per method: the init's compile and run (for
one-shot: the local pre-training and k-means), the round's compile and its
rounds, and the evaluations (the first includes the compile). Each phase is timed
with `time.perf_counter` (wall) and `time.process_time` (CPU of all threads):
on a shared machine CPU seconds are the steadier figure. Peak RSS is
`resource.getrusage(RUSAGE_SELF).ru_maxrss`, the process's high-water mark so
far, printed after each phase. XLA's `memory_analysis()` of the init, round and
evaluation is printed too (temp bytes: the working memory XLA allocates).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedjax_sim import simulate  # noqa: E402
from fedjax_sim.experiments.ifca_images import MNIST, PRESETS, load_split_images  # noqa: E402
from fedjax_sim.experiments.settings import parse_assignments, resolve  # noqa: E402

ROWS: list[dict] = []


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Phase:
    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        row = {"phase": self.name, "wall_s": round(time.perf_counter() - self.wall, 2),
               "cpu_s": round(time.process_time() - self.cpu, 2),
               "peak_rss_gb": round(peak_gb(), 2)}
        ROWS.append(row)
        print(json.dumps(row), flush=True)


def temp_gb(compiled) -> float:
    try:
        return round(compiled.memory_analysis().temp_size_in_bytes / 2**30, 3)
    except Exception:  # memory_analysis is best effort per backend
        return float("nan")


def block(tree):
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready")
                        else a, tree)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE settings")
    parser.add_argument("--methods", nargs="*", default=list(MNIST.methods))
    args = parser.parse_args(argv)
    preset = next(p for p in PRESETS if p.name == "ifca-rotated-mnist")
    declared = {st.name: st for st in MNIST.settings}
    s = resolve(declared, preset.defaults, parse_assignments(args.set))
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with Phase("data"):
        load_split_images(s)
    with Phase("federation"):
        problem = MNIST.problem(s)
        block(problem["train"])
    for name in args.methods:
        spec = MNIST.method_run(name, s, problem)
        alg, data = spec.algorithm, spec.data
        key_init, key_rounds = jax.random.split(spec.key)
        with Phase(f"{name}: init compile"):
            init = jax.jit(alg.init).lower(key_init, data).compile()
        print(f"  init temp {temp_gb(init)} GB", flush=True)
        with Phase(f"{name}: init run" + (" (pretraining + k-means)" if name == "oneshot"
                                          else "")):
            state = block(init(key_init, data))
        with Phase(f"{name}: evaluation at round 0 (with compile)"):
            spec.evaluate(state)
        with Phase(f"{name}: round compile"):
            # Donating its input state, as `simulate.run`'s chunks do.
            lowered = simulate._compiled_scan(data, donate_state=True).lower(
                alg, state, data, key_rounds, 0, 1)
            compiled = lowered.compile()
        print(f"  round temp {temp_gb(compiled)} GB", flush=True)
        with Phase(f"{name}: {spec.rounds} rounds"):
            for t in range(spec.rounds):
                state, _ = compiled(state, data, key_rounds, t)
            block(state)
        with Phase(f"{name}: evaluation at the last round"):
            spec.evaluate(state)
        del state, init, compiled, lowered
    total = {"phase": "total", "wall_s": round(time.perf_counter() - wall0, 2),
             "cpu_s": round(time.process_time() - cpu0, 2), "peak_rss_gb": round(peak_gb(), 2)}
    ROWS.append(total)
    print(json.dumps(total), flush=True)


if __name__ == "__main__":
    main()
