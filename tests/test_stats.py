"""fedjax_sim.stats: Wilson intervals and paired per-seed comparisons, checked by hand."""

from __future__ import annotations

import csv
import io
import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from fedjax_sim.stats import (
    paired_comparison,
    results_columns,
    results_markdown,
    wilson_interval,
)

# --------------------------------------------------------------------------- Wilson


def wilson_by_hand(s: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    z = scipy_stats.norm.ppf((1 + confidence) / 2)
    p = s / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(center - half, 0.0), min(center + half, 1.0)


@pytest.mark.parametrize("s", [0, 1, 20, 39, 40])
def test_wilson_matches_the_formula(s):
    low, high = wilson_interval(s, 40)
    assert isinstance(low, float) and isinstance(high, float)
    np.testing.assert_allclose((low, high), wilson_by_hand(s, 40), rtol=1e-12, atol=1e-15)


def test_wilson_known_values():
    # Published 95 % Wilson intervals (e.g. Newcombe 1998, Table I; Wikipedia).
    np.testing.assert_allclose(wilson_interval(8, 10), (0.4902, 0.9433), atol=1e-4)
    np.testing.assert_allclose(wilson_interval(0, 10), (0.0, 0.2775), atol=1e-4)
    np.testing.assert_allclose(wilson_interval(10, 10), (0.7225, 1.0), atol=1e-4)
    # 20/40 is symmetric about 1/2.
    low, high = wilson_interval(20, 40)
    assert low + high == pytest.approx(1.0)


def test_wilson_edges_are_exact():
    low, high = wilson_interval(0, 40)
    assert low == 0.0 and 0.0 < high < 1.0
    low, high = wilson_interval(40, 40)
    assert high == 1.0 and 0.0 < low < 1.0


def test_wilson_broadcasts_and_agrees_with_scalars():
    s = np.array([[0, 1, 20, 40], [0, 0, 3, 5]])
    n = np.array([[40], [5]])
    low, high = wilson_interval(s, n, confidence=0.9)
    assert low.shape == high.shape == (2, 4)
    for i in range(2):
        for j in range(4):
            expected = wilson_interval(int(s[i, j]), int(n[i, 0]), confidence=0.9)
            np.testing.assert_allclose((low[i, j], high[i, j]), expected, rtol=1e-12)


def test_wilson_zero_trials_is_nan():
    low, high = wilson_interval(0, 0)
    assert math.isnan(low) and math.isnan(high)
    low, high = wilson_interval([0, 2], [0, 4])
    assert np.isnan(low[0]) and np.isnan(high[0])
    np.testing.assert_allclose((low[1], high[1]), wilson_interval(2, 4))


def test_wilson_invariants():
    n = 40
    s = np.arange(n + 1)
    low, high = wilson_interval(s, n)
    p = s / n
    assert np.all((0 <= low) & (low <= p) & (p <= high) & (high <= 1))
    assert np.all(np.diff(low) > 0) and np.all(np.diff(high) > 0)
    # Symmetric under s -> n - s.
    np.testing.assert_allclose(low, 1 - high[::-1], atol=1e-12)
    # Wider at higher confidence; narrower with more trials at the same proportion.
    lo90, hi90 = wilson_interval(s, n, confidence=0.90)
    lo99, hi99 = wilson_interval(s, n, confidence=0.99)
    assert np.all(hi90 - lo90 < high - low) and np.all(high - low < hi99 - lo99)
    lo_big, hi_big = wilson_interval(4 * s, 4 * n)
    assert np.all(hi_big - lo_big < high - low)


@pytest.mark.parametrize(
    "successes, trials, culprit",
    [
        (-1, 10, "successes"),
        (11, 10, "successes"),
        ([1, 5], [4, 4], "successes"),
        (0, -1, "trials"),
    ],
)
def test_wilson_rejects_bad_counts(successes, trials, culprit):
    with pytest.raises(ValueError, match=culprit):
        wilson_interval(successes, trials)


@pytest.mark.parametrize("confidence", [0.0, 1.0, 95])
def test_wilson_rejects_bad_confidence(confidence):
    with pytest.raises(ValueError, match="confidence"):
        wilson_interval(1, 2, confidence=confidence)


# --------------------------------------------------------------- paired comparison

# 3 methods × 4 seeds × 2 metrics. "ifca" beats the baseline on every seed by
# 0.02 ± a little; "mixed" wobbles around it.
BASE_ACC = np.array([0.80, 0.82, 0.78, 0.80])
BASE_LOSS = np.array([0.50, 0.45, 0.55, 0.50])
TOY = {
    "fedavg": {"accuracy": BASE_ACC, "loss": BASE_LOSS},
    "ifca": {
        "accuracy": BASE_ACC + np.array([0.02, 0.03, 0.01, 0.02]),
        "loss": BASE_LOSS - np.array([0.10, 0.12, 0.08, 0.10]),
    },
    "mixed": {
        "accuracy": BASE_ACC + np.array([0.01, -0.01, 0.02, -0.02]),
        "loss": BASE_LOSS + np.array([0.05, -0.05, 0.00, 0.02]),
    },
}
METRICS = ["accuracy", "loss"]


def paired_by_hand(x, b, confidence=0.95):
    d = np.asarray(x, float) - np.asarray(b, float)
    n = d.size
    mean = d.sum() / n
    sd = math.sqrt(((d - mean) ** 2).sum() / (n - 1))
    se = sd / math.sqrt(n)
    t_crit = scipy_stats.t.ppf((1 + confidence) / 2, n - 1)
    return mean, se, abs(mean) / se > t_crit


def test_rows_follow_the_dict_order_and_the_columns():
    rows = paired_comparison(TOY, "fedavg", METRICS)
    assert [r["method"] for r in rows] == ["fedavg", "ifca", "mixed"]
    for row in rows:
        assert list(row) == results_columns(METRICS)


def test_results_columns_order():
    assert results_columns(["acc", "loss"]) == [
        "method",
        "acc_mean",
        "acc_std",
        "acc_diff",
        "acc_diff_se",
        "acc_significant",
        "loss_mean",
        "loss_std",
        "loss_diff",
        "loss_diff_se",
        "loss_significant",
    ]


@pytest.mark.parametrize("confidence", [0.95, 0.99])
def test_paired_comparison_matches_a_hand_computation(confidence):
    rows = {r["method"]: r for r in paired_comparison(TOY, "fedavg", METRICS, confidence)}
    for method, table in TOY.items():
        for m in METRICS:
            x = table[m]
            assert rows[method][f"{m}_mean"] == pytest.approx(x.sum() / 4)
            sd = math.sqrt(((x - x.mean()) ** 2).sum() / 3)
            assert rows[method][f"{m}_std"] == pytest.approx(sd)
            if method == "fedavg":
                for key in ("diff", "diff_se", "significant"):
                    assert rows[method][f"{m}_{key}"] is None
                continue
            diff, se, significant = paired_by_hand(x, TOY["fedavg"][m], confidence)
            assert rows[method][f"{m}_diff"] == pytest.approx(diff)
            assert rows[method][f"{m}_diff_se"] == pytest.approx(se)
            assert rows[method][f"{m}_significant"] is bool(significant)


def test_paired_comparison_golden_numbers():
    rows = {r["method"]: r for r in paired_comparison(TOY, "fedavg", METRICS)}
    # ifca accuracy: differences 0.02, 0.03, 0.01, 0.02: mean 0.02, sample std
    # sqrt(2e-4 / 3) = 0.008165, se 0.004082, t = 4.90 > t_{0.975, 3} = 3.182.
    assert rows["ifca"]["accuracy_diff"] == pytest.approx(0.02)
    assert rows["ifca"]["accuracy_diff_se"] == pytest.approx(math.sqrt(2e-4 / 3) / 2)
    assert rows["ifca"]["accuracy_significant"] is True
    assert rows["ifca"]["loss_diff"] == pytest.approx(-0.10)
    assert rows["ifca"]["loss_significant"] is True
    # mixed accuracy: differences 0.01, -0.01, 0.02, -0.02 average to 0.
    assert rows["mixed"]["accuracy_diff"] == pytest.approx(0.0, abs=1e-12)
    assert rows["mixed"]["accuracy_significant"] is False
    assert rows["mixed"]["loss_significant"] is False
    # The baseline's own spread: 0.80, 0.82, 0.78, 0.80 -> sample std sqrt(8e-4 / 3).
    assert rows["fedavg"]["accuracy_std"] == pytest.approx(math.sqrt(8e-4 / 3))


def test_pairing_is_what_makes_the_difference_significant():
    # A shift of 0.02 buried in a seed-to-seed spread of ±0.1 is invisible to an
    # unpaired comparison, but every paired difference is about 0.02.
    base = np.array([0.6, 0.8, 0.7, 0.9, 0.5])
    rows = paired_comparison(
        {"base": {"acc": base}, "new": {"acc": base + [0.021, 0.019, 0.020, 0.022, 0.018]}},
        "base",
        ["acc"],
    )
    assert rows[1]["acc_significant"] is True
    assert rows[1]["acc_diff"] < rows[0]["acc_std"] / 5


def test_zero_se():
    base = np.array([1.0, 2.0, 3.0])
    rows = paired_comparison(
        {"b": {"x": base}, "same": {"x": base.copy()}, "shifted": {"x": base + 0.5}}, "b", ["x"]
    )
    by = {r["method"]: r for r in rows}
    assert by["same"]["x_diff"] == 0.0 and by["same"]["x_diff_se"] == 0.0
    assert by["same"]["x_significant"] is False
    assert by["shifted"]["x_diff_se"] == 0.0 and by["shifted"]["x_significant"] is True


def test_diverged_seeds_are_dropped_pairwise():
    nan, inf = math.nan, math.inf
    base = np.array([1.0, 2.0, nan, 4.0, 5.0])
    new = np.array([1.5, nan, 3.0, 4.4, inf])
    rows = paired_comparison({"base": {"x": base}, "new": {"x": new}}, "base", ["x"])
    # Seeds 0 and 3 are finite for both.
    diff, se, significant = paired_by_hand([1.5, 4.4], [1.0, 4.0])
    assert rows[1]["x_diff"] == pytest.approx(diff)
    assert rows[1]["x_diff_se"] == pytest.approx(se)
    assert rows[1]["x_significant"] is bool(significant)
    # Means and stds use each method's own finite seeds.
    assert rows[0]["x_mean"] == pytest.approx(3.0)
    assert rows[0]["x_std"] == pytest.approx(np.std([1.0, 2.0, 4.0, 5.0], ddof=1))
    assert rows[1]["x_mean"] == pytest.approx((1.5 + 3.0 + 4.4) / 3)
    assert rows[1]["x_std"] == pytest.approx(np.std([1.5, 3.0, 4.4], ddof=1))


def test_all_seeds_diverged():
    rows = paired_comparison(
        {"base": {"x": np.array([1.0, 2.0])}, "new": {"x": np.array([math.nan, math.nan])}},
        "base",
        ["x"],
    )
    new = rows[1]
    assert math.isnan(new["x_mean"]) and math.isnan(new["x_std"])
    assert math.isnan(new["x_diff"]) and math.isnan(new["x_diff_se"])
    assert new["x_significant"] is False


def test_single_seed():
    rows = paired_comparison(
        {"base": {"x": np.array([1.0])}, "new": {"x": np.array([2.0])}}, "base", ["x"]
    )
    assert rows[0]["x_mean"] == 1.0 and math.isnan(rows[0]["x_std"])
    assert rows[1]["x_diff"] == 1.0
    assert math.isnan(rows[1]["x_diff_se"])
    assert rows[1]["x_significant"] is False


def test_rows_write_to_csv_with_the_columns():
    rows = paired_comparison(TOY, "fedavg", METRICS)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=results_columns(METRICS))  # extras would raise
    writer.writeheader()
    writer.writerows(rows)
    read = list(csv.DictReader(io.StringIO(buf.getvalue())))
    assert [r["method"] for r in read] == list(TOY)
    assert float(read[1]["accuracy_diff"]) == pytest.approx(0.02)


