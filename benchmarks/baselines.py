"""FedProx, SCAFFOLD, q-FedAvg and FedOpt rounds: vectorized vs a per-client loop, and vs FedAvg.

Usage:
  python benchmarks/baselines.py   # writes results/baselines.json beside this script (or --out)
  python benchmarks/baselines.py --quick --out /tmp/baselines.json   # smoke run, tiny sizes

Two problems, each with N clients of which a cohort of s = N/10 takes part, τ local
SGD steps on minibatches:

* `linear`: linear regression, N = 1000, n = 20 rows, d = 10, τ = 10, batch 10. The
  rounds read little and compute less, so the figure of merit is the fraction of the
  stream probe (`harness.stream_bandwidth`) reached by the bytes a round must at least
  read: the cohort's minibatches τ times (plus, for q-FFL, one pass over the cohort's
  rows for F_k(w_t); for SCAFFOLD, the cohort's c_i read and written).
* `mlp`: a 64-32-10 MLP classifier (2 410 params), N = 1000, n = 32, τ = 10, batch 16;
  SCAFFOLD's c_i are then [1000, 2410] floats (9.6 MB). Figure of merit: the matmul
  flops of the local steps (`harness.dense_flops`: forward, weight gradients, and the
  input gradients of all layers but the first; q-FFL adds a forward pass over n rows
  for F_k) over the matmul probe (`harness.matmul_peak`). The common 6·batch·params
  rule would count 1.43× the work JAX does for this MLP.

Arms, timed in interleaved blocks (`harness.interleaved_blocks`, the order rotated from
block to block) from one state and key after compiling apart: the jitted rounds of
`fedavg`, `fedavg(server_optimizer="adam")` (FedOpt), `fedprox`, `scaffold` and `qffl`;
and, for the last three, the same round as a Python loop over the cohort (one jitted
one-client update per slot, with the keys the vectorized round draws, then one jitted
aggregation), checked first to give the vectorized round's model. Each row gives its
median round, its ratio to FedAvg's round (the median over blocks of the ratio within a
block, and its quartiles: on a shared, loaded machine the load drifts between blocks),
and the loop over the vectorized round. FedAvg and SCAFFOLD are also timed as
`simulate` runs them, 10 rounds in one `simulate.scan_rounds` (the state a scan carry:
SCAFFOLD's c_i are then written in place rather than copied into a new output).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness

FULL = dict(N=1000, participation=0.1, tau=10, linear_n=20, d=10, linear_batch=10,
            mlp_n=32, mlp_batch=16, blocks=12)
QUICK = dict(N=40, participation=0.25, tau=3, linear_n=8, d=4, linear_batch=4,
             mlp_n=8, mlp_batch=4, blocks=1)
LR, MU, Q = 0.05, 0.1, 1.0
SCANNED, SCAN_ROUNDS = ("fedavg", "scaffold"), 10  # also timed inside `simulate.scan_rounds`


def _problem(kind: str, cfg: dict):
    import numpy as np

    from fedjax_sim.data import FederatedData
    from fedjax_sim.models import linear_regression
    from fedjax_sim.models.zoo import mlp_classifier

    rng = np.random.default_rng(0)
    if kind == "linear":
        x = rng.normal(size=(cfg["N"], cfg["linear_n"], cfg["d"])).astype(np.float32)
        theta = rng.normal(size=(cfg["N"], cfg["d"])).astype(np.float32)  # heterogeneous
        y = (np.einsum("mnd,md->mn", x, theta)
             + 0.1 * rng.normal(size=x.shape[:2])).astype(np.float32)
        return FederatedData.from_arrays(x, y), linear_regression(cfg["d"]), cfg["linear_batch"]
    x = rng.random((cfg["N"], cfg["mlp_n"], 64), np.float32)
    y = rng.integers(0, 10, (cfg["N"], cfg["mlp_n"])).astype(np.int32)
    return FederatedData.from_arrays(x, y), mlp_classifier((64,), (32,), 10), cfg["mlp_batch"]


def _loops(model, data, batch: int, tau: int, participation: float):
    """Per-client loops of each algorithm's round: name -> (state, key) -> new state."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedjax_sim.algorithms.base import cohort_size
    from fedjax_sim.algorithms.fedprox import proximal_term
    from fedjax_sim.algorithms.scaffold import add_correction
    from fedjax_sim.models.core import client_loss
    from fedjax_sim.ops import client_update, sample_cohort

    m = data.num_clients
    size = cohort_size(m, participation)
    clients = list(zip(data.x, data.y, data.num_examples, strict=True))  # sliced once
    steps = dict(num_steps=tau, batch_size=batch)

    def mean(trees):
        return jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), 0), *trees)

    def cohort(key):
        c = sample_cohort(key, m, size)
        return np.asarray(c.ids).tolist(), list(c.keys)

    @jax.jit
    def prox_client(w, x, y, n, key):
        opt = optax.chain(proximal_term(MU), optax.sgd(LR))
        return client_update(model, opt, w, x, y, n, key, **steps)[0]

    mean_of = jax.jit(mean)

    def fedprox_loop(state, key):
        ids, keys = cohort(key)
        trained = [prox_client(state.params, *clients[i], k)
                   for i, k in zip(ids, keys, strict=True)]
        return state._replace(params=mean_of(trained), round=state.round + 1)

    @jax.jit
    def scaffold_client(x_, c, controls, i, x, y, n, key):
        c_i = jax.tree.map(lambda a: a[i], controls)  # inside the jit: no extra dispatch
        opt = optax.chain(add_correction(optax.tree.sub(c, c_i)), optax.sgd(LR))
        y_i = client_update(model, opt, x_, x, y, n, key, **steps)[0]
        delta_y = optax.tree.sub(y_i, x_)
        return delta_y, jax.tree.map(lambda c, d: -c - d / (tau * LR), c, delta_y)

    @jax.jit
    def scaffold_server(state, ids, delta_ys, delta_cs):
        delta_c = mean(delta_cs)
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *delta_cs)
        controls = jax.tree.map(lambda a, d: a.at[ids].add(d), state.client_controls, stacked)
        return state._replace(
            params=optax.tree.add(state.params, mean(delta_ys)),
            control=optax.tree.add(state.control, optax.tree.scale(len(ids) / m, delta_c)),
            client_controls=controls, round=state.round + 1)

    def scaffold_loop(state, key):
        ids, keys = cohort(key)
        out = [scaffold_client(state.params, state.control, state.client_controls, i,
                               *clients[i], k) for i, k in zip(ids, keys, strict=True)]
        return scaffold_server(state, jnp.asarray(ids), [o[0] for o in out],
                               [o[1] for o in out])

    @jax.jit
    def qffl_client(w, x, y, n, key):
        f = client_loss(model, w, x, y, n) + 1e-10
        trained = client_update(model, optax.sgd(LR), w, x, y, n, key, **steps)[0]
        dw = jax.tree.map(lambda a, b: (a - b) / LR, w, trained)
        h = Q * f ** (Q - 1) * optax.tree.norm(dw, squared=True) + f**Q / LR
        return optax.tree.scale(f**Q, dw), h

    @jax.jit
    def qffl_server(state, deltas, hs):
        total = jax.tree.map(lambda *a: jnp.sum(jnp.stack(a), 0), *deltas)
        return state._replace(params=optax.tree.sub(
            state.params, optax.tree.scale(1.0 / jnp.sum(jnp.stack(hs)), total)),
            round=state.round + 1)

    def qffl_loop(state, key):
        ids, keys = cohort(key)
        out = [qffl_client(state.params, *clients[i], k) for i, k in zip(ids, keys, strict=True)]
        return qffl_server(state, [o[0] for o in out], [o[1] for o in out])

    return {"fedprox": fedprox_loop, "scaffold": scaffold_loop, "qffl": qffl_loop}


