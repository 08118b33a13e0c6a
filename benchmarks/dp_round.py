"""A DP round (clip + noise, `with_dp`) beside the plain round: same algorithm, data and keys.

Usage:
  nice -n 5 python benchmarks/dp_round.py        # writes results/dp_round.json (or --out)
  python benchmarks/dp_round.py --dry-run --out /tmp/dp.json   # tiny sizes, a smoke run

`with_dp(algorithm, clip_norm, noise_multiplier)` replaces the server's weighted mean by
DP-FedAvg's: each reporting client's change θ̃_i − θ is clipped to L2 norm C (flat over
the pytree), the clipped changes are summed, N(0, σ²C²) is added and the sum divided by
the expected cohort (`fedjax_sim.algorithms.private`). The extra work per round is one
subtraction and one squared norm per client, a scale per client folded into the sum
the plain round computes anyway, and one Gaussian draw of the model's size (k draws
for IFCA). Each pair below is two jitted rounds built from one algorithm, compiled
apart (`harness.compile_ahead`), then called in turn, one call of each per pair (plain
first in even pairs, `harness.old_new_blocks`), every call ending in
`block_until_ready`; each arm chains its own state from the same initial state through
the same round keys. On a shared machine a burst of other load falls on both calls of
a pair, so the pairs' ratios are steadier than either arm's times. Beside each pair the
server's aggregation alone is timed at the round's shapes (`aggregation_pair`: the
plain weighted mean against DP's subtraction of the start model, clip, sum and noise):
the DP round's own extra work, which does not drown in the round's spread.

1. `ifca_synthetic`: IFCA option "model" on the synthetic linear mixture at the
   ifca-synthetic sizes (k = 2, m = 100, n = 100, d = 1000, τ = 1 full-batch step, every
   client each round), against the stream bandwidth measured in the same run (before
   and after the rounds; the better of the two): the round makes 1 + 2τ passes over the
   clients' rows X (the k cluster losses, then per step the residuals and the
   gradient), `round_bytes` = (1 + 2τ)·m·n·d·4 + m·n·4.
2. `fedavg_mlp_digits`: FedAvg with the MLP 64-32-10 of the hetero-digits preset on its
   20 Dirichlet(0.5) clients of 8×8 digits, τ = 5 full-batch steps at lr 0.1.
3. `fedavg_gin_esol`: FedAvg with the GIN of the drflm-esol preset (3 × 64, mean pooling)
   on its 8 scaffold clients of ESOL, τ = 10 Adam steps of batch 32 (skipped with the
   reason when RDKit or the ESOL archive is missing).
4. `dp_fedavg_generated`: DP-FedAvg against plain FedAvg on 10⁶ generated clients of the
   linear mixture (`data.generated_mixture`, k = 4, n = 10, d = 10: no client's rows are
   stored, the cohort's rows are drawn inside the round), a cohort of s = 1,000 and of
   10,000 per round (`fedavg(..., participation=s/m)`), τ = 5 full-batch steps: rounds
   per second; the cohort's draw alone (`ops.sampling.sample_uniform`, s of 10⁶ without
   replacement), timed apart; and the cohort's rows (s·n·(d+1)·4 bytes, 2τ + 1 passes:
   each step's residuals and gradient, and the cohort loss) over the round's time
   against the stream bandwidth. The rows are generated, not read, so this fraction says
   how far the round is from what reading stored rows would cost, not that memory
   bounds it.

Reported per pair: each arm's median seconds per round over its calls, DP / plain as
the ratio of those medians (the target: within 1.10), the median and quartiles of the
pairs' ratios, the ratio of the minima, XLA's flop and byte counts of both programs,
the aggregation's extra seconds and their share of the plain round, and the compile
seconds of each arm.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import harness

FULL = dict(
    ifca=dict(k=2, m=100, n=100, d=1000, tau=1, lr=0.1),
    mlp=dict(clients=None, tau=5, lr=0.1),
    gin=dict(clients=8, tau=10, batch=32),
    cohorts=dict(population=10**6, sizes=(1000, 10_000), k=4, n=10, d=10, tau=5, lr=0.1),
    clip_norm=0.5, noise_multiplier=1.0,
    pairs=300, gin_pairs=16, cohort_pairs=8, blocks=8, aggregation_calls=50, draw_reps=3,
)
DRY = dict(
    ifca=dict(k=2, m=8, n=5, d=6, tau=1, lr=0.1),
    mlp=dict(clients=4, tau=2, lr=0.1),
    gin=None,  # its GIN compiles for ~10 s on a CPU: the full run measures it
    cohorts=dict(population=2000, sizes=(10, 100), k=2, n=4, d=3, tau=2, lr=0.1),
    clip_norm=0.5, noise_multiplier=1.0,
    pairs=2, gin_pairs=1, cohort_pairs=1, blocks=1, aggregation_calls=2, draw_reps=1,
)


def _xla_counts(compiled) -> dict:
    """XLA's own count of a compiled round's work (`cost_analysis`): flops, bytes accessed,
    transcendentals; a measure of the extra work that no other load on the machine moves."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 -- a backend without the analysis: no counts
        return {}
    if isinstance(analysis, list):
        analysis = analysis[0] if analysis else {}
    return {key: analysis.get(key) for key in ("flops", "bytes accessed", "transcendentals")}


