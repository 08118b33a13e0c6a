"""The documentation: generated parts current, every registered name present, no history.

* docs/generate.py writes the tables of algorithms and presets, the preset reference,
  the command-line option tables, the API pages of the factories, the protocol tables
  (from the committed results) and the performance table; what is committed must be
  what it writes now.
* README.md, docs/ and benchmarks/'s notes state what is, not how it came to be: no
  numbered round of work, issue number, branch name, commit hash or "earlier tree".
  History lives in git and CHANGELOG.md.
* The README stays short; CITATION.cff states the package's version.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedjax_sim.algorithms import ALGORITHMS
from fedjax_sim.experiments import PRESETS

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 350

_spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = generate  # dataclasses look their module up there
_spec.loader.exec_module(generate)


def test_every_registered_algorithm_and_preset_is_described():
    assert generate.missing_info() == []


def test_the_generated_parts_are_current():
    stale = generate.stale()
    assert not stale, (f"stale: {', '.join(stale)}; run `python docs/generate.py` and commit "
                       "the result")


@pytest.mark.parametrize("path", ["README.md", "docs/index.md", "docs/presets.md"])
def test_every_preset_and_algorithm_appears_in_the_tables(path):
    text = (ROOT / path).read_text()
    for name in PRESETS:
        assert f"`{name}`" in text, (path, name)
    if path != "docs/presets.md":
        for name, factory in ALGORITHMS.items():
            assert f"| `{name}` |" in text, (path, name)
            assert factory.__qualname__ in text, (path, name)


def test_the_api_reference_documents_every_factory():
    text = (ROOT / "docs" / "api" / "algorithms.md").read_text()
    for factory in ALGORITHMS.values():
        assert f"::: {generate.factory_path(factory)}\n" in text


def test_the_protocol_tables_come_from_the_committed_results():
    """A committed number changed by hand, or a results file changed without the tables,
    is a stale table."""
    text = (ROOT / "docs" / "protocols.md").read_text()
    for name in ("table1-mnist", "weight-init", "success-small", "drflm"):
        begin, end = generate._markers(name)
        assert text.count(begin) == 1 and text.count(end) == 1, name
    cell = generate._rows_by_method(
        generate.RESULTS / "ifca_rotated_mnist_n50_5seeds" / "results.csv")["ifca"]
    assert generate._mean_std(cell, "test_accuracy") in generate.table1_mnist()
    assert generate._mean_std(cell, "test_accuracy") in text


# --------------------------------------------------------------------------- history

# What tells the history of a number rather than the number: a numbered round of work,
# an issue number, a branch, a commit hash, an earlier tree.
HISTORY = [
    (re.compile(r"\bsessions?\s+\d+", re.I), "a numbered session"),
    (re.compile(r"\bsession\s+`", re.I), "a named session"),
    (re.compile(r"\bround\s+\d+\s+of\s+work\b", re.I), "a numbered round of work"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w/])#\d+\b"), "an issue or pull-request number"),
    (re.compile(r"\bbranch(?:es)?\s+[`'\"]", re.I), "a branch name"),
    (re.compile(r"\bissue\d+[-\w]*", re.I), "a branch name"),
    (re.compile(r"\bmerged\s+main\b|\bon\s+main\b", re.I), "a branch"),
    # 7 to 40 hex digits with a digit and a letter, but not a number such as 1e10000
    (re.compile(r"\b(?!\d+e\d+\b)(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
     "a commit hash"),
    (re.compile(r"\b(?:earlier|older|previous)\s+(?:trees?|checkouts?|commits?|code)\b", re.I),
     "an earlier tree"),
    (re.compile(r"\bthe\s+code\s+before\b|\bbefore\s+(?:the|this)\s+(?:refactor|change|session)",
                re.I), "an earlier tree"),
]


def history_phrases(text: str) -> list[str]:
    found = []
    for pattern, what in HISTORY:
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"line {line}: {match.group(0)!r} ({what})")
    return found


def _documents() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "README.md", "docs",
         "benchmarks/*.md"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not listed:
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if name.endswith(".md") and (ROOT / name).is_file()]


def test_no_document_tells_the_history_of_a_number():
    problems = []
    for path in _documents():
        problems += [f"{path.relative_to(ROOT)}: {p}" for p in history_phrases(path.read_text())]
    assert not problems, "history belongs in git and CHANGELOG.md:\n" + "\n".join(problems)


@pytest.mark.parametrize("text", [
    "measured in session 18 on an Intel Xeon", "Session 15's machine", "(issue 18)",
    "issue #20, item 4", "fixed in #12", "see branch `ceil`", "on the issue33-product branch",
    "at b9b1bc9", "commit 8701ccb", "Earlier trees gave 0.075", "the code before this change",
    "round 3 of work", "quiet re-measure (merged main)",
])
def test_history_phrases_are_found(text):
    assert history_phrases(text), text


@pytest.mark.parametrize("text", [
    "a session of 300 rounds", "round 10", "rounds 6, 2, 4", "sha256 of metrics.csv",
    "the 2-GT server branch", "both branches run at once", "at R = 0.25, 1e-3, 2048²",
    "decade", "facade", "1e10000", "issues on GitHub", "data seeds 0–39", "(2 410 params)",
    "`#ifca-synthetic`", "an earlier round", "before the first round",
])
def test_ordinary_words_are_not_history(text):
    assert history_phrases(text) == [], text


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_citation_file_states_the_package_version():
    tomllib = pytest.importorskip("tomllib")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    text = (ROOT / "CITATION.cff").read_text()
    assert re.search(r"^cff-version: 1\.2\.0$", text, re.M)
    assert re.search(rf"^version: {re.escape(version)}$", text, re.M)
    for key in ("message", "title", "authors"):  # required by CFF 1.2
        assert re.search(rf"^{key}:", text, re.M), key
    assert "references:" in text  # the papers the presets reproduce
