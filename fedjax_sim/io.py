"""Run-directory files: JSON and CSV, whole files written atomically.

`write_json` and `write_csv` write a temporary file beside the target, fsync it
and rename it over the target, so a reader or a crash sees the old file or the
new one, never half of one. `append_csv` appends instead, for files that grow
while a run goes: by default it fsyncs each call; with ``sync=False`` the rows
reach the operating system at once (a killed process loses nothing) and the
disk at the next `sync_appended` (which every checkpoint save and the end of
`simulate.run` call), so only an OS crash or power loss can take rows written
since then. `read_csv` drops a last line a crash cut short.

Formats:

* JSON is strict (RFC 8259): float NaN and ±inf, whether Python floats, numpy
  scalars or elements of numpy arrays, at any depth of lists, tuples and dicts,
  are written as ``null``; no ``NaN``/``Infinity`` token ever reaches the file,
  so any JSON reader (jq, JavaScript, pandas) can load it.
* CSV records end with "\\n". A field holding "\\r" or "\\n" is quoted, so
  `read_csv` gives back any text; it also reads files with "\\r\\n" line ends.
  Floats are written with `repr`, so they read back exactly.
* Files get the mode a plain `open()` would give them (0666 less the umask).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import secrets
import threading
from pathlib import Path

# Python's csv writer quotes a field holding "\r" only when "\r" is part of the
# line terminator, so records are formatted with "\r\n" and the terminator is
# then cut to "\n".
_CSV_TERMINATOR = "\r\n"
_EOL = "\n"
_TEMP_NAME_TRIES = 100
# The names `_create_temp` gives: ".<target name>.<12 hex digits>.tmp".
_TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")
# Files appended with sync=False since their last fsync (see `sync_appended`).
_UNSYNCED: set[Path] = set()
_UNSYNCED_LOCK = threading.Lock()


def _create_temp(path: Path) -> tuple[int, Path]:
    """Creates an empty, unique temporary file beside `path`.

    Created like `open()` creates a file (mode 0666, which the kernel narrows by
    the umask and the directory's default ACL), not 0600 as `tempfile.mkstemp`.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    for _ in range(_TEMP_NAME_TRIES):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no unused temporary file name beside {path}")


def remove_temporaries(directory) -> list[Path]:
    """Deletes the temporary files a killed `write_json`/`write_csv` left under `directory`.

    A SIGKILL between creating a temporary file and renaming it over its target
    leaves ".<name>.<12 hex>.tmp" beside the target (the target itself is
    intact: the old file or none). A resumed run calls this before it writes,
    so its directory ends as an uninterrupted run's would. Only names of that
    exact form are touched. Returns the paths removed.
    """
    removed = []
    for path in sorted(Path(directory).rglob("*.tmp")):
        if _TEMP_NAME.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _naming(err: OSError, path: Path) -> OSError:
    """err with `filename` set to path when it names none (a failed write or fsync)."""
    if err.filename is None and err.errno:
        return type(err)(err.errno, err.strerror or str(err), str(path))
    return err


def _atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _create_temp(path)
    except OSError as err:
        raise _naming(err, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError):  # e.g. ENOSPC from write, which names no file
            raise _naming(err, path) from None
        raise


def _clean(value):
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _strict(value):
    """`value` with numpy values made plain and non-finite floats made None."""
    if isinstance(value, dict):
        return {_clean(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    cleaned = _clean(value)
    if cleaned is value:
        return value  # json.dumps decides: a str, int, bool or None, else a TypeError
    return _strict(cleaned)


def write_json(path, obj) -> None:
    """Writes `obj` as strict JSON (non-finite floats become null), atomically."""

    def unencodable(o):
        raise TypeError(f"not JSON serializable: {type(o).__name__}")

    text = json.dumps(_strict(obj), indent=2, allow_nan=False, default=unencodable)
    _atomic_write(Path(path), text + "\n")


def read_json(path):
    """The JSON file at `path` (a non-finite float that `write_json` wrote reads as None)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _format(value):
    value = _clean(value)
    if isinstance(value, float):
        return repr(value)
    return value


def _records(rows: list[dict], columns: list[str], header: bool) -> str:
    """CSV text of `rows` (and the header first if asked), each record ending in "\\n"."""
    parts: list[str] = []
    writer = csv.DictWriter(
        _Sink(parts), fieldnames=columns, extrasaction="ignore", lineterminator=_CSV_TERMINATOR
    )
    out = []

    def take():
        record = "".join(parts)
        parts.clear()
        out.append(record[: -len(_CSV_TERMINATOR)] + _EOL)

    if header:
        writer.writeheader()
        take()
    for row in rows:
        writer.writerow({c: _format(row.get(c, "")) for c in columns})
        take()
    return "".join(out)


class _Sink:
    def __init__(self, parts: list[str]):
        self.parts = parts

    def write(self, s):
        self.parts.append(s)


def write_csv(path, rows: list[dict], columns: list[str] | None = None) -> None:
    """Writes all rows at once (atomically). Columns default to the union of keys, in order."""
    columns = columns or _columns(rows)
    _atomic_write(Path(path), _records(rows, columns, header=True))


def append_csv(path, rows: list[dict], columns: list[str], *, sync: bool = True) -> None:
    """Appends rows to a CSV (writing the header first if the file is new).

    sync=True fsyncs the file before returning: an OS crash loses at most the
    rows of this call. sync=False only flushes them to the operating system (a
    killed process loses nothing) and leaves the fsync to the next
    `sync_appended`. A partial last line left by a crash is dropped by `read_csv`.
    """
    path = Path(path)
    try:
        _drop_partial_line(path)
        new = not path.exists() or path.stat().st_size == 0
        text = _records(rows, columns, header=new)
        with open(path, "a", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        if not sync:
            with _UNSYNCED_LOCK:
                _UNSYNCED.add(path.absolute())
    except OSError as err:  # a write error names no file
        raise _naming(err, path) from None


def sync_appended() -> None:
    """Fsyncs every file `append_csv(..., sync=False)` appended to since its last fsync.

    The write barrier of deferred appends: `checkpoint.RunCheckpoints.save`
    calls it before writing a checkpoint, so every row appended before a
    checkpoint is on disk before that checkpoint is; `simulate.run` calls it
    when it ends. A file removed since is skipped.
    """
    with _UNSYNCED_LOCK:
        paths = sorted(_UNSYNCED)
        _UNSYNCED.clear()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            continue
        except OSError as err:
            raise _naming(err, path) from None
        try:
            os.fsync(fd)
        except OSError as err:
            raise _naming(err, path) from None
        finally:
            os.close(fd)


def _drop_partial_line(path: Path) -> None:
    """Truncates a last line left unfinished by a crash, so appends start on a fresh line."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.seek(data.rfind(b"\n") + 1)
        f.truncate()


def read_csv(path) -> list[dict]:
    """Rows of a CSV as dicts of strings; a last line cut short by a crash is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    # Cut at the last newline before decoding, so a crash that split a
    # multi-byte character does not make the whole file unreadable.
    text = data[: data.rfind(b"\n") + 1].decode("utf-8")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    width = len(reader.fieldnames or [])
    return [row for row in reader if len(row) == width and None not in row.values()]


def _columns(rows):
    seen = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)
