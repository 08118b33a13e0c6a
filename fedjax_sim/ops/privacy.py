"""User-level differential privacy over a stacked cohort of client updates.

The kernels of DP federated averaging, each one jit/vmap-able function over a
cohort whose client updates Δ_i are a pytree with leaves [s, ...] (slot first)
and whose `reports` mask [s] says which slots reached the server. Every key is
explicit; no Python loop runs over clients. They are the mechanisms only: a
round that uses them, and the accounting of what they cost
(`fedjax_sim.accounting`), are separate.

DP-FedAvg (H. Brendan McMahan, Daniel Ramage, Kunal Talwar, Li Zhang, "Learning
Differentially Private Recurrent Language Models", ICLR 2018, arXiv:1710.06963),
one round's aggregation:

    ‖Δ_i‖   = sqrt(Σ over every leaf and coordinate of Δ_i²)      (flat over the pytree)
    Δ̄_i     = Δ_i · min(1, C / ‖Δ_i‖)                              (clip to L2 norm C)
    S̃       = Σ_{i reports} w_i Δ̄_i + N(0, σ² C² I)                (noised sum)
    Δ       = S̃ / D,   D = the expected cohort size qN (fixed), or the count Σ w_i

Sensitivity: adding or removing one client (add/remove adjacency, Poisson
sampling) moves the clipped sum by at most C (w_i ≤ 1), so the noised sum is the
Gaussian mechanism with noise multiplier σ. Replacing one client by another
(replace-one adjacency, fixed-size sampling) moves it by at most 2C. A fixed
denominator keeps the mean's sensitivity C/D; the count denominator is exact
only where the count is public (fixed-size sampling, every slot reporting):
under Poisson sampling it reveals whether a client took part, so use the fixed
one (McMahan et al.'s fixed-denominator estimator).

Per cluster (IFCA, HypCluster, CFL): each reporting client adds its clipped
update to exactly one of the k cluster sums, so the k sums together move by at
most C in L2 (the vector of sums changes in one block only). Noising each of the
k sums with N(0, σ²C²) is one Gaussian mechanism of multiplier σ on the
concatenated vector: the k noised sums cost what one noised sum costs. The
per-cluster counts are data (which cluster a client picks depends on its data):
divide by fixed expected counts, or accept that the count rule is not private.

Adaptive clipping (Galen Andrew, Om Thakkar, H. Brendan McMahan, Swaroop
Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS
2021, arXiv:1905.03871): C tracks the γ-quantile of the update norms,

    b_i     = 1[‖Δ_i‖ ≤ C]                                  (unclipped at this round's C)
    b̃       = (Σ_{i reports} (b_i − ½) + N(0, σ_b²)) / D + ½, clipped to [0, 1]
    C      ← C · exp(−η_C (b̃ − γ))                         (geometric update)

Centering b_i at ½ halves the count's sensitivity (½), so the count is a
Gaussian mechanism of multiplier 2σ_b; the update sum is noised with
σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) so the pair costs one Gaussian of multiplier σ
(`adaptive_noise_multiplier`). The paper's defaults: γ = 0.5, η_C = 0.2,
σ_b = D / 20.

DP-FTRL's tree aggregation (Peter Kairouz, Brendan McMahan, Shuang Song, Om
Thakkar, Abhradeep Thakurta, Zheng Xu, "Practical and Private (Deep) Learning
without Sampling or Shuffling", ICML 2021, arXiv:2103.00039): the model is
θ_t = θ_0 − η (Σ_{τ≤t} g_τ + n_t), where n_t, the noise of the prefix sum, is
the sum of the binary tree's nodes that cover steps 1..t, one per set bit of t,
each N(0, σ²C²). A leaf lies in at most ⌈log₂(T+1)⌉ nodes, which is what
`accounting.tree_epsilon` charges. `tree_noise_init` / `tree_noise_step` keep
the latest node of each level (a scan-friendly state): step t draws one node,
at level ctz(t), from its key.

Key use, so a test can redraw the noise: a pytree's noise draws one
`jax.random.normal(k_j, leaf.shape, leaf.dtype)` per leaf j with
`k = jax.random.split(key, number of leaves)` (`gaussian_noise`); a kernel that
also noises a count splits `key_sum, key_count = jax.random.split(key)` first,
and the count's draw is `jax.random.normal(key_count, count.shape)`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fedjax_sim.ops.aggregation import divide_segments, mean_or_keep, segment_totals


def _concrete(value) -> float | None:
    """value as a Python float when it is a concrete number (not traced), else None."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_clip_norm(clip_norm) -> None:
    """ValueError unless a concrete clip_norm is a finite number > 0 (traced: unchecked)."""
    value = _concrete(clip_norm)
    if value is not None and not (math.isfinite(value) and value > 0):
        raise ValueError(f"clip_norm must be a finite number > 0; got {clip_norm!r}.")