def _ratio(counted: dict, key: str) -> float | None:
    plain, dp = counted["plain"].get(key), counted["dp"].get(key)
    return dp / plain if plain and dp is not None else None


def _pair(plain, data, cfg, pairs: int) -> dict:
    """Times `plain` and `with_dp(plain)` on `data` in `pairs` pairs of calls: the figures."""
    import jax

    from fedjax_sim.algorithms import with_dp

    algorithms = {"old": plain,
                  "new": with_dp(plain, clip_norm=cfg["clip_norm"],
                                 noise_multiplier=cfg["noise_multiplier"])}
    arms, compile_s, counted = {}, {}, {}
    for name, alg in algorithms.items():
        state = alg.init(jax.random.key(0), data)
        compiled, seconds = harness.compile_ahead(jax.jit(alg.round), state, data,
                                                  jax.random.key(1))
        label = "plain" if name == "old" else "dp"
        compile_s[label] = seconds
        counted[label] = _xla_counts(compiled)
        box = {"state": state, "i": 0}

        def step(compiled=compiled, box=box):
            box["i"] += 1  # both arms: round keys 1, 2, 3, ... from the same initial state
            box["state"], metrics = compiled(box["state"], data, jax.random.key(box["i"]))
            return box["state"], metrics

        jax.block_until_ready(step())  # warm
        arms[name] = harness.Arm(step, min_calls=1, budget_s=0.0)
    # One call of each per pair, plain first in even pairs: a burst of other load falls on
    # both calls of a pair, so the pair's ratio is steadier than either time.
    per_pair = harness.old_new_blocks(arms, pairs)
    plain_times = [t for (t,) in per_pair["old"]]
    dp_times = [t for (t,) in per_pair["new"]]
    ratios = harness.new_over_old(plain_times, dp_times)
    return {"plain_s_per_round": ratios["old_s"], "dp_s_per_round": ratios["new_s"],
            "dp_over_plain": ratios["new_over_old"],
            "pair_ratio_median": ratios["block_ratio_median"],
            "pair_ratio_q1": ratios["block_ratio_q1"],
            "pair_ratio_q3": ratios["block_ratio_q3"],
            "plain_min_s": min(plain_times), "dp_min_s": min(dp_times),
            "dp_over_plain_of_minima": min(dp_times) / min(plain_times),
            "pairs": pairs, "compile_s": compile_s, "xla_counts": counted,
            "xla_flops_dp_over_plain": _ratio(counted, "flops"),
            "xla_bytes_dp_over_plain": _ratio(counted, "bytes accessed"),
            "clip_norm": cfg["clip_norm"], "noise_multiplier": cfg["noise_multiplier"]}


