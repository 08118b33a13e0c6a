"""Wikipedia loader: markup stripping and the dump parse, on a tiny fake gensim wheel."""

from __future__ import annotations

import bz2
import zipfile

import pytest

from fedjax_sim.data import archives, wiki

# The article's first paragraph: one line in the dump (a line break there is text).
LEAD = ("'''Anarchism''' is a [[political philosophy]] that advocates "
        "[[self-governance|self-governed]] societies.&lt;ref&gt;Cite, p. 1&lt;/ref&gt; "
        "See [http://example.org the site] or http://bare.example.org.")

PAGES = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/" version="0.10">
  <siteinfo><sitename>Wikipedia</sitename></siteinfo>
  <page>
    <title>AccessibleComputing</title><ns>0</ns><id>10</id>
    <redirect title="Computer accessibility" />
    <revision><text xml:space="preserve">#REDIRECT [[Computer accessibility]]</text></revision>
  </page>
  <page>
    <title>Anarchism</title><ns>0</ns><id>12</id>
    <revision><text xml:space="preserve">{{Redirect|Anarchist|other uses {{nested|x}}}}
{{Infobox
| name = x
}}
@LEAD@
[[File:A.jpg|thumb|A caption with a [[link]] inside]]
&lt;!-- a hidden comment --&gt;
== History ==
* Caf\u00e9 society &amp;ndash; the 1840s\u2013 era.
{| class="wikitable"
| cell || {{tmpl}}
|}
[[Category:Political philosophy]]
[[de:Anarchismus]]</text></revision>
  </page>
  <page>
    <title>Talk:Anarchism</title><ns>1</ns><id>13</id>
    <revision><text xml:space="preserve">Not an article.</text></revision>
  </page>
  <page>
    <title>Empty</title><ns>0</ns><id>14</id>
    <revision><text xml:space="preserve">{{only a template}}</text></revision>
  </page>
</mediawiki>
""".replace("@LEAD@", LEAD)

ANARCHISM = ("Anarchism is a political philosophy that advocates self-governed societies. "
             "See the site or\n"
             "History\n"
             "Cafe society - the 1840s- era.")


def test_plain_text_strips_the_markup():
    assert wiki.plain_text("x {{a|{{b}}}} y") == "x y"
    assert wiki.plain_text("[[a|b]] [[c]] [[d|[[e]]]]") == "b c e"
    assert wiki.plain_text("a<ref name=n/>b<ref>c</ref>d") == "abd"
    assert wiki.plain_text("=== Head ===\n''it'' '''bold'''") == "Head\nit bold"
    assert wiki.plain_text("[[Image:x.png|a [[b|c]] d]]e") == "e"
    assert wiki.plain_text("S\u00e3o \u2014 \u201cq\u201d") == 'Sao - "q"'


def _write_wheel(root, member_bytes):
    (root / "archives").mkdir(parents=True)
    path = root / "archives" / f"{wiki.PACKAGE}-{wiki.VERSION}-cp311-cp311-manylinux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(wiki.MEMBER, member_bytes)
        zf.writestr("gensim/__init__.py", "")
    return path


def test_articles_from_a_fake_wheel(tmp_path):
    _write_wheel(tmp_path, bz2.compress(PAGES.encode()))
    articles = wiki.wikipedia_articles(cache_dir=tmp_path, download=False)
    # The redirect, the talk page and the article with no prose are dropped.
    assert articles == [wiki.Article("Anarchism", ANARCHISM)]
    cache = next(tmp_path.glob("extracted/**/articles.*.json"))
    # The second call reads the JSON cache: change it and the change shows.
    cache.write_text(cache.read_text().replace("era.", "cached."))
    again = wiki.wikipedia_articles(cache_dir=tmp_path, download=False)
    assert again[0].text.endswith("cached.")


def test_missing_or_unreadable_wheel_names_package_and_version(tmp_path):
    with pytest.raises(archives.DataUnavailable, match=r"gensim==4\.4\.0.*pip"):
        wiki.wikipedia_articles(cache_dir=tmp_path / "empty", download=False)
    _write_wheel(tmp_path, b"not bz2")
    with pytest.raises(archives.DataUnavailable, match=r"gensim==4\.4\.0.*bz2"):
        wiki.wikipedia_articles(cache_dir=tmp_path, download=False)
