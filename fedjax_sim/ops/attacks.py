"""Byzantine attacks on a stacked cohort of updates: each a function of the round's honest updates.

Every attack is built by a factory and called as

    attacked = attack(updates, byzantine, key, mask=None)

with `updates` a pytree with leaves [s, ...] holding what every slot computed honestly,
`byzantine` a [s] bool of the Byzantine slots and `mask` a [s] bool of the reporting ones
(default: all). The Byzantine slots' entries are replaced; every other entry is returned
as it came, bit for bit (so no Byzantine slot means no change). The attacks are
omniscient, as in their papers: their statistics are over the honest reporting slots
(mask & ~byzantine) of the round, never over a non-reporting one.

    sign_flip(scale)        x_b ← −c x_b, the slot's own update
    gaussian_noise(sigma)   x_b ~ N(0, σ² I), independent per slot          (Blanchard et al.)
    a_little_is_enough(z)   μ − z σ per coordinate, z = Φ⁻¹((n − s)/n),
                            s = ⌊n/2 + 1⌋ − f                                (Baruch et al.)
    inner_product_manipulation(ε)   −ε μ                                     (Xie et al.)
    min_max, min_sum        μ + γ p, the largest γ whose max (sum) of squared distances to
                            the honest updates stays within theirs  (Shejwalkar, Houmansadr)
    mimic                   every Byzantine copies one honest update  (Karimireddy et al. 2022)
    label_flip(C)           the Byzantine clients train on y ← C − 1 − y (`flip_labels`; a
                            data-level attack, applied by `with_aggregator`)
    one_of(attacks, index)  attacks[index], by `lax.switch` on an index that may be traced
                            (`switch`): a sweep's attack as a vmapped axis of one program

μ and σ are the honest updates' mean and standard deviation per coordinate (σ with the
n − 1 divisor, as the papers' code computes it; 0 with fewer than two honest slots); n
and f count the reporting slots and the reporting Byzantine ones.

References:
  Peva Blanchard, El Mahdi El Mhamdi, Rachid Guerraoui, Julien Stainer, "Machine Learning
  with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017.
  Moran Baruch, Gilad Baruch, Yoav Goldberg, "A Little Is Enough: Circumventing Defenses
  For Distributed Learning", NeurIPS 2019, arXiv:1902.06156.
  Cong Xie, Oluwasanmi Koyejo, Indranil Gupta, "Fall of Empires: Breaking Byzantine-tolerant
  SGD by Inner Product Manipulation", UAI 2020, arXiv:1903.03936.
  Virat Shejwalkar, Amir Houmansadr, "Manipulating the Byzantine: Optimizing Model Poisoning
  Attacks and Defenses for Federated Learning", NDSS 2021.
  Sai Praneeth Karimireddy, Lie He, Martin Jaggi, "Byzantine-Robust Learning on
  Heterogeneous Datasets via Bucketing", ICLR 2022, arXiv:2006.09365.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri

from fedjax_sim.ops.robust import (
    _broadcast,
    _check_mask,
    _count,
    _known_int,
    _sq_norms,
    _weighted_mean,
    _zero_absent,
    num_slots,
    pairwise_sq_distances,
)

Attack = Callable  # (updates, byzantine, key, mask=None) -> updates

DIRECTIONS = ("std", "sign", "unit")


def _masks(updates, byzantine, mask):
    s = num_slots(updates)
    byzantine = _check_mask(byzantine, s, "byzantine")
    mask = jnp.ones((s,), bool) if mask is None else _check_mask(mask, s)
    return byzantine, mask, mask & ~byzantine


def _replace(updates, byzantine, crafted):
    """Byzantine slots get `crafted` (leaves [s, ...], or [...] for one shared vector)."""
    def one(leaf, c):
        c = jnp.broadcast_to(c.astype(leaf.dtype), leaf.shape)
        return jnp.where(_broadcast(byzantine, leaf), c, leaf)

    return jax.tree.map(one, updates, crafted)


def honest_moments(updates, honest):
    """(μ, σ): per coordinate mean and standard deviation (n − 1 divisor) over the slots of
    `honest`; σ = 0 with fewer than two, both 0 with none."""
    x = _zero_absent(updates, honest)
    w = honest.astype(jnp.float32)
    mu = _weighted_mean(x, w)
    k = _count(honest)

    def std(leaf, m):
        dev = jnp.where(_broadcast(honest, leaf), leaf - m[None], 0)
        var = jnp.sum(jnp.square(dev), axis=0) / jnp.maximum(k - 1, 1).astype(leaf.dtype)
        return jnp.where(k > 1, jnp.sqrt(var), 0)

    return mu, jax.tree.map(std, x, mu)


def _check_number(name: str, what: str, value, positive: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or (positive and not value > 0):
        kind = "a positive number" if positive else "a finite number"
        raise ValueError(f"{name}: {what} must be {kind}; got {value!r}.")
    return float(value)


def _check_iterations(name: str, what: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: {what} must be an integer >= {minimum}; got {value!r}.")
    return value


# --------------------------------------------------------------------------- attacks


def sign_flip(*, scale: float = 1.0) -> Attack:
    """Each Byzantine slot sends its own update times −c.

    Args:
      scale: c > 0.
    """
    c = _check_number("sign_flip", "scale", scale, positive=True)

    def attack(updates, byzantine, key, mask=None):
        del key
        byzantine, _, _ = _masks(updates, byzantine, mask)
        return _replace(updates, byzantine, jax.tree.map(lambda leaf: -c * leaf, updates))

    return attack


def gaussian_noise(*, sigma: float = 1.0) -> Attack:
    """Each Byzantine slot sends a draw of N(0, σ² I), independent across slots (Blanchard
    et al.'s Gaussian Byzantine vectors).

    Args:
      sigma: σ > 0.
    """
    sigma = _check_number("gaussian_noise", "sigma", sigma, positive=True)

    def attack(updates, byzantine, key, mask=None):
        byzantine, _, _ = _masks(updates, byzantine, mask)
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(key, len(leaves))
        noise = [sigma * jax.random.normal(k, leaf.shape, leaf.dtype)
                 for k, leaf in zip(keys, leaves, strict=True)]
        return _replace(updates, byzantine, jax.tree.unflatten(treedef, noise))

    return attack


def alie_z(n, f):
    """Baruch et al.'s z_max: s = ⌊n/2 + 1⌋ − f supporters needed, z = Φ⁻¹((n − s)/n).

    s is floored at 1 (a Byzantine majority needs no cover); n = 0 gives z = 0.
    """
    n = jnp.asarray(n, jnp.int32)
    s = jnp.maximum(n // 2 + 1 - f, 1)
    return jnp.where(n > 0, ndtri((n - s) / jnp.maximum(n, 1).astype(jnp.float32)), 0.0)


def a_little_is_enough(*, z: float | None = None) -> Attack:
    """A Little Is Enough (Baruch, Baruch, Goldberg, NeurIPS 2019).

    Every Byzantine slot sends μ − z σ per coordinate, μ and σ over the honest reporting
    updates. z = `alie_z(n, f)` from the reporting count n and the reporting Byzantine
    count f of the round, as the paper's Algorithm 1 sets z_max, unless given.

    Args:
      z: a fixed z ≥ 0 instead of the paper's.
    """
    if z is not None:
        z = _check_number("a_little_is_enough", "z", z)
        if z < 0:
            raise ValueError(f"a_little_is_enough: z must be >= 0; got {z!r}.")

    def attack(updates, byzantine, key, mask=None):
        del key
        byzantine, mask, honest = _masks(updates, byzantine, mask)
        mu, sigma = honest_moments(updates, honest)
        zz = alie_z(_count(mask), _count(mask & byzantine)) if z is None else z
        crafted = jax.tree.map(lambda m, sd: m - (zz * sd).astype(m.dtype), mu, sigma)
        return _replace(updates, byzantine, crafted)

    return attack


def inner_product_manipulation(*, epsilon: float = 0.1) -> Attack:
    """Inner-product manipulation (Xie, Koyejo, Gupta, UAI 2020): every Byzantine slot sends
    −ε μ, μ the honest reporting updates' mean (the paper: ε = 0.1 breaks Krum and the
    median, ε = 100 the mean).

    Args:
      epsilon: ε > 0.
    """
    eps = _check_number("inner_product_manipulation", "epsilon", epsilon, positive=True)

    def attack(updates, byzantine, key, mask=None):
        del key
        byzantine, _, honest = _masks(updates, byzantine, mask)
        mu = _weighted_mean(_zero_absent(updates, honest), honest.astype(jnp.float32))
        return _replace(updates, byzantine, jax.tree.map(lambda m: -eps * m, mu))

    return attack


def _perturbation(direction: str, mu, sigma):
    """Shejwalkar and Houmansadr's p: −σ ("std"), −sign(μ) ("sign"), −μ/‖μ‖ ("unit")."""
    if direction == "std":
        return jax.tree.map(jnp.negative, sigma)
    if direction == "sign":
        return jax.tree.map(lambda m: -jnp.sign(m), mu)
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(m.astype(jnp.float32))) for m in jax.tree.leaves(mu)))
    return jax.tree.map(lambda m: -m / jnp.maximum(norm, 1e-30).astype(m.dtype), mu)


