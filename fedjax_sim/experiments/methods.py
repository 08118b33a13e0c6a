"""The methods a comparison can train: one table, declared once for every experiment.

A `Method` is a registered algorithm (`fedjax_sim.algorithms.ALGORITHMS`) with
fixed options, the experiment settings it reads, the combinators around it and
what it needs of an experiment (server data, a split model). `METHODS` holds
every method of every comparison; an experiment offers every method that fits
its data (`fits`), declares the ones it compares by default, and may replace an
entry where its protocol trains a method its own way (`Experiment.method_table`).
So `--set methods=...` can name any method that fits, and a new algorithm is one
registry line plus, where it has settings of its own, one line here.

`build(name, table, model, training, s)` is the one way a method is built:
the factory of its algorithm, called with the model, the experiment's client
training and the method's options and settings, then its combinators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_sim import simulate
from fedjax_sim.algorithms import (
    ALGORITHMS,
    ClientTraining,
    fedavg,
    sgd,
    with_balanced_init,
    with_frozen_trunk,
    with_systems,
    with_warm_start,
    with_weight_sharing,
)
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.experiments.clock import FEDASYNC_READS, FEDBUFF_READS
from fedjax_sim.experiments.settings import Setting
from fedjax_sim.models.core import TRUNK, Model
from fedjax_sim.ops.work import Work
from fedjax_sim.systems import Systems

KINDS = ("global", "clustered", "personal", "fixed", "fine_tuned")
# What an experiment's metrics read unless it says more (`Experiment.kinds`): a fine-tuned
# method's evaluation trains every client first, which an experiment must offer itself.
BASIC_KINDS = KINDS[:4]
SERVER_DATA, SPLIT_MODEL, FLOAT_TARGETS = "server_data", "split_model", "float_targets"
# The asynchronous methods need client speeds and availability in virtual time: an
# experiment offering the clock settings (`experiments.clock`) provides it.
VIRTUAL_CLOCK = "virtual_clock"


class Build(NamedTuple):
    """What a method's combinators and adapters see."""

    model: Model  # the model it trains (split where it needs a split model)
    training: ClientTraining  # the experiment's client training for it
    s: dict  # the experiment's settings
    table: Mapping  # the experiment's method table (to build another method)
    problem: Any = None  # what every method of the comparison shares (`Experiment.problem`)


@dataclasses.dataclass(frozen=True)
class Method:
    """One method a comparison can train.

    Attributes:
      algorithm: its factory's name in `algorithms.ALGORITHMS`, or, for a method of an
        experiment's own, the factory itself: (model, training, **options) -> Algorithm.
      help: one line for `describe` and the notes.
      options: fixed keyword arguments of the factory.
      reads: experiment setting -> factory keyword, applied where the experiment
        declares the setting; a value may be a callable (value, Build) -> {keyword:
        value} for a setting that needs converting (0 meaning "the default", ...).
      kind: how it is evaluated: "global" (one model), "clustered" (cluster
        models and each client's assignment), "personal" (a model per client),
        "fixed" (clusters fixed at init: one-shot) or "fine_tuned" (one global
        model, each client's copy fine-tuned on its training data before it is
        tested: `adapt_steps` local steps of its client training).
      needs: what it needs of an experiment: SERVER_DATA (a datacenter set beside
        the clients), SPLIT_MODEL (a model split into trunk and head),
        FLOAT_TARGETS (targets it can mix: regression, or one-hot labels).
      lr: the setting of its client learning rate, where the experiment declares
        it ("lr" otherwise).
      rounds: the setting of its number of rounds, where declared ("rounds" otherwise).
      sgd: its maths assume plain SGD at a known rate (SCAFFOLD, q-FFL): its
        training is `sgd(lr)` whatever the experiment's optimizer.
      training: optional (ClientTraining, Build) -> ClientTraining: its own training
        from the experiment's (IFCA option I takes one full-batch gradient).
      wrap: optional (Algorithm, Build) -> Algorithm: its combinators.
      personal: kind "personal": the state field holding the per-client models.
      adaptive_weights: its clients' weights change every round without a λ in its
        state (q-FFL): an experiment reporting client weights has none to report.
      straggler_policy: "keep" or "drop": its own rule for stragglers whatever the
        setting `straggler_policy` says (the FedProx paper's FedAvg drops them).
      settings: settings this row trains with whatever the run's say (e.g. its own
        robust rule, `aggregator`: IFCA with the median beside plain IFCA in one
        comparison); `experiments.study` applies them before anything is built.
    """

    algorithm: str | Callable[..., Algorithm]
    help: str
    options: Mapping = dataclasses.field(default_factory=dict)
    reads: Mapping = dataclasses.field(default_factory=dict)
    kind: str = "global"
    needs: frozenset = frozenset()
    lr: str = "lr"
    rounds: str = "rounds"
    sgd: bool = False
    training: Callable | None = None
    wrap: Callable | None = None
    personal: str | None = None
    adaptive_weights: bool = False
    straggler_policy: str | None = None
    settings: Mapping = dataclasses.field(default_factory=dict)

    def replace(self, **changes) -> Method:
        return dataclasses.replace(self, **changes)


