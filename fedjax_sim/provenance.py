"""What produced a run: the package's git commit and the versions of its stack.

Written into every config.json, so a result can be traced to the code and
libraries that made it. Discovery never fails: what cannot be found is None.
"""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path

#: Distributions whose versions a config.json records (pip names).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint")


def git_commit(directory=None) -> dict:
    """The git commit of a checkout: {"commit": sha or None, "dirty": bool or None}.

    Args:
      directory: a directory inside the checkout; default the directory that
        holds the installed fedjax_sim package (its parent, the repository
        root, when it is an editable checkout). Not a checkout (a wheel in
        site-packages), no git, or any git error: both None.

    "dirty" is True when tracked files differ from the commit (untracked files
    do not count).
    """
    if directory is None:
        directory = Path(__file__).resolve().parent.parent
    unknown = {"commit": None, "dirty": None}
    try:
        top = _git(directory, "rev-parse", "--show-toplevel")
        # A package installed inside some other repository (a virtualenv in a project)
        # is not a checkout of fedjax_sim: its commit would be the other project's.
        if top is None or not (Path(top) / "fedjax_sim").is_dir():
            return unknown
        commit = _git(directory, "rev-parse", "HEAD")
        if commit is None:
            return unknown
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        return {"commit": commit, "dirty": None if status is None else bool(status)}
    except Exception:  # provenance is a record, never a reason for a run to fail
        return unknown


def _git(directory, *args) -> str | None:
    """git's stdout (stripped) run in `directory`; None when git fails or is absent."""
    try:
        done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def package_versions(packages=PACKAGES) -> dict:
    """{distribution name: installed version, or None when it is not installed}."""
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except Exception:  # PackageNotFoundError, or broken metadata
            versions[name] = None
    return versions


def provenance() -> dict:
    """{"git": git_commit(), "versions": {..., "python": ...}} for config.json."""
    return {"git": git_commit(),
            "versions": {**package_versions(), "python": platform.python_version()}}


__all__ = ["PACKAGES", "git_commit", "package_versions", "provenance"]