def largest_feasible(feasible: Callable, gamma_init: float, expansions: int, iterations: int):
    """The largest γ ≥ 0 with feasible(γ), for a feasible set [0, γ*] (0 must be feasible).

    γ doubles from `gamma_init` while feasible (at most `expansions` times), then
    `iterations` bisection steps halve the bracket [last feasible, first infeasible];
    returns its feasible end, within bracket / 2^iterations of γ*. Fixed step counts:
    one compiled loop, no data-dependent trip count.
    """
    def expand(_, carry):
        lo, hi = carry
        ok = feasible(hi)
        return jnp.where(ok, hi, lo), jnp.where(ok, 2 * hi, hi)

    def bisect(_, carry):
        lo, hi = carry
        mid = (lo + hi) / 2
        ok = feasible(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    start = (jnp.float32(0.0), jnp.float32(gamma_init))
    lo, hi = jax.lax.fori_loop(0, expansions, expand, start)
    lo, _ = jax.lax.fori_loop(0, iterations, bisect, (lo, hi))
    return lo


def _min_max_or_sum(name: str, objective: str, direction: str, gamma_init: float,
                    expansions: int, iterations: int) -> Attack:
    if direction not in DIRECTIONS:
        raise ValueError(f"{name}: direction must be one of {DIRECTIONS}; got {direction!r}.")
    gamma_init = _check_number(name, "gamma_init", gamma_init, positive=True)
    _check_iterations(name, "expansions", expansions, minimum=0)
    _check_iterations(name, "iterations", iterations, minimum=0)

    def attack(updates, byzantine, key, mask=None):
        del key
        byzantine, _, honest = _masks(updates, byzantine, mask)
        x = _zero_absent(updates, honest)
        mu, sigma = honest_moments(updates, honest)
        p = _perturbation(direction, mu, sigma)
        # ‖μ + γp − x_i‖² = c_i + 2γ b_i + γ² a: three reductions, then each γ is O(s).
        diff = jax.tree.map(lambda m, leaf: m[None] - leaf, mu, x)
        c = _sq_norms(diff)
        b = sum(jnp.sum((d * q[None]).reshape(d.shape[0], -1).astype(jnp.float32), axis=1)
                for d, q in zip(jax.tree.leaves(diff), jax.tree.leaves(p), strict=True))
        a = jnp.sum(_sq_norms(jax.tree.map(lambda q: q[None], p)))
        d2 = jnp.where(honest[:, None] & honest[None, :], pairwise_sq_distances(x, honest), 0.0)
        if objective == "max":  # Min-Max: max_i ‖m − x_i‖² ≤ max_{i,j} ‖x_i − x_j‖²
            bound = jnp.max(d2)

            def feasible(g):
                return jnp.max(jnp.where(honest, c + 2 * g * b + g * g * a, -jnp.inf)) <= bound
        else:  # Min-Sum: Σ_i ‖m − x_i‖² ≤ max_i Σ_j ‖x_i − x_j‖²
            bound = jnp.max(jnp.sum(d2, axis=1))

            def feasible(g):
                return jnp.sum(jnp.where(honest, c + 2 * g * b + g * g * a, 0.0)) <= bound

        gamma = largest_feasible(feasible, gamma_init, expansions, iterations)
        crafted = jax.tree.map(lambda m, q: m + gamma.astype(m.dtype) * q, mu, p)
        return _replace(updates, byzantine, crafted)

    return attack


def min_max(*, direction: str = "std", gamma_init: float = 10.0, expansions: int = 30,
            iterations: int = 30) -> Attack:
    """Min-Max (Shejwalkar, Houmansadr, NDSS 2021): every Byzantine slot sends μ + γ p with
    the largest γ such that its largest squared distance to an honest update is at most
    the largest between two honest updates.

    The paper searches γ from γ_init = 10 with halving steps to a threshold; here
    `largest_feasible` doubles γ from γ_init then bisects, fixed step counts (the distances
    are convex in γ, so the feasible γ form an interval [0, γ*]).

    Args:
      direction: p = −σ ("std", the paper's best), −sign(μ) ("sign") or −μ/‖μ‖ ("unit").
      gamma_init: the first γ tried.
      expansions, iterations: doublings, then bisection steps.
    """
    return _min_max_or_sum("min_max", "max", direction, gamma_init, expansions, iterations)


def min_sum(*, direction: str = "std", gamma_init: float = 10.0, expansions: int = 30,
            iterations: int = 30) -> Attack:
    """Min-Sum (Shejwalkar, Houmansadr, NDSS 2021): as `min_max`, with the constraint that
    the sum of its squared distances to the honest updates is at most the largest such
    sum of an honest update.
    """
    return _min_max_or_sum("min_sum", "sum", direction, gamma_init, expansions, iterations)


def mimic(*, target: int | None = None, iterations: int = 10) -> Attack:
    """Mimic (Karimireddy, He, Jaggi, ICLR 2022): every Byzantine slot copies one honest update.

    target=None: the paper's heuristic, applied to each round's honest updates on its
    own: z, the direction of largest variance of the honest updates (power iteration
    on their centred Gram form from a random start, `iterations` steps), and the copied
    update the honest x_i of largest ⟨x_i, z⟩. The paper instead accumulates z over a
    warm-up phase of rounds and then fixes the copied client; that stateful form is not
    implemented. target=k (the simple variant): the honest reporting slot of rank k in
    slot order (modulo their number).

    Args:
      target: None, or k ≥ 0.
      iterations: power-iteration steps (target=None).
    """
    if target is not None:
        _check_iterations("mimic", "target", target, minimum=0)
    _check_iterations("mimic", "iterations", iterations)

    def attack(updates, byzantine, key, mask=None):
        byzantine, _, honest = _masks(updates, byzantine, mask)
        s = byzantine.shape[0]
        x = _zero_absent(updates, honest)
        if target is None:
            mu = _weighted_mean(x, honest.astype(jnp.float32))
            dev = jax.tree.map(lambda leaf, m: jnp.where(_broadcast(honest, leaf),
                                                         leaf - m[None], 0), x, mu)
            leaves, treedef = jax.tree.flatten(mu)
            keys = jax.random.split(key, len(leaves))
            z0 = jax.tree.unflatten(treedef, [jax.random.normal(k, m.shape, m.dtype)
                                              for k, m in zip(keys, leaves, strict=True)])

            def project(tree, z):  # [s] ⟨tree_i, z⟩
                return sum(jnp.sum((t * v[None]).reshape(s, -1), axis=1)
                           for t, v in zip(jax.tree.leaves(tree), jax.tree.leaves(z),
                                           strict=True))

            def power(_, z):
                z = jax.tree.map(lambda d: jnp.tensordot(project(dev, z).astype(d.dtype), d, 1),
                                 dev)
                norm = jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(z)))
                return jax.tree.map(lambda v: v / jnp.maximum(norm, 1e-30), z)

            z = jax.lax.fori_loop(0, iterations, power, z0)
            chosen = jnp.argmax(jnp.where(honest, project(x, z), -jnp.inf))
        else:
            k = jnp.maximum(_count(honest), 1)
            order = jnp.argsort(~honest, stable=True)  # honest slots first, in slot order
            chosen = order[target % k]
        return _replace(updates, byzantine, jax.tree.map(lambda leaf: leaf[chosen], x))

    return attack


