"""AFL, HypCluster, CFL, Ditto and robust IFCA: each vectorized round vs a per-client loop.

Usage:
  python benchmarks/baselines_personal.py                 # writes results/baselines_personal.json
  python benchmarks/baselines_personal.py --quick --out /tmp/bp.json   # smoke run, tiny sizes

For every algorithm, on synthetic linear clients (two clusters of θ*, N
clients of n rows, d features, a cohort of s, τ local steps on minibatches
of b): `jax.jit(alg.round)` against the same round written as a Python loop
over the cohort's slots, one jitted single-client call per slot
(`ops.client_update`, the cluster losses of one client), and the server's
step as one jitted call on the lists of per-client results, the way a
per-client simulator runs it. Both arms start from the same state and key
and must agree on the new models (checked before timing); they are timed in
interleaved blocks (`harness.interleaved_blocks`).

`fraction_of_stream`: the bytes the round must at least read (every cohort
client's data once for its losses, plus τ minibatches per trained model; Ditto
trains two models) over the round's time, as a fraction of the stream probe.
These linear rounds are bound by per-call overhead at these sizes, far from
either probe; the figure says how far.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import harness

FULL = dict(N=200, n=20, d=10, s=50, tau=5, batch=10, k=2, blocks=3)
QUICK = dict(N=20, n=8, d=4, s=5, tau=2, batch=4, k=2, blocks=1)
LR = 0.01


def _problem(cfg):
    import numpy as np

    from fedjax_sim.data import FederatedData

    rng = np.random.default_rng(0)
    x = rng.normal(size=(cfg["N"], cfg["n"], cfg["d"])).astype(np.float32)
    truth = np.arange(cfg["N"]) % 2
    theta = np.stack([np.ones(cfg["d"]), -np.ones(cfg["d"])]).astype(np.float32)
    y = (np.einsum("mnd,md->mn", x, theta[truth]) + 0.1 * rng.normal(size=x.shape[:2]))
    return FederatedData.from_arrays(x, y.astype(np.float32), cluster=truth)


def _builders(cfg):
    """name -> (factory kwargs, loop round builder)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from fedjax_sim.algorithms import afl, cfl, ditto, hypcluster, robust_ifca, sgd
    from fedjax_sim.models import linear_regression
    from fedjax_sim.models.core import client_loss
    from fedjax_sim.ops import client_update, sample_cohort
    from fedjax_sim.ops.clustering import cosine_similarity, optimal_bipartition
    from fedjax_sim.ops.simplex import project_segments

    model = linear_regression(cfg["d"])
    opt = optax.sgd(LR)
    part = cfg["s"] / cfg["N"]
    training = sgd(LR, steps=cfg["tau"], batch_size=cfg["batch"])
    common = dict(participation=part)
    tau, b, k = cfg["tau"], cfg["batch"], cfg["k"]

    @jax.jit
    def train(p, x, y, n, key):  # one client's τ steps; also its first-step loss
        q, _, losses = client_update(model, opt, p, x, y, n, key, num_steps=tau, batch_size=b)
        return q, losses[0]

    @jax.jit
    def losses_k(params, x, y, n):  # one client's loss under each of k models
        return jax.vmap(lambda p: client_loss(model, p, x, y, n))(params)

    def cohort_of(state, data, key):
        c = sample_cohort(key, data.num_clients, cfg["s"])
        return np.asarray(c.ids).tolist(), c.keys

    # --- AFL
    @jax.jit
    def afl_server(models, losses, lam, ids):
        w = lam[ids]
        params = jnp.tensordot(w, jnp.stack(models), 1) / jnp.sum(w)
        v = jnp.zeros_like(lam).at[ids].set(cfg["N"] / cfg["s"] * jnp.stack(losses))
        return params, project_segments(lam + 0.01 * v, jnp.zeros_like(ids, shape=lam.shape), 1)

    def afl_loop(state, data, clients, key):
        ids, keys = cohort_of(state, data, key)
        out = [train(state.params, *clients[i], keys[j]) for j, i in enumerate(ids)]
        params, lam = afl_server([o[0] for o in out], [o[1] for o in out], state.lam,
                                 jnp.asarray(ids))
        return state._replace(params=params, lam=lam)

    # --- HypCluster and robust IFCA share the client side
    def clustered_clients(state, clients, ids, keys):
        out = []
        for j, i in enumerate(ids):
            losses = losses_k(state.cluster_params, *clients[i][:3])
            c = int(jnp.argmin(losses))
            q, _ = train(state.cluster_params[c], *clients[i], keys[j])
            out.append((c, q, losses[c]))
        return out

    @jax.jit
    def per_cluster_mean(models, chosen, weights, old):
        totals = jax.ops.segment_sum(weights[:, None] * jnp.stack(models), chosen, k)
        cw = jax.ops.segment_sum(weights, chosen, k)
        return jnp.where(cw[:, None] > 0, totals / jnp.maximum(cw, 1e-30)[:, None], old)

    def hyp_loop(state, data, clients, key):
        ids, keys = cohort_of(state, data, key)
        out = clustered_clients(state, clients, ids, keys)
        chosen = jnp.asarray([o[0] for o in out])
        counts = jnp.asarray([clients[i][2] for i in ids], jnp.float32)
        params = per_cluster_mean([o[1] for o in out], chosen, counts, state.cluster_params)
        return state._replace(cluster_params=params,
                              assignment=state.assignment.at[jnp.asarray(ids)].set(chosen))

    @jax.jit
    def robust_server(models, chosen, losses, ids, state):
        prev, lam_prev = state.assignment[ids], state.lam[ids]
        members = jax.ops.segment_sum(jnp.ones_like(state.lam),
                                      jnp.where(state.assignment >= 0, state.assignment, k),
                                      k + 1)[:k]
        w = jnp.where(chosen == prev, lam_prev, 1.0 / jnp.maximum(members, 1.0)[chosen])
        params = per_cluster_mean(models, chosen, w, state.cluster_params)
        assignment = state.assignment.at[ids].set(chosen)
        seg = jnp.where(assignment >= 0, assignment, k)
        lam = state.lam.at[ids].set(w)
        lam = jnp.where(assignment >= 0, lam / jnp.maximum(
            jax.ops.segment_sum(lam, seg, k + 1)[seg], 1e-30), 0.0)
        size = jax.ops.segment_sum(jnp.ones_like(lam), seg, k + 1)[:k]
        in_c = jax.ops.segment_sum(jnp.ones_like(losses), chosen, k)
        v = jnp.zeros_like(lam).at[ids].set(size[chosen] / in_c[chosen] * losses)
        lam = project_segments(lam + 0.01 * tau * v, jnp.where(assignment >= 0, assignment, -1),
                               k)
        return state._replace(cluster_params=params, assignment=assignment, lam=lam)

    def robust_loop(state, data, clients, key):
        ids, keys = cohort_of(state, data, key)
        out = clustered_clients(state, clients, ids, keys)
        return robust_server([o[1] for o in out], jnp.asarray([o[0] for o in out]),
                             jnp.stack([o[2] for o in out]), jnp.asarray(ids), state)

    # --- CFL (slots K = 4; ε chosen so a split happens in the timed round)
    K = 4

    @jax.jit
    def cfl_server(deltas, weights, ids, state):
        ids_c = state.cluster_id[ids]
        delta = jnp.stack(deltas)
        mean = jax.ops.segment_sum(weights[:, None] * delta, ids_c, K)
        cw = jax.ops.segment_sum(weights, ids_c, K)
        mean_norm = jnp.linalg.norm(mean / jnp.maximum(cw, 1e-30)[:, None], axis=1)
        max_norm = jnp.maximum(jax.ops.segment_max(jnp.linalg.norm(delta, axis=1), ids_c, K), 0.)
        size = jax.ops.segment_sum(jnp.ones_like(weights, jnp.int32), ids_c, K)
        wants = (mean_norm < 100.0) & (max_norm > 0.0) & (size >= 2)
        sim = cosine_similarity(delta)
        used = state.num_clusters
        params = state.cluster_params
        for c in range(K):  # unrolled on the host's side of the loop: K is tiny
            do = wants[c] & (used < K)
            side = optimal_bipartition(sim, ids_c == c)
            ids_c = jnp.where(do & side, used, ids_c)
            params = jnp.where(do, params.at[jnp.minimum(used, K - 1)].set(params[c]), params)
            used = used + do.astype(jnp.int32)
        totals = jax.ops.segment_sum(weights[:, None] * delta, ids_c, K)
        cw = jax.ops.segment_sum(weights, ids_c, K)
        params = params + jnp.where(cw[:, None] > 0, totals / jnp.maximum(cw, 1e-30)[:, None],
                                    0.0)
        return state._replace(cluster_params=params, cluster_id=state.cluster_id.at[ids].set(
            ids_c), num_clusters=used)

    def cfl_loop(state, data, clients, key):
        ids, keys = cohort_of(state, data, key)
        deltas = []
        for j, i in enumerate(ids):
            start = state.cluster_params[state.cluster_id[i]]
            deltas.append(train(start, *clients[i], keys[j])[0] - start)
        weights = jnp.asarray([clients[i][2] for i in ids], jnp.float32)
        return cfl_server(deltas, weights, jnp.asarray(ids), state)

    # --- Ditto
    @jax.jit
    def personalize(v, w, x, y, n, key):
        def loss(p, xb, yb, mb, _k):
            r = xb @ p - yb
            return (jnp.sum(mb * r * r) / jnp.maximum(jnp.sum(mb), 1.0)
                    + 0.5 * 0.5 * jnp.sum((p - w) ** 2))

        q, _, _ = client_update(model, opt, v, x, y, n, jax.random.fold_in(key, 1),
                                num_steps=tau, batch_size=b, batch_loss=loss)
        return q

    @jax.jit
    def ditto_server(models, personal, ids, state):
        return state._replace(params=jnp.mean(jnp.stack(models), 0),
                              personal=state.personal.at[ids].set(jnp.stack(personal)))

    def ditto_loop(state, data, clients, key):
        ids, keys = cohort_of(state, data, key)
        models, personal = [], []
        for j, i in enumerate(ids):
            models.append(train(state.params, *clients[i], keys[j])[0])
            personal.append(personalize(state.personal[i], state.params, *clients[i], keys[j]))
        return ditto_server(models, personal, jnp.asarray(ids), state)

    return {
        "afl": (lambda: afl(model, training, lambda_lr=0.01, **common), afl_loop, "params", 1),
        "hypcluster": (lambda: hypcluster(model, training, num_clusters=k, **common), hyp_loop,
                       "cluster_params", 1),
        "cfl": (lambda: cfl(model, training, max_clusters=K, eps1=100.0, eps2=0.0, **common),
                cfl_loop, "cluster_params", 1),
        "ditto": (lambda: ditto(model, training, ditto_lambda=0.5, **common), ditto_loop,
                  "personal", 2),
        "robust_ifca": (lambda: robust_ifca(model, training, num_clusters=k, lambda_lr=0.01,
                                            **common), robust_loop, "cluster_params", 1),
    }


