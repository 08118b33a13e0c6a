"""Formulas render as math and no asterisk turns into stray emphasis (docs/markup_checks.py).

The checks run inside every `mkdocs build` (docs/hooks.py), so a page with a misread
asterisk or an unrendered formula fails the build. Here they are tested on examples
that must fail and pass, run on the README (which the site does not build), and run on
the built site, whose pages with formulas must load KaTeX. Where Chromium and KaTeX's
npm package are installed (optional: `apt-get install chromium`, `npm install katex`),
the page of protocols is opened headless with KaTeX loaded from that package and every
formula must render without a KaTeX error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from docs_site import ROOT, built_site

_spec = importlib.util.spec_from_file_location("docs_markup_checks",
                                               ROOT / "docs" / "markup_checks.py")
checks = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = checks
_spec.loader.exec_module(checks)


# --------------------------------------------------------------------------- Markdown


@pytest.mark.parametrize("text", [
    "Data: θ*_j = R·b_j with b_j ∈ {0,1}^d and y = xᵀθ*_c + ε.",  # pairs into emphasis
    "The distance ‖w − w*‖ to the optimum.",                      # an unopened closer
    "FedNova's distance to w* shrinks, and w* is the fit.",
    "An *emphasis that never closes.\n\nNext paragraph.",
    "A **strong one that never closes.",
    "| w* | Σ p_i F_i |",                                           # in a table cell
    "- a list item with θ*_j inside",
])
def test_misread_asterisks_are_found(text):
    assert checks.markdown_problems(text), text


@pytest.mark.parametrize("text", [
    "Data: $\\theta^*_j = R\\, b_j$ and $w^*$ and $$\\sum_i p_i F_i$$.",
    "As in *ifca:synthetic/train_cluster.py*, a *(recalled)* number.",
    "**`run`.** writes `metrics.csv`; **Option I** (`option=\"gradient\"`).",
    "Code: `ifca-success-*` and `[N, *features]` and an escaped \\* asterisk.",
    "* a list item\n* another, *emphasised*",
    "```python\nx = a * b  # θ*_j\n```",
    "Text.\n\n    indented code: w* and θ*_j\n\nText.",
    "<!-- a comment with w* -->",
    "| `tune_*` | *(read by fedavg)* |",
    "***",
])
def test_well_formed_markup_passes(text):
    assert checks.markdown_problems(text) == [], text


def test_the_readme_has_no_misread_asterisk():
    assert checks.markdown_problems((ROOT / "README.md").read_text(), "README.md") == []


# --------------------------------------------------------------------------- HTML


@pytest.mark.parametrize("html", [
    "<p>the loss <em>_j = R·b_j with θ</em> of</p>",                  # after θ*_j … θ*
    "<p>text <em>. Two variants run side by side: </em> end</p>",
    "<p>a formula left as $\\theta^*_j$ in the text</p>",
    "<p>display $$\\sum_i x_i$$ left</p>",
    "<p>a TeX command \\sqrt{d} in prose</p>",
    "<p>env <span class=\"arithmatex\">\\(FEDJAX_SIM_CACHE or ~/.cache (\\)</span>HOME</p>",
    "<p><span class=\"arithmatex\">\\(x_{i\\)</span></p>",
    "<p><span class=\"arithmatex\">$x$</span></p>",
])
def test_broken_pages_are_found(html):
    assert checks.html_problems(html), html


@pytest.mark.parametrize("html", [
    "<p><span class=\"arithmatex\">\\(\\theta^*_j = R\\, \\mathrm{Bernoulli}(\\tfrac12)^d\\)"
    "</span> and <em>ifca:mnist</em>, <strong><code>run</code>.</strong></p>",
    "<div class=\"arithmatex\">\\[\\tilde G^2 = \\lVert a \\rVert^2\\]</div>",
    "<p>cache (default: $FEDJAX_SIM_CACHE or ~/.cache/fedjax_sim)</p>",
    "<pre><code>$x$ \\sqrt{d} w*</code></pre>",
    "<p>at <span class=\"arithmatex\">\\(\\lfloor \\text{val\\_fraction} \\cdot n_i \\rfloor\\)"
    "</span> rows</p>",
    "<div class=\"arithmatex\">\\[\\begin{aligned} C &\\leftarrow C \\end{aligned}\\]</div>",
])
def test_good_pages_pass(html):
    assert checks.html_problems(html) == [], html


# --------------------------------------------------------------------------- the site


@pytest.fixture(scope="module")
def site():
    return built_site()


def test_every_built_page_passes_and_the_formulas_load_katex(site):
    problems, formulas = [], {}
    for path in sorted(site.rglob("*.html")):
        html = path.read_text(encoding="utf-8")
        name = path.relative_to(site).as_posix()
        problems += checks.html_problems(html, name)
        count = html.count('class="arithmatex"')
        if count:
            formulas[name] = count
            assert "katex" in html and "auto-render" in html and "javascripts/katex.js" in html, (
                f"{name}: formulas without the KaTeX scripts")
    assert not problems, "\n".join(problems)
    # The protocols page states the algorithms' updates as formulas.
    assert formulas.get("protocols/index.html", 0) >= 150, formulas


def _katex_dist() -> Path | None:
    node = shutil.which("node")
    if node is None:
        return None
    found = subprocess.run([node, "-e", "console.log(require.resolve('katex'))"],
                           capture_output=True, text=True)
    if found.returncode:
        return None
    return Path(found.stdout.strip()).parents[0] if found.stdout.strip().endswith(".js") \
        else None


def test_a_browser_renders_every_formula_of_the_protocols_page(site, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    dist = _katex_dist()
    if chromium is None or dist is None or not (dist / "katex.min.js").is_file():
        pytest.skip("optional: needs chromium and the katex npm package (NODE_PATH)")
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    page = copy / "protocols" / "index.html"
    html = re.sub(r"https://cdn\.jsdelivr\.net/npm/katex@[\d.]+/dist", dist.as_uri(),
                  page.read_text(encoding="utf-8"))
    page.write_text(html, encoding="utf-8")
    dom = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                          "--virtual-time-budget=10000", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HOME": str(tmp_path)}).stdout
    expected = html.count('class="arithmatex"')
    assert expected >= 150
    assert dom.count('class="katex"') == expected, json.dumps(
        {"formulas": expected, "rendered": dom.count('class="katex"')})
    assert "katex-error" not in dom


_PARSE_EVERY_FORMULA = r"""
const katex = require('katex'); const fs = require('fs');
const failed = []; let count = 0;
for (const file of process.argv.slice(1)) {
  const html = fs.readFileSync(file, 'utf8');
  const found = /class="arithmatex">([\s\S]*?)<\/(span|div)>/g; let m;
  while ((m = found.exec(html))) {
    const tex = m[1].replace(/&lt;/g, '<').replace(/&gt;/g, '>').replace(/&amp;/g, '&').trim();
    count++;
    try {
      katex.renderToString(tex.slice(2, -2), {displayMode: tex.startsWith('\\['),
                                              throwOnError: true});
    } catch (err) { failed.push(file + ': ' + err.message.slice(0, 200)); }
  }
}
console.log(JSON.stringify({count, failed}));
"""


def test_katex_parses_every_formula_of_every_page(site):
    """Each formula as KaTeX's own parser reads it (`throwOnError`), in Node, no browser."""
    if _katex_dist() is None:
        pytest.skip("optional: needs node and the katex npm package (NODE_PATH)")
    pages = [str(p) for p in sorted(site.rglob("*.html")) if 'class="arithmatex"' in
             p.read_text(encoding="utf-8")]
    done = subprocess.run([shutil.which("node"), "-e", _PARSE_EVERY_FORMULA, *pages],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["count"] >= 150 and not result["failed"], "\n".join(result["failed"])