def problem_rows(kind: str, cfg: dict, ceilings: dict) -> list[dict]:
    import jax
    import numpy as np

    from fedjax_sim.algorithms import fedadam, fedavg, fedprox, qffl, scaffold, sgd
    from fedjax_sim.algorithms.base import cohort_size, num_params
    from fedjax_sim.simulate import scan_rounds

    data, model, batch = _problem(kind, cfg)
    tau, part = cfg["tau"], cfg["participation"]
    training = sgd(LR, steps=tau, batch_size=batch)
    algorithms = {
        "fedavg": fedavg(model, training, participation=part),
        "fedopt_adam": fedadam(model, training, participation=part),
        "fedprox": fedprox(model, training, mu=MU, participation=part),
        "scaffold": scaffold(model, training, participation=part),
        "qffl": qffl(model, training, q=Q, participation=part),
    }
    key = jax.random.key(1)
    states, rounds, compile_s = {}, {}, {}
    for name, alg in algorithms.items():
        state = jax.jit(alg.init)(jax.random.key(0), data)
        rounds[name], compile_s[name] = harness.compile_ahead(jax.jit(alg.round), state, data,
                                                              key)
        states[name] = rounds[name](state, data, jax.random.key(2))[0]  # non-zero c_i, moments
    loops = _loops(model, data, batch, tau, part)
    loop_first = {}
    for name, loop in loops.items():  # the loop gives the vectorized round's model
        t0 = time.perf_counter()
        got = jax.block_until_ready(loop(states[name], key))
        loop_first[name] = time.perf_counter() - t0
        want = rounds[name](states[name], data, key)[0]
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5,
                                       err_msg=f"{kind} {name}: loop vs vectorized")
    arms = {name: harness.Arm(lambda f=f, s=states[name]: f(s, data, key)[0], min_calls=5,
                              budget_s=0.3)
            for name, f in rounds.items()}
    arms |= {f"{name}_loop": harness.Arm(lambda f=f, s=states[name]: f(s, key), min_calls=1)
             for name, f in loops.items()}
    for name in SCANNED:  # as `simulate` runs rounds: the state a scan carry, updated in place
        def scanned(alg=algorithms[name], s=states[name]):
            return scan_rounds(alg, s, data, key, 0, SCAN_ROUNDS)[0]
        jax.block_until_ready(scanned())  # compile
        arms[f"{name}_scan"] = harness.Arm(scanned, min_calls=2)
    # Block by block, the arms' order rotated each time; a ratio to FedAvg is taken within
    # each block (the same load falls on both), then its median and quartiles over blocks.
    names = list(arms)
    blocks = []
    for b in range(cfg["blocks"]):
        order = names[b % len(names):] + names[:b % len(names)]
        blocks.append(harness.interleaved_blocks({a: arms[a] for a in order}, 1))
    times = {name: [t for block in blocks for t in block[name]] for name in names}
    median = {name: float(np.median(t)) for name, t in times.items()}

    def over_fedavg(name, base="fedavg", label="over_fedavg"):
        ratios = sorted(float(np.median(b[name]) / np.median(b[base])) for b in blocks)
        return {label: float(np.median(ratios)),
                f"{label}_q1_q3": [ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]]}

    s, n, d = cohort_size(cfg["N"], part), cfg[f"{kind}_n"], num_params(states["fedavg"].params)
    rows = []
    for name in algorithms:
        row = {"kind": f"{name}_round_{kind}", "algorithm": name, "problem": kind,
               "N": cfg["N"], "cohort": s, "n": n, "params": d, "tau": tau, "batch": batch,
               "round_s": median[name], **over_fedavg(name),
               "compile_s": compile_s[name], "calls": len(times[name])}
        if name in SCANNED:
            row |= {"scan_round_s": median[f"{name}_scan"] / SCAN_ROUNDS,
                    **over_fedavg(f"{name}_scan", "fedavg_scan", "scan_over_fedavg")}
        if name in loops:
            row |= {"loop_s": median[f"{name}_loop"],
                    "loop_over_vectorized": median[f"{name}_loop"] / median[name],
                    "loop_first_call_s": loop_first[name]}
        if kind == "linear":  # bytes a round must read at least, over the stream probe
            moved = s * tau * batch * (d + 1) * 4
            moved += {"qffl": s * n * (d + 1) * 4, "scaffold": 2 * s * d * 4}.get(name, 0)
            row["min_bytes"] = moved
            row["fraction_of_stream"] = moved / median[name] / 1e9 / ceilings["stream_GBps"]
        else:  # forward + backward flops per local step, over the matmul probe
            widths = (64, 32, 10)  # the problem's MLP; F_k of q-FFL: a forward pass over n rows
            flops = harness.dense_flops(widths, steps=batch * tau * s,
                                        forward=n * s if name == "qffl" else 0)
            row["flops"] = flops
            row["fraction_of_matmul"] = (flops / median[name] / 1e9
                                         / ceilings["matmul_peak_GFLOPs"])
        rows.append(row)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "baselines.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(None)
    meta = harness.collect_meta(quick=args.quick)
    cfg = QUICK if args.quick else FULL
    ceilings = harness.machine_ceilings(quick=args.quick)
    result = problem_rows("linear", cfg, ceilings) + problem_rows("mlp", cfg, ceilings)
    meta = harness.finish_meta(meta, started)
    harness.write_json(args.out, [{**row, "ceilings": ceilings, "meta": meta}
                                  for row in result])
    for row in result:
        print({k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()})
    scaffold_ratio = {r["problem"]: (r["over_fedavg"], r["scan_over_fedavg"]) for r in result
                      if r["algorithm"] == "scaffold"}
    print("SCAFFOLD round / FedAvg round (alone, in scan_rounds):", scaffold_ratio,
          "(target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
