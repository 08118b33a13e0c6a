"""ε of a DP federated training run, by Google's dp-accounting (host-side).

The mechanisms are `fedjax_sim.ops.privacy`'s: every round adds N(0, σ²C²) to a
sum of client updates clipped to L2 norm C, so a round is a Gaussian mechanism
of noise multiplier σ on a sampled cohort, and a run is `rounds` of them
composed. How the cohort is drawn decides the event and the adjacency:

- `"poisson"`: each of the N clients takes part independently with probability
  q. A round is `PoissonSampledDpEvent(q, GaussianDpEvent(σ))`, under add-or-remove
  adjacency (one client's clipped update moves the sum by at most C). Accountants:
  `"pld"`, `"rdp"`, `"moments"`.
- `"without_replacement"`: a fixed-size cohort of s of the N clients. A round is
  `SampledWithoutReplacementDpEvent(N, s, GaussianDpEvent(σ / 2))`, under
  replace-one adjacency: replacing one client's update by another's moves the sum
  by at most 2C, so noise σC is a Gaussian of multiplier σ / 2. Accountants:
  `"rdp"`, `"moments"` (dp-accounting's PLD has no such event).
- DP-FTRL's tree (`tree_epsilon`): every client at most once per epoch, the tree
  restarted each epoch: `SingleEpochTreeAggregationDpEvent(σ, steps)` composed
  over the epochs, under replace-with-zero adjacency (Kairouz et al., Def. 1.1),
  by RDP.

The accountants: `"pld"` (privacy loss distributions, dp-accounting's
`PLDAccountant`: the tightest), `"rdp"` (Rényi DP at dp-accounting's default
orders, converted to (ε, δ) with Canonne, Kamath and Steinke's bound,
arXiv:2004.00010, Prop. 12), and `"moments"` (Abadi et al.'s moments
accountant, Deep Learning with Differential Privacy, CCS 2016,
arXiv:1607.00133: the same RDP at the integer orders α = λ + 1, λ = 1 … 32,
with their tail bound, ε = min_α RDP(α) + log(1/δ)/(α − 1); looser, and what
papers of its time report).

Adaptive clipping (Andrew et al.) costs one Gaussian of its total multiplier
σ; the update sum is noised with `adaptive_noise_multiplier(σ, σ_b)`. A round
that also noises its denominator count (sensitivity 1, noise σ_n) costs one
Gaussian of `combined_noise_multiplier(σ_Δ, σ_n)`.

dp-accounting is the optional extra `privacy` (`pip install -e '.[privacy]'` in a
checkout, or `pip install dp-accounting`), imported when a function here first needs it. Every
function checks its inputs first and refuses a bad one in one line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fedjax_sim.extras import require
from fedjax_sim.ops.privacy import adaptive_noise_multiplier

SAMPLINGS = ("poisson", "without_replacement")
ACCOUNTANTS = ("pld", "rdp", "moments")
#: The moments accountant's orders: α = λ + 1 for Abadi et al.'s λ = 1 … 32.
MOMENTS_ORDERS = tuple(range(2, 34))

__all__ = [
    "ACCOUNTANTS",
    "MOMENTS_ORDERS",
    "SAMPLINGS",
    "adaptive_noise_multiplier",
    "calibrate_noise",
    "calibrate_tree_noise",
    "combined_noise_multiplier",
    "dp_event",
    "epsilon",
    "epsilons",
    "poisson_overflow_probability",
    "tree_epsilon",
    "tree_epsilons",
    "tree_event",
]


def _dp():
    require("dp_accounting", "privacy", "privacy accounting")
    import dp_accounting

    return dp_accounting


# ----------------------------------------------------------------------------------- checks


def _check_delta(delta) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ValueError(f"delta must be a number in (0, 1), e.g. 1e-5; got {delta!r}.")
    return float(delta)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1; got {value!r}.")
    return value


def _check_noise(noise_multiplier) -> float:
    if (isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, (int, float))
            or not math.isfinite(noise_multiplier) or noise_multiplier < 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0; got "
                         f"{noise_multiplier!r}.")
    return float(noise_multiplier)


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {value!r}.")


def _sampling_rate(sampling, q, num_clients, cohort_size) -> tuple:
    """(q, N, s) checked for the sampling model."""
    _check_choice("sampling", sampling, SAMPLINGS)
    if sampling == "poisson":
        if q is None:
            if num_clients is None or cohort_size is None:
                raise ValueError("sampling='poisson' needs q (each client's probability per "
                                 "round) or num_clients and cohort_size (q = s / N).")
            q = _check_count("cohort_size", cohort_size) / _check_count("num_clients",
                                                                        num_clients)
        if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
            raise ValueError(f"q must be a number in (0, 1]; got {q!r}.")
        return float(q), num_clients, cohort_size
    if num_clients is None or cohort_size is None or q is not None:
        raise ValueError("sampling='without_replacement' needs num_clients and cohort_size "
                         "(a fixed-size cohort of s of the N clients), not q.")
    n, s = _check_count("num_clients", num_clients), _check_count("cohort_size", cohort_size)
    if s > n:
        raise ValueError(f"cohort_size must be <= num_clients; got {s} of {n}.")
    return s / n, n, s


def _relation(dp, sampling: str):
    rel = dp.NeighboringRelation
    return rel.ADD_OR_REMOVE_ONE if sampling == "poisson" else rel.REPLACE_ONE


# ----------------------------------------------------------------------------------- events


def _round_event(dp, noise_multiplier: float, sampling, q, n, s):
    if sampling == "poisson":
        return dp.PoissonSampledDpEvent(q, dp.GaussianDpEvent(noise_multiplier))
    # Replace-one adjacency: the clipped sum moves by up to 2C, so σC of noise is a
    # Gaussian of multiplier σ / 2 relative to the sensitivity.
    return dp.SampledWithoutReplacementDpEvent(n, s, dp.GaussianDpEvent(noise_multiplier / 2))


def dp_event(noise_multiplier: float, rounds: int, *, sampling: str = "poisson", q=None,
             num_clients=None, cohort_size=None):
    """The dp-accounting event of `rounds` rounds of the sampled Gaussian (module table).

    Args:
      noise_multiplier: σ ≥ 0: each round's sum gets N(0, σ²C²) (the total σ under
        adaptive clipping).
      rounds: T ≥ 1.
      sampling: "poisson" (q, or num_clients and cohort_size for q = s / N) or
        "without_replacement" (num_clients N and cohort_size s).

    Returns:
      dp_accounting.SelfComposedDpEvent(round event, T).
    """
    sigma = _check_noise(noise_multiplier)
    rounds = _check_count("rounds", rounds)
    q, n, s = _sampling_rate(sampling, q, num_clients, cohort_size)
    dp = _dp()
    return dp.SelfComposedDpEvent(_round_event(dp, sigma, sampling, q, n, s), rounds)


def _accountant(dp, accountant: str, sampling: str, orders=None):
    relation = _relation(dp, sampling)
    if accountant == "pld":
        if sampling != "poisson":
            raise ValueError("accountant='pld' has no fixed-size sampling event in "
                             "dp-accounting; use accountant='rdp' for "
                             "sampling='without_replacement'.")
        return dp.pld.PLDAccountant(relation)
    return dp.rdp.RdpAccountant(orders, relation)


def _moments_epsilon(dp, event, delta: float, sampling: str) -> float:
    """min over α of RDP(α) + log(1/δ)/(α − 1), from dp-accounting's RDP at each order.

    dp-accounting converts RDP(α) with Prop. 12 of arXiv:2004.00010,
    ε = RDP(α) + log(1 − 1/α) − log(δ'α)/(α − 1); at δ' = δ (1 − 1/α)^(α−1) / α this
    is exactly the tail bound RDP(α) + log(1/δ)/(α − 1) (when positive).
    """
    best = math.inf
    for alpha in MOMENTS_ORDERS:
        acc = _accountant(dp, "rdp", sampling, [alpha])
        acc.compose(event)
        shifted = delta * (1 - 1 / alpha) ** (alpha - 1) / alpha
        eps = acc.get_epsilon(shifted)
        # dp-accounting answers 0 when RDP(α) is below δ'² (its KL bound): RDP ≈ 0.
        best = min(best, eps if eps > 0 else math.log(1 / delta) / (alpha - 1))
    return best


def _epsilon_of(dp, event, delta, sampling, accountant) -> float:
    if accountant == "moments":
        return _moments_epsilon(dp, event, delta, sampling)
    acc = _accountant(dp, accountant, sampling)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def epsilon(noise_multiplier: float, delta: float, rounds: int, *, sampling: str = "poisson",
            q=None, num_clients=None, cohort_size=None, accountant: str = "pld") -> float:
    """ε at δ after `rounds` rounds of the sampled Gaussian (`dp_event`).

    Args:
      noise_multiplier, rounds, sampling, q, num_clients, cohort_size: as in `dp_event`.
      delta: δ in (0, 1).
      accountant: "pld" (default), "rdp" or "moments" (module docstring).

    Returns:
      ε (inf for σ = 0).

    Examples:
      >>> from fedjax_sim.accounting import epsilon
      >>> round(epsilon(1.1, 1e-5, 1000, q=0.01, accountant="rdp"), 2)
      1.71
    """
    delta = _check_delta(delta)
    _check_choice("accountant", accountant, ACCOUNTANTS)
    event = dp_event(noise_multiplier, rounds, sampling=sampling, q=q,
                     num_clients=num_clients, cohort_size=cohort_size)
    dp = _dp()
    if accountant == "pld":
        _accountant(dp, accountant, sampling)  # refuses a sampling PLD cannot account
    if noise_multiplier == 0:
        return math.inf
    return _epsilon_of(dp, event, delta, sampling, accountant)


def epsilons(noise_multiplier: float, delta: float, rounds: Sequence[int], *,
             sampling: str = "poisson", q=None, num_clients=None, cohort_size=None,
             accountant: str = "pld") -> list[float]:
    """ε at δ after each of `rounds` (increasing), composed once, round by round.

    What a run reports after every evaluated round; the same numbers as `epsilon`
    called for each entry.
    """
    delta = _check_delta(delta)
    _check_choice("accountant", accountant, ACCOUNTANTS)
    rounds = [_check_count("rounds", r) for r in rounds]
    if any(b <= a for a, b in zip(rounds, rounds[1:], strict=False)):
        raise ValueError(f"rounds must be strictly increasing; got {rounds!r}.")
    if not rounds:
        return []
    one = dp_event(noise_multiplier, 1, sampling=sampling, q=q, num_clients=num_clients,
                   cohort_size=cohort_size).event
    dp = _dp()
    if accountant == "moments":
        return [_epsilon_of(dp, dp.SelfComposedDpEvent(one, r), delta, sampling, accountant)
                for r in rounds]
    acc = _accountant(dp, accountant, sampling)
    if noise_multiplier == 0:
        return [math.inf] * len(rounds)
    out, done = [], 0
    for r in rounds:
        acc.compose(one, r - done)
        done = r
        out.append(float(acc.get_epsilon(delta)))
    return out


def tree_epsilon(noise_multiplier: float, delta: float, steps_per_epoch: int,
                 epochs: int = 1) -> float:
    """ε at δ of DP-FTRL's tree aggregation (Kairouz et al., arXiv:2103.00039, App. D).

    Every client contributes at most once per epoch of `steps_per_epoch` rounds
    (cyclic participation: the clients split into that many groups; one round with
    everyone is an epoch of 1), and the tree restarts each epoch:
    `SelfComposedDpEvent(SingleEpochTreeAggregationDpEvent(σ, steps), epochs)`,
    accounted by RDP under replace-with-zero adjacency. Each node's noise is σC.

    Args:
      noise_multiplier: σ ≥ 0, each node's noise over the sensitivity C.
      delta: δ in (0, 1).
      steps_per_epoch: rounds per tree (≥ 1).
      epochs: trees (≥ 1).
    """
    sigma = _check_noise(noise_multiplier)
    delta = _check_delta(delta)
    steps = _check_count("steps_per_epoch", steps_per_epoch)
    epochs = _check_count("epochs", epochs)
    if sigma == 0:
        return math.inf
    dp = _dp()
    acc = dp.rdp.RdpAccountant(None, dp.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(dp.SelfComposedDpEvent(dp.SingleEpochTreeAggregationDpEvent(sigma, steps),
                                       epochs))
    return float(acc.get_epsilon(delta))


def tree_event(noise_multiplier: float, steps_per_epoch: int, rounds: int):
    """The dp-accounting event of `rounds` rounds of DP-FTRL with the tree restarted every
    `steps_per_epoch` rounds (cyclic participation: every client once per epoch): the
    ⌊rounds / G⌋ whole epochs' `SingleEpochTreeAggregationDpEvent(σ, G)` composed, then
    the running epoch's tree of rounds mod G steps, where there is one."""
    sigma = _check_noise(noise_multiplier)
    steps = _check_count("steps_per_epoch", steps_per_epoch)
    rounds = _check_count("rounds", rounds)
    dp = _dp()
    epochs, rest = divmod(rounds, steps)
    events = []
    if epochs:
        events.append(dp.SelfComposedDpEvent(
            dp.SingleEpochTreeAggregationDpEvent(sigma, steps), epochs))
    if rest:
        events.append(dp.SingleEpochTreeAggregationDpEvent(sigma, rest))
    return dp.ComposedDpEvent(events)


def tree_epsilons(noise_multiplier: float, delta: float, steps_per_epoch: int,
                  rounds: Sequence[int]) -> list[float]:
    """ε at δ of DP-FTRL after each of `rounds` (increasing; `tree_event`), by RDP under
    replace-with-zero adjacency; inf for σ = 0.

    Examples:
      >>> from fedjax_sim.accounting import tree_epsilons
      >>> [round(e, 2) for e in tree_epsilons(10.0, 1e-5, 4, [4, 8])]
      [0.68, 0.99]
    """
    sigma = _check_noise(noise_multiplier)
    delta = _check_delta(delta)
    steps = _check_count("steps_per_epoch", steps_per_epoch)
    rounds = [_check_count("rounds", r) for r in rounds]
    if any(b <= a for a, b in zip(rounds, rounds[1:], strict=False)):
        raise ValueError(f"rounds must be strictly increasing; got {rounds!r}.")
    if sigma == 0:
        return [math.inf] * len(rounds)
    dp = _dp()
    out = []
    for r in rounds:
        acc = dp.rdp.RdpAccountant(None, dp.NeighboringRelation.REPLACE_SPECIAL)
        acc.compose(tree_event(sigma, steps, r))
        out.append(float(acc.get_epsilon(delta)))
    return out


def calibrate_tree_noise(target_epsilon: float, delta: float, steps_per_epoch: int,
                         rounds: int, max_noise_multiplier: float = 1000.0) -> float:
    """The smallest σ whose DP-FTRL ε at δ after `rounds` rounds (`tree_epsilons`) is at
    most `target_epsilon`, by dp-accounting's `calibrate_dp_mechanism`; a target that
    `max_noise_multiplier` does not reach is refused."""
    if (isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float))
            or not 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0; got {target_epsilon!r}.")
    delta = _check_delta(delta)
    top = _check_noise(max_noise_multiplier)
    steps = _check_count("steps_per_epoch", steps_per_epoch)
    rounds = _check_count("rounds", rounds)
    dp = _dp()

    def make_accountant():
        return dp.rdp.RdpAccountant(None, dp.NeighboringRelation.REPLACE_SPECIAL)

    def eps(sigma):
        acc = make_accountant()
        acc.compose(tree_event(sigma, steps, rounds))
        return acc.get_epsilon(delta)

    reached = eps(top)
    if reached > target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon} is unreachable at delta={delta} after {rounds} "
            f"rounds of DP-FTRL: even noise_multiplier={top:g} (max_noise_multiplier) gives "
            f"epsilon={reached:.4g}.")
    lo = 1e-3
    if eps(lo) <= target_epsilon:
        return lo
    return float(dp.calibrate_dp_mechanism(
        make_accountant, lambda sigma: tree_event(sigma, steps, rounds), target_epsilon, delta,
        dp.ExplicitBracketInterval(lo, top), tol=1e-4))


