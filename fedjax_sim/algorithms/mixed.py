"""Mixed FL: parallel training and one-/two-way gradient transfer.

Sean Augenstein, Andrew Hard, Lin Ning, Karan Singhal,
Satyen Kale, Kurt Partridge, Rajiv Mathews. "Mixed Federated Learning: Joint
Decentralized and Centralized Learning". arXiv:2205.13655.

The mixed objective is f(x) = w_f f_f(x) + w_c f_c(x): f_f the federated loss
(the cohort's clients), f_c a centralized loss computed on the server, either
a datacenter dataset (minibatches drawn on the server, `ServerData` arrays
{"x": [n_c, ...], "y": [n_c, ...]}) or an extra loss term such as a
regularizer (`central_loss(params, server_arrays, key) -> scalar`). Three
ways to train it (docs/protocols.md#mixed-fl-algorithms, reconstructed; K = the clients'
training steps):

Each variant is its own factory over shared pieces (the checked settings, the
clients' K local steps, which are `ops.client_update`'s as every algorithm's, the
server step and the metrics); `mixed(variant=...)` picks one by name:

* PT (`mixed_parallel`): clients take K steps on f_i, the server K steps on
  f_c, both from x^(t); Δ = w_f·mean_i Δ_i + w_c·Δ_c.
* 1-GT (`mixed_gt1`): the server sends ĝ_c = g_c(x^(t)) with the model;
  clients take K steps on w_f g_i(y) + w_c ĝ_c (ĝ_c held fixed); Δ = mean_i Δ_i.
* 2-GT (`mixed_gt2`): as 1-GT on the clients, which also return
  ĝ_i = g_i(x^(t)) (their first-step gradient); the server takes K steps on
  w_c g_c(y) + w_f ĝ_f, ĝ_f = mean_i ĝ_i; Δ = α·mean_i Δ_i + (1 − α)·Δ_c.

Then x^(t+1) = ServerOpt(x^(t), −Δ) (SGD at lr 1: x^(t) + Δ).

Choices where the reconstruction is open (settings, documented in the presets'
notes):

* `combine` (2-GT's α): "half" (α = ½, the reconstruction's text) or "mixing"
  (α = w_f / (w_f + w_c), which makes w_c = 0 reduce to FedAvg).
* `transfer` (2-GT's ĝ_f): "current" (the central steps run after the
  clients report and use this round's ĝ_f) or "stale" (they use last round's
  ĝ_f, zeros in round 0, so the two branches can run concurrently).
* The central steps use the client optimizer unless `central` gives another
  training (the paper: the same η).

Every round logs, at the round-start model x^(t), the sampled dissimilarity
estimates (docs/protocols.md) from ∇̃f_f = the cohort's mean first-step gradient and
∇̃f_c = a central batch gradient, on the normalised weights p = w/(w_f + w_c) and
∇̃f = p_f∇̃f_f + p_c∇̃f_c: G̃² = p_f‖∇̃f_f‖² + p_c‖∇̃f_c‖² − ‖∇̃f‖² (B = 1) and
B̃² = (p_f‖∇̃f_f‖² + p_c‖∇̃f_c‖²)/‖∇̃f‖² (G = 0) (`dissimilarity` says why), and the
floats each client receives and sends.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedjax_sim.algorithms.base import (
    Algorithm,
    Cohorts,
    check_choice,
    check_inputs,
    cohorts,
    mean_over,
    num_params,
)
from fedjax_sim.algorithms.fedavg import evaluate_shared
from fedjax_sim.algorithms.training import ClientTraining, check_learning_rate, check_training
from fedjax_sim.data.federated import FederatedData, ServerData
from fedjax_sim.models.core import Model
from fedjax_sim.ops import (
    cohort_sums,
    mean_or_keep,
    sample_batch,
    sample_cohort,
    take,
    weighted_sum,
)

COMBINES = ("half", "mixing")
TRANSFERS = ("current", "stale")
CENTRAL_STREAM = 0x5E7C  # the server's K step keys: split(fold_in(round key, CENTRAL_STREAM), K)

#: central_loss(params, server_arrays, key) -> scalar: an extra loss term on the server.
CentralLoss = Callable[..., jax.Array]


class DrawnLoss(NamedTuple):
    """A central loss whose randomness is a draw from the server arrays, made apart.

    Called as a `CentralLoss` it draws, then evaluates. The algorithms make
    all K central steps' draws before the step loop instead (the same draws,
    one PRNG call and one top_k for all K steps).
    """

    draw: Callable  # (server_arrays, key) -> one step's input (e.g. a batch's row indices)
    loss: Callable  # (params, server_arrays, step input) -> scalar

    def __call__(self, params, arrays, key):
        return self.loss(params, arrays, self.draw(arrays, key))


class MixedState(NamedTuple):
    params: object  # pytree, one model x^(t)
    grad_f: object  # pytree like params: last round's ĝ_f (2-GT "stale" reads it)
    round: jax.Array  # int32
    server_state: object = ()  # `with_server_optimizer`'s state; () without one


def split_inputs(inputs) -> tuple[FederatedData, ServerData | None]:
    """(client data, server data or None) of an algorithm's inputs."""
    if isinstance(inputs, FederatedData):
        return inputs, None
    data, server = inputs
    if not isinstance(data, FederatedData) or not isinstance(server, ServerData):
        raise ValueError(
            "mixed FL inputs must be a FederatedData or a (FederatedData, ServerData) pair; "
            f"got ({type(data).__name__}, {type(server).__name__})."
        )
    return data, server


