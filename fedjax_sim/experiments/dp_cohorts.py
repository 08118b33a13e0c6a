"""User-level DP at real cohort sizes, beside the peers' noise shortcut (`dp-cohorts-synthetic`).

The question (issue 42; McMahan et al., ICLR 2018, arXiv:1710.06963, §3): at a fixed
(ε, δ), how does the model improve as the cohort that trains grows, and how far from it
are the numbers of the shortcut that trains a small cohort with noise calibrated for a
large one (pfl-research's `noise_cohort_size`)? On generated clients of the linear
mixture, none of them stored:

    data      m clients (10⁶), k clusters of equal size, client i's n rows drawn from
              fold_in(key, i) when a cohort needs them: x ~ N(0, I_d), y = xᵀθ*_c + N(0, σ²)
              (`data.generated_mixture`); the test: test_clients clients spread evenly
              over the population (every (m / test_clients)-th), n_test held-out rows each
    each round t (`study.method_run`: the method of the table with `privacy.PrivateRule.wrap`)
        every client takes part with probability q = participation (Poisson, a static
        cohort of slots); each trains local_steps full-batch SGD steps from θ
        θ ← θ + (Σ clipped changes + N(0, σ²C²)) / (q·m)             (DP-FedAvg)
        σ calibrated before training so that ε after `rounds` rounds is target_epsilon
        at dp_delta (PLD accountant); with dp_noise_cohort = N the sum's noise is
        σC · q·m / N and σ is calibrated at q = N/m: the shortcut (`experiments.privacy`)
    evaluated every eval_every rounds, per seed (seeds share the population):
        test_loss     mean squared error over the test clients' rows
        mean_dist     ‖θ − θ̄‖, θ̄ = the mean of the k θ*: the minimiser of the population
                      loss (x isotropic, clusters of equal size), where FedAvg heads
        min_dist      min_j ‖θ − θ*_j‖ (IFCA's metric; ≥ half the clusters' spread here)
        epsilon       ε at δ after the round: the real cohort's, or the shortcut's claim
        epsilon_as_trained  ε of the mechanism the run actually ran (the shortcut's own
                      cohort at its smaller noise, by RDP); = epsilon without the shortcut

What is private is the server's model; the evaluation on the test clients is the
simulator's instrument (it reads their held-out rows, not a released statistic).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import check_mixture_settings, generated_mixture
from fedjax_sim.experiments import privacy
from fedjax_sim.experiments.base import DATA, Experiment, Preset, Trained, client_mean, stream_key
from fedjax_sim.experiments.methods import FLOAT_TARGETS, METHODS, fits
from fedjax_sim.experiments.settings import (
    Setting,
    count,
    eval_every_setting,
    local_steps_setting,
    lr_setting,
    method_setting,
    participation_setting,
    rounds_setting,
    seed_setting,
    seeds_setting,
)
from fedjax_sim.models import linear_regression

PROVIDES = frozenset({FLOAT_TARGETS})
# The methods with one global model (the metrics read its parameters); under DP only those
# whose server averages the clients' changes (`privacy.check` refuses the others).
TABLE = {name: m for name, m in METHODS.items()
         if m.kind == "global" and fits(m, PROVIDES) is None}
# This experiment's defaults of the DP settings: on, ε = 3 at δ = 1e-6 = 1/m.
DP_DEFAULTS = {"dp_clip": 0.5, "target_epsilon": 3.0, "dp_delta": 1e-6}


def test_ids(s: dict) -> np.ndarray:
    """[test_clients] the test clients: every (m / test_clients)-th, so every cluster."""
    return (np.arange(s["test_clients"], dtype=np.int64) * s["m"] // s["test_clients"]
            ).astype(np.int32)


def problem(s: dict) -> dict:
    """The population (generated: nothing per client stored), its test clients, θ*, the
    model; one population for every seed (copies 0: the seeds differ in init and rounds)."""
    p = generated_mixture(stream_key(s["seed"], DATA), k=s["k"], m=s["m"], n=s["n"],
                          d=s["d"], sigma=s["sigma"], R=s["R"], n_test=s["n_test"])
    return {"train": p.train, "test": p.test.subset(jnp.asarray(test_ids(s))),
            "theta_star": p.theta_star, "model": linear_regression(s["d"]), "copies": 0}


def _as_trained_table(t: Trained, every: int):
    """[rounds + 1] float32: ε of the run as trained after each evaluated round (NaN
    elsewhere): the shortcut's own cohort at its noise, or the plan's ε; None without DP."""
    if not privacy.enabled(t.s):
        return None
    plan = privacy.PrivateRule(t.s, t.problem["train"].num_clients, t.rounds)
    if not plan.noise_cohort:
        return plan.table(every)
    from fedjax_sim import accounting

    noise, _ = plan.as_trained()
    evaluated = sorted({*range(every, t.rounds + 1, every), t.rounds})
    out = np.full((t.rounds + 1,), np.nan, np.float32)
    out[0] = 0.0
    values = (accounting.epsilons(noise, plan.delta, evaluated, accountant="rdp",
                                  **plan.trained_event) if noise > 0
              else [np.inf] * len(evaluated))
    out[evaluated] = values
    return out


def metrics(t: Trained):
    """state -> test_loss, mean_dist, min_dist (and epsilon_as_trained under DP), [seeds]."""
    test, theta_star = t.problem["test"], t.problem["theta_star"]
    center = jnp.mean(theta_star, axis=0)

    @jax.jit
    def measure(state):
        out = t.algorithm.evaluate(state, test)  # client_loss [seeds, test_clients]
        theta = state.params  # [seeds, d]
        dist = jnp.linalg.norm(theta[:, None, :] - theta_star[None], axis=-1)  # [seeds, k]
        return (out["client_loss"], out["client_weight"],
                jnp.linalg.norm(theta - center, axis=-1), jnp.min(dist, axis=-1))

    table = _as_trained_table(t, t.s["eval_every"])

    def evaluate(state):
        loss, weight, mean_dist, min_dist = measure(state)
        row = {"test_loss": client_mean(loss, weight), "mean_dist": np.asarray(mean_dist),
               "min_dist": np.asarray(min_dist)}
        if table is not None:
            row["epsilon_as_trained"] = table[np.asarray(state.round)]
        return row

    return evaluate


def table(s: dict) -> list[str]:
    out = ["test_loss", "mean_dist", "min_dist"]
    return out + (["epsilon", "epsilon_as_trained"] if privacy.enabled(s) else [])


def validate(s: dict, command: str = "run") -> None:
    """The mixture's sizes, the test clients, and DP's settings with m known (a
    dp_noise_cohort below the expected cohort, an unreachable target): before anything
    is written."""
    check_mixture_settings(s["k"], s["m"], s["n"], s["d"], s["sigma"], s["R"],
                           n_test=s["n_test"])
    if s["test_clients"] > s["m"]:
        raise ValueError(f"setting test_clients={s['test_clients']} exceeds m={s['m']}.")
    methods = s["methods"] if command == "compare" else [s["method"]]
    privacy.check(TABLE, tuple(methods), s, s["m"])


def notes(s: dict, problem, results: dict) -> dict:
    q, m = s["participation"], s["m"]
    notes = {
        "data": f"{m} generated clients (none stored) of the linear mixture: k={s['k']} "
                f"equal clusters, d={s['d']}, n={s['n']} rows each, σ={s['sigma']}, "
                f"R={s['R']}; tested on {s['test_clients']} clients spread over the "
                f"population, n_test={s['n_test']} held-out rows each",
        "training": f"{', '.join(results)}: {s['local_steps']} full-batch SGD steps at lr "
                    f"{s['lr']} per round, {s['rounds']} rounds, expected cohort {q * m:g} "
                    f"(participation {q:g}), {s['seeds']} seeds sharing the population",
    }
    if privacy.enabled(s):
        plan = privacy.PrivateRule(s, m, s["rounds"])
        record = plan.record()
        notes["privacy"] = (f"DP-FedAvg, clip {s['dp_clip']}, σ = {plan.noise:.4g}, "
                            f"δ = {s['dp_delta']:g}, {s['dp_accountant']}")
        if plan.noise_cohort:
            notes["shortcut"] = record["claim"]
    return notes


def _settings() -> tuple[Setting, ...]:
    dp = tuple(dataclasses.replace(st, default=DP_DEFAULTS.get(st.name, st.default))
               for st in privacy.PRIVACY_SETTINGS.values())
    return (
        count("m", 1_000_000, "clients in the population (generated: none stored)",
              maximum=2**31 - 1),
        count("k", 2, "clusters of the mixture (equal sizes; θ*_j ∈ R·{0,1}^d)",
              maximum=1024),
        count("n", 10, "training rows per client", maximum=10**6),
        count("n_test", 10, "held-out rows per test client", maximum=10**6),
        count("d", 10, "features", maximum=10**6),
        Setting("sigma", float, 0.5, "label noise standard deviation", minimum=0.0),
        Setting("R", float, 1.0, "scale of θ*: θ*_j ∈ R·{0,1}^d", minimum=0.0),
        count("test_clients", 1000, "clients tested (every m/test_clients-th)",
              maximum=10**6),
        lr_setting(0.05, "client learning rate (full-batch SGD)"),
        local_steps_setting(5),
        participation_setting(1e-3, "each client's probability of taking part in a round "
                              "(Poisson under DP): the expected cohort is participation·m"),
        *dp,
        rounds_setting(50),
        seeds_setting(2, "seeds (init and rounds; the population is shared), one vmapped "
                      "axis"),
        seed_setting(),
        eval_every_setting(10),
        method_setting(tuple(TABLE), "fedavg"),
    )


EXPERIMENT = Experiment(
    name="dp_cohorts",
    description="User-level DP (DP-FedAvg) at a fixed ε as the cohort grows, on 10⁶ "
                "generated clients, beside the noise shortcut",
    settings=_settings(),
    problem=problem,
    metrics=metrics,
    methods=("fedavg",),
    baseline="fedavg",
    table=table,
    notes=notes,
    validate=validate,
    panels=(("test_loss", "test loss (avg client)"), ("mean_dist", "‖θ − θ̄‖")),
    log_metrics=("mean_dist",),
    provides=PROVIDES,
    kinds=("global",),
)

PRESETS = [
    Preset("dp-cohorts-synthetic", EXPERIMENT,
           "DP-FedAvg at ε = 3, δ = 1e-6 on 10⁶ generated linear-mixture clients: expected "
           "cohorts of 100, 1,000 and 10,000 (participation 1e-4 … 1e-2), each trained "
           "with its own calibrated noise (dp_noise_cohort=0) and with the shortcut's noise "
           "for 10,000 (dp_noise_cohort=10000); a sweep.",
           {"participation": [1e-4, 1e-3, 1e-2], "dp_noise_cohort": [0, 10_000]}),
]