def _default_if_zero(keyword: str):
    """A setting whose 0 means "the factory's default" (e.g. server_lr)."""
    return lambda value, b: {} if not value else {keyword: value}


def _none_if_zero(keyword: str):
    return lambda value, b: {keyword: value or None}


def balanced_init(algorithm: Algorithm, b: Build) -> Algorithm:
    """IFCA's find-a-good-initializer rule where the experiment asks for it (init_tries > 1)."""
    if b.s.get("init_tries", 1) <= 1:
        return algorithm
    return with_balanced_init(algorithm, b.model, tries=b.s["init_tries"],
                              min_fraction=b.s["init_min_fraction"],
                              participation=b.s.get("participation", 1.0))


def weight_sharing(algorithm: Algorithm, b: Build) -> Algorithm:
    return balanced_init(with_weight_sharing(algorithm, b.model), b)


def frozen_trunk(algorithm: Algorithm, b: Build) -> Algorithm:
    """The FEMNIST-style run (docs/protocols.md#ifca-femnist): FedAvg pretrains the trunk for
    `pretrain_rounds` rounds (the same local training) from the init key; the trunk is then
    frozen in every cluster with random heads, and for `warm_start_rounds` rounds each head
    trains on a random equal client group."""
    s, model = b.s, b.model
    pre = fedavg(model, b.training, participation=s.get("participation", 1.0))

    def init(key, data):
        k_pre, k_rounds, k_heads = jax.random.split(key, 3)
        state = pre.init(k_pre, data)
        state, _ = simulate.scan_rounds(pre, state, data, k_rounds, 0, s["pretrain_rounds"])
        clustered = with_warm_start(with_frozen_trunk(algorithm, model, state.params[TRUNK]),
                                    s["warm_start_rounds"])
        return clustered.init(k_heads, data)

    return algorithm._replace(init=init)  # the wrappers change init alone


def fedavg_mixup_init(value, b: Build) -> dict:
    """FedAvg + mixup's fixed λ: FedAvg's weights (∝ rows with weighting=examples, else
    uniform; FedTorch's default λ₀ is ∝ rows, so uniform is given explicitly there)."""
    del value
    s = b.s
    if s.get("weighting", "uniform") == "examples":
        return {"lambda_init": "examples"}
    if s.get("official_code"):
        return {"lambda_init": np.full(s["num_clients"], 1.0 / s["num_clients"])}
    return {"lambda_init": "uniform"}


def _option_one(training: ClientTraining, b: Build) -> ClientTraining:
    """IFCA option I: one full-batch gradient per client, stepped by the training optimizer."""
    if b.s.get("option", "model") == "gradient":
        return training.replace(steps=1, batch_size=None)
    return training


def _pretraining(value, b: Build) -> dict:
    """One-shot's local pre-training: `pretrain_steps` full-batch SGD steps at `oneshot_lr`
    (one client's rows alone need a smaller step than a cluster's pooled data)."""
    return {"pretraining": sgd(b.s.get("oneshot_lr", b.s["lr"]), steps=value)}


def _read_by_another(value, b: Build) -> dict:
    """A setting another of the method's reads takes in (declared here as read by it)."""
    return {}


def _mixup(value, b: Build) -> dict:
    return {"mixup": (b.s["mixup_alpha"], b.s["mixup_beta"])}