def dissimilarity(grad_f, grad_c, w_f, w_c):
    """Sampled G̃, B̃ (docs/protocols.md#mixed-fl-dissimilarity) of a federated, a central gradient,
    for any weights w_f, w_c >= 0 (not both 0).

    Defined on the normalised weights p_f = w_f/(w_f + w_c), p_c = w_c/(w_f + w_c)
    and ∇̃f = p_f g_f + p_c g_c:

        G̃² = p_f‖g_f‖² + p_c‖g_c‖² − ‖∇̃f‖²        (B = 1)
        B̃² = (p_f‖g_f‖² + p_c‖g_c‖²) / ‖∇̃f‖²      (G = 0)

    Why normalised: (G, B)-dissimilarity bounds the weighted mean of the parts'
    squared gradient norms by the squared norm of their weighted mean, which is
    a statement about a convex combination. f = w_f f_f + w_c f_c is
    (w_f + w_c)·(p_f f_f + p_c f_c): the same minimiser and training, only its
    scale differs. With the raw weights, when w_f + w_c ≠ 1, G̃² can be negative
    (w_f = 0.9, w_c = 100: ‖w_c g_c‖² dwarfs w_c‖g_c‖²) and B̃ below 1, which
    the definition excludes. Normalised, B̃ is unchanged by rescaling f, G̃ is
    in units of the normalised objective's gradient, and with w_f + w_c = 1
    nothing changes. Both are computed through the identity (exact for
    p_f + p_c = 1) G̃² = p_f p_c‖g_f − g_c‖², B̃² = 1 + G̃²/‖∇̃f‖², which has no
    cancellation and keeps G̃ >= 0 and B̃ >= 1 in floating point.

    Args:
      grad_f: ∇̃f_f, the cohort-averaged client gradient (pytree).
      grad_c: ∇̃f_c, a central batch gradient (pytree like grad_f).
      w_f, w_c: the mixing weights (may be traced; both 0 reads as G̃ = 0, B̃ = 1).

    Returns:
      (G̃, B̃) scalars; B̃ = 1 when both gradients are 0, and finite when only
      ∇̃f is (its squared norm's floor is 1e-30).
    """
    total = w_f + w_c
    total = jnp.where(total > 0, total, 1.0)
    p_f, p_c = w_f / total, w_c / total
    gap = optax.tree.norm(optax.tree.sub(grad_f, grad_c), squared=True)
    g_sq = p_f * p_c * gap
    mean = optax.tree.add(optax.tree.scale(p_f, grad_f), optax.tree.scale(p_c, grad_c))
    sq_mean = optax.tree.norm(mean, squared=True)
    return jnp.sqrt(g_sq), jnp.sqrt(1.0 + g_sq / jnp.maximum(sq_mean, 1e-30))


def descend(batch_grad, optimizer, start, steps, *, scale=1.0, correction=None):
    """K optimizer steps on scale·g(y) + correction, from `start`: the server's central steps
    (the clients' steps are `ops.client_update`'s).

    Args:
      batch_grad: (params, step input) -> (loss, gradient) of one stochastic batch.
      optimizer: optax optimizer (a fresh state).
      start: params.
      steps: pytree of the K steps' inputs (leading axis K): their batches drawn
        beforehand (a `DrawnLoss`'s draws), or their keys.
      scale: the weight of g (w_f on a GT client, w_c on a 2-GT server).
      correction: None, or a fixed pytree added to every step's direction
        (the transferred w_c·ĝ_c or w_f·ĝ_f).

    Returns:
      (params after K steps, g(start) of the first batch, its loss): the first
      step's raw gradient, without scale or correction, is what 2-GT sends up
      and what G̃/B̃ read.
    """

    def step(carry, inputs):
        y, opt_state = carry
        loss, grad = batch_grad(y, inputs)
        direction = optax.tree.scale(scale, grad)
        if correction is not None:
            direction = optax.tree.add(direction, correction)
        updates, opt_state = optimizer.update(direction, opt_state, y)
        return (optax.apply_updates(y, updates), opt_state), (loss, grad)

    # The first step is peeled off so its gradient comes out without a K-long output.
    first, rest = (jax.tree.map(lambda a, i=i: a[i], steps) for i in (0, slice(1, None)))
    carry, (loss0, grad0) = step((start, optimizer.init(start)), first)
    (end, _), _ = jax.lax.scan(lambda c, x: (step(c, x)[0], None), carry, rest)
    return end, grad0, loss0


