"""Asynchronous FL in virtual time: FedAvg (with and without a deadline), FedProx, FedBuff
and FedAsync on the heterogeneous-FL problem (`hetero`), judged by time to accuracy.

    each seed s:  the clients of `hetero` (a Flower partition of digits or MNIST), an MLP
    the clock:    each client's step seconds and link (`experiments.clock`), shared by seeds
    each method M, every seed at once (one vmapped axis):
        train M; synchronous rounds timed by `with_clock` (the slowest reporting client,
        or the deadline), FedBuff and FedAsync by their own event rule
        every evaluation: hetero's metrics, virtual_time, trips
    finals: time_to_target, trips_to_target (first test_accuracy ≥ target_accuracy)

The settings, problem and metrics are `hetero`'s; this module adds the clock
(`experiments.clock`) and the methods that read it.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from fedjax_sim.algorithms.clocked import ClockedState
from fedjax_sim.experiments import clock
from fedjax_sim.experiments.base import Metrics, Preset, Trained
from fedjax_sim.experiments.hetero.experiment import hetero_experiment
from fedjax_sim.experiments.hetero.experiment import metrics as hetero_metrics
from fedjax_sim.experiments.hetero.experiment import notes as hetero_notes
from fedjax_sim.experiments.hetero.experiment import table as hetero_table
from fedjax_sim.experiments.methods import METHODS, VIRTUAL_CLOCK

ASYNC_METHODS = ("fedavg", "fedavg_deadline", "fedbuff", "fedasync")

# The synchronous rows time their rounds by the clock (`with_clock`); fedavg_deadline alone
# reads the deadline.
TABLE = {
    "fedavg": METHODS["fedavg"].replace(wrap=clock.clocked),
    "fedavg_deadline": METHODS["fedavg"].replace(
        help="FedAvg whose rounds stop waiting after deadline seconds (later clients "
             "dropped)", reads={"weighting": "weighting", "deadline": lambda value, b: {}},
        wrap=clock.clocked_with_deadline),
    "fedprox": METHODS["fedprox"].replace(wrap=clock.clocked),
    "fedbuff": METHODS["fedbuff"],
    "fedasync": METHODS["fedasync"],
    "async_ifca": METHODS["async_ifca"],
}


class _Clusters(NamedTuple):
    """Asynchronous IFCA's k models as hetero's metrics find cluster models (a state's
    `cluster_params`: a client's test set served by the cluster its training data picks)."""
    params: object  # leaves [k, ...]: what the algorithm's evaluate reads
    cluster_params: object  # the same


def metrics(t: Trained) -> Metrics:
    """hetero's metrics of the method's model, with virtual_time and trips from its state;
    finals time_to_target and trips_to_target."""
    timed = VIRTUAL_CLOCK not in t.method.needs  # a synchronous method under `with_clock`
    clustered = t.method.kind == "clustered" and not timed  # asynchronous IFCA
    built = t.built
    if timed:  # the inner state's evaluation (hetero's reads the inner state's fields)
        built = built._replace(
            evaluate=lambda state, data: t.built.evaluate(ClockedState(state, 0.0, 0), data))
    base = hetero_metrics(t._replace(built=built))

    def evaluate(state) -> dict:
        model = state.inner if timed else _Clusters(state.params, state.params) if clustered \
            else state
        return {**base(model),
                "virtual_time": np.asarray(state.time, np.float64),
                "trips": np.asarray(state.trips, np.float64)}

    return Metrics(evaluate, finals=lambda rows, _: clock.to_target(
        rows, t.s["target_accuracy"]))


def table(s: dict) -> list[str]:
    return [*hetero_table(s), "virtual_time", "trips", "time_to_target", "trips_to_target"]


def notes(s: dict, problem, results: dict) -> dict:
    """hetero's notes (its methods line for this table's methods), and the clock."""
    out = hetero_notes(s, problem, {})
    out["methods"] = "; ".join(
        f"{m} = {TABLE[m].help}" + "".join(f" {st}={s[st]}" for st in TABLE[m].reads
                                           if st in s and st != "weighting")
        + (f" for {s[TABLE[m].rounds]} server updates" if TABLE[m].rounds in s else "")
        for m in results)
    return {**out, "clock": clock.note(s)}


def _validate(hetero_validate):
    def validate(s: dict, command: str = "compare") -> None:
        chosen = s.get("methods") if command == "compare" else s.get("method")
        clock.check(s, None if chosen is None else
                    (chosen,) if isinstance(chosen, str) else tuple(chosen))
        if s.get("unseen_clients"):
            raise ValueError("setting unseen_clients must be 0 under the virtual clock (the "
                             "clock times the training clients only).")
        if s.get("dp_clip"):
            raise ValueError("setting dp_clip must be 0 here: DP under the virtual clock is "
                             "not offered.")
        hetero_validate(s, command)

    return validate


def async_experiment(name: str, description: str, compared: tuple[str, ...],
                     defaults: dict):
    """hetero's experiment with the clock: its settings, `TABLE`, virtual time in every
    evaluation and time to a target accuracy in its finals."""
    e = hetero_experiment(name, description, compared, "fedavg", defaults)
    added = [dataclasses.replace(st, default=defaults.get(st.name, st.default))
             for st in (*clock.CLOCK_SETTINGS.values(), *clock.ASYNC_SETTINGS.values())]
    # Of the clustered methods, this table has async_ifca alone.
    own = tuple(dataclasses.replace(st, help="async_ifca: cluster models") if st.name == "k"
                else st for st in e.settings)
    return e.replace(
        settings=(*own, *added), method_table=TABLE,
        provides=frozenset({VIRTUAL_CLOCK}), metrics=metrics, table=table, notes=notes,
        validate=_validate(e.validate), tune_metric=None,
        panels=(*e.panels[:2], ("virtual_time", "virtual time (s)"), ("trips", "client trips")))


ASYNC = async_experiment(
    "async_hetero", "Asynchronous FL in virtual time: FedAvg (with and without a deadline), "
    "FedBuff and FedAsync on partitioned images with heavy-tailed client speeds",
    ASYNC_METHODS,
    {"num_clients": 50, "alpha": 0.3, "participation": 0.2, "local_steps": 5,
     "batch_size": 10, "rounds": 100, "eval_every": 2, "seeds": 3, "speed_spread": 1.0,
     "bandwidth": 10_000.0, "deadline": 15.0, "target_accuracy": 0.8, "concurrency": 20,
     "buffer_size": 10, "fedasync_rounds": 1000, "fedasync_alpha": 0.6})

PRESETS = [
    Preset("async-digits", ASYNC,
           "FedAvg (synchronous; with a 15 s deadline), FedBuff (K=20 in flight, B=10) and "
           "FedAsync (α=0.6) on 8×8 digits, 50 Dirichlet(0.3) clients, client step seconds "
           "lognormal (median 1 s, σ=1), a 10 kB/s link: virtual time and trips to 80% test "
           "accuracy."),
]
