"""Differential privacy as settings of an experiment, declared once (like the systems ones).

An experiment that offers it adds `PRIVACY_SETTINGS`; with `dp_clip > 0` every method it
trains gets `algorithms.with_dp` (user-level DP-FedAvg), and each run reports ε at
`dp_delta` after every evaluated round (the `epsilon` column of metrics.csv; the last one
is the run's final ε in summary.json and a comparison's results). What is accounted:

    sampling  "poisson" (default): each of the m clients takes part independently with
              probability q = participation (`Systems(availability=q)`), in a static
              cohort of s slots whose overflow probability P[Binomial(m, q) > s] ≤ 1e-9
              (`accounting.poisson_overflow_probability`; recorded);
              "fixed": s = round(q·m) clients without replacement (accountant "rdp" only:
              dp-accounting's PLD has no fixed-size event)
    σ         dp_noise, or calibrated before training to reach target_epsilon after the
              run's rounds at dp_delta with the same accountant (`accounting.calibrate_noise`)
    ε         `accounting.epsilons(σ, δ, evaluated rounds, ...)` by dp_accountant
              ("pld" default, "rdp")

With dp_quantile > 0 the clip adapts to that quantile of the update norms (Andrew et al.;
`AdaptiveClipping(dp_quantile)`; dp_clip is then the first round's C). Tuning (a tuned
comparison's grid, choosing on the validation split; `tune_dp_clip` a grid of clips) is not
privatised, as in the papers.

With dp_mechanism = "ftrl" every method gets `algorithms.with_dp_ftrl` instead (DP-FTRL,
Kairouz et al., arXiv:2103.00039): no sampling. The cohort of s = round(participation · m)
slots is not drawn: the m clients form G = m / s fixed groups (m a multiple of s) and
round t trains group t mod G (`Systems(cyclic=True)`), so every client takes part once
per epoch of G rounds; the tree of noise is restarted every epoch (DP-FTRL-TreeRestart),
and ε after round t is dp-accounting's tree aggregation over ⌊t / G⌋ epochs and the
running one (`accounting.tree_epsilons`, RDP under replace-with-zero adjacency;
target_epsilon calibrates σ with the same: `accounting.calibrate_tree_noise`). With
participation 1 every client trains every round: G = 1, a tree per round. dp_sampling,
dp_accountant, dp_quantile and dp_noise_cohort are DP-FedAvg's (refused with ftrl), and
so is availability < 1; a clustered method (one noised sum per cluster) is refused.

With dp_noise_cohort = N > 0 the run takes the peers' shortcut (`with_dp(...,
noise_cohort_size=N)`): the cohort that trains is the participation's, but the sum's noise
is calibrated as if N clients took part (σC · D / N), and the ε reported is the one the
shortcut claims: accounted, and calibrated, at q = N/m (Poisson; "fixed": N of the m
clients). The claim holds only for a run that trained N clients per round; summary.json's
`privacy` record says so ("shortcut": true), with the ε of the run as trained beside it.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np

from fedjax_sim.algorithms import PRIVATE_READY, AdaptiveClipping, with_dp, with_dp_ftrl
from fedjax_sim.algorithms.base import cohort_size
from fedjax_sim.experiments.methods import Setting, setting_of
from fedjax_sim.experiments.tuned import grid_values

SAMPLINGS = ("poisson", "fixed")
MECHANISMS = ("gaussian", "ftrl")
# DP-FTRL noises one server model's prefix sums: not the clustered methods' k sums.
FTRL_READY = PRIVATE_READY - {"ifca", "hypcluster"}
GAUSSIAN_ONLY = ("dp_mechanism", ("gaussian",))
# What sweep cells of one compiled program may differ in (`PrivateGrid`): σ's settings.
TRACED = ("target_epsilon", "dp_noise")
OVERFLOW = 1e-9  # the largest overflow probability a Poisson cohort's slots may have

PRIVACY_SETTINGS = {st.name: st for st in (
    Setting("dp_clip", float, 0.0, "user-level DP (DP-FedAvg): each client's whole update "
            "clipped to this L2 norm, the sum noised; 0: no DP", minimum=0.0),
    Setting("dp_noise", float, 1.0, "the noise multiplier σ (the sum's noise is σ·dp_clip), "
            "unless target_epsilon sets it", minimum=0.0, traced=True),
    Setting("dp_delta", float, 1e-5, "δ of the (ε, δ) reported", minimum=1e-300, maximum=0.5),
    Setting("target_epsilon", float, 0.0, "calibrate σ before training so that ε after the "
            "run's rounds is this (0: use dp_noise)", minimum=0.0, traced=True),
    Setting("dp_mechanism", str, "gaussian", "gaussian: DP-FedAvg (a sampled Gaussian per "
            "round); ftrl: DP-FTRL (Kairouz et al.): no sampling, the clients in m / cohort "
            "fixed groups taking turns (every client once per epoch), tree-aggregated noise "
            "restarted each epoch, ε by dp-accounting's tree aggregation (RDP)",
            choices=MECHANISMS),
    Setting("dp_accountant", str, "pld", "the accountant of ε (Google's dp-accounting): pld "
            "(privacy loss distributions, tightest) or rdp", choices=("pld", "rdp"),
            when=GAUSSIAN_ONLY),
    Setting("dp_sampling", str, "poisson", "poisson: each client takes part with probability "
            "participation (a static cohort capped at an overflow probability of 1e-9); "
            "fixed: a fixed-size cohort without replacement (accountant rdp)",
            choices=SAMPLINGS, when=GAUSSIAN_ONLY),
    Setting("dp_quantile", float, 0.0, "adaptive clipping: the clip follows this quantile of "
            "the update norms (Andrew et al.: 0.5), starting at dp_clip; 0: a fixed clip",
            minimum=0.0, maximum=1.0, when=GAUSSIAN_ONLY),
    Setting("dp_noise_cohort", int, 0, "the peers' shortcut: noise (and ε) calibrated as if "
            "this many clients took part per round while the participation's cohort trains; "
            "the ε reported holds only for a run that trained them; 0: off", minimum=0,
            when=GAUSSIAN_ONLY),
)}


def enabled(s: dict) -> bool:
    """Whether the settings ask for DP: dp_clip > 0, traced (a grid point's clip), or a
    tune_dp_clip grid (`experiments.tuned`)."""
    clip = s.get("dp_clip", 0.0)
    if isinstance(clip, jax.core.Tracer) or grid_values(s.get("tune_dp_clip")):
        return True
    return float(clip or 0.0) > 0.0


def is_ftrl(s: dict) -> bool:
    return s.get("dp_mechanism", "gaussian") == "ftrl"


def check(table, methods, s: dict, num_clients: int | None = None) -> None:
    """ValueError in one line when DP is asked of a method that cannot take it, or with
    settings that do not go together (before anything is written); num_clients: the m
    clients trained on, where known (a dp_noise_cohort is checked against it)."""
    if not enabled(s):
        if s.get("dp_noise_cohort", 0):
            raise ValueError("setting dp_noise_cohort (the noise shortcut) needs DP: set "
                             "dp_clip > 0, or leave dp_noise_cohort at 0.")
        return
    refused = [n for n in methods if not _ready(table[n])]
    if is_ftrl(s):
        return _check_ftrl(table, methods, s, refused, num_clients)
    if refused:
        ready = [n for n, m in table.items() if _ready(m)]
        raise ValueError(
            f"dp_clip > 0: method{'s' if len(refused) > 1 else ''} {', '.join(refused)} "
            "cannot be trained with user-level DP (its server uses more than the clipped sum "
            "of the clients' model changes, e.g. their losses); with DP train "
            f"{', '.join(ready)}.")
    if s.get("dp_sampling", "poisson") == "fixed" and s.get("dp_accountant", "pld") == "pld":
        raise ValueError("dp_sampling=fixed needs dp_accountant=rdp (dp-accounting's pld has "
                         "no fixed-size sampling event).")
    if s.get("dp_sampling", "poisson") == "poisson" and s.get("availability", 1.0) < 1.0:
        raise ValueError("dp_sampling=poisson draws each client with probability "
                         "participation; leave availability at 1 (or use dp_sampling=fixed).")
    if num_clients is not None:
        check_noise_cohort(s, num_clients)
    target = s.get("target_epsilon", 0.0)
    shortcut = s.get("dp_noise_cohort", 0)
    if target > 0 and s.get("dp_sampling", "poisson") == "poisson" and (
            not shortcut or num_clients is not None):
        # Under Poisson sampling ε depends on q, σ, δ and the rounds only: an unreachable
        # target is refused here, before anything is written.
        q = shortcut / num_clients if shortcut else float(s.get("participation", 1.0))
        for name in methods:
            rounds = s[setting_of(table[name], "rounds", s)]
            calibrated_noise(target, s["dp_delta"], rounds,
                             accountant=s.get("dp_accountant", "pld"), sampling="poisson", q=q)
    if s.get("dp_quantile", 0.0) > 0.0 and target == 0.0 \
            and s.get("dp_noise", 1.0) == 0.0:
        raise ValueError("dp_quantile > 0 (adaptive clipping) needs dp_noise > 0 or a "
                         "target_epsilon.")


def _check_ftrl(table, methods, s: dict, refused: list, num_clients: int | None) -> None:
    refused += [n for n in methods if _ready(table[n]) and table[n].algorithm not in FTRL_READY]
    if refused:
        ready = [n for n, m in table.items()
                 if _ready(m) and m.algorithm in FTRL_READY]
        raise ValueError(
            f"dp_mechanism=ftrl: method{'s' if len(refused) > 1 else ''} {', '.join(refused)} "
            "cannot be trained with DP-FTRL (it noises the prefix sums of one server model's "
            f"clipped changes); with dp_mechanism=ftrl train {', '.join(ready)}.")
    if s.get("availability", 1.0) < 1.0 or s.get("availability_period", 0):
        raise ValueError("setting availability: dp_mechanism=ftrl takes no sampling (every "
                         "client once per epoch, in fixed groups); leave availability at 1 "
                         "and availability_period at 0.")
    if num_clients is None:
        return
    slots = cohort_size(num_clients, float(s.get("participation", 1.0)))
    if num_clients % slots:
        raise ValueError(
            f"setting participation={s.get('participation', 1.0):g}: dp_mechanism=ftrl trains "
            f"the m = {num_clients} clients in fixed groups of the cohort ({slots}), taking "
            "turns; m must be a multiple of the cohort: choose participation = 1/G for a "
            f"G dividing {num_clients}.")
    target = s.get("target_epsilon", 0.0)
    if target > 0:
        for name in methods:
            rounds = s[setting_of(table[name], "rounds", s)]
            calibrated_tree_noise(target, s["dp_delta"], num_clients // slots, rounds)


def check_noise_cohort(s: dict, num_clients: int) -> None:
    """ValueError in one line when dp_noise_cohort is neither 0 nor a cohort between the
    expected one (participation · m) and the m clients."""
    noise_cohort = s.get("dp_noise_cohort", 0)
    if not noise_cohort:
        return
    q = float(s.get("participation", 1.0))
    expected = (q * num_clients if s.get("dp_sampling", "poisson") == "poisson"
                else cohort_size(num_clients, q))
    if noise_cohort < expected or noise_cohort > num_clients:
        raise ValueError(
            f"setting dp_noise_cohort={noise_cohort} must be 0 (off) or between the expected "
            f"cohort ({expected:g} = participation {q:g} of m = {num_clients} clients) and m: "
            "the shortcut calibrates noise for a cohort at least as large as the one that "
            "trains.")


@functools.lru_cache(maxsize=64)
def calibrated_noise(target: float, delta: float, rounds: int, **event) -> float:
    """`accounting.calibrate_noise`, remembered (its PLD search takes tens of seconds, and
    a run asks for it when its settings are checked and when it starts)."""
    from fedjax_sim import accounting

    return accounting.calibrate_noise(target, delta, rounds, **event)


@functools.lru_cache(maxsize=64)
def calibrated_tree_noise(target: float, delta: float, groups: int, rounds: int) -> float:
    """`accounting.calibrate_tree_noise`, remembered."""
    from fedjax_sim import accounting

    return accounting.calibrate_tree_noise(target, delta, groups, rounds)


@functools.lru_cache(maxsize=64)
def _tree_epsilons(noise: float, delta: float, groups: int, rounds: tuple) -> list[float]:
    from fedjax_sim import accounting

    return accounting.tree_epsilons(noise, delta, groups, rounds)


@functools.lru_cache(maxsize=64)
def _epsilons(noise: float, delta: float, rounds: tuple, **event) -> list[float]:
    from fedjax_sim import accounting

    return accounting.epsilons(noise, delta, rounds, **event)


def _ready(method) -> bool:
    return isinstance(method.algorithm, str) and method.algorithm in PRIVATE_READY


class PrivateRule:
    """One run's DP: what the round gets and what the accountant charges."""

    def __init__(self, s: dict, num_clients: int, rounds: int):
        from fedjax_sim import accounting

        self.m, self.rounds = num_clients, rounds
        self.clip = s["dp_clip"]  # a float, or traced (a grid point's)
        self.tuned_clips = grid_values(s.get("tune_dp_clip"))
        self.delta = float(s["dp_delta"])
        self.mechanism = s.get("dp_mechanism", "gaussian")
        self.accountant = s["dp_accountant"]
        self.sampling = s["dp_sampling"]
        q = float(s.get("participation", 1.0))
        self.q = q
        self.quantile = float(s.get("dp_quantile", 0.0))
        self.noise_cohort = 0
        target = float(s.get("target_epsilon", 0.0))
        if self.mechanism == "ftrl":
            # Cyclic participation: G fixed groups of the cohort's s slots take turns.
            self.accountant, self.sampling, self.overflow = "rdp", "cyclic", 0.0
            self.slots = cohort_size(num_clients, q)
            self.groups = num_clients // self.slots
            self.event = {"sampling": "cyclic"}
            self.noise = (calibrated_tree_noise(target, self.delta, self.groups, rounds)
                          if target > 0 else float(s["dp_noise"]))
            return
        if self.sampling == "poisson":
            self.slots = poisson_slots(num_clients, q)
            self.event = {"sampling": "poisson", "q": q}
            self.overflow = (accounting.poisson_overflow_probability(num_clients, q, self.slots)
                             if q < 1 else 0.0)
        else:
            self.slots = cohort_size(num_clients, q)
            self.event = {"sampling": "without_replacement", "num_clients": num_clients,
                          "cohort_size": self.slots}
            self.overflow = 0.0
        # The shortcut: the same cohort trains; noise and ε are those of a cohort of N.
        self.noise_cohort = int(s.get("dp_noise_cohort", 0) or 0)
        self.trained_event = self.event
        if self.noise_cohort:
            check_noise_cohort(s, num_clients)
            self.event = ({"sampling": "poisson", "q": self.noise_cohort / num_clients}
                          if self.sampling == "poisson" else
                          {**self.event, "cohort_size": self.noise_cohort})
        if target > 0:
            self.noise = calibrated_noise(target, self.delta, rounds,
                                          accountant=self.accountant, **self.event)
        else:
            self.noise = float(s["dp_noise"])

    def settings(self, s: dict) -> dict:
        """The settings a method is built with: Poisson sampling as availability q over a
        cohort of `slots` (the same for every method of a comparison); DP-FTRL's cyclic
        groups as the cohort schedule (`methods.systems_of_settings`)."""
        if self.mechanism == "ftrl":
            return {**s, "cohort_schedule": "cyclic"}
        if self.sampling != "poisson" or self.q >= 1.0:
            return s
        return {**s, "participation": self.slots / self.m, "availability": self.q}

    def wrap(self, algorithm, noise=None):
        """The algorithm with this run's DP; noise: σ in place of the run's (traced: a
        sweep's grid point, `PrivateGrid`)."""
        noise = self.noise if noise is None else noise
        if self.mechanism == "ftrl":
            return with_dp_ftrl(algorithm, self.clip, noise, rounds=self.groups,
                                expected_clients=float(self.slots), restart=True)
        adaptive = AdaptiveClipping(self.quantile) if self.quantile > 0 else None
        return with_dp(algorithm, self.clip, noise, adaptive=adaptive,
                       expected_clients=self.expected if self.sampling == "poisson" else None,
                       noise_cohort_size=self.noise_cohort or None)

    @property
    def expected(self) -> float:
        """D: the expected cohort that trains (the denominator of the noised mean)."""
        return self.q * self.m if self.sampling == "poisson" else float(self.slots)

    def as_trained(self) -> tuple[float, float]:
        """The shortcut's run as it trained: (the multiplier of its sum's noise over C,
        σ · D / N, and ε at δ after its rounds for its own cohort, by RDP: PLD is slow
        at such small multipliers; inf where the noise is 0)."""
        from fedjax_sim import accounting

        noise = self.noise * self.expected / self.noise_cohort
        if noise == 0:
            return noise, math.inf
        return noise, accounting.epsilon(noise, self.delta, self.rounds, accountant="rdp",
                                         **self.trained_event)

    def epsilons(self, evaluated_rounds) -> dict[int, float]:
        """ε at δ after each evaluated round (0 at round 0)."""
        rounds = sorted({int(r) for r in evaluated_rounds if r > 0})
        if self.mechanism == "ftrl":
            values = _tree_epsilons(self.noise, self.delta, self.groups,
                                    tuple(rounds)) if rounds else []
            return {0: 0.0, **dict(zip(rounds, values, strict=True))}
        values = _epsilons(self.noise, self.delta, tuple(rounds), accountant=self.accountant,
                           **self.event) if rounds else []
        return {0: 0.0, **dict(zip(rounds, values, strict=True))}

    def table(self, every: int):
        """[rounds + 1] float32: ε after round t where t is evaluated (every `every` rounds
        and the last), NaN elsewhere; what the evaluation reads at the state's round. At
        σ = 0, inf at every evaluated round, round 0 included."""
        evaluated = list(range(0, self.rounds + 1, every)) + [self.rounds]
        out = np.full((self.rounds + 1,), np.nan, np.float32)
        if self.noise == 0:
            # No noise, no privacy: ε = ∞ from the start (a column finite at round 0 that
            # turns infinite reads as a divergence: `simulate`'s watcher).
            out[evaluated] = np.inf
            return out
        for r, eps in self.epsilons(evaluated).items():
            out[r] = eps if math.isfinite(eps) else np.inf
        return out

    def record(self) -> dict:
        """What config.json and summary.json say of the mechanism."""
        clip = _float_or_none(self.clip)
        if self.tuned_clips:
            clip = f"tuned per seed on the validation rows over {self.tuned_clips}"
        if self.mechanism == "ftrl":
            return {"mechanism": "DP-FTRL (user level; tree aggregation restarted each "
                    "epoch)", "clip": clip, "noise_multiplier": self.noise,
                    "delta": self.delta, "accountant": "rdp (tree aggregation)",
                    "sampling": "cyclic", "groups": self.groups, "cohort_slots": self.slots,
                    "epoch_rounds": self.groups, "shortcut": False}
        record = {"mechanism": "DP-FedAvg (user level)", "clip": clip,
                  "adaptive_quantile": self.quantile or None, "noise_multiplier": self.noise,
                  "delta": self.delta, "accountant": self.accountant, "q": self.q,
                  "sampling": self.event["sampling"], "cohort_slots": self.slots,
                  "expected_clients": self.q * self.m, "poisson_overflow": self.overflow,
                  "shortcut": bool(self.noise_cohort)}
        if self.noise_cohort:
            noise, epsilon = self.as_trained()
            claimed_q = (self.noise_cohort / self.m if self.sampling == "poisson"
                         else f"{self.noise_cohort} of {self.m} without replacement")
            record.update(
                noise_cohort_size=self.noise_cohort, claimed_q=claimed_q,
                claim=f"epsilon (and noise_multiplier) are the shortcut's claim, accounted "
                      f"as if {self.noise_cohort} clients took part per round: it holds only "
                      f"for a run that trained {self.noise_cohort} clients per round, not "
                      f"for this run, which trained {self.expected:g} (expected) with its "
                      f"sum noised at {noise:.4g}·C",
                trained_noise_multiplier=noise,
                epsilon_as_trained=epsilon if math.isfinite(epsilon) else None,
                epsilon_as_trained_accountant="rdp")
        return record


class PrivateGrid:
    """The DP of sweep cells that differ only in target_epsilon and dp_noise, as the
    traced σ of one program (`grid_trials`): one point per distinct σ of the cells, each
    calibrated on the host as the cell's own run calibrates it (`PrivateRule`), then
    passed as data; every point gets the seeds' data, initial weights and round keys, so
    a cell's trials are those of the cell trained alone up to float rounding. Each cell's
    ε is its own rule's, after the run's rounds.

    Attributes:
      points: {"dp_noise": [G] σ} (`algorithms.with_grid`'s points).
      cell_points: each cell's point, in the order of the cells.
    """

    def __init__(self, cells: list[dict], num_clients: int, rounds: int):
        self.rules = [PrivateRule(c, num_clients, rounds) for c in cells]
        unique = list(dict.fromkeys(r.noise for r in self.rules))
        self.cell_points = [unique.index(r.noise) for r in self.rules]
        self.points = {"dp_noise": unique}

    def __len__(self) -> int:
        return len(self.points["dp_noise"])

    def settings(self, s: dict) -> dict:
        """What the method is built with (`PrivateRule.settings`, the same for each cell)."""
        return self.rules[0].settings(s)

    def wrap_at(self, point: dict):
        """The server rule's wrap at a point of `points` (σ may be traced)."""
        return functools.partial(self.rules[0].wrap, noise=point["dp_noise"])

    def final_epsilons(self, every: int) -> list[float]:
        """Each cell's ε after the run's last round, as its run's evaluation reads it
        (float32, evaluated every `every` rounds)."""
        return [float(rule.table(every)[-1]) for rule in self.rules]


def one_program(cells: list[dict]) -> bool:
    """Whether sweep cells train as one program (`PrivateGrid`): several, with DP, differing
    only in `TRACED`."""
    apart = {k for c in cells for k in c if c.get(k) != cells[0].get(k)} - {"cell_id"}
    return len(cells) > 1 and apart <= set(TRACED) and enabled(cells[0])


def grid_trials(e, cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
    """trials.csv rows (each with its cell's "cell_id") of every (cell, seed) of cells that
    differ only in target_epsilon and dp_noise, trained as one program: `study.grid_run`
    over a `PrivateGrid`'s σ, or with a tune_* grid `tuned.tuned_run` over σ × the grid's
    points (each cell's point chosen per seed among its σ's, as its own run chooses)."""
    from fedjax_sim import compare as executor
    from fedjax_sim.experiments import study, tuned
    from fedjax_sim.experiments.base import RunContext

    s = {k: v for k, v in cells[0].items() if k != "cell_id"}
    name = s[e.method_key]
    execution = RunContext(mesh=mesh, progress=False).execution(s)
    problem = study.problem_for(e, s)
    if not isinstance(problem, tuned.Tuned):
        footprint = None if e.footprint is None else e.footprint(name, s, problem)
        problem = execution.planned(problem, footprint)
    trained = problem.fit if isinstance(problem, tuned.Tuned) else problem
    m = study.num_clients(trained)
    own = e.method_table[name].settings
    ruled = [{**c, **own} for c in cells]
    if e.derived is not None:
        ruled = [e.derived(c, trained) for c in ruled]
    for cell in ruled:
        check(e.method_table, (name,), cell, m)
    rounds = study.method_rounds(e, name, ruled[0])
    grid = PrivateGrid(ruled, m, rounds)
    if isinstance(problem, tuned.Tuned):
        # A tune_* grid too: the program's points are σ × the grid's, chosen per σ.
        def run_at(name_, point_s, part):  # σ and a tuned clip may be traced
            rule = PrivateRule({**point_s, **own, "target_epsilon": 0.0, "dp_noise": 0.0},
                               m, rounds)
            return study.method_run(e, name_, rule.settings(point_s), part,
                                    wrap=functools.partial(rule.wrap,
                                                           noise=point_s["dp_noise"]))

        spec = tuned.tuned_run(e, name, s, problem, run_at, outer=grid.points)
    else:
        spec = study.grid_run(e, name, grid.settings(s), problem, grid.points, grid.wrap_at)
    seeds = s["seeds"]
    result = executor.train_method(name, spec, len(grid) * seeds, execution)
    metrics = [x for x in study.table(e, s) if x in result.per_seed and x != "epsilon"]
    epsilons = grid.final_epsilons(spec.eval_every)
    return [{"cell_id": cell["cell_id"], "data_seed": i, "method": name,
             **{x: float(result.per_seed[x][point * seeds + i]) for x in metrics},
             "epsilon": epsilon}
            for cell, point, epsilon in zip(cells, grid.cell_points, epsilons, strict=True)
            for i in seed_ids]


def grouped(e, sweep):
    """`sweep` (a comparison's, `study.sweep_of`) with its cells that differ only in
    target_epsilon and dp_noise trained as one program (`grid_trials`); others cell by
    cell, as before."""
    import dataclasses

    if "dp_noise" not in e.declared:
        return sweep

    def group_trials(cells: list[dict], seed_ids: list[int], mesh=None) -> list[dict]:
        if not one_program(cells):
            return [{"cell_id": c["cell_id"], **row}
                    for c in cells for row in sweep.trials(c, seed_ids, mesh)]
        return grid_trials(e, cells, seed_ids, mesh)

    def trials_per_program(cells: list[dict]) -> int:
        if not one_program(cells):
            return sweep.program_size(cells)
        # A point per distinct σ: each target's calibration, or dp_noise where there is none.
        sigmas = {("target", c["target_epsilon"]) if c["target_epsilon"] > 0
                  else ("noise", c["dp_noise"]) for c in cells}
        return len(sigmas) * cells[0]["seeds"]

    return dataclasses.replace(sweep, group=True, group_trials=group_trials,
                               trials_per_program=trials_per_program)


def _float_or_none(value) -> float | None:
    """A concrete setting as a float; None where it is traced (a grid's point)."""
    return None if isinstance(value, jax.core.Tracer) else float(value)


def poisson_slots(num_clients: int, q: float) -> int:
    """The fewest slots s ≥ q·m with P[Binomial(m, q) > s] ≤ OVERFLOW."""
    from fedjax_sim import accounting

    if q >= 1.0:
        return num_clients
    slots = max(1, math.ceil(q * num_clients))
    step = max(1, int(math.sqrt(q * num_clients)))
    while slots < num_clients and accounting.poisson_overflow_probability(
            num_clients, q, slots) > OVERFLOW:
        slots = min(num_clients, slots + step)
    return slots
