"""IFCA's communication reduction as a preset setting (`stable_rounds`): once a client's
assignment has been stable that many rounds it downloads its own model only, d floats
instead of k·d, which the round metric `downlink_floats` counts."""

from __future__ import annotations

import csv

from fedjax_sim import cli


def _last_rows(out):
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    last = rows[-1]["round"]
    return [r for r in rows if r["round"] == last]


def test_stable_rounds_cut_the_downlink_of_pinned_clients(tmp_path):
    settings = ["rounds=12", "eval_every=12", "k=2", "m=8", "n=20", "d=5", "R=2.0",
                "restarts=1"]
    runs = {}
    for name, extra in (("off", []), ("on", ["stable_rounds=2"])):
        out = tmp_path / name
        code = cli.main(["run", "ifca-synthetic-tiny", "--set", *settings, *extra,
                         "--out", str(out), "--no-progress"])
        assert code == 0
        runs[name] = _last_rows(out)
    d, k, m = 5, 2, 8
    (off,), (on,) = runs["off"], runs["on"]
    assert float(off["downlink_floats"]) == m * k * d  # every client gets every model
    pinned = float(on["frozen_clients"])
    assert pinned > 0
    # d floats to each pinned client, k·d to the others.
    assert float(on["downlink_floats"]) == pinned * d + (m - pinned) * k * d
