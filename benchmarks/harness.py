"""What every benchmark shares: which fedjax_sim it measures, on what machine, and how.

Every benchmark script imports this module as `harness` (it sits beside them, so
`python benchmarks/X.py` finds it). It provides:

* **Which fedjax_sim.** `use_checkout(path)` puts a fedjax_sim checkout first
  on `sys.path`, imports `fedjax_sim` and fails (`CheckoutError`) unless it
  was imported from that checkout. `add_checkout_arg` gives a script its
  `--checkout DIR` option, so another checkout (a worktree of another branch)
  is measured with the same benchmark code.
* **Provenance.** `collect_meta` / `finish_meta`: CPU model, cores, memory,
  load average at start and end, date, versions, JAX backend and devices,
  and of the measured checkout its git HEAD (only when the checkout is a
  fedjax_sim repository), whether fedjax_sim/ has uncommitted changes, and a
  sha256 of the fedjax_sim sources.
* **Timing.** `compile_then_time` compiles apart (`.lower(...).compile()` for
  a jitted function), then times steady-state calls that each end in
  `jax.block_until_ready`; `interleaved_blocks` times several arms in turn,
  block after block, so that a burst of load on a shared machine falls on
  all of them.
* **Machine ceilings.** `stream_bandwidth()` (a triad) and `matmul_peak()`,
  so results can be stated as fractions of what the machine can do.
* **A fresh process per point.** `run_point_subprocess` runs one
  measurement in a new Python (JAX fixes its device count at start-up; peak
  RSS is per process) and parses the JSON object it prints.
* **Where the time goes.** `thunk_profile` traces calls of a compiled
  function with `jax.profiler` and sums the time of each XLA instruction,
  with the JAX op it came from.
* **Strict JSON.** `write_json`: NaN and ±inf become null.

JAX is imported only inside the functions that need it, so `use_checkout`
and `write_json` work before (or without) JAX.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import itertools
import json
import math
import os
import pathlib
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

PACKAGE = "fedjax_sim"
# The checkout this harness lives in: the default one to measure.
REPO = pathlib.Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- which fedjax_sim


class CheckoutError(RuntimeError):
    """The fedjax_sim to measure is missing, or another copy of it got imported."""


def resolve_checkout(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The absolute root of a fedjax_sim checkout (default: this repository).

    Raises:
      CheckoutError: `path` has no `fedjax_sim/__init__.py`.
    """
    root = REPO if path is None else pathlib.Path(path).expanduser().resolve()
    if not (root / PACKAGE / "__init__.py").is_file():
        raise CheckoutError(
            f"{root} is not a fedjax_sim checkout: there is no {root / PACKAGE / '__init__.py'} "
            f"(pass --checkout the root of a clone or worktree, e.g. one made with "
            f"`git worktree add /tmp/old <commit>`)."
        )
    return root


def use_checkout(path: str | os.PathLike | None = None):
    """Imports fedjax_sim from the checkout at `path` (default: this repository).

    The checkout goes first on `sys.path`, ahead of any installed copy (a
    stale site-packages install was once measured silently this way).

    Returns:
      The imported `fedjax_sim` module.

    Raises:
      CheckoutError: `path` is not a checkout, or `fedjax_sim` was (or had
        already been) imported from somewhere else.
    """
    root = resolve_checkout(path)
    module = sys.modules.get(PACKAGE)
    if module is None:
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
        module = importlib.import_module(PACKAGE)
    where = pathlib.Path(module.__file__).resolve()
    if not where.is_relative_to(root / PACKAGE):
        raise CheckoutError(
            f"fedjax_sim was imported from {where}, not from the checkout {root}: "
            "something imported it before use_checkout, or an installed copy shadows it."
        )
    return module


