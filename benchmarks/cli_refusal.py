"""Time to a refusal: how long `fedjax-sim` takes to refuse bad input, in a fresh process.

Usage:
  python benchmarks/cli_refusal.py                  # writes results/cli_refusal.json (or --out)
  python benchmarks/cli_refusal.py --repeats 3 --out /tmp/cli_refusal.json   # a smoke run

The command checks a preset's name and its `--set` values against the presets'
declarations (`fedjax_sim.experiments.manifest`) before it imports JAX, so a refusal
costs a Python start-up and the check. Each case below is a fresh
`python -m fedjax_sim.cli ...` of the measured checkout (`--checkout DIR` for
another), timed from the start of the process to its exit, `--repeats` times in
turn (case after case, so a burst of load falls on all of them); each must exit 2
with one line on stderr, or the script stops. For scale, the same is timed for a
bare `python -c pass` and for `python -c "import jax"` (what a refusal cost while
JAX was imported first). Reported: each case's median and minimum seconds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import time

import harness

# name -> the command line after `python`; None: not a refusal (a reference).
CASES = {
    "setting out of range (run ifca-synthetic --set k=-1)":
        ["-m", "fedjax_sim.cli", "run", "ifca-synthetic", "--set", "k=-1"],
    "mistyped setting (compare hetero-digits --set rouns=3)":
        ["-m", "fedjax_sim.cli", "compare", "hetero-digits", "--set", "rouns=3"],
    "unknown preset (run ifca-synthetc)":
        ["-m", "fedjax_sim.cli", "run", "ifca-synthetc"],
    "method that does not fit (run ifca-synthetic-tiny --set algorithm=ifca_ws)":
        ["-m", "fedjax_sim.cli", "run", "ifca-synthetic-tiny", "--set", "algorithm=ifca_ws"],
}
REFERENCES = {
    "python start-up (python -c pass)": ["-c", "pass"],
    "import jax (python -c 'import jax')": ["-c", "import jax"],
}


def _once(args: list[str], env: dict, refusal: bool) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=120)
    seconds = time.perf_counter() - started
    if refusal:
        lines = done.stderr.strip().splitlines()
        if done.returncode != 2 or len(lines) != 1:
            raise SystemExit(f"{' '.join(args)}: expected exit 2 and one line on stderr; got "
                             f"exit {done.returncode} and {done.stderr!r}")
    elif done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {done.stderr.strip()}")
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="runs of each case (default 10)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "cli_refusal.json"))
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    root = harness.resolve_checkout(args.checkout)
    env = {**os.environ, **harness.checkout_env(root), "JAX_PLATFORMS": "cpu"}
    started = time.perf_counter()
    meta = harness.collect_meta(root, repeats=args.repeats)
    every = {**{k: (v, True) for k, v in CASES.items()},
             **{k: (v, False) for k, v in REFERENCES.items()}}
    times: dict[str, list[float]] = {name: [] for name in every}
    for command, refusal in every.values():  # one untimed run each (file caches)
        _once(command, env, refusal)
    for _ in range(args.repeats):
        for name, (command, refusal) in every.items():
            times[name].append(_once(command, env, refusal))
    rows = [{"case": name, "refusal": every[name][1], "median_s": statistics.median(t),
             "min_s": min(t), "max_s": max(t), "times_s": t} for name, t in times.items()]
    for row in rows:
        print(f"{row['case']:<80} median {row['median_s']:.3f} s  min {row['min_s']:.3f} s")
    harness.write_json(args.out, {"rows": rows, "meta": harness.finish_meta(meta, started)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
