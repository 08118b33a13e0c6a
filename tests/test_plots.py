"""plots: the numbers a comparison plot draws, log axes, colours, missing points, offsets."""

import math

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from scipy import stats as scipy_stats

from fedjax_sim import io, plots

ROUNDS = (0, 5, 10, 15, 20)
SEEDS = 5


def _per_seed_rows():
    """per_seed_metrics.csv rows: loss spans 4 decades; "b"'s seed 4 diverges after round 10."""
    rng = np.random.default_rng(0)
    rows = []
    for method, scale in (("a", 1.0), ("b", 3.0), ("c", 0.5)):
        for seed in range(SEEDS):
            for t in ROUNDS:
                loss = scale * 10.0 ** (-t / 5) * (1 + 0.3 * rng.random())
                gap = scale - 0.1 * t + rng.normal()  # changes sign: never a log axis
                if method == "b" and seed == 4 and t > 10:
                    loss = gap = math.nan
                rows.append({"method": method, "seed": seed, "round": t, "loss": loss,
                             "gap": gap, "acc": 0.5 + 0.01 * t + 0.01 * seed})
    return rows


@pytest.fixture
def drawn_axes(monkeypatch):
    """The axes of every figure the plots draw, [1, panels] each."""
    drawn = []
    real = plots._figure

    def recording(panels, width, height):
        fig, axes = real(panels, width, height)
        drawn.append(axes)
        return fig, axes

    monkeypatch.setattr(plots, "_figure", recording)
    return drawn


def _expected(rows, method, metric, interval):
    """The band from the rows, written here: finite seeds, t or se half-width."""
    out = {"round": [], "mean": [], "lo": [], "hi": [], "n": []}
    for t in ROUNDS:
        v = np.array([float(r[metric]) for r in rows
                      if r["method"] == method and float(r["round"]) == t and r[metric] != ""])
        v = v[np.isfinite(v)]
        se = v.std(ddof=1) / math.sqrt(len(v))
        half = se * scipy_stats.t.ppf(0.975, len(v) - 1) if interval == "t95" else se
        for key, value in (("round", t), ("mean", v.mean()), ("lo", v.mean() - half),
                           ("hi", v.mean() + half), ("n", len(v))):
            out[key].append(value)
    return out


@pytest.mark.parametrize("interval", ["t95", "se"])
def test_the_band_drawn_is_the_one_computed_from_per_seed_metrics_csv(
        tmp_path, drawn_axes, interval):
    io.write_csv(tmp_path / "per_seed_metrics.csv", _per_seed_rows())
    rows = plots.per_seed_rows(tmp_path)  # as read back: strings, empty cells
    drawn = plots.plot_comparison(rows, tmp_path / "comparison.png",
                                  [("loss", "train loss"), ("acc", "accuracy")],
                                  interval=interval)
    assert (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert set(drawn) == {"loss", "acc"} and list(drawn["loss"]) == ["a", "b", "c"]
    for metric in ("loss", "acc"):
        for method in ("a", "b", "c"):
            want = _expected(rows, method, metric, interval)
            got = drawn[metric][method]
            for key in want:
                np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)
    assert drawn["loss"]["b"]["n"] == [5, 5, 5, 4, 4]  # the diverged seed left out
    # ...and those numbers are what matplotlib got: the lines and the bands' outlines.
    (axes,) = drawn_axes
    ax = axes[0][0]
    for line, method in zip(ax.get_lines(), ("a", "b", "c"), strict=True):
        np.testing.assert_array_equal(line.get_ydata(), drawn["loss"][method]["mean"])
    for band, method in zip(ax.collections, ("a", "b", "c"), strict=True):
        outline = band.get_paths()[0].vertices[:, 1]
        for key in ("lo", "hi"):
            assert np.isin(drawn["loss"][method][key], outline).all()
    assert plots.INTERVALS[interval] in ax.get_legend().get_title().get_text()


def test_every_axis_is_labelled_and_log_axes_follow_the_values(tmp_path, drawn_axes):
    rows = _per_seed_rows()
    plots.plot_comparison(rows, tmp_path / "c.png",
                          [("loss", "loss"), ("gap", "gap"), ("acc", "accuracy")])
    plots.plot_comparison(rows, tmp_path / "d.png", [("acc", "accuracy")], log_y={"acc"})
    plots.plot_comparison(rows, tmp_path / "e.png", [("loss", "loss")], auto_log=False)
    first, forced, off = (axes[0] for axes in drawn_axes)
    # loss spans > 2 decades, all > 0: log; gap changes sign, acc spans < 2 decades: linear.
    assert [ax.get_yscale() for ax in first] == ["log", "linear", "linear"]
    assert forced[0].get_yscale() == "log" and off[0].get_yscale() == "linear"
    for ax in [*first, *forced]:
        assert ax.get_xlabel() == "round" and ax.get_ylabel()
    assert [ax.get_ylabel() for ax in first] == ["loss", "gap", "accuracy"]


