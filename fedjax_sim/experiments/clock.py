"""Virtual time as settings of an experiment, declared once (like the systems ones).

An experiment that offers it adds `CLOCK_SETTINGS` (the clients' speeds: `ops.clock.Clock`
from the settings, or a trace CSV) and `ASYNC_SETTINGS` (read only by FedBuff and
FedAsync: `Method.reads`), and `provides` `methods.VIRTUAL_CLOCK`, so the asynchronous
methods fit it. Every run then reports, in each evaluation row,

    virtual_time  the seconds elapsed (`ops.clock`): FedBuff and FedAsync from their
                  state; a synchronous method's round lasts as long as its slowest
                  reporting client, or `deadline` seconds, after which the stragglers
                  are dropped (`algorithms.clocked.with_clock`)
    trips         the client uploads so far

and a comparison's finals add `time_to_target` and `trips_to_target`: the virtual time
and trips of the first evaluation whose test_accuracy reaches `target_accuracy` (NaN:
never reached).
"""

from __future__ import annotations

import math

import numpy as np

from fedjax_sim.experiments.settings import Setting
from fedjax_sim.ops.clock import Clock, read_trace

STALENESS = ("polynomial", "hinge", "constant")

CLOCK_SETTINGS = {st.name: st for st in (
    Setting("step_seconds", float, 1.0, "virtual clock: seconds of one local step (the "
            "median over clients with speed_spread)", minimum=1e-6),
    Setting("speed_spread", float, 0.0, "virtual clock: σ of the lognormal of the clients' "
            "step seconds, drawn once per client from seed (heavy-tailed: 1 puts the slowest "
            "of 50 clients near 10× the median); 0: equal speeds", minimum=0.0, maximum=5.0),
    Setting("bandwidth", float, 0.0, "virtual clock: bytes per second of every client's link "
            "(download and upload of the model); 0: communication is free", minimum=0.0),
    Setting("trace", str, "", "virtual clock: a CSV of the clients' speeds and online "
            "windows (columns client, step_seconds, bandwidth, online_from, online_until: "
            "ops.clock.read_trace), replacing step_seconds, speed_spread and bandwidth"),
    Setting("trace_cycle", float, 0.0, "virtual clock: the trace's online windows repeat "
            "every trace_cycle seconds (86400: a daily trace); 0: each window once",
            minimum=0.0),
    Setting("deadline", float, 0.0, "fedavg_deadline: the seconds after which a synchronous "
            "round stops waiting; the clients still training are dropped", minimum=0.0),
    Setting("target_accuracy", float, 0.8, "the test_accuracy (mean over clients) whose "
            "virtual time and trips a comparison reports (time_to_target, trips_to_target)",
            minimum=0.0, maximum=1.0),
)}

ASYNC_SETTINGS = {st.name: st for st in (
    Setting("concurrency", int, 20, "fedbuff, fedasync: K, the clients in flight at once",
            minimum=1, maximum=100_000),
    Setting("buffer_size", int, 10, "fedbuff: B ≤ concurrency, the uploads a server step "
            "waits for", minimum=1, maximum=100_000),
    Setting("max_staleness", int, 20, "fedbuff, fedasync: the stalest update applied (the "
            "server keeps max_staleness + 1 versions)", minimum=0, maximum=10_000),
    Setting("staleness", str, "polynomial", "fedbuff, fedasync: staleness weight s(τ): "
            "polynomial (1 + τ)^−1/2, hinge (FedAsync's, a=10, b=4) or constant",
            choices=STALENESS),
    Setting("async_server_lr", float, 1.0, "fedbuff: η_g, the server step on the mean "
            "staleness-weighted update", minimum=1e-9),
    Setting("fedasync_alpha", float, 0.6, "fedasync: α, the mixing weight of a fresh arrival",
            minimum=1e-9, maximum=1.0),
    Setting("fedasync_rounds", int, 500, "fedasync: server updates (one per arrival)",
            minimum=1, maximum=10_000_000),
)}


def clock_of(s: dict) -> Clock:
    """The `Clock` the settings ask for: the trace where one is given (one row per client
    of num_clients), else step_seconds · exp(speed_spread · z_i) from seed, bandwidth."""
    if s.get("trace"):
        return read_trace(s["trace"], s["num_clients"], cycle=s.get("trace_cycle", 0.0))
    return Clock(step_seconds=s["step_seconds"], spread=s["speed_spread"],
                 bandwidth=s["bandwidth"] or math.inf, seed=s.get("seed", 0))


