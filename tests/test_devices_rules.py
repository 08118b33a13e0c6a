"""The same seed on 1 and 4 forced CPU devices: the same events and the same numbers.

FedBuff, FedAsync and asynchronous IFCA (with Systems' availability and dropout,
heavy-tailed speeds): after every server step, the slots' clients, their download
versions, event times and outcomes and the server's version and clock agree exactly (the
event order), the model to float rounding. `with_aggregator` (Byzantine clients under a
robust rule, FedAvg and IFCA per cluster) and `with_dp` (clipped, noised FedAvg with a
cohort; adaptive clipping): the same cohorts, Byzantine flags and noise, so the same
models to float rounding. The `async-digits` comparison through the command line with
`--devices 1` and `--devices 4`: the same virtual times and trips exactly, every other
number to float rounding.

Sharding the client axis changes only the order of the cross-client sums (the design:
a client's key is fold_in(round_key, client_id)), so discrete results agree bit for bit
and floats to a few float32 ulps. JAX fixes its device count when it initialises: the
runs happen in one fresh subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from federations import subprocess_env

TINY = ["num_clients=8", "seeds=2", "rounds=4", "fedasync_rounds=8", "eval_every=2",
        "concurrency=4", "buffer_size=2", "target_accuracy=0.05", "checkpoint_every=0"]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from federations import eight_clients
    from fedjax_sim import cli, parallel, simulate
    from fedjax_sim.algorithms import (AdaptiveClipping, Work, async_ifca, fedasync, fedavg,
                                       fedbuff, ifca, sgd, with_aggregator, with_dp,
                                       with_systems)
    from fedjax_sim.ops import attacks, robust
    from fedjax_sim.ops.clock import Clock
    from fedjax_sim.systems import Systems

    out_dir, tiny, part = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    assert jax.device_count() == 4
    data, model = eight_clients()
    clock = Clock(step_seconds=0.5, spread=1.0, bandwidth=1e3, bandwidth_spread=0.5, seed=1,
                  round_seconds=2.0)
    training = sgd(0.1, steps=3, batch_size=2, work=Work(low=1))
    systems = Systems(availability=0.8, period=4, dropout=0.1)
    asynchronous = {
        "fedbuff": fedbuff(model, training, concurrency=5, buffer_size=2, max_staleness=3,
                           clock=clock),
        "fedasync": fedasync(model, training, concurrency=4, max_staleness=3, clock=clock),
        "async_ifca": async_ifca(model, training, num_clusters=2, concurrency=5, buffer_size=2,
                                 max_staleness=3, clock=clock),
    }
    plain = sgd(0.1, steps=2, batch_size=2)
    rules = {
        "median+byzantine": with_aggregator(fedavg(model, plain, participation=0.5),
                                            robust.coordinate_median(), byzantine=2,
                                            attack=attacks.sign_flip(scale=5.0)),
        "trimmed+ifca": with_aggregator(ifca(model, plain, num_clusters=2, option="model"),
                                        robust.trimmed_mean(f=1), byzantine=1,
                                        attack=attacks.gaussian_noise(sigma=2.0)),
        "dp": with_dp(fedavg(model, plain, participation=0.5), 0.5, 0.8),
        "dp+adaptive": with_dp(with_systems(fedavg(model, plain, participation=0.5),
                                            Systems(availability=0.8)), 0.5, 0.8,
                               adaptive=AdaptiveClipping(count_stddev=1.0)),
    }

    def events(alg, state, placed, steps):
        # The state after every server step: the event order, step by step.
        def step(state, t):
            state, metrics = alg.round(state, placed, jax.random.fold_in(jax.random.key(4), t))
            seen = {"clients": state.clients, "flying": state.flying, "started": state.started,
                    "events": state.events, "uploads": state.uploads,
                    "version": state.version, "time": state.time, "trips": state.trips}
            return state, (seen, metrics)
        return jax.jit(lambda s: jax.lax.scan(step, s, jnp.arange(steps)))(state)

    def listed(tree):
        return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)

    out = {}
    for devices in (1, 4):
        if part == "digits":
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = cli.main(["compare", "async-digits", "--set", *tiny, "--devices",
                                 str(devices), "--out", f"{out_dir}/digits{devices}",
                                 "--no-progress"])
            out[f"digits/{devices}"] = {"code": code, "stderr": err.getvalue()[-2000:]}
            continue
        placed = data if devices == 1 else parallel.place_inputs(data, parallel.make_mesh(4))
        for name, alg in asynchronous.items():
            alg = with_systems(alg, systems)
            state = jax.jit(alg.init)(jax.random.key(3), placed)
            state, (seen, metrics) = events(alg, state, placed, 15)
            out[f"{name}/{devices}"] = {"seen": listed(seen), "metrics": listed(metrics),
                                        "params": listed(state.params)}
        for name, alg in rules.items():
            state = jax.jit(alg.init)(jax.random.key(3), placed)
            state, metrics = simulate.scan_rounds(alg, state, placed, jax.random.key(4), 0, 6)
            params = getattr(state, "params", None)
            if params is None:
                params = state.cluster_params
            out[f"{name}/{devices}"] = {"metrics": listed(metrics), "params": listed(params)}
    print("RESULT" + json.dumps(out))
    """
)


