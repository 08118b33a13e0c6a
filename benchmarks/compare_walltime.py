"""Wall and CPU time of whole `fedjax-sim compare` runs, old checkout vs new, alternating.

The host side of a comparison (data, building, evaluation, files: everything
outside the compiled rounds) must not grow when the experiments layer changes.
Each command runs in a fresh process (compilation included, as a user sees
it), old and new in turn, `--repeats` times; the JSON holds every run's wall
and CPU seconds (the child's user + system time) and the medians.

    git worktree add /tmp/fedjax_old <old commit>
    python benchmarks/compare_walltime.py --old /tmp/fedjax_old --out OUT.json
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
# (name, the old checkout's arguments, the new checkout's): the new comparison is asked
# for the old one's methods where the new preset lists more.
CASES = [
    ("ifca-rotated-digits", ["compare", "ifca-rotated-digits"],
     ["compare", "ifca-rotated-digits", "--set", "methods=ifca,fedavg,local",
      "checkpoint_every=0"]),
    ("mixed-synthetic", ["compare", "mixed-synthetic"],
     ["compare", "mixed-synthetic", "--set", "checkpoint_every=0"]),
]


def _run(checkout: Path, args: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    env.pop("XLA_FLAGS", None)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fedjax_sim.cli", *args, "--out",
                               str(Path(tmp) / "out"), "--no-progress"], env=env,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "returncode": done.returncode,
            "stderr_tail": done.stderr[-300:] if done.returncode else ""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the old checkout (a git worktree)")
    parser.add_argument("--new", default=str(HERE.parent), help="the new checkout")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "compare_walltime.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    meta = harness.collect_meta(old_checkout=str(args.old))
    rows = []
    for name, old_args, new_args in CASES:
        runs = {"old": [], "new": []}
        for _ in range(args.repeats):
            for arm, checkout, cmd in (("old", args.old, old_args), ("new", args.new, new_args)):
                runs[arm].append(_run(Path(checkout), cmd))
                print(name, arm, runs[arm][-1], flush=True)
        row = {"case": name, "old_args": old_args, "new_args": new_args, "runs": runs}
        for arm in ("old", "new"):
            row[f"{arm}_wall_s"] = statistics.median(r["wall_s"] for r in runs[arm])
            row[f"{arm}_cpu_s"] = statistics.median(r["cpu_s"] for r in runs[arm])
        row["new_over_old_wall"] = row["new_wall_s"] / row["old_wall_s"]
        row["new_over_old_cpu"] = row["new_cpu_s"] / row["old_cpu_s"]
        rows.append(row)
    harness.write_json(args.out, {"meta": harness.finish_meta(meta, started), "rows": rows})
    for r in rows:
        print(f"{r['case']}: old {r['old_wall_s']:.1f} s wall / {r['old_cpu_s']:.1f} s CPU, "
              f"new {r['new_wall_s']:.1f} s / {r['new_cpu_s']:.1f} s "
              f"(new/old wall {r['new_over_old_wall']:.2f}, CPU {r['new_over_old_cpu']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
