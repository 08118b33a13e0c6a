"""The experiment-level half of asynchronous FL: virtual time in every run.

`with_clock` against the clock's definition written here (a synchronous round lasts as
long as its slowest reporting client; a deadline drops exactly the clients past it, and
the round is FedAvg over the rest, a float64 loop; so is a client leaving its window), the
`async-digits` preset end to end through the command line, and bad inputs refused in one
line with nothing written.
"""

from __future__ import annotations

import csv
import json
import math
import re

import jax
import numpy as np
import pytest
from federations import local_gd

from conftest import make_ragged, np_client_grad
from fedjax_sim import cli, experiments, plots
from fedjax_sim.algorithms import Work, fedavg, sgd
from fedjax_sim.algorithms.clocked import with_clock
from fedjax_sim.models import linear_regression
from fedjax_sim.ops.clock import Clock

SIZES = (4, 1, 0, 3, 2, 5, 2, 3)  # client 2 holds no data: it never reports
TAUS = (3, 1, 2, 4, 2, 3, 1, 2)  # Work(per_client=...): τ_i
STEP_SECONDS = (1.0, 1.7, 50.0, 2.9, 0.55, 7.3, 1.3, 3.1)  # client 2 would be the slowest
BANDWIDTH = (1e3, 2e3, 1e3, 500.0, 4e3, 1e3, 800.0, 2e3)  # bytes/s
LR = 0.05


def _setup():
    data = make_ragged(seed=4, sizes=SIZES, clusters=(0, 1, 0, 1, 0, 1, 0, 1))
    d = data.x.shape[-1]
    training = sgd(LR, steps=max(TAUS), work=Work(per_client=TAUS))  # full batch
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH)
    return data, linear_regression(d), training, clock, d


def _assert_fedavg_over(kept, start, data, params):
    """params equal FedAvg (uniform weights) of the `kept` clients alone, each by full-batch
    GD from `start` in float64 (the test's loop)."""
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y, np.float64)
    ref = type("Ref", (), {"grad": staticmethod(np_client_grad)})
    want = np.mean([local_gd(ref, start, x[i], y[i], SIZES[i], LR, TAUS[i])
                    for i in np.flatnonzero(kept)], axis=0)
    np.testing.assert_allclose(np.asarray(params, np.float64), want, rtol=1e-5, atol=1e-6)


def _trips(d):
    """Each client's trip by the clock's definition: τ_i · step_i + 2 · model_bytes / bw_i,
    the model θ ∈ R^d in float32."""
    model_bytes = 4 * d
    return np.array([t * s + 2.0 * model_bytes / b
                     for t, s, b in zip(TAUS, STEP_SECONDS, BANDWIDTH, strict=True)])


def test_a_synchronous_round_lasts_as_long_as_its_slowest_reporting_client():
    data, model, training, clock, d = _setup()
    alg = with_clock(fedavg(model, training), model, training, clock)
    state = alg.init(jax.random.key(0), data)
    step = jax.jit(alg.round)
    trips = _trips(d)
    reporting = np.array(SIZES) > 0
    slowest = trips[reporting].max()  # client 5; client 2 (no data) is left out
    assert slowest < trips[2]
    for t in range(1, 3):
        state, metrics = step(state, data, jax.random.key(t))
        np.testing.assert_allclose(float(state.time), t * slowest, rtol=1e-6)
        assert int(state.trips) == t * reporting.sum()
        np.testing.assert_allclose(metrics["virtual_time"], t * slowest, rtol=1e-6)
        assert float(metrics["dropped"]) == 0.0


@pytest.mark.parametrize("deadline", [5.0, 9.5])
def test_a_deadline_drops_exactly_the_clients_past_it(deadline):
    data, model, training, clock, d = _setup()
    alg = with_clock(fedavg(model, training), model, training, clock, deadline=deadline)
    state = alg.init(jax.random.key(0), data)
    start = np.asarray(state.inner.params, np.float64)
    state, metrics = jax.jit(alg.round)(state, data, jax.random.key(1))

    trips = _trips(d)
    reporting = np.array(SIZES) > 0
    kept = reporting & (trips <= deadline)
    assert 0 < kept.sum() < reporting.sum()
    assert float(metrics["dropped"]) == (reporting & ~kept).sum()
    np.testing.assert_allclose(float(state.time), min(deadline, trips[reporting].max()),
                               rtol=1e-6)
    assert int(state.trips) == reporting.sum()  # a dropped client's upload still counts
    # The round is FedAvg (uniform weights) over the kept clients alone.
    _assert_fedavg_over(kept, start, data, state.inner.params)


