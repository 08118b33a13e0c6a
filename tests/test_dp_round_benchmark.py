"""benchmarks/dp_round.py's dry run (slow: tiny rounds of each pair, about a minute on 2 CPU
cores): every pair timed, the ratios what the times say, strict JSON with the CPU model and
the git HEAD."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_dry_run_times_every_pair_as_strict_json(tmp_path):
    out = tmp_path / "dp.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dp_round.py"), "--dry-run",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = _strict(out.read_text())
    meta = payload["meta"]
    assert meta["cpu_model"] and meta["dry_run"] is True
    assert meta["stream_GBps"] == max(meta["stream_GBps_start"], meta["stream_GBps_end"]) > 0
    if (REPO / ".git").exists():
        assert meta["git_head"]
    rows = payload["rows"]
    assert [row["kind"] for row in rows] == [
        "ifca_synthetic", "fedavg_mlp_digits", "fedavg_gin_esol", "dp_fedavg_generated",
        "dp_fedavg_generated"]
    assert rows[2]["skipped"] == "dry run"  # its GIN compiles for ~10 s: the full run has it
    timed = [row for row in rows if "skipped" not in row]
    for row in timed:
        assert row["plain_s_per_round"] > 0 and row["dp_s_per_round"] > 0, row["kind"]
        assert row["dp_over_plain"] == pytest.approx(row["dp_s_per_round"]
                                                     / row["plain_s_per_round"])
        assert row["pair_ratio_q1"] <= row["pair_ratio_median"] <= row["pair_ratio_q3"]
        assert row["xla_flops_dp_over_plain"] > 1  # the clip and the noise add work
        assert row["plain_min_s"] <= row["plain_s_per_round"]
        assert row["compile_s"]["plain"] > 0 and row["compile_s"]["dp"] > 0
        assert row["pairs"] >= 1
        agg = row["aggregation_alone"]
        assert agg["plain_s"] > 0 and agg["dp_s"] > 0
        assert agg["extra_s"] == pytest.approx(agg["dp_s"] - agg["plain_s"])
    ifca = rows[0]
    assert (ifca["m"], ifca["n"], ifca["d"], ifca["k"]) == (8, 5, 6, 2)
    assert ifca["aggregation_alone"]["clusters"] == 2
    assert ifca["round_bytes"] == 3 * 8 * 5 * 6 * 4 + 8 * 5 * 4  # τ = 1: 3 passes over X
    assert ifca["plain_fraction_of_stream"] > 0
    assert rows[1]["aggregation_alone"]["parameters"] == 64 * 32 + 32 + 32 * 10 + 10
    cohorts = rows[3:]
    assert [row["cohort"] for row in cohorts] == [10, 100]
    for row in cohorts:
        assert row["population"] == 2000 and row["cohort_draw_s"] > 0
        assert row["dp_rounds_per_s"] == pytest.approx(1 / row["dp_s_per_round"])
        assert row["dp_fraction_of_stream"] > 0