def aggregation_pair(like, slots: int, cfg, num_clusters: int | None = None) -> dict:
    """The server's aggregation alone, at a round's shapes: the plain weighted mean against
    DP's subtraction of the start model, clip, sum and noise (`ops.privacy`), on the same
    `slots` trained models (leaves [slots, ...] shaped like `like`; with `num_clusters`,
    IFCA's per-cluster rules, every client's start model its cluster's).

    A round's DP overhead is this difference; measured alone it does not drown in the
    round's own spread on a loaded machine."""
    import jax
    import jax.numpy as jnp

    from fedjax_sim.ops.aggregation import (
        divide_segments,
        mean_or_keep,
        segment_totals,
        weighted_sum,
    )
    from fedjax_sim.ops.privacy import clipped_cluster_sums, clipped_sum, privatize

    clip, sigma = cfg["clip_norm"], cfg["noise_multiplier"]
    k = num_clusters
    leaves = jax.tree.leaves(like)
    keys = iter(jax.random.split(jax.random.key(7), 2 * len(leaves)))
    models = () if k is None else (k,)
    base = jax.tree.map(lambda x: jax.random.normal(next(keys), models + x.shape), like)
    trained = jax.tree.map(lambda x: jax.random.normal(next(keys), (slots,) + x.shape), like)
    segment = jnp.arange(slots) % (k or 1)
    weights = jnp.ones((slots,), jnp.float32)

    def plain(trained, base, weights, key):
        if k is None:
            return mean_or_keep(weighted_sum(trained, weights), jnp.sum(weights), base)
        totals, counts = segment_totals(trained, segment, k, weights)
        return divide_segments(totals, counts, fallback=base)

    def private(trained, base, weights, key):
        start = base if k is None else jax.tree.map(lambda b: b[segment], base)
        changes = jax.tree.map(jnp.subtract, trained, start)
        if k is None:
            sums = clipped_sum(changes, clip, reports=weights > 0)
        else:
            sums = clipped_cluster_sums(changes, segment, k, clip, reports=weights > 0)
        noised = privatize(sums, key, clip_norm=clip, noise_multiplier=sigma,
                           denominator=slots / (k or 1))
        return jax.tree.map(jnp.add, base, noised.mean)

    arms = {}
    for name, fn in (("old", plain), ("new", private)):
        args = (trained, base, weights, jax.random.key(3))
        compiled, _ = harness.compile_ahead(jax.jit(fn), *args)
        jax.block_until_ready(compiled(*args))
        arms[name] = harness.Arm(lambda compiled=compiled, args=args: compiled(*args),
                                 min_calls=cfg["aggregation_calls"])
    per_block = harness.old_new_blocks(arms, cfg["blocks"])
    plain_s = statistics.median([t for block in per_block["old"] for t in block])
    dp_s = statistics.median([t for block in per_block["new"] for t in block])
    return {"plain_s": plain_s, "dp_s": dp_s, "extra_s": dp_s - plain_s,
            "slots": slots, "clusters": k,
            "parameters": sum(int(x.size) for x in leaves)}


def _with_aggregation(row: dict, aggregation: dict) -> dict:
    row["aggregation_alone"] = aggregation
    row["aggregation_extra_over_plain_round"] = (aggregation["extra_s"]
                                                 / row["plain_s_per_round"])
    return row


def ifca_row(cfg, stream_gbps: float) -> dict:
    import jax

    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.data import linear_mixture
    from fedjax_sim.models import linear_regression

    c = cfg["ifca"]
    m, n, d, tau = c["m"], c["n"], c["d"], c["tau"]
    data = linear_mixture(jax.random.key(0), k=c["k"], m=m, n=n, d=d, sigma=0.1, R=0.5).train
    plain = ifca(linear_regression(d), sgd(c["lr"], steps=tau), num_clusters=c["k"],
                 option="model")
    row = {"kind": "ifca_synthetic", **c, **_pair(plain, data, cfg, cfg["pairs"])}
    like = linear_regression(d).init(jax.random.key(0))
    _with_aggregation(row, aggregation_pair(like, m, cfg, num_clusters=c["k"]))
    round_bytes = (1 + 2 * tau) * m * n * d * 4 + m * n * 4
    row.update(round_bytes=round_bytes,
               round_bytes_model="(1 + 2τ) passes over X (m·n·d·4 bytes) + y (m·n·4 bytes)",
               plain_fraction_of_stream=round_bytes / row["plain_s_per_round"] / 1e9
               / stream_gbps,
               dp_fraction_of_stream=round_bytes / row["dp_s_per_round"] / 1e9 / stream_gbps)
    return row