def _staleness(value: str) -> dict:
    # FedBuff's 1/√(1 + τ); FedAsync's hinge with the paper's a = 10, b = 4.
    return {"staleness": value, "staleness_a": 10.0 if value == "hinge" else 0.5,
            "staleness_b": 4.0}


def _concurrency(value, b) -> dict:
    """K, and the experiment's clock (every asynchronous method reads concurrency)."""
    return {"concurrency": value, "clock": clock_of(b.s)}


ASYNC_READS = {"concurrency": _concurrency, "max_staleness": "max_staleness",
               "staleness": lambda value, b: _staleness(value)}
FEDBUFF_READS = {**ASYNC_READS, "buffer_size": "buffer_size", "async_server_lr": "server_lr"}
FEDASYNC_READS = {**ASYNC_READS, "fedasync_alpha": "alpha"}


def clocked(algorithm, b):
    """A synchronous method's wrap under the clock: `with_clock`, no deadline."""
    from fedjax_sim.algorithms.clocked import with_clock

    return with_clock(algorithm, b.model, b.training, clock_of(b.s),
                      participation=b.s.get("participation", 1.0))


def clocked_with_deadline(algorithm, b):
    """`clocked` with the setting deadline (0: none)."""
    from fedjax_sim.algorithms.clocked import with_clock

    return with_clock(algorithm, b.model, b.training, clock_of(b.s),
                      participation=b.s.get("participation", 1.0),
                      deadline=b.s.get("deadline") or None)


def check(s: dict, trained: tuple[str, ...] | None = None) -> None:
    """ValueError in one line for clock settings that do not go together (before anything
    is written): the trace read whole, B ≤ K where FedBuff is among the `trained` methods
    (None: any may be)."""
    if s.get("trace_cycle") and not s.get("trace"):
        raise ValueError(f"setting trace_cycle={s['trace_cycle']} repeats a trace's online "
                         "windows: give the trace too (trace=FILE.csv), or trace_cycle=0.")
    if s.get("trace"):
        read_trace(s["trace"], s["num_clients"], cycle=s.get("trace_cycle", 0.0))
    fedbuff = trained is None or "fedbuff" in trained
    if fedbuff and "buffer_size" in s and s["buffer_size"] > s["concurrency"]:
        raise ValueError(f"setting buffer_size={s['buffer_size']} exceeds concurrency="
                         f"{s['concurrency']}: a FedBuff server step waits for B of the K "
                         "clients in flight.")
    if s.get("stragglers", 0.0):
        raise ValueError("under the virtual clock slow clients are slow by their speeds "
                         f"(speed_spread, trace): give stragglers=0; got {s['stragglers']}.")


def to_target(rows: list[dict], target: float, metric: str = "test_accuracy") -> dict:
    """{time_to_target, trips_to_target}: [seeds] virtual time and trips of the first
    evaluation row whose `metric` reaches `target` (NaN where no row does)."""
    seeds = np.shape(rows[0][metric]) if rows else (0,)
    time, trips = np.full(seeds, np.nan), np.full(seeds, np.nan)
    for row in rows:
        reached = np.isnan(time) & (np.asarray(row[metric], np.float64) >= target)
        time = np.where(reached, np.asarray(row["virtual_time"], np.float64), time)
        trips = np.where(reached, np.asarray(row["trips"], np.float64), trips)
    return {"time_to_target": time, "trips_to_target": trips}


def note(s: dict) -> str:
    """The clock of a comparison in words."""
    if s.get("trace"):
        speeds = f"client speeds and windows from the trace {s['trace']}"
    else:
        spread = (f", each client's drawn once as {s['step_seconds']} · exp({s['speed_spread']}"
                  " z_i), z_i ~ N(0, 1)" if s["speed_spread"] else " for every client")
        link = (f"a {s['bandwidth']:g} B/s link each way" if s["bandwidth"]
                else "free communication")
        speeds = f"{s['step_seconds']} s per local step{spread}; {link}"
    return (f"{speeds}; a synchronous round lasts as long as its slowest reporting client "
            f"(fedavg_deadline: at most deadline={s['deadline']} s, later clients dropped); "
            f"time_to_target, trips_to_target: the first evaluation with test_accuracy ≥ "
            f"{s['target_accuracy']} (NaN: not reached); no network contention is modelled")
