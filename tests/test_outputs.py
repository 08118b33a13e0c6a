"""What a run leaves on disk: io's CSV/JSON formats and file modes, logs' writers, plots."""

from __future__ import annotations

import io as stdio
import json
import math
import os
import re
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from fedjax_sim import io as fio
from fedjax_sim import logs, plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# ============================================================================ io: CSV


def test_csv_records_end_with_a_bare_newline(tmp_path):
    columns = ["round", "loss"]
    fio.write_csv(tmp_path / "w.csv", [{"round": 0, "loss": 0.5}, {"round": 1, "loss": 0.25}])
    fio.append_csv(tmp_path / "a.csv", [{"round": 0, "loss": 0.5}], columns)
    fio.append_csv(tmp_path / "a.csv", [{"round": 1, "loss": 0.25}], columns)
    want = b"round,loss\n0,0.5\n1,0.25\n"
    assert (tmp_path / "w.csv").read_bytes() == want
    assert (tmp_path / "a.csv").read_bytes() == want


TRICKY_TEXT = ["a\rb", "c\nd", "e\r\nf", 'say "hi"', "x,y", "end\r", "\n", "", " lead", "é\u2028"]


def test_csv_round_trips_text_with_line_breaks_quotes_and_commas(tmp_path):
    rows = [{"i": i, "text": text} for i, text in enumerate(TRICKY_TEXT)]
    fio.write_csv(tmp_path / "w.csv", rows)
    for row in rows:
        fio.append_csv(tmp_path / "a.csv", [row], ["i", "text"])
    for name in ("w.csv", "a.csv"):
        got = fio.read_csv(tmp_path / name)
        assert [r["text"] for r in got] == TRICKY_TEXT, name
        # Fields with "\r" or "\n" quoted; every record, and only a record, ends in "\n".
        assert (tmp_path / name).read_bytes() == (
            b'i,text\n0,"a\rb"\n1,"c\nd"\n2,"e\r\nf"\n3,"say ""hi"""\n4,"x,y"\n'
            b'5,"end\r"\n6,"\n"\n7,\n8, lead\n9,\xc3\xa9\xe2\x80\xa8\n'
        ), name


def test_read_csv_still_reads_crlf_files_and_appends_after_them(tmp_path):
    path = tmp_path / "old.csv"
    path.write_bytes(b'round,note\r\n0,"a\r\nb"\r\n1,plain\r\n')
    fio.append_csv(path, [{"round": 2, "note": "new"}], ["round", "note"])
    assert fio.read_csv(path) == [
        {"round": "0", "note": "a\r\nb"},
        {"round": "1", "note": "plain"},
        {"round": "2", "note": "new"},
    ]


# ============================================================================ io: JSON


def _reject_constant(token):
    raise AssertionError(f"non-strict JSON token {token}")


def test_write_json_is_strict_non_finite_floats_become_null(tmp_path):
    path = tmp_path / "summary.json"
    fio.write_json(path, {
        "nan": math.nan,
        "inf": math.inf,
        "list": [1.0, -math.inf, (math.nan, 2)],
        "nested": {"deep": [{"x": float("-inf")}]},
        "np_scalar": np.float32("nan"),
        "np64": np.float64("inf"),
        "array": np.array([[1.5, np.nan], [np.inf, -np.inf]]),
        "ints": np.arange(3),
        "ok": 0.1,
    })
    got = json.loads(path.read_text(), parse_constant=_reject_constant)
    assert got == {
        "nan": None,
        "inf": None,
        "list": [1.0, None, [None, 2]],
        "nested": {"deep": [{"x": None}]},
        "np_scalar": None,
        "np64": None,
        "array": [[1.5, None], [None, None]],
        "ints": [0, 1, 2],
        "ok": 0.1,
    }


def test_write_json_still_rejects_unencodable_objects(tmp_path):
    with pytest.raises(TypeError, match="object"):
        fio.write_json(tmp_path / "x.json", {"x": object()})
    assert not os.listdir(tmp_path)


