"""What a run writes while it goes: its metrics file, its progress, its TensorBoard log.

* `MetricsCSV` appends history rows to metrics.csv as they come, fsynced, so a
  killed run keeps every row it logged; a resumed run first cuts the rows after
  the round it resumes from, so the file ends up as an uninterrupted run's.
* `Progress` reports long work: a tqdm bar on a terminal, else plain, flushed
  lines (SLURM logs, CI, pipes) at most one every `progress_every()` seconds
  (`set_progress_every`, the CLI's --progress-every) plus the last, with rate
  and ETA. A sweep passes each step's cost, so cells of different sizes still
  give a right ETA. Metrics with a copies axis (seeds, restarts) are shown
  summarised by a rule the caller picks (`mean_of_copies`, `best_copy`).
* `TensorBoardLog` writes scalar metrics as TensorBoard event files through
  tensorboardX (no TensorFlow needed); install it with
  ``pip install -e '.[tensorboard]'`` in a checkout (or ``pip install tensorboardX``).
  Non-finite values (the round-0
  placeholders, a diverged copy) are left out.
"""

from __future__ import annotations

import csv
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedjax_sim.extras import require
from fedjax_sim.io import append_csv, read_csv, sync_appended, write_csv


class MetricsCSV:
    """History rows appended to a CSV, one `append` call at a time.

    Appends reach the operating system at once (a killed process loses no row)
    but are fsynced only at the next `io.sync_appended`: before each checkpoint
    is written (`checkpoint.RunCheckpoints.save`), when `simulate.run` ends, and
    at `sync`. So every row of the rounds a checkpoint covers is on disk before
    that checkpoint is, and a resumed run never lacks one; an fsync per
    evaluation row would cost a disk flush every few rounds for no stronger
    guarantee (rows past the last checkpoint are recomputed on resume anyway).

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
        """Appends `rows` (fsynced at the next `io.sync_appended`); the first row ever
        written fixes the columns.

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
        append_csv(self.path, rows, self.columns, sync=False)

    def sync(self) -> None:
        """Fsyncs the rows appended so far (and those of every other deferred append)."""
        sync_appended()


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


#: Seconds between two plain progress lines (not on a terminal); see set_progress_every.
_PROGRESS_EVERY = 10.0


def set_progress_every(seconds: float) -> None:
    """Sets the default seconds between two plain progress lines (0: a line per step).

    Every `Progress` made afterwards without its own `every_seconds` uses it;
    the CLI's ``--progress-every SECONDS`` calls this.

    Raises:
      ValueError: seconds is not a finite number >= 0.
    """
    global _PROGRESS_EVERY
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(seconds, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"progress_every must be a number of seconds >= 0; got {seconds!r}.")
    _PROGRESS_EVERY = value


def progress_every() -> float:
    """The default seconds between two plain progress lines."""
    return _PROGRESS_EVERY


#: A summary rule: a history row (values may be per-copy arrays) -> (scalars, label),
#: the label saying how arrays were summarised ("" when none was).
Summary = Callable[[dict], tuple[dict, str]]