def test_a_method_keeps_its_colour_across_plots(tmp_path, drawn_axes):
    rows = _per_seed_rows()
    every = ["c", "a", "b", "never_run"]
    colors = plots.method_colors(every)
    assert colors == plots.method_colors(every) and len(set(map(str, colors.values()))) == 4
    plots.plot_comparison(rows, tmp_path / "all.png", [("loss", "loss")], methods=every)
    only_b = [r for r in rows if r["method"] == "b"]
    plots.plot_comparison(only_b, tmp_path / "b.png", [("acc", "acc")], methods=every)
    plots.plot_curves([{"m": m, "x": x, "y": 1.0} for m in ("b", "c") for x in (1, 2)],
                      tmp_path / "curves.png", x="x", y="y", group="m", colors=colors)
    both, alone, curves = (axes[0][0] for axes in drawn_axes)
    line_color = {line.get_label(): to_rgba(line.get_color()) for line in both.get_lines()}
    assert line_color == {m: to_rgba(colors[m]) for m in ("c", "a", "b")}
    assert to_rgba(alone.get_lines()[0].get_color()) == to_rgba(colors["b"])
    assert [to_rgba(line.get_color()) for line in curves.get_lines()] == [
        to_rgba(colors["b"]), to_rgba(colors["c"])]


def test_a_target_never_reached_is_drawn_at_the_top_not_dropped(tmp_path, drawn_axes):
    points = [{"G": G, "method": m, "rounds": r}
              for G, by in ((0.1, {"PT": 30, "2-GT": 10, "FL": None}),
                            (1.0, {"PT": None, "2-GT": 12, "FL": None}),
                            (10.0, {"PT": None, "2-GT": "", "FL": None}))
              for m, r in by.items()]
    colors = plots.method_colors(["PT", "2-GT", "FL"])
    assert plots.plot_curves(points, tmp_path / "r.png", x="G", y="rounds", group="method",
                             log_x=True, missing="not reached", colors=colors,
                             label_format="{value}")
    ax = drawn_axes[0][0][0]
    labels = ax.get_legend_handles_labels()[1]
    assert set(labels) >= {"PT", "2-GT", "FL", "not reached (marker at top)"}
    tops = [line for line in ax.get_lines() if line.get_marker() == "^" and len(line.get_xdata())]
    at_top = {to_rgba(line.get_color()): len(line.get_xdata()) for line in tops}
    # FL never reached: 3 markers; PT 2; 2-GT 1 (an empty cell).
    assert at_top == {to_rgba(colors["FL"]): 3, to_rgba(colors["PT"]): 2,
                      to_rgba(colors["2-GT"]): 1}
    assert all(np.all(np.asarray(line.get_ydata()) == plots._TOP) for line in tops)


def test_error_bars_that_share_an_x_are_offset(tmp_path, drawn_axes):
    rows = [{"m": m, "n": n, "p": 0.5, "lo": 0.4, "hi": 0.6}
            for m in (50, 100, 200) for n in (50, 100, 200)]
    plots.plot_curves(rows, tmp_path / "lin.png", x="m", y="p", group="n", ci=("lo", "hi"))
    plots.plot_curves(rows, tmp_path / "log.png", x="m", y="p", group="n", ci=("lo", "hi"),
                      log_x=True)
    for axes, log in zip(drawn_axes, (False, True), strict=True):
        ax = axes[0][0]
        xs = np.array([line.get_xdata() for line in ax.get_lines()  # [curves, points]
                       if line.get_marker() == "o"])  # the data, not the caps
        assert xs.shape == (3, 3)
        assert len(np.unique(xs)) == 9  # no two points at one x
        true = np.array([50.0, 100.0, 200.0])
        at = np.log10(xs) if log else xs
        centre = np.log10(true) if log else true
        np.testing.assert_allclose(at.mean(axis=0), centre, atol=1e-9)  # centred on the x
        gap = np.diff(centre).min()
        assert np.abs(at - centre).max() <= 0.3 * gap / 2 + 1e-9  # and close to it
        assert ax.get_ylabel() == "p" and ax.get_xlabel() == "m"
    shifted = plots.dodge(np.array([5.0]), 0, 2)
    assert shifted[0] < 5.0 < plots.dodge(np.array([5.0]), 1, 2)[0]
    np.testing.assert_array_equal(plots.dodge(np.array([1.0, 2.0]), 0, 1), [1.0, 2.0])


