"""What a run writes while it goes: its metrics file, its progress, its TensorBoard log.

* `MetricsCSV` appends history rows to metrics.csv as they come, fsynced, so a
  killed run keeps every row it logged; a resumed run first cuts the rows after
  the round it resumes from, so the file ends up as an uninterrupted run's.
* `Progress` reports long work: a tqdm bar on a terminal, else one plain,
  flushed line per step (SLURM logs, CI, pipes), with rate and ETA. A sweep
  passes each step's cost, so cells of different sizes still give a right ETA.
* `TensorBoardLog` writes scalar metrics as TensorBoard event files through
  tensorboardX (no TensorFlow needed); install it with
  ``pip install 'fedjax_sim[tensorboard]'``.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from pathlib import Path

import numpy as np

from fedjax_sim.extras import require
from fedjax_sim.io import append_csv, read_csv, write_csv


class MetricsCSV:
    """History rows appended to a CSV, one `append` call at a time.

    Args:
      path: the CSV file.
      resume_round: the round a resumed run continues from. An existing file
        is rewritten (atomically) keeping only its rows with round <=
        resume_round, and later rows are appended to it. None starts a new
        file: an existing one raises ValueError rather than being overwritten.
    """

    def __init__(self, path, resume_round: int | None = None):
        self.path = Path(path)
        self.columns: list[str] | None = None
        if not self.path.exists():
            return
        if resume_round is None:
            raise ValueError(
                f"{self.path} already exists; resume the run that wrote it, or write elsewhere."
            )
        self.columns = _header(self.path)
        if self.columns is None:  # a crash before the header was complete: nothing to keep
            self.path.unlink()
            return
        if "round" not in self.columns:
            raise ValueError(
                f"cannot resume {self.path}: it has no 'round' column (columns: {self.columns})."
            )
        kept = [row for row in read_csv(self.path) if _round(row, self.path) <= resume_round]
        write_csv(self.path, kept, self.columns)

    def append(self, rows: list[dict]) -> None:
        """Appends `rows` and fsyncs; the first row ever written fixes the columns.

        Raises:
          ValueError: a row has a key that is not a column (it would be lost).
        """
        if not rows:
            return
        if self.columns is None:
            self.columns = list(rows[0])
        known = set(self.columns)
        for row in rows:
            extra = [key for key in row if key not in known]
            if extra:
                raise ValueError(
                    f"row for round {row.get('round')!r} has keys {extra} that {self.path} "
                    f"has no column for (columns: {self.columns})."
                )
        append_csv(self.path, rows, self.columns)


def _header(path: Path) -> list[str] | None:
    """The column names of a CSV, or None when it has no complete header line."""
    with open(path, encoding="utf-8", newline="") as f:
        line = f.readline()
    if not line.endswith("\n"):
        return None
    return next(csv.reader([line]))


def _round(row: dict, path: Path) -> int:
    try:
        return int(float(row["round"]))
    except (TypeError, ValueError):
        raise ValueError(f"cannot resume {path}: a row has round {row['round']!r}.") from None


class Progress:
    """Progress of long work: a tqdm bar on a terminal, else one plain line per step.

    A plain line reads
    ``ifca-synthetic: 50/300 rounds (17%) | train_loss=0.1234 | 41.2 rounds/s | ETA 0:00:06``.
    Rates and ETAs use the wall time since construction. The ETA weighs the
    work left by cost when `total_cost` is given and every `advance` passed a
    cost, and by count otherwise.

    Args:
      total: units of work in all, `initial` included.
      description: what the work is; starts each line.
      unit: the name of one unit of work, singular.
      enabled: False reports nothing.
      stream: where to report; default sys.stderr.
      total_cost: the cost of the work this object will be advanced through
        (not of `initial`), in the units of `advance`'s cost.
      initial: units done before construction (a resumed run).
      clock: seconds, monotonic; tests pass a fake one.
    """

    def __init__(
        self,
        total: float,
        *,
        description: str,
        unit: str = "round",
        enabled: bool = True,
        stream=None,
        total_cost: float | None = None,
        initial: float = 0,
        clock=time.monotonic,
    ):
        self.total = total
        self.description = description
        self.unit = unit
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.total_cost = total_cost
        self.done = initial
        self._initial = initial
        self._cost_done = 0.0
        self._costed = True  # every advance so far passed a cost
        self._clock = clock
        self._start = clock()
        self._bar = None
        if enabled and _isatty(self.stream):
            from tqdm import tqdm

            # tqdm's own ETA is by count; ours (in the postfix) may be by cost.
            self._bar = tqdm(
                total=total, initial=initial, desc=description, unit=unit, file=self.stream,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]",
            )

    def advance(self, count: int, *, cost: float | None = None, postfix: dict | None = None):
        """Records `count` more units done (costing `cost`) and reports them."""
        self.done += count
        if cost is None:
            self._costed = False
        else:
            self._cost_done += cost
        if not self.enabled:
            return
        metrics = _postfix_text(postfix or {})
        eta = f"ETA {_duration(self.eta())}"
        if self._bar is not None:
            self._bar.set_postfix_str(" | ".join(filter(None, [metrics, eta])), refresh=False)
            self._bar.update(count)
            return
        units = f"{self.unit}s"
        percent = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        parts = [f"{self.description}: {_number(self.done)}/{_number(self.total)} {units}{percent}"]
        if metrics:
            parts.append(metrics)
        rate = self.rate()
        if rate is not None:
            parts.append(_rate_text(rate, self.unit))
        parts.append(eta)
        print(" | ".join(parts), file=self.stream, flush=True)

    def rate(self) -> float | None:
        """Units per second since construction; None before any time has passed."""
        elapsed = self._clock() - self._start
        return (self.done - self._initial) / elapsed if elapsed > 0 else None

    def eta(self) -> float | None:
        """Seconds left, or None while nothing is done yet to extrapolate from."""
        elapsed = self._clock() - self._start
        if self.total_cost is not None and self._costed:
            done, left = self._cost_done, self.total_cost - self._cost_done
        else:
            done, left = self.done - self._initial, self.total - self.done
        if done <= 0:
            return None
        return max(left, 0) * elapsed / done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _isatty(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _scalar(value) -> float | int | bool | None:
    """A plain Python number from a number or size-1 array; None for anything else."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # objects numpy cannot take are not numbers either
        return None
    if array.size != 1 or array.dtype.kind not in "biuf":
        return None
    return array.reshape(()).item()


