"""benchmarks/standard_workloads.py: its FLOP count, and its dry run (slow: a tiny round of
the fedavg-cifar10-pfl preset, and pfl-research's PyTorch path where its venv exists)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import standard_workloads  # noqa: E402


def test_flops_count_every_layer_of_simple_cnn():
    s = {"local_epochs": 1, "datapoints_per_user": 50, "cohort_size": 50, "test_images": 10_000}
    f = standard_workloads.flops(s)
    macs = {"conv1": 30 * 30 * 32 * 27, "conv2": 28 * 28 * 64 * 288, "dense": 12544 * 128,
            "out": 128 * 10}
    forward = sum(macs.values())
    assert f["forward_flops_per_image"] == 2 * forward == 33_670_400
    # forward, weight gradients, input gradients of every layer but the first
    assert f["train_flops_per_image"] == 2 * (3 * forward - macs["conv1"])
    assert f["round_flops"] == 50 * 50 * f["train_flops_per_image"]
    assert f["eval_flops"] == 10_000 * 2 * forward


def _strict(text: str):
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.slow
def test_dry_run_writes_both_systems_as_strict_json(tmp_path):
    out = tmp_path / "sw.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "standard_workloads.py"),
                           "--dry-run", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = _strict(out.read_text())
    meta = payload["meta"]
    assert meta["cpu_model"] and meta["dry_run"] is True and meta["threads"] >= 1
    if (REPO / ".git").exists():
        assert meta["git_head"]
    ours = payload["fedjax_sim"]
    assert ours["parameters"] == 1_626_442 and ours["users"] == payload["workload"]["users"]
    assert ours["round_s"] > 0 and ours["eval_s"] > 0 and ours["compile_s"] > 0
    assert ours["matmul_peak"]["matmul_peak_GFLOPs"] > 0
    assert 0.0 <= ours["test_accuracy_after"] <= 1.0
    pfl = payload["pfl"]
    if "skipped" in pfl:  # no venv here: a dry run does not create it
        assert "venv" in pfl["skipped"]
    else:  # pfl's own model has the same parameters
        assert pfl["parameters"] == 1_626_442 and pfl["round_s"] > 0
        assert payload["ratio_pfl_over_fedjax_sim"]["round"] > 0