@pytest.mark.parametrize(
    "per_seed, baseline, metrics, culprits",
    [
        (TOY, "fedprox", METRICS, ["fedprox"]),
        ({**TOY, "bad": {"accuracy": BASE_ACC}}, "fedavg", METRICS, ["'loss'", "'bad'"]),
        (
            {**TOY, "short": {"accuracy": BASE_ACC[:3], "loss": BASE_LOSS}},
            "fedavg",
            METRICS,
            ["'short'", "'accuracy'", "3", "4"],
        ),
        (
            {**TOY, "flat": {"accuracy": BASE_ACC[None], "loss": BASE_LOSS}},
            "fedavg",
            METRICS,
            ["'flat'", "'accuracy'", "1-D"],
        ),
        (TOY, "fedavg", ["loss", "loss"], ["loss"]),
    ],
    ids=["unknown-baseline", "missing-metric", "unequal-seeds", "not-1d", "repeated-metric"],
)
def test_paired_comparison_rejects_bad_inputs(per_seed, baseline, metrics, culprits):
    with pytest.raises(ValueError) as err:
        paired_comparison(per_seed, baseline, metrics)
    for culprit in culprits:
        assert culprit in str(err.value)


def test_paired_comparison_rejects_bad_confidence():
    with pytest.raises(ValueError, match="confidence"):
        paired_comparison(TOY, "fedavg", METRICS, confidence=1.5)


