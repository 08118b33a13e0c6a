"""logs: progress throttled off a terminal, per-copy postfixes, TensorBoard without warnings."""

import io as stdio
import math
import struct

import numpy as np
import pytest

from fedjax_sim import logs


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class TimedStream(stdio.StringIO):
    """A pipe that records the fake time of every line written to it."""

    def __init__(self, clock):
        super().__init__()
        self.clock, self.times = clock, []

    def write(self, text):
        self.times.extend([self.clock()] * text.count("\n"))
        return super().write(text)


def test_piped_2000_round_run_prints_a_few_dozen_lines():
    """eval_every=1 over 2000 rounds in 30 s (the issue's run): a line per 10 s, plus the last."""
    clock = FakeClock()
    stream = TimedStream(clock)
    with logs.Progress(2000, description="run", stream=stream, clock=clock) as bar:
        for t in range(1, 2001):
            clock.now += 0.015
            bar.advance(1, postfix={"round": t, "loss": 1.0 / t})
    lines = stream.getvalue().splitlines()
    assert 2 <= len(lines) <= 6
    assert lines[0].startswith("run: 1/2000 rounds")  # the first step at once
    assert lines[-1].startswith("run: 2000/2000 rounds (100%) | loss=0.0005 |")
    gaps = np.diff(stream.times[:-1])  # the last line comes when the work ends
    assert np.all(gaps >= 10.0 - 1e-9)
    assert not any("round=" in line for line in lines)  # the count already says it


def test_progress_every_default_is_a_module_setting(monkeypatch):
    monkeypatch.setattr(logs, "_PROGRESS_EVERY", logs.progress_every())
    logs.set_progress_every(2.5)
    assert logs.progress_every() == 2.5
    clock, stream = FakeClock(), stdio.StringIO()
    bar = logs.Progress(100, description="run", stream=stream, clock=clock)
    assert bar.every_seconds == 2.5
    for _ in range(10):  # one step a second: lines at 1 s, 4 s, 7 s, 10 s (the last)
        clock.now += 1.0
        bar.advance(10)
    assert [line.split(" ")[1] for line in stream.getvalue().splitlines()] == [
        "10/100", "40/100", "70/100", "100/100"]
    logs.set_progress_every(0)
    assert logs.Progress(1, description="x").every_seconds == 0
    for bad in (-1, math.nan, math.inf, "soon", True):
        with pytest.raises(ValueError, match="progress_every"):
            logs.set_progress_every(bad)


def test_a_stopped_run_prints_its_newest_throttled_line_on_close():
    clock, stream = FakeClock(), stdio.StringIO()
    with pytest.raises(RuntimeError):
        with logs.Progress(100, description="run", stream=stream, clock=clock) as bar:
            clock.now += 1.0
            bar.advance(10)
            clock.now += 1.0
            bar.advance(10, postfix={"loss": 0.5})
            raise RuntimeError("diverged")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and lines[1].startswith("run: 20/100 rounds (20%) | loss=0.5 |")


def _postfix_line(postfix, summary=None):
    stream = stdio.StringIO()
    bar = logs.Progress(10, description="run", stream=stream, clock=FakeClock(),
                        summary=summary)
    bar.advance(1, postfix=postfix)
    return stream.getvalue()


def test_per_seed_postfix_shows_the_finite_mean_over_seeds_not_a_bare_round():
    row = {"round": 50, "test_loss": np.array([0.1, 0.3, np.nan]),
           "accuracy": np.array([0.5, 0.7, 0.9], np.float32),
           "placeholder": np.full(3, np.nan), "lr": 0.1}
    line = _postfix_line(row, logs.mean_of_copies("seeds"))
    assert "| test_loss=0.2 accuracy=0.7 placeholder=nan lr=0.1 (mean of 3 seeds) |" in line
    assert "round=" not in line
    default = _postfix_line({"round": 1, "loss": np.array([1.0, 2.0])})
    assert "| loss=1.5 (mean of 2 copies) |" in default


