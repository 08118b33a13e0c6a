"""fedjax_sim.accounting against Google's dp-accounting called directly here, and one
published (q, σ, T, δ) → ε pair."""

from __future__ import annotations

import builtins
import doctest
import math
import re

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from fedjax_sim import accounting

REL = dp_accounting.NeighboringRelation


def _direct(event, delta, accountant, relation):
    acc = (pld.PLDAccountant(relation) if accountant == "pld"
           else rdp.RdpAccountant(None, relation))
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_poisson_epsilon_is_dp_accountings(accountant):
    q, sigma, rounds, delta = 0.02, 1.2, 200, 1e-5
    want = _direct(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds),
        delta, accountant, REL.ADD_OR_REMOVE_ONE)
    got = accounting.epsilon(sigma, delta, rounds, q=q, accountant=accountant)
    assert got == pytest.approx(want, rel=1e-12)
    # q from a cohort: s of N clients.
    assert accounting.epsilon(sigma, delta, rounds, num_clients=500, cohort_size=10,
                              accountant=accountant) == pytest.approx(want, rel=1e-12)


def test_without_replacement_epsilon_is_dp_accountings():
    # Replace-one adjacency: swapping one client's clipped update for another's moves
    # the sum by up to 2C, so noise σC is the Gaussian of multiplier σ/2.
    n, s, sigma, rounds, delta = 1000, 20, 1.5, 300, 1e-6
    want = _direct(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SampledWithoutReplacementDpEvent(
            n, s, dp_accounting.GaussianDpEvent(sigma / 2)), rounds),
        delta, "rdp", REL.REPLACE_ONE)
    got = accounting.epsilon(sigma, delta, rounds, sampling="without_replacement",
                             num_clients=n, cohort_size=s, accountant="rdp")
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="accountant='pld' has no fixed-size sampling") as err:
        accounting.epsilon(sigma, delta, rounds, sampling="without_replacement",
                           num_clients=n, cohort_size=s, accountant="pld")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_epsilons_after_each_round_equal_epsilon_at_each(accountant):
    q, sigma, delta, rounds = 0.05, 2.0, 1e-5, [1, 5, 40]
    got = accounting.epsilons(sigma, delta, rounds, q=q, accountant=accountant)
    want = [_direct(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), r),
        delta, accountant, REL.ADD_OR_REMOVE_ONE) for r in rounds]
    assert got == pytest.approx(want, rel=1e-6)
    assert got == sorted(got)


def test_tree_epsilon_is_dp_accountings():
    sigma, steps, epochs, delta = 8.0, 100, 3, 1e-5
    want = _direct(dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, steps), epochs),
        delta, "rdp", REL.REPLACE_SPECIAL)
    assert accounting.tree_epsilon(sigma, delta, steps, epochs) == pytest.approx(want, rel=1e-12)
    # The tree charges a Gaussian of sensitivity sqrt(⌈log₂(T+1)⌉) C per epoch:
    # RDP(α) = α · depth · epochs / (2σ²), converted as dp-accounting converts.
    depth = math.ceil(math.log2(steps + 1))
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512]
    curve = [a * depth * epochs / (2 * sigma**2) for a in orders]
    assert accounting.tree_epsilon(sigma, delta, steps, epochs) == pytest.approx(
        rdp.compute_epsilon(orders, curve, delta)[0], rel=1e-9)


def test_abadi_et_al_moments_accountant_pair():
    # Abadi et al., "Deep Learning with Differential Privacy", CCS 2016, §3.1: with
    # q = 0.01, σ = 4, δ = 1e-5 and T = 10000 steps, "ε ≈ 1.26 using our moments
    # accountant".
    eps = accounting.epsilon(4.0, 1e-5, 10000, q=0.01, accountant="moments")
    assert round(eps, 2) == 1.26
    # The later conversions are tighter on the same event.
    assert accounting.epsilon(4.0, 1e-5, 10000, q=0.01, accountant="rdp") < eps


