"""DRFA / DRFLM speed: the vectorized round vs a per-client loop, the GNN round, the λ projection.

Usage:
  python benchmarks/drfa.py                 # writes results/drfa.json beside this script (or --out)
  python benchmarks/drfa.py --quick --out /tmp/drfa.json   # smoke run at a tiny size

In one run (the issue's Performance section):

1. The DRFA round (paper form) at N = 1000 synthetic linear clients (n = 20,
   d = 10), m = 100, τ = 10, minibatch 10: `jax.jit(drfa(...).round)` vs the
   same round as a per-client loop, one jitted client update
   (`ops.client_update`) per sampled client and one jitted minibatch loss per
   client of U_s, the averages and the λ step on the host. Both arms start
   from the same state and are timed in interleaved blocks
   (`harness.interleaved_blocks`); target: >= 20× on 2 CPU cores.
2. The GNN DRFLM round on ESOL (8 scaffold clients, m = 4, τ = 10, minibatch
   32, GIN 3 × 64), ms per round (skipped with a note when the ESOL archive
   is not cached).
3. The λ projection (`ops.project_simplex`, optax's sort method, O(N log N))
   at N = 10⁶, ms, and as a fraction of stream bandwidth for the 2 N floats it
   must at least read and write.

Compile times are measured apart (`harness.compile_then_time`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness

FULL = dict(N=1000, n=20, d=10, m=100, tau=10, batch=10, gnn_rounds=10, proj_n=10**6)
QUICK = dict(N=50, n=8, d=4, m=10, tau=3, batch=4, gnn_rounds=2, proj_n=10**4)


def _linear_problem(cfg):
    import numpy as np

    from fedjax_sim.data import FederatedData

    rng = np.random.default_rng(0)
    x = rng.normal(size=(cfg["N"], cfg["n"], cfg["d"])).astype(np.float32)
    theta = rng.normal(size=cfg["d"]).astype(np.float32)
    y = (x @ theta + 0.1 * rng.normal(size=x.shape[:2])).astype(np.float32)
    return FederatedData.from_arrays(x, y)


def _loop_round(state, key, cfg, one_client, probe_loss, clients, mean_of, update):
    """One DRFA round, a Python loop over cohort slots (the per-client simulator's way).

    `clients` holds each client's arrays sliced once (x, y, count), as a simulator
    without a client axis stores them; `mean_of` and `update` are jitted calls that
    take the lists of per-client results (w̃; the mean model, the loss vector and the
    λ step).
    """
    import jax
    import numpy as np

    from fedjax_sim.ops import sample_cohort

    n, m, tau = cfg["N"], cfg["m"], cfg["tau"]
    key_c, key_t, key_u = jax.random.split(key, 3)
    cohort = sample_cohort(key_c, n, m, weights=state.lam)
    t_snap = jax.random.randint(key_t, (), 1, tau + 1)
    finals, snaps = [], []
    for j, i in enumerate(np.asarray(cohort.ids).tolist()):
        p, s = one_client(state.params, *clients[i], cohort.keys[j], t_snap)
        finals.append(p)
        snaps.append(s)
    w_tilde = mean_of(snaps)
    u = sample_cohort(key_u, n, m)
    losses = [probe_loss(w_tilde, *clients[i], u.keys[j])
              for j, i in enumerate(np.asarray(u.ids).tolist())]
    params, lam = update(finals, losses, u.ids, state.lam, state.lambda_lr)
    return state._replace(params=params, lam=lam, round=state.round + 1)


def linear_rows(cfg, blocks: int, ceilings: dict) -> list[dict]:
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedjax_sim.algorithms import drfa, sgd
    from fedjax_sim.models import linear_regression
    from fedjax_sim.ops import client_update, project_simplex, sample_batch

    data = _linear_problem(cfg)
    model = linear_regression(cfg["d"])
    alg = drfa(model, sgd(0.01, steps=cfg["tau"], batch_size=cfg["batch"]),
               participation=cfg["m"] / cfg["N"], lambda_lr=0.001)
    state = alg.init(jax.random.key(0), data)
    round_ = jax.jit(alg.round)
    key = jax.random.key(1)
    timing = harness.compile_then_time(round_, state, data, key, reps=3)
    opt = optax.sgd(0.01)

    @jax.jit
    def one_client(params, x, y, count, k, t):
        p, s, _ = client_update(model, opt, params, x, y, count, k, num_steps=cfg["tau"],
                                batch_size=cfg["batch"], snapshot_step=t)
        return p, s

    @jax.jit
    def probe_loss(w, x, y, count, k):
        k_batch, _ = jax.random.split(k)
        idx, mask = sample_batch(k_batch, count, y.shape[0], cfg["batch"])
        r = x[idx] @ w - y[idx]
        return jnp.sum(mask * r * r) / jnp.maximum(jnp.sum(mask), 1)

    project_fn = functools.partial(project_simplex, floor=0.0, floor_method="exact")

    @jax.jit
    def mean_of(trees):
        return jax.tree.map(lambda *a: jnp.mean(jnp.stack(a), 0), *trees)

    @jax.jit
    def update(finals, losses, ids, lam, lambda_lr):
        v = jnp.zeros(cfg["N"]).at[ids].set(cfg["N"] / cfg["m"] * jnp.stack(losses))
        return mean_of(finals), project_fn(lam + lambda_lr * cfg["tau"] * v)

    clients = list(zip(data.x, data.y, data.num_examples, strict=True))  # sliced once
    loop = functools.partial(_loop_round, one_client=one_client, probe_loss=probe_loss,
                             cfg=cfg, clients=clients, mean_of=mean_of, update=update)
    # The two arms agree on one round from the same state and key.
    want = round_(state, data, key)[0]
    got = loop(state=state, key=key)
    np.testing.assert_allclose(np.asarray(got.params), np.asarray(want.params), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.lam), np.asarray(want.lam), atol=1e-5)
    t0 = time.perf_counter()
    jax.block_until_ready(loop(state=state, key=key))  # warm every jitted piece
    warm_loop = time.perf_counter() - t0
    arms = {
        "vectorized": harness.Arm(lambda: round_(state, data, key), min_calls=5, budget_s=0.5),
        "loop": harness.Arm(lambda: loop(state=state, key=key).params, min_calls=1),
    }
    times = harness.interleaved_blocks(arms, blocks)
    vec, per = float(np.median(times["vectorized"])), float(np.median(times["loop"]))
    return [{
        "kind": "drfa_round_linear", **{k: cfg[k] for k in ("N", "n", "d", "m", "tau", "batch")},
        "vectorized_s": vec, "loop_s": per, "speedup": per / vec,
        "vectorized_compile_s": timing.compile_s, "loop_first_call_s": warm_loop,
        "calls": {k: len(v) for k, v in times.items()},
        # What the vectorized round reads at least: the sampled clients' minibatches, τ times.
        "fraction_of_stream": (cfg["m"] * cfg["tau"] * cfg["batch"] * (cfg["d"] + 1) * 4 / vec
                               / 1e9 / ceilings["stream_GBps"]),
    }]


def gnn_rows(cfg) -> list[dict]:
    import jax

    from fedjax_sim.algorithms import drflm, sgd
    from fedjax_sim.data.archives import DataUnavailable
    from fedjax_sim.data.molecules import ATOM_FEATURES, load_molecules
    from fedjax_sim.models.graph import gin_regressor

    try:
        fed = load_molecules("esol", 8)
    except DataUnavailable as err:
        return [{"kind": "drflm_round_gnn_esol", "skipped": str(err)}]
    model = gin_regressor(ATOM_FEATURES, fed.train.x["nodes"].shape[2], hidden=64, layers=3)
    alg = drflm(model, sgd(0.05, steps=10, batch_size=32), participation=0.5, lambda_lr=0.002)
    state = alg.init(jax.random.key(0), fed.train)
    round_ = jax.jit(alg.round)
    timing = harness.compile_then_time(
        round_, state, fed.train, jax.random.key(1), reps=cfg["gnn_rounds"],
        next_args=lambda i, args, out: (out[0], args[1], jax.random.key(1 + i)))
    return [{"kind": "drflm_round_gnn_esol", "clients": 8, "m": 4, "tau": 10, "batch": 32,
             "hidden": 64, "layers": 3, "max_atoms": int(fed.train.x["nodes"].shape[2]),
             "round_ms": timing.median_s * 1e3, "compile_s": timing.compile_s}]


def projection_rows(cfg, stream: dict) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from fedjax_sim.ops import project_simplex

    n = cfg["proj_n"]
    v = jax.random.normal(jax.random.key(0), (n,)) / n + 1.0 / n
    fn = jax.jit(lambda a: project_simplex(a, 0.0, "exact"))
    timing = harness.compile_then_time(fn, v, reps=10)
    gbps = stream.get("stream_GBps")
    moved = 2 * n * 4 / timing.median_s / 1e9
    return [{"kind": "lambda_projection", "N": n, "ms": timing.median_s * 1e3,
             "compile_s": timing.compile_s, "gb_per_s_of_2N_floats": moved,
             "fraction_of_stream": moved / gbps if gbps else None,
             "sum_minus_1": float(jnp.sum(timing.output) - 1.0)}]


def rows(quick: bool) -> list[dict]:
    cfg = QUICK if quick else FULL
    ceilings = harness.machine_ceilings(quick=quick)
    out = linear_rows(cfg, blocks=1 if quick else 3, ceilings=ceilings)
    out += gnn_rows(cfg)
    out += projection_rows(cfg, ceilings)
    for row in out:
        row["ceilings"] = ceilings
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "drfa.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(None)
    meta = harness.collect_meta(quick=args.quick)
    result = rows(args.quick)
    meta = harness.finish_meta(meta, started)
    harness.write_json(args.out, [{**row, "meta": meta} for row in result])
    for row in result:
        print({k: v for k, v in row.items() if k not in ("ceilings", "meta")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