def mlp_row(cfg) -> dict:
    import jax
    import jax.numpy as jnp

    from fedjax_sim.algorithms import fedavg, sgd
    from fedjax_sim.experiments import PRESETS
    from fedjax_sim.experiments.runner import resolve_settings

    c = cfg["mlp"]
    preset = PRESETS["hetero-digits"]
    s = resolve_settings(preset, ["seeds=1", "clients=copies"], "compare")
    problem = preset.experiment.problem(s)
    data = problem["train"].copy_at(0)  # the one seed's clients
    if c["clients"] is not None:
        data = data.take(jnp.arange(c["clients"]))
    plain = fedavg(problem["model"], sgd(c["lr"], steps=c["tau"]))
    row = {"kind": "fedavg_mlp_digits", "clients": data.num_clients, "tau": c["tau"],
           "batch": "full", "lr": c["lr"], "widths": [64, s["hidden"], 10],
           **_pair(plain, data, cfg, cfg["pairs"])}
    like = problem["model"].init(jax.random.key(0))
    return _with_aggregation(row, aggregation_pair(like, data.num_clients, cfg))


def gin_row(cfg) -> dict:
    c = cfg["gin"]
    try:
        import rdkit  # noqa: F401 -- the molecules are featurised with it
    except ImportError:
        return {"kind": "fedavg_gin_esol",
                "skipped": "RDKit is not installed: the ESOL molecules cannot be featurised "
                           "(pip install rdkit)"}
    import jax
    import optax

    from fedjax_sim.algorithms import ClientTraining, fedavg
    from fedjax_sim.data.archives import DataUnavailable
    from fedjax_sim.experiments import PRESETS
    from fedjax_sim.experiments.runner import resolve_settings

    preset = PRESETS["drflm-esol"]
    s = resolve_settings(preset, ["seeds=1", f"num_clients={c['clients']}"], "compare")
    try:
        problem = preset.experiment.problem(s)
    except DataUnavailable as err:
        return {"kind": "fedavg_gin_esol", "skipped": str(err)}
    data = problem.train if problem.shared else problem.train.copy_at(0)  # the one seed's
    optimizer = (optax.adam if s["optimizer"] == "adam" else optax.sgd)(s["lr"])
    plain = fedavg(problem.model, ClientTraining(optimizer, c["tau"], c["batch"]))
    row = {"kind": "fedavg_gin_esol", "clients": data.num_clients, "tau": c["tau"],
           "batch": c["batch"], "optimizer": s["optimizer"], "lr": s["lr"],
           "hidden": s["hidden"], "layers": s["layers"], "pooling": s["pooling"],
           **_pair(plain, data, cfg, cfg["gin_pairs"])}
    like = problem.model.init(jax.random.key(0))
    return _with_aggregation(row, aggregation_pair(like, data.num_clients, cfg))


def cohort_rows(cfg, stream_gbps: float) -> list[dict]:
    import jax

    from fedjax_sim.algorithms import fedavg, sgd
    from fedjax_sim.data import generated_mixture
    from fedjax_sim.models import linear_regression
    from fedjax_sim.ops.sampling import sample_uniform

    c = cfg["cohorts"]
    m, n, d, tau = c["population"], c["n"], c["d"], c["tau"]
    data = generated_mixture(jax.random.key(0), k=c["k"], m=m, n=n, d=d, sigma=0.1,
                             R=1.0).train
    rows = []
    for size in c["sizes"]:
        plain = fedavg(linear_regression(d), sgd(c["lr"], steps=tau), participation=size / m)
        row = {"kind": "dp_fedavg_generated", "population": m, "cohort": size, "k": c["k"],
               "n": n, "d": d, "tau": tau, "lr": c["lr"],
               **_pair(plain, data, cfg, cfg["cohort_pairs"])}
        _with_aggregation(row, aggregation_pair(linear_regression(d).init(jax.random.key(0)),
                                                size, cfg))
        draw = harness.compile_then_time(
            jax.jit(lambda key, size=size: sample_uniform(key, m, size)), jax.random.key(5),
            reps=cfg["draw_reps"], next_args=lambda i, args, out: (jax.random.key(5 + i),))
        row.update(cohort_draw_s=draw.median_s,
                   cohort_draw_share_of_plain_round=draw.median_s / row["plain_s_per_round"])
        cohort_bytes = size * n * (d + 1) * 4
        passes = 2 * tau + 1
        row.update(plain_rounds_per_s=1 / row["plain_s_per_round"],
                   dp_rounds_per_s=1 / row["dp_s_per_round"],
                   round_bytes=passes * cohort_bytes,
                   round_bytes_model="(2τ + 1) passes over the cohort's rows (s·n·(d+1)·4 "
                                     "bytes), generated inside the round, not read",
                   plain_fraction_of_stream=passes * cohort_bytes / row["plain_s_per_round"]
                   / 1e9 / stream_gbps,
                   dp_fraction_of_stream=passes * cohort_bytes / row["dp_s_per_round"] / 1e9
                   / stream_gbps)
        rows.append(row)
        print(_line(row), file=sys.stderr, flush=True)
    return rows


