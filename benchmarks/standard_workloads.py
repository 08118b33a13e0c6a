"""A standard workload against the fastest peer on its own benchmark: pfl-research's CIFAR-10.

pfl-research (Apple, arXiv:2404.06430) times simulators on FedAvg over CIFAR-10 cut into
1,000 users of 50 images, its `simple_cnn` (1,626,442 parameters), cohort 50, one local
epoch of batch 10 at lr 0.1, central SGD at 1.0, 1,500 central iterations, central
evaluation every 10 (`pfl:benchmarks/image_classification/configs/baseline.yaml` of
apple/pfl-research; our preset `fedavg-cifar10-pfl`). This script measures, side by
side in one run, on the same synthetic CIFAR-shaped data (random uint8 images and
labels: the time does not depend on the pixels) and the same users, each in a fresh
process pinned to the same CPUs (`--threads`, default every usable one):

1. **fedjax_sim**: the preset's FedAvg round, built by the preset's own experiment
   (`experiments.pfl_cifar10`: its users, model, client training and central step),
   `jax.jit(round)` compiled apart (`.lower().compile()`), then rounds timed one by one
   until `--ours-budget` seconds have passed (at least one); and its central evaluation
   of the 10,000 test images (the second call timed; the first compiles). A round's
   time includes drawing the cohort, gathering its users' images, the 5 local steps of
   every user (in the client chunk the executor plans by default, `study.method_spec`:
   one user at a time on a CPU, the cohort vmapped on an accelerator; recorded as
   `client_chunk`), the unweighted mean and the central step; not the host's metrics
   or checkpoints.
2. **pfl-research**: pfl 0.6.0 and torch's CPU build in a venv this script creates
   (`benchmarks/.venv-pfl`, `pip install pfl==0.6.0 torch==2.13.0`), running
   `benchmarks/pfl_cifar10.py`: pfl's `FederatedAveraging` over `SimulatedBackend`
   with the same users, model and hyper-parameters, torch at `--threads` threads.
   An iteration's time is between the ends of consecutive central iterations
   (pfl's callback hook), the first dropped; it includes sampling the cohort, building
   its datasets, local training user after user, pfl's aggregation and the central
   step. Its central evaluation (`PyTorchModel.evaluate` of the test set, batch
   10,000) is timed apart, the second of two calls.

Reported: seconds per round and per evaluation, the ratio pfl / fedjax_sim per
round, GFLOP/s and their fraction of the matmul peak measured in the same run (the
fedjax_sim child's `harness.matmul_peak`, on the same CPUs), and the projected wall
time of the 1,500 iterations (compile + 1,500 rounds + 151 evaluations for fedjax_sim,
which also evaluates at round 0; setup + 1,500 iterations + 150 evaluations for
pfl, whose callback evaluates at iterations 0, 10, …, 1,490). The FLOP count is the
CNN's: per training image the forward multiply-adds of every layer, their weight
gradients and the input gradients of every layer but the first, × 2; per evaluated
image the forward multiply-adds × 2 (`flops`); pooling, activations, the softmax
and the SGD updates are not counted.

Usage:
  nice -n 5 python benchmarks/standard_workloads.py                 # the full side by side
  python benchmarks/standard_workloads.py --dry-run --out /tmp/sw.json   # tiny, seconds
Results: `results/standard_workloads.json` beside this script (or --out), strict JSON with the CPU
model and git HEAD (`harness.collect_meta`).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import harness
import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "standard_workloads.json"
VENV = HERE / ".venv-pfl"
PFL_SCRIPT = HERE / "pfl_cifar10.py"
PFL_REQUIREMENTS = ("pfl==0.6.0", "torch==2.13.0")
PRESET = "fedavg-cifar10-pfl"

# The full workload (the preset's defaults), and the dry run's tiny one.
FULL = {"train": 50_000, "test": 10_000}
# (Tiny: the dry run is in the slow test set.)
DRY = {"train": 60, "test": 20, "datapoints_per_user": 5, "cohort_size": 2,
       "batch_size": 5, "rounds": 20, "eval_every": 10, "eval_batch_size": 20}


# --------------------------------------------------------------------------- the workload


def flops(s: dict, input_shape=(32, 32, 3), classes: int = 10) -> dict:
    """The simple_cnn's FLOPs: per training image (forward, weight gradients, input
    gradients of every layer but the first; ×2 multiply-adds), per evaluated image
    (forward ×2), per round and per central evaluation."""
    h, w, c = input_shape
    conv1 = (h - 2) * (w - 2) * 32 * 9 * c
    conv2 = (h - 4) * (w - 4) * 64 * 9 * 32
    flat = ((h - 4) // 2) * ((w - 4) // 2) * 64
    dense = flat * 128 + 128 * classes
    forward = conv1 + conv2 + dense
    train_image = 2 * (3 * forward - conv1)
    per_user = s["local_epochs"] * s["datapoints_per_user"]
    return {"forward_flops_per_image": 2 * forward, "train_flops_per_image": train_image,
            "round_flops": s["cohort_size"] * per_user * train_image,
            "eval_flops": s["test_images"] * 2 * forward}


def settings(dry: bool, test_images: int) -> dict:
    """The preset's settings (the dry run's tiny ones) as the experiment resolves them."""
    from fedjax_sim.experiments import PRESETS

    s = dict(PRESETS[PRESET].defaults)
    if dry:
        s.update({k: v for k, v in DRY.items() if k in s})
    return {**s, "test_images": test_images}


def synthetic(dry: bool, seed: int = 0):
    """CIFAR-shaped random data: (train x uint8, train y, test x, test y)."""
    size = DRY if dry else FULL
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (size["train"], 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, size["train"]).astype(np.int32),
            rng.integers(0, 256, (size["test"], 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, size["test"]).astype(np.int32))


def projected(round_s, rounds: int, eval_s, evaluations: int, fixed_s: float) -> float | None:
    if round_s is None or eval_s is None:
        return None
    return fixed_s + rounds * round_s + evaluations * eval_s


def measure_ours(dry: bool, budget_s: float, peak_gflops: float | None, log=print,
                 arrays=None) -> dict:
    """The preset's round and central evaluation on synthetic data, in this process (the
    suite's child, or this script's): seconds, GFLOP/s, fraction of `peak_gflops`."""
    import jax

    from fedjax_sim.execution import plan_of
    from fedjax_sim.experiments import study
    from fedjax_sim.experiments.pfl_cifar10 import PFL

    arrays = synthetic(dry) if arrays is None else arrays
    s = settings(dry, len(arrays[3]))
    t0 = time.perf_counter()
    problem = PFL.problem(s, arrays)
    spec = study.method_spec(PFL, "fedavg", s, problem)  # the executor's default plan
    key = jax.random.key(0)
    state = jax.block_until_ready(jax.jit(spec.algorithm.init)(key, spec.data))
    setup_s = time.perf_counter() - t0
    compiled, compile_s = harness.compile_ahead(jax.jit(spec.algorithm.round), state, spec.data,
                                                key)
    log(f"fedjax_sim: round compiled in {compile_s:.1f} s")
    times, cpu_times = [], []
    began = time.perf_counter()
    while not times or (time.perf_counter() - began < budget_s and len(times) < 50):
        cpu0 = time.process_time()
        seconds, (state, _) = harness.timed_call(compiled, state, spec.data,
                                                 jax.random.fold_in(key, len(times)))
        cpu_times.append(time.process_time() - cpu0)
        times.append(seconds)
        log(f"fedjax_sim: round {len(times)}: {seconds:.2f} s ({cpu_times[-1]:.2f} CPU s)")
    t0 = time.perf_counter()
    spec.evaluate(state)
    first_eval_s = time.perf_counter() - t0
    t0, cpu0 = time.perf_counter(), time.process_time()
    evaluation = spec.evaluate(state)
    eval_s, eval_cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
    log(f"fedjax_sim: evaluation {eval_s:.2f} s, {eval_cpu_s:.2f} CPU s (first call "
        f"{first_eval_s:.2f} s)")
    steady = times[1:] if len(times) > 2 else times
    round_s = float(np.median(steady))
    round_cpu_s = float(np.median(cpu_times[1:] if len(cpu_times) > 2 else cpu_times))
    work = flops(s)
    gflops = work["round_flops"] / round_s / 1e9
    evaluations = s["rounds"] // s["eval_every"] + 1
    return {
        "system": "fedjax_sim", "preset": PRESET, "users": int(max(problem["users"])),
        "parameters": int(sum(np.size(p) for p in jax.tree.leaves(state.params))),
        "settings": {k: s[k] for k in ("datapoints_per_user", "cohort_size", "local_epochs",
                                       "batch_size", "lr", "central_lr", "rounds",
                                       "eval_every", "test_images")},
        "client_chunk": plan_of(spec.data).client_chunk,
        "setup_s": setup_s, "compile_s": compile_s, "round_s_each": times,
        "round_s": round_s, "round_s_median_of": len(steady),
        "round_cpu_s_each": cpu_times, "round_cpu_s": round_cpu_s,
        "eval_first_call_s": first_eval_s, "eval_s": eval_s, "eval_cpu_s": eval_cpu_s,
        "test_accuracy_after": float(np.asarray(evaluation["test_accuracy"])[0]),
        **work, "round_GFLOPs": gflops,
        "eval_GFLOPs": work["eval_flops"] / eval_s / 1e9,
        "fraction_of_matmul_peak": gflops / peak_gflops if peak_gflops else None,
        "evaluations": evaluations,
        "projected_wall_s": projected(round_s, s["rounds"], eval_s, evaluations,
                                      compile_s + first_eval_s - eval_s),
        "includes": "round: cohort draw, gather of its users' images, every user's local "
                    "steps (in the executor's client chunk), unweighted mean, central step; "
                    "jax.jit(round) "
                    "compiled apart; evaluation: the 10,000 test images (second call)",
    }


# --------------------------------------------------------------------------- the children


def pin(threads: int | None) -> list[int]:
    """Pins this process to the first `threads` usable CPUs (all when None); returns them."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads:
        cpus = cpus[:threads]
        os.sched_setaffinity(0, cpus)
    return cpus