def check_noise_multiplier(noise_multiplier, name: str = "noise_multiplier") -> None:
    """ValueError unless a concrete noise multiplier is a finite number >= 0."""
    value = _concrete(noise_multiplier)
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0; got {noise_multiplier!r}.")


def _rows(vector: jax.Array, leaf: jax.Array) -> jax.Array:
    """[s] broadcast against a leaf [s, ...]."""
    return vector.reshape(vector.shape + (1,) * (leaf.ndim - vector.ndim)).astype(leaf.dtype)


# ------------------------------------------------------------------------------- clipping


def client_norms(updates) -> jax.Array:
    """[s] L2 norm of each client's whole update, flat over every leaf of the pytree.

    ‖Δ_i‖ = sqrt(Σ_leaves Σ_coordinates Δ_i²), summed in at least float32.

    Args:
      updates: pytree, leaves [s, ...].
    """
    leaves = jax.tree.leaves(updates)
    if not leaves:
        raise ValueError("updates must hold at least one array (leaves [s, ...]).")
    s = leaves[0].shape[0]

    def squares(leaf):
        dtype = jnp.promote_types(leaf.dtype, jnp.float32)
        return jnp.sum(jnp.square(leaf.astype(dtype)).reshape(s, -1), axis=1)

    return jnp.sqrt(sum(squares(leaf) for leaf in leaves))


def clip_factors(norms: jax.Array, clip_norm) -> jax.Array:
    """[s] min(1, C / ‖Δ_i‖): the scale that brings each update inside the ball of radius C
    (1 for a zero update)."""
    return jnp.minimum(1.0, clip_norm / jnp.maximum(norms, jnp.finfo(norms.dtype).tiny))


def clip_updates(updates, clip_norm):
    """Δ̄_i = Δ_i · min(1, C / ‖Δ_i‖), each client's update clipped to L2 norm C.

    Args:
      updates: pytree, leaves [s, ...].
      clip_norm: C > 0 (may be traced: adaptive clipping, a sweep).

    Returns:
      (clipped updates, leaves [s, ...]; [s] norms before clipping).
    """
    check_clip_norm(clip_norm)
    norms = client_norms(updates)
    scale = clip_factors(norms, clip_norm)
    return jax.tree.map(lambda u: u * _rows(scale, u), updates), norms


class ClippedSum(NamedTuple):
    """What a cohort (or a chunk of it) adds up before the server noises it.

    Every field is additive over clients: a round that visits its cohort in chunks
    adds the chunks' ClippedSums (`optax.tree.add`) and noises once.
    """

    total: Any  # pytree like one update (leaves [...]), or per cluster (leaves [k, ...])
    count: jax.Array  # [] or [k] float32: Σ_{i reports} w_i
    below: jax.Array  # [] or [k] float32: Σ_{i reports, w_i > 0} (1[‖Δ_i‖ ≤ C] − ½)


def _report_weights(reports, weights, s: int) -> jax.Array:
    w = jnp.ones((s,), jnp.float32) if weights is None else weights.astype(jnp.float32)
    return w if reports is None else jnp.where(reports, w, 0.0)


def clipped_sum(updates, clip_norm, reports=None, weights=None) -> ClippedSum:
    """Σ_{i reports} w_i Δ̄_i, the reporting count and the centered unclipped count.

    The clip is a per-client scale, so the sum is one weighted sum of the raw
    updates, Σ_i (w_i min(1, C/‖Δ_i‖)) Δ_i: no clipped copy of the cohort is made.

    Args:
      updates: pytree, leaves [s, ...].
      clip_norm: C > 0.
      reports: [s] bool, the slots whose update reaches the server (None: all). A
        slot that does not report adds nothing (its finite update gets weight 0, as
        in `ops.weighted_sum`) and is not counted.
      weights: [s] client weights w_i in [0, 1] (None: 1). The sensitivity stays C
        only for w_i ≤ 1 (McMahan et al.'s capped weights w_i = min(n_i / ŵ, 1)).

    Returns:
      ClippedSum(total with leaves [...], count [], below []).
    """
    check_clip_norm(clip_norm)
    norms = client_norms(updates)
    w = _report_weights(reports, weights, norms.shape[0])
    scale = w * clip_factors(norms, clip_norm)
    total = jax.tree.map(lambda u: jnp.tensordot(scale.astype(u.dtype), u, axes=1), updates)
    below = jnp.sum(jnp.where(w > 0, (norms <= clip_norm) - 0.5, 0.0)).astype(jnp.float32)
    return ClippedSum(total, jnp.sum(w), below)


