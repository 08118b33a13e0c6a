"""A 2-GT mixed-FL round, vectorized vs a per-client Python loop, and the server branch's share.

The round (`fedjax_sim.algorithms.mixed.mixed_gt2`): S = 100 clients, K = 10 local
steps at batch 16 on a small MLP (64-32-10), a datacenter of 4096 rows with
central batch 256 and K central steps. Three arms, timed in interleaved blocks
(`harness.interleaved_blocks`) after compiling apart:

* `vectorized`: the jitted round (one vmap over the cohort);
* `loop`: the same round with the clients one at a time (what a simulator
  without a client axis does): each client's arrays sliced once beforehand, a
  jitted one-client K-step update called S times from Python with the keys the
  vectorized round draws, then one jitted call for the means, the server
  branch and the update. Before timing, the two arms are checked to give the
  same params. (Until this version the loop sliced `data.x[i]` eagerly inside
  the timed round, four dispatches per client that tripled its time.)
* `server`: the server branch alone (ĝ_c, K central steps on
  w_c g_c + w_f ĝ_f), whose median over the vectorized round's is
  `server_share`.

FLOP rates: each gradient's matmul flops (`harness.dense_flops`: the forward
pass, the weight gradients and the input gradients of all layers but the first;
`flops_per_central_step` records XLA's own count of one central step beside it)
over `matmul_peak()`. (The 6·params-per-example rule would count the first layer's
input gradient, which JAX never computes, and the biases: 1.43× the work of this
64-32-10 MLP.)

    python benchmarks/mixed.py   # writes results/mixed.json beside this script (or --out)
    python benchmarks/mixed.py --quick --out /tmp/mixed.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import harness

OUT = Path(__file__).resolve().parent / "results" / "mixed.json"


PROFILE_GROUPS = (  # (label, test on (instruction name, JAX op)), the first match wins
    ("dots outside YNNPACK (XLA's own batched dot)",
     lambda name, op: name == "dot" or name.startswith("dot.")),
    ("YNNPACK fusions (its dots and reductions)", lambda name, op: name.startswith("ynn_fusion")),
    ("PRNG (threefry, a rolled loop on CPU)",
     lambda name, op: "threefry" in op or "_uniform" in op or "random_bits" in op),
    ("batch draws (ranks, top_k) and gathers",
     lambda name, op: "sample_batch" in op or "top_k" in op or "gather" in name),
    ("everything else", lambda name, op: True),
)


def profile_summary(profile: dict[str, dict], top: int = 12) -> dict:
    """Each group's share of the traced self time of the vectorized round, and the top
    instructions (`harness.thunk_profile`; the tracer inflates times, so shares only)."""
    total = sum(p["us_per_call"] for p in profile.values()) or 1.0
    shares = {label: 0.0 for label, _ in PROFILE_GROUPS}
    for name, p in profile.items():
        label = next(lbl for lbl, test in PROFILE_GROUPS if test(name, p["op_name"]))
        shares[label] += p["us_per_call"] / total
    return {"traced_us_per_call": total, "shares": shares,
            "top": [{"instruction": name, **p} for name, p in list(profile.items())[:top]]}


def measure(*, clients: int, steps: int, batch: int, central_batch: int, n: int, n_c: int,
            blocks: int, min_calls: int, profiled: bool = True) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedjax_sim.algorithms.mixed import CENTRAL_STREAM, datacenter_loss, descend, mixed_gt2
    from fedjax_sim.algorithms.training import sgd
    from fedjax_sim.data import FederatedData, ServerData
    from fedjax_sim.models.recsys import compiled_flops
    from fedjax_sim.models.zoo import mlp_classifier
    from fedjax_sim.ops import client_update, sample_cohort

    rng = np.random.default_rng(0)
    x = rng.random((clients, n, 64), np.float32)
    y = rng.integers(0, 10, (clients, n)).astype(np.int32)
    data = FederatedData.from_arrays(x, y)
    server = ServerData({"x": jnp.asarray(rng.random((n_c, 64), np.float32)),
                         "y": jnp.asarray(rng.integers(0, 10, n_c).astype(np.int32))})
    model = mlp_classifier((64,), (32,), 10)
    lr, w_f, w_c = 0.05, 0.5, 0.5
    algorithm = mixed_gt2(model, sgd(lr, steps=steps, batch_size=batch),
                          central=sgd(lr, steps=steps, batch_size=central_batch), w_f=w_f,
                          w_c=w_c)
    inputs = (data, server)
    state = jax.jit(algorithm.init)(jax.random.key(1), inputs)
    params = state.params
    d = sum(int(a.size) for a in jax.tree.leaves(params))
    opt = optax.sgd(lr)
    f_c = datacenter_loss(model, central_batch)

    def central_grad(p, idx):
        return jax.value_and_grad(lambda q: f_c.loss(q, server.arrays, idx))(p)

    @jax.jit
    def one_client(p, x_i, y_i, n_i, key, corr):
        end, _, _, g0 = client_update(
            model, opt, p, x_i, y_i, n_i, key, num_steps=steps, batch_size=batch,
            direction=lambda g: optax.tree.add(optax.tree.scale(w_f, g), corr),
            keep_first_grad=True)
        return optax.tree.sub(end, p), g0

    @jax.jit
    def round_keys(p, key):
        """The round's draws as the vectorized round makes them, and ĝ_c at x^(t)."""
        slots = sample_cohort(key, clients, clients).keys
        keys = jax.random.split(jax.random.fold_in(key, CENTRAL_STREAM), steps)
        batches = jax.vmap(lambda k: f_c.draw(server.arrays, k))(keys)  # the K central batches
        _, g_c = central_grad(p, batches[0])
        return optax.tree.scale(w_c, g_c), batches, tuple(slots[i] for i in range(clients))

    @jax.jit
    def server_branch(p, batches, hat_g_f):
        end, _, _ = descend(central_grad, opt, p, batches, scale=w_c,
                            correction=optax.tree.scale(w_f, hat_g_f))
        return optax.tree.sub(end, p)

    @jax.jit
    def finish(p, deltas, grads, batches):
        """The cohort means (one dispatch for the whole list), the server branch, the update."""
        delta_f, hat_g_f = (jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), 0), *t)
                            for t in (deltas, grads))
        delta_c = server_branch(p, batches, hat_g_f)
        return optax.apply_updates(p, optax.tree.add(optax.tree.scale(0.5, delta_f),
                                                     optax.tree.scale(0.5, delta_c)))

    # What a simulator without a client axis holds: one array per client, sliced once.
    xs, ys, ns = list(data.x), list(data.y), list(data.num_examples)

    def loop_round(key):
        corr, batches, slots = round_keys(params, key)
        deltas, grads = [], []
        for i in range(clients):  # the per-client loop: one dispatch per client
            delta, g0 = one_client(params, xs[i], ys[i], ns[i], slots[i], corr)
            deltas.append(delta)
            grads.append(g0)
        return finish(params, deltas, grads, batches)

    def server_only(key):
        corr, batches, _ = round_keys(params, key)
        return server_branch(params, batches, corr)

    vectorized = jax.jit(algorithm.round)
    compile_s = {}
    t0 = time.perf_counter()
    vectorized = vectorized.lower(state, inputs, jax.random.key(2)).compile()
    compile_s["vectorized"] = time.perf_counter() - t0
    for name, fn in (("loop", loop_round), ("server", server_only)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(jax.random.key(2)))  # traces and compiles its pieces
        compile_s[name] = time.perf_counter() - t0
    key = jax.random.key(3)
    # The two arms compute the same round (same cohort keys, batches and central draws).
    want = vectorized(state, inputs, key)[0].params
    got = loop_round(key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    arms = {
        "vectorized": harness.Arm(lambda: vectorized(state, inputs, key), min_calls=min_calls),
        "loop": harness.Arm(lambda: loop_round(key), min_calls=max(1, min_calls // 3)),
        "server": harness.Arm(lambda: server_only(key), min_calls=min_calls),
    }
    times = harness.interleaved_blocks(arms, blocks)
    profile = harness.thunk_profile(vectorized, state, inputs, key) if profiled else {}
    median = {name: float(np.median(t)) for name, t in times.items()}
    widths = (64, 32, 10)
    flops = harness.dense_flops(widths, steps=clients * steps * batch
                                + (steps + 1) * central_batch + clients * batch)
    xla_step = compiled_flops(lambda p, i: central_grad(p, i)[1], params,
                              f_c.draw(server.arrays, jax.random.key(0)))
    return {
        "clients": clients, "local_steps": steps, "batch": batch, "central_batch": central_batch,
        "params": d, "n": n, "n_c": n_c,
        "s_vectorized": median["vectorized"], "s_loop": median["loop"],
        "s_server": median["server"],
        "speedup": median["loop"] / median["vectorized"],
        "server_share": median["server"] / median["vectorized"],
        "calls": {name: len(t) for name, t in times.items()},
        "compile_s": compile_s,
        "round_gflop": flops / 1e9,
        "flops_per_central_step": {"counted": harness.dense_flops(widths, steps=central_batch),
                                   "xla_cost_analysis": xla_step},
        "vectorized_GFLOPs": flops / median["vectorized"] / 1e9,
        **({"profile": profile_summary(profile)} if profiled else {}),
    }


def rows(quick: bool) -> list[dict]:
    """The benchmark's rows: one at S = 100, K = 10 (or a tiny one when quick)."""
    if quick:
        sizes = dict(clients=8, steps=2, batch=8, central_batch=32, n=16, n_c=256, blocks=1,
                     min_calls=2)
    else:
        sizes = dict(clients=100, steps=10, batch=16, central_batch=256, n=64, n_c=4096,
                     blocks=5, min_calls=5)
    return [measure(**sizes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--out", default=str(OUT), help=f"JSON file (default {OUT})")
    harness.add_checkout_arg(parser)
    args = parser.parse_args()
    root = harness.resolve_checkout(args.checkout)
    harness.use_checkout(root)
    started = time.perf_counter()
    meta = harness.collect_meta(root, quick=args.quick)
    probes = harness.machine_ceilings(quick=args.quick)
    results = rows(args.quick)
    for r in results:
        r["fraction_of_matmul_peak"] = r["vectorized_GFLOPs"] / probes["matmul_peak_GFLOPs"]
        print(json.dumps(harness.strict_json(r)), flush=True)
    harness.write_json(args.out, {"meta": harness.finish_meta({**meta, **probes}, started),
                                  "rows": results})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
