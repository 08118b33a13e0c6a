"""The methods of the DRFA / DRFLM comparison, built from the registered algorithms:

- fedavg: the registered FedAvg (uniform cohort without replacement), its
  clients weighted by their training rows (setting weighting=examples, the
  default: DRFLM's objective Σ_i (n_i/n) f_i, which its FedAvg baseline
  optimises) or uniformly (weighting=uniform);
- drfa: DRFA (λ-sampled cohort, λ ascent on the losses of w̃);
- drflm: DRFA with a local mixup step after g (the GNN's graph embedding);
- fedavg_mixup: DRFLM with λ_lr = 0, λ fixed at the FedAvg weights (∝ rows
  with weighting=examples, else uniform): the control that separates mixup's
  effect from the robust weighting. Like drfa and drflm it follows
  official_code (paper form: a cohort drawn ∝ λ with replacement, plain
  mean; FedTorch form: a uniform cohort, λ-weighted aggregation).
- afl: Agnostic FL (λ by projected ascent, λ-weighted averaging);
- qffl: q-FedAvg at its own SGD step (its Lipschitz estimate is 1/qffl_lr).
"""

from __future__ import annotations

import numpy as np
import optax

from fedjax_sim.algorithms import afl, drfa, drflm, fedavg, qffl

METHODS = ("fedavg", "drfa", "drflm", "fedavg_mixup", "afl", "qffl")


def build_method(name: str, s: dict, model):
    # A fresh optimizer state on every client every round (as FedAvg's clients do).
    opt = optax.adam(s["lr"]) if s["optimizer"] == "adam" else optax.sgd(s["lr"])
    common = dict(local_steps=s["local_steps"], batch_size=s["batch_size"],
                  participation=s["participation"])
    model_opt = (model, opt)
    robust = dict(lambda_floor=s["lambda_floor"] or None, official_code=s["official_code"])
    if name == "fedavg":
        return fedavg(*model_opt, weighting=s["weighting"], **common)
    if name == "drfa":
        return drfa(*model_opt, lambda_lr=s["lambda_lr"], **common, **robust)
    mix = dict(alpha=s["mixup_alpha"], beta=s["mixup_beta"], lambda_loss=s["lambda_loss"])
    if name == "drflm":
        return drflm(*model_opt, lambda_lr=s["lambda_lr"], **mix, **common, **robust)
    if name == "fedavg_mixup":  # λ stays at FedAvg's weights (official_code keeps a given λ₀)
        if s["weighting"] == "examples":
            lam0 = "examples"
        elif s["official_code"]:  # FedTorch's default λ₀ is ∝ rows: uniform must be explicit
            lam0 = np.full(s["num_clients"], 1.0 / s["num_clients"])
        else:
            lam0 = "uniform"
        return drflm(*model_opt, lambda_lr=0.0, lambda_init=lam0, **mix, **common, **robust)
    if name == "afl":  # Agnostic FL: λ by projected ascent, λ-weighted averaging
        return afl(*model_opt, lambda_lr=s["lambda_lr"], **common)
    if name == "qffl":  # q-FedAvg: plain SGD at qffl_lr (its L = 1/lr assumes SGD)
        return qffl(model, q=s["q"], learning_rate=s["qffl_lr"], **common)
    raise ValueError(f"method must be one of {METHODS}; got {name!r}.")