# ============================================================================ io: file modes


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_output_files_get_the_mode_open_would_give(tmp_path, umask_022):
    fio.write_json(tmp_path / "config.json", {"a": 1})
    fio.write_csv(tmp_path / "summary.csv", [{"a": 1}])
    fio.append_csv(tmp_path / "trials.csv", [{"a": 1}], ["a"])
    fio.write_csv(tmp_path / "sub" / "new.csv", [{"a": 1}])
    for name in ("config.json", "summary.csv", "trials.csv", "sub/new.csv"):
        assert _mode(tmp_path / name) == 0o644, (name, oct(_mode(tmp_path / name)))
    with open(tmp_path / "plain", "w"):
        pass
    assert _mode(tmp_path / "plain") == 0o644


def test_output_file_modes_follow_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        fio.write_json(tmp_path / "config.json", {"a": 1})
    finally:
        os.umask(old)
    assert _mode(tmp_path / "config.json") == 0o600


# ============================================================================ logs: MetricsCSV


def _history(rounds):
    return [{"round": t, "train_loss": 1 / (t + 1), "acc": np.float32(t / 10)} for t in rounds]


def test_metrics_csv_resume_truncates_later_rows_and_matches_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole.csv"
    logs.MetricsCSV(whole).append(_history(range(0, 9)))

    killed = tmp_path / "killed.csv"
    first = logs.MetricsCSV(killed)
    first.append(_history(range(0, 4)))
    first.append(_history(range(4, 7)))  # rows past the checkpoint at round 4
    assert len(fio.read_csv(killed)) == 7
    resumed = logs.MetricsCSV(killed, resume_round=4)
    assert [r["round"] for r in fio.read_csv(killed)] == ["0", "1", "2", "3", "4"]
    resumed.append(_history(range(5, 9)))
    assert killed.read_bytes() == whole.read_bytes()


def test_metrics_csv_resume_keeps_the_existing_header_and_drops_a_partial_line(tmp_path):
    path = tmp_path / "m.csv"
    path.write_bytes(b"round,loss\n0,1.0\n1.0,0.5\n2,0.2")  # a crash cut the last row
    metrics = logs.MetricsCSV(path, resume_round=1)
    metrics.append([{"round": 2, "loss": 0.25}])
    assert path.read_bytes() == b"round,loss\n0,1.0\n1.0,0.5\n2,0.25\n"
    with pytest.raises(ValueError, match="extra"):
        metrics.append([{"round": 3, "loss": 0.1, "extra": 1}])


def test_metrics_csv_refuses_to_overwrite_without_resume(tmp_path):
    path = tmp_path / "m.csv"
    logs.MetricsCSV(path).append(_history(range(2)))
    before = path.read_bytes()
    with pytest.raises(ValueError, match="already exists"):
        logs.MetricsCSV(path)
    assert path.read_bytes() == before