def calibrate_noise(target_epsilon: float, delta: float, rounds: int, *,
                    sampling: str = "poisson", q=None, num_clients=None, cohort_size=None,
                    accountant: str = "pld", max_noise_multiplier: float = 1000.0) -> float:
    """The smallest σ whose ε at δ after `rounds` rounds is at most `target_epsilon`.

    dp-accounting's `calibrate_dp_mechanism` (Brent's method on ε(σ) − target) inside a
    bracket found by doubling or halving σ from 1; the answer's ε is ≤ the target and
    within 1e-3 · σ of the optimum.

    Args:
      target_epsilon: ε > 0.
      delta, rounds, sampling, q, num_clients, cohort_size: as in `epsilon`.
      accountant: "pld" or "rdp".
      max_noise_multiplier: the largest σ searched; a target that it does not reach
        is refused.

    Returns:
      σ (a float).
    """
    if (isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float))
            or not 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0; got {target_epsilon!r}.")
    _check_choice("accountant", accountant, ("pld", "rdp"))
    delta = _check_delta(delta)
    top = _check_noise(max_noise_multiplier)
    event = dp_event(1.0, rounds, sampling=sampling, q=q, num_clients=num_clients,
                     cohort_size=cohort_size)  # checks the rest
    dp = _dp()
    _accountant(dp, accountant, sampling)  # refuses a sampling the accountant cannot take
    q_, n, s = _sampling_rate(sampling, q, num_clients, cohort_size)

    def make_event(sigma):
        return dp.SelfComposedDpEvent(_round_event(dp, sigma, sampling, q_, n, s), event.count)

    def eps(sigma):
        return _epsilon_of(dp, make_event(sigma), delta, sampling, accountant)

    reached = eps(top)
    if reached > target_epsilon:
        raise ValueError(
            f"target_epsilon={target_epsilon} is unreachable at delta={delta} after {rounds} "
            f"rounds: even noise_multiplier={top:g} (max_noise_multiplier) gives "
            f"epsilon={reached:.4g}.")
    hi = min(1.0, top)
    while eps(hi) > target_epsilon:
        hi = min(2 * hi, top)
    lo = hi / 2
    while eps(lo) <= target_epsilon:
        if lo < 1e-3:  # ε this large needs next to no noise
            return lo
        lo, hi = lo / 2, lo
    return float(dp.calibrate_dp_mechanism(
        lambda: _accountant(dp, accountant, sampling), make_event, target_epsilon, delta,
        dp.ExplicitBracketInterval(lo, hi), tol=1e-3 * lo))