def _central(value, b: Build) -> dict:
    """Mixed FL's central steps: the client training's optimizer and steps, and the
    datacenter minibatch of `central_batch_size` (0: every row)."""
    return {"central": b.training.replace(batch_size=value or None)}


_K = {"k": "num_clusters"}
_LAMBDA = {"lambda_lr": "lambda_lr"}
_FEDOPT = {"server_lr": _default_if_zero("server_lr")}
_ROBUST = {**_LAMBDA, "lambda_floor": _none_if_zero("lambda_floor"),
           "official_code": "official_code"}
_MIXED = {"w_f": "w_f", "w_c": "w_c", **_FEDOPT,
          "central_batch_size": _central}
_IFCA = {**_K, "option": "option", "divide_by": "divide_by",
         "stable_rounds": _none_if_zero("stable_rounds")}

METHODS: dict[str, Method] = {
    "fedavg": Method("fedavg", "FedAvg (one global model)", reads={"weighting": "weighting"}),
    "fedavgm": Method("fedavgm", "FedAvgM (FedOpt, SGD with server momentum)", reads=_FEDOPT),
    "fedadam": Method("fedadam", "FedAdam (FedOpt)", reads=_FEDOPT),
    "fedyogi": Method("fedyogi", "FedYogi (FedOpt)", reads=_FEDOPT),
    "fedadagrad": Method("fedadagrad", "FedAdagrad (FedOpt)", reads=_FEDOPT),
    "fedavg_drop": Method("fedavg", "FedAvg dropping stragglers (the FedProx paper's FedAvg: "
                          "a straggler's partial work is discarded)",
                          reads={"weighting": "weighting"}, straggler_policy="drop"),
    "fedavg_ft": Method("fedavg", "FedAvg + fine-tuning (each client tested after adapt_steps "
                        "local steps from the global model on its training data)",
                        reads={"weighting": "weighting"}, kind="fine_tuned"),
    "fedprox": Method("fedprox", "FedProx", reads={"prox_mu": "mu"}),
    "fednova": Method("fednova", "FedNova (each client's update normalised by its local "
                      "work τ_i)", reads={"weighting": "weighting"}, sgd=True),
    "scaffold": Method("scaffold", "SCAFFOLD (option II variates)", sgd=True),
    "qffl": Method("qffl", "q-FFL (q-FedAvg)", reads={"q": "q"}, lr="qffl_lr", sgd=True,
                   adaptive_weights=True),
    "afl": Method("afl", "Agnostic FL", reads=_LAMBDA),
    "fedbuff": Method("fedbuff", "FedBuff (buffered asynchronous aggregation; a round is a "
                      "server step)", reads=FEDBUFF_READS, needs=frozenset({VIRTUAL_CLOCK})),
    "fedasync": Method("fedasync", "FedAsync (every arrival mixed in at once; a round is an "
                       "arrival)", reads=FEDASYNC_READS, rounds="fedasync_rounds",
                        needs=frozenset({VIRTUAL_CLOCK})),
    "async_ifca": Method("async_ifca", "asynchronous IFCA (FedBuff's buffered step per "
                         "cluster, each arrival training its lowest-loss cluster model; a "
                         "round is a server step)", reads={**FEDBUFF_READS, **_K},
                         kind="clustered", needs=frozenset({VIRTUAL_CLOCK})),
    "ditto": Method("ditto", "Ditto (personal models)", reads={"ditto_lambda": "ditto_lambda"},
                    kind="personal", personal="personal"),
    "local": Method("local", "local models (each client alone)", kind="personal",
                    personal="params", lr="local_lr"),
    "hypcluster": Method("hypcluster", "HypCluster (k hypotheses, each client trains its "
                         "lowest-loss one)", reads=_K, kind="clustered"),
    "cfl": Method("cfl", "clustered FL (Sattler et al.: recursive bi-partitioning, up to k "
                  "clusters)", reads={"k": "max_clusters", "cfl_eps1": "eps1",
                                      "cfl_eps2": "eps2"}, kind="clustered"),
    "ifca": Method("ifca", "IFCA (option II, model averaging)", options={"option": "model"},
                   reads=_IFCA, kind="clustered", training=_option_one, wrap=balanced_init),
    "ifca_ws": Method("ifca", "IFCA with weight sharing (trunk by FedAvg over every client, "
                      "k heads by IFCA)", options={"option": "model"}, reads=_K,
                      kind="clustered", needs=frozenset({SPLIT_MODEL}), wrap=weight_sharing),
    "ifca_frozen": Method("ifca", "IFCA, frozen pretrained trunk, only the last layer "
                          "clustered (FEMNIST)", options={"option": "model"}, reads=_K,
                          kind="clustered", needs=frozenset({SPLIT_MODEL}), wrap=frozen_trunk),
    "oneshot": Method("oneshot", "one-shot clustering (k-means of local models, then fixed "
                      "clusters)", reads={**_K, "pretrain_steps": _pretraining,
                                          "oneshot_lr": _read_by_another}, kind="fixed"),
    "robust_ifca": Method("robust_ifca", "IFCA with DRFA's per-cluster λ",
                          reads={**_K, **_LAMBDA}, kind="clustered"),
    "drfa": Method("drfa", "DRFA", reads=_ROBUST),
    "drflm": Method("drflm", "DRFLM (DRFA with local mixup)",
                    reads={**_ROBUST, "mixup_alpha": _mixup, "lambda_loss": "lambda_loss"},
                    needs=frozenset({FLOAT_TARGETS})),
    "fedavg_mixup": Method("drflm", "FedAvg + mixup (DRFLM with λ fixed at FedAvg's weights)",
                           options={"lambda_lr": 0.0},
                           reads={"lambda_floor": _none_if_zero("lambda_floor"),
                                  "official_code": "official_code", "mixup_alpha": _mixup,
                                  "lambda_loss": "lambda_loss",
                                  "weighting": fedavg_mixup_init},
                           needs=frozenset({FLOAT_TARGETS})),
    "mixed_parallel": Method("mixed_parallel", "Mixed FL, parallel training (PT)",
                             reads=_MIXED, needs=frozenset({SERVER_DATA})),
    "mixed_gt1": Method("mixed_gt1", "Mixed FL, one-way gradient transfer (1-GT)",
                        reads=_MIXED, needs=frozenset({SERVER_DATA})),
    "mixed_gt2": Method("mixed_gt2", "Mixed FL, two-way gradient transfer (2-GT)",
                        reads={**_MIXED, "combine": "combine", "transfer": "transfer"},
                        needs=frozenset({SERVER_DATA})),
    "oracle": Method("oracle", "the centrally trained oracle (all data pooled on "
                     "the server)", reads=_MIXED, needs=frozenset({SERVER_DATA})),
}


