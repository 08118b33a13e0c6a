"""The IFCA option-I round in every kernel form, called one by one and scanned, in one process.

`ops.linear.LINEAR_FORMS` computes the round's per-cluster gradient sums by different
programs; `fedjax_sim.tuning` times them once per machine and round shape and keeps the
fastest. This script shows the whole table the choice is made from, on the machine it
runs on: for each (m, n, d, k) of `rounds_per_sec.py`, the round called one by one
(chained calls of `--rounds` rounds, as a Python loop over `alg.round` or the FedJAX
comparison runs it) and scanned (`--rounds` rounds in one compiled `lax.scan`, as
`simulate.run` runs them), every candidate `tuning` times (each form over the whole
cohort and, on a CPU where the clients' rows outgrow a core's cache, each form a
cache-sized chunk of clients at a time: "loop/4762" is the "loop" form 4,762 clients
at a time, `tuning.chunk_candidate`) compiled ahead of time (compile time reported
apart) and timed in alternating blocks, each block ending in `block_until_ready`; the
candidates agree to 1e-5 before timing. Each row states the candidate `tuning` takes
from these times (`tuning_would_take`: the executor's choice, "loop" unless another is
5 % faster), the ratio of each to the default "loop" over the whole cohort (what the
executor ran before chunks were candidates), and the round's fraction of the machine's
stream bandwidth (`harness.linear_round_bytes`: the round is bandwidth-bound).

Usage:
  python benchmarks/kernel_forms.py --out benchmarks/results/kernel_forms_<machine>.json
  python benchmarks/kernel_forms.py --configs 1000,10,10,4 --blocks 6   # one row, quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

CONFIGS = ((100, 100, 1000, 2), (1000, 10, 10, 4), (10000, 10, 10, 4), (100000, 10, 10, 4))


def arms(m, n, d, k, rounds):
    """{(mode, form): (thunk, compile seconds)} and the state the thunks start from."""
    from fedjax_sim import backend, simulate, tuning
    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.data import linear_mixture
    from fedjax_sim.execution import plan_of
    from fedjax_sim.models import linear_regression

    mixture = jax.jit(linear_mixture, static_argnames=("k", "m", "n", "d", "n_test"))
    data = mixture(jax.random.key(0), k=k, m=m, n=n, d=d, sigma=0.1, R=0.25).train
    alg = ifca(linear_regression(d), sgd(0.1), num_clusters=k)
    state = alg.init(jax.random.key(1), data)
    keys = list(jax.random.split(jax.random.key(2), rounds))
    built, finals = {}, {}
    for form in tuning.candidates(d, tuning.chunk_candidate(data)):
        placed = tuning.planned_arm(data, form)
        call, call_s = harness.compile_ahead(
            backend.jit(alg.round, d, linear_form=plan_of(placed).linear_form), state, placed,
            keys[0])
        scan, scan_s = harness.compile_ahead(
            simulate._compiled_scan(placed), alg, state, placed, keys[0], 0, rounds)

        def chained(call=call, placed=placed):
            s = state
            for key in keys:
                s, _ = call(s, placed, key)
            return s

        def scanned(scan=scan, placed=placed):
            return scan(state, placed, keys[0], 0)[0]

        built["call", form] = (chained, call_s)
        built["scan", form] = (scanned, scan_s)
        finals[form] = jax.block_until_ready(chained())
    base = finals[tuning.DEFAULT_LINEAR_FORM]
    for form, final in finals.items():
        if not (np.array_equal(final.assignment, base.assignment) and np.allclose(
                final.cluster_params, base.cluster_params, rtol=1e-5, atol=1e-5)):
            raise AssertionError(f"form {form} disagrees with the default at {(m, n, d, k)}")
    return built, alg, state, data


def bench(m, n, d, k, blocks, rounds, log):
    from fedjax_sim import tuning

    probe = harness.stream_bandwidth()
    built, alg, state, data = arms(m, n, d, k, rounds)
    times = {arm: [] for arm in built}
    names = list(built)
    for thunk, _ in built.values():
        jax.block_until_ready(thunk())
    for b in range(blocks):
        for arm in names if b % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            jax.block_until_ready(built[arm][0]())
            times[arm].append((time.perf_counter() - t0) / rounds)
    median = {arm: statistics.median(t) for arm, t in times.items()}
    row = {"m": m, "n": n, "d": d, "k": k, "blocks": blocks, "rounds_per_block": rounds,
           "stream_GBps": probe["stream_GBps"], "modes": {}}
    for mode in ("call", "scan"):
        forms = {f: median[mode, f] for (md, f) in median if md == mode}
        base = forms[tuning.DEFAULT_LINEAR_FORM]
        row["modes"][mode] = {
            "seconds_per_round": forms,
            "over_loop": {f: s / base for f, s in forms.items()},
            "block_ratio_iqr_over_loop": {
                f: _iqr([a / b for a, b in zip(times[mode, f], times[mode, "loop"],
                                               strict=True)]) for f in forms},
            "compile_s": {f: built[mode, f][1] for f in forms},
            "fraction_of_stream": {f: harness.linear_round_bytes(m, n, d) / s
                                   / (probe["stream_GBps"] * 1e9) for f, s in forms.items()},
            "fastest": min(forms, key=forms.get),
            "tuning_would_take": tuning.fastest(forms),
        }
        took = row["modes"][mode]["tuning_would_take"]
        row["modes"][mode]["taken_over_loop"] = forms[took] / base
        row["modes"][mode]["taken_fraction_of_stream"] = \
            row["modes"][mode]["fraction_of_stream"][took]
        log(f"  {(m, n, d, k)} {mode}: " + ", ".join(
            f"{f} {s * 1e6:.1f} µs ({s / base:.2f})" for f, s in forms.items())
            + f"; takes {tuning.fastest(forms)}")
    return row


def _iqr(values):
    values = sorted(values)
    return [values[len(values) // 4], values[3 * len(values) // 4]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="*", default=None,
                        help="m,n,d,k of each row (default: the rounds_per_sec.py rows)")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=20, help="rounds per timed block")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    configs = ([tuple(int(v) for v in c.split(",")) for c in args.configs]
               if args.configs else CONFIGS)
    meta = harness.collect_meta(None, blocks=args.blocks, rounds=args.rounds,
                                bytes_model=harness.LINEAR_ROUND_BYTES_MODEL)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    rows = [bench(m, n, d, k, max(args.blocks // 2, 4) if m >= 100000 else args.blocks,
                  args.rounds, log) for m, n, d, k in configs]
    payload = {"meta": harness.finish_meta(meta, started), "rows": rows}
    if args.out:
        harness.write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
