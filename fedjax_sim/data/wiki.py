"""English Wikipedia articles as plain text, from the excerpt of a dump that gensim ships.

The `gensim==4.4.0` wheel carries, as test data, the bz2-compressed XML of the
first pages of an English Wikipedia dump
(`gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`,
1.7 MB; 106 articles once redirects and other namespaces are dropped, about
2.9 M characters of prose). It is read straight out of the wheel through
`data/archives.py`; gensim itself is never installed or imported. Wikipedia's
text is licensed CC BY-SA (and GFDL): it is read at run time, never copied into
this repository.

The wikitext markup is stripped by a few rules, in the spirit of gensim's
`filter_wiki`, not a full MediaWiki parser: comments, `<ref>` notes, templates
`{{...}}` and tables `{|...|}` (nested) go; file, image, category and
interlanguage links go whole; `[[target|label]]` keeps the label and
`[[target]]` the target; external links keep their label; headings keep their
words; bold/italic quotes, list markers and HTML tags go. Accented letters lose
their accents (NFKD) and dashes become '-', so nearly all the text lies in the
ASCII vocabulary of `data/text.py`; what remains outside it becomes its
out-of-vocabulary id.
"""

from __future__ import annotations

import bz2
import html
import json
import os
import re
import unicodedata
import xml.etree.ElementTree as ET
from typing import NamedTuple

from fedjax_sim.data import archives

PACKAGE, VERSION = "gensim", "4.4.0"
MEMBER = ("gensim/test/test_data/"
          "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
_CACHE_NAME = "articles.v1.json"  # bump the version when the cleaning changes


class Article(NamedTuple):
    """One article: its title and its plain text, one paragraph (or heading) per line."""

    title: str
    text: str


_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
_EXTERNAL = re.compile(r"\[(?:https?|ftp)://[^\s\]]+(?:\s([^\]]*))?\]")
_URL = re.compile(r"https?://\S+")
_DROPPED_LINK = re.compile(r"\[\[\s*(?:File|Image|Category|[a-z][a-z\-]{1,11}):", re.I)
_LINK = re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_QUOTES = re.compile(r"'{2,}")
_LIST = re.compile(r"^[*#:;]+\s*", re.M)
_DASHES = str.maketrans({"\u2013": "-", "\u2014": "-", "\u2212": "-", "\u2010": "-",
                         "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                         "\u00a0": " "})


def _drop_nested(text: str, opener: str, closer: str) -> str:
    """text without every (possibly nested) opener ... closer span."""
    out, depth, i, n = [], 0, 0, len(text)
    while i < n:
        if text.startswith(opener, i):
            depth, i = depth + 1, i + len(opener)
        elif depth and text.startswith(closer, i):
            depth, i = depth - 1, i + len(closer)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def _drop_links(text: str) -> str:
    """text without file/image/category/interlanguage links, whose captions nest links."""
    while (found := _DROPPED_LINK.search(text)) is not None:
        depth, i = 0, found.start()
        while i < len(text):
            if text.startswith("[[", i):
                depth, i = depth + 1, i + 2
            elif text.startswith("]]", i):
                depth, i = depth - 1, i + 2
                if depth == 0:
                    break
            else:
                i += 1
        text = text[: found.start()] + text[i:]
    return text


def plain_text(wikitext: str) -> str:
    """The prose of one article's wikitext: paragraphs and headings, one per line.

    Table rows left over by malformed markup (lines opening with '|' or '!') are dropped.
    """
    t = _COMMENT.sub("", wikitext)
    t = _REF.sub("", t)
    t = _drop_nested(t, "{{", "}}")
    t = _drop_nested(t, "{|", "|}")
    t = _drop_links(t)
    for _ in range(3):  # a label may itself hold a link
        t = _LINK.sub(r"\1", t)
    t = _EXTERNAL.sub(lambda m: m.group(1) or "", t)
    t = _URL.sub("", t)
    t = _TAG.sub("", html.unescape(t))
    t = _HEADING.sub(r"\1", t)
    t = _QUOTES.sub("", t)
    t = _LIST.sub("", t)
    t = unicodedata.normalize("NFKD", t.translate(_DASHES))
    t = "".join(c for c in t if not unicodedata.combining(c))
    lines = (" ".join(line.split()) for line in t.split("\n"))
    return "\n".join(line for line in lines if line and not line.startswith(("|", "!")))


def parse_dump(xml: bytes | str) -> list[Article]:
    """The articles of a MediaWiki XML export, in file order: namespace 0 only, no
    redirects, no article whose plain text is empty."""
    root = ET.fromstring(xml)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    articles = []
    for page in root.iter(f"{ns}page"):
        wikitext = page.findtext(f"{ns}revision/{ns}text") or ""
        if (page.findtext(f"{ns}ns") or "0").strip() != "0" or page.find(f"{ns}redirect") \
                is not None or wikitext.lstrip().upper().startswith("#REDIRECT"):
            continue
        text = plain_text(wikitext)
        if text:
            articles.append(Article(page.findtext(f"{ns}title") or "", text))
    return articles


def wikipedia_articles(cache_dir=None, *, download: bool = True) -> list[Article]:
    """The articles of the Wikipedia excerpt in the `gensim==4.4.0` wheel, in dump order.

    The cleaned articles are cached as JSON beside the extracted member (written
    atomically), so later calls neither decompress nor parse the dump.

    Args:
      cache_dir: the cache directory (default: $FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim).
      download: fetch the wheel with pip when it is not cached; False raises instead.

    Raises:
      archives.DataUnavailable: the wheel is not cached and cannot be fetched (the
        message names gensim==4.4.0 and the pip command), or it cannot be read.
    """
    path = archives.member_path(PACKAGE, VERSION, MEMBER, cache_dir=cache_dir,
                                download=download)
    cache = path.with_name(_CACHE_NAME)
    if cache.is_file():
        return [Article(*row) for row in json.loads(cache.read_text())]
    try:
        articles = parse_dump(bz2.decompress(path.read_bytes()))
    except (OSError, EOFError, ValueError, ET.ParseError) as err:
        raise archives.DataUnavailable(
            f"{path} (from {PACKAGE}=={VERSION}) is not a readable bz2-compressed XML dump "
            f"({type(err).__name__}: {err}); delete it and the wheel under the cache's "
            "archives/ to fetch them again.") from None
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps([list(a) for a in articles]))
    os.replace(tmp, cache)
    return articles


__all__ = ["Article", "parse_dump", "plain_text", "wikipedia_articles"]