# The settings methods read beyond the experiment's own, declared once: every comparison
# that can train a method declares its settings (with the experiment's default where it
# has one), scoped to the methods that read them (`Setting.methods`).
METHOD_SETTINGS = {st.name: st for st in (
    Setting("k", int, 2, "clustered methods: cluster models", minimum=1, maximum=1000),
    Setting("prox_mu", float, 0.01, "fedprox: proximal μ", minimum=0.0),
    Setting("stable_rounds", int, 0, "ifca: pin a client to its cluster once its assignment "
            "has been stable this many rounds (it then downloads one model, not k: the round "
            "metric downlink_floats); 0: never (the paper's communication reduction is off)",
            minimum=0),
    Setting("q", float, 1.0, "qffl: fairness exponent q (0: FedAvg)", minimum=0.0),
    Setting("ditto_lambda", float, 0.1, "ditto: λ pulling personal models to the global one",
            minimum=0.0),
    Setting("lambda_lr", float, 0.01, "λ ascent step of the robust methods", minimum=0.0),
    Setting("server_lr", float, 0.0, "FedOpt methods: server lr; 0: each server optimizer's "
            "own default", minimum=0.0),
    Setting("cfl_eps1", float, 0.4, "cfl: split a cluster only while its mean client update "
            "norm is below this (ε₁; paper and official code: 0.4)", minimum=0.0),
    Setting("cfl_eps2", float, 1.6, "cfl: ... and its largest client update norm is above "
            "this (ε₂; paper: 1.6)", minimum=0.0),
)}


