"""FedOpt: the server's step on the clients' mean delta, as an optax transformation.

Sashank J. Reddi, Zachary Charles, Manzil Zaheer, Zachary Garrett, Keith Rush,
Jakub Konečný, Sanjiv Kumar, H. Brendan McMahan. "Adaptive Federated
Optimization". ICLR 2021, arXiv:2003.00295.

FedOpt (the paper's Algorithm 1) treats the clients' mean change
Δ_t = mean_i (x_i − x_t) as a pseudo-gradient −Δ_t for a server optimizer:
x_{t+1} = ServerOpt(x_t, −Δ_t, η, t). Plain SGD at η = 1 is FedAvg. The
adaptive presets are the paper's Algorithm 2, written here as it is printed:

    m_t = β₁ m_{t−1} + (1 − β₁) Δ_t
    v_t = v_{t−1} + Δ_t²                                  (FedAdagrad)
    v_t = v_{t−1} − (1 − β₂) Δ_t² sign(v_{t−1} − Δ_t²)     (FedYogi)
    v_t = β₂ v_{t−1} + (1 − β₂) Δ_t²                       (FedAdam)
    x_{t+1} = x_t + η m_t / (√v_t + τ)

Choices where the paper leaves room [I]:
- m_{−1} = 0 and v_{−1} = τ² (the paper asks for v_{−1} ≥ τ²); no bias
  correction (Algorithm 2 has none; optax's adam/yogi and Flower's FedAdam
  correct it, so they differ in the first rounds: pass `optax.adam(...)` as
  `server_optimizer` for that form).
- β₁ = 0.9, β₂ = 0.99, τ = 1e-3: the values the paper fixes for its
  experiments (τ is tuned there over 1e-5 … 1e-1; 1e-3 is in its range).
- "sgdm" (FedAvgM, Hsu et al. 2019) is optax's heavy-ball SGD with momentum
  β = 0.9: v_t = β v_{t−1} + Δ_t, x_{t+1} = x_t + η v_t.
- Default server learning rates: 1 for "sgd" and "sgdm" (FedAvg; FedAvgM as
  Hsu et al. run it); 1e-2 for the adaptive ones, the order of the paper's
  tuned η on its image tasks. Tune them.
- A round in which no client holding data took part changes neither the model
  nor the optimizer state (a zero pseudo-gradient would still move a model
  with momentum).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

SERVER_OPTIMIZERS = ("sgd", "sgdm", "adam", "yogi", "adagrad")
DEFAULT_SERVER_LR = {"sgd": 1.0, "sgdm": 1.0, "adam": 1e-2, "yogi": 1e-2, "adagrad": 1e-2}
BETA1, BETA2, TAU = 0.9, 0.99, 1e-3  # Reddi et al.'s β₁, β₂ and adaptivity τ
MOMENTUM = 0.9  # FedAvgM's server momentum


class AdaptiveState(NamedTuple):
    m: Any  # pytree like params, the first moment of Δ
    v: Any  # pytree like params, the second-moment estimate of Δ


def scale_by_adaptive_server(rule: str, b1: float = BETA1, b2: float = BETA2,
                             tau: float = TAU) -> optax.GradientTransformation:
    """The paper's Algorithm 2 without the learning rate: g ↦ m_t / (√v_t + τ).

    Fed the pseudo-gradient g = −Δ, m_t is that of −Δ and v_t that of Δ², so
    chained with `optax.scale_by_learning_rate(η)` it gives x + η m_t(Δ) / (√v_t + τ).

    Args:
      rule: "adam", "yogi" or "adagrad": how v_t follows Δ_t².
      b1, b2: β₁, β₂ (b2 unused by "adagrad").
      tau: τ, the adaptivity; also √v_{−1}.
    """
    if rule not in ("adam", "yogi", "adagrad"):
        raise ValueError(f"rule must be one of ('adam', 'yogi', 'adagrad'); got {rule!r}.")

    def init(params):
        return AdaptiveState(jax.tree.map(jnp.zeros_like, params),
                             jax.tree.map(lambda p: jnp.full_like(p, tau**2), params))

    def second_moment(v, g):
        g2 = g * g
        if rule == "adagrad":
            return v + g2
        if rule == "yogi":
            return v - (1.0 - b2) * g2 * jnp.sign(v - g2)
        return b2 * v + (1.0 - b2) * g2

    def update(grads, state, params=None):
        del params
        m = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state.m, grads)
        v = jax.tree.map(second_moment, state.v, grads)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), m, v)
        return updates, AdaptiveState(m, v)

    return optax.GradientTransformation(init, update)


def _check_lr(server_lr) -> None:
    if isinstance(server_lr, (int, float, np.number)) and not (
        math.isfinite(float(server_lr)) and server_lr > 0
    ):
        raise ValueError(f"server_lr must be a finite number > 0; got {server_lr!r}.")


def make_server_optimizer(name, server_lr=None) -> optax.GradientTransformation | None:
    """The server optimizer of FedOpt, by preset name or as given.

    Args:
      name: None (no server optimizer: the caller's plain average), one of
        "sgd", "sgdm", "adam", "yogi", "adagrad" (the presets above), or an
        optax.GradientTransformation applied to the pseudo-gradient −Δ.
      server_lr: η for a preset (None: its default in DEFAULT_SERVER_LR); may
        be traced (a sweep vmaps over it). Refused with a transformation,
        which carries its own.

    Returns:
      The transformation, or None when `name` is None.
    """
    if name is None or isinstance(name, optax.GradientTransformation):
        if server_lr is not None:
            raise ValueError("server_lr applies to a server_optimizer given by name "
                             f"{SERVER_OPTIMIZERS}; an optax transformation carries its own "
                             "learning rate and no server_optimizer takes none.")
        return name
    if not isinstance(name, str) or name not in SERVER_OPTIMIZERS:
        raise ValueError(f"server_optimizer must be None, an optax.GradientTransformation or "
                         f"one of {SERVER_OPTIMIZERS}; got {name!r}.")
    lr = DEFAULT_SERVER_LR[name] if server_lr is None else server_lr
    _check_lr(lr)
    if name == "sgd":
        return optax.sgd(lr)
    if name == "sgdm":
        return optax.sgd(lr, momentum=MOMENTUM)
    return optax.chain(scale_by_adaptive_server(name), optax.scale_by_learning_rate(lr))


def apply_server_update(optimizer: optax.GradientTransformation, params, opt_state,
                        mean_delta, trained=None):
    """x_{t+1} = ServerOpt(x_t, −Δ_t): one server step on the clients' mean delta.

    Args:
      optimizer: the server optimizer (from `make_server_optimizer`).
      params: x_t.
      opt_state: its state.
      mean_delta: Δ_t, pytree like params: the (weighted) mean of x_i − x_t.
      trained: optional scalar bool; where False (no client with data took
        part) params and state are returned unchanged.

    Returns:
      (x_{t+1}, new optimizer state).
    """
    pseudo_grad = jax.tree.map(jnp.negative, mean_delta)
    updates, new_state = optimizer.update(pseudo_grad, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if trained is None:
        return new_params, new_state
    return jax.tree.map(lambda new, old: jnp.where(trained, new, old),
                        (new_params, new_state), (params, opt_state))