def _line(row: dict) -> str:
    if "skipped" in row:
        return f"{row['kind']}: skipped ({row['skipped']})"
    text = (f"{row['kind']}{' s=' + str(row['cohort']) if 'cohort' in row else ''}: plain "
            f"{row['plain_s_per_round'] * 1e3:.3f} ms, DP {row['dp_s_per_round'] * 1e3:.3f} ms, "
            f"DP/plain {row['dp_over_plain']:.3f} (pairs' ratios {row['pair_ratio_median']:.3f}, "
        f"quartiles {row['pair_ratio_q1']:.3f}–"
            f"{row['pair_ratio_q3']:.3f}; of the minima {row['dp_over_plain_of_minima']:.3f})")
    if row.get("xla_flops_dp_over_plain") is not None:
        text += (f"; XLA's counts DP/plain: flops {row['xla_flops_dp_over_plain']:.4f}, bytes "
                 f"{row['xla_bytes_dp_over_plain']:.4f}")
    if "aggregation_alone" in row:
        agg = row["aggregation_alone"]
        text += (f"; the aggregation alone {agg['extra_s'] * 1e6:+.0f} µs "
                 f"({100 * row['aggregation_extra_over_plain_round']:.1f} % of the plain round)")
    if "cohort_draw_s" in row:
        text += (f"; the cohort draw alone {row['cohort_draw_s'] * 1e3:.0f} ms "
                 f"({100 * row['cohort_draw_share_of_plain_round']:.0f} % of the plain round)")
    if "dp_fraction_of_stream" in row:
        text += f", {100 * row['dp_fraction_of_stream']:.1f} % of stream"
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--skip-gin", action="store_true", help="leave the GIN round out")
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"
                                             / "dp_round.json"))
    harness.add_checkout_arg(parser)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    harness.use_checkout(args.checkout)
    cfg = DRY if args.dry_run else FULL
    meta = harness.collect_meta(args.checkout, dry_run=args.dry_run)
    meta.update(harness.stream_bandwidth(1 << 20, 5) if args.dry_run
                else harness.stream_bandwidth())
    stream = meta["stream_GBps"]
    rows = []
    for build in (lambda: ifca_row(cfg, stream), lambda: mlp_row(cfg)):
        rows.append(build())
        print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.skip_gin or cfg["gin"] is None:
        rows.append({"kind": "fedavg_gin_esol",
                     "skipped": "--skip-gin" if args.skip_gin else "dry run"})
    else:
        rows.append(gin_row(cfg))
    print(_line(rows[-1]), file=sys.stderr, flush=True)
    rows += cohort_rows(cfg, stream)
    # The probe moves with other load: the machine's ceiling is the best it showed.
    end = harness.stream_bandwidth(1 << 20, 5) if args.dry_run else harness.stream_bandwidth()
    meta.update(stream_GBps_start=stream, stream_GBps_end=end["stream_GBps"],
                stream_GBps=max(stream, end["stream_GBps"]))
    stream = meta["stream_GBps"]
    for row in rows:
        if "round_bytes" in row:
            for arm in ("plain", "dp"):
                row[f"{arm}_fraction_of_stream"] = (row["round_bytes"]
                                                    / row[f"{arm}_s_per_round"] / 1e9 / stream)
    payload = {"meta": harness.finish_meta(meta, started), "rows": rows}
    harness.write_json(args.out, payload)
    print(f"stream {stream:.1f} GB/s; load average {meta['loadavg_start'][0]:.1f} → "
          f"{meta['loadavg_end'][0]:.1f}; {meta['total_seconds']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
