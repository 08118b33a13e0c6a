"""What the memory plan may change: a run's, sweep's or comparison's numbers, and resumes.

The plan (`memory_budget_gb` and this machine's memory: how many clients a round
processes at once, how many trials share one compiled sweep program) changes
numbers in their last bits where clients' contributions are summed (a chunked
round adds the chunks' partial sums) and where XLA compiles a sweep program of
another width differently. Per-client computations (evaluation, local training)
do not depend on it. So: the same settings under budgets that plan the same give
the same bytes, a per-client path gives them under any plan, and a resume keeps
the plan it started with (config.json's "plan", the checkpoints' too) or is
refused in one line, writing nothing.

Tiny shapes, in process (no subprocess) but for the one real kill (about 10 s).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedjax_sim import cli

ROOT = Path(__file__).resolve().parents[1]
SYN = ["k=2", "m=8", "n=10", "d=5", "rounds=4", "eval_every=2", "restarts=2", "n_test=5"]
# Two cells that differ only in a traced setting (lr): one vmapped program of both per
# seed where the budget holds two (cell, seed) pairs of FedAvg (~1.03e-5 GiB each), one
# pair at a time below that.
SWEEP = [*SYN, "algorithm=fedavg", "seeds=3", "lr=0.05,0.1"]
TWO_PAIRS, TWO_PAIRS_TOO, ONE_PAIR = "1.0", "0.001", "1.5e-5"
# The success protocol at d < 64 (its gradient is a multiply-and-reduce loop there).
SUCCESS = ["k=2", "m=8", "n=5", "d=5", "rounds=5", "restarts=2", "R=1.0,0.5", "sigma=0.1",
           "lr=0.1,0.5", "seeds=6"]


def _snapshot(root: Path) -> dict:
    """Every file under root: path -> bytes."""
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main([*args, "--no-progress"])
    return code, capsys.readouterr().err


def _config(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())


def _refused(code: int, err: str, out: Path, there: str, now: str) -> None:
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"cannot resume {out}: " in err
    # `now` may be a pattern: a client chunk under a tiny budget depends on the machine
    # (a 2-core Intel Xeon plans 3 clients at a time where a 2-core AMD EPYC planned 2).
    said = re.search(f"plans {now.pattern} where the", err) if isinstance(now, re.Pattern) \
        else f"plans {now} where the" in err
    assert said and f"started with {there}" in err, err
    assert "a resume may change memory_budget_gb only to a value that keeps the plan" in err


def _sweep(capsys, out: Path, budget: str, *more: str) -> None:
    code, err = _cli(capsys, "sweep", "ifca-synthetic", "--set", *SWEEP,
                     f"memory_budget_gb={budget}", "--out", str(out), *more)
    assert code == 0, err


def _trials_per_program(out: Path) -> list[int]:
    return list(_config(out)["plan"]["trials_per_program"].values())


def test_a_sweep_under_budgets_that_plan_the_same_is_byte_equal_and_resumes_across_them(
        tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    _sweep(capsys, a, TWO_PAIRS)
    _sweep(capsys, b, TWO_PAIRS_TOO)
    assert _trials_per_program(a) == _trials_per_program(b) == [2]
    for name in ("trials.csv", "summary.csv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()

    # A sweep stopped after its first seed's rows (and half a row: a kill mid-write),
    # resumed under the other budget: the uninterrupted sweep's files.
    killed = tmp_path / "killed"
    shutil.copytree(a, killed)
    for path in killed.iterdir():
        if path.name not in ("config.json", "trials.csv"):
            path.unlink()
    lines = (a / "trials.csv").read_text().splitlines(keepends=True)
    (killed / "trials.csv").write_text("".join(lines[:3]) + lines[3][:10])
    code, err = _cli(capsys, "sweep", "--resume", "--out", str(killed), "--set",
                     f"memory_budget_gb={TWO_PAIRS_TOO}")
    assert code == 0, err
    for name in ("trials.csv", "summary.csv"):
        assert (killed / name).read_bytes() == (a / name).read_bytes()

    # Under a budget of one pair per program the remaining seeds would be computed by
    # another program: refused, nothing written.
    (killed / "trials.csv").write_text("".join(lines[:3]))
    before = _snapshot(killed)
    code, err = _cli(capsys, "sweep", "--resume", "--out", str(killed), "--set",
                     f"memory_budget_gb={ONE_PAIR}")
    _refused(code, err, killed, "2 trials per compiled program",
             "1 trial per compiled program")
    assert f"memory_budget_gb={float(ONE_PAIR)} (config.json: {float(TWO_PAIRS_TOO)})" in err
    assert f"resume with memory_budget_gb={float(TWO_PAIRS_TOO)}" in err
    assert _snapshot(killed) == before


def test_a_finished_sweep_resumes_under_any_budget(tmp_path, capsys):
    out = tmp_path / "done"
    _sweep(capsys, out, TWO_PAIRS)
    trials = (out / "trials.csv").read_bytes()
    code, err = _cli(capsys, "sweep", "--resume", "--out", str(out), "--set",
                     f"memory_budget_gb={ONE_PAIR}")
    assert code == 0, err  # no trial is left to plan
    assert (out / "trials.csv").read_bytes() == trials
    assert _trials_per_program(out) == [2]  # as the trials ran


def test_the_success_sweep_at_small_d_gives_the_same_bytes_at_any_seeds_per_program(
        tmp_path, capsys):
    """Its trials do not depend on how many seeds share a program at d < 64 (measured; at
    d >= 64 they do, so a resume keeps the plan either way)."""
    outs = []
    for budget in ("1.0", "8e-6"):  # 6 seeds per program, and 1
        out = tmp_path / budget
        code, err = _cli(capsys, "sweep", "ifca-success-small", "--set", *SUCCESS,
                         f"memory_budget_gb={budget}", "--out", str(out))
        assert code == 0, err
        outs.append(out)
    assert [_trials_per_program(o) for o in outs] == [[6, 6], [1, 1]]
    for name in ("trials.csv", "summary.csv"):
        assert (outs[1] / name).read_bytes() == (outs[0] / name).read_bytes()


def _run(capsys, out: Path, preset: str, budget: str, *more: str) -> dict:
    code, err = _cli(capsys, "run", preset, "--set", *SYN, f"memory_budget_gb={budget}", *more,
                     "--out", str(out))
    assert code == 0, err
    return json.loads((out / "summary.json").read_text())


def test_a_run_of_per_client_models_gives_the_same_bytes_at_any_client_chunk(tmp_path, capsys):
    whole = _run(capsys, tmp_path / "whole", "local-synthetic", "0", "checkpoint_every=0")
    chunked = _run(capsys, tmp_path / "chunked", "local-synthetic", "5.5e-6",
                   "checkpoint_every=0")
    assert whole["client_chunk"] is None and 1 < chunked["client_chunk"] < 8
    assert _config(tmp_path / "chunked")["plan"] == {"client_chunk": chunked["client_chunk"]}
    assert ((tmp_path / "whole" / "metrics.csv").read_bytes()
            == (tmp_path / "chunked" / "metrics.csv").read_bytes())


def test_a_run_resumes_under_its_plan_only(tmp_path, capsys):
    out = tmp_path / "run"
    _run(capsys, out, "ifca-synthetic", "0", "checkpoint_every=2")
    assert _config(out)["plan"] == {"client_chunk": None}
    before = _snapshot(out)
    code, err = _cli(capsys, "run", "--resume", "--out", str(out), "--set",
                     "memory_budget_gb=4.5e-6")
    _refused(code, err, out, "all clients at once", re.compile(r"\d+ clients at a time"))
    assert "memory_budget_gb=4.5e-06 (config.json: 0.0)" in err
    assert _snapshot(out) == before
    # A budget that still holds every client at once plans the same.
    code, err = _cli(capsys, "run", "--resume", "--out", str(out), "--set",
                     "memory_budget_gb=0.01")
    assert code == 0, err
    assert (out / "metrics.csv").read_bytes() == before["metrics.csv"]


def _compare(capsys, out: Path, budget: str) -> None:
    code, err = _cli(capsys, "compare", "ifca-synthetic", "--set", *SYN, "seeds=2",
                     "methods=fedavg,local", "checkpoint_every=2",
                     f"memory_budget_gb={budget}", "--out", str(out))
    assert code == 0, err


def _method_rows(path: Path, method: str) -> list[dict]:
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row["method"] == method]


def test_a_comparison_resumes_under_its_plan_only(tmp_path, capsys):
    whole, chunked = tmp_path / "whole", tmp_path / "chunked"
    _compare(capsys, whole, "0")
    _compare(capsys, chunked, "8.5e-6")
    assert _config(whole)["plan"] == {"fedavg": {"client_chunk": None},
                                      "local": {"client_chunk": None}}
    chunks = {m: p["client_chunk"] for m, p in _config(chunked)["plan"].items()}
    assert list(chunks) == ["fedavg", "local"] and all(1 < c < 8 for c in chunks.values())
    # Local models are trained and evaluated client by client: the same bytes in every
    # chunking (FedAvg's average adds the chunks' partial sums: its last bits may move).
    for name in ("per_seed.csv", "per_seed_metrics.csv", "metrics.csv"):
        assert (_method_rows(whole / name, "local")
                == _method_rows(chunked / name, "local")), name

    # Stopped before its last method finished (a kill leaves no results.csv).
    killed = tmp_path / "killed"
    shutil.copytree(whole, killed)
    for path in killed.iterdir():
        if path.name not in ("config.json", "methods"):
            (shutil.rmtree if path.is_dir() else Path.unlink)(path)
    (killed / "methods" / "local.json").unlink()
    before = _snapshot(killed)
    code, err = _cli(capsys, "compare", "--resume", "--out", str(killed), "--set",
                     "memory_budget_gb=8.5e-6")
    _refused(code, err, killed, "all clients at once", f"{chunks['local']} clients at a time")
    assert "method local: memory_budget_gb=8.5e-06 (config.json: 0.0)" in err
    assert _snapshot(killed) == before
    code, err = _cli(capsys, "compare", "--resume", "--out", str(killed), "--set",
                     "memory_budget_gb=0.01")
    assert code == 0, err
    for name in ("results.csv", "per_seed.csv", "per_seed_metrics.csv", "metrics.csv"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes(), name


def test_a_killed_sweep_resumed_under_another_budget_equals_the_uninterrupted_one(tmp_path):
    """SIGKILL a sweep once it has written rows, resume it under another budget that plans
    the same: the trials.csv and summary.csv of a sweep never stopped."""
    sets = [*SWEEP[:-2], "seeds=400", "lr=0.05,0.1"]
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedjax_sim.cli", "sweep", "ifca-synthetic", "--set", *sets,
         f"memory_budget_gb={TWO_PAIRS}", "--out", str(killed), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    trials = killed / "trials.csv"
    try:
        deadline = time.monotonic() + 240
        while not trials.exists() or len(trials.read_text().splitlines()) < 5:
            if proc.poll() is not None:
                pytest.fail(f"the sweep ended (code {proc.returncode}) before the kill:\n"
                            f"{proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("no trials.csv rows within 240 s")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.stdout.close()
    assert not (killed / "summary.csv").exists(), "the kill landed after the sweep had finished"
    assert cli.main(["sweep", "--resume", "--out", str(killed), "--no-progress", "--set",
                     f"memory_budget_gb={TWO_PAIRS_TOO}"]) == 0
    assert cli.main(["sweep", "ifca-synthetic", "--set", *sets,
                     f"memory_budget_gb={TWO_PAIRS_TOO}", "--out", str(whole),
                     "--no-progress"]) == 0
    for name in ("trials.csv", "summary.csv"):
        assert (killed / name).read_bytes() == (whole / name).read_bytes()