def test_metrics_csv_without_a_round_column_cannot_resume(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text("step,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="round"):
        logs.MetricsCSV(path, resume_round=0)


# ============================================================================ logs: Progress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_prints_one_plain_line_per_advance_with_rate_and_postfix():
    clock, stream = FakeClock(), stdio.StringIO()
    with logs.Progress(300, description="ifca-synthetic", stream=stream, clock=clock,
                       every_seconds=0) as bar:
        clock.now += 2.0
        bar.advance(50, postfix={"train_loss": 0.123456, "loss": np.float32(0.13009),
                                 "assign": np.arange(3), "name": "ok"})
        clock.now += 2.0
        bar.advance(50)
    lines = stream.getvalue().splitlines()
    assert lines == [  # an array shows its mean over copies, labelled
        "ifca-synthetic: 50/300 rounds (17%) | train_loss=0.1235 loss=0.1301 assign=1 name=ok"
        " (mean of 3 copies) | 25 rounds/s | ETA 0:00:10",
        "ifca-synthetic: 100/300 rounds (33%) | 25 rounds/s | ETA 0:00:08",
    ]


def test_progress_disabled_prints_nothing():
    stream = stdio.StringIO()
    with logs.Progress(10, description="x", enabled=False, stream=stream) as bar:
        bar.advance(3, postfix={"loss": 1.0})
    assert stream.getvalue() == ""


def test_progress_eta_is_weighted_by_cost():
    """Cells of 10 seeds, then cells of 1000: the count ETA would be far off."""
    clock, stream = FakeClock(), stdio.StringIO()
    bar = logs.Progress(4, description="sweep", unit="cell", stream=stream,
                        total_cost=10 + 10 + 1000 + 1000, clock=clock, every_seconds=0)
    clock.now += 5.0
    bar.advance(1, cost=10)
    clock.now += 5.0
    bar.advance(1, cost=10)
    # 10 s for 20 cost: 2000 cost left at 0.5 s each; by count it would be 10 s.
    assert bar.eta() == pytest.approx(1000.0)
    assert stream.getvalue().splitlines()[-1] == (
        "sweep: 2/4 cells (50%) | 5 s/cell | ETA 0:16:40"
    )
    clock.now += 500.0
    bar.advance(1, cost=1000)
    assert bar.eta() == pytest.approx(1000 * 510 / 1020)


def test_progress_eta_falls_back_to_count_when_a_cost_is_missing():
    clock = FakeClock()
    bar = logs.Progress(4, description="sweep", unit="cell", stream=stdio.StringIO(),
                        total_cost=100.0, clock=clock)
    clock.now += 3.0
    bar.advance(1, cost=1.0)
    clock.now += 3.0
    bar.advance(1)
    assert bar.eta() == pytest.approx(6.0)  # 2 of 4 cells in 6 s


def test_progress_counts_rate_and_eta_from_initial():
    clock, stream = FakeClock(), stdio.StringIO()
    bar = logs.Progress(100, description="run", initial=60, stream=stream, clock=clock)
    assert bar.eta() is None
    clock.now += 4.0
    bar.advance(20)
    assert stream.getvalue() == "run: 80/100 rounds (80%) | 5 rounds/s | ETA 0:00:04\n"


class _TTY(stdio.StringIO):
    def isatty(self):
        return True


def test_progress_on_a_terminal_draws_a_tqdm_bar():
    stream = _TTY()
    with logs.Progress(10, description="run", stream=stream) as bar:
        bar.advance(5, postfix={"loss": 0.5})
    text = stream.getvalue()
    assert "\r" in text and "run:" in text and "5/10" in text and "loss=0.5" in text


# ============================================================================ logs: TensorBoardLog


def _read_events(path: Path):
    """Events of a TFRecord file: [u64 length][u32 crc][data][u32 crc] per record."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    data, events, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    assert at == len(data)
    return events


def test_tensorboard_log_writes_finite_scalars_an_event_reader_reads_back(tmp_path):
    pytest.importorskip("tensorboardX")
    with logs.TensorBoardLog(tmp_path / "tb") as tb:
        tb.write(0, {"loss": 1.5, "acc": np.float32(0.25), "n": np.int64(7), "one": np.ones(1),
                     "vector": np.ones(3), "name": "skip", "bad": math.nan, "inf": -math.inf})
        tb.write(5, {"loss": 0.5, "acc": np.array(0.75)})
    (events_file,) = (tmp_path / "tb").iterdir()
    assert events_file.name.startswith("events.out.tfevents.")
    scalars = {}
    for event in _read_events(events_file):
        for value in event.summary.value:
            scalars[(value.tag, event.step)] = value.simple_value
    assert set(scalars) == {("loss", 0), ("acc", 0), ("n", 0), ("one", 0),
                            ("loss", 5), ("acc", 5)}  # NaN and inf left out
    assert scalars[("loss", 0)] == 1.5 and scalars[("acc", 5)] == 0.75
    assert scalars[("n", 0)] == 7 and scalars[("one", 0)] == 1.0


def test_tensorboard_log_without_tensorboardx_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    with pytest.raises(ValueError, match=re.escape("pip install -e '.[tensorboard]'")):
        logs.TensorBoardLog(tmp_path / "tb")


# ============================================================================ plots


def test_plot_history_writes_a_png_with_hlines_log_axes_and_groups(tmp_path):
    rows = [{"round": t, "loss": 1 / (t + 1), "dist": 2.0 ** -t} for t in range(5)]
    path = plots.plot_history(
        rows, tmp_path / "m.png", [("loss", "loss"), ("dist", "distance"), ("absent", "none")],
        title="run", hlines={"dist": (0.1, "threshold")}, log_y={"dist", "loss"},
    )
    assert path == tmp_path / "m.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    # CSV-read rows (strings, an empty cell) and one line per group.
    as_read = [{k: str(v) for k, v in row.items()} for row in rows] + [{"round": "5", "loss": ""}]
    grouped = plots.plot_history(
        [], tmp_path / "g.png", [("loss", "loss")], groups={"a": rows, "b": as_read},
    )
    assert grouped.read_bytes()[:8] == PNG_SIGNATURE
    assert plots.plot_history(rows, tmp_path / "none.png", [("absent", "x")]) is None
    assert not (tmp_path / "none.png").exists()


def _summary():
    return [
        {"R": R, "sigma": sigma, "k": k, "p": min(1.0, R * (k + sigma)),
         "low": max(0.0, R * (k + sigma) - 0.1), "high": min(1.0, R * (k + sigma) + 0.1)}
        for R in (0.5, 0.1, 1.0) for sigma in (0.2, 0.0) for k in (2, 4)
    ]


def test_plot_curves_writes_a_png_with_panels_ci_and_log_x(tmp_path):
    path = plots.plot_curves(
        _summary(), tmp_path / "c.png", x="R", y="p", group="sigma", panels=["k"],
        ci=("low", "high"), log_x=True, xlabel="R", ylabel="success probability",
        ylim=(-0.03, 1.03),
    )
    assert path == tmp_path / "c.png"
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    plain = plots.plot_curves(_summary(), tmp_path / "d.png", x="R", y="p", group="k")
    assert plain.read_bytes()[:8] == PNG_SIGNATURE


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


def test_plot_curves_panels_and_curves_follow_the_settings(tmp_path, drawn_axes):
    plots.plot_curves(_summary(), tmp_path / "c.png", x="R", y="p", group="sigma",
                      panels=("k",), ci=("low", "high"), log_x=True, offset=False)
    (axes,) = drawn_axes
    assert [ax.get_title() for ax in axes[0]] == ["k=2", "k=4"]
    for ax in axes[0]:
        assert ax.get_xscale() == "log"
        assert ax.get_legend_handles_labels()[1] == ["sigma=0", "sigma=0.2"]
        assert list(ax.get_lines()[0].get_xdata()) == [0.1, 0.5, 1.0]  # sorted by x


def test_plot_curves_needs_two_x_values(tmp_path):
    rows = [row for row in _summary() if row["R"] == 0.5]
    assert plots.plot_curves(rows, tmp_path / "c.png", x="R", y="p", group="sigma") is None
    assert not (tmp_path / "c.png").exists()


def test_plot_curves_log_x_falls_back_to_linear_for_non_positive_x(tmp_path, drawn_axes):
    rows = [{"R": R, "p": 0.5, "g": 1} for R in (0.0, 1.0)]
    assert plots.plot_curves(rows, tmp_path / "c.png", x="R", y="p", group="g", log_x=True)
    assert drawn_axes[0][0][0].get_xscale() == "linear"