def test_intervals_of_one_or_no_finite_seed_and_a_method_with_no_value(tmp_path, drawn_axes):
    assert plots.seed_interval([2.0, math.nan]) == (2.0, pytest.approx(math.nan, nan_ok=True),
                                                    pytest.approx(math.nan, nan_ok=True), 1)
    mean, lo, hi, n = plots.seed_interval([math.inf, ""])
    assert n == 0 and math.isnan(mean) and math.isnan(lo) and math.isnan(hi)
    with pytest.raises(ValueError, match="interval"):
        plots.seed_interval([1.0], "sd")
    rows = [{"method": m, "seed": s, "round": t, "loss": 1.0 if m == "ok" else math.nan}
            for m in ("ok", "diverged") for s in range(2) for t in (0, 1)]
    drawn = plots.plot_comparison(rows, tmp_path / "c.png", [("loss", "loss")])
    assert set(drawn["loss"]) == {"ok", "diverged"}
    labels = drawn_axes[0][0][0].get_legend_handles_labels()[1]
    assert labels == ["ok", "diverged (no finite value)"]
    assert plots.plot_comparison(rows, tmp_path / "none.png", [("absent", "x")]) == {}
    assert not (tmp_path / "none.png").exists()


def test_per_seed_rows_fall_back_to_seed_means(tmp_path):
    histories = {"a": [{"round": 0, "loss": 1.0}], "b": [{"round": 0, "loss": 2.0}]}
    assert plots.per_seed_rows(tmp_path, histories) == [
        {"method": "a", "seed": 0, "round": 0, "loss": 1.0},
        {"method": "b", "seed": 0, "round": 0, "loss": 2.0}]


# ============================================================ the experiments' plots


def _comparison_outputs(tmp_path, methods, metrics):
    """A comparison's per_seed_metrics.csv and seed-mean histories, made up (no training)."""
    from fedjax_sim.experiments.base import Comparison, seed_mean_rows

    rng = np.random.default_rng(1)
    rows = [{"method": m, "seed": s, "round": t,
             **{k: float(rng.random()) for k in metrics}}
            for m in methods for s in range(3) for t in (0, 2, 4)]
    io.write_csv(tmp_path / "per_seed_metrics.csv", rows)
    histories = {}
    for m in methods:
        by_round = {}
        for row in rows:
            if row["method"] == m:
                by_round.setdefault(row["round"], []).append(row)
        histories[m] = seed_mean_rows([
            {"round": t, **{k: [r[k] for r in rs] for k in metrics}}
            for t, rs in by_round.items()])
    return Comparison({}, histories, list(metrics), methods[0]), rows


@pytest.fixture
def comparison_calls(monkeypatch):
    calls = []
    real = plots.plot_comparison

    def spy(rows, path, panels, **kw):
        calls.append((path.name, rows, kw, real(rows, path, panels, **kw)))
        return calls[-1][-1]

    monkeypatch.setattr(plots, "plot_comparison", spy)
    return calls


def test_drfa_plots_draw_per_seed_bands_in_the_runs_colours(tmp_path, comparison_calls):
    from fedjax_sim.experiments import drfa_molecules

    experiment = drfa_molecules.EXPERIMENT
    metrics = ["train_loss_worst", "lambda_0", "lambda_1", "sampled_0", "sampled_1"]
    comparison, rows = _comparison_outputs(tmp_path, list(experiment.methods), metrics)
    experiment.plot_compare(comparison, tmp_path)
    assert (tmp_path / "lambda.png").read_bytes()[:4] == b"\x89PNG"
    ((name, used, kw, drawn),) = comparison_calls
    assert name == "worst_client_loss.png" and (tmp_path / name).is_file()
    assert kw["colors"] == plots.method_colors(experiment.methods)
    band = drawn["train_loss_worst"]["drfa"]
    want = _expected_from(rows, "drfa", "train_loss_worst")
    np.testing.assert_allclose(band["lo"], want["lo"])
    np.testing.assert_allclose(band["hi"], want["hi"])