def rows(cfg, ceilings) -> list[dict]:
    import jax
    import numpy as np

    data = _problem(cfg)
    clients = list(zip(data.x, data.y, data.num_examples, strict=True))  # sliced once
    out = []
    for name, (build, loop, field, trained_models) in _builders(cfg).items():
        alg = build()
        key = jax.random.key(1)
        state = alg.init(jax.random.key(0), data)
        if name == "robust_ifca":  # a first round assigns clusters, so λ is exercised
            state = jax.jit(alg.round)(state, data, jax.random.key(2))[0]
        round_ = jax.jit(alg.round)
        timing = harness.compile_then_time(round_, state, data, key, reps=3)
        want = getattr(round_(state, data, key)[0], field)
        got = getattr(loop(state, data, clients, key), field)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5,
                                   err_msg=name)
        arms = {
            "vectorized": harness.Arm(lambda r=round_, s=state: r(s, data, key), min_calls=5,
                                      budget_s=0.5),
            "loop": harness.Arm(lambda s=state, f=loop: getattr(f(s, data, clients, key), field),
                                min_calls=2),
        }
        times = harness.interleaved_blocks(arms, cfg["blocks"])
        vec, per = float(np.median(times["vectorized"])), float(np.median(times["loop"]))
        row_bytes = 4 * (cfg["d"] + 1) * cfg["s"] * (
            cfg["n"] + trained_models * cfg["tau"] * cfg["batch"])
        out.append({
            "kind": f"{name}_round_linear",
            **{k: cfg[k] for k in ("N", "n", "d", "s", "tau", "batch", "k")},
            "vectorized_s": vec, "loop_s": per, "speedup": per / vec,
            "vectorized_compile_s": timing.compile_s,
            "calls": {a: len(v) for a, v in times.items()},
            "min_bytes": row_bytes,
            "fraction_of_stream": row_bytes / vec / 1e9 / ceilings["stream_GBps"],
        })
        print({k: v for k, v in out[-1].items()}, flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "baselines_personal.json"))
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(None)
    meta = harness.collect_meta(quick=args.quick)
    cfg = QUICK if args.quick else FULL
    ceilings = harness.machine_ceilings(quick=args.quick)
    result = rows(cfg, ceilings)
    meta = harness.finish_meta(meta, started)
    harness.write_json(args.out, [{**row, "ceilings": ceilings, "meta": meta} for row in result])
    return 0


if __name__ == "__main__":
    sys.exit(main())