TINY = ["num_clients=10", "seeds=1", "rounds=4", "fedasync_rounds=8", "eval_every=2",
        "concurrency=4", "buffer_size=2", "target_accuracy=0.05"]


def _with(settings, *changes):
    """settings with each KEY=VALUE of changes in place of the KEY's own."""
    keys = {c.split("=")[0] for c in changes}
    return [t for t in settings if t.split("=")[0] not in keys] + list(changes)


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_the_preset_compares_and_runs_end_to_end(tmp_path, monkeypatch):
    out = tmp_path / "compare"
    drawn = {}  # PNG name -> (plot_comparison's keywords, the numbers it drew)
    real = plots.plot_comparison

    def spy(rows, path, panels, **kw):
        drawn[path.name] = (kw, real(rows, path, panels, **kw))
        return drawn[path.name][1]

    monkeypatch.setattr(plots, "plot_comparison", spy)
    # async_ifca: a method of the table beyond the preset's own four, drawn too.
    methods = "methods=fedavg,fedavg_deadline,fedbuff,fedasync,async_ifca"
    assert cli.main(["compare", "async-digits", "--set", *_with(TINY, "seeds=2"), methods,
                     "--out", str(out), "--no-progress"]) == 0
    _check_time_plot(out, *drawn["comparison_time.png"])
    assert set(drawn["comparison.png"][1]["test_accuracy"]) == set(methods[8:].split(","))
    results = {r["method"]: r for r in _rows(out / "results.csv")}
    assert set(results) == {"fedavg", "fedavg_deadline", "fedbuff", "fedasync", "async_ifca"}
    for name, row in results.items():
        time, trips = float(row["virtual_time_mean"]), float(row["trips_mean"])
        assert time > 0 and trips > 0, name
        # A target of 5 % is reached at the first evaluation after round 0 at the latest
        # (at round 0 itself, time 0, where a seed's initial models already reach it).
        assert 0 <= float(row["time_to_target_mean"]) <= time, name
        assert 0 <= float(row["trips_to_target_mean"]) <= trips, name
    # 4 FedBuff steps of B = 2 uploads; 8 FedAsync arrivals; FedAvg's 2 of 10 per round.
    assert float(results["fedbuff"]["trips_mean"]) == 8
    assert float(results["async_ifca"]["trips_mean"]) == 8
    assert float(results["fedasync"]["trips_mean"]) == 8
    assert float(results["fedavg"]["trips_mean"]) == 8
    history = _rows(out / "metrics.csv")
    assert {"virtual_time", "trips"} <= set(history[0])

    run = tmp_path / "run"
    fedbuff_only = [t for t in TINY if not t.startswith("fedasync_")]
    assert cli.main(["run", "async-digits", "--set", *fedbuff_only, "method=fedbuff", "--out",
                     str(run), "--no-progress"]) == 0
    rows = _rows(run / "metrics.csv")
    times = [float(r["virtual_time"]) for r in rows]
    assert [int(r["round"]) for r in rows] == [0, 2, 4]
    assert times[0] == 0.0 and times[1] < times[2]
    summary = json.loads((run / "summary.json").read_text())
    assert math.isfinite(summary["final_mean"]["time_to_target"])


def _check_time_plot(out, kw, drawn):
    """comparison_time.png: every method's seed mean of each metric at each evaluation
    round, drawn at the seeds' mean virtual time of that round (per_seed_metrics.csv)."""
    assert (out / "comparison_time.png").read_bytes()[:4] == b"\x89PNG"
    assert kw["x"] == "virtual_time" and kw["xlabel"].startswith("virtual time (s)")
    assert set(drawn) == {"test_accuracy", "test_accuracy_worst", "trips"}  # not time itself
    rows = _rows(out / "per_seed_metrics.csv")
    seeds = {r["seed"] for r in rows}
    for metric, per_method in drawn.items():
        assert set(per_method) == {"fedavg", "fedavg_deadline", "fedbuff", "fedasync",
                                   "async_ifca"}
        for method, band in per_method.items():
            mine = [r for r in rows if r["method"] == method]
            rounds = sorted({int(r["round"]) for r in mine})
            at = [[r for r in mine if int(r["round"]) == t] for t in rounds]
            time = [np.mean([float(r["virtual_time"]) for r in rs]) for rs in at]
            value = [np.mean([float(r[metric]) for r in rs]) for rs in at]
            np.testing.assert_allclose(band["round"], time, rtol=1e-9, err_msg=method)
            np.testing.assert_allclose(band["mean"], value, rtol=1e-9, err_msg=method)
            assert band["n"] == [len(seeds)] * len(rounds)
            assert time[0] == 0.0 and np.all(np.diff(time) > 0), method
    # FedAsync's 8 arrivals, FedBuff's and async IFCA's 4 steps (k + 1 models a trip) end
    # at other times than FedAvg's rounds.
    ends = {m: b["round"][-1] for m, b in drawn["test_accuracy"].items()}
    assert len(set(ends.values())) == 5, ends