# --------------------------------------------------------------------------- data level


def flip_labels(y: jax.Array, num_classes: int, byzantine: jax.Array) -> jax.Array:
    """Label flipping: the Byzantine clients' labels y ← C − 1 − y, the others' as they are.

    Args:
      y: [m, ...] integer labels, one row per client (padding rows flip too; the
        example mask still hides them).
      num_classes: C ≥ 2.
      byzantine: [m] bool.
    """
    _check_iterations("flip_labels", "num_classes", num_classes, minimum=2)
    y = jnp.asarray(y)
    if not jnp.issubdtype(y.dtype, jnp.integer):
        raise ValueError(f"flip_labels: y must hold integer class labels; got {y.dtype}.")
    byzantine = _check_mask(byzantine, y.shape[0], "byzantine")
    return jnp.where(_broadcast(byzantine, y), num_classes - 1 - y, y)


@dataclasses.dataclass(frozen=True)
class LabelFlip:
    """Label flipping as an attack: the Byzantine clients train on labels y ← C − 1 − y
    and send their honest update of that (`algorithms.with_aggregator` flips their rows'
    labels before the round; `flip_labels` is the map)."""

    num_classes: int


def label_flip(num_classes: int) -> LabelFlip:
    """The data-level attack of label flipping over C classes (y ← C − 1 − y).

    Args:
      num_classes: C ≥ 2.
    """
    return LabelFlip(_check_iterations("label_flip", "num_classes", num_classes, minimum=2))