def import_fresh(path: str | os.PathLike, modules: Sequence[str]) -> dict:
    """`fedjax_sim.<name>` for each name, imported afresh from the checkout at `path`.

    Every fedjax_sim module already imported is dropped first, so two checkouts can be
    imported one after the other into one process (for old-vs-new A/B timing: a compiled
    executable does not need its modules afterwards).

    Raises:
      CheckoutError: the package came from somewhere other than `path`.
    """
    root = resolve_checkout(path)
    for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        package = importlib.import_module(PACKAGE)
        if not pathlib.Path(package.__file__).resolve().is_relative_to(root):
            raise CheckoutError(f"imported {package.__file__}, not a file under {root}")
        return {name: importlib.import_module(f"{PACKAGE}.{name}") for name in modules}
    finally:
        sys.path.remove(str(root))


def add_checkout_arg(parser) -> None:
    """Adds `--checkout DIR` to an argparse parser."""
    parser.add_argument(
        "--checkout", metavar="DIR", default=None,
        help="root of the fedjax_sim checkout to measure (default: the one this script is "
             f"in, {REPO}); e.g. an old commit's `git worktree add /tmp/old COMMIT`",
    )


def checkout_from_argv(argv: Sequence[str] | None = None) -> str | None:
    """The value of `--checkout DIR` / `--checkout=DIR` in argv (default sys.argv), or None.

    For scripts that import fedjax_sim at module level, before argparse runs.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv):
        if arg == "--checkout" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--checkout="):
            return arg.split("=", 1)[1]
    return None


def checkout_env(root: str | os.PathLike) -> dict[str, str]:
    """Environment entries that make a child Python import fedjax_sim from `root`."""
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(root) + (os.pathsep + old if old else "")}


# --------------------------------------------------------------------------- provenance


def cpu_model() -> str | None:
    """lscpu's "Model name", else /proc/cpuinfo's "model name", else platform.processor()."""
    try:
        out = subprocess.run(
            ["lscpu"], capture_output=True, text=True, timeout=10,
            env={**os.environ, "LC_ALL": "C"},
        ).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def meminfo_gib(field: str) -> float | None:
    """A /proc/meminfo field in GiB (None where there is no /proc/meminfo)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def sources_sha256(package_dir: str | os.PathLike) -> str:
    """First 16 hex digits of a sha256 over every *.py under package_dir (paths and bytes).

    The same digest rounds_per_sec.py has recorded since 8121080, so old
    results stay comparable.
    """
    package = pathlib.Path(package_dir)
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def git_provenance(package_dir: str | os.PathLike) -> dict:
    """{"git_head", "git_dirty"} of the repository whose top level holds package_dir.

    Both are None unless package_dir's parent is the top of a git work tree
    (so an enclosing repository, or a copy outside any, reports nothing).
    `git_dirty` covers uncommitted changes, untracked files included, under
    the package directory only.
    """
    package = pathlib.Path(package_dir).resolve()
    out = {"git_head": None, "git_dirty": None}

    def git(*cmd):
        return subprocess.run(
            ["git", *cmd], cwd=package, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        top = pathlib.Path(git("rev-parse", "--show-toplevel")).resolve()
        if top == package.parent:
            out["git_head"] = git("rev-parse", "--short", "HEAD")
            out["git_dirty"] = bool(git("status", "--porcelain", "--", "."))
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def source_provenance(checkout: str | os.PathLike) -> dict:
    """What is measured: the checkout, its fedjax_sim sources' hash, git HEAD and dirtiness."""
    root = resolve_checkout(checkout)
    package = root / PACKAGE
    out = {"checkout": str(root), "fedjax_sim_sources_sha256": sources_sha256(package)}
    out.update(git_provenance(package))
    loaded = sys.modules.get(PACKAGE)
    out["fedjax_sim_file"] = getattr(loaded, "__file__", None)
    return out


def machine_meta() -> dict:
    """The host: CPU model, cores, memory, OS, and the JAX backend with its devices."""
    import jax
    import jaxlib

    devices = jax.devices()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count()
    return {
        "cpu_model": cpu_model(),
        "host_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "mem_total_gib": meminfo_gib("MemTotal"),
        "mem_available_gib_start": meminfo_gib("MemAvailable"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backend": jax.default_backend(),
        "device": str(devices[0].device_kind),
        "devices": [str(d) for d in devices],
        "num_devices": len(devices),
    }


def collect_meta(checkout: str | os.PathLike | None = None, **extra) -> dict:
    """Meta of a benchmark run, taken at its start; complete it with `finish_meta`.

    Args:
      checkout: the measured fedjax_sim checkout (default: this repository).
      **extra: more entries (settings of the run, `quick`, ...).
    """
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "loadavg_start": list(os.getloadavg()),
        **machine_meta(),
        **source_provenance(resolve_checkout(checkout)),
        **extra,
    }


def finish_meta(meta: dict, started: float) -> dict:
    """Adds the end-of-run load average and `total_seconds` since perf_counter() `started`."""
    meta["loadavg_end"] = list(os.getloadavg())
    meta["total_seconds"] = time.perf_counter() - started
    return meta


# --------------------------------------------------------------------------- timing


class Timing(NamedTuple):
    """What `compile_then_time` measured; seconds throughout."""

    compile_s: float | None  # `.lower().compile()`; None when fn was not a jitted function
    first_call_s: float  # the warm-up call (compiles too, when compile_s is None)
    median_s: float | None  # of the timed calls; None when none ran
    min_s: float | None
    count: int  # timed calls, the warm-up excluded
    times: list[float]
    compiled: Callable  # what was called: the AOT executable, or fn itself
    output: Any  # the last call's output

    def summary(self) -> dict:
        return {
            "compile_s": self.compile_s,
            "first_call_s": self.first_call_s,
            "median_s": self.median_s,
            "min_s": self.min_s,
            "count": self.count,
        }


def compile_ahead(fn: Callable, *args) -> tuple[Callable, float | None]:
    """(callable, compile seconds): `fn.lower(*args).compile()` for a jitted fn, else (fn, None)."""
    if not hasattr(fn, "lower"):
        return fn, None
    t0 = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - t0


def timed_call(fn: Callable, *args) -> tuple[float, Any]:
    """(seconds, output) of one call that ends in `jax.block_until_ready`."""
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def compile_then_time(
    fn: Callable,
    *args,
    reps: int,
    min_reps: int | None = None,
    budget_s: float | None = None,
    next_args: Callable[[int, tuple, Any], Sequence] | None = None,
    on_call: Callable[[int, float, Any], None] | None = None,
) -> Timing:
    """Compiles `fn` for `args` apart, makes one warm-up call, then times steady calls.

    Every call ends in `jax.block_until_ready` on its output.

    Args:
      fn: a jitted function (compiled with `.lower(*args).compile()`, timed as
        compile_s) or any callable (its first call then includes tracing and
        compiling, and compile_s is None).
      *args: arguments of the first call.
      reps: the most timed calls.
      min_reps: the fewest timed calls (default: reps).
      budget_s: beyond min_reps, no call starts once this many seconds have
        passed since the warm-up call began (None: always `reps` calls).
      next_args: `(i, previous_args, previous_output) -> args` of call i
        (i = 1 is the first timed call; the warm-up is call 0). Use it to
        chain a state, or to give each call its own seed. Not timed.
      on_call: `(i, seconds, output)` after every call, the warm-up included
        (for live logs or to keep outputs).

    Returns:
      A Timing; median_s and min_s are over the timed calls only.
    """
    min_reps = reps if min_reps is None else min_reps
    if reps < 0 or not 0 <= min_reps <= reps:
        raise ValueError(f"need 0 <= min_reps <= reps; got min_reps={min_reps}, reps={reps}.")
    compiled, compile_s = compile_ahead(fn, *args)
    began = time.perf_counter()
    first_s, out = timed_call(compiled, *args)
    if on_call is not None:
        on_call(0, first_s, out)
    times: list[float] = []
    while len(times) < min_reps or (
        len(times) < reps and (budget_s is None or time.perf_counter() - began < budget_s)
    ):
        i = len(times) + 1
        if next_args is not None:
            args = tuple(next_args(i, args, out))
        seconds, out = timed_call(compiled, *args)
        times.append(seconds)
        if on_call is not None:
            on_call(i, seconds, out)
    return Timing(
        compile_s=compile_s,
        first_call_s=first_s,
        median_s=float(np.median(times)) if times else None,
        min_s=float(np.min(times)) if times else None,
        count=len(times),
        times=times,
        compiled=compiled,
        output=out,
    )


def thunk_profile(compiled, *args, calls: int = 10) -> dict[str, dict]:
    """Time per call of each XLA instruction of `compiled` (a `.lower(...).compile()`d
    function), traced with `jax.profiler` over `calls` calls.

    Returns:
      {instruction name: {"us_per_call", "count_per_call", "op_name"}}; op_name is
      the JAX op the instruction came from (its HLO metadata; "" when it has none).
      The tracer's own overhead inflates every time, so compare shares, not sums.
    """
    import glob
    import gzip
    import re
    import tempfile

    import jax

    op_names = {}  # every instruction of the program -> its JAX op ("" without metadata)
    for line in compiled.as_text().splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
        if found:
            op = re.search(r'op_name="([^"]*)"', line)
            op_names[found.group(1)] = op.group(1) if op else ""
    jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        try:
            out = None
            for _ in range(calls):
                out = compiled(*args)
            jax.block_until_ready(out)
        finally:
            jax.profiler.stop_trace()
        files = sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))
        with gzip.open(files[-1]) as f:
            events = json.load(f)["traceEvents"]
    # Self time: a while loop's event spans its body's instructions, whose own events nest
    # inside it on the same thread; each event's children are subtracted from it.
    mine = sorted((e for e in events if e.get("ph") == "X" and e.get("name") in op_names),
                  key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    stack: list[list] = []  # [end, name, self time so far, thread]

    def close(entry):
        total[entry[1]] = total.get(entry[1], 0.0) + entry[2]

    for event in mine:
        thread, start, end = (event["pid"], event["tid"]), event["ts"], event["ts"] + event["dur"]
        while stack and (stack[-1][3] != thread or stack[-1][0] <= start):
            close(stack.pop())
        if stack:
            stack[-1][2] -= event["dur"]
        stack.append([end, event["name"], float(event["dur"]), thread])
        count[event["name"]] = count.get(event["name"], 0) + 1
    while stack:
        close(stack.pop())
    return {name: {"us_per_call": total[name] / calls, "count_per_call": count[name] / calls,
                   "op_name": op_names[name]}
            for name in sorted(total, key=total.get, reverse=True)}


class Arm(NamedTuple):
    """One side of an interleaved comparison: how many calls of `step` per block."""

    step: Callable[[], Any]  # one call; its output is blocked on
    min_calls: int = 5  # per block
    budget_s: float = 0.0  # per block: beyond min_calls, keep calling until this has passed
    max_calls: int = 500  # per block


def interleaved_blocks(arms: dict[str, Arm], blocks: int) -> dict[str, list[float]]:
    """Times the arms in turn, `blocks` times over (A, B, ..., A, B, ...).

    On a shared machine a burst of other load then falls on every arm rather
    than on one, so ratios between arms are steadier than their times.

    Returns:
      Seconds of every call, per arm name.
    """
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(blocks):
        for name, arm in arms.items():
            start, count = time.perf_counter(), 0
            while count < arm.min_calls or (
                count < arm.max_calls and time.perf_counter() - start < arm.budget_s
            ):
                times[name].append(timed_call(arm.step)[0])
                count += 1
    return times


def old_new_blocks(arms: dict[str, Arm], blocks: int) -> dict[str, list[list[float]]]:
    """Old-vs-new A/B timing: `blocks` blocks, "old" first in even blocks and "new" first
    in odd ones, so neither always runs first. Returns each arm's call times per block."""
    times: dict[str, list[list[float]]] = {name: [] for name in arms}
    for b in range(blocks):
        order = ("old", "new") if b % 2 == 0 else ("new", "old")
        for name, seconds in interleaved_blocks({a: arms[a] for a in order}, 1).items():
            times[name].append(seconds)
    return times


def new_over_old(old: Sequence[float], new: Sequence[float]) -> dict:
    """Per-block seconds of two arms -> their medians, new/old of the medians, and the
    median and quartiles of the per-block new/old ratios."""
    import statistics

    ratios = sorted(n / o for o, n in zip(old, new, strict=True))
    old_s, new_s = statistics.median(old), statistics.median(new)
    return {"old_s": old_s, "new_s": new_s, "new_over_old": new_s / old_s,
            "block_ratio_median": statistics.median(ratios),
            "block_ratio_q1": ratios[len(ratios) // 4],
            "block_ratio_q3": ratios[3 * len(ratios) // 4]}


# --------------------------------------------------------------------------- machine ceilings


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def stream_bandwidth(num_floats: int | None = None, reps: int = 10) -> dict:
    """Triad b ← a*s + b: bytes moved (2 reads + 1 write) over the median time.

    b is donated, so the output reuses its buffer: without that every call
    writes a freshly mapped output and times the page faults (on the 2-core
    CPU here, ~2.5 GB/s instead of ~24).

    Args:
      num_floats: array length (default 2²⁵ f32 on CPU, 2²⁸ on an
        accelerator: far beyond the caches).
      reps: timed calls.
    """
    import jax
    import jax.numpy as jnp

    if num_floats is None:
        num_floats = (1 << 25) if _on_cpu() else (1 << 28)
    rng = np.random.default_rng(123)  # numpy inputs: no extra XLA compile for the probe
    a = jnp.asarray(rng.standard_normal(num_floats, np.float32))
    box = [jnp.asarray(rng.standard_normal(num_floats, np.float32))]
    s = jnp.float32(1.0001)  # a traced scalar, so XLA cannot fold the multiply away
    triad = jax.jit(lambda a, b, s: a * s + b, donate_argnums=1)

    def step():
        box[0] = triad(a, box[0], s)
        return box[0]

    timed_call(step)
    t = float(np.median([timed_call(step)[0] for _ in range(reps)]))
    moved = 3 * num_floats * 4
    return {
        "stream_GBps": moved / t / 1e9,
        "stream_bytes_moved": moved,
        "stream_s": t,
        "stream_kernel": "b = a*s + b (b donated), f32, 2 reads + 1 write per element",
    }


def matmul_peak(size: int | None = None, reps: int = 5, *, dtype: str = "float32",
                precision: str | None = None) -> dict:
    """GFLOP/s of one large square matmul (2·N³ flops), median over reps.

    Args:
      size: N (default 2048 on CPU, 8192 on an accelerator).
      reps: timed calls.
      dtype: the operands' dtype ("float32", "bfloat16", ...); the product has it too
        (XLA accumulates bf16 products in f32).
      precision: `jax.lax.Precision` name for the dot ("highest": true f32 on GPUs and
        TPUs, whose default f32 dot may use TF32 or bf16 passes); None: JAX's default,
        what a fedjax_sim round gets.
    """
    import jax
    import jax.numpy as jnp

    if size is None:
        size = 2048 if _on_cpu() else 8192
    rng = np.random.default_rng(321)
    a = jnp.asarray(rng.standard_normal((size, size), np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((size, size), np.float32), dtype)
    timing = compile_then_time(jax.jit(lambda a, b: jnp.dot(a, b, precision=precision)), a, b,
                               reps=reps)
    t = timing.median_s
    return {"matmul_peak_GFLOPs": 2 * size**3 / t / 1e9, "matmul_size": size, "matmul_s": t,
            "matmul_dtype": str(jnp.dtype(dtype)), "matmul_precision": precision or "default"}


def dense_flops(widths, *, forward: int = 0, steps: int = 0) -> int:
    """Matmul flops (2 per multiply-add) of a dense network with layer widths `widths`.

    `forward` examples through forward passes alone, and `steps` examples through SGD
    steps: the forward pass, every layer's weight gradient, and every layer's input
    gradient but the first's. The first layer's input is data, which a gradient over
    the parameters does not differentiate, so JAX never computes it; the common
    "6 × params per example" rule counts it anyway (1.4× too many for a 784-200-10 MLP,
    whose first layer is 99 % of its multiply-adds). Biases and activations are not
    counted. XLA's count of one compiled step (`fedjax_sim.models.recsys.compiled_flops`)
    is the cross-check.
    """
    layers = [a * b for a, b in itertools.pairwise(widths)]
    macs = sum(layers)
    return 2 * forward * macs + 2 * steps * (3 * macs - layers[0])


def machine_ceilings(quick: bool = False) -> dict:
    """Both probes: full size, or tiny ones (seconds) for smoke runs."""
    if quick:
        return {**stream_bandwidth(1 << 20, 5), **matmul_peak(256, 3)}
    return {**stream_bandwidth(), **matmul_peak()}


def linear_round_bytes(m: int, n: int, d: int) -> int:
    """Bytes one fused IFCA option-I linear round reads: 2 passes over X plus y.

    The fused kernel (`linear_regression`'s cluster_grad_sums) reads X
    [m, n, d] f32 once for the residuals and once for the per-client
    gradients, and y [m, n] f32 once; the parameters and per-client outputs
    are small and not counted.
    """
    return 2 * m * n * d * 4 + m * n * 4


LINEAR_ROUND_BYTES_MODEL = "2 passes over X (m·n·d·4 bytes each) + y (m·n·4 bytes)"


# --------------------------------------------------------------------------- subprocesses


class Finished(NamedTuple):
    """A finished (or killed) child process."""

    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    killed: str | None  # why the parent killed it, if it did

    def json_objects(self) -> list[dict]:
        """Every stdout line that is a JSON object, in order."""
        found = []
        for line in self.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    value = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(value, dict):
                    found.append(value)
        return found

    def error(self) -> str | None:
        """None for a clean exit; else why it failed, with stderr's last line."""
        if self.killed:
            return self.killed
        if self.returncode == 0:
            return None
        tail = [line for line in self.stderr.strip().splitlines() if line.strip()]
        return f"exit {self.returncode}: " + (tail[-1] if tail else "(no stderr)")


def run_subprocess(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    watch: Callable[[int], str | None] | None = None,
    poll_s: float = 0.05,
    echo: str | None = None,
) -> Finished:
    """Runs cmd to completion, killing its process group past `timeout` or on `watch`.

    If this process is interrupted while it waits (KeyboardInterrupt, or a SIGTERM
    handler that raises), the child's process group is killed before the exception
    propagates, and the output read so far is attached to the exception as
    `partial` (a `Finished`).

    Args:
      cmd: the command.
      env: entries added to (overriding) this process's environment.
      cwd: working directory.
      timeout: seconds before the child is killed (None: no limit).
      watch: `watch(pid) -> reason or None`, polled every poll_s seconds; a
        reason kills the child (max_clients.py's RSS watchdog).
      poll_s: polling interval.
      echo: when given, each stderr line of the child is also written to this
        process's stderr as it arrives, after this prefix (live logs of a long run).
    """
    start = time.perf_counter()
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, cwd=cwd, start_new_session=True,
    )
    killed: list[str] = []
    out_lines: list[str] = []
    err_lines: list[str] = []

    def kill(reason: str) -> None:
        killed.append(reason)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's own session
        except ProcessLookupError:
            pass

    def guard():
        while proc.poll() is None:
            reason = None
            if timeout is not None and time.perf_counter() - start > timeout:
                reason = f"ran past {timeout:.0f} s"
            elif watch is not None:
                reason = watch(proc.pid)
            if reason:
                kill(reason)
                return
            time.sleep(poll_s)

    def read(stream, lines: list[str], prefix: str | None):
        for line in stream:
            lines.append(line)
            if prefix is not None:
                sys.stderr.write(prefix + line)
                sys.stderr.flush()

    readers = [threading.Thread(target=read, args=(proc.stdout, out_lines, None), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, err_lines, echo), daemon=True)]
    for reader in readers:
        reader.start()
    guardian = None
    if timeout is not None or watch is not None:
        guardian = threading.Thread(target=guard, daemon=True)
        guardian.start()

    def finished() -> Finished:
        for reader in readers:
            reader.join(timeout=5.0)
        return Finished(
            returncode=proc.returncode, stdout="".join(out_lines), stderr="".join(err_lines),
            wall_s=time.perf_counter() - start, killed=killed[0] if killed else None,
        )

    try:
        proc.wait()
    except BaseException as err:  # interrupted: never leave the child running
        kill(f"interrupted by {type(err).__name__}")
        proc.wait()
        err.partial = finished()
        raise
    if guardian is not None:
        guardian.join()
    return finished()


def point_command(module_or_script: str, args: Sequence[str] = ()) -> list[str]:
    """`python SCRIPT ARGS` for a path, `python -c ARGS` for "-c", else `python -m MODULE ARGS`."""
    if module_or_script.startswith("-"):
        return [sys.executable, module_or_script, *args]
    if module_or_script.endswith(".py") or os.sep in module_or_script:
        return [sys.executable, str(module_or_script), *args]
    return [sys.executable, "-m", module_or_script, *args]


def run_point_subprocess(
    module_or_script: str,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    *,
    cwd: str | os.PathLike | None = None,
    watch: Callable[[int], str | None] | None = None,
    keep_all: bool = False,
    echo: str | None = None,
) -> dict:
    """Runs one measurement in a fresh Python process; returns the JSON object it printed.

    The child prints its result as one JSON object on one stdout line (other
    lines are ignored; with several objects the last one is returned).

    Args:
      module_or_script: a script path (`python PATH ARGS`), a module name
        (`python -m MODULE ARGS`), or "-c" with the code as args[0].
      args: its arguments.
      env: environment entries added to this process's (XLA_FLAGS, ...).
      timeout: seconds before the child is killed.
      cwd, watch, echo: as in `run_subprocess`.
      keep_all: also return, success or not, every JSON object the child printed
        (`objects`, in order: what a child that reports as it goes had finished before
        it failed or was killed), `timed_out` (killed past `timeout`), `wall_s` and
        `stderr_tail` (its last 2000 characters).

    Returns:
      The child's JSON object, or {"error": why, "returncode": code} when it
      failed, was killed or printed no JSON object; with keep_all, plus the
      keys above.
    """
    done = run_subprocess(
        point_command(module_or_script, args), env=env, cwd=cwd, timeout=timeout, watch=watch,
        echo=echo,
    )
    objects = done.json_objects()
    error = done.error()
    if error is None and objects:
        result = dict(objects[-1])
    else:
        result = {"error": error or "the child printed no JSON object",
                  "returncode": done.returncode}
    if keep_all:
        result.update(objects=objects, wall_s=done.wall_s, stderr_tail=done.stderr[-2000:],
                      timed_out=bool(done.killed and done.killed.startswith("ran past")))
    return result


# --------------------------------------------------------------------------- JSON


def strict_json(value):
    """value with numpy types made Python, non-finite floats None, tuples lists, paths str."""
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    if isinstance(value, np.ndarray):
        return strict_json(value.tolist())
    if isinstance(value, np.generic):
        return strict_json(value.item())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def write_json(path: str | os.PathLike, payload, indent: int = 2) -> None:
    """Writes payload as strict JSON (NaN/±inf → null; `allow_nan=False`), parents created."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(strict_json(payload), indent=indent, allow_nan=False)
    path.write_text(text + "\n")