def clipped_cluster_sums(updates, segment_ids: jax.Array, num_clusters: int, clip_norm,
                         reports=None, weights=None) -> ClippedSum:
    """Per cluster j: Σ_{i reports, id_i = j} w_i Δ̄_i, the count and the centered count.

    Args:
      updates: pytree, leaves [s, ...].
      segment_ids: [s] ints, each client's cluster; ids outside [0, k) are dropped.
      num_clusters: k (static).
      clip_norm, reports, weights: as in `clipped_sum`.

    Returns:
      ClippedSum(total with leaves [k, ...], count [k], below [k]).
    """
    check_clip_norm(clip_norm)
    norms = client_norms(updates)
    w = _report_weights(reports, weights, norms.shape[0])
    scale = w * clip_factors(norms, clip_norm)
    totals, _ = segment_totals(updates, segment_ids, num_clusters, scale)
    count = jax.ops.segment_sum(w, segment_ids, num_clusters)
    centered = jnp.where(w > 0, (norms <= clip_norm) - 0.5, 0.0).astype(jnp.float32)
    below = jax.ops.segment_sum(centered, segment_ids, num_clusters)
    return ClippedSum(totals, count, below)


# ---------------------------------------------------------------------------------- noise


def gaussian_noise(key, like, stddev):
    """N(0, stddev²) per coordinate, a pytree shaped like `like`.

    Leaf j is `stddev * jax.random.normal(k_j, leaf.shape, leaf.dtype)` with
    `k = jax.random.split(key, number of leaves)`, leaves in `jax.tree.leaves` order.
    """
    leaves, treedef = jax.tree.flatten(like)
    keys = jax.random.split(key, len(leaves))
    noise = [jnp.asarray(stddev, leaf.dtype) * jax.random.normal(k, leaf.shape, leaf.dtype)
             for k, leaf in zip(keys, leaves, strict=True)]
    return jax.tree.unflatten(treedef, noise)


def add_noise(total, key, stddev):
    """total + `gaussian_noise(key, total, stddev)`."""
    return jax.tree.map(jnp.add, total, gaussian_noise(key, total, stddev))


class NoisedMean(NamedTuple):
    """A privatised mean of client updates."""

    mean: Any  # pytree like one update, or leaves [k, ...] per cluster
    count: jax.Array  # [] or [k] float32: the exact reporting count (not private)
    denominator: jax.Array  # [] or [k] float32: what the noised sum was divided by
    below: jax.Array  # [] or [k] float32: the exact centered unclipped count (not private)


def _denominator(count, denominator, count_stddev, key_count):
    if denominator is not None:
        return jnp.broadcast_to(jnp.asarray(denominator, jnp.float32), count.shape)
    if count_stddev is None:
        return count
    return jnp.maximum(count + count_stddev * jax.random.normal(key_count, count.shape), 1.0)


def noised_mean(updates, key, *, clip_norm, noise_multiplier, reports=None, weights=None,
                denominator=None, count_stddev=None) -> NoisedMean:
    """DP-FedAvg's aggregate: (Σ_{i reports} w_i Δ̄_i + N(0, σ²C² I)) / D.

    Args:
      updates: pytree, leaves [s, ...].
      key: the noise's key (split `key_sum, key_count`; see the module docstring).
      clip_norm: C > 0.
      noise_multiplier: σ ≥ 0 (σ_Δ under adaptive clipping); the sum's noise is σC.
      reports, weights: as in `clipped_sum`.
      denominator: D. A number (the expected cohort size qN, or the fixed cohort
        size): the fixed-denominator estimator, whose sensitivity is C/D. None: the
        reporting count Σ w_i (a round with a zero count returns a zero mean).
      count_stddev: with denominator None, noise N(0, count_stddev²) added to the
        count, floored at 1, before dividing (a Gaussian query of sensitivity 1 of its
        own: account for it with `accounting.combined_noise_multiplier`). None: the
        exact count.

    Returns:
      NoisedMean(mean, count, denominator, below).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops.privacy import noised_mean
      >>> updates = {"w": jnp.array([[3.0, 4.0], [0.3, 0.4], [9.0, 9.0]])}  # norms 5, .5, 12.7
      >>> out = noised_mean(updates, jax.random.key(0), clip_norm=1.0, noise_multiplier=0.0,
      ...                   reports=jnp.array([True, True, False]), denominator=2.0)
      >>> [round(float(v), 3) for v in out.mean["w"]], float(out.count), float(out.below)
      ([0.45, 0.6], 2.0, 0.0)
    """
    check_noise_multiplier(noise_multiplier)
    sums = clipped_sum(updates, clip_norm, reports, weights)
    return privatize(sums, key, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                     denominator=denominator, count_stddev=count_stddev)