def byzantine_clients(key: jax.Array, num_clients: int, count) -> jax.Array:
    """[num_clients] bool with exactly `count` True, uniformly chosen from `key`: the same
    clients for every method that uses the same key.

    `count` may be traced (a sweep's Byzantine share as a vmapped axis): the first `count`
    clients of `jax.random.permutation(key, num_clients)` are Byzantine, so for one key a
    larger count keeps the clients of a smaller one and adds more.
    """
    _check_iterations("byzantine_clients", "num_clients", num_clients)
    if _known_int(count) is not None:
        count = _check_iterations("byzantine_clients", "count", _known_int(count), minimum=0)
        if count > num_clients:
            raise ValueError(f"byzantine_clients: count must be at most num_clients = "
                             f"{num_clients}; got {count}.")
    order = jax.random.permutation(key, num_clients)
    return jnp.zeros((num_clients,), bool).at[order].set(jnp.arange(num_clients) < count)


# --------------------------------------------------------------------------- a traced choice


class OneOf(NamedTuple):
    """One of several attacks, picked by an index that may be traced: a sweep's attack as a
    vmapped axis of one program (`with_aggregator(..., attack=one_of(...))`).

    attacks: each an attack, or None (the Byzantine clients send their honest update).
    index: int32 scalar, which of them (traced in a sweep).
    """

    attacks: tuple
    index: jax.Array


