"""Statistics for reporting runs: algorithms compared over seeds, and success rates.

Two questions come up when federated algorithms are put side by side:

* Is method A better than the baseline, or is the gap seed noise? Every method
  runs on the same seeds (same federation, same initialisation), so the
  comparison is *paired*: the per-seed difference method − baseline cancels
  whatever the seed shares between them. `paired_comparison` reports the mean
  paired difference, its standard error and a two-sided paired t-test;
  `results_columns` and `results_markdown` lay that out as results.csv and as
  a Markdown table.
* How often does a method succeed (e.g. recover the true clusters)? A success
  count over a few dozen seeds is a binomial proportion; `wilson_interval`
  gives its Wilson score interval, which unlike the normal approximation stays
  inside [0, 1] and is sensible at 0 or n successes.

A seed whose value is NaN or ±inf (a diverged run) is dropped, pairwise for
differences. Only numpy and scipy are used, so this runs on a machine without
an accelerator, on results read back from disk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats as _scipy_stats


def _check_confidence(confidence: float) -> float:
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), e.g. 0.95; got {confidence}.")
    return confidence


def wilson_interval(successes, trials, confidence: float = 0.95):
    """Wilson score interval for a binomial proportion successes / trials.

    With p̂ = s / n and z the (1 + confidence) / 2 normal quantile, the
    interval is

        (p̂ + z²/2n ± z·sqrt(p̂(1 − p̂)/n + z²/4n²)) / (1 + z²/n).

    Args:
      successes: [...] number of successes, in [0, trials].
      trials: [...] number of trials, >= 0; broadcasts against `successes`.
      confidence: coverage of the interval, in (0, 1).

    Returns:
      (low, high), floats for scalar inputs, else arrays of the broadcast
      shape, inside [0, 1]; (nan, nan) where trials == 0.
    """
    confidence = _check_confidence(confidence)
    s, n = np.broadcast_arrays(
        np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    )
    if np.any(n < 0):
        raise ValueError(f"trials must be >= 0; got {np.asarray(trials).tolist()}.")
    if np.any((s < 0) | (s > n)):
        raise ValueError(
            f"successes must be in [0, trials]; got successes={np.asarray(successes).tolist()} "
            f"for trials={np.asarray(trials).tolist()}."
        )
    z = float(_scipy_stats.norm.ppf((1.0 + confidence) / 2.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        p = s / n
        denom = 1.0 + z**2 / n
        center = (p + z**2 / (2.0 * n)) / denom
        half = z / denom * np.sqrt(p * (1.0 - p) / n + z**2 / (4.0 * n**2))
    # Rounding can put an endpoint a hair outside [0, 1] at s = 0 or s = n.
    low = np.where(n > 0, np.clip(center - half, 0.0, 1.0), np.nan)
    high = np.where(n > 0, np.clip(center + half, 0.0, 1.0), np.nan)
    if low.ndim == 0:
        return float(low), float(high)
    return low, high


def _finite_mean_std(x: np.ndarray) -> tuple[float, float]:
    """Mean and sample std (ddof=1) over the finite entries; nan where too few."""
    x = x[np.isfinite(x)]
    mean = float(np.mean(x)) if x.size >= 1 else math.nan
    std = float(np.std(x, ddof=1)) if x.size >= 2 else math.nan
    return mean, std


def _paired_test(diffs: np.ndarray, confidence: float) -> tuple[float, float, bool]:
    """(mean difference, its standard error, two-sided paired t-test verdict)."""
    n = diffs.size
    diff = float(np.mean(diffs)) if n >= 1 else math.nan
    se = float(np.std(diffs, ddof=1) / math.sqrt(n)) if n >= 2 else math.nan
    if n < 2 or math.isnan(se):
        return diff, se, False
    if se == 0.0:
        # Every seed moved by exactly the same amount: no noise to test against.
        return diff, se, diff != 0.0
    t_crit = float(_scipy_stats.t.ppf((1.0 + confidence) / 2.0, n - 1))
    return diff, se, bool(abs(diff) / se > t_crit)


def paired_comparison(
    per_seed: Mapping[str, Mapping[str, np.ndarray]],
    baseline: str,
    metrics: Sequence[str],
    confidence: float = 0.95,
) -> list[dict]:
    """Each method against `baseline`, paired per seed, one row per method.

    Args:
      per_seed: `per_seed[method][metric]` is an array of shape `[num_seeds]`; the same seeds,
        in the same order, for every method. NaN or ±inf marks a diverged seed.
      baseline: the method the others are compared against; a key of `per_seed`.
      metrics: the metrics to report, each present for every method.
      confidence: confidence level of the two-sided paired t-test, in (0, 1).

    Returns:
      One dict per method, in `per_seed`'s order, with the keys of
      `results_columns(metrics)`: "method"; f"{m}_mean" and f"{m}_std" (sample
      std, ddof=1) over the method's finite seeds, nan when it has none (std:
      fewer than two); f"{m}_diff", the mean over seeds of method − baseline,
      on the seeds finite for both; f"{m}_diff_se", the sample std of those
      differences / sqrt(n); f"{m}_significant", |diff| / se >
      t_{(1 + confidence)/2, n − 1}, False when n < 2, True when se == 0 and
      diff != 0. The three difference keys are None in the baseline's row.
    """
    confidence = _check_confidence(confidence)
    if baseline not in per_seed:
        raise ValueError(f"baseline {baseline!r} is not a method of per_seed: {list(per_seed)}.")
    metrics = list(metrics)
    if len(set(metrics)) != len(metrics):
        raise ValueError(f"metrics must not repeat a name; got {metrics}.")

    values: dict[str, dict[str, np.ndarray]] = {}
    for method, table in per_seed.items():
        values[method] = {}
        for m in metrics:
            if m not in table:
                raise ValueError(
                    f"metric {m!r} is missing for method {method!r}; it has {list(table)}."
                )
            x = np.asarray(table[m], dtype=np.float64)
            if x.ndim != 1:
                raise ValueError(
                    f"per_seed[{method!r}][{m!r}] must be a 1-D array over seeds; "
                    f"got shape {x.shape}."
                )
            values[method][m] = x
    for method in values:
        for m in metrics:
            n_method, n_base = values[method][m].size, values[baseline][m].size
            if n_method != n_base:
                raise ValueError(
                    f"per_seed[{method!r}][{m!r}] has {n_method} seeds but the baseline "
                    f"{baseline!r} has {n_base}; every method must run on the same seeds."
                )

    rows = []
    for method, table in values.items():
        row: dict = {"method": method}
        for m in metrics:
            row[f"{m}_mean"], row[f"{m}_std"] = _finite_mean_std(table[m])
            if method == baseline:
                row[f"{m}_diff"] = row[f"{m}_diff_se"] = row[f"{m}_significant"] = None
                continue
            x, b = table[m], values[baseline][m]
            both = np.isfinite(x) & np.isfinite(b)
            row[f"{m}_diff"], row[f"{m}_diff_se"], row[f"{m}_significant"] = _paired_test(
                x[both] - b[both], confidence
            )
        rows.append(row)
    return rows


def results_columns(metrics: Sequence[str]) -> list[str]:
    """Column order of results.csv: "method", then five columns per metric.

    Args:
      metrics: metric names, in the order their columns should appear.

    Returns:
      ["method", f"{m}_mean", f"{m}_std", f"{m}_diff", f"{m}_diff_se",
      f"{m}_significant" for each m]: exactly the keys of a
      `paired_comparison` row.
    """
    columns = ["method"]
    for m in metrics:
        columns += [f"{m}_mean", f"{m}_std", f"{m}_diff", f"{m}_diff_se", f"{m}_significant"]
    return columns


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _mean_cell(mean, std) -> str:
    """"mean ± std"; the mean alone with one seed (no std); "—" with no finite value."""
    if not _finite(mean):
        return "—"
    return f"{mean:.4g} ± {std:.4g}" if _finite(std) else f"{mean:.4g}"


def _diff_cells(diff, se, significant) -> list[str]:
    """"+diff ± se (se)" and yes/no; "—" where there is no paired difference (a method or
    the baseline without the metric) or, for the verdict, too few seeds to test one."""
    if not _finite(diff):
        return ["—", "—"]
    if not _finite(se):
        return [f"{diff:+.4g}", "—"]
    return [f"{diff:+.4g} ± {se:.4g} (se)", "yes" if significant else "no"]


def results_markdown(
    rows: Sequence[Mapping],
    metrics: Sequence[str],
    baseline: str,
    *,
    seeds: int,
    title: str = "",
    confidence: float = 0.95,
) -> str:
    """A GitHub-Markdown table of `paired_comparison` rows, one line per method.

    Per metric there are three columns: "mean ± std" (4 significant digits),
    "Δ vs <baseline>" as "+diff ± se (se)" and "significant at <confidence> %"
    as yes/no; the baseline's two difference cells are "—". Where a number does
    not exist the cell says "—", never "nan": a metric the method does not report
    (or whose every seed diverged), a difference from a baseline without the
    metric, a verdict with fewer than two paired seeds; with one seed the mean and
    the difference stand alone, without "± nan".

    Args:
      rows: the output of `paired_comparison(..., baseline, metrics, confidence)`.
      metrics: the metrics to show, each with columns in `rows`.
      baseline: name of the baseline method; must be one of the rows.
      seeds: number of seeds per method, for the caption.
      title: optional heading put above the table.
        Rows may carry "diverged_seeds" and "seeds_used" (`compare.results_table`):
        the method's label then counts its diverged seeds, and a method with no
        seed left shows "diverged" instead of numbers.
      confidence: the level `rows` were computed at, for the headers.

    Returns:
      The Markdown text, ending with a newline.
    """
    confidence = _check_confidence(confidence)
    if not any(row["method"] == baseline for row in rows):
        raise ValueError(
            f"baseline {baseline!r} is not among the rows' methods: "
            f"{[row['method'] for row in rows]}."
        )
    for m in metrics:
        missing = [c for c in results_columns([m])[1:] if any(c not in row for row in rows)]
        if missing:
            raise ValueError(f"metric {m!r}: rows lack the columns {missing}.")

    level = f"{confidence * 100:g} %"
    header = ["method"]
    for m in metrics:
        header += [f"{m} mean ± std", f"{m} Δ vs {baseline}", f"{m} significant at {level}"]
    lines = []
    if title:
        lines += [f"## {title}", ""]
    seed_word = "seed" if seeds == 1 else "seeds"
    lines += [
        f"{seeds} {seed_word} per method. Differences are method − {baseline}, paired per seed; "
        f"± after a difference is the standard error of the mean paired difference (se); "
        f"significance is a two-sided paired t-test at {level}. ± after a mean is the sample "
        f"standard deviation over seeds. A diverged seed (NaN or inf) is left out of its "
        f"method's means and differences. — marks a metric with no finite value for the "
        f"method, a difference the baseline cannot be paired for, or a verdict that needs "
        f"two seeds.",
        "",
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "|" + "|".join([" --- "] + [" ---: ", " ---: ", " :---: "] * len(metrics)) + "|",
    ]
    for row in rows:
        gone = row.get("diverged_seeds") or 0
        used = row.get("seeds_used", seeds)
        label = row["method"] + (f" ({gone} of {gone + used} seeds diverged)" if gone else "")
        cells = [_cell(label)]
        for m in metrics:
            if used == 0:  # no seed left: no number, no verdict
                cells += ["diverged", "—", "—"]
                continue
            cells.append(_mean_cell(row[f"{m}_mean"], row[f"{m}_std"]))
            if row["method"] == baseline:
                cells += ["—", "—"]
            else:
                cells += _diff_cells(row[f"{m}_diff"], row[f"{m}_diff_se"],
                                     row[f"{m}_significant"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