@pytest.mark.parametrize("accountant, target, q, rounds", [("rdp", 2.0, 0.05, 500),
                                                          ("pld", 1.0, 0.2, 10)])
def test_calibrated_noise_reaches_the_target_within_one_percent(accountant, target, q, rounds):
    delta = 1e-5
    sigma = accounting.calibrate_noise(target, delta, rounds, q=q, accountant=accountant)
    reached = _direct(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), rounds),
        delta, accountant, REL.ADD_OR_REMOVE_ONE)
    assert 0.99 * target <= reached <= target


def test_combined_multiplier_and_the_adaptive_split():
    sigma, sigma_b = 1.2, 4.0
    sigma_delta = accounting.adaptive_noise_multiplier(sigma, sigma_b)
    # The count's multiplier is 2σ_b (sensitivity ½): together they cost σ.
    assert accounting.combined_noise_multiplier(sigma_delta, 2 * sigma_b) == pytest.approx(
        sigma, rel=1e-12)
    assert accounting.combined_noise_multiplier(2.0, 2.0) == pytest.approx(math.sqrt(2.0))


def test_poisson_overflow_probability_is_the_binomial_tail():
    n, q, m = 60, 0.1, 9
    tail = sum(math.comb(n, k) * q**k * (1 - q) ** (n - k) for k in range(m + 1, n + 1))
    assert accounting.poisson_overflow_probability(n, q, m) == pytest.approx(tail, rel=1e-9)


@pytest.mark.parametrize("call, message", [
    (lambda: accounting.epsilon(1.0, 1.0, 10, q=0.1), "delta must be a number in (0, 1)"),
    (lambda: accounting.epsilon(1.0, 0.0, 10, q=0.1), "delta must be a number in (0, 1)"),
    (lambda: accounting.epsilon(1.0, 1e-5, 0, q=0.1), "rounds must be an integer >= 1"),
    (lambda: accounting.epsilon(-1.0, 1e-5, 10, q=0.1), "noise_multiplier must be"),
    (lambda: accounting.epsilon(1.0, 1e-5, 10, q=0.0), "q must be a number in (0, 1]"),
    (lambda: accounting.epsilon(1.0, 1e-5, 10), "sampling='poisson' needs q"),
    (lambda: accounting.epsilon(1.0, 1e-5, 10, sampling="without_replacement", q=0.1),
     "needs num_clients and cohort_size"),
    (lambda: accounting.epsilon(1.0, 1e-5, 10, sampling="without_replacement",
                                num_clients=5, cohort_size=6, accountant="rdp"),
     "cohort_size must be <= num_clients"),
    (lambda: accounting.epsilon(1.0, 1e-5, 10, q=0.1, accountant="prv"),
     "accountant must be one of"),
    (lambda: accounting.calibrate_noise(1e-6, 1e-5, 100, q=0.05, accountant="rdp"),
     "target_epsilon=1e-06 is unreachable"),
    (lambda: accounting.calibrate_noise(0.0, 1e-5, 100, q=0.05), "target_epsilon must be"),
    (lambda: accounting.calibrate_noise(1.0, 1e-5, 100, q=0.05, accountant="moments"),
     "accountant must be one of"),
    (lambda: accounting.tree_epsilon(1.0, 1e-5, 0), "steps_per_epoch must be an integer"),
    (lambda: accounting.epsilons(1.0, 1e-5, [5, 3], q=0.1), "strictly increasing"),
])
def test_bad_inputs_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        call()
    assert "\n" not in str(err.value)


def test_a_missing_dp_accounting_names_the_pip_line(monkeypatch):
    real = builtins.__import__

    def fake(name, *args, **kwargs):
        if name == "dp_accounting" or name.startswith("dp_accounting."):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ValueError, match=re.escape("pip install -e '.[privacy]'")):
        accounting.epsilon(1.0, 1e-5, 10, q=0.1)


def test_module_doctests():
    result = doctest.testmod(accounting, optionflags=doctest.ELLIPSIS, report=False)
    assert result.attempted > 0 and result.failed == 0