def one_of(choices, index) -> OneOf:
    """The attack `choices[index]`, chosen inside the program (`switch`).

    Args:
      choices: a sequence of attacks, None among them for honest Byzantine clients.
      index: an int in [0, len(choices)), or an int32 scalar array (may be traced).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from fedjax_sim.ops import attacks
      >>> chosen = attacks.one_of([None, attacks.sign_flip(scale=2.0)], 1)
      >>> attacks.switch(chosen, jnp.array([[1.0], [3.0]]), jnp.array([False, True]),
      ...                jax.random.key(0))
      Array([[ 1.],
             [-6.]], dtype=float32)
    """
    choices = tuple(choices)
    if not choices or any(c is not None and not callable(c) and not isinstance(c, LabelFlip)
                          for c in choices):
        raise ValueError(f"one_of: choices must be a non-empty sequence of attacks (None: "
                         f"honest); got {choices!r}.")
    known = _known_int(index)
    if known is not None and (isinstance(known, bool) or not isinstance(known, int)
                              or not 0 <= known < len(choices)):
        raise ValueError(f"one_of: index must be an integer in [0, {len(choices)}); got "
                         f"{index!r}.")
    return OneOf(choices, jnp.asarray(index, jnp.int32))


def switch(chosen: OneOf, updates, byzantine, key, mask=None):
    """`chosen.attacks[chosen.index](updates, byzantine, key, mask=mask)` by `lax.switch`
    (under vmap over the index every branch runs and each point keeps its own); None and
    `label_flip` leave the updates as they are (a label flip acts on the data)."""
    def branch(attack):
        if attack is None or isinstance(attack, LabelFlip):
            return lambda u, b, k, m: u
        return lambda u, b, k, m: attack(u, b, k, mask=m)

    s = num_slots(updates)
    mask = jnp.ones((s,), bool) if mask is None else mask
    if len(chosen.attacks) == 1:
        return branch(chosen.attacks[0])(updates, byzantine, key, mask)
    return jax.lax.switch(chosen.index, [branch(a) for a in chosen.attacks], updates,
                          byzantine, key, mask)
