"""The device suite (benchmarks/suite.py): its dry run, its budget, its Table 1 reading.

The dry run is the one slow test, in the exhaustive tier (every section at a tiny size, in
subprocesses, about a minute on 2 CPU cores; `--run-exhaustive`); the budget and signal
logic run on fake sections that do no work.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import suite  # noqa: E402

PROBES = ("stream_GBps", "matmul_f32_GFLOPs", "matmul_f32_highest_GFLOPs", "matmul_bf16_GFLOPs")


def _strict(text: str):
    """json.loads that refuses NaN / Infinity tokens."""
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_dry_run_writes_every_section_as_strict_json(tmp_path):
    out = tmp_path / "DRY.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "suite.py"), "--dry-run", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    payload = _strict(out.read_text())
    assert payload["dry_run"] is True
    names = [s["name"] for s in payload["sections"]]
    assert names == [s.name for s in suite.SECTIONS]
    meta = payload["meta"]
    assert meta["cpu_model"] and meta["device"] and meta["backend"]
    if (REPO / ".git").exists():
        assert meta["git_head"]
    for key in PROBES:
        assert meta["probes"][key] > 0, key
    for section in payload["sections"]:
        assert section["status"] == "ok", (section["name"], section.get("reason"),
                                           section.get("stderr_tail"))
        assert section["probes"] == meta["probes"], section["name"]
        assert section["seconds"] > 0
        assert all(p["status"] in ("ok", "skipped") for p in section["parts"]), section["name"]
    by_name = {s["name"]: s for s in payload["sections"]}
    rows = [p for p in by_name["ifca_rows"]["parts"] if p["status"] == "ok"]
    assert rows and all(p["fraction_of_stream"] > 0 and p.get("verified_equal") is not False
                        for p in rows)
    table1 = by_name["table1"]["parts"][0]
    assert 0 <= table1["accuracy"]["ifca"]["ours_pct"] <= 100
    assert table1["accuracy"]["ifca"]["paper_pct"] == 95.25  # n = 200, the paper's IFCA
    assert by_name["sweep_grids"]["parts"][0]["cells"] == 1
    assert by_name["max_clients"]["parts"][0]["summary"][0]["largest_m_run"] == 1000
    # Two processes, the compilation cache off: the same bytes on a CPU (test_resume
    # relies on it too); the device run says whether that holds there.
    (pair,) = by_name["determinism"]["parts"]
    assert pair["part"] == "default" and pair["identical"] is True and pair["rows"] > 0
    markdown = out.with_suffix(".md").read_text()
    for name in names:
        assert f"| {name} | ok |" in markdown


def test_csv_differences_names_the_cells_and_the_largest_difference(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("round,loss,acc\n0,1.5,0.25\n1,1.25,0.5\n")
    b.write_text("round,loss,acc\n0,1.5,0.25\n1,1.2500003,0.5\n")
    assert suite.csv_differences(a, a) == {"identical": True, "rows": 2, "differing_cells": 0,
                                           "max_abs_difference": 0.0}
    found = suite.csv_differences(a, b)
    assert found["identical"] is False and found["differing_cells"] == 1
    assert found["max_abs_difference"] == pytest.approx(3e-7, rel=1e-3)
    assert suite.csv_differences(a, tmp_path / "none.csv")["missing"] == [
        str(tmp_path / "none.csv")]


def _fake(name, least, run=None):
    return suite.Section(name, name, "launcher", run or (lambda ctx: {"figures": {}}),
                         min_s=least, cap_s=100, dry_min_s=least, dry_cap_s=100)


def test_budget_skips_what_does_not_fit_and_keeps_the_later_sections_minimum():
    sections = (_fake("a", 1), _fake("b", 3), _fake("c", 50), _fake("d", 2))
    allowed, recorded = {}, []

    def execute(section, seconds):
        allowed[section.name] = seconds
        return {"status": "ok", "parts": [], "figures": {"ran": section.name}}

    entries, stopped = suite.schedule(
        sections, budget_s=suite.WRITE_RESERVE_S + 10, dry=True, started=time.time(),
        execute=execute, record=lambda e: recorded.append([x["name"] for x in e]))
    assert stopped is None
    assert [e["status"] for e in entries] == ["ok", "ok", "skipped", "ok"]
    assert "needs ≥ 50 s" in entries[2]["reason"]
    # a may not eat the minimum of b and d, b not d's (c can never fit: nothing is kept for
    # it); the fake sections take no time, so d, the last, gets what is left.
    assert allowed["a"] == pytest.approx(10 - 3 - 2, abs=0.5)
    assert allowed["b"] == pytest.approx(10 - 2, abs=0.5)
    assert allowed["d"] == pytest.approx(10, abs=0.5)
    assert recorded == [["a"], ["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]]

    entries, _ = suite.schedule(sections, budget_s=1.0, dry=True, started=time.time(),
                                execute=execute, record=lambda e: None, selected={"a", "b"})
    assert [e["status"] for e in entries] == ["skipped"] * 4
    assert entries[2]["reason"] == "not selected (--sections)"
    assert "left of the 1 s budget" in entries[0]["reason"]


def test_sigterm_stops_the_section_in_flight_and_skips_the_rest():
    def execute(section, seconds):
        if section.name == "b":
            err = suite.Stopped("SIGTERM")
            err.parts = [{"part": "half", "status": "ok"}]
            raise err
        return {"status": "ok", "parts": [], "figures": {}}

    sections = (_fake("a", 1), _fake("b", 1), _fake("c", 1))
    entries, stopped = suite.schedule(sections, budget_s=60, dry=True, started=time.time(),
                                      execute=execute, record=lambda e: None)
    assert stopped == "SIGTERM"
    assert [e["status"] for e in entries] == ["ok", "timeout", "skipped"]
    assert entries[1]["parts"] == [{"part": "half", "status": "ok"}]
    assert entries[2]["reason"] == "the suite was stopped (SIGTERM)"


def test_a_launcher_that_raises_is_failed_with_what_it_finished():
    def run(ctx):
        ctx.emit({"part": "first", "status": "ok"})
        raise RuntimeError("boom")

    ctx = suite.Context(dry=True, stop_at=time.time() + 60, probes=None, root=REPO,
                        artifacts=REPO, backend="cpu")
    entry = suite.run_launcher(_fake("x", 1, run), ctx, 10.0)
    assert entry["status"] == "failed" and "boom" in entry["reason"]
    assert entry["parts"] == [{"part": "first", "status": "ok"}]


def test_a_tiny_budget_writes_valid_json_and_markdown_without_running_anything(
        tmp_path, monkeypatch):
    # main() sets these for its children; monkeypatch restores them afterwards.
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    out = tmp_path / "tiny.json"
    assert suite.main(["--dry-run", "--budget", "2", "--out", str(out)]) == 0
    payload = _strict(out.read_text())
    assert [s["status"] for s in payload["sections"]] == ["skipped"] * len(suite.SECTIONS)
    assert payload["meta"]["cpu_model"] and "probes" in payload["meta"]
    assert "| ceilings | skipped |" in out.with_suffix(".md").read_text()


def test_table1_reads_a_comparison_beside_the_paper(tmp_path):
    # The committed 5-seed n = 50 comparison (docs/protocols.md#ifca-rotated-mnist).
    table = suite.table1_accuracies(BENCHMARKS / "results" / "ifca_rotated_mnist_n50_5seeds", 50)
    assert list(table) == ["ifca", "fedavg", "local", "oneshot", "ifca_ws"]
    assert table["ifca"]["ours_pct"] == pytest.approx(92.50, abs=1e-3)
    assert table["ifca"]["ours_std_pct"] == pytest.approx(0.1879, abs=1e-3)
    assert (table["ifca"]["paper_pct"], table["ifca"]["paper_std_pct"]) == (94.20, 0.03)
    assert table["fedavg"]["paper_pct"] == 86.74 and table["local"]["paper_pct"] == 63.32
    assert table["oneshot"]["paper_pct"] is None
    assert table["ifca"]["cluster_accuracy"] == 1.0
    # One seed: no spread (NaN in the CSV).
    (tmp_path / "results.csv").write_text(
        "method,test_accuracy_mean,test_accuracy_std,cluster_accuracy_mean\n"
        "ifca,0.92675,nan,1.0\n")
    one = suite.table1_accuracies(tmp_path, 50)
    assert one["ifca"]["ours_pct"] == pytest.approx(92.675) and one["ifca"]["ours_std_pct"] is None