def client_step_input(key, num_examples, n_max: int, batch_size: int | None):
    """The oracle's one-gradient input of a cohort member: its batch (idx [b], mask [b]),
    drawn as a client step's batch is (FedAvg's); the key for a full batch."""
    if batch_size is None:
        return key
    return sample_batch(jax.random.split(key)[0], num_examples, n_max, batch_size)


def client_batch_grad(model: Model, x, y, num_examples, batch_size: int | None):
    """(params, step input) -> (loss, grad) of one client's masked minibatch loss (full
    batch if batch_size is None); the step input from `client_step_input` (the oracle's)."""
    n_max = y.shape[0]

    def loss_fn(p, step):
        if batch_size is None:
            xb, yb = x, y
            mb = (jnp.arange(n_max) < num_examples).astype(jnp.float32)
        else:
            idx, bmask = step
            xb = jax.tree.map(lambda a: a[idx], x)
            yb, mb = y[idx], bmask.astype(jnp.float32)
        losses = model.example_loss(model.apply(p, xb), yb)
        return jnp.sum(mb * losses) / jnp.maximum(jnp.sum(mb), 1.0)

    return jax.value_and_grad(loss_fn)


def datacenter_loss(model: Model, batch_size: int | None) -> DrawnLoss:
    """The central loss of a datacenter dataset: the mean loss of a minibatch drawn on the server.

    The server arrays are {"x": [n_c, ...] (any pytree), "y": [n_c, ...]};
    batch_size None uses every row each step, else a batch without
    replacement (its draw: the rows' indices; the key when every row is used).
    """

    def every_row(arrays) -> bool:
        return batch_size is None or batch_size >= arrays["y"].shape[0]

    def draw(arrays, key):
        if every_row(arrays):
            return key
        n_c = arrays["y"].shape[0]
        return sample_batch(key, n_c, n_c, batch_size, replicated=True)[0]

    def loss(params, arrays, idx):
        x, y = arrays["x"], arrays["y"]
        if every_row(arrays):
            xb, yb = x, y
        else:
            xb, yb = jax.tree.map(lambda a: a[idx], x), y[idx]
        return jnp.mean(model.example_loss(model.apply(params, xb), yb))

    return DrawnLoss(draw, loss)


def l2_regularizer(scale: float = 1.0) -> CentralLoss:
    """A central loss needing no server arrays: scale · ½‖x‖² (an example of an extra term)."""

    def loss(params, arrays, key):
        del arrays, key
        return 0.5 * scale * optax.tree.norm(params, squared=True)

    return loss


