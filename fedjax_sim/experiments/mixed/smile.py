"""Mixed FL label imbalance, the paper's smile task, on sklearn's 8×8 digits (`mixed-smile`):
federated clients hold only "positive" digits, the datacenter only "negative" ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import FederatedData, ServerData
from fedjax_sim.experiments.base import Preset
from fedjax_sim.experiments.mixed.base import Task, mixed_task, shared_settings
from fedjax_sim.experiments.settings import Setting, count
from fedjax_sim.models.zoo import mlp_classifier


def digits_label_imbalance(seed: int, *, positive: tuple[int, ...], m: int, test_fraction: float):
    """sklearn's 8×8 digits as a binary task: federated clients hold only positives.

    Label 1 = a digit in `positive`, 0 = any other. The positives' training
    rows are shuffled and dealt to m clients (as equal as possible); the
    datacenter holds only the negatives' training rows; a stratified
    `test_fraction` of each class is held out.

    Returns:
      (x_f [m, n_max, 64], n_f [m], x_c [n_c, 64], x_test, y_test), float32 in [0, 1].
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    label = np.isin(digits.target, positive).astype(np.int32)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in (0, 1):
        idx = rng.permutation(np.flatnonzero(label == c))
        cut = int(round(test_fraction * len(idx)))
        test.append(idx[:cut])
        train.append(idx[cut:])
    pos = train[1]
    parts = np.array_split(pos, m)
    n_max = max(len(p) for p in parts)
    x_f = np.zeros((m, n_max, x.shape[1]), np.float32)
    n_f = np.zeros((m,), np.int32)
    for i, p in enumerate(parts):
        x_f[i, : len(p)] = x[p]
        n_f[i] = len(p)
    test_idx = np.concatenate(test)
    return x_f, n_f, x[train[0]], x[test_idx], label[test_idx]


def binary_auc(scores, labels):
    """ROC AUC = P(score of a positive > score of a negative), ties counting ½. Scalar."""
    pos, neg = labels == 1, labels == 0
    diff = scores[:, None] - scores[None, :]
    pair = (pos[:, None] & neg[None, :]).astype(jnp.float32)
    wins = jnp.where(diff > 0, 1.0, jnp.where(diff == 0, 0.5, 0.0))
    return jnp.sum(wins * pair) / jnp.maximum(jnp.sum(pair), 1.0)


def check(s: dict) -> None:
    digits = set(s["positive"])
    if not s["positive"] or not digits <= set("0123456789") or len(digits) == 10:
        raise ValueError(
            f"setting positive must list some but not all digits 0-9 (e.g. 01234); got "
            f"{s['positive']!r}.")


def seed_data(s: dict, seed_ids: list[int]):
    """Each seed's own split of the digits (seeded with seed·1000 + its id)."""
    positive = tuple(sorted(int(c) for c in set(s["positive"])))
    per = [digits_label_imbalance(s["seed"] * 1000 + i, positive=positive, m=s["m"],
                                  test_fraction=s["test_fraction"]) for i in seed_ids]
    x_f = np.stack([p[0] for p in per])
    n_f = np.stack([p[1] for p in per])
    n_c = min(len(p[2]) for p in per)
    x_c = np.stack([p[2][:n_c] for p in per])
    n_t = min(len(p[3]) for p in per)
    x_t, y_t = np.stack([p[3][:n_t] for p in per]), np.stack([p[4][:n_t] for p in per])
    seeds, m, n_max = x_f.shape[:3]
    data = FederatedData(jnp.asarray(x_f), jnp.ones((seeds, m, n_max), jnp.int32),
                         jnp.asarray(n_f), jnp.full((seeds, m), -1, jnp.int32))
    server = ServerData({"x": jnp.asarray(x_c), "y": jnp.zeros((seeds, n_c), jnp.int32)})
    test = {"x": jnp.asarray(x_t), "y": jnp.asarray(y_t)}
    params = jax.eval_shape(functions(s)[0].init, jax.random.key(0))
    info = {"num_params": float(sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))),
            "positive": positive, "clients_rows": int(n_f.sum(-1).mean()), "n_c": n_c,
            "n_test": n_t}
    return (data, server, test), info


def functions(s: dict):
    model = mlp_classifier((64,), (s["hidden"],), 2)

    def objective(params, inputs):
        data, server, _ = inputs
        mask = data.mask()
        fed = jax.vmap(lambda x, y: model.example_loss(model.apply(params, x), y))(
            data.x, data.y)
        per_client = jnp.sum(fed * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1.0)
        cen = jnp.mean(model.example_loss(model.apply(params, server.arrays["x"]),
                                          server.arrays["y"]))
        return {"federated_loss": jnp.mean(per_client), "central_loss": cen}

    def evaluate(params, inputs):
        _, _, test = inputs
        logits = model.apply(params, test["x"])
        score = logits[:, 1] - logits[:, 0]
        return {**objective(params, inputs),
                "test_auc": binary_auc(score, test["y"]),
                "test_loss": jnp.mean(model.example_loss(logits, test["y"])),
                "test_accuracy": jnp.mean(model.correct(logits, test["y"]))}

    # The per-round objective would run the MLP over every client each round: the
    # curves come from the evaluations instead.
    return model, None, evaluate, None


def notes(s, info):
    negative = sorted(set(range(10)) - set(info["positive"]))
    return {
        "data": "sklearn.datasets.load_digits (1 797 8×8 digits, shipped with scikit-learn; "
                "CelebA is not available offline): label 1 = digits "
                f"{''.join(map(str, info['positive']))} (held by the {s['m']} federated "
                f"clients, {info['clients_rows']} training rows), label 0 = digits "
                f"{''.join(map(str, negative))} (the datacenter, {info['n_c']} rows); "
                f"{info['n_test']} held-out rows of both classes for AUC/loss",
        "model": f"MLP 64-{s['hidden']}-2, softmax cross-entropy; AUC of logit₁ − logit₀",
    }


TASK = Task(
    num_clients=lambda s: s["m"],
    seed_data=seed_data,
    functions=functions,
    table_metrics=("test_auc", "test_loss", "test_accuracy", "federated_loss", "central_loss",
                   "G_tilde_mean", "G_tilde_median", "B_tilde_mean", "B_tilde_median",
                   "floats_down", "floats_up"),
    notes=notes,
    check=check,
)

SMILE = mixed_task(
    TASK,
    name="mixed_smile",
    description=("Label imbalance (the paper's smile task) on sklearn digits: clients hold "
                 "only positive digits, the datacenter only negatives; AUC and loss vs "
                 "rounds."),
    settings=(
        Setting("positive", str, "01234", "digits of label 1 (the clients'); the others are the "
                "datacenter's label 0"),
        count("m", 36, "federated clients (the positives' training rows dealt evenly)"),
        Setting("test_fraction", float, 0.2, "held-out fraction of each class", minimum=0.05,
                maximum=0.5),
        count("hidden", 32, "hidden units of the MLP 64-hidden-2"),
        *shared_settings(rounds=60, lr=0.1, local_steps=5, clients_per_round=10,
                         batch_size=10, central_batch_size=32, eval_every=5),
    ),
    panels=(("test_auc", "test AUC"), ("test_loss", "test loss"),
            ("federated_loss", "federated loss f_f"), ("central_loss", "datacenter loss f_c")),
)

PRESET = Preset("mixed-smile", SMILE,
                "Mixed FL label imbalance on sklearn digits (clients: positives only, datacenter: "
                "negatives only): AUC and loss vs rounds.")