@pytest.mark.parametrize("settings, message", [
    (["buffer_size=30", "concurrency=20"], r"buffer_size=30 exceeds concurrency=20"),
    (["step_seconds=-1"], r"step_seconds"),
    (["trace=TRACE", "num_clients=10"], r"has no row for 6 clients 4, 5, 6, 7, 8"),
    (["trace_cycle=100"], r"trace_cycle=100.0 repeats a trace's online windows: give the trace"),
    (["trace=WINDOWS", "num_clients=4", "trace_cycle=100"], r"cycle=100.0"),
])
def test_bad_inputs_are_refused_in_one_line_with_nothing_written(tmp_path, capsys, settings,
                                                                 message):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,step_seconds,bandwidth\n0,1.0,1e4\n1,2.0,\n2,0.5,1e5\n3,4.0,\n")
    windows = tmp_path / "windows.csv"  # client 2's window ends past a cycle of 100 s
    windows.write_text("client,step_seconds,online_from,online_until\n0,1.0,0,50\n"
                       "1,2.0,0,100\n2,0.5,20,150\n3,4.0,0,100\n")
    out = tmp_path / "out"
    given = dict(t.split("=") for t in TINY)
    given.update(s.replace("TRACE", str(trace)).replace("WINDOWS", str(windows)).split("=", 1)
                 for s in settings)
    code = cli.main(["compare", "async-digits", "--set", *(f"{k}={v}" for k, v in given.items()),
                     "--out", str(out),
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    assert not out.exists()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert re.search(message, lines[0]), lines[0]


def test_trace_cycle_repeats_the_traces_windows(tmp_path):
    """trace_cycle reaches the clock: a client online in [0, 50) of every 100 s is online
    again at 120 s, and without the cycle it is not."""
    import jax.numpy as jnp

    from fedjax_sim.experiments.clock import clock_of
    from fedjax_sim.ops.clock import _tables, online
    from fedjax_sim.systems import Systems

    def online_at(clock, client, t):
        return online(_tables(clock, 2, Systems()), jnp.asarray([client]),
                      jnp.asarray([t], jnp.float32))[0]

    path = tmp_path / "trace.csv"
    path.write_text("client,step_seconds,online_from,online_until\n0,1.0,0,50\n1,2.0,0,100\n")
    s = {"trace": str(path), "num_clients": 2}
    once, daily = clock_of({**s, "trace_cycle": 0.0}), clock_of({**s, "trace_cycle": 100.0})
    assert once.cycle == 0.0 and daily.cycle == 100.0
    assert bool(online_at(daily, 0, 120.0)) and not bool(online_at(once, 0, 120.0))
    assert bool(online_at(daily, 0, 20.0)) and bool(online_at(once, 0, 20.0))


def test_a_client_that_goes_offline_mid_trip_does_not_report():
    """Client 5 (the slowest) leaves its window before its trip ends: the round lasts as long
    as the slowest of the others, and is FedAvg over them; client 0 is offline at the start
    (its window opens later) and does not report either."""
    data, model, training, _, d = _setup()
    trips = _trips(d)
    windows = [((0.0, 1e6),)] * len(SIZES)
    windows[5] = ((0.0, trips[5] / 2),)
    windows[0] = ((100.0, 200.0),)
    clock = Clock(step_seconds=STEP_SECONDS, bandwidth=BANDWIDTH, windows=tuple(windows))
    alg = with_clock(fedavg(model, training), model, training, clock)
    state = alg.init(jax.random.key(0), data)
    start = np.asarray(state.inner.params, np.float64)
    state, metrics = jax.jit(alg.round)(state, data, jax.random.key(1))

    kept = (np.array(SIZES) > 0) & ~np.isin(np.arange(len(SIZES)), [0, 5])
    np.testing.assert_allclose(float(state.time), trips[kept].max(), rtol=1e-6)
    assert int(state.trips) == kept.sum()
    _assert_fedavg_over(kept, start, data, state.inner.params)


SWEEP = ["num_clients=8", "seeds=2", "rounds=4", "eval_every=2", "concurrency=4",
         "buffer_size=1,2,4", "target_accuracy=0.05", "method=fedbuff"]


@pytest.mark.slow
def test_a_sweep_over_the_buffer_and_its_resume_lose_and_duplicate_nothing(tmp_path):
    """`sweep async-digits` over B: a trial per cell and seed, each with its clock columns
    (B uploads per server step: trips = rounds · B with every client online); a sweep
    killed after its first cell, mid-row, resumes to the same trials and summary."""
    full = experiments.sweep_preset("async-digits", SWEEP, out_dir=tmp_path / "full",
                                    progress=False)
    trials = _rows(full / "trials.csv")
    assert sorted((int(r["buffer_size"]), int(r["data_seed"])) for r in trials) == [
        (b, s) for b in (1, 2, 4) for s in (0, 1)]
    for row in trials:
        assert float(row["trips"]) == 4 * int(row["buffer_size"])
        assert 0 <= float(row["time_to_target"]) <= float(row["virtual_time"])
    summary = {int(r["buffer_size"]): r for r in _rows(full / "summary.csv")}
    # A server step waits for the B earliest of the K = 4 in flight: more B, more time.
    times = [float(summary[b]["virtual_time_mean"]) for b in (1, 2, 4)]
    assert times[0] < times[1] < times[2], times

    lines = (full / "trials.csv").read_text().splitlines(keepends=True)
    part = tmp_path / "part"
    part.mkdir()
    (part / "config.json").write_bytes((full / "config.json").read_bytes())
    (part / "trials.csv").write_text("".join(lines[:3]) + lines[3][:9])  # the kill, mid-row
    experiments.sweep_preset("async-digits", SWEEP, out_dir=part, progress=False, resume=True)
    key = lambda r: (r["cell_id"], r["data_seed"])  # noqa: E731
    assert sorted(_rows(part / "trials.csv"), key=key) == sorted(trials, key=key)
    assert _rows(part / "summary.csv") == _rows(full / "summary.csv")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedbuff", "fedasync"])
def test_an_interrupted_run_resumes_to_the_same_history(tmp_path, monkeypatch, method):
    """A `run` stopped (Ctrl-C) right after its second checkpoint resumes from it: the
    clients in flight, their versions and the clock come back with the state, so
    metrics.csv (virtual time and trips included) and the summary equal an uninterrupted
    run's."""
    from fedjax_sim.checkpoint import RunCheckpoints

    steps = "fedasync_rounds" if method == "fedasync" else "rounds"
    settings = ["--set", *_with(TINY, f"{steps}=8", "seeds=2"), "checkpoint_every=2",
                f"method={method}"]
    other = ("buffer_size=", "rounds=") if method == "fedasync" else ("fedasync_",)
    settings = [t for t in settings if not t.startswith(other)]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    real, saved = RunCheckpoints.save, []

    def save_then_interrupt(self, step, *args, **kw):
        real(self, step, *args, **kw)
        saved.append(step)
        if len(saved) == 2:
            self.wait()
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(RunCheckpoints, "save", save_then_interrupt)
        assert cli.main(["run", "async-digits", *settings, "--out", str(killed),
                         "--no-progress"]) == 130
    assert saved == [2, 4] and not (killed / "summary.json").exists()
    assert cli.main(["run", "async-digits", *settings, "--out", str(killed), "--resume",
                     "--no-progress"]) == 0
    assert cli.main(["run", "async-digits", *settings, "--out", str(whole),
                     "--no-progress"]) == 0
    text = (whole / "metrics.csv").read_text()
    assert (killed / "metrics.csv").read_text() == text
    rows = _rows(whole / "metrics.csv")
    assert [int(r["round"]) for r in rows] == [0, 0, 2, 2, 4, 4, 6, 6, 8, 8]  # two seeds
    assert float(rows[-1]["virtual_time"]) > float(rows[4]["virtual_time"]) > 0
    timing = ("seconds", "rounds_per_second", "compile_seconds", "evaluate_seconds",
              "run_seconds", "rounds_run")
    kept, fresh = (json.loads((d / "summary.json").read_text()) for d in (killed, whole))
    assert {k: v for k, v in kept.items() if k not in timing} == {
        k: v for k, v in fresh.items() if k not in timing}
    assert len(json.loads((killed / "config.json").read_text())["resumed"]) == 1
