"""Systems heterogeneity: whether clients show up, report, or straggle, as masks of a round.

Statistical heterogeneity lives in the data; *systems* heterogeneity is how
the clients behave as machines. A `Systems` value says it, and rides on the
client data as static pytree data (like the executor's `execution.Plan`), so
that the one cohort path (`ops.sample_cohort`, `ops.cohort_sums`) applies it
in every algorithm's round without any algorithm naming it. Attach it with
`algorithms.with_systems(algorithm, systems)` (or `attach` here, on the
data itself). In a round:

    A    ← {i : u_i < p_i(t)}                   (u_i ~ U[0, 1), fresh each round)
    S    ← the cohort, drawn among A only      (uniform without replacement, or ∝ weights)
    K    ← the slots of S holding an available client
    stragglers, straggler_draw = "fixed" (the FedProx code's rule, the default):
         K − round(K · (1 − stragglers)) of the K slots, uniformly at random
    stragglers, straggler_draw = "independent":
         each slot j with probability stragglers (v_j < stragglers)
    each slot j ∈ S:
         reports_j ← w_j ≥ dropout            (it sends its update back)
                     and not (straggles_j and straggler_policy = "drop")

The "fixed" count is the FedProx code's: round(K · (1 − rate)) of the selected
devices do their full work and the others straggle (Python's round, half to
even; it equals round(K · rate) but at exact halves with odd K). So with the
"drop" policy and no dropout, a round in which K · (1 − rate) ≥ 1 keeps at least
one reporter. Stragglers are chosen among the available slots before training;
dropout is drawn on its own afterwards (FedProx's code has none).

p_i(t) is `availability` (one number, or one per client), or with a `period`
a day/night cycle: client i lives in time zone z_i = ⌊π(i) · period / m⌋, π a
permutation of the m clients drawn once from `zone_seed`
(`ops.work.time_zones`), and is in its day when (t + z_i) mod period <
period / 2, available then with probability availability_i and with
probability `night` otherwise. The permutation spreads the zones evenly (as
many clients per zone as ⌊i · period / m⌋ gives) independently of how the
clients are numbered: clients numbered cluster by cluster do not sleep a
cluster at a time.

A slot that does not report, or whose client is unavailable (when fewer
than |S| clients are available, the remaining slots are empty), gets weight
0 in every sum of the round (`CohortBatch.active`), exactly as a client
without data does; a straggler that is kept trains a uniformly drawn
1, …, τ_i − 1 of its τ_i local steps (`ops.work.straggler_steps`: strictly
less than its full work, the FedProx code's 1..E − 1 epochs), and its partial
update counts like any other. A straggler whose τ_i ≤ 1 cannot do part of its
work: it takes its τ_i steps (kept: a full update; dropped under "drop" like any
straggler).

The data layer carries it without knowing what it holds (this module imports
only `fedjax_sim.carried`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedjax_sim.carried import carried, carrying

POLICIES = ("keep", "drop")
DRAWS = ("fixed", "independent")


def _fraction(name: str, value, *, open_top: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"Systems {name} must be a number in [0, 1]; got {value!r}.") from None
    if not 0.0 <= number <= 1.0 or (open_top and number == 1.0):
        allowed = "[0, 1)" if open_top else "[0, 1]"
        raise ValueError(f"Systems {name} must be a number in {allowed}; got {value!r}.")
    return number


@dataclass(frozen=True)
class Systems:
    """How the clients behave as machines (hashable: part of jit's cache key).

    Attributes:
      availability: the probability that a client is available in a round (by
        day, with a `period`): one number for every client, or a tuple with one
        per client (length m).
      period: 0: availability is constant; else the rounds of one day/night cycle
        (an integer >= 2), the clients' time zones spread evenly over it in an
        order drawn from `zone_seed`.
      night: the probability that a client is available at night (with a period).
      dropout: the probability that a chosen client fails to report its update
        after training, in [0, 1).
      stragglers: the straggler rate, in [0, 1]: under straggler_draw "fixed"
        the fraction of the available cohort slots that straggle in every round
        (K − round(K · (1 − stragglers)) of K); under "independent" the
        probability that each slot straggles.
      straggler_draw: "fixed" (default, the FedProx code's rule) or
        "independent" (each slot on its own, so the count varies by round).
      straggler_policy: "keep": a straggler's partial work (a uniform
        1..τ_i − 1 of its steps) is aggregated like any update (FedProx's rule);
        "drop": a straggler's update is discarded (FedAvg's rule in the FedProx
        paper).
      zone_seed: the seed of the permutation that places the clients' time
        zones (with a period).
      cyclic: the cohort of s slots is not drawn: the m clients form G = m / s
        groups of s consecutive ids and round t (counted from 0) trains group
        t mod G, so every client takes part exactly once in every G rounds
        (DP-FTRL's cyclic participation, Kairouz et al., arXiv:2103.00039). Every
        client available (no availability < 1 nor period); m a multiple of s,
        and no sampling weights.

    Examples:
      >>> from fedjax_sim.systems import Systems
      >>> Systems(availability=0.5, stragglers=0.9, straggler_policy="drop").trivial
      False
      >>> Systems().trivial
      True
      >>> Systems(availability=0.9, period=24, night=0.1).always_available
      False
      >>> Systems(dropout=1.0)
      Traceback (most recent call last):
      ...
      ValueError: Systems dropout must be a number in [0, 1); got 1.0.
    """

    availability: float | tuple[float, ...] = 1.0
    period: int = 0
    night: float = 0.0
    dropout: float = 0.0
    stragglers: float = 0.0
    straggler_policy: str = "keep"
    straggler_draw: str = "fixed"
    zone_seed: int = 0
    cyclic: bool = False

    def __post_init__(self):
        if isinstance(self.availability, tuple | list):
            values = tuple(_fraction("availability", a) for a in self.availability)
            if not values:
                raise ValueError("Systems availability per client must hold one "
                                 "probability per client; got an empty tuple.")
            object.__setattr__(self, "availability", values)
        else:
            object.__setattr__(self, "availability",
                               _fraction("availability", self.availability))
        if (not isinstance(self.period, int) or isinstance(self.period, bool) or self.period < 0
                or self.period == 1):
            raise ValueError(f"Systems period must be 0 (constant availability) or an integer "
                             f">= 2 (rounds per day/night cycle); got {self.period!r}.")
        object.__setattr__(self, "night", _fraction("night", self.night))
        object.__setattr__(self, "dropout", _fraction("dropout", self.dropout, open_top=True))
        object.__setattr__(self, "stragglers", _fraction("stragglers", self.stragglers))
        if self.straggler_policy not in POLICIES:
            raise ValueError(f"Systems straggler_policy must be one of {', '.join(POLICIES)}; "
                             f"got {self.straggler_policy!r}.")
        if self.straggler_draw not in DRAWS:
            raise ValueError(f"Systems straggler_draw must be one of {', '.join(DRAWS)}; "
                             f"got {self.straggler_draw!r}.")
        if not isinstance(self.zone_seed, int) or isinstance(self.zone_seed, bool):
            raise ValueError(f"Systems zone_seed must be an integer; got {self.zone_seed!r}.")
        if not isinstance(self.cyclic, bool):
            raise ValueError(f"Systems cyclic must be True or False; got {self.cyclic!r}.")
        if self.cyclic and not self.always_available:
            raise ValueError("Systems cyclic (every client once per G rounds) needs every "
                             "client available: leave availability at 1 and period at 0.")

    @property
    def always_available(self) -> bool:
        return self.availability == 1.0 and (self.period == 0 or self.night == 1.0)

    @property
    def trivial(self) -> bool:
        """Every client available, reporting, never straggling, the cohort drawn: the round
        as without it."""
        return (self.always_available and self.dropout == 0.0 and self.stragglers == 0.0
                and not self.cyclic)

    def replace(self, **changes) -> Systems:
        return replace(self, **changes)


NO_SYSTEMS = Systems()


def systems_of(data) -> Systems:
    """The Systems of a client source, or of the first one in a pytree (NO_SYSTEMS if none)."""
    return carried(data, "systems", NO_SYSTEMS)


def attach(data, systems: Systems):
    """`data` (a client source, or a pytree holding them) with every client source's
    systems set to `systems`; other nodes as they are."""
    if not isinstance(systems, Systems):
        raise ValueError(f"systems must be a fedjax_sim.systems.Systems; got {systems!r}.")
    return carrying(data, "systems", systems)
