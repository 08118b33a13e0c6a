"""The CLI keeps compiled programs on disk (JAX's persistent compilation cache).

Each test runs `fedjax-sim` in a fresh process without the test session's own cache
(conftest.py's JAX_COMPILATION_CACHE_DIR), pointing the data cache at a temporary
directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(out: Path, cache: Path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    environ.update(PYTHONPATH=str(ROOT), FEDJAX_SIM_CACHE=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env)
    return subprocess.run(
        [sys.executable, "-m", "fedjax_sim.cli", "run", "ifca-synthetic-tiny", "--set",
         "rounds=4", "eval_every=2", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=environ, timeout=240)


def _entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith("-cache")}


def test_a_rerun_loads_every_program_from_the_cache_and_gives_the_same_numbers(tmp_path):
    cache = tmp_path / "cache"
    first = _run(tmp_path / "a", cache)
    assert first.returncode == 0, first.stderr
    kept = _entries(cache / "xla")
    assert kept, "the first run kept no compiled program"
    second = _run(tmp_path / "b", cache)
    assert second.returncode == 0, second.stderr
    assert _entries(cache / "xla") == kept  # every program was found: none compiled anew
    assert (tmp_path / "a" / "metrics.csv").read_bytes() == \
        (tmp_path / "b" / "metrics.csv").read_bytes()


def test_the_cache_can_be_turned_off_or_moved_and_an_unwritable_one_is_skipped(tmp_path):
    cache = tmp_path / "cache"
    off = _run(tmp_path / "off", cache, FEDJAX_SIM_XLA_CACHE="off")
    assert off.returncode == 0, off.stderr
    assert not (cache / "xla").exists()

    moved = tmp_path / "elsewhere"
    done = _run(tmp_path / "moved", cache, FEDJAX_SIM_XLA_CACHE=str(moved))
    assert done.returncode == 0, done.stderr
    assert _entries(moved) and not (cache / "xla").exists()

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    skipped = _run(tmp_path / "skipped", cache, FEDJAX_SIM_XLA_CACHE=str(blocker / "xla"))
    assert skipped.returncode == 0, skipped.stderr
    assert (tmp_path / "skipped" / "metrics.csv").exists()
    assert (tmp_path / "skipped" / "metrics.csv").read_bytes() == \
        (tmp_path / "off" / "metrics.csv").read_bytes()
