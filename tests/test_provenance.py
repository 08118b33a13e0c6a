"""provenance: the git commit and library versions every config.json records."""

import platform
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import fedjax_sim
from fedjax_sim import provenance
from fedjax_sim.experiments import runner
from fedjax_sim.experiments.registry import get_preset

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(directory, *args) -> str:
    return subprocess.run(["git", "-C", str(directory), *args], check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkout(tmp_path):
    """A fedjax_sim-shaped repository with one commit."""
    root = tmp_path / "repo"
    (root / "fedjax_sim").mkdir(parents=True)
    (root / "fedjax_sim" / "__init__.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return root


@needs_git
def test_git_commit_of_a_checkout_and_its_dirty_flag(checkout):
    head = _git(checkout, "rev-parse", "HEAD")
    assert len(head) == 40
    assert provenance.git_commit(checkout) == {"commit": head, "dirty": False}
    (checkout / "notes.txt").write_text("untracked files do not count\n")
    assert provenance.git_commit(checkout) == {"commit": head, "dirty": False}
    (checkout / "fedjax_sim" / "__init__.py").write_text("x = 2\n")
    assert provenance.git_commit(checkout) == {"commit": head, "dirty": True}


@needs_git
def test_not_a_checkout_gives_none(tmp_path, checkout):
    site = tmp_path / "site-packages"  # a wheel's install: no repository
    site.mkdir()
    assert provenance.git_commit(site) == {"commit": None, "dirty": None}
    # Installed in a virtualenv inside some other project's repository: not our commit.
    other = checkout / "venv" / "lib"
    other.mkdir(parents=True)
    (checkout / "fedjax_sim").rename(checkout / "elsewhere")
    assert provenance.git_commit(other) == {"commit": None, "dirty": None}
    assert provenance.git_commit(tmp_path / "missing") == {"commit": None, "dirty": None}


def test_no_git_program_gives_none(checkout, monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert provenance.git_commit(checkout) == {"commit": None, "dirty": None}


def test_package_versions_read_the_installed_distributions():
    versions = provenance.package_versions()
    assert set(versions) == {"jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint"}
    assert versions["numpy"] == np.__version__
    import jax

    assert versions["jax"] == jax.__version__
    assert provenance.package_versions(("numpy", "no-such-distribution-xyz")) == {
        "numpy": np.__version__, "no-such-distribution-xyz": None}


@needs_git
def test_config_json_records_commit_and_versions():
    preset = get_preset("ifca-synthetic-tiny")
    config = runner._config(preset, "run", dict(preset.defaults))
    package_root = Path(fedjax_sim.__file__).resolve().parent.parent
    try:
        head = _git(package_root, "rev-parse", "HEAD")
    except subprocess.CalledProcessError:  # tests run from an installed wheel
        head = None
    assert config["git_commit"] == head
    assert config["git_dirty"] in ((True, False) if head else (None,))
    assert config["versions"]["numpy"] == np.__version__
    assert config["versions"]["python"] == platform.python_version()
    assert set(config["versions"]) == {*provenance.PACKAGES, "python"}