# ----------------------------------------------------------------------- Markdown


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_markdown_has_one_row_per_method():
    rows = paired_comparison(TOY, "fedavg", METRICS)
    text = results_markdown(rows, METRICS, "fedavg", seeds=4, title="Toy comparison")
    assert text.startswith("## Toy comparison\n")
    lines = table_lines(text)
    header, rule, body = lines[0], lines[1], lines[2:]
    assert [line.split("|")[1].strip() for line in body] == list(TOY)
    n_cols = 1 + 3 * len(METRICS)
    for line in lines:
        assert line.count("|") == n_cols + 1
    assert "Δ vs fedavg" in header and "significant at 95 %" in header
    assert set(rule) <= set("|-: ")
    # Paired-per-seed caption with the seed count and what the ± of a difference is.
    caption = text.split("\n\n")[1]
    assert "4 seeds" in caption and "paired per seed" in caption
    assert "standard error of the mean paired difference" in caption


def test_markdown_cells():
    rows = paired_comparison(TOY, "fedavg", METRICS)
    body = table_lines(results_markdown(rows, METRICS, "fedavg", seeds=4))[2:]
    cells = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in body
    }
    by = {r["method"]: r for r in rows}
    # Baseline: mean ± std, then a dash in both difference cells, per metric.
    base = by["fedavg"]
    assert cells["fedavg"][0] == f"{base['accuracy_mean']:.4g} ± {base['accuracy_std']:.4g}"
    assert cells["fedavg"][1:3] == ["—", "—"] and cells["fedavg"][4:6] == ["—", "—"]
    # ifca accuracy 0.82, 0.85, 0.79, 0.82: mean 0.82, sample std sqrt(18e-4 / 3) = 0.02449.
    assert cells["ifca"][0] == "0.82 ± 0.02449"
    assert cells["ifca"][1] == "+0.02 ± 0.004082 (se)"
    assert cells["ifca"][2] == "yes"
    assert cells["ifca"][4].startswith("-0.1 ± ") and cells["ifca"][4].endswith(" (se)")
    assert cells["mixed"][2] == "no" and cells["mixed"][5] == "no"