def _scalar_text(value) -> str | None:
    if isinstance(value, str):
        return value
    number = _scalar(value)
    if number is None:
        return None
    return f"{number:.4g}" if isinstance(number, float) else str(number)


def _postfix_text(postfix: dict) -> str:
    """'key=value' for each scalar of `postfix`, floats to 4 significant digits."""
    texts = ((key, _scalar_text(value)) for key, value in postfix.items())
    return " ".join(f"{key}={text}" for key, text in texts if text is not None)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _rate_text(rate: float, unit: str) -> str:
    # Slow work reads better as seconds per unit: "12.5 s/cell", not "0.08 cells/s".
    if 0 < rate < 1:
        return f"{1 / rate:.3g} s/{unit}"
    return f"{rate:.3g} {unit}s/s" if rate < 100 else f"{rate:.0f} {unit}s/s"


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class TensorBoardLog:
    """Scalar metrics as TensorBoard event files in `log_dir`, through tensorboardX.

    Raises:
      ValueError: tensorboardX is not installed.
    """

    def __init__(self, log_dir):
        require("tensorboardX", "tensorboard", "--tensorboard")
        from tensorboardX import SummaryWriter
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(logdir=str(self.log_dir))

    def write(self, step: int, metrics: dict) -> None:
        """Adds every scalar number in `metrics` (NaN and inf included) at `step`, then flushes.

        Strings and arrays of more than one element are skipped.
        """
        for name, value in metrics.items():
            number = _scalar(value)
            if number is not None:
                self._writer.add_scalar(str(name), float(number), global_step=int(step))
        # Flushed per call (a chunk of rounds), so a killed run keeps what it logged.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