def privatize(sums: ClippedSum, key, *, clip_norm, noise_multiplier, denominator=None,
              count_stddev=None, fallback=None) -> NoisedMean:
    """The server's half of `noised_mean` / `noised_cluster_means`: noise and divide.

    For a round that adds its `ClippedSum` over chunks of the cohort. The noise is
    drawn with the shape of `sums.total`, so per-cluster sums ([k, ...]) get k
    independent draws.

    Args:
      sums: from `clipped_sum` or `clipped_cluster_sums` (added over chunks).
      key, clip_norm, noise_multiplier, denominator, count_stddev: as in `noised_mean`
        (`denominator` may be [k] per cluster).
      fallback: per cluster only, with the count rule: leaves [k, ...] returned for
        a cluster whose count is 0 (IFCA keeps an empty cluster's model). Default:
        zeros. The fixed denominator never reads the count.
    """
    check_noise_multiplier(noise_multiplier)
    check_clip_norm(clip_norm)
    key_sum, key_count = jax.random.split(key)
    noised = add_noise(sums.total, key_sum, noise_multiplier * clip_norm)
    denom = _denominator(sums.count, denominator, count_stddev, key_count)
    if denominator is None and count_stddev is None:  # the exact count: keep what an
        if fallback is None:  # empty round (cluster) had
            fallback = jax.tree.map(jnp.zeros_like, noised)
        if sums.count.ndim == 0:
            mean = mean_or_keep(noised, sums.count, fallback)
        else:
            mean = divide_segments(noised, sums.count, fallback)
    else:  # a fixed or noised denominator: nothing reads the exact count
        mean = jax.tree.map(lambda t: t / _rows(denom, t), noised)
    return NoisedMean(mean, sums.count, denom, sums.below)


def noised_cluster_means(updates, segment_ids: jax.Array, num_clusters: int, key, *,
                         clip_norm, noise_multiplier, reports=None, weights=None,
                         denominators=None, count_stddev=None, fallback=None) -> NoisedMean:
    """Per cluster j: (Σ_{i reports, id_i = j} w_i Δ̄_i + N(0, σ²C² I)) / D_j.

    A client adds to exactly one cluster's sum, so the k noised sums together are one
    Gaussian mechanism of multiplier σ (module docstring): they cost what one
    `noised_mean` costs.

    Args:
      updates: pytree, leaves [s, ...].
      segment_ids: [s] ints, each client's cluster (outside [0, k): dropped).
      num_clusters: k (static).
      key, clip_norm, noise_multiplier, reports, weights, count_stddev: as in
        `noised_mean`.
      denominators: D_j: a number or [k] (fixed expected cluster sizes), or None (the
        clusters' counts, which are not private).
      fallback: leaves [k, ...], with the count rule, for a cluster nobody reported to.

    Returns:
      NoisedMean(mean with leaves [k, ...], count [k], denominator [k], below [k]).
    """
    sums = clipped_cluster_sums(updates, segment_ids, num_clusters, clip_norm, reports, weights)
    return privatize(sums, key, clip_norm=clip_norm, noise_multiplier=noise_multiplier,
                     denominator=denominators, count_stddev=count_stddev, fallback=fallback)


# ------------------------------------------------------------------------ adaptive clipping


def adaptive_noise_multiplier(noise_multiplier, count_stddev):
    """σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2): the update sum's multiplier under adaptive clipping.

    Andrew et al. (arXiv:1905.03871): the centered unclipped count (sensitivity ½)
    noised with N(0, σ_b²) is a Gaussian of multiplier 2σ_b; with the update sum at
    σ_Δ the pair costs one Gaussian of multiplier σ, the one to account for.

    Args:
      noise_multiplier: σ > 0, the total multiplier (what the accountant charges).
      count_stddev: σ_b > σ / 2, the count's noise (the paper: D / 20).
    """
    z, b = _concrete(noise_multiplier), _concrete(count_stddev)
    if z is not None and b is not None and not (z > 0 and 2 * b > z):
        raise ValueError(f"adaptive clipping needs noise_multiplier > 0 and count_stddev > "
                         f"noise_multiplier / 2 (the count alone would spend the whole "
                         f"budget); got noise_multiplier={noise_multiplier!r}, "
                         f"count_stddev={count_stddev!r}.")
    return (noise_multiplier ** -2.0 - (2.0 * count_stddev) ** -2.0) ** -0.5


