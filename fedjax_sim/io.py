"""Run-directory files, written atomically (write to a temporary file, then rename)."""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
from pathlib import Path

# RFC 4180 line ends: Python's csv writer quotes a field holding "\r" only
# when "\r" is part of the terminator, so "\n" alone would corrupt such text.
_EOL = "\r\n"


def _atomic_write(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _clean(value):
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def write_json(path, obj) -> None:
    def default(o):
        cleaned = _clean(o)
        if cleaned is o:
            raise TypeError(f"not JSON serializable: {type(o).__name__}")
        return cleaned

    _atomic_write(Path(path), json.dumps(obj, indent=2, sort_keys=False, default=default) + "\n")


def read_json(path):
    with open(path) as f:
        return json.load(f)


def _format(value):
    value = _clean(value)
    if isinstance(value, float):
        return repr(value)
    return value


def write_csv(path, rows: list[dict], columns: list[str] | None = None) -> None:
    """Writes all rows at once (atomically). Columns default to the union of keys, in order."""
    columns = columns or _columns(rows)
    lines = []

    class _Sink:
        def write(self, s):
            lines.append(s)

    writer = csv.DictWriter(
        _Sink(), fieldnames=columns, extrasaction="ignore", lineterminator=_EOL
    )
    writer.writeheader()
    for row in rows:
        writer.writerow({c: _format(row.get(c, "")) for c in columns})
    _atomic_write(Path(path), "".join(lines))


def append_csv(path, rows: list[dict], columns: list[str]) -> None:
    """Appends rows to a CSV (writing the header first if the file is new), then fsyncs.

    A crash loses at most the rows of this call; a partial last line left by a
    crash is dropped by `read_csv`.
    """
    path = Path(path)
    _drop_partial_line(path)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(
            f, fieldnames=columns, extrasaction="ignore", lineterminator=_EOL
        )
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: _format(row.get(c, "")) for c in columns})
        f.flush()
        os.fsync(f.fileno())


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