def _subprocess(out, part: str):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out), json.dumps(TINY), part],
                          capture_output=True, text=True, env=subprocess_env(4), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return out, json.loads(line[len("RESULT"):])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The rounds and server steps on 1 and 4 devices, in one subprocess."""
    return _subprocess(tmp_path_factory.mktemp("devices_rules"), "rounds")


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    """`compare async-digits` on 1 and 4 devices, in one subprocess."""
    return _subprocess(tmp_path_factory.mktemp("devices_digits"), "digits")


def _close(a, b, what):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-5, atol=1e-6, err_msg=what)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fedbuff", "fedasync", "async_ifca"])
def test_async_events_are_the_same_on_one_and_four_devices(runs, name):
    _, out = runs
    one, four = out[f"{name}/1"], out[f"{name}/4"]
    for field, steps in one["seen"].items():  # [steps, ...] each
        assert steps == four["seen"][field], f"{name}: {field}"
    for key, values in one["metrics"].items():
        _close(values, four["metrics"][key], f"{name}: {key}")
    _close(one["params"], four["params"], f"{name}: params")
    # The premises: clients came and went, trips failed or were stale, the model moved.
    seen = one["seen"]
    assert seen["trips"][-1] > 10 and seen["version"][-1] > 3
    assert len({tuple(c) for c in seen["clients"]}) > 5
    assert not all(all(u) for u in seen["uploads"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["median+byzantine", "trimmed+ifca", "dp", "dp+adaptive"])
def test_server_rules_give_the_same_rounds_on_one_and_four_devices(runs, name):
    _, out = runs
    one, four = out[f"{name}/1"], out[f"{name}/4"]
    assert one["metrics"].keys() == four["metrics"].keys()
    for key, values in one["metrics"].items():
        _close(values, four["metrics"][key], f"{name}: {key}")
    _close(one["params"], four["params"], f"{name}: params")
    if "byzantine_reports" in one["metrics"]:  # the same Byzantine clients reported
        assert one["metrics"]["byzantine_reports"] == four["metrics"]["byzantine_reports"]
        assert sum(one["metrics"]["byzantine_reports"]) > 0
    if "dp_clip_norm" in one["metrics"] and name == "dp+adaptive":  # C followed the norms
        assert len(set(one["metrics"]["dp_clip_norm"])) > 1


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.exhaustive  # two tiny comparisons of five methods (about a minute on 2 cores)
def test_async_digits_compares_the_same_on_one_and_four_devices(digits_runs):
    root, out = digits_runs
    for devices in (1, 4):
        assert out[f"digits/{devices}"]["code"] == 0, out[f"digits/{devices}"]["stderr"]
    config = json.loads((root / "digits4" / "config.json").read_text())
    assert config["mesh_devices"] == 4
    for table in ("per_seed_metrics.csv", "per_seed.csv"):
        one, four = _rows(root / "digits1" / table), _rows(root / "digits4" / table)
        assert len(one) == len(four) > 0
        for a, b in zip(one, four, strict=True):
            assert a.keys() == b.keys()
            for key in a:
                if key in ("method", "seed", "round", "diverged", "trips", "trips_to_target",
                           "virtual_time", "time_to_target") or "" in (a[key], b[key]):
                    assert a[key] == b[key], (table, key, a, b)  # the clock: exactly
                else:
                    _close(float(a[key]), float(b[key]), f"{table} {key}")