def adaptive_clip_update(clip_norm, below, key, *, target_quantile, learning_rate,
                         count_stddev, expected_count):
    """One geometric step of the clip toward the γ-quantile of the update norms.

    b̃ = clip((below + N(0, σ_b²)) / D + ½, 0, 1);  C ← C · exp(−η_C (b̃ − γ)).

    Args:
      clip_norm: [] the C the round clipped with.
      below: [] (or [k]) Σ_{i reports} (1[‖Δ_i‖ ≤ C] − ½), `ClippedSum.below`.
      key: the count noise's key (`jax.random.normal(key, below.shape)`).
      target_quantile: γ in [0, 1], the fraction of updates left unclipped.
      learning_rate: η_C ≥ 0.
      count_stddev: σ_b ≥ 0 (0: the exact fraction, not private).
      expected_count: D > 0, the expected number of reporting clients.

    Returns:
      (new clip norm, b̃ the noised unclipped fraction), each shaped like `below`.
    """
    gamma = _concrete(target_quantile)
    if gamma is not None and not 0.0 <= gamma <= 1.0:
        raise ValueError(f"target_quantile must be in [0, 1]; got {target_quantile!r}.")
    expected = _concrete(expected_count)
    if expected is not None and not expected > 0:
        raise ValueError(f"expected_count must be > 0; got {expected_count!r}.")
    noised = below + count_stddev * jax.random.normal(key, jnp.shape(below))
    fraction = jnp.clip(noised / expected_count + 0.5, 0.0, 1.0)
    return clip_norm * jnp.exp(-learning_rate * (fraction - target_quantile)), fraction


# ------------------------------------------------------------------------- tree aggregation


class TreeNoiseState(NamedTuple):
    """The binary tree of DP-FTRL's noise, as a scan carry."""

    nodes: Any  # pytree like one update, leaves [depth, ...]: the latest node of each level
    step: jax.Array  # int32, steps taken (t after step t)


def tree_depth(num_steps: int) -> int:
    """Levels a tree over `num_steps` leaves needs: ⌊log₂ T⌋ + 1 (so 2^depth > T)."""
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"num_steps must be an integer >= 1; got {num_steps!r}.")
    return num_steps.bit_length()


def tree_noise_init(like, num_steps: int) -> TreeNoiseState:
    """An empty tree for up to `num_steps` steps, node noise shaped like `like`."""
    depth = tree_depth(num_steps)
    nodes = jax.tree.map(lambda x: jnp.zeros((depth,) + jnp.shape(x), jnp.result_type(x)), like)
    return TreeNoiseState(nodes, jnp.zeros((), jnp.int32))


def _trailing_zeros(t: jax.Array) -> jax.Array:
    return jax.lax.population_count((t & -t) - 1)


def tree_noise_step(state: TreeNoiseState, key, stddev):
    """Step t = state.step + 1: the noise n_t of the prefix sum Σ_{τ≤t} g_τ.

    Node (level l, index i) covers steps i·2^l + 1 … (i + 1)·2^l and is drawn, as
    `gaussian_noise(key_t, ·, stddev)`, at the step t = (i + 1)·2^l it completes, with
    that step's key. n_t = Σ over the set bits l of t of the latest node at level l
    (the dyadic decomposition of 1..t). Only the nodes that some prefix uses are drawn
    (one per step, at level ctz(t)), a post-processing of the full tree the
    accountant charges.

    Args:
      state: from `tree_noise_init` or the previous step.
      key: this step's key.
      stddev: σC, each node's noise.

    Returns:
      (new state, n_t shaped like one update). Past the tree's capacity
      (t ≥ 2^depth) n_t is NaN: restart the tree (`tree_noise_init`) each epoch.
    """
    t = state.step + 1
    depth = jax.tree.leaves(state.nodes)[0].shape[0]
    level = _trailing_zeros(t)
    like = jax.tree.map(lambda n: n[0], state.nodes)
    new = gaussian_noise(key, like, stddev)
    nodes = jax.tree.map(lambda n, x: n.at[level].set(x, mode="drop"), state.nodes, new)
    bits = (t >> jnp.arange(depth)) & 1
    within = t < (1 << depth)

    def prefix(n):
        total = jnp.tensordot(bits.astype(n.dtype), n, axes=1)
        return jnp.where(within, total, jnp.nan)

    return TreeNoiseState(nodes, t), jax.tree.map(prefix, nodes)