def _check_weight(name: str, value) -> None:
    if isinstance(value, (int, float, np.number)) and not (
        math.isfinite(float(value)) and value >= 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0; got {value!r}.")


class _Setup(NamedTuple):
    """What the four variants share once their settings are checked."""

    model: Model
    training: ClientTraining  # the clients' K local steps
    central: ClientTraining  # the server's steps (PT, 2-GT)
    w_f: object
    w_c: object
    clients: Cohorts
    server_opt: optax.GradientTransformation  # ServerOpt on −Δ
    drawn: DrawnLoss  # f_c, its draws made apart
    datacenter: bool  # f_c is a datacenter dataset (central_loss None)

    def arrays(self, server):
        """The server arrays f_c reads (a datacenter dataset's checked)."""
        if self.datacenter:
            if server is None or not isinstance(server.arrays, dict) or not {
                    "x", "y"} <= set(server.arrays):
                raise ValueError(
                    "the centralized loss is a datacenter dataset (central_loss=None): give "
                    "the inputs as (FederatedData, ServerData(arrays={'x': [n_c, ...], "
                    "'y': [n_c, ...]})), or pass central_loss=(params, arrays, key) -> scalar."
                )
            return server.arrays
        return None if server is None else server.arrays

    def central_keys(self, key, steps: int):
        """The server's step keys: a stream folded off the round key, apart from the cohort's
        (so with w_c = 0 the client side is FedAvg's round draw for draw)."""
        return jax.random.split(jax.random.fold_in(key, CENTRAL_STREAM), steps)

    def central_grad(self, arrays):
        """(params, central step input) -> (loss, grad) of f_c."""
        return jax.value_and_grad(lambda p, step: self.drawn.loss(p, arrays, step))

    def central_inputs(self, arrays, keys):
        """Every central step's input (f_c's draws), drawn before the steps."""
        return jax.vmap(lambda k: self.drawn.draw(arrays, k))(keys)

    def clients_train(self, state: MixedState, data: FederatedData, cohort, direction=None):
        """The cohort's K local steps from x^(t) (`ops.client_update`'s, on `direction`(g_i)
        if given): (Δ_f = mean_i Δ_i, ĝ_f = mean_i g_i(x^(t)), first losses [s], active [s])."""
        x_t = state.params
        training_t = self.training.at_round(state.round)  # the round's rate η_t

        def client_step(batch):
            def one(x, y, n, k, work):
                end, _, losses, g0 = training_t.update(
                    self.model, x_t, x, y, n, k, direction=direction, keep_first_grad=True,
                    **work)
                return optax.tree.sub(end, x_t), g0, losses[0]

            deltas, grads0, losses0 = jax.vmap(one)(batch.data.x, batch.data.y,
                                                    batch.data.num_examples, batch.keys,
                                                    batch.slot_work())
            weights = self.clients.weights(batch.active, batch.data.num_examples)
            sums = (weighted_sum(deltas, weights), weighted_sum(grads0, weights),
                    jnp.sum(weights))
            return sums, (losses0, batch.active)

        (delta_total, grad_total, weight), (losses0, active) = cohort_sums(
            client_step, data, cohort)
        zeros = optax.tree.zeros_like(x_t)
        return (mean_or_keep(delta_total, weight, zeros), mean_or_keep(grad_total, weight, zeros),
                losses0, active)

    def server_step(self, x_t, delta):
        """x^(t+1) = ServerOpt(x^(t), −Δ)."""
        updates, _ = self.server_opt.update(optax.tree.scale(-1.0, delta),
                                            self.server_opt.init(x_t), x_t)
        return optax.apply_updates(x_t, updates)

    def metrics(self, data, x_t, hat_g_f, hat_g_c, losses0, active, loss_c, *, down, up):
        """The round's metrics; down, up: models' worth of floats each client receives, sends."""
        g_tilde, b_tilde = dissimilarity(hat_g_f, hat_g_c, self.w_f, self.w_c)
        cohort_loss = mean_over(losses0, active)
        d = float(num_params(x_t))
        return {
            "cohort_loss": cohort_loss,
            **self.clients.participants(data, active),
            "central_loss": loss_c,
            "mixed_loss": self.w_f * cohort_loss + self.w_c * loss_c,
            "G_tilde": g_tilde,
            "B_tilde": b_tilde,
            "floats_down": jnp.float32(down * d),
            "floats_up": jnp.float32(up * d),
        }

    def algorithm(self, round_) -> Algorithm:
        """The variant's round with the shared init (x^(0), ĝ_f = 0) and evaluation."""

        def init(key, inputs) -> MixedState:
            data, server = split_inputs(inputs)
            self.arrays(server)
            params = self.model.init(key)
            check_inputs(self.model, params, data)
            return MixedState(params, optax.tree.zeros_like(params), jnp.zeros((), jnp.int32))

        def evaluate(state: MixedState, inputs) -> dict:
            data, _ = split_inputs(inputs)
            return evaluate_shared(self.model, state.params, data)

        return Algorithm(init, round_, evaluate)


def _setup(name: str, model: Model, training: ClientTraining, central, w_f, w_c,
           participation, weighting, central_loss, server_lr) -> _Setup:
    """The settings every variant takes, checked (ValueError naming the first bad one)."""
    check_training(name, training)
    if central is None:  # the clients' optimizer and K on every row; the clients' sampling
        # mode is theirs alone (the datacenter's batches are drawn afresh)
        central = training.replace(batch_size=None, sampling="with_replacement")
    check_training(name, central, "central")
    if central.sampling != "with_replacement":
        raise ValueError("the central steps draw each datacenter batch afresh: central "
                         f"sampling must be with_replacement; got {central.sampling!r}.")
    clients = cohorts(participation, weighting)
    _check_weight("w_f", w_f)
    _check_weight("w_c", w_c)
    if all(isinstance(w, (int, float, np.number)) for w in (w_f, w_c)) and w_f + w_c == 0:
        raise ValueError("w_f and w_c must not both be 0 (f = w_f f_f + w_c f_c would be 0).")
    if central_loss is not None and not callable(central_loss):
        raise ValueError(
            "central_loss must be None (a datacenter dataset in ServerData) or a callable "
            f"(params, server_arrays, key) -> scalar; got {central_loss!r}."
        )
    server_lr = 1.0 if server_lr is None else server_lr
    check_learning_rate("server_lr", server_lr)
    f_c = central_loss if central_loss is not None else datacenter_loss(model, central.batch_size)
    # A plain central loss draws nothing apart: its step input is the step's key.
    drawn = f_c if isinstance(f_c, DrawnLoss) else DrawnLoss(lambda arrays, key: key, f_c)
    # ServerOpt on −Δ: SGD at η_s (another: `with_server_optimizer` around server_lr = 1).
    return _Setup(model, training, central, w_f, w_c, clients, optax.sgd(server_lr), drawn,
                  central_loss is None)


def _transferred(w_f, w_c, hat_g_c):
    """A GT client's direction w_f g_i(y) + w_c ĝ_c (ĝ_c held fixed)."""
    correction = optax.tree.scale(w_c, hat_g_c)
    return lambda grad: optax.tree.add(optax.tree.scale(w_f, grad), correction)


def mixed_parallel(model: Model, training: ClientTraining, *,
                   central: ClientTraining | None = None, w_f=0.5, w_c=0.5,
                   participation: float = 1.0, weighting: str = "uniform",
                   central_loss: CentralLoss | None = None,
                   server_lr=None) -> Algorithm:
    """Mixed FL by parallel training (PT): client and server steps from x^(t), deltas mixed.

    One round:

        S ← the cohort;  each i ∈ S: Δ_i ← K steps on f_i from x^(t)
        y_c ← K central steps on f_c from x^(t)
        x^(t+1) ← ServerOpt(x^(t), −(w_f·mean_i Δ_i + w_c·(y_c − x^(t))))
    Args:
      model: the shared model.
      training: the clients' K local steps (`ClientTraining`: optimizer, K,
        minibatch size, sampling).
      central: the server's central steps on f_c (PT, 2-GT): its optimizer, its
        number of steps and its datacenter minibatch size (None: every row each
        step); default: `training`'s optimizer and K, every row. 1-GT (one central
        gradient) and the oracle (the clients' optimizer and K) read only its
        batch size.
      w_f, w_c: mixing weights of f = w_f f_f + w_c f_c (>= 0; need not sum to 1).
      participation: the fraction of clients per round, uniformly without
        replacement.
      weighting: "uniform" or "examples": how clients' deltas and gradients
        are averaged (f_f's convex combination).
      central_loss: None: a datacenter dataset in ServerData arrays
        {"x", "y"}; else (params, server_arrays, key) -> scalar computed on
        the server (a regularizer; the inputs may then be FederatedData alone).
      server_lr: η_s of the server's SGD on −Δ (None: 1, x + Δ); another server
        optimizer is `with_server_optimizer` around the algorithm at server_lr = 1.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import mixed_parallel, sgd
      >>> from fedjax_sim.data import ServerData, linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> rng = np.random.default_rng(0)  # a datacenter set: 32 rows, no client axis
      >>> server = ServerData({"x": rng.normal(size=(32, 3)).astype(np.float32),
      ...                      "y": rng.normal(size=32).astype(np.float32)})
      >>> alg = mixed_parallel(linear_regression(3), sgd(0.02, steps=5), w_f=0.5, w_c=0.5)
      >>> state = alg.init(jax.random.key(1), (data, server))
      >>> state, metrics = jax.jit(alg.round)(state, (data, server), jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)
      >>> jax.jit(alg.evaluate)(state, (data, server))["client_loss"].shape  # the clients'
      (8,)

    References:
      Sean Augenstein, Andrew Hard, Lin Ning, Karan Singhal, Satyen Kale, Kurt
      Partridge, Rajiv Mathews, "Mixed Federated Learning: Joint Decentralized and
      Centralized Learning", arXiv 2022, https://arxiv.org/abs/2205.13655.
    """
    mx = _setup("mixed_parallel", model, training, central, w_f, w_c, participation,
                weighting, central_loss, server_lr)

    def round_(state: MixedState, inputs, key):
        data, server = split_inputs(inputs)
        arrays, x_t = mx.arrays(server), state.params
        cohort = mx.clients.draw(key, data, round=state.round)
        central_in = mx.central_inputs(arrays, mx.central_keys(key, mx.central.steps))
        delta_f, hat_g_f, losses0, active = mx.clients_train(state, data, cohort)
        y_c, hat_g_c, loss_c = descend(mx.central_grad(arrays),
                                       mx.central.at_round(state.round).optimizer, x_t,
                                       central_in)
        delta = optax.tree.add(optax.tree.scale(w_f, delta_f),
                               optax.tree.scale(w_c, optax.tree.sub(y_c, x_t)))
        metrics = mx.metrics(data, x_t, hat_g_f, hat_g_c, losses0, active, loss_c,
                             down=1, up=1)
        return state._replace(params=mx.server_step(x_t, delta), grad_f=hat_g_f,
                              round=state.round + 1), metrics

    return mx.algorithm(round_)


def mixed_gt1(model: Model, training: ClientTraining, *,
              central: ClientTraining | None = None, w_f=0.5, w_c=0.5,
              participation: float = 1.0, weighting: str = "uniform",
              central_loss: CentralLoss | None = None,
              server_lr=None) -> Algorithm:
    """Mixed FL by one-way gradient transfer (1-GT): clients step on w_f g_i + w_c ĝ_c.

    One round:

        ĝ_c ← g_c(x^(t)) on one central batch, sent down with x^(t)
        S ← the cohort;  each i ∈ S: Δ_i ← K steps on w_f g_i(y) + w_c ĝ_c from x^(t)
        x^(t+1) ← ServerOpt(x^(t), −mean_i Δ_i)

    Args:
      model, training, central, w_f, w_c, participation, weighting, central_loss,
        server_lr: as in `mixed_parallel`.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import mixed_gt1, sgd
      >>> from fedjax_sim.data import ServerData, linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> rng = np.random.default_rng(0)  # a datacenter set: 32 rows, no client axis
      >>> server = ServerData({"x": rng.normal(size=(32, 3)).astype(np.float32),
      ...                      "y": rng.normal(size=32).astype(np.float32)})
      >>> alg = mixed_gt1(linear_regression(3), sgd(0.02, steps=5),
      ...                 central=sgd(0.02, batch_size=16))  # ĝ_c on 16 datacenter rows
      >>> state = alg.init(jax.random.key(1), (data, server))
      >>> state, metrics = jax.jit(alg.round)(state, (data, server), jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

    References:
      Sean Augenstein, Andrew Hard, Lin Ning, Karan Singhal, Satyen Kale, Kurt
      Partridge, Rajiv Mathews, "Mixed Federated Learning: Joint Decentralized and
      Centralized Learning", arXiv 2022, https://arxiv.org/abs/2205.13655.
    """
    mx = _setup("mixed_gt1", model, training, central, w_f, w_c, participation, weighting,
                central_loss, server_lr)

    def round_(state: MixedState, inputs, key):
        data, server = split_inputs(inputs)
        arrays, x_t = mx.arrays(server), state.params
        cohort = mx.clients.draw(key, data, round=state.round)
        # One central gradient, on the first of the K keys the other variants use.
        central_in = mx.central_inputs(arrays, mx.central_keys(key, training.steps))
        loss_c, hat_g_c = mx.central_grad(arrays)(x_t, jax.tree.map(lambda a: a[0], central_in))
        delta_f, hat_g_f, losses0, active = mx.clients_train(
            state, data, cohort, _transferred(w_f, w_c, hat_g_c))
        metrics = mx.metrics(data, x_t, hat_g_f, hat_g_c, losses0, active, loss_c,
                             down=2, up=1)
        return state._replace(params=mx.server_step(x_t, delta_f), grad_f=hat_g_f,
                              round=state.round + 1), metrics

    return mx.algorithm(round_)


def mixed_gt2(model: Model, training: ClientTraining, *,
              central: ClientTraining | None = None, w_f=0.5, w_c=0.5,
              participation: float = 1.0, weighting: str = "uniform",
              central_loss: CentralLoss | None = None, combine: str = "half",
              transfer: str = "current", server_lr=None) -> Algorithm:
    """Mixed FL by two-way gradient transfer (2-GT): both sides step on the mixed gradient.

    One round:

        ĝ_c ← g_c(x^(t)), sent down with x^(t)
        S ← the cohort;  each i ∈ S: Δ_i ← K steps on w_f g_i(y) + w_c ĝ_c, and ĝ_i = g_i(x^(t))
        y_c ← K central steps on w_c g_c(y) + w_f ĝ_f    (ĝ_f = mean_i ĝ_i: `transfer`)
        x^(t+1) ← ServerOpt(x^(t), −(α·mean_i Δ_i + (1 − α)·(y_c − x^(t))))   (α: `combine`)

    combine: α, "half" (½) or "mixing" (w_f / (w_f + w_c)); transfer: ĝ_f,
    "current" (this round's) or "stale" (last round's, zeros in round 0).

    Args:
      model, training, central, w_f, w_c, participation, weighting, central_loss,
        server_lr: as in `mixed_parallel`.
      combine, transfer: above.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import mixed_gt2, sgd
      >>> from fedjax_sim.data import ServerData, linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> rng = np.random.default_rng(0)  # a datacenter set: 32 rows, no client axis
      >>> server = ServerData({"x": rng.normal(size=(32, 3)).astype(np.float32),
      ...                      "y": rng.normal(size=32).astype(np.float32)})
      >>> alg = mixed_gt2(linear_regression(3), sgd(0.02, steps=5), w_f=0.5, w_c=0.5,
      ...                 central=sgd(0.02, steps=5, batch_size=32))
      >>> state = alg.init(jax.random.key(1), (data, server))
      >>> state, metrics = jax.jit(alg.round)(state, (data, server), jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

    References:
      Sean Augenstein, Andrew Hard, Lin Ning, Karan Singhal, Satyen Kale, Kurt
      Partridge, Rajiv Mathews, "Mixed Federated Learning: Joint Decentralized and
      Centralized Learning", arXiv 2022, https://arxiv.org/abs/2205.13655.
    """
    mx = _setup("mixed_gt2", model, training, central, w_f, w_c, participation, weighting,
                central_loss, server_lr)
    check_choice("combine", combine, COMBINES)
    check_choice("transfer", transfer, TRANSFERS)

    def round_(state: MixedState, inputs, key):
        data, server = split_inputs(inputs)
        arrays, x_t = mx.arrays(server), state.params
        cohort = mx.clients.draw(key, data, round=state.round)
        central_in = mx.central_inputs(arrays, mx.central_keys(key, mx.central.steps))
        # The central scan starts with the same batch at x^(t): its first gradient is ĝ_c.
        g_c = mx.central_grad(arrays)
        loss_c, hat_g_c = g_c(x_t, jax.tree.map(lambda a: a[0], central_in))
        delta_f, hat_g_f, losses0, active = mx.clients_train(
            state, data, cohort, _transferred(w_f, w_c, hat_g_c))
        transferred = hat_g_f if transfer == "current" else state.grad_f
        y_c, _, _ = descend(g_c, mx.central.at_round(state.round).optimizer, x_t,
                            central_in, scale=w_c,
                            correction=optax.tree.scale(w_f, transferred))
        alpha = 0.5 if combine == "half" else w_f / jnp.maximum(w_f + w_c, 1e-30)
        delta = optax.tree.add(optax.tree.scale(alpha, delta_f),
                               optax.tree.scale(1.0 - alpha, optax.tree.sub(y_c, x_t)))
        metrics = mx.metrics(data, x_t, hat_g_f, hat_g_c, losses0, active, loss_c,
                             down=2, up=2)
        return state._replace(params=mx.server_step(x_t, delta), grad_f=hat_g_f,
                              round=state.round + 1), metrics

    return mx.algorithm(round_)


def mixed_centralized(model: Model, training: ClientTraining, *,
                      central: ClientTraining | None = None, w_f=0.5, w_c=0.5,
                      participation: float = 1.0, weighting: str = "uniform",
                      central_loss: CentralLoss | None = None,
                      server_lr=None) -> Algorithm:
    """The centrally trained oracle: K minibatch-SGD steps per round on the mixed loss, all
    data pooled on the server (each step a fresh cohort's batches and a central batch).

    One round (nothing is communicated):

        y ← x^(t);  K times: S_j ← a fresh cohort;  y ← y − η (w_f ∇̃f_f(y; S_j) + w_c ∇̃f_c(y))
        x^(t+1) ← ServerOpt(x^(t), −(y − x^(t)))

    Args:
      model, training, central, w_f, w_c, participation, weighting, central_loss,
        server_lr: as in `mixed_parallel`.

    Examples:
      >>> import jax
      >>> import numpy as np
      >>> from fedjax_sim.algorithms import mixed_centralized, sgd
      >>> from fedjax_sim.data import ServerData, linear_mixture
      >>> from fedjax_sim.models import linear_regression
      >>> data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
      >>> rng = np.random.default_rng(0)  # a datacenter set: 32 rows, no client axis
      >>> server = ServerData({"x": rng.normal(size=(32, 3)).astype(np.float32),
      ...                      "y": rng.normal(size=32).astype(np.float32)})
      >>> alg = mixed_centralized(linear_regression(3), sgd(0.02, steps=5))
      >>> state = alg.init(jax.random.key(1), (data, server))
      >>> state, metrics = jax.jit(alg.round)(state, (data, server), jax.random.key(2))
      >>> state.params.shape, int(state.round)
      ((3,), 1)

    References:
      Sean Augenstein, Andrew Hard, Lin Ning, Karan Singhal, Satyen Kale, Kurt
      Partridge, Rajiv Mathews, "Mixed Federated Learning: Joint Decentralized and
      Centralized Learning", arXiv 2022, https://arxiv.org/abs/2205.13655.
    """
    mx = _setup("mixed_centralized", model, training, central, w_f, w_c, participation,
                weighting, central_loss, server_lr)
    batch_size = training.batch_size

    def round_(state: MixedState, inputs, key):
        data, server = split_inputs(inputs)
        arrays, x_t = mx.arrays(server), state.params
        s = mx.clients.draw(key, data, round=state.round).size
        g_c = mx.central_grad(arrays)

        def mixed_grad(p, k):
            k_cohort, k_c = jax.random.split(k)
            members = sample_cohort(k_cohort, data.num_clients, s)
            part = take(members, data)

            def one(x, y, n, kk):
                step = client_step_input(kk, n, y.shape[0], batch_size)
                return client_batch_grad(model, x, y, n, batch_size)(p, step)

            losses, grads = jax.vmap(one)(part.x, part.y, part.num_examples, members.keys)
            weights = mx.clients.weights(part.active(), part.num_examples)
            weight = jnp.sum(weights)
            grad_f = mean_or_keep(weighted_sum(grads, weights), weight, optax.tree.zeros_like(p))
            loss_f = mean_over(losses, weights)
            loss_c, grad_c = g_c(p, mx.drawn.draw(arrays, k_c))
            mixed = optax.tree.add(optax.tree.scale(w_f, grad_f), optax.tree.scale(w_c, grad_c))
            return (loss_f, loss_c, grad_f, grad_c), mixed

        end, _, (loss_f, loss_c, grad_f, grad_c) = descend(
            mixed_grad, training.at_round(state.round).optimizer, x_t,
            mx.central_keys(key, training.steps))
        updates, _ = mx.server_opt.update(optax.tree.sub(x_t, end), mx.server_opt.init(x_t),
                                          x_t)
        params = optax.apply_updates(x_t, updates)
        g_tilde, b_tilde = dissimilarity(grad_f, grad_c, w_f, w_c)
        metrics = {
            "cohort_loss": loss_f,
            "central_loss": loss_c,
            "mixed_loss": w_f * loss_f + w_c * loss_c,
            "G_tilde": g_tilde,
            "B_tilde": b_tilde,
            "floats_down": jnp.float32(0.0),
            "floats_up": jnp.float32(0.0),
        }
        return state._replace(params=params, grad_f=grad_f, round=state.round + 1), metrics

    return mx.algorithm(round_)


VARIANTS = {"parallel": mixed_parallel, "gt1": mixed_gt1, "gt2": mixed_gt2,
            "centralized": mixed_centralized}


def mixed(model: Model, training: ClientTraining, *, variant: str, combine: str = "half",
          transfer: str = "current", **settings) -> Algorithm:
    """The factory of VARIANTS[variant] ("parallel", "gt1", "gt2" or "centralized"), for a
    caller that holds the variant as a name; `settings` are the factory's.

    A setting the variant does not read is refused rather than ignored: combine and
    transfer are 2-GT's.
    """
    check_choice("variant", variant, tuple(VARIANTS))
    if variant == "gt2":
        return mixed_gt2(model, training, combine=combine, transfer=transfer, **settings)
    unread = [name for name, changed in (("combine", combine != "half"),
                                         ("transfer", transfer != "current")) if changed]
    if unread:
        raise ValueError(f"mixed variant {variant!r} does not read {', '.join(unread)}; "
                         "leave them unset.")
    return VARIANTS[variant](model, training, **settings)


def on_federated_data(algorithm: Algorithm) -> Algorithm:
    """An algorithm of client data alone (FedAvg: "FL only") run on (FederatedData, ServerData)."""

    def init(key, inputs):
        return algorithm.init(key, split_inputs(inputs)[0])

    def round_(state, inputs, key):
        return algorithm.round(state, split_inputs(inputs)[0], key)

    def evaluate(state, inputs):
        return algorithm.evaluate(state, split_inputs(inputs)[0])

    return Algorithm(init, round_, evaluate, algorithm.client_axes)
