"""User-level differential privacy for every algorithm whose server averages client updates.

`with_dp(algorithm, clip_norm, noise_multiplier)` is DP-FedAvg's aggregation (H. Brendan
McMahan, Daniel Ramage, Kunal Talwar, Li Zhang, "Learning Differentially Private
Recurrent Language Models", ICLR 2018, arXiv:1710.06963) put in place of an algorithm's
weighted mean; `with_dp_ftrl` is DP-FTRL's (Peter Kairouz, Brendan McMahan, Shuang Song,
Om Thakkar, Abhradeep Thakurta, Zheng Xu, "Practical and Private (Deep) Learning without
Sampling or Shuffling", ICML 2021, arXiv:2103.00039). One round's server step, for an
algorithm whose clients start from θ (their cluster's θ_j in IFCA and HypCluster):

    Δ_i   ← θ̃_i − θ                                     (client i's whole change, every leaf)
    Δ̄_i   ← Δ_i · min(1, C / ‖Δ_i‖₂)                     (clipped, flat over the pytree)
    S̃     ← Σ_{i reports} Δ̄_i + N(0, σ²C² I)              (one Gaussian; per cluster: k sums)
    θ     ← θ + S̃ / D                                    (D: the expected cohort, fixed)

Every reporting client counts 1 (a client's weight in the sum is at most 1, so adding or
removing one client moves S̃ by at most C: sensitivity C); `weighting="examples"` is not
used under DP. A slot that does not report (no data, unavailable, dropped, straggling under
"drop", chunk padding) adds nothing and is not counted. Clustered algorithms: a client adds
to exactly one cluster's sum, so the k noised sums are one Gaussian mechanism of
multiplier σ on their concatenation and cost what one sum costs; their denominators are
fixed too (D / k each: the expected cohort split evenly), since the clusters' counts
depend on the clients' data.

What is private is the sequence of server models (and everything computed from them:
evaluations on public or server data). The clients' losses, the round metrics
(`cohort_loss`, `participants`), the cluster assignments, and evaluations of the clients'
own data are not: they are the simulator's instruments. Algorithms whose server uses more
than the clipped sum of model changes (DRFA/DRFLM's λ from client losses, AFL, q-FFL,
robust IFCA) have no `aggregation` in their state and are refused by `with_dp`.

ε is the accountant's (`fedjax_sim.accounting`, Google's dp-accounting): a round is the
sampled Gaussian of multiplier σ at the cohort's sampling rate (fixed-size sampling
without replacement: `sampling="without_replacement"`; Poisson sampling: each client
available with probability q, `with_systems(..., Systems(availability=q))`, with the
cohort's s slots as the cap: `sampling="poisson"`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.algorithms.base import Algorithm, check_no_rule
from fedjax_sim.ops.privacy import (
    _concrete,
    adaptive_clip_update,
    adaptive_noise_multiplier,
    check_clip_norm,
    check_noise_multiplier,
    clipped_cluster_sums,
    clipped_sum,
    privatize,
    tree_noise_init,
    tree_noise_step,
)

#: The stream folded into a round's key for its DP noise (the cohort's draws are untouched).
PRIVACY_STREAM = 0x5EC12E7
DENOMINATORS = ("expected", "count")

__all__ = [
    "DENOMINATORS",
    "AdaptiveClipping",
    "GaussianSum",
    "TreeSum",
    "with_dp",
    "with_dp_ftrl",
]


class AdaptiveClipping(NamedTuple):
    """Adaptive clipping (Galen Andrew, Om Thakkar, H. Brendan McMahan, Swaroop Ramaswamy,
    "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021,
    arXiv:1905.03871): C follows the γ-quantile of the update norms,

        b̃ ← (Σ_{i reports} (1[‖Δ_i‖ ≤ C] − ½) + N(0, σ_b²)) / D + ½     (clipped to [0, 1])
        C ← C · exp(−η_C (b̃ − γ))

    and the sum is noised at σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−½), so that the two together cost
    one Gaussian of multiplier σ (what the accountant charges).

    target_quantile: γ in [0, 1] (the paper: 0.5).
    learning_rate: η_C ≥ 0 (the paper: 0.2).
    count_stddev: σ_b > σ / 2; None: D / 20 (the paper's choice).
    """

    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_stddev: float | None = None


def _noise_key(key):
    return jax.random.fold_in(key, PRIVACY_STREAM)


def _add(base, mean):
    return jax.tree.map(lambda b, d: b + d.astype(b.dtype), base, mean)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GaussianSum:
    """DP-FedAvg's aggregation: a state's `aggregation` under `with_dp` (module docstring).

    The rule `Cohorts.sums` / `Cohorts.mean` hand the round's changes to. Traced fields may
    be vmapped (a sweep over σ or C); the static ones choose the program.
    """

    clip_norm: jax.Array  # [] float32: this round's C (adaptive clipping moves it)
    noise_multiplier: jax.Array  # [] float32: σ, the total multiplier the accountant charges
    target_quantile: Any = None  # [] γ with adaptive clipping; None: a fixed C
    clip_learning_rate: Any = None  # [] η_C
    count_stddev: Any = None  # [] σ_b; None: D / 20
    denominator: str = dataclasses.field(default="expected", metadata={"static": True})
    expected_clients: float | None = dataclasses.field(default=None, metadata={"static": True})
    noise_cohort_size: float | None = dataclasses.field(default=None,
                                                        metadata={"static": True})
    sigma_given: float | None = dataclasses.field(default=None, metadata={"static": True})

    @property
    def adaptive(self) -> bool:
        return self.target_quantile is not None

    # -- the clients' half: additive over slots (a chunked round adds chunks)

    def sums(self, changes, weights, batch=None):
        return clipped_sum(changes, self.clip_norm, reports=weights > 0)

    def cluster_sums(self, changes, segment, num_clusters: int, weights, batch=None):
        return clipped_cluster_sums(changes, segment, num_clusters, self.clip_norm,
                                    reports=weights > 0)

    # -- the server's half: once per round

    def _expected(self, expected: float | None) -> float:
        if self.expected_clients is not None:
            return self.expected_clients
        if expected is None:
            raise ValueError("the expected cohort size needs one availability for every "
                             "client and no day/night cycle; give it to with_dp as "
                             "expected_clients.")
        return expected

    def _sum_noise(self, expected: float):
        """σ_Δ: the sum's multiplier (σ, or σ's share under adaptive clipping), times D / N
        where the shortcut calibrates the noise for a cohort of N."""
        sigma = self.noise_multiplier
        if self.adaptive:
            sigma = adaptive_noise_multiplier(sigma, self._count_stddev(expected))
        if self.noise_cohort_size is not None:
            sigma = sigma * expected / self.noise_cohort_size
        return sigma

    def _count_stddev(self, expected: float):
        if self.count_stddev is not None:
            return self.count_stddev
        stddev = expected / 20.0
        if self.sigma_given is not None and not 2.0 * stddev > self.sigma_given:
            raise ValueError(
                f"adaptive clipping's count noise σ_b = D / 20 = {stddev:g} (D = {expected:g} "
                f"expected clients) must exceed noise_multiplier / 2 = {self.sigma_given / 2:g}; "
                "give AdaptiveClipping(count_stddev=...) above it, or a larger cohort.")
        return stddev

    def _finish(self, sums, base, key, expected: float, denominators):
        expected = self._expected(expected)
        key_sum, key_clip = jax.random.split(_noise_key(key))
        noised = privatize(sums, key_sum, clip_norm=self.clip_norm,
                           noise_multiplier=self._sum_noise(expected),
                           denominator=None if self.denominator == "count" else denominators(
                               expected),
                           fallback=jax.tree.map(jnp.zeros_like, base))
        metrics = {"dp_clip_norm": self.clip_norm}
        rule = self
        if self.adaptive:
            clip, fraction = adaptive_clip_update(
                self.clip_norm, jnp.sum(sums.below), key_clip,
                target_quantile=self.target_quantile, learning_rate=self.clip_learning_rate,
                count_stddev=self._count_stddev(expected), expected_count=expected)
            rule = dataclasses.replace(self, clip_norm=clip.astype(jnp.float32))
            metrics["dp_unclipped_fraction"] = fraction
        return _add(base, noised.mean), rule, metrics

    def divisor(self, sums, expected: float | None):
        """What `mean` divides the sum by: D, or the reporting count (denominator="count")."""
        return sums.count if self.denominator == "count" else self._expected(expected)

    def mean(self, sums, base, key, expected: float):
        return self._finish(sums, base, key, expected, lambda d: d)

    def cluster_means(self, sums, base, key, expected: float):
        k = sums.count.shape[0]
        return self._finish(sums, base, key, expected, lambda d: d / k)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeSum:
    """DP-FTRL's aggregation: a state's `aggregation` under `with_dp_ftrl`.

    θ_t = θ_0 + (Σ_{τ≤t} S_τ + n_t) / D, n_t the tree's noise of the prefix sum; written
    round by round as θ_t = θ_{t−1} + (S_t + n_t − n_{t−1}) / D, so the state keeps the
    tree's nodes and n_{t−1}, not θ_0 or the running sum. Round t's node is drawn with
    the key fold_in(round key, PRIVACY_STREAM) (`ops.privacy.tree_noise_step`).
    """

    clip_norm: jax.Array  # [] float32: C
    noise_multiplier: jax.Array  # [] float32: σ, each tree node's noise over C
    tree: Any  # ops.privacy.TreeNoiseState: the latest node of each level
    previous: Any  # n_{t−1}, shaped like one round's sum (zeros before round 1)
    rounds: int = dataclasses.field(default=1, metadata={"static": True})
    expected_clients: float | None = dataclasses.field(default=None, metadata={"static": True})
    restart: bool = dataclasses.field(default=False, metadata={"static": True})

    def sums(self, changes, weights, batch=None):
        return clipped_sum(changes, self.clip_norm, reports=weights > 0)

    def divisor(self, sums, expected: float | None):
        """D, what `mean` divides the sums by."""
        return expected if self.expected_clients is None else self.expected_clients

    def mean(self, sums, base, key, expected: float | None):
        expected = expected if self.expected_clients is None else self.expected_clients
        if expected is None:
            raise ValueError("the expected cohort size needs one availability for every "
                             "client and no day/night cycle; give it to with_dp_ftrl as "
                             "expected_clients.")
        tree, noise = tree_noise_step(self.tree, _noise_key(key),
                                      self.noise_multiplier * self.clip_norm)
        step = jax.tree.map(lambda s, n, p: (s + n - p) / expected, sums.total, noise,
                            self.previous)
        if self.restart:
            # The epoch's last round: the next starts an empty tree from the model as it is
            # (n_{t−1} = 0), so no client reaches two trees' nodes within its epoch.
            done = tree.step >= self.rounds
            tree = jax.tree.map(lambda a: jnp.where(done, jnp.zeros_like(a), a), tree)
            noise = jax.tree.map(lambda n: jnp.where(done, jnp.zeros_like(n), n), noise)
        rule = dataclasses.replace(self, tree=tree, previous=noise)
        return _add(base, step), rule, {"dp_clip_norm": self.clip_norm}

    def cluster_sums(self, *args):
        raise ValueError("with_dp_ftrl noises one model's prefix sums; clustered algorithms "
                         "(per-cluster sums) are not supported: use with_dp.")

    cluster_means = cluster_sums


def _check_expected(expected_clients, name: str = "expected_clients") -> None:
    if expected_clients is None:
        return
    value = _concrete(expected_clients)
    if value is None or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a number > 0 (or None); got {expected_clients!r}.")


def with_dp(algorithm: Algorithm, clip_norm, noise_multiplier, *,
            denominator: str = "expected", expected_clients: float | None = None,
            adaptive: AdaptiveClipping | None = None,
            noise_cohort_size: float | None = None) -> Algorithm:
    """The algorithm with DP-FedAvg's clipped, noised aggregation (user-level DP).

    Each reporting client's whole change is clipped to L2 norm C; the server adds
    N(0, σ²C²) to their sum (k independent sums for a clustered algorithm) and divides by
    the expected cohort size D (module docstring). Everything else in the round is the
    algorithm's own: a FedOpt server step (`with_server_optimizer`, in either order)
    steps on the privatised mean; SCAFFOLD clips its model and control-variate changes
    together; FedNova its normalized changes; Ditto and the personalised methods privatise
    the global model only (the personal models never leave the clients).

    Args:
      algorithm: one whose state has an `aggregation` field (FedAvg, FedProx, FedNova,
        SCAFFOLD, Ditto, IFCA with option "model", HypCluster); others (CFL included) are
        refused
        at `init` in one line saying why. Apply `with_dp` before `with_seeds`,
        `with_restarts` or `with_grid` (each copy its own noise).
      clip_norm: C > 0 (may be traced: a sweep); the initial C under adaptive clipping.
      noise_multiplier: σ ≥ 0 (may be traced); ε follows from σ, the sampling rate and
        the rounds (`fedjax_sim.accounting.epsilon`, or `calibrate_noise` for a target ε).
      denominator: "expected" (D = the expected cohort size, `base.expected_clients`:
        the fixed-denominator estimator, private) or "count" (the exact count of
        reporting clients: not private where the count is not public, e.g. under Poisson
        sampling or per cluster; for measuring what the fixed denominator costs).
      expected_clients: D itself (None: from the cohort and the data's `Systems`).
      adaptive: `AdaptiveClipping(...)` to let C follow a quantile of the update norms
        (σ is then the total multiplier, split between the sum and the count); None: C
        fixed.
      noise_cohort_size: the peers' shortcut (pfl-research's `noise_cohort_size`): the
        noise calibrated as if N clients had taken part (the sum's noise σC · D / N), while
        only the cohort trains. The result is private only if the run had a cohort of N;
        this option measures how far the shortcut is from training that cohort. None: the
        noise of the cohort that trains.

    Returns:
      The algorithm; its rounds report `dp_clip_norm` (the C used) and, with adaptive
      clipping, `dp_unclipped_fraction` (the noised b̃).

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_dp
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_dp(fedavg(linear_regression(3), sgd(0.1, steps=5), participation=0.5),
      ...               clip_norm=1.0, noise_multiplier=0.5)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> sorted(metrics)
      ['cohort_loss', 'dp_clip_norm']

    References:
      McMahan et al., ICLR 2018, https://arxiv.org/abs/1710.06963; Andrew et al.,
      NeurIPS 2021, https://arxiv.org/abs/1905.03871.
    """
    check_clip_norm(clip_norm)
    check_noise_multiplier(noise_multiplier)
    if denominator not in DENOMINATORS:
        raise ValueError(f"denominator must be one of {DENOMINATORS}; got {denominator!r}.")
    _check_expected(expected_clients)
    _check_expected(noise_cohort_size, "noise_cohort_size")
    if adaptive is not None:
        if not isinstance(adaptive, AdaptiveClipping):
            raise ValueError(f"adaptive must be None or AdaptiveClipping(...); got {adaptive!r}.")
        sigma = _concrete(noise_multiplier)
        if sigma is not None and sigma == 0:
            raise ValueError("adaptive clipping needs noise_multiplier > 0 (its count takes a "
                             "share of the noise); use a fixed clip_norm at noise 0.")
        if adaptive.count_stddev is not None:
            adaptive_noise_multiplier(noise_multiplier, adaptive.count_stddev)  # checks
        gamma, rate = _concrete(adaptive.target_quantile), _concrete(adaptive.learning_rate)
        if gamma is not None and not 0.0 <= gamma <= 1.0:
            raise ValueError(f"adaptive clipping's target_quantile must be in [0, 1]; got "
                             f"{adaptive.target_quantile!r}.")
        if rate is not None and not rate >= 0:
            raise ValueError(f"adaptive clipping's learning_rate must be >= 0; got "
                             f"{adaptive.learning_rate!r}.")

    def rule():
        f32 = lambda v: None if v is None else jnp.asarray(v, jnp.float32)  # noqa: E731
        a = adaptive or AdaptiveClipping(None, None, None)
        return GaussianSum(f32(clip_norm), f32(noise_multiplier), f32(a.target_quantile),
                           f32(a.learning_rate), f32(a.count_stddev), denominator,
                           expected_clients, noise_cohort_size, _concrete(noise_multiplier))

    def init(key, data):
        state = algorithm.init(key, data)
        check_no_rule(state, "with_dp", "the clipped sum of those changes")
        return state._replace(aggregation=rule())

    return algorithm._replace(init=init)


def with_dp_ftrl(algorithm: Algorithm, clip_norm, noise_multiplier, *, rounds: int,
                 expected_clients: float | None = None, restart: bool = False) -> Algorithm:
    """The algorithm with DP-FTRL's tree-aggregated noise (no sampling amplification).

    The server's model is θ_0 plus the noised prefix sum of the clipped changes over D:
    θ_t = θ_0 + (Σ_{τ≤t} S_τ + n_t) / D, n_t drawn from a binary tree over the rounds
    whose every node is N(0, σ²C²) (`ops.privacy.tree_noise_step`); a client's change
    reaches at most ⌈log₂(T+1)⌉ nodes, which is what `accounting.tree_epsilon` charges.
    Made for full or cyclic participation (every client at most once per tree): account
    it with `tree_epsilon(σ, δ, steps_per_epoch, epochs)`. A FedOpt server step
    (`with_server_optimizer`, e.g. momentum as in Kairouz et al.'s federated runs) steps on
    the privatised change. One model only (FedAvg, FedProx, FedNova, SCAFFOLD, Ditto).

    Args:
      algorithm: as in `with_dp`, with one server model.
      clip_norm: C > 0.
      noise_multiplier: σ ≥ 0, each tree node's noise over C.
      rounds: T ≥ 1, the rounds the tree must cover (a tree of ⌊log₂ T⌋ + 1 levels;
        past T the model turns NaN: build it with the run's rounds).
      expected_clients: D (None: the cohort's expected size).
      restart: restart the tree every `rounds` rounds (an epoch: Kairouz et al.'s
        DP-FTRL-TreeRestart), the model keeping what it has learnt; the run may then go
        past `rounds`. With cyclic participation (`Systems(cyclic=True)`, G groups) and
        rounds = G, every client is in each tree once:
        `accounting.tree_epsilons(σ, δ, G, ...)`.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fedavg, sgd, with_dp_ftrl
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = with_dp_ftrl(fedavg(linear_regression(3), sgd(0.1)), clip_norm=1.0,
      ...                    noise_multiplier=1.0, rounds=20)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> state.aggregation.tree.step.item()
      1

    References:
      Kairouz et al., ICML 2021, https://arxiv.org/abs/2103.00039.
    """
    check_clip_norm(clip_norm)
    check_noise_multiplier(noise_multiplier)
    _check_expected(expected_clients)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"with_dp_ftrl's rounds must be an integer >= 1; got {rounds!r}.")

    def init(key, data):
        state = algorithm.init(key, data)
        check_no_rule(state, "with_dp_ftrl", "the clipped sum of those changes")
        if "params" not in state._fields:
            raise ValueError("with_dp_ftrl noises one server model's prefix sums; "
                             f"{type(state).__name__} holds one model per cluster: use with_dp.")
        zeros = jax.tree.map(jnp.zeros_like, _server_changes_like(state))
        rule = TreeSum(jnp.asarray(clip_norm, jnp.float32),
                       jnp.asarray(noise_multiplier, jnp.float32),
                       tree_noise_init(zeros, rounds), zeros, rounds, expected_clients,
                       bool(restart))
        return state._replace(aggregation=rule)

    return algorithm._replace(init=init)


def _server_changes_like(state):
    """The shape of what the round's clients change on the server: its model, and with
    SCAFFOLD its control variate too."""
    if "control" in state._fields:
        return (state.params, state.control)
    return state.params