def test_cluster_identity_plot_keeps_the_colours_of_all_methods(tmp_path, comparison_calls):
    from fedjax_sim.experiments import ifca_images

    experiment = ifca_images.DIGITS  # ifca, fedavg, local, hypcluster, cfl
    comparison, rows = _comparison_outputs(tmp_path, list(experiment.methods),
                                           ["cluster_accuracy"])
    experiment.plot_compare(comparison, tmp_path)
    ((name, _, kw, drawn),) = comparison_calls
    assert name == "cluster_identity.png" and (tmp_path / name).is_file()
    assert list(drawn["cluster_accuracy"]) == [m for m in experiment.methods
                                               if m in ifca_images.CLUSTERING]
    assert kw["colors"]["ifca"] == plots.method_colors(experiment.methods)["ifca"]
    np.testing.assert_allclose(drawn["cluster_accuracy"]["ifca"]["mean"],
                               _expected_from(rows, "ifca", "cluster_accuracy")["mean"])


def _expected_from(rows, method, metric):
    rounds = sorted({r["round"] for r in rows})
    out = {"mean": [], "lo": [], "hi": []}
    for t in rounds:
        v = np.array([r[metric] for r in rows if r["method"] == method and r["round"] == t])
        half = scipy_stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
        out["mean"].append(v.mean())
        out["lo"].append(v.mean() - half)
        out["hi"].append(v.mean() + half)
    return out


def test_synthetic_run_plot_labels_every_axis(tmp_path, drawn_axes):
    from fedjax_sim.experiments import ifca_synthetic

    rows = [{"round": t, "restart": 0, "train_loss": 10.0 ** -t, "test_loss": 2.0 ** -t,
             "cluster_accuracy": 0.5, "min_dist": 1.0 / (t + 1)} for t in range(4)]
    ifca_synthetic.EXPERIMENT.plot_run(rows, {"success_threshold": 0.06, "algorithm": "ifca",
                                       "best_restart": 0}, tmp_path)
    (axes,) = drawn_axes
    panels = ifca_synthetic.EXPERIMENT.panels
    assert [ax.get_ylabel() for ax in axes[0]] == [label for _, label in panels]
    assert all(ax.get_xlabel() == "round" for ax in axes[0])
    assert axes[0][0].get_yscale() == "log"
    color = to_rgba(axes[0][0].get_lines()[0].get_color())
    assert color == to_rgba(plots.method_colors(ifca_synthetic.EXPERIMENT.methods)["ifca"])


def test_bands_against_a_time_each_seed_reaches_on_its_own(tmp_path, drawn_axes):
    """x = "virtual_time", by = "round": each round's band over the seeds sits at the seeds'
    mean time of that round (sorted by it); a row without a time is left out."""
    rng = np.random.default_rng(2)
    rows = []
    for method, speed in (("sync", 3.0), ("async", 1.0)):
        for seed in range(SEEDS):
            time = 0.0
            for t in ROUNDS:
                rows.append({"method": method, "seed": seed, "round": t,
                             "virtual_time": time, "acc": 0.1 + 0.03 * t + 0.05 * rng.random()})
                time += speed * 5 * (1 + rng.random())
    rows.append({"method": "sync", "seed": 9, "round": 20, "virtual_time": "", "acc": 0.0})
    io.write_csv(tmp_path / "per_seed_metrics.csv", rows)
    read = plots.per_seed_rows(tmp_path)
    drawn = plots.plot_comparison(read, tmp_path / "time.png", [("acc", "accuracy")],
                                  x="virtual_time", by="round", xlabel="virtual time (s)")
    assert (tmp_path / "time.png").read_bytes()[:4] == b"\x89PNG"
    for method in ("sync", "async"):
        mine = [r for r in rows if r["method"] == method and r["virtual_time"] != ""]
        time = [np.mean([r["virtual_time"] for r in mine if r["round"] == t]) for t in ROUNDS]
        acc = [[r["acc"] for r in mine if r["round"] == t] for t in ROUNDS]
        band = drawn["acc"][method]
        np.testing.assert_allclose(band["round"], time, rtol=1e-12)
        np.testing.assert_allclose(band["mean"], [np.mean(a) for a in acc], rtol=1e-12)
        half = [scipy_stats.t.ppf(0.975, SEEDS - 1) * np.std(a, ddof=1) / math.sqrt(SEEDS)
                for a in acc]
        np.testing.assert_allclose(band["hi"], np.mean(acc, axis=1) + half, rtol=1e-12)
        assert band["n"] == [SEEDS] * len(ROUNDS)
    # The async method reaches each round sooner: its curve ends left of the other's.
    assert drawn["acc"]["async"]["round"][-1] < drawn["acc"]["sync"]["round"][-1] / 2
    (axes,) = drawn_axes
    ax = axes[0][0]
    assert ax.get_xlabel() == "virtual time (s)"
    np.testing.assert_allclose(ax.get_lines()[0].get_xdata(), drawn["acc"]["sync"]["round"])
