"""Every file the repository points a reader at exists in the repository.

Scanned: the README, docs/, notebooks, benchmarks' notes and every string or
comment in the code (which is also what the CLI prints: setting help, notes).
A reference is a Markdown link, a path under one of the repository's own
folders (docs/, benchmarks/, notebooks/, tests/, fedjax_sim/, .ci/), a path
that climbs out of it (../), a top-level file of the repository by name, or a
capitalised notes file (PAPERS.md, DATASETS.md, ...). A reference into
docs/protocols.md with an #anchor needs that anchor too.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (".md", ".py", ".ipynb", ".toml", ".txt", "")
FOLDERS = ("docs", "benchmarks", "notebooks", "tests", "fedjax_sim", ".ci")
TOP_FILES = ("README.md", "LICENSE", "pyproject.toml", "constraints.txt", "constraints-min.txt",
             "conftest.py")
_PATH = r"[\w.\-*<>{}]+(?:/[\w.\-*<>{}]+)*/?"
MARKDOWN_LINK = re.compile(r"\[[^\]\n]+\]\(([\w./#\-]+)\)")  # in .md files and notebooks
PATTERNS = (
    # climbs out of the file's folder (a folder or a file with an extension follows)
    re.compile(r"(?<![\w/.\-:])((?:\.\./)+[\w.\-]+(?:/[\w.\-/]*|\.\w+))"),
    re.compile(rf"(?<![\w/.\-:])((?:{'|'.join(map(re.escape, FOLDERS))})/{_PATH}(?:#[\w\-]+)?)"),
    re.compile(rf"(?<![\w/.\-:])((?:{'|'.join(map(re.escape, TOP_FILES))}))(?![\w.\-/])"),
    re.compile(r"(?<![\w/.\-:])([A-Z][A-Z_]+\.md)(?![\w.\-])"),  # PAPERS.md, DATASETS.md, ...
)


# Paths that are written in the code but are not references to a file of this repository.
NOT_REFERENCES = {
    "fedjax_sim/cli/",  # benchmarks/rounds_per_sec.py: a layout an older checkout may have
    "benchmarks/.venv-pfl",  # created by benchmarks/standard_workloads.py, git-ignored
}


def _placeholder(target: str) -> bool:
    """A path written with a placeholder: benchmarks/X.py, docs/protocols.md#ANCHOR."""
    path, _, anchor = target.partition("#")
    stem = Path(path).stem
    return anchor.isupper() or (stem.isupper() and not path.endswith(".md"))


def repository_files() -> list[Path]:
    """The repository's files: tracked and new ones git does not ignore (no build output)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
            capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def anchors(markdown: str) -> set[str]:
    """Explicit `<a id="...">` anchors and GitHub's heading slugs."""
    found = set(re.findall(r'<a id="([\w\-]+)"', markdown))
    for heading in re.findall(r"^#+\s+(.*)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def _exists(target: str, source: Path, root: Path) -> bool:
    target = target.split("#")[0].rstrip("/")
    if not target or re.search(r"[<>{}]", target):  # a placeholder such as <data_dir>/x
        return True
    if re.fullmatch(r"[A-Z][A-Z_]+\.md", target):  # a notes file: anywhere in the repository
        return any(root.rglob(target))
    for base in (root, source.parent):
        path = (base / target).resolve()
        if not path.is_relative_to(root.resolve()):  # outside the repository: users lack it
            continue
        if "*" in target:
            if any(base.glob(target)):
                return True
        elif path.exists():
            return True
    return False


def missing_references(text: str, source: Path, root: Path = ROOT) -> list[str]:
    """The references in `text` (from file `source`) that the repository cannot resolve."""
    docs = root / "docs" / "protocols.md"
    ids = anchors(docs.read_text()) if docs.is_file() else set()
    bad = []
    patterns = PATTERNS + ((MARKDOWN_LINK,) if source.suffix in (".md", ".ipynb") else ())
    for pattern in patterns:
        for match in pattern.finditer(text):
            target = match.group(1).rstrip(".,;:)'\"`")
            if (re.match(r"[a-z]+:", target) or target.startswith("#")  # URLs, same page
                    or target in NOT_REFERENCES or _placeholder(target)):
                continue
            if not _exists(target, source, root):
                bad.append(target)
            elif "docs/protocols.md#" in target or (
                    source == docs and target.startswith("protocols.md#")):
                if target.split("#", 1)[1] not in ids:
                    bad.append(target)
    return sorted(set(bad))


def test_every_reference_points_at_a_file_of_the_repository():
    problems = []
    for path in repository_files():
        if path.suffix not in SCANNED or path.name == "test_docs_refs.py":
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        problems += [f"{path.relative_to(ROOT)}: {target}"
                     for target in missing_references(text, path)]
    assert not problems, "references to files the repository does not contain:\n" + "\n".join(
        sorted(set(problems)))


@pytest.mark.parametrize("text, bad", [
    ("see PAPERS.md §2.1 for the protocol", ["PAPERS.md"]),
    ("read ../shared/DESIGN.md first", ["../shared/DESIGN.md"]),
    ("[notes](docs/notes.md)", ["docs/notes.md"]),
    ("numbers in benchmarks/NOPE.md and docs/protocols.md#no-such-anchor",
     ["benchmarks/NOPE.md", "docs/protocols.md#no-such-anchor"]),
    ("see docs/protocols.md#ifca and benchmarks/README.md, (README.md), "
     "notebooks/quickstart.ipynb, fedjax_sim/experiments/*.py, <data_dir>/cifar10/train.npz, "
     "[PyPI](https://pypi.org/) and metrics.csv", []),
])
def test_the_checker_flags_missing_files_and_anchors(text, bad):
    assert sorted(missing_references(text, ROOT / "README.md")) == sorted(bad)


@pytest.mark.slow
def test_the_readme_python_api_example_runs_and_finds_the_clusters(capsys):
    """The README's Python quick start, run as written: the best restart reaches the noise
    floor."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Python quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (Python quick start)", "exec"), {})
    out = capsys.readouterr().out
    best = float(re.search(r"best restart \d+: ([\d.]+)", out).group(1))
    per_restart = re.search(r"per restart: \[([^\]]*)\]", out).group(1).split()
    assert len(per_restart) == 10
    # σ = 0.1: a restart that found both clusters fits to about σ² (less: the fit absorbs noise).
    assert best < 0.02, out