def ours_child(args) -> int:
    cpus = pin(args.threads)
    harness.use_checkout(args.checkout)
    with np.load(args.data) as z:
        arrays = (z["x"], z["y"], z["test_x"], z["test_y"])
    peak = harness.matmul_peak(256, 3) if args.dry_run else harness.matmul_peak()
    row = measure_ours(args.dry_run, args.ours_budget, peak["matmul_peak_GFLOPs"],
                       lambda msg: print(msg, file=sys.stderr, flush=True), arrays)
    print(json.dumps(harness.strict_json({**row, "matmul_peak": peak, "cpus": cpus})),
          flush=True)
    return 0


def venv_python(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def ensure_venv(venv: pathlib.Path, install: bool, log) -> str | None:
    """None when `venv` has pfl and torch; else creates it and installs them (install) or
    says why not."""
    python = venv_python(venv)
    probe = [str(python), "-c", "import pfl, torch"]
    if python.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    if not install:
        return f"no pfl venv at {venv} (run without --dry-run, or with --install, to create it)"
    log(f"creating {venv} and installing {' '.join(PFL_REQUIREMENTS)} (minutes)")
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", *PFL_REQUIREMENTS]]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return f"`{' '.join(cmd)}` failed: {tail}"
    if subprocess.run(probe, capture_output=True).returncode:
        return f"pfl or torch does not import in {venv}"
    return None


def run_pfl(args, data: pathlib.Path, s: dict, rounds: int, log) -> dict:
    why = ensure_venv(pathlib.Path(args.venv), args.install or not args.dry_run, log)
    if why is not None:
        return {"system": "pfl-research", "skipped": why}
    cmd = [str(venv_python(pathlib.Path(args.venv))), str(PFL_SCRIPT), "--data", str(data),
           "--rounds", str(rounds), "--threads", str(len(args.cpus)),
           "--cohort", str(s["cohort_size"]), "--epochs", str(s["local_epochs"]),
           "--batch", str(s["batch_size"]), "--lr", str(s["lr"]),
           "--central-lr", str(s["central_lr"]), "--eval-batch", "10000",
           "--cpus", ",".join(map(str, args.cpus))]
    done = harness.run_subprocess(cmd, timeout=args.pfl_timeout)
    objects = [o for o in done.json_objects() if len(o.get("iteration_s", [])) >= 2]
    if not objects:
        return {"system": "pfl-research", "error": done.error() or "no JSON printed",
                "stderr_tail": done.stderr[-2000:]}
    out = objects[-1]  # a run stopped past --pfl-timeout keeps the iterations it finished
    steady = out["iteration_s"][1:]
    round_s = float(np.median(steady))
    eval_s = float(out["eval_s"][-1])
    cpu = out.get("iteration_cpu_s") or []
    work = flops(s)
    evaluations = s["rounds"] // s["eval_every"]
    return {
        "system": "pfl-research", "stopped": done.error(),
        **{k: out[k] for k in ("pfl_version", "torch_version",
                                                           "torch_threads", "parameters",
                                                           "users", "setup_s")},
        "iteration_s_each": out["iteration_s"], "round_s": round_s,
        "round_s_median_of": len(steady), "eval_s_each": out["eval_s"], "eval_s": eval_s,
        "round_cpu_s_each": cpu,
        "round_cpu_s": float(np.median(cpu[1:])) if len(cpu) >= 2 else None,
        "eval_cpu_s": (out.get("eval_cpu_s") or [None])[-1],
        "round_GFLOPs": work["round_flops"] / round_s / 1e9,
        "eval_GFLOPs": work["eval_flops"] / eval_s / 1e9, "evaluations": evaluations,
        "projected_wall_s": projected(round_s, s["rounds"], eval_s, evaluations,
                                      out["setup_s"]),
        "includes": "iteration: between the ends of consecutive central iterations (pfl's "
                    "callback hook; the first dropped): cohort sampling, its datasets, local "
                    "training user after user, aggregation, central step; evaluation: "
                    "PyTorchModel.evaluate of the 10,000 test images, batch 10,000 (second "
                    "of two calls)",
    }


# --------------------------------------------------------------------------- the parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (seconds)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--threads", type=int, default=0,
                        help="CPUs (and torch threads) for both systems; 0: every usable CPU")
    parser.add_argument("--ours-budget", type=float, default=240.0,
                        help="seconds of fedjax_sim rounds to time (at least one round)")
    parser.add_argument("--pfl-rounds", type=int, default=6,
                        help="pfl central iterations to run (the first is dropped)")
    parser.add_argument("--pfl-timeout", type=float, default=420.0)
    parser.add_argument("--ours-timeout", type=float, default=900.0)
    parser.add_argument("--venv", default=str(VENV), help="the pfl venv (created if missing)")
    parser.add_argument("--install", action="store_true",
                        help="create the pfl venv in a dry run too")
    parser.add_argument("--no-pfl", action="store_true", help="measure fedjax_sim only")
    parser.add_argument("--no-ours", action="store_true", help="measure pfl-research only")
    parser.add_argument("--child-ours", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    if args.child_ours:
        return ours_child(args)

    started = time.perf_counter()
    args.cpus = pin(args.threads)
    args.threads = len(args.cpus)
    harness.use_checkout(args.checkout)
    meta = harness.collect_meta(args.checkout, dry_run=args.dry_run, threads=args.threads,
                                cpus=args.cpus)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    arrays = synthetic(args.dry_run)
    s = settings(args.dry_run, len(arrays[3]))
    from fedjax_sim.experiments.pfl_cifar10 import iid_users

    users = iid_users(len(arrays[1]), s["datapoints_per_user"],
                      np.random.RandomState(s["seed"]))
    rows = np.zeros((len(users), max(map(len, users))), np.int64)
    for i, u in enumerate(users):
        rows[i, :len(u)] = u
    results = {"meta": meta, "workload": {
        "what": "pfl-research's CIFAR-10 benchmark config (baseline.yaml, cifar10_iid, "
                "simple_cnn) on synthetic CIFAR-shaped data: uniform random uint8 images "
                "and labels, the preset's users (seed 0) given to both systems",
        "train_images": len(arrays[1]), "test_images": len(arrays[3]), "users": len(users),
        "rounds": s["rounds"],
        **flops(s)}}
    with tempfile.TemporaryDirectory() as tmp:
        data = pathlib.Path(tmp) / "cifar_shaped.npz"
        np.savez(data, x=arrays[0], y=arrays[1], test_x=arrays[2], test_y=arrays[3],
                 users=rows, counts=np.array([len(u) for u in users]))
        del arrays
        if not args.no_ours:
            log(f"fedjax_sim: measuring on CPUs {args.cpus}")
        budget = min(args.ours_budget, 2.0) if args.dry_run else args.ours_budget
        child = ["--child-ours", "--data", str(data), "--threads", str(args.threads),
                 "--ours-budget", str(budget)]
        if args.checkout:
            child += ["--checkout", args.checkout]
        if args.dry_run:
            child.append("--dry-run")
        ours = {"system": "fedjax_sim", "skipped": "--no-ours"} if args.no_ours else \
            harness.run_point_subprocess(str(pathlib.Path(__file__)), child,
                                         timeout=args.ours_timeout, echo="  ")
        results["fedjax_sim"] = ours
        if args.no_pfl:
            results["pfl"] = {"system": "pfl-research", "skipped": "--no-pfl"}
        else:
            log(f"pfl-research: measuring on CPUs {args.cpus}")
            pfl_rounds = 3 if args.dry_run else args.pfl_rounds
            results["pfl"] = run_pfl(args, data, s, pfl_rounds, log)
    pfl = results["pfl"]
    if args.no_ours:  # the probe the fedjax_sim child would have taken, here on the same CPUs
        results["matmul_peak"] = harness.matmul_peak(256, 3) if args.dry_run else \
            harness.matmul_peak()
    peak = (ours.get("matmul_peak") or results.get("matmul_peak") or {}).get(
        "matmul_peak_GFLOPs")
    if "round_s" in pfl and peak:
        pfl["fraction_of_matmul_peak"] = pfl["round_GFLOPs"] / peak
    if "round_s" in pfl and "round_s" in ours:
        results["ratio_pfl_over_fedjax_sim"] = {
            "round": pfl["round_s"] / ours["round_s"],
            "evaluation": pfl["eval_s"] / ours["eval_s"],
            "round_cpu_seconds": _ratio(pfl.get("round_cpu_s"), ours.get("round_cpu_s")),
            "evaluation_cpu_seconds": _ratio(pfl.get("eval_cpu_s"), ours.get("eval_cpu_s")),
            "projected_1500_iterations": pfl["projected_wall_s"] / ours["projected_wall_s"],
            "reading": "> 1: fedjax_sim is faster by that factor",
        }
    harness.finish_meta(meta, started)
    harness.write_json(args.out, results)
    log(summary(results))
    return 0 if "round_s" in ours or (args.no_ours and "round_s" in pfl) else 1


def _ratio(a, b):
    return a / b if a and b else None


def summary(results: dict) -> str:
    lines = []
    for name in ("fedjax_sim", "pfl"):
        row = results.get(name, {})
        if "round_s" not in row:
            lines.append(f"{name}: {row.get('skipped') or row.get('error')}")
            continue
        frac = row.get("fraction_of_matmul_peak")
        cpu = row.get("round_cpu_s")
        lines.append(f"{name}: {row['round_s']:.3f} s/round"
                     + (f" ({cpu:.3f} CPU s)" if cpu else "")
                     + f", evaluation {row['eval_s']:.2f} s, "
                     f"{row['round_GFLOPs']:.1f} GFLOP/s"
                     + (f" ({frac:.1%} of the matmul peak)" if frac else "")
                     + f", {results['workload']['rounds']} iterations ≈ "
                       f"{row['projected_wall_s'] / 60:.1f} min")
    ratio = results.get("ratio_pfl_over_fedjax_sim")
    if ratio:
        lines.append(f"pfl / fedjax_sim per round: {ratio['round']:.2f}× (wall), "
                     + (f"{ratio['round_cpu_seconds']:.2f}× (CPU seconds)"
                        if ratio.get("round_cpu_seconds") else "CPU seconds not measured"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