def test_restart_postfix_shows_the_best_restart_of_each_seed():
    train = np.array([[0.3, 0.1, np.nan],   # seed 0: restart 1 is best
                      [0.2, 0.4, 0.5]])     # seed 1: restart 0 is best
    test = np.array([[3.0, 1.0, 9.0],
                     [2.0, 4.0, 5.0]])
    row = {"round": 7, "train_loss": train, "test_loss": test, "lr": np.float32(0.5),
           "eval_only": np.array([10.0, 20.0])}  # another shape: the mean
    line = _postfix_line(row, logs.best_copy("train_loss"))
    # seed means of the best restarts: train (0.1 + 0.2) / 2, test (1 + 2) / 2
    assert ("| train_loss=0.15 test_loss=1.5 lr=0.5 eval_only=15 "
            "(best of 3 restarts by train_loss, mean of 2 seeds) |") in line
    one_seed = _postfix_line({"train_loss": train[1], "test_loss": test[1]},
                             logs.best_copy("train_loss"))
    assert "| train_loss=0.2 test_loss=2 (best of 3 restarts by train_loss) |" in one_seed
    # Round 0: no finite ranking yet, so the plain mean.
    unranked = _postfix_line({"train_loss": np.full(3, np.nan), "test_loss": test[1]},
                             logs.best_copy("train_loss"))
    assert "| train_loss=nan test_loss=3.667 (mean of 3 restarts) |" in unranked


def test_tensorboard_log_writes_nan_rows_without_a_warning(tmp_path, capfd, caplog):
    pytest.importorskip("tensorboardX")
    # tensorboardX warns through `logging` (stderr outside pytest, captured by caplog here).
    caplog.set_level("WARNING")
    with logs.TensorBoardLog(tmp_path / "tb") as tb:
        for step in range(20):  # the round-0 placeholders of a run's round metrics
            tb.write(step, {"train_loss_round": math.nan, "inf": math.inf,
                            "loss": 1.0 / (step + 1)})
    captured = capfd.readouterr()
    assert "NaN or Inf" not in captured.err + captured.out
    assert captured.err == ""
    assert not [r for r in caplog.records if r.levelno >= 30]
    assert any((tmp_path / "tb").iterdir())


def test_write_bands_gives_one_run_folder_per_method_with_mean_and_bounds(tmp_path, caplog):
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")

    def read_events(path):  # TFRecords: [u64 length][u32 crc][data][u32 crc] each
        data, events, at = path.read_bytes(), [], 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
            at += 12 + length + 4
        return events

    caplog.set_level("WARNING")
    bands = {"loss": {"a": {"round": [0, 5], "mean": [2.0, 1.0], "lo": [math.nan, 0.5],
                            "hi": [math.nan, 1.5]},
                      "b": {"round": [0, 5], "mean": [3.0, 2.5], "lo": [2.0, 2.0],
                            "hi": [4.0, 3.0]}},
             "acc": {"a": {"round": [5], "mean": [0.9], "lo": [0.8], "hi": [1.0]}}}
    written = logs.write_bands(tmp_path / "tb", bands)
    assert [p.name for p in written] == ["a", "b"]
    scalars = {}
    for folder in written:
        (events,) = folder.iterdir()
        for event in read_events(events):
            for value in event.summary.value:
                scalars[(folder.name, value.tag, event.step)] = value.simple_value
    assert scalars == pytest.approx({
        ("a", "loss/mean", 0): 2.0, ("a", "loss/mean", 5): 1.0, ("a", "loss/lo", 5): 0.5,
        ("a", "loss/hi", 5): 1.5, ("a", "acc/mean", 5): 0.9, ("a", "acc/lo", 5): 0.8,
        ("a", "acc/hi", 5): 1.0,
        ("b", "loss/mean", 0): 3.0, ("b", "loss/lo", 0): 2.0, ("b", "loss/hi", 0): 4.0,
        ("b", "loss/mean", 5): 2.5, ("b", "loss/lo", 5): 2.0, ("b", "loss/hi", 5): 3.0})
    assert not [r for r in caplog.records if r.levelno >= 30]
