"""DRFA and DRFLM: distributionally robust federated averaging, with local mixup.

Yuyang Deng, Mohammad Mahdi Kamani, Mehrdad Mahdavi. "Distributionally Robust
Federated Averaging". NeurIPS 2020, arXiv:2102.12660.

Bingzhe Wu, Zhipeng Liang, Yuxuan Han, Yatao Bian, Peilin Zhao, Junzhou Huang.
"DRFLM: Distributionally Robust Federated Learning with Inter-client Noise via
Local Mixup". arXiv:2204.07742, 2022.

Both solve min_w max_{λ ∈ Δ} Σ_i λ_i f_i(w) (docs/protocols.md#drfa-algorithm, #drflm). One round:

    C_s  ← m clients drawn ∝ λ, with replacement (a client drawn twice trains twice)
    t'   ← uniform on {1, ..., τ}
    every j ∈ C_s: τ local SGD steps from w, keeping w_j^(τ) and w_j^(t')
    w    ← mean_j w_j^(τ);   w̃ ← mean_j w_j^(t')
    U_s  ← m clients drawn uniformly without replacement
    v_i  ← (N/m) f_i(w̃; one minibatch) for i ∈ U_s, 0 elsewhere
    λ    ← Π_Δ(λ + γ τ v)

DRFLM replaces the local step by a mixup step after a feature map g (the
trunk of a split model; the identity otherwise) and, by default, feeds the
mixup loss into v.

Under `Systems` (`with_systems`) U_s is drawn among the clients available this
round, A, and a slot whose client drops out (or straggles under "drop") sends
no loss; N/m then becomes |A|/r, r the slots of U_s that reported:

    v_i  ← (|A|/r) f_i(w̃; one minibatch) for the r reporting i ∈ U_s, 0 elsewhere

Given A and r ≥ 1 the reporters are a uniform draw from A, so v is an unbiased
estimate of the losses of the available clients, and 0 for the others (whose
loss the round cannot observe: their λ_i moves only through the projection).
Without Systems |A| = N and r = m: the paper's N/m. (With `official_code` the
C_s update's λ_j N/m weights are FedTorch's, availability or not.)

`official_code=True` reproduces the official FedTorch code
(`comms/trainings/federated/centered/drfa.py`, docs/protocols.md#drfa-fedtorch) instead:
λ^(0) ∝ sample counts; γ ← 0.9 γ at the start of every round; C_s uniform
without replacement with the λ-importance-weighted update
w ← w + Σ_j (λ_j N/m)(w_j − w); each client draws k uniformly from
{1, ..., τ−1} (FedTorch draws it inside its loop over clients) and keeps the
model it holds when its k-th local step begins, i.e. after k − 1 updates
(w̃ = the plain mean of those); λ floored at 1e-3 by clipping and
renormalising, every entry (its distributed variant).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.algorithms.base import (
    Algorithm,
    broadcast_to_clients,
    check_choice,
    check_inputs,
    cohort_size,
    cohorts,
    mean_over,
    per_client_fields,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.data.federated import FederatedData
from fedjax_sim.models.core import HEAD, TRUNK, Model
from fedjax_sim.ops import (
    cohort_sums,
    mean_or_keep,
    mixup_client,
    project_simplex,
    put,
    sample_batch,
    take,
    weighted_sum,
)

LAMBDA_INITS = ("uniform", "examples")
LAMBDA_LOSSES = ("clean", "mixup")
OFFICIAL_DECAY = 0.9  # FedTorch: drfa_gamma *= 0.9 at the start of every round
OFFICIAL_FLOOR = 1e-3  # FedTorch: entries <= 1e-3 set to 1e-3, then renormalised


class DRFAState(NamedTuple):
    params: object  # pytree, the global model w^(s)
    lam: jax.Array  # [N] float32, λ^(s), on the simplex
    lam_avg: jax.Array  # [N] float32, λ̂: mean of λ^(0), ..., λ^(s) (the reported weights)
    lambda_lr: jax.Array  # float32 scalar, γ of the next round (decays with official_code)
    sampled: jax.Array  # [N] int32, how often each client has been in C_s so far
    round: jax.Array  # int32
    server_state: object = ()  # `with_server_optimizer`'s state; () without one


def _masked_mean_loss(model: Model, pred, y, mask):
    return jnp.sum(mask * model.example_loss(pred, y)) / jnp.maximum(jnp.sum(mask), 1.0)


def mixup_batch_loss(model: Model, alpha, beta):
    """(params, x_b, y_b, mask_b, key) -> the mixup loss of one minibatch (DRFLM's local step).

    γ ~ Beta(α, β) once per minibatch and a random pairing of its real rows
    (`ops.mixup_client`; standard mixup practice, docs/protocols.md#drflm). On a
    split model the embeddings h = g(x) are mixed and the head predicts from
    them, so g is trained through the mixed embeddings (manifold mixup); on a
    plain model g is the identity and the inputs are mixed. Targets are
    mixed as floats: regression targets or one-hot / soft labels.
    """

    def loss(params, xb, yb, mb, key):
        count = jnp.sum(mb).astype(jnp.int32)  # the real rows of a minibatch come first
        if model.is_split:
            h = model.features(params[TRUNK], xb)
            h_mix, y_mix, _ = mixup_client(key, h, yb, count, alpha, beta)
            pred = model.head(params[HEAD], h_mix)
        else:
            x_mix, y_mix, _ = mixup_client(key, xb, yb, count, alpha, beta)
            pred = model.apply(params, x_mix)
        return _masked_mean_loss(model, pred, y_mix, mb)

    return loss


def drfa(model: Model, training: ClientTraining, *, participation: float = 1.0,
         lambda_lr=0.01, lambda_floor: float | None = None, lambda_init="uniform",
         official_code: bool = False) -> Algorithm:
    """Builds DRFA (docs/protocols.md#drfa; `official_code=True`: the FedTorch form).

    Args:
      model: the shared model.
      training: how each client of C_s trains (τ = training.steps local steps; a
        fresh optimizer state every round, as in FedAvg); its batch size is also
        that of the one minibatch each client of U_s evaluates w̃ on.
      participation: m / N, the size of C_s and of U_s.
      lambda_lr: γ, the λ step size (may be traced). γ = 0 keeps λ = λ^(0):
        FedAvg with clients sampled by λ^(0).
      lambda_floor: lower bound on every λ_i after the projection (the exact
        projection onto the floored simplex); None: 0, or FedTorch's 1e-3 by
        clip-and-renormalise with official_code.
      lambda_init: "uniform" (the paper), "examples" (∝ num_examples, the
        official code), or an explicit [N] array on the simplex.
      official_code: reproduce the FedTorch deviations (module docstring).

    A server optimizer on w's change (mean_j w_j^(τ) − w; the λ step and w̃
    unchanged) is `with_server_optimizer(drfa(...), ...)`.

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import drfa, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = drfa(linear_regression(3), sgd(0.01, steps=10, batch_size=8),
      ...            participation=0.5, lambda_lr=0.001)
      >>> state = alg.init(jax.random.key(1), data)
      >>> state.params.shape, state.lam.shape  # the model; λ over the m clients
      ((3,), (8,))
      >>> state.lam.tolist() == [0.125] * 8  # λ^(0) uniform on the simplex
      True

    References:
      Yuyang Deng, Mohammad Mahdi Kamani, Mehrdad Mahdavi, "Distributionally Robust
      Federated Averaging", NeurIPS 2020, https://arxiv.org/abs/2102.12660.
    """
    return _drfa(model, training, participation, lambda_lr, lambda_floor, lambda_init,
                 official_code, None, "clean")


def drflm(model: Model, training: ClientTraining, *, participation: float = 1.0,
          lambda_lr=0.01, lambda_floor: float | None = None, lambda_init="uniform",
          official_code: bool = False, mixup=(1.0, 1.0), lambda_loss: str = "mixup"
          ) -> Algorithm:
    """Builds DRFLM: DRFA whose local step is a mixup step (docs/protocols.md#drflm).

    Args:
      model: a split model mixes after its trunk g (graph embeddings for the
        GNN); a plain model mixes its inputs (g = identity).
      mixup: (α, β) of the mixing weight γ ~ Beta(α, β) (Beta(1, 1) is the
        presets' default, docs/protocols.md#drflm-experiments); may be traced.
      lambda_loss: "mixup" (default: DRFLM's objective is the mixup loss, so
        the λ ascent uses it [I]) or "clean".
      (the rest as in `drfa`)

    Examples:
      >>> import jax
      >>> from fedjax_sim.algorithms import drflm, sgd
      >>> from fedjax_sim.data import linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> alg = drflm(linear_regression(3), sgd(0.01, steps=10, batch_size=8),
      ...             mixup=(1.0, 1.0))
      >>> state = alg.init(jax.random.key(1), data)
      >>> state.params.shape, state.lam.shape
      ((3,), (8,))
      >>> jax.jit(alg.evaluate)(state, data)["client_loss"].shape
      (8,)

    References:
      Bingzhe Wu, Zhipeng Liang, Yuxuan Han, Yatao Bian, Peilin Zhao, Junzhou Huang,
      "DRFLM: Distributionally Robust Federated Learning with Inter-client Noise via
      Local Mixup", arXiv 2022, https://arxiv.org/abs/2204.07742.
    """
    if not isinstance(mixup, (tuple, list)) or len(mixup) != 2:
        raise ValueError(f"mixup must be (alpha, beta); got {mixup!r}.")
    return _drfa(model, training, participation, lambda_lr, lambda_floor, lambda_init,
                 official_code, tuple(mixup), lambda_loss)


def _drfa(model, training, participation, lambda_lr, lambda_floor, lambda_init,
          official_code, mixup, lambda_loss) -> Algorithm:
    """DRFA's round, with DRFLM's mixup step when `mixup` is (α, β)."""
    check_training("drfa", training)
    local_steps, batch_size = training.steps, training.batch_size
    clients = cohorts(participation)
    check_choice("lambda_loss", lambda_loss, LAMBDA_LOSSES)
    if lambda_loss == "mixup" and mixup is None:
        raise ValueError("lambda_loss='mixup' needs mixup=(alpha, beta) (use drflm).")
    if official_code and local_steps < 2:
        raise ValueError(
            "official_code=True draws the snapshot step from {1, ..., local_steps − 1} (FedTorch); "
            f"it needs training steps >= 2; got {local_steps}.")
    check_learning_rate("lambda_lr", lambda_lr)
    if lambda_floor is not None and not (0.0 <= float(lambda_floor) < 1.0):
        raise ValueError(f"lambda_floor must be in [0, 1); got {lambda_floor!r}.")
    if isinstance(lambda_init, str):
        check_choice("lambda_init", lambda_init, LAMBDA_INITS)
    else:
        lam0 = np.asarray(lambda_init, np.float64)
        if lam0.ndim != 1 or np.any(lam0 < 0) or not np.isclose(lam0.sum(), 1.0, atol=1e-5):
            raise ValueError("lambda_init must be 'uniform', 'examples' or a 1-D array of "
                             f"non-negative weights summing to 1; got {lambda_init!r}.")
    if official_code:
        floor = OFFICIAL_FLOOR if lambda_floor is None else float(lambda_floor)
        floor_method = "clip"
    else:
        floor = 0.0 if lambda_floor is None else float(lambda_floor)
        floor_method = "exact"
    if mixup is not None:
        alpha, beta = mixup
        for name, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, (int, float, np.number)) and not value > 0:
                raise ValueError(f"mixup {name} must be > 0; got {value!r}.")
        mixed_loss = mixup_batch_loss(model, alpha, beta)
    else:
        mixed_loss = None

    def clean_loss(params, xb, yb, mb, _key):
        return _masked_mean_loss(model, model.apply(params, xb), yb, mb)

    def init(key, data: FederatedData) -> DRFAState:
        params = model.init(key)
        check_inputs(model, params, data)
        n = data.num_clients
        if mixup is not None and not jnp.issubdtype(data.y.dtype, jnp.floating):
            raise ValueError(
                f"drflm mixes targets, so data.y must be float (regression targets or one-hot "
                f"labels); got dtype {data.y.dtype}.")
        if floor * n > 1.0:
            raise ValueError(f"lambda_floor={floor} is too large for N={n} clients "
                             "(N · floor must be <= 1).")
        official_default = official_code and isinstance(lambda_init, str) and (
            lambda_init == "uniform")
        init_rule = "examples" if official_default else lambda_init
        if isinstance(init_rule, str) and init_rule == "uniform":
            lam = jnp.full((n,), 1.0 / n, jnp.float32)
        elif isinstance(init_rule, str):  # ∝ sample counts (FedTorch)
            counts = data.num_examples.astype(jnp.float32)
            lam = counts / jnp.maximum(jnp.sum(counts), 1.0)
        else:
            lam = jnp.asarray(init_rule, jnp.float32)
            if lam.shape != (n,):
                raise ValueError(f"lambda_init has shape {lam.shape}; the data has N={n} clients.")
        return DRFAState(params, lam, lam, jnp.asarray(lambda_lr, jnp.float32),
                         jnp.zeros((n,), jnp.int32), jnp.zeros((), jnp.int32))

    def round_(state: DRFAState, data: FederatedData, key):
        n = data.num_clients
        m = cohort_size(n, participation)
        key_c, key_t, key_u = jax.random.split(key, 3)
        gamma = state.lambda_lr * OFFICIAL_DECAY if official_code else state.lambda_lr
        training_t = training.at_round(state.round)  # the round's rate η_t

        # --- C_s: τ local steps, keeping the snapshot at t'
        if official_code:
            cohort = clients.draw(key_c, data, round=state.round)
            # FedTorch copies the model when its step counter reaches k, before that step's
            # update: the snapshot is the model after k − 1 updates.
            snap_steps = jax.random.randint(key_t, (m,), 1, local_steps) - 1
            slot_weight = take(cohort, state.lam) * (n / m)
        else:
            cohort = clients.draw(key_c, data, weights=state.lam, round=state.round)
            snap_steps = jnp.full((m,), jax.random.randint(key_t, (), 1, local_steps + 1))
            slot_weight = jnp.ones((m,), jnp.float32)

        def train(batch):
            c = batch.keys.shape[0]
            t_snap, weight = batch.inputs

            def one(p, x, y, count, k, t, work):
                return training_t.update(model, p, x, y, count, k, snapshot_step=t,
                                         batch_loss=mixed_loss, **work)

            start = broadcast_to_clients(state.params, c)
            trained, snaps, losses = jax.vmap(one)(
                start, batch.data.x, batch.data.y, batch.data.num_examples, batch.keys, t_snap,
                batch.slot_work())
            # A client without data takes no part (its weight is 0).
            active = batch.active.astype(jnp.float32)
            sums = (weighted_sum(trained, active * weight), jnp.sum(active * weight),
                    weighted_sum(snaps, active), jnp.sum(active))
            return sums, (losses[:, 0], batch.active)

        (w_sum, w_weight, snap_sum, count), (first_losses, active) = cohort_sums(
            train, data, cohort, inputs=(snap_steps, slot_weight))
        if official_code:  # w + Σ_j a_j (w_j − w), a_j = λ_j N/m (not normalised)
            params = jax.tree.map(lambda w, s: (1.0 - w_weight) * w + s, state.params, w_sum)
        else:
            params = mean_or_keep(w_sum, w_weight, state.params)
        w_tilde = mean_or_keep(snap_sum, count, state.params)

        # --- U_s: each returns the loss of w̃ on one minibatch; the λ step
        lam_cohort = clients.draw(key_u, data, round=state.round)
        lam_loss = mixed_loss if lambda_loss == "mixup" else clean_loss

        def probe(batch):
            def one(x, y, count, k):
                k_batch, k_loss = jax.random.split(k)
                n_max = y.shape[0]
                size = n_max if batch_size is None else batch_size
                idx, mask = sample_batch(k_batch, count, n_max, size)
                xb = jax.tree.map(lambda a: a[idx], x)
                return lam_loss(w_tilde, xb, y[idx], mask.astype(jnp.float32), k_loss)

            losses = jax.vmap(one)(batch.data.x, batch.data.y, batch.data.num_examples,
                                   batch.keys)
            return (), jnp.where(batch.active, losses, 0.0)

        _, probe_losses = cohort_sums(probe, data, lam_cohort)
        if lam_cohort.reports is None:
            scale = n / m
        else:  # |A| / r: the available clients over the slots that reported a loss
            here = n if lam_cohort.num_available is None else lam_cohort.num_available
            reported = jnp.sum(lam_cohort.reports.astype(jnp.int32))
            scale = jnp.asarray(here, jnp.float32) / jnp.maximum(reported, 1).astype(
                jnp.float32)
        v = put(lam_cohort, jnp.zeros((n,), jnp.float32), scale * probe_losses)
        lam = project_simplex(state.lam + gamma * local_steps * v, floor, floor_method)
        lam_avg = state.lam_avg + (lam - state.lam_avg) / (state.round + 2).astype(jnp.float32)
        sampled = state.sampled + jax.ops.segment_sum(
            jnp.ones((m,), jnp.int32), cohort.ids, num_segments=n)
        metrics = {
            "cohort_loss": mean_over(first_losses, active),
            **clients.participants(data, active),
            "lambda_max": jnp.max(lam),
            "lambda_entropy": -jnp.sum(jnp.where(lam > 0, lam * jnp.log(lam), 0.0)),
            "probe_loss_worst": jnp.max(probe_losses),
        }
        return state._replace(params=params, lam=lam, lam_avg=lam_avg, lambda_lr=gamma,
                              sampled=sampled, round=state.round + 1), metrics

    def evaluate(state: DRFAState, data: FederatedData) -> dict:
        out = evaluate_shared(model, state.params, data)
        out["client_lambda"] = state.lam
        return out

    return Algorithm(init, round_, evaluate, per_client_fields("lam", "lam_avg", "sampled"))

