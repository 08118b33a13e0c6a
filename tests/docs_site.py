"""The documentation site, built once per test session for the tests that read it.

`built_site()` runs `mkdocs build --strict` (with docs/hooks.py: stale generated pages,
misread emphasis and unrendered math fail it) into a temporary directory and returns
it; `inventory(site)` reads the objects.inv that mkdocstrings writes, the index of every
object the API reference documents. The tests skip where the `docs` extra (MkDocs, its
Material theme, mkdocstrings) is not installed.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def require_docs_tools() -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                   "pymdownx"):
        pytest.importorskip(module, reason="the `docs` extra builds the site")


@functools.cache
def _build() -> tuple[Path | None, str]:
    site = Path(tempfile.mkdtemp(prefix="fedjax_sim_site_"))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(site)], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        return None, proc.stdout[-4000:] + proc.stderr[-8000:]
    return site, ""


def built_site() -> Path:
    """The site built from this checkout (once per session); fails with the build's log."""
    require_docs_tools()
    site, log = _build()
    assert site is not None, f"`mkdocs build --strict` failed:\n{log}"
    return site


def inventory(site: Path) -> set[str]:
    """Every name the API reference documents: each inventory entry's name and the path
    its anchor points at (where an exported name is documented under its definition)."""
    head, body = (site / "objects.inv").read_bytes().split(b"\n", 4)[3:5]
    assert b"zlib" in head, head
    names = set()
    for line in zlib.decompress(body).decode().splitlines():
        name, _domain, _priority, uri = line.split(" ", 4)[:4]
        names.add(name)
        if "#" in uri:
            names.add(uri.split("#", 1)[1])
    return names