def combined_noise_multiplier(*noise_multipliers: float) -> float:
    """(Σ_j z_j⁻²)^(−1/2): the one Gaussian that Gaussian queries of multipliers z_j cost
    together (their outputs stacked, each over its own sensitivity).

    E.g. an update sum at σ_Δ with a noised count of noise σ_n (sensitivity 1):
    `combined_noise_multiplier(σ_Δ, σ_n)`; adaptive clipping's count at σ_b has
    sensitivity ½, multiplier 2σ_b.
    """
    if not noise_multipliers:
        raise ValueError("combined_noise_multiplier needs at least one multiplier.")
    for z in noise_multipliers:
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not z > 0:
            raise ValueError(f"each noise multiplier must be a number > 0; got {z!r}.")
    return sum(z ** -2.0 for z in noise_multipliers) ** -0.5


def poisson_overflow_probability(num_clients: int, q: float, max_cohort: int) -> float:
    """P[Binomial(N, q) > max_cohort]: how often a Poisson cohort overflows a static
    maximum of `max_cohort` slots."""
    from scipy import stats

    n = _check_count("num_clients", num_clients)
    m = _check_count("max_cohort", max_cohort)
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not 0 < q <= 1:
        raise ValueError(f"q must be a number in (0, 1]; got {q!r}.")
    return float(stats.binom.sf(m, n, q))