def test_markdown_says_dash_where_a_number_does_not_exist():
    """A metric a method does not report (all NaN), a baseline without the metric, one seed:
    "—" or the number alone, never "nan" and never a "no" verdict without a test."""
    nan4 = np.full(4, np.nan)
    per_seed = {"fedavg": {"accuracy": BASE_ACC, "identity": nan4},
                "ifca": {"accuracy": BASE_ACC + 0.02, "identity": np.ones(4)},
                "local": {"accuracy": nan4, "identity": nan4}}
    rows = paired_comparison(per_seed, "fedavg", ["accuracy", "identity"])
    text = results_markdown(rows, ["accuracy", "identity"], "fedavg", seeds=4)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in table_lines(text)[2:]}
    assert "nan" not in text.replace("NaN", "")
    assert cells["fedavg"][3:] == ["—", "—", "—"]  # the baseline has no identity
    assert cells["ifca"][3] == "1 ± 0" and cells["ifca"][4:] == ["—", "—"]  # nothing to pair
    assert cells["local"] == ["—"] * 6  # reports neither metric
    assert cells["ifca"][1].endswith("(se)") and cells["ifca"][2] == "yes"

    one = {"fedavg": {"accuracy": BASE_ACC[:1]}, "ifca": {"accuracy": BASE_ACC[:1] + 0.02}}
    text = results_markdown(paired_comparison(one, "fedavg", ["accuracy"]), ["accuracy"],
                            "fedavg", seeds=1)
    cells = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in table_lines(text)[2:]}
    assert cells["fedavg"][0] == f"{BASE_ACC[0]:.4g}"  # one seed: no std
    assert cells["ifca"] == [f"{BASE_ACC[0] + 0.02:.4g}", "+0.02", "—"]  # no se, no test
    assert "nan" not in text


def test_markdown_other_confidence_and_no_title():
    rows = paired_comparison(TOY, "fedavg", ["loss"], confidence=0.99)
    text = results_markdown(rows, ["loss"], "fedavg", seeds=1, confidence=0.99)
    assert text.startswith("1 seed per method.")
    assert "significant at 99 %" in table_lines(text)[0]


def test_markdown_rejects_unknown_baseline_and_metric():
    rows = paired_comparison(TOY, "fedavg", METRICS)
    with pytest.raises(ValueError, match="fedprox"):
        results_markdown(rows, METRICS, "fedprox", seeds=4)
    with pytest.raises(ValueError, match="'time'"):
        results_markdown(rows, ["time"], "fedavg", seeds=4)