def _finite_mean(values: np.ndarray, axis=None):
    """Mean over `axis` of the finite values; NaN where none is finite (no warning)."""
    finite = np.isfinite(values)
    count = finite.sum(axis=axis)
    total = np.where(finite, values, 0.0).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _numeric(value) -> np.ndarray | None:
    """`value` as a float64 array when it is numeric, else None."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        array = np.asarray(value)
    except Exception:  # objects numpy cannot take are not numbers either
        return None
    return array.astype(np.float64) if array.dtype.kind in "biuf" else None


def mean_of_copies(noun: str = "copies") -> Summary:
    """Summary rule: each multi-element value becomes the mean of its finite elements.

    Args:
      noun: what the copies are ("seeds", "restarts"), for the label
        ``mean of 3 seeds`` (the count is the leading axis of the first array).
    """

    def summary(row: dict) -> tuple[dict, str]:
        out, copies = {}, None
        for name, value in row.items():
            array = _numeric(value)
            if array is None or array.size <= 1:
                out[name] = value
                continue
            out[name] = float(_finite_mean(array))
            copies = copies or array.shape[0]
        return out, "" if copies is None else f"mean of {copies} {noun}"

    return summary


def best_copy(key: str, *, noun: str = "restarts", outer: str = "seeds") -> Summary:
    """Summary rule: the copy with the lowest `key`, along the last copies axis.

    A row whose `key` is [R] (restarts) shows every value of that shape at the
    restart of lowest finite `key`; a row whose `key` is [S, R] (seeds ×
    restarts, as `with_seeds(with_restarts(...))` gives) takes each seed's
    best restart and averages over seeds. Values of other shapes are averaged
    (`mean_of_copies`). A row without a finite `key` in some copy group (the
    round-0 placeholders) is summarised by `mean_of_copies` instead.

    Args:
      key: the value that ranks copies (lower is better), e.g. a training loss.
      noun: what the last copies axis holds, for the label.
      outer: what the leading copies axes hold, for the label.
    """
    means = mean_of_copies(noun)

    def summary(row: dict) -> tuple[dict, str]:
        ranking = _numeric(row.get(key))
        if ranking is None or ranking.ndim == 0 or ranking.shape[-1] <= 1:
            return means(row)
        finite = np.isfinite(ranking)
        if not finite.any(axis=-1).all():
            return means(row)
        best = np.argmin(np.where(finite, ranking, np.inf), axis=-1)[..., None]
        out = {}
        for name, value in row.items():
            array = _numeric(value)
            if array is None or array.size <= 1:
                out[name] = value
            elif array.shape == ranking.shape:
                out[name] = float(_finite_mean(np.take_along_axis(array, best, axis=-1)))
            else:
                out[name] = float(_finite_mean(array))
        label = f"best of {ranking.shape[-1]} {noun} by {key}"
        if ranking.ndim > 1:
            label += f", mean of {int(np.prod(ranking.shape[:-1]))} {outer}"
        return out, label

    return summary


class Progress:
    """Progress of long work: a tqdm bar on a terminal, else plain lines, time-throttled.

    A plain line reads
    ``ifca-synthetic: 50/300 rounds (17%) | train_loss=0.1234 | 41.2 rounds/s | ETA 0:00:06``.
    Off a terminal the first step prints at once, later ones at most one line
    every `every_seconds`, and the last step (or `close`, after a stop) always
    prints the newest state: a 2000-round run piped to a file writes a few
    dozen lines, not 2000. Rates and ETAs use the wall time since
    construction. The ETA weighs the work left by cost when `total_cost` is
    given and every `advance` passed a cost, and by count otherwise.

    Args:
      total: units of work in all, `initial` included.
      description: what the work is; starts each line.
      unit: the name of one unit of work, singular. A postfix key of that name
        (a history row's "round") is not repeated: the count shows it.
      enabled: False reports nothing.
      stream: where to report; default sys.stderr.
      total_cost: the cost of the work this object will be advanced through
        (not of `initial`), in the units of `advance`'s cost.
      initial: units done before construction (a resumed run).
      clock: seconds, monotonic; tests pass a fake one.
      every_seconds: least seconds between two plain lines; default
        `progress_every()` (10 s unless `set_progress_every` changed it); 0
        prints every step.
      summary: how a postfix with per-copy arrays is shown (`mean_of_copies`,
        the default, or `best_copy`): its scalars, then its label in
        parentheses, e.g. ``loss=0.12 (mean of 3 seeds)``.
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
        every_seconds: float | None = None,
        summary: Summary | None = None,
    ):
        self.total = total
        self.description = description
        self.unit = unit
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self.total_cost = total_cost
        self.every_seconds = progress_every() if every_seconds is None else float(every_seconds)
        self.summary = summary or mean_of_copies()
        self.done = initial
        self._initial = initial
        self._cost_done = 0.0
        self._costed = True  # every advance so far passed a cost
        self._clock = clock
        self._start = clock()
        self._printed_at: float | None = None
        self._pending: str | None = None  # the newest line, when throttled away
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
        metrics = self._postfix(postfix or {})
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
        line = " | ".join(parts)
        now = self._clock()
        if (self._printed_at is None or self.done >= self.total
                or now - self._printed_at >= self.every_seconds):
            self._print(line, now)
        else:
            self._pending = line

    def _postfix(self, postfix: dict) -> str:
        shown = {k: v for k, v in postfix.items() if k != self.unit}
        values, label = self.summary(shown)
        text = _postfix_text(values)
        return f"{text} ({label})" if text and label else text

    def _print(self, line: str, now: float) -> None:
        print(line, file=self.stream, flush=True)
        self._printed_at = now
        self._pending = None

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
        """Prints the newest throttled line, if any, and closes a tqdm bar."""
        if self._pending is not None:
            self._print(self._pending, self._clock())
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
        """Adds every finite scalar number in `metrics` at `step`, then flushes.

        Strings, arrays of more than one element and NaN or inf values (the
        round-0 placeholders of round metrics; a diverged copy) are skipped:
        TensorBoard has no use for them and tensorboardX warns on each.
        """
        for name, value in metrics.items():
            number = _scalar(value)
            if number is not None and math.isfinite(number):
                self._writer.add_scalar(str(name), float(number), global_step=int(step))
        # Flushed per call (a chunk of rounds), so a killed run keeps what it logged.
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_bands(log_dir, bands: dict) -> list[Path]:
    """A comparison's seed means and bands as TensorBoard scalars, one run folder per method.

    Args:
      log_dir: the parent folder; method m's events go to log_dir/m.
      bands: {metric: {method: {"round": [...], "mean": [...], "lo": [...],
        "hi": [...]}}}, as `plots.seed_bands` gives them.

    Tags are ``<metric>/mean``, ``<metric>/lo`` and ``<metric>/hi`` (one
    TensorBoard section per metric) at each round; NaN bounds (fewer than two
    finite seeds) are left out.

    Returns:
      the method folders written.

    Raises:
      ValueError: tensorboardX is not installed.
    """
    rows: dict = {}
    for metric, by_method in bands.items():
        for method, band in by_method.items():
            per_round = rows.setdefault(method, {})
            for i, step in enumerate(band["round"]):
                row = per_round.setdefault(int(step), {})
                for part in ("mean", "lo", "hi"):
                    row[f"{metric}/{part}"] = band[part][i]
    written = []
    for method, per_round in rows.items():
        with TensorBoardLog(Path(log_dir) / str(method)) as tb:
            for step in sorted(per_round):
                tb.write(step, per_round[step])
        written.append(Path(log_dir) / str(method))
    return written