# Systems heterogeneity (`fedjax_sim.systems`, `ops.work`), declared once: an experiment
# that offers it adds these settings; `build` gives every method the same local work and
# wraps it in the same `with_systems`, so the methods of a comparison see the same clients
# available, dropping out and straggling in every round of a seed.
LOCAL_WORK = ("uniform", "per_client", "per_round")
SYSTEMS_SETTINGS = {st.name: st for st in (
    Setting("local_work", str, "uniform", "how many of its local_steps a client takes: "
            "uniform (all), per_client (τ_i uniform on min_local_steps..local_steps, drawn once "
            "per client: its speed), per_round (drawn afresh every round)", choices=LOCAL_WORK),
    Setting("min_local_steps", int, 1, "the fewest local steps under local_work per_client or "
            "per_round", minimum=0, when=("local_work", ("per_client", "per_round"))),
    Setting("stragglers", float, 0.0, "straggler rate: the fraction of the available cohort "
            "that straggles in every round (K − round(K(1 − rate)) of K slots; under "
            "straggler_draw independent each slot's probability); a straggler does a uniform "
            "1..τ_i − 1 of its τ_i steps", minimum=0.0, maximum=1.0),
    Setting("straggler_draw", str, "fixed", "fixed: exactly that many stragglers per round "
            "(the FedProx code's rule); independent: each slot straggles on its own",
            choices=("fixed", "independent")),
    Setting("straggler_policy", str, "keep", "keep: a straggler's partial update is averaged "
            "(FedProx); drop: it is discarded (fedavg_drop drops whatever this says)",
            choices=("keep", "drop")),
    Setting("availability", float, 1.0, "probability that a client is available in a round; "
            "the cohort is drawn among the available", minimum=0.0, maximum=1.0),
    Setting("availability_period", int, 0, "0: availability is constant; else rounds per "
            "day/night cycle, the clients' time zones spread evenly over it in an order "
            "drawn from the seed (available with probability availability by day, "
            "night_availability by night)", minimum=0),
    Setting("night_availability", float, 0.0, "probability that a client is available at "
            "night (with an availability_period)", minimum=0.0, maximum=1.0),
    Setting("dropout", float, 0.0, "probability that a chosen client fails to report after "
            "training", minimum=0.0, maximum=0.99),
)}


def work_of(s: dict, training: ClientTraining) -> ClientTraining:
    """`training` with the local work the settings ask for (as it is where they do not)."""
    kind = s.get("local_work", "uniform")
    if kind == "uniform":
        return training
    low = s["min_local_steps"]
    if low > training.steps:
        raise ValueError(f"setting min_local_steps={low} exceeds local_steps="
                         f"{training.steps}.")
    return training.replace(work=Work(low=low, per_round=kind == "per_round",
                                      seed=s.get("seed", 0)))


def systems_of_settings(s: dict, method: Method) -> Systems | None:
    """The `Systems` the settings ask for (None: none), with the method's own policy;
    cohort_schedule "cyclic" (set by `privacy.PrivateRule.settings` for DP-FTRL, not a
    setting): the cohort's fixed groups take turns (`Systems.cyclic`)."""
    if not any(k in s for k in ("stragglers", "availability", "dropout", "cohort_schedule")):
        return None
    period = s.get("availability_period", 0)
    if period == 1:
        raise ValueError("setting availability_period must be 0 (constant) or at least 2 "
                         "rounds; got 1.")
    systems = Systems(availability=s.get("availability", 1.0), period=period,
                      night=s.get("night_availability", 0.0), dropout=s.get("dropout", 0.0),
                      stragglers=s.get("stragglers", 0.0),
                      straggler_policy=method.straggler_policy
                      or s.get("straggler_policy", "keep"),
                      straggler_draw=s.get("straggler_draw", "fixed"),
                      zone_seed=s.get("seed", 0),
                      cyclic=s.get("cohort_schedule", "sampled") == "cyclic")
    return None if systems.trivial else systems


