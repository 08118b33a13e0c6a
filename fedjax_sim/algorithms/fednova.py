"""FedNova: FedAvg with each client's update normalised by its own amount of local work.

Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent Poor. "Tackling
the Objective Inconsistency Problem in Heterogeneous Federated
Optimization". NeurIPS 2020, arXiv:2007.07481.

With heterogeneous local steps τ_i, FedAvg's average Σ p_i Δ_i weighs client
i by how much it computed, and converges to the optimum of a surrogate
objective (clients weighted ∝ p_i τ_i), not of F = Σ p_i F_i. FedNova divides
each client's cumulative update by the ℓ₁ norm of its aggregation vector a_i
(the coefficients of its local gradients in Δ_i) and rescales the average by
τ_eff (the paper's Eq. 6–7):

    S    ← a cohort; p_i ∝ n_i (weighting="examples") or 1, normalised over S
    each i ∈ S:  y_i ← τ_i local steps from x        (SGD, momentum ρ, proximal μ)
                 d_i ← (x − y_i) / ‖a_i‖₁
    τ_eff ← Σ_{i∈S} p_i ‖a_i‖₁
    x    ← x − τ_eff Σ_{i∈S} p_i d_i
           (`with_dp`: x − ‖a(τ)‖₁ (Σ_{i∈S} clip(d_i) + N(0, σ²C²)) / D, below)

‖a_i‖₁ for the local solvers of the paper's Appendix (η the client step):

    SGD                  τ_i
    momentum SGD ρ       [τ_i − ρ (1 − ρ^τ_i) / (1 − ρ)] / (1 − ρ)
    proximal μ (FedProx) [1 − (1 − ημ)^τ_i] / (ημ)     (as −expm1(τ_i log1p(−ημ)) / (ημ):
                                                    no cancellation; τ_i as ημ → 0)

With equal τ_i every ‖a_i‖₁ is equal, τ_eff = ‖a‖₁ and FedNova is FedAvg.

Choices [I]:
- τ_i is the client's own steps this round (`ClientTraining.work`, and a
  straggler's share under `Systems`): the same draws its local steps used.
- The client optimizer is the paper's: plain SGD at `training.learning_rate`,
  with momentum ρ (a fresh buffer every round) and/or the proximal term μ;
  momentum and proximal together are refused (the paper gives no ‖a‖₁ for it).
- A client without data, or with τ_i = 0, adds nothing and weighs 0 in p and
  τ_eff; a round in which nobody contributes keeps x.
- The paper's default weighting is by examples (p_i = n_i / n).
- The paper's normalisation covers local solvers whose update is a fixed
  linear combination of the local gradients: plain, momentum and proximal SGD
  are implemented (`momentum`, `mu`: FedNova over FedProx's solver). SCAFFOLD's
  corrected steps are not normalised here; `scaffold` itself uses each client's
  own K_i in its control variates.

Under `with_dp` (or `with_dp_ftrl`) what a client sends is its normalised change
d_i, and that is what is clipped (‖d_i‖₂ ≤ C), summed, noised (N(0, σ²C²)) and
divided by D, the expected cohort (`algorithms.private`); every reporting client
counts 1 (no `weighting="examples"`). τ_eff = Σ p_i ‖a_i‖₁ is not used: it reads
every client's τ_i (with `Work(epochs=...)` a function of its n_i) and p_i, and
would need a privatised count of its own. It is replaced by a fixed, public value,
‖a(τ)‖₁ of the configured `steps` τ at the round's rate (the work of a client that
takes all its steps; `tau_eff` reports it). This keeps what FedNova is for: in
the paper's general update (its Section 4), x − τ_eff Σ w_i d_i reaches the
objective Σ w_i F_i whatever τ_eff is (τ_eff scales the server's step, not the
weights), so a fixed τ_eff is still objective-consistent with w_i = the uniform
p_i of the noised sum. With every client taking all τ steps it is the plain
τ_eff; under heterogeneous work it exceeds Σ p_i ‖a_i‖₁, a larger server step
(scale it with `with_server_optimizer(..., "sgd", server_lr)`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    cohorts,
    is_plain,
    mean_over,
)
from fedjax_sim.algorithms.fedavg import FedAvgState, fedavg
from fedjax_sim.algorithms.fedprox import proximal_term
from fedjax_sim.algorithms.training import (
    ClientTraining,
    check_learning_rate,
    check_training,
    sgd_rate,
)
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import cohort_sums, weighted_sum


def _rows(per_client, leaf):
    """[c] values shaped to broadcast against a [c, ...] leaf."""
    return per_client.reshape(per_client.shape + (1,) * (leaf.ndim - 1)).astype(leaf.dtype)


def work_norm(steps, *, learning_rate=0.0, momentum=0.0, mu=0.0):
    """‖a_i‖₁ of τ_i = `steps` local steps (float32, elementwise over `steps`); for the
    proximal solver computed without cancellation, so it tends to τ_i as ημ → 0."""
    tau = jnp.asarray(steps, jnp.float32)
    if momentum:
        rho = momentum
        return (tau - rho * (1.0 - rho**tau) / (1.0 - rho)) / (1.0 - rho)
    if isinstance(mu, int | float) and mu == 0:
        return tau
    decay = jnp.asarray(learning_rate * mu, jnp.float32)
    # [1 − (1 − ημ)^τ] / (ημ) = −expm1(τ log1p(−ημ)) / (ημ): no cancellation in float32 at
    # small ημ (1 − (1 − ημ)^τ rounds to 0 at ημ = 5e-9), and τ in the limit ημ → 0, and
    # at ημ = 0 exactly. ημ >= 1 (each step overshoots the anchor) takes the power form.
    safe = jnp.clip(decay, 1e-30, 0.5)  # (the branch not taken must stay finite)
    stable = -jnp.expm1(tau * jnp.log1p(-safe)) / safe
    power = (1.0 - (1.0 - decay) ** tau) / jnp.maximum(decay, 1e-30)
    return jnp.where(decay > 0, jnp.where(decay < 0.5, stable, power), tau)


def fednova(model: Model, training: ClientTraining, *, momentum: float = 0.0, mu=0.0,
            participation: float = 1.0, weighting: str = "examples") -> Algorithm:
    """Builds FedNova (normalised averaging).

    Args:
      model: the shared model.
      training: how each client trains: `sgd(lr, steps=, batch_size=, work=)`;
        its `work` (or stragglers) gives the clients their different τ_i.
      momentum: ρ in [0, 1), the client's momentum (a fresh buffer every round).
      mu: μ >= 0, a proximal term μ/2 ‖y − x‖² in every local step (FedNova over
        FedProx's solver); may be traced.
      participation: fraction of clients per round, uniform without replacement.
      weighting: "examples" (p_i ∝ n_i, the paper's) or "uniform".

    Returns:
      Algorithm(init, round, evaluate) with state FedAvgState.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import fednova, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> from fedjax_sim.ops.work import Work
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> training = sgd(0.05, steps=8, work=Work(low=1))  # τ_i uniform on 1..8, per client
      >>> alg = fednova(linear_regression(3), training)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
      >>> sorted(metrics)
      ['cohort_loss', 'tau_eff']

    References:
      Jianyu Wang, Qinghua Liu, Hao Liang, Gauri Joshi, H. Vincent Poor, "Tackling the
      Objective Inconsistency Problem in Heterogeneous Federated Optimization",
      NeurIPS 2020, https://arxiv.org/abs/2007.07481.
    """
    check_training("fednova", training)
    sgd_rate(training, "fednova", "‖a_i‖₁ is that of plain SGD's steps")
    if not (isinstance(momentum, int | float) and 0.0 <= momentum < 1.0):
        raise ValueError(f"fednova's momentum must be a number in [0, 1); got {momentum!r}.")
    check_learning_rate("fednova's mu", mu)
    proximal = not (isinstance(mu, int | float) and mu == 0)  # (a traced μ counts as one)
    if momentum and proximal:
        raise ValueError("fednova takes momentum or mu, not both (the paper gives ‖a_i‖₁ "
                         "for each alone).")

    def local_solver(training_t):  # the paper's local solver at the round's rate η
        lr = training_t.learning_rate
        if momentum:
            return training_t.replace(optimizer=optax.sgd(lr, momentum=momentum))
        if proximal:
            return training_t.replace(optimizer=optax.chain(proximal_term(mu), optax.sgd(lr)))
        return training_t

    # FedAvg's state, init and evaluation (and its checks of participation and weighting);
    # only the round's aggregation is FedNova's own.
    shared = fedavg(model, training, participation=participation, weighting=weighting)
    clients = cohorts(participation, weighting)

    def round_(state: FedAvgState, data: FederatedData, key):
        cohort = clients.draw(key, data, round=state.round)
        local = local_solver(training.at_round(state.round))  # at the round's rate η_t
        lr = local.learning_rate
        plain = is_plain(state.aggregation)

        def client_step(batch):
            start = broadcast_to_clients(state.params, batch.keys.shape[0])
            trained, _, losses = local.update_clients(model, start, batch.data, batch.keys,
                                                      **batch.work())
            tau = local.steps_taken(batch.data, batch.keys, **batch.work())
            norm = work_norm(tau, learning_rate=lr, momentum=momentum, mu=mu)  # ‖a_i‖₁
            p = clients.weights(batch.active, batch.data.num_examples)
            p = jnp.where(tau > 0, p, 0.0)
            delta = optax.tree.sub(start, trained)  # x − y_i
            if not plain:  # d_i = (x − y_i) / ‖a_i‖₁, the update a rule clips
                d = jax.tree.map(lambda u: u / _rows(jnp.maximum(norm, 1e-30), u), delta)
                return clients.sums(state.aggregation, d, None, p, batch), (losses[:, 0],
                                                                     batch.active)
            scale = p / jnp.maximum(norm, 1e-30)  # p_i / ‖a_i‖₁ (unnormalised p)
            sums = (weighted_sum(delta, scale), jnp.sum(p * norm), jnp.sum(p))
            return sums, (losses[:, 0], batch.active)

        sums, (first_losses, active) = cohort_sums(client_step, data, cohort)
        metrics = {"cohort_loss": mean_over(first_losses, active),
                   **clients.participants(data, active)}
        if not plain:  # x ← x − ‖a(τ)‖₁ · (the rule's mean of d_i) (module docstring)
            mean_d, aggregation, server_metrics = clients.mean(
                state.aggregation, sums, optax.tree.zeros_like(state.params), key, cohort,
                data)
            tau_eff = work_norm(training.steps, learning_rate=lr, momentum=momentum, mu=mu)
            params = optax.tree.add_scale(state.params, -tau_eff, mean_d)
            metrics.update(tau_eff=tau_eff, **server_metrics)
            return state._replace(params=params, round=state.round + 1,
                                  aggregation=aggregation), metrics
        # x ← x − τ_eff Σ p_i d_i, with p normalised over the contributors:
        # τ_eff = Σ p_i ‖a_i‖₁ / Σ p_i and Σ p_i d_i = d_total / Σ p_i.
        d_total, pa_total, p_total = sums
        some = p_total > 0
        total = jnp.maximum(p_total, 1e-30)
        tau_eff = pa_total / total
        params = optax.tree.where(
            some, optax.tree.add_scale(state.params, -tau_eff / total, d_total), state.params)
        metrics["tau_eff"] = jnp.where(some, tau_eff, 0.0)
        return state._replace(params=params, round=state.round + 1), metrics

    return Algorithm(shared.init, round_, shared.evaluate)

