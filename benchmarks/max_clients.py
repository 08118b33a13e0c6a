"""The largest number of clients m whose IFCA round runs in this machine's memory.

Usage:
  python benchmarks/max_clients.py --out max_clients.json           # ~12 min on 2 cores
  python benchmarks/max_clients.py --quick --out /tmp/quick.json    # smoke run, ~1 min
  python benchmarks/max_clients.py --tasks mlp --modes chunked \\
      --ladder mlp=110000 --max-trial-s 900 --budget-s 1800  # the chunked MLP near 20 GB

Two tasks, each with `client_chunk` (default sizes in DEFAULT_CHUNKS) and
without (None, everything at once):

  synthetic: IFCA option I (gradient averaging), linear regression, k=4,
    n=10, d=10, data from `linear_mixture` (σ=0.1, R=1).
  mlp: IFCA option II (model averaging), `mlp_classifier((784,), (200,), 10)`,
    k=4, n=50 N(0, 1) inputs with random labels per client, τ=2 local SGD steps.

Every m runs in its own subprocess (`harness.run_subprocess`). It builds the
data in chunks of clients written in place into preallocated arrays (donated
buffers; `linear_mixture`'s `client_ids` gives exactly the rows of the whole
problem), so building the data never needs more than the data plus one chunk. Then, for each mode
(chunked first, as the unchunked one is the likelier to die), it resets the
process's peak RSS (Linux clear_refs), compiles the jitted round and runs it
(`harness.compile_then_time`: compile apart, a first round, and a second,
timed, when the first took under 5 s) and reports the peak RSS of that
phase, which includes the data it holds. A watchdog in the parent kills a
child whose RSS passes --limit-gb or that leaves less than --min-free-gb of
the machine's memory available to other processes (RLIMIT_AS is useless with
XLA, which reserves far more address space than it touches).

m climbs a ladder. Before each step a mode's next peak is extrapolated
linearly from its last two results (peak grows linearly in m); a mode stops
when that passes --limit-gb or the memory available now, when its
extrapolated time passes --max-trial-s or the time left of the task's
--budget-s, or at its first failure. The JSON written to --out has one row per (m, mode)
and, per task and mode, the largest m that ran and the m where the line
through the last two peaks reaches --limit-gb, plus the run's `meta`
(`harness.collect_meta`, with the machine ceilings in `meta["probes"]`);
synthetic rows also get `fraction_of_stream` (`harness.linear_round_bytes`
per second over the stream probe). `--checkout DIR` measures another
fedjax_sim checkout (children included).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time

import harness
import jax
import jax.numpy as jnp
import numpy as np

# The fedjax_sim of --checkout (default: this one), not a copy in site-packages;
# read before argparse runs, since fedjax_sim is imported here at module level.
ROOT = harness.resolve_checkout(harness.checkout_from_argv())
harness.use_checkout(ROOT)

from fedjax_sim import backend, memory  # noqa: E402
from fedjax_sim.algorithms import ifca, sgd  # noqa: E402
from fedjax_sim.data import FederatedData, linear_mixture  # noqa: E402
from fedjax_sim.execution import planned  # noqa: E402
from fedjax_sim.models import linear_regression, mlp_classifier  # noqa: E402

LADDERS = {
    "synthetic": (10**5, 3 * 10**5, 10**6, 2 * 10**6, 10**7, 2 * 10**7, 4 * 10**7, 8 * 10**7),
    "mlp": (1000, 2000, 4000, 8000, 16000, 32000, 64000, 128000),
}
QUICK_LADDERS = {"synthetic": (10**4, 10**5), "mlp": (100, 300)}
DEFAULT_CHUNKS = "synthetic=65536,mlp=128"
# Seconds per task (--budget-s): about 12 minutes in all on 2 cores.
DEFAULT_BUDGETS = "synthetic=500,mlp=240"
K = 4
SYN = dict(n=10, d=10, sigma=0.1, R=1.0)
MLP = dict(n=50, input_dim=784, hidden=200, classes=10, local_steps=2, lr=0.05)
BUILD_CHUNK_BYTES = 64 * 2**20  # data rows generated per step while building


# --------------------------------------------------------------------------- the child


def _status_kb(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Sets this process's VmHWM (and ru_maxrss) to its current RSS (Linux clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@functools.partial(jax.jit, donate_argnums=0)
def _write(buffers, part, start):
    return jax.tree.map(
        lambda b, p: jax.lax.dynamic_update_slice_in_dim(b, p, start, 0), buffers, part
    )


def build_in_chunks(draw, m: int, row_bytes: int) -> FederatedData:
    """FederatedData of m clients, `draw(first_id, count)` clients at a time, written in place."""
    c = max(1, min(m, BUILD_CHUNK_BYTES // row_bytes))
    # The last chunk starts at m − c (overlapping the previous one) so every
    # chunk has the same shape: one compilation, and ids stay positions.
    starts = sorted({min(s, m - c) for s in range(0, m, c)})
    first = draw(starts[0], c)
    buffers = jax.tree.map(lambda a: jnp.zeros((m, *a.shape[1:]), a.dtype), first)
    buffers = _write(buffers, first, starts[0])
    for s in starts[1:]:
        buffers = _write(buffers, draw(s, c), s)
    return buffers


def synthetic_data(m: int) -> FederatedData:
    key = jax.random.key(0)

    @functools.partial(jax.jit, static_argnums=1)
    def draw_ids(first, count):
        ids = first + jnp.arange(count)
        return linear_mixture(key, k=K, m=m, **SYN, client_ids=ids).train

    row = 4 * SYN["n"] * (SYN["d"] + 1)
    return build_in_chunks(lambda s, c: draw_ids(jnp.int32(s), c), m, row)


def mlp_data(m: int) -> FederatedData:
    n, dim = MLP["n"], MLP["input_dim"]
    key = jax.random.key(0)

    @functools.partial(jax.jit, static_argnums=1)
    def draw_ids(first, count):
        kx, ky = jax.random.split(jax.random.fold_in(key, first))
        # A flat draw: XLA:CPU compiles a 3-D random.normal far more slowly.
        x = jax.random.normal(kx, (count * n * dim,)).reshape(count, n, dim)
        y = jax.random.randint(ky, (count * n,), 0, MLP["classes"]).reshape(count, n)
        return FederatedData(
            x=x, y=y, num_examples=jnp.full((count,), n, jnp.int32),
            cluster=jnp.full((count,), -1, jnp.int32),
        )

    return build_in_chunks(lambda s, c: draw_ids(jnp.int32(s), c), m, 4 * n * (dim + 1))


def setting(task: str):
    """(model, algorithm, IFCA option) of a task."""
    if task == "synthetic":
        model = linear_regression(SYN["d"])
        return model, ifca(model, sgd(0.1), num_clusters=K), "gradient"
    model = mlp_classifier((MLP["input_dim"],), (MLP["hidden"],), MLP["classes"])
    algorithm = ifca(model, sgd(MLP["lr"], steps=MLP["local_steps"]), num_clusters=K,
                     option="model")
    return model, algorithm, "model"


def run_round(task: str, data: FederatedData, chunk: int | None) -> dict:
    """Compiles and runs one round of a mode; the peak RSS is that of this phase."""
    model, algorithm, option = setting(task)
    data = planned(data, client_chunk=chunk)  # the executor's memory plan
    _reset_peak_rss()
    held_gb = _status_kb("VmRSS") / 2**20
    state = jax.jit(algorithm.init)(jax.random.key(1), data)
    # A second round (key 3, from the same state) only when the first took < 5 s.
    timing = harness.compile_then_time(
        backend.jit(algorithm.round, backend.feature_size(data)), state, data, jax.random.key(2),
        reps=1, min_reps=0, budget_s=5.0,
        next_args=lambda i, args, out: (args[0], args[1], jax.random.key(2 + i)),
    )
    stats = timing.compiled.memory_analysis()
    new_state, metrics = timing.output
    params = jax.tree.leaves(new_state.cluster_params)
    return {
        "client_chunk": chunk,
        "peak_rss_round_gb": _status_kb("VmHWM") / 2**20,
        "rss_before_round_gb": held_gb,
        "xla_temp_gb": stats.temp_size_in_bytes / 2**30 if stats is not None else None,
        "estimated_bytes_per_client": memory.estimate_bytes_per_client(
            model, data, local_training=option == "model", num_clusters=K
        ),
        "compile_seconds": timing.compile_s,
        "seconds_per_round": timing.median_s if timing.count else timing.first_call_s,
        "first_round_seconds": timing.first_call_s,
        "cohort_loss": float(metrics["cohort_loss"]),
        "finite": all(bool(np.all(np.isfinite(p))) for p in params),
    }


def run_trial(task: str, m: int, chunks: list[int | None]) -> None:
    """Builds the data once, then prints one JSON line per mode as soon as it is done."""
    t0 = time.perf_counter()
    data = synthetic_data(m) if task == "synthetic" else mlp_data(m)
    jax.block_until_ready(data)
    built = {
        "data_gb": memory.tree_bytes(data) / 2**30,
        "data_seconds": time.perf_counter() - t0,
        "peak_rss_data_gb": _status_kb("VmHWM") / 2**20,
    }
    for chunk in chunks:
        print(json.dumps({**built, **run_round(task, data, chunk)}), flush=True)


# --------------------------------------------------------------------------- the parent


def _meminfo_gb(field: str) -> float:
    value = harness.meminfo_gib(field)
    return float("nan") if value is None else value


def launch(task: str, m: int, chunks: list[int | None], limit_gb: float, min_free_gb: float,
           timeout_s: float) -> list[dict]:
    """One child for one m and the given modes, watched; one row per mode."""
    spec = ",".join("none" if c is None else str(c) for c in chunks)
    cmd = [sys.executable, os.path.abspath(__file__), "--trial", task, str(m), spec,
           "--checkout", str(ROOT)]
    max_rss = [0.0]

    def watch(pid: int) -> str | None:
        try:
            rss_gb = _status_kb("VmRSS", str(pid)) / 2**20
        except (OSError, ValueError):
            return None
        max_rss[0] = max(max_rss[0], rss_gb)
        if rss_gb > limit_gb:
            return f"RSS {rss_gb:.1f} GB passed --limit-gb {limit_gb}"
        if _meminfo_gb("MemAvailable") < min_free_gb:
            return f"machine below {min_free_gb} GB available (RSS {rss_gb:.1f} GB)"
        return None

    finished = harness.run_subprocess(
        cmd, env=harness.checkout_env(ROOT), timeout=timeout_s, watch=watch
    )
    wall = finished.wall_s
    done = finished.json_objects()
    rows = []
    for i, chunk in enumerate(chunks):
        row = {"task": task, "m": m, "client_chunk": chunk, "child_wall_seconds": wall}
        if i < len(done):
            row.update(done[i], ok=True)
            # The process's peak: building the data, or this mode's round.
            row["peak_rss_gb"] = max(row["peak_rss_round_gb"], row["peak_rss_data_gb"])
        else:
            row["ok"] = False
            row["max_rss_seen_gb"] = max_rss[0]
            row["error"] = finished.killed or (
                f"exit {finished.returncode}: " + finished.stderr.strip()[-400:]
            )
        rows.append(row)
    return rows


def _line(rows: list[dict], key: str):
    """(slope, last row) of the line through the last two successful rows, or None."""
    ok = [r for r in rows if r["ok"]]
    if len(ok) < 2:
        return None
    a, b = ok[-2], ok[-1]
    return (b[key] - a[key]) / (b["m"] - a["m"]), b


def _extrapolate(rows: list[dict], key: str, m_next: int) -> float | None:
    """key at m_next on the line through the last two results (one result: proportional)."""
    ok = [r for r in rows if r["ok"]]
    if not ok:
        return None
    if len(ok) == 1:
        return ok[0][key] * m_next / ok[0]["m"]
    slope, b = _line(rows, key)
    return b[key] + max(slope, 0.0) * (m_next - b["m"])


def _m_at_limit(rows: list[dict], limit_gb: float) -> int | None:
    line = _line(rows, "peak_rss_gb")
    if line is None or line[0] <= 0:
        return None
    slope, b = line
    return int(b["m"] + (limit_gb - b["peak_rss_gb"]) / slope)


def _chunk(task: str, m: int, spec: str, work_gb: float) -> int:
    """The client_chunk of a chunked run: fixed per task, or from a working-memory budget."""
    if spec != "auto":
        return min(m, int(dict(kv.split("=") for kv in spec.split(","))[task]))
    if task == "synthetic":
        feature, target = (SYN["n"], SYN["d"]), jnp.float32
    else:
        feature, target = (MLP["n"], MLP["input_dim"]), jnp.int32
    shapes = FederatedData(
        x=jax.ShapeDtypeStruct((m, *feature), jnp.float32),
        y=jax.ShapeDtypeStruct((m, feature[0]), target),
        num_examples=jax.ShapeDtypeStruct((m,), jnp.int32),
        cluster=jax.ShapeDtypeStruct((m,), jnp.int32),
    )
    model, _, option = setting(task)
    per = memory.estimate_bytes_per_client(model, shapes, local_training=option == "model",
                                           num_clusters=K)
    return memory.client_chunk_for_budget(m, per, work_gb * 2**30) or m


def _describe(row: dict) -> str:
    head = f"{row['task']} m={row['m']} client_chunk={row['client_chunk']}: "
    if not row["ok"]:
        return head + f"FAILED: {row['error']}"
    return head + (
        f"peak {row['peak_rss_gb']:.2f} GB (round {row['peak_rss_round_gb']:.2f} GB, "
        f"data {row['data_gb']:.2f} GB), "
        f"{row['seconds_per_round']:.2f} s/round, compile {row['compile_seconds']:.1f} s, "
        f"XLA temp {row['xla_temp_gb']:.3f} GB"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="max_clients.json")
    parser.add_argument("--tasks", default="synthetic,mlp")
    parser.add_argument("--modes", default="chunked,unchunked")
    parser.add_argument("--chunk", default=DEFAULT_CHUNKS,
                        help="client_chunk of the chunked runs, TASK=INT,... or 'auto' "
                             "(memory.client_chunk_for_budget with --work-gb)")
    parser.add_argument("--work-gb", type=float, default=1.0)
    parser.add_argument("--ladder", action="append", default=[], metavar="TASK=M1,M2,...",
                        help="replace a task's ladder of m")
    parser.add_argument("--limit-gb", type=float, default=20.0)
    parser.add_argument("--min-free-gb", type=float, default=1.0)
    parser.add_argument("--max-trial-s", type=float, default=240.0)
    parser.add_argument("--budget-s", default=DEFAULT_BUDGETS,
                        help="seconds per task, TASK=S,... or one number for every task")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trial", nargs=3, help=argparse.SUPPRESS)
    harness.add_checkout_arg(parser)  # read at import time (harness.checkout_from_argv)
    args = parser.parse_args(argv)

    if args.trial:
        task, m, spec = args.trial
        run_trial(task, int(m), [None if c == "none" else int(c) for c in spec.split(",")])
        return 0

    ladders = dict(QUICK_LADDERS if args.quick else LADDERS)
    for spec in args.ladder:
        task, ms = spec.split("=")
        ladders[task] = tuple(int(float(v)) for v in ms.split(","))
    modes = args.modes.split(",")
    if "=" in args.budget_s:
        budgets = {t: float(v) for t, v in (kv.split("=") for kv in args.budget_s.split(","))}
    else:
        budgets = dict.fromkeys(ladders, float(args.budget_s))
    began = time.perf_counter()
    meta = harness.collect_meta(ROOT, quick=args.quick)
    probes = harness.machine_ceilings(quick=args.quick)
    rows, summary = [], []
    for task in args.tasks.split(","):
        task_began = time.perf_counter()
        series = {mode: [] for mode in modes}
        stopped = {mode: None for mode in modes}
        for m in ladders[task]:
            left = budgets.get(task, 300.0) - (time.perf_counter() - task_began)
            allowed = min(args.max_trial_s, left)
            run = []
            for mode in modes:
                if stopped[mode]:
                    continue
                peak = _extrapolate(series[mode], "peak_rss_gb", m)
                wall = _extrapolate(series[mode], "child_wall_seconds", m)
                if peak is not None and peak > args.limit_gb:
                    stopped[mode] = f"m={m}: extrapolated peak {peak:.1f} GB > {args.limit_gb} GB"
                elif peak is not None and peak + args.min_free_gb > _meminfo_gb("MemAvailable"):
                    stopped[mode] = f"m={m}: extrapolated peak {peak:.1f} GB > available now"
                elif wall is not None and wall > allowed:
                    stopped[mode] = f"m={m}: extrapolated {wall:.0f} s > {allowed:.0f} s allowed"
                else:
                    run.append(mode)
                    continue
                print(f"{task} {mode}: stop, {stopped[mode]}", flush=True)
            if not run:
                break
            chunks = [_chunk(task, m, args.chunk, args.work_gb) if mode == "chunked" else None
                      for mode in run]
            results = launch(task, m, chunks, args.limit_gb, args.min_free_gb,
                             timeout_s=max(2 * allowed, 60.0))
            for mode, row in zip(run, results, strict=True):
                row["mode"] = mode
                if task == "synthetic" and row["ok"]:
                    row["fraction_of_stream"] = (
                        harness.linear_round_bytes(m, SYN["n"], SYN["d"])
                        / row["seconds_per_round"] / (probes["stream_GBps"] * 1e9)
                    )
                series[mode].append(row)
                print(_describe(row), flush=True)
                if not row["ok"]:
                    stopped[mode] = f"m={m}: {row['error']}"
        for mode in modes:
            ran = [r for r in series[mode] if r["ok"]]
            last = ran[-1] if ran else {}
            rows.extend(series[mode])
            summary.append({
                "task": task,
                "mode": mode,
                "largest_m_run": last.get("m"),
                "client_chunk": last.get("client_chunk"),
                "peak_rss_gb": last.get("peak_rss_gb"),
                "seconds_per_round": last.get("seconds_per_round"),
                "m_at_limit_by_linear_fit": _m_at_limit(series[mode], args.limit_gb),
                "stopped_by": stopped[mode] or "end of ladder",
            })
    result = {
        "limit_gb": args.limit_gb,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "mem_total_gb": _meminfo_gb("MemTotal"), "jax": jax.__version__},
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["benchmarks/max_clients.py", *(argv or sys.argv[1:])]),
        "settings": {"k": K, "synthetic": SYN, "mlp": MLP, "chunk": args.chunk},
        "total_seconds": time.perf_counter() - began,
        "summary": summary,
        "trials": rows,
        "meta": {**harness.finish_meta(meta, began), "probes": probes,
                 "round_bytes_model": harness.LINEAR_ROUND_BYTES_MODEL + " (synthetic rows)"},
    }
    harness.write_json(args.out, result, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