def systems_note(s: dict) -> str:
    """The systems settings of a comparison in words ("" when it simulates none)."""
    parts = []
    if s.get("local_work", "uniform") != "uniform":
        when = "once per client" if s["local_work"] == "per_client" else "every round"
        parts.append(f"local work τ_i uniform on {s['min_local_steps']}..{s['local_steps']} "
                     f"steps, drawn {when}")
    if s.get("availability_period", 0):
        parts.append(f"a day/night cycle of {s['availability_period']} rounds: each client "
                     f"available with probability {s['availability']} by day and "
                     f"{s['night_availability']} by night, the cohort drawn among the available")
    elif s.get("availability", 1.0) < 1.0:
        parts.append(f"each client available with probability {s['availability']}, the cohort "
                     "drawn among the available")
    if s.get("dropout", 0.0) > 0.0:
        parts.append(f"a chosen client fails to report with probability {s['dropout']}")
    if s.get("stragglers", 0.0) > 0.0:
        if s.get("straggler_draw", "fixed") == "fixed":
            who = (f"in every round K − round(K(1 − {s['stragglers']})) of the K available "
                   "cohort slots straggle")
        else:
            who = f"a chosen client straggles with probability {s['stragglers']}"
        parts.append(f"{who}, each doing a uniform 1..τ_i − 1 of its τ_i steps (policy "
                     f"{s['straggler_policy']}; fedavg_drop always drops)")
    return "; ".join(parts)


def fits(method: Method, provides: frozenset) -> str | None:
    """None when an experiment providing `provides` can train `method`; else why not."""
    missing = sorted(method.needs - provides)
    if not missing:
        return None
    what = {SERVER_DATA: "server data (a datacenter dataset beside the clients)",
            SPLIT_MODEL: "a model split into a trunk and a head",
            FLOAT_TARGETS: "float targets to mix (regression targets or one-hot labels)",
            VIRTUAL_CLOCK: "a virtual clock (client speeds and availability in time)"}
    return " and ".join(what[m] for m in missing)


def readers(table: Mapping[str, Method]) -> dict[str, tuple[str, ...]]:
    """setting -> the methods of `table` that read it: the settings of their `reads`, and
    a learning-rate or rounds setting of their own (not the shared "lr" and "rounds")."""
    out: dict[str, list[str]] = {}
    for name, method in table.items():
        own = [x for x, shared in ((method.lr, "lr"), (method.rounds, "rounds")) if x != shared]
        for setting in (*method.reads, *own):
            out.setdefault(setting, []).append(name)
    return {k: tuple(v) for k, v in out.items()}


def setting_of(method: Method, which: str, s: dict) -> str:
    """The setting of a method's learning rate ("lr") or rounds ("rounds") in `s`."""
    own = getattr(method, which)
    return own if own in s else which


def build(name: str, table: Mapping[str, Method], model: Model, training: ClientTraining,
          s: dict, problem=None, server_rule: Callable | None = None, **extra) -> Algorithm:
    """Method `name` of `table` (unvmapped), trained by `training`, with the settings `s`.

    `training` is the experiment's client training at the method's own learning rate
    (`setting_of(method, "lr", s)`); problem: what the comparison's methods share, which
    the row's adapters and combinators may read (`Build.problem`); server_rule: algorithm ->
    algorithm, the run's one server aggregation rule (DP, `experiments.privacy`; or a
    robust rule with Byzantine clients, `experiments.robustness`), applied to the
    factory's algorithm before the row's `wrap`; extra: keyword arguments passed to every
    factory that takes them.
    """
    method = table[name]
    training = work_of(s, training)
    b = Build(model, training, s, table, problem)
    if method.training is not None:
        training = method.training(training, b)
        b = b._replace(training=training)
    kwargs: dict[str, Any] = dict(method.options)
    for setting, keyword in method.reads.items():
        if setting not in s:
            continue
        if callable(keyword):
            kwargs.update(keyword(s[setting], b))
        else:
            kwargs[keyword] = s[setting]
    factory = (ALGORITHMS[method.algorithm] if isinstance(method.algorithm, str)
               else method.algorithm)
    if "participation" in s and _takes(factory, "participation"):
        kwargs.setdefault("participation", s["participation"])
    kwargs.update({k: v for k, v in extra.items() if _takes(factory, k)})
    algorithm = factory(model, training, **kwargs)
    if server_rule is not None:
        algorithm = server_rule(algorithm)
    algorithm = method.wrap(algorithm, b) if method.wrap is not None else algorithm
    systems = systems_of_settings(s, method)
    return algorithm if systems is None else with_systems(algorithm, systems)


def _takes(factory, keyword: str) -> bool:
    import inspect

    return keyword in inspect.signature(factory).parameters
