"""Robust aggregation of a cohort's client updates, over the stacked cohort with a reporting mask.

Setting (Blanchard et al. 2017): a round's cohort has s slots; n of them report (`mask`),
and up to f of those may be Byzantine. Updates are a pytree with leaves [s, ...]; an
aggregator returns one update (leaves [...]). A slot outside `mask` never enters a
statistic: its entries are replaced by zeros before anything is computed, sorts push it
past every reporting value, distances to it are +inf and counts are of reporting slots
only. A median over a cluster's mask is the median of that cluster's reporting clients,
and whatever a non-reporting slot holds (NaN included) changes nothing. A cohort in which
no slot reports gets the zero update from every rule.

Aggregators compose like optax transformations:

    agg = chain(nearest_neighbor_mixing(f=2), trimmed_mean(f=2))
    state = agg.init(params)
    update, state = agg.aggregate(updates, mask, key, state)

The rules (n reporting slots, P parameters; f the Byzantine count each rule is built for):

    mean                    Σ_i x_i / n
    coordinate_median       per coordinate, the median of the n values      (Yin et al. 2018)
    trimmed_mean            per coordinate, drop the f (or ⌊βn⌋) largest and
                            smallest, average the rest                      (Yin et al. 2018)
    multi_krum / krum       score(i) = Σ of the squared distances from x_i to its
                            n − f − 2 nearest others; average the m lowest
                            scorers (Krum: m = 1)                          (Blanchard et al. 2017)
    geometric_median        smoothed Weiszfeld from the mean, T iterations:
                            β_i = 1 / max(ν, ‖v − x_i‖),  v ← Σ β_i x_i / Σ β_i
                                                                           (Pillutla et al. 2022)
    centered_clipping       from v_0 = the previous round's aggregate, L times:
                            v ← v + (1/n) Σ_i (x_i − v) min(1, τ / ‖x_i − v‖)
                                                                           (Karimireddy et al. 2021)
    bulyan                  Krum applied θ = n − 2f times, each pick removed;
                            per coordinate, the mean of the β = θ − 2f picked
                            values closest to their median        (El Mhamdi et al. 2018)
    pre-aggregations (`chain` them before a rule):
    bucketing               a random permutation of the reporting slots cut into
                            buckets of b; each bucket's mean       (Karimireddy et al. 2022)
    nearest_neighbor_mixing x_i ← the mean of its n − f nearest reporting updates,
                            itself included                          (Allouah et al. 2023)

Pairwise squared distances ‖a‖² + ‖b‖² − 2⟨a, b⟩ are one Gram matrix product per leaf
(`pairwise_sq_distances`), of the updates centred at their mean (distances do not
change; the cancellation does). The parameter axis is never concatenated: norms, dot
products and weighted sums add up over the leaves.

Each rule refuses, in one line naming the limit, an f beyond what it tolerates for the
cohort's s slots. f may also be a traced int32 scalar (a sweep whose Byzantine share is
a vmapped axis; its limit is then the caller's to check), kept in the rule's state by
`inject_hyperparams` (as `optax.inject_hyperparams` keeps an optimizer's numbers).
When fewer slots report than the rule needs, it still returns an update, by the floors
its docstring states (e.g. Krum scores with at least one neighbour): the guarantee is
gone, the program still runs.

References:
  Dong Yin, Yudong Chen, Kannan Ramchandran, Peter Bartlett, "Byzantine-Robust
  Distributed Learning: Towards Optimal Statistical Rates", ICML 2018, arXiv:1803.01498.
  Peva Blanchard, El Mahdi El Mhamdi, Rachid Guerraoui, Julien Stainer, "Machine Learning
  with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017.
  Krishna Pillutla, Sham M. Kakade, Zaid Harchaoui, "Robust Aggregation for Federated
  Learning", IEEE Transactions on Signal Processing 2022, arXiv:1912.13445.
  Sai Praneeth Karimireddy, Lie He, Martin Jaggi, "Learning from History for Byzantine
  Robust Optimization", ICML 2021, arXiv:2012.10333.
  El Mahdi El Mhamdi, Rachid Guerraoui, Sébastien Rouault, "The Hidden Vulnerability of
  Distributed Learning in Byzantium", ICML 2018, arXiv:1802.07927.
  Sai Praneeth Karimireddy, Lie He, Martin Jaggi, "Byzantine-Robust Learning on
  Heterogeneous Datasets via Bucketing", ICLR 2022, arXiv:2006.09365.
  Youssef Allouah, Sadegh Farhadkhani, Rachid Guerraoui, Nirupam Gupta, Rafaël Pinot,
  John Stephan, "Fixing by Mixing: A Recipe for Optimal Byzantine ML under
  Heterogeneity", AISTATS 2023, arXiv:2302.01772.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.ops.aggregation import mean_or_keep, weighted_sum


class Aggregator(NamedTuple):
    """A robust aggregation rule, built like an optax transformation.

    init(params) -> state: the rule's state for a model of this shape (`()` when it
      keeps none).
    aggregate(updates, mask, key, state) -> (update, state): `updates` a pytree with
      leaves [s, ...], `mask` [s] bool (the slots that report), `key` a PRNG key (rules
      that draw nothing ignore it); the update has leaves [...].
    """

    init: Callable[[Any], Any]
    aggregate: Callable[[Any, jax.Array, jax.Array, Any], tuple[Any, Any]]


class PreAggregation(NamedTuple):
    """A step before an `Aggregator` (`chain` them): new updates and a new mask.

    init(params) -> state.
    apply(updates, mask, key, state) -> (updates', mask', state): leaves [s', ...] and a
      [s'] mask (bucketing: s' = ⌈s / b⌉ buckets).
    """

    init: Callable[[Any], Any]
    apply: Callable[[Any, jax.Array, jax.Array, Any], tuple[Any, jax.Array, Any]]


class CenteredClippingState(NamedTuple):
    centre: Any  # pytree like params: v, the previous round's aggregate (zeros at first)


def _no_state(params):
    del params
    return ()


# --------------------------------------------------------------------------- helpers


def num_slots(updates) -> int:
    """s, the slots of a stacked cohort; refuses leaves that disagree or have no slot axis."""
    leaves = jax.tree.leaves(updates)
    if not leaves:
        raise ValueError("updates: an empty pytree; an aggregator needs leaves [s, ...].")
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"updates: every leaf needs the same leading (slot) axis; got "
                         f"{sorted(str(n) for n in sizes)}.")
    return sizes.pop()


def _check_mask(mask, s: int, what: str = "mask") -> jax.Array:
    mask = jnp.asarray(mask)
    if mask.shape != (s,) or mask.dtype != jnp.bool_:
        raise ValueError(f"{what}: needs a [{s}] boolean array (one entry per slot); got "
                         f"{mask.dtype}{list(mask.shape)}.")
    return mask


def _broadcast(v: jax.Array, leaf: jax.Array) -> jax.Array:
    """[s] -> [s, 1, ..., 1] against a leaf [s, ...]."""
    return v.reshape(v.shape + (1,) * (leaf.ndim - v.ndim))


def _zero_absent(updates, mask):
    """Non-reporting slots' entries replaced by 0 (whatever they held, NaN included)."""
    return jax.tree.map(lambda leaf: jnp.where(_broadcast(mask, leaf), leaf, 0), updates)


def _zeros_like_one(updates):
    return jax.tree.map(lambda leaf: jnp.zeros(leaf.shape[1:], leaf.dtype), updates)


def _weighted_mean(updates, weights: jax.Array):
    """Σ_i w_i x_i / Σ_i w_i over the slot axis; zeros when every weight is 0."""
    return mean_or_keep(weighted_sum(updates, weights), jnp.sum(weights),
                        _zeros_like_one(updates))


def _sq_norms(tree) -> jax.Array:
    """[s] ‖x_i‖² summed over every leaf's parameters (accumulated in float32 at least)."""
    def one(leaf):
        leaf = leaf.astype(jnp.promote_types(leaf.dtype, jnp.float32))
        return jnp.sum(jnp.square(leaf).reshape(leaf.shape[0], -1), axis=1)

    return sum(jax.tree.leaves(jax.tree.map(one, tree)))


def _distances_to(updates, point) -> jax.Array:
    """[s] ‖x_i − v‖ for one point v (leaves [...])."""
    return jnp.sqrt(_sq_norms(jax.tree.map(lambda x, v: x - v[None], updates, point)))


def _count(mask) -> jax.Array:
    return jnp.sum(mask.astype(jnp.int32))


def _where_any(n, value, fallback):
    return jax.tree.map(lambda v, f: jnp.where(n > 0, v, f), value, fallback)


def _sorted_slots(leaf: jax.Array, mask: jax.Array) -> jax.Array:
    """The leaf sorted along the slot axis, coordinate by coordinate, with the
    non-reporting slots pushed past every reporting value (to +inf)."""
    return jnp.sort(jnp.where(_broadcast(mask, leaf), leaf, jnp.inf), axis=0)


def _median_of_sorted(srt: jax.Array, n: jax.Array) -> jax.Array:
    """The median of the first n entries along axis 0: the middle one, or the mean of the
    two middle ones for even n."""
    lo = jax.lax.dynamic_index_in_dim(srt, jnp.maximum((n - 1) // 2, 0), 0, keepdims=False)
    hi = jax.lax.dynamic_index_in_dim(srt, jnp.maximum(n // 2, 0), 0, keepdims=False)
    return jnp.where(n > 0, (lo + hi) / 2, 0).astype(srt.dtype)


def pairwise_sq_distances(updates, mask: jax.Array) -> jax.Array:
    """[s, s] squared Euclidean distances between the reporting slots' updates.

    ‖a − b‖² = ‖a‖² + ‖b‖² − 2⟨a, b⟩ with the ⟨a, b⟩ of all pairs one Gram matrix product
    per leaf, summed over leaves, of the updates centred at their mean over the reporting
    slots; clamped at 0, exactly 0 on the diagonal of a reporting slot, +inf where either
    slot does not report.

    Args:
      updates: pytree, leaves [s, ...].
      mask: [s] bool, the reporting slots.
    """
    s = num_slots(updates)
    mask = _check_mask(mask, s)
    x = _zero_absent(updates, mask)
    centre = _weighted_mean(x, mask.astype(jnp.float32))
    gram = jnp.zeros((s, s), jnp.float32)
    for leaf, c in zip(jax.tree.leaves(x), jax.tree.leaves(centre), strict=True):
        dtype = jnp.promote_types(leaf.dtype, jnp.float32)
        z = jnp.where(_broadcast(mask, leaf), leaf - c[None], 0).reshape(s, -1).astype(dtype)
        gram = gram + jnp.dot(z, z.T, precision=jax.lax.Precision.HIGHEST)
    sq = jnp.diagonal(gram)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * gram, 0.0)
    d2 = jnp.where(jnp.eye(s, dtype=bool), 0.0, d2)
    return jnp.where(mask[:, None] & mask[None, :], d2, jnp.inf)


def _krum_scores(d2: jax.Array, mask: jax.Array, f: int) -> jax.Array:
    """[s] Krum scores among the slots of `mask`: the sum of the k smallest distances to
    the other slots of `mask`, k = n − f − 2 floored at 1 (at most n − 1); +inf outside."""
    s = mask.shape[0]
    n = _count(mask)
    k = jnp.minimum(jnp.maximum(n - f - 2, 1), n - 1)
    others = mask[:, None] & mask[None, :] & ~jnp.eye(s, dtype=bool)
    srt = jnp.sort(jnp.where(others, d2, jnp.inf), axis=1)
    nearest = jnp.arange(s)[None, :] < k
    score = jnp.sum(jnp.where(nearest, srt, 0.0), axis=1)
    return jnp.where(mask, score, jnp.inf)


def _ranks(values: jax.Array) -> jax.Array:
    """Rank of each entry in increasing order, ties broken by index."""
    order = jnp.argsort(values, stable=True)
    return jnp.zeros_like(order).at[order].set(jnp.arange(values.shape[0], dtype=order.dtype))


def _check_count(name: str, what: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: {what} must be an integer >= {minimum}; got {value!r}.")
    return value


def _known_int(value):
    """value as a Python int when it is a concrete integer scalar (an int, or an array not
    traced), the value itself when it is not an integer scalar, None when traced."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array | np.ndarray | np.integer):
        if np.ndim(value) or not np.issubdtype(np.asarray(value).dtype, np.integer):
            return value
        return int(value)
    return value


def _check_f(name: str, f):
    """f as an int when it is known; a traced integer scalar as it is (a sweep's f as a
    vmapped axis: its limits are the caller's to check, as `experiments.robustness` does
    for every cell before anything is traced)."""
    known = _known_int(f)
    if known is None:
        if jnp.shape(f) or not jnp.issubdtype(jnp.result_type(f), jnp.integer):
            raise ValueError(f"{name}: a traced f must be an integer scalar; got "
                             f"{jnp.result_type(f)}{list(jnp.shape(f))}.")
        return f
    return _check_count(name, "f", known)


def _check_positive(name: str, what: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{name}: {what} must be a positive number; got {value!r}.")
    return float(value)


def _require_slots(name: str, s: int, needed, rule: str) -> None:
    if _known_int(needed) is not None and s < needed:
        raise ValueError(f"{name}: needs {rule}, i.e. at least {needed} cohort slots; "
                         f"the cohort has {s}.")


# --------------------------------------------------------------------------- aggregators


def mean() -> Aggregator:
    """The plain mean over the reporting slots: Σ_i x_i / n (0 when n = 0).

    Exactly `ops.mean_or_keep(ops.weighted_sum(updates, w), Σ w, 0)` with w the mask as
    float32: the average FedAvg's server takes, bit for bit.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops import robust
      >>> agg = robust.mean()
      >>> x = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])}
      >>> update, _ = agg.aggregate(x, jnp.array([True, True, False]), jax.random.key(0),
      ...                           agg.init(None))
      >>> update["w"]
      Array([2., 3.], dtype=float32)
    """

    def aggregate(updates, mask, key, state):
        del key
        mask = _check_mask(mask, num_slots(updates))
        return _weighted_mean(_zero_absent(updates, mask), mask.astype(jnp.float32)), state

    return Aggregator(_no_state, aggregate)


def coordinate_median() -> Aggregator:
    """The coordinate-wise median over the reporting slots (Yin et al. 2018).

    Per coordinate, the middle of the n reporting values (the mean of the two middle
    ones for even n). Tolerates f < n/2; takes no f.
    """

    def aggregate(updates, mask, key, state):
        del key
        mask = _check_mask(mask, num_slots(updates))
        n = _count(mask)
        return jax.tree.map(lambda leaf: _median_of_sorted(_sorted_slots(leaf, mask), n),
                            updates), state

    return Aggregator(_no_state, aggregate)


def trimmed_mean(*, f: int | None = None, beta: float | None = None) -> Aggregator:
    """The coordinate-wise trimmed mean (Yin et al. 2018).

    Per coordinate, the n reporting values sorted, the t smallest and t largest dropped
    and the other n − 2t averaged: t = f, or t = ⌊β n⌋ for a fraction β of the reporting
    slots. t is floored so that one value stays (t ≤ ⌊(n − 1)/2⌋).

    Give exactly one of f and beta.

    Args:
      f: values trimmed from each side (needs s ≥ 2f + 1 slots).
      beta: the fraction trimmed from each side, 0 ≤ β < 1/2.
    """
    if (f is None) == (beta is None):
        raise ValueError(f"trimmed_mean: give exactly one of f (a count per side) and beta "
                         f"(a fraction per side); got f={f!r}, beta={beta!r}.")
    if f is not None:
        f = _check_f("trimmed_mean", f)
    elif isinstance(beta, bool) or not isinstance(beta, int | float) or not 0 <= beta < 0.5:
        raise ValueError(f"trimmed_mean: beta must be in [0, 0.5) (Yin et al.: β < 1/2); "
                         f"got {beta!r}.")

    def aggregate(updates, mask, key, state):
        del key
        s = num_slots(updates)
        mask = _check_mask(mask, s)
        if f is not None:
            _require_slots("trimmed_mean", s, 2 * f + 1, f"n > 2f with f = {f}")
        n = _count(mask)
        if f is not None:
            t = jnp.asarray(f, jnp.int32)
        else:  # the 1e-6 keeps β n = 3 from flooring to 2 when β n is 2.9999999
            t = jnp.floor(beta * n.astype(jnp.float32) + 1e-6).astype(jnp.int32)
        t = jnp.minimum(t, jnp.maximum((n - 1) // 2, 0))
        keep = n - 2 * t

        def one(leaf):
            srt = _sorted_slots(leaf, mask)
            rank = _broadcast(jnp.arange(s), leaf)
            kept = (rank >= t) & (rank < n - t)
            total = jnp.sum(jnp.where(kept, srt, 0), axis=0)
            return jnp.where(n > 0, total / jnp.maximum(keep, 1).astype(leaf.dtype), 0)

        return jax.tree.map(one, updates), state

    return Aggregator(_no_state, aggregate)


def multi_krum(*, f: int, m: int | None = None) -> Aggregator:
    """Multi-Krum (Blanchard et al. 2017): the mean of the m updates of lowest Krum score.

    score(i) = Σ_{j ∈ N_i} ‖x_i − x_j‖², N_i the n − f − 2 reporting updates nearest to x_i
    (itself excluded). The distances are one Gram matrix product. Ties go to the lower
    slot.

    Args:
      f: the Byzantine slots tolerated; needs s ≥ 2f + 3 (the paper's n > 2f + 2).
      m: how many lowest scorers are averaged, 1 ≤ m ≤ s − f; None: n − f.

    With fewer reporting slots than 2f + 3, a score sums at least 1 neighbour (at most
    n − 1), and m is at most max(n − f, 1).
    """
    f = _check_f("multi_krum", f)
    if m is not None:
        _check_count("multi_krum", "m", m, minimum=1)

    def aggregate(updates, mask, key, state):
        del key
        s = num_slots(updates)
        mask = _check_mask(mask, s)
        _require_slots("krum" if m == 1 else "multi_krum", s, 2 * f + 3,
                       f"n > 2f + 2 with f = {f}")
        if m is not None and _known_int(f) is not None and m > s - f:
            raise ValueError(f"multi_krum: m must be at most s - f = {s - f} (the cohort has "
                             f"{s} slots, f = {f}); got m = {m}.")
        x = _zero_absent(updates, mask)
        score = _krum_scores(pairwise_sq_distances(x, mask), mask, f)
        n = _count(mask)
        cap = jnp.maximum(n - f, 1)
        take = cap if m is None else jnp.minimum(m, cap)
        chosen = (_ranks(score) < take) & mask
        return _weighted_mean(x, chosen.astype(jnp.float32)), state

    return Aggregator(_no_state, aggregate)


def krum(*, f: int) -> Aggregator:
    """Krum (Blanchard et al. 2017): the reporting update of lowest score (`multi_krum`, m = 1).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops import robust
      >>> x = jnp.array([[0.0], [0.1], [0.2], [0.3], [9.0]])
      >>> agg = robust.krum(f=1)
      >>> agg.aggregate(x, jnp.ones(5, bool), jax.random.key(0), agg.init(None))[0]
      Array([0.1], dtype=float32)
    """
    return multi_krum(f=f, m=1)


def geometric_median(*, nu: float = 1e-6, iterations: int = 3) -> Aggregator:
    """The geometric median by the smoothed Weiszfeld algorithm: RFA (Pillutla et al. 2022).

    argmin_v Σ_i ‖v − x_i‖ over the reporting updates, approximated from v = their mean by

        β_i ← 1 / max(ν, ‖v − x_i‖);   v ← Σ_i β_i x_i / Σ_i β_i

    a fixed number of times (the paper reports that 3 suffice; its code starts from the
    mean). Tolerates f < n/2; takes no f.

    Args:
      nu: ν > 0, the smoothing (the floor of a distance).
      iterations: T ≥ 1.
    """
    nu = _check_positive("geometric_median", "nu", nu)
    _check_count("geometric_median", "iterations", iterations, minimum=1)

    def aggregate(updates, mask, key, state):
        del key
        mask = _check_mask(mask, num_slots(updates))
        x = _zero_absent(updates, mask)
        w = mask.astype(jnp.float32)

        def step(v, _):
            beta = w / jnp.maximum(nu, _distances_to(x, v))
            return _weighted_mean(x, beta), None

        v, _ = jax.lax.scan(step, _weighted_mean(x, w), None, length=iterations)
        return v, state

    return Aggregator(_no_state, aggregate)


def centered_clipping(*, tau: float, iterations: int = 1) -> Aggregator:
    """Centered clipping (Karimireddy, He, Jaggi, ICML 2021).

    From v_0 = the previous round's aggregate (zeros in the first round), L times

        v ← v + (1/n) Σ_i (x_i − v) min(1, τ / ‖x_i − v‖)

    over the reporting updates; v is this round's aggregate and the next round's centre
    (the state). A round in which nothing reports returns 0 and keeps the centre. The
    paper clips worker momenta; here, whatever the caller passes.

    Args:
      tau: τ > 0, the clipping radius.
      iterations: L ≥ 1 (the paper: 1 suffices with momentum).
    """
    tau = _check_positive("centered_clipping", "tau", tau)
    _check_count("centered_clipping", "iterations", iterations, minimum=1)

    def init(params):
        return CenteredClippingState(jax.tree.map(jnp.zeros_like, params))

    def aggregate(updates, mask, key, state: CenteredClippingState):
        del key
        mask = _check_mask(mask, num_slots(updates))
        x = _zero_absent(updates, mask)
        n = _count(mask)
        w = mask.astype(jnp.float32)

        def step(v, _):
            dist = _distances_to(x, v)
            scale = w * jnp.where(dist > tau, tau / jnp.where(dist > tau, dist, 1.0), 1.0)
            moved = jax.tree.map(
                lambda leaf, c: c + jnp.tensordot(scale.astype(leaf.dtype), leaf - c[None], 1)
                / jnp.maximum(n, 1).astype(leaf.dtype), x, v)
            return moved, None

        centre = jax.tree.map(lambda c, leaf: c.astype(leaf.dtype), state.centre, x)
        v, _ = jax.lax.scan(step, centre, None, length=iterations)
        update = _where_any(n, v, _zeros_like_one(x))
        return update, CenteredClippingState(_where_any(n, v, state.centre))

    return Aggregator(init, aggregate)


def bulyan(*, f: int) -> Aggregator:
    """Bulyan over Krum (El Mhamdi, Guerraoui, Rouault, ICML 2018).

    θ = n − 2f updates are selected by applying Krum θ times, each time to the updates not
    yet selected (its scores recomputed among them, with the same f) and moving its pick
    to the selection; then per coordinate, the β = θ − 2f selected values closest to
    their median are averaged.

    Args:
      f: the Byzantine slots tolerated; needs s ≥ 4f + 3.

    With fewer reporting slots than 4f + 3, θ and β are floored at 1 and each Krum step
    floors its neighbours as `multi_krum` does.
    """
    f = _check_f("bulyan", f)

    def aggregate(updates, mask, key, state):
        del key
        s = num_slots(updates)
        mask = _check_mask(mask, s)
        _require_slots("bulyan", s, 4 * f + 3, f"n ≥ 4f + 3 with f = {f}")
        x = _zero_absent(updates, mask)
        d2 = pairwise_sq_distances(x, mask)
        n = _count(mask)
        theta = jnp.maximum(n - 2 * f, 1)
        beta = jnp.maximum(theta - 2 * f, 1)

        def pick(t, carry):
            remaining, selected = carry
            i = jnp.argmin(_krum_scores(d2, remaining, f))
            now = (t < theta) & remaining[i]
            return remaining.at[i].set(remaining[i] & ~now), selected.at[i].set(
                selected[i] | now)

        # θ ≤ s − 2f picks; a traced f loops over s (the steps past θ change nothing)
        steps = s if _known_int(f) is None else s - 2 * f
        _, selected = jax.lax.fori_loop(0, steps, pick,
                                        (mask, jnp.zeros((s,), bool)))

        def one(leaf):
            med = _median_of_sorted(_sorted_slots(leaf, selected), theta)
            sel = _broadcast(selected, leaf)
            gap = jnp.where(sel, jnp.abs(leaf - med[None]), jnp.inf)
            _, nearest = jax.lax.sort((gap, jnp.where(sel, leaf, 0)), dimension=0, num_keys=1)
            rank = _broadcast(jnp.arange(s), leaf)
            total = jnp.sum(jnp.where(rank < beta, nearest, 0), axis=0)
            return jnp.where(n > 0, total / beta.astype(leaf.dtype), 0)

        return jax.tree.map(one, x), state

    return Aggregator(_no_state, aggregate)


# --------------------------------------------------------------------------- pre-aggregation


def bucketing(*, bucket_size: int) -> PreAggregation:
    """Bucketing (Karimireddy, He, Jaggi, ICLR 2022): means of random buckets of b updates.

    The reporting slots in the order of `jax.random.permutation(key, s)` (the
    non-reporting ones dropped) are cut into consecutive buckets of b; each bucket's
    update is the mean of its members, and the aggregator after it sees ⌈n / b⌉
    reporting buckets among ⌈s / b⌉ slots. The last bucket may hold fewer than b: its mean
    is over those (the paper's 1/b would shrink it).

    Args:
      bucket_size: b ≥ 1 (the paper's s; s = 2 repairs the rules on non-IID data).
    """
    b = _check_count("bucketing", "bucket_size", bucket_size, minimum=1)

    def apply(updates, mask, key, state):
        s = num_slots(updates)
        mask = _check_mask(mask, s)
        buckets = -(-s // b)
        perm = jax.random.permutation(key, s)
        order = perm[jnp.argsort(~mask[perm], stable=True)]  # reporting first, permuted
        pad = buckets * b - s
        order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
        member = jnp.concatenate([mask[order[:s]], jnp.zeros((pad,), bool)])
        member = member.reshape(buckets, b)
        count = jnp.sum(member, axis=1)
        x = _zero_absent(updates, mask)

        def one(leaf):
            grouped = leaf[order].reshape((buckets, b) + leaf.shape[1:])
            w = _broadcast(member, grouped).astype(leaf.dtype)
            total = jnp.sum(w * grouped, axis=1)
            return total / _broadcast(jnp.maximum(count, 1), total).astype(leaf.dtype)

        return jax.tree.map(one, x), count > 0, state

    return PreAggregation(_no_state, apply)


def nearest_neighbor_mixing(*, f: int) -> PreAggregation:
    """Nearest-neighbour mixing, NNM (Allouah et al., AISTATS 2023).

    Each reporting update is replaced by the mean of its n − f nearest reporting updates
    (itself included, at distance 0): one Gram product for the distances and one [s, s]
    mixing matrix product. Non-reporting slots stay out (and hold zeros).

    Args:
      f: the Byzantine slots tolerated; needs s ≥ 2f + 1 (the paper's f < n/2).
    """
    f = _check_f("nearest_neighbor_mixing", f)

    def apply(updates, mask, key, state):
        del key
        s = num_slots(updates)
        mask = _check_mask(mask, s)
        _require_slots("nearest_neighbor_mixing", s, 2 * f + 1, f"n > 2f with f = {f}")
        x = _zero_absent(updates, mask)
        d2 = pairwise_sq_distances(x, mask)
        n = _count(mask)
        k = jnp.maximum(n - f, 1)
        rank = jnp.argsort(jnp.argsort(d2, axis=1, stable=True), axis=1)
        near = (rank < k) & mask[:, None] & mask[None, :]
        weights = near.astype(jnp.float32) / k.astype(jnp.float32)
        mixed = jax.tree.map(
            lambda leaf: jnp.tensordot(weights.astype(leaf.dtype), leaf, 1,
                                       precision=jax.lax.Precision.HIGHEST), x)
        return mixed, mask, state

    return PreAggregation(_no_state, apply)


# --------------------------------------------------------------------------- composition


def chain(*stages) -> Aggregator:
    """Pre-aggregations, then one aggregator, as one `Aggregator` (like `optax.chain`).

    The key is split into one per stage; the state is the tuple of the stages' states.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops import robust
      >>> agg = robust.chain(robust.nearest_neighbor_mixing(f=1), robust.trimmed_mean(f=1))
      >>> x = jnp.array([[0.0], [1.0], [2.0], [3.0], [40.0]])
      >>> agg.aggregate(x, jnp.ones(5, bool), jax.random.key(0), agg.init(None))[0]
      Array([1.5], dtype=float32)
    """
    if not stages or not isinstance(stages[-1], Aggregator):
        raise ValueError("chain: needs pre-aggregations followed by one Aggregator last; got "
                         f"{[type(st).__name__ for st in stages]}.")
    pre = stages[:-1]
    wrong = [type(st).__name__ for st in pre if not isinstance(st, PreAggregation)]
    if wrong:
        raise ValueError(f"chain: every stage before the last must be a PreAggregation "
                         f"(bucketing, nearest_neighbor_mixing); got {wrong}.")
    last = stages[-1]

    def init(params):
        return tuple(st.init(params) for st in stages)

    def aggregate(updates, mask, key, state):
        keys = jax.random.split(key, len(stages))
        states = []
        for stage, k, st in zip(pre, keys, state, strict=False):
            updates, mask, st = stage.apply(updates, mask, k, st)
            states.append(st)
        update, st = last.aggregate(updates, mask, keys[-1], state[-1])
        return update, (*states, st)

    return Aggregator(init, aggregate)


class InjectedState(NamedTuple):
    hyperparams: dict  # name -> scalar array: the rule's numbers (traced in a sweep)
    inner: Any  # the rule's own state


def inject_hyperparams(factory: Callable[..., Aggregator], **hyperparams) -> Aggregator:
    """`factory(**hyperparams)` with its numbers held in the state (as
    `optax.inject_hyperparams` holds an optimizer's), so they may be traced.

    A rule built for a traced f (a sweep whose cells differ in their Byzantine share, f
    with it) cannot close over f: the state that leaves `init` would hold a closure over
    a dead tracer. Here `init` stores the values and every `aggregate` rebuilds the rule
    from the state's values; with concrete values it equals `factory(**hyperparams)`.

    Args:
      factory: keyword numbers -> an `Aggregator` (e.g. `lambda f: robust.krum(f=f)`);
        it must accept them traced (the f of `trimmed_mean`, `multi_krum`, `krum`,
        `bulyan` and `nearest_neighbor_mixing` may be).
      hyperparams: name -> a number or a scalar array (may be traced).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops import robust
      >>> x = jnp.array([[0.0], [1.0], [2.0], [3.0], [40.0]])
      >>> def at(f):
      ...     agg = robust.inject_hyperparams(lambda f: robust.trimmed_mean(f=f), f=f)
      ...     return agg.aggregate(x, jnp.ones(5, bool), jax.random.key(0), agg.init(None))[0]
      >>> jax.vmap(at)(jnp.array([0, 1, 2], jnp.int32))[:, 0]
      Array([9.2, 2. , 2. ], dtype=float32)
    """

    def init(params):
        values = {k: jnp.asarray(v) for k, v in hyperparams.items()}
        return InjectedState(values, factory(**values).init(params))

    def aggregate(updates, mask, key, state: InjectedState):
        update, inner = factory(**state.hyperparams).aggregate(updates, mask, key,
                                                               state.inner)
        return update, InjectedState(state.hyperparams, inner)

    return Aggregator(init, aggregate)
