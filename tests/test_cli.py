"""The `fedjax-sim` command end to end, and its refusal of bad input."""

from __future__ import annotations

import csv
import errno
import json
import math
import os
import re
import shutil

import pytest

from fedjax_sim import cli, experiments, stats
from fedjax_sim.experiments import ifca_success, ifca_synthetic


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_list_names_presets_and_algorithms(capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name, preset in experiments.PRESETS.items():
        (line,) = [line for line in lines if line.split()[:1] == [name]]
        # Each preset with the commands it supports, then its description.
        assert line.split()[1] == "/".join(preset.commands), line
        assert line.endswith(preset.description)
    for name in ("ifca", "fedavg", "local", "oneshot"):
        assert f"  {name} " in out


def test_run_writes_a_complete_run_directory(tmp_path):
    out = tmp_path / "run"
    code = cli.main(
        ["run", "ifca-synthetic-tiny", "--set", "rounds=20", "eval_every=5", "--out", str(out),
         "--no-progress"]
    )
    assert code == 0
    assert {p.name for p in out.iterdir()} == {
        "config.json", "metrics.csv", "summary.json", "metrics.png"
    }
    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == "ifca-synthetic-tiny"
    assert config["settings"]["rounds"] == 20
    assert config["settings"]["k"] == 2 and config["seed"] == 0
    assert config["fedjax_sim_version"]
    rows = _rows(out / "metrics.csv")
    restarts = config["settings"]["restarts"]
    # One row per (round, restart).
    assert [(int(r["round"]), int(r["restart"])) for r in rows] == [
        (t, i) for t in (0, 5, 10, 15, 20) for i in range(restarts)]
    for column in ("train_loss", "test_loss", "cluster_accuracy", "min_dist"):
        assert all(math.isfinite(float(r[column])) for r in rows), column
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["round"] == 20
    assert len(summary["restarts_final_min_dist"]) == restarts
    # The reported restart is the one of lowest final train loss.
    final = {int(r["restart"]): r for r in rows if int(r["round"]) == 20}
    best = min(final, key=lambda i: float(final[i]["train_loss"]))
    assert summary["best_restart"] == best
    assert summary["final"]["restart"] == best
    assert summary["final"]["train_loss"] == float(final[best]["train_loss"])
    assert summary["restarts_final_train_loss"] == [
        float(final[i]["train_loss"]) for i in range(restarts)]
    assert summary["rounds_run"] == 20
    assert summary["compile_seconds"] >= 0
    assert summary["rounds_per_second"] is None or summary["rounds_per_second"] > 0
    first = {int(r["restart"]): r for r in rows if int(r["round"]) == 0}
    assert float(final[best]["train_loss"]) < float(first[best]["train_loss"])
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_is_deterministic(tmp_path):
    # eval_every=5: the chunk program of the other tiny runs here (compiled once).
    args = ["run", "ifca-synthetic-tiny", "--set", "rounds=10", "eval_every=5", "--no-progress",
            "--out"]
    assert cli.main([*args, str(tmp_path / "a")]) == 0
    assert cli.main([*args, str(tmp_path / "b")]) == 0
    assert (tmp_path / "a" / "metrics.csv").read_text() == (
        tmp_path / "b" / "metrics.csv"
    ).read_text()


@pytest.mark.parametrize(
    ("command", "overrides", "message"),
    [
        ("run", ["k=0"], "setting k must be an integer in [1, 1024]; got 0"),
        ("run", ["k=3"], "m must be divisible by k"),
        ("run", ["lr=-0.1"], "lr must be a finite number >= 0"),
        ("run", ["lr=nan"], "lr must be a finite number >= 0"),
        ("run", ["banana=1"], "unknown setting 'banana'"),
        ("run", ["m=10.5"], "setting m: cannot read"),
        ("run", ["R=0.1,0.2"], "setting R takes one value here"),
        ("run", ["rounds=0"], "setting rounds must be an integer in [1, 1e+07]; got 0"),
        ("run", ["memory_budget_gb=0.00000001"], "memory budget"),
        ("sweep", ["k=0"], "setting k must be an integer in [1, 1024]; got 0"),
        ("sweep", ["m=30"], "m must be divisible by k"),
        ("sweep", ["lr=0.1,-1"], "lr must be a finite number >= 0"),
        ("sweep", ["colour=red"], "unknown setting 'colour'"),
    ],
)
def test_bad_settings_are_refused_and_nothing_is_written(
    tmp_path, capsys, command, overrides, message
):
    preset = "ifca-synthetic-tiny" if command == "run" else "ifca-success-small"
    out = tmp_path / "out"
    code = cli.main([command, preset, "--set", *overrides, "--out", str(out), "--no-progress"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_unknown_preset_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["run", "no-such-preset", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown preset for run 'no-such-preset'" in err and "ifca-synthetic" in err
    assert not out.exists()
    # A success-sweep preset compares nothing: the line names it and the command to use.
    assert cli.main(["compare", "ifca-success-small", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == ("fedjax-sim: error: preset ifca-success-small is a sweep preset (commands: "
                   "run, sweep); it has no compare: use `fedjax-sim sweep ifca-success-small` "
                   "or `fedjax-sim run ifca-success-small` for one cell (--set each grid axis "
                   "to one value).\n")
    assert not out.exists()


def test_existing_run_directory_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["run", "ifca-synthetic-tiny", "--set", "rounds=5", "--out", str(out), "--no-progress"]
    assert cli.main(args) == 0
    before = (out / "metrics.csv").read_text()
    assert cli.main(args) == 2
    assert "already holds a run (config.json)" in capsys.readouterr().err
    assert (out / "metrics.csv").read_text() == before


# ----------------------------------------------------------------------------- helpers


def _snapshot(root):
    """Every file (path -> bytes) and directory under root: what "nothing changed" compares."""
    files, dirs = {}, set()
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            dirs.add(os.path.relpath(os.path.join(dirpath, d), root))
        for f in filenames:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                files[os.path.relpath(path, root)] = fh.read()
    return files, dirs


def _no_constant(token):
    raise AssertionError(f"non-standard JSON constant {token}")


def _assert_strict_files(out):
    """Every JSON file parses as strict JSON (no NaN/Infinity); no CSV has a "\\r\\n"."""
    jsons = sorted(out.rglob("*.json"))
    csvs = sorted(out.rglob("*.csv"))
    assert out / "config.json" in jsons
    assert csvs
    for path in jsons:
        json.loads(path.read_text(), parse_constant=_no_constant)
    for path in csvs:
        data = path.read_bytes()
        assert b"\r\n" not in data, path
        assert data.endswith(b"\n"), path


def _main(*args):
    return cli.main([*args, "--no-progress"])


def _set(settings):
    return [f"{k}={v}" for k, v in settings.items()]


RUN_TINY = {"k": 2, "m": 8, "n": 10, "d": 5, "rounds": 4, "eval_every": 2, "restarts": 2,
            "n_test": 5}
SWEEP_TINY = {"k": 2, "m": 8, "n": 5, "d": 5, "rounds": 5, "restarts": 2, "seeds": 2,
              "R": 1.0, "sigma": 0.1}
# The synthetic-IFCA presets share these tiny settings; other experiments test their own.
SYNTHETIC = {n: p for n, p in experiments.PRESETS.items()
             if p.experiment in (ifca_synthetic.EXPERIMENT, ifca_success.SUCCESS)}
RUN_PRESETS = [n for n, p in SYNTHETIC.items() if p.experiment is ifca_synthetic.EXPERIMENT]
SWEEP_ONLY_PRESETS = [n for n, p in SYNTHETIC.items() if p.experiment is ifca_success.SUCCESS]
COMPARE_PRESETS = [n for n, p in SYNTHETIC.items() if "compare" in p.commands]
SMALL_SWEEP = ["seeds=2", "R=0.4,0.8"]
SMALL_RUN = ["rounds=10", "seed=3", "eval_every=5"]


def _run_tiny(name):
    preset = experiments.PRESETS[name]
    declared = preset.experiment.declared
    settings = {k: v for k, v in RUN_TINY.items() if k in declared}
    if preset.defaults.get("algorithm") == "oneshot":  # read by one-shot clustering only
        settings["pretrain_steps"] = 2
    return settings


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixture-run") / "run"
    assert _main("run", "ifca-synthetic-tiny", "--set", *SMALL_RUN, "--out", str(out)) == 0
    return out


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixture-sweep") / "sweep"
    assert _main("sweep", "ifca-success-small", "--set", *SMALL_SWEEP, "--out", str(out)) == 0
    return out


# ----------------------------------------------------------------------------- registry


def test_every_preset_runs_or_sweeps():
    for name, preset in experiments.PRESETS.items():
        assert "run" in preset.commands, name  # no preset a user cannot run alone
    assert RUN_PRESETS and SWEEP_ONLY_PRESETS and COMPARE_PRESETS


@pytest.mark.parametrize("name", SWEEP_ONLY_PRESETS)
def test_every_success_preset_runs_one_cell(tmp_path, capsys, name):
    """A success-sweep preset's `run` trains one cell (its grid axes given one value each)."""
    out = tmp_path / "run"
    cell = {**{k: v for k, v in SWEEP_TINY.items() if k != "seeds"}, "lr": 0.1}
    assert _main("run", name, "--set", *_set(cell), "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lr"] == 0.1 and summary["rounds_run"] == 5
    assert summary["success"] == (summary["final"]["min_dist"] < summary["success_threshold"])
    # At the preset's defaults the grid's axes are lists: refused in one line naming the
    # preset, its axes and the sweep command.
    capsys.readouterr()
    assert _main("run", name, "--out", str(tmp_path / "grid")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"fedjax-sim: error: preset {name} is a sweep preset: its defaults give ")
    assert f"use `fedjax-sim sweep {name}`" in err
    axes = [k for k, v in experiments.PRESETS[name].defaults.items()
            if isinstance(v, list) and not experiments.PRESETS[name].experiment.declared[k]
            .listable]
    assert axes and all(f"{k}=" in err for k in axes)
    assert not (tmp_path / "grid").exists()


@pytest.mark.parametrize("name", list(experiments.PRESETS))
def test_describe_lists_every_setting(capsys, name):
    assert cli.main(["describe", name]) == 0
    out = capsys.readouterr().out
    preset = experiments.PRESETS[name]
    listed = {line.split()[0] for line in out.splitlines() if line.startswith("  ")}
    for setting in preset.experiment.declared.values():
        assert setting.name in listed, setting.name
        (line,) = [l for l in out.splitlines() if l.split()[:1] == [setting.name]]
        assert setting.help in line and setting.describe_range() in line
    assert "/".join(preset.commands).replace("/", ", ") in out


@pytest.mark.parametrize("name", RUN_PRESETS)
def test_every_run_preset_runs_tiny(tmp_path, name):
    out = tmp_path / "run"
    settings = _run_tiny(name)
    assert _main("run", name, "--set", *_set(settings), "--out", str(out)) == 0
    assert {"config.json", "metrics.csv", "summary.json", "metrics.png"} <= {
        p.name for p in out.iterdir()}
    rows = _rows(out / "metrics.csv")
    assert [(int(r["round"]), int(r["restart"])) for r in rows] == [
        (t, i) for t in (0, 2, 4) for i in range(2)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds_run"] == 4 and summary["diverged"] is False
    assert summary["algorithm"] == experiments.PRESETS[name].defaults["algorithm"]
    config = json.loads((out / "config.json").read_text())
    assert config["preset"] == name and config["command"] == "run"
    assert all(config["settings"][k] == v for k, v in settings.items())
    _assert_strict_files(out)


@pytest.mark.parametrize("name", SWEEP_ONLY_PRESETS)
def test_every_sweep_preset_sweeps_tiny(tmp_path, name):
    out = tmp_path / "sweep"
    assert _main("sweep", name, "--set", *_set(SWEEP_TINY), "--out", str(out)) == 0
    trials = _rows(out / "trials.csv")
    assert [int(r["data_seed"]) for r in trials] == [0, 1]
    assert len({r["cell_id"] for r in trials}) == 1
    (row,) = _rows(out / "summary.csv")
    assert int(row["seeds"]) == 2
    assert (int(row["k"]), int(row["m"]), float(row["R"]), float(row["sigma"])) == (2, 8, 1.0, 0.1)
    p = float(row["success_prob"])
    assert p == sum(int(r["success"]) for r in trials) / 2
    assert float(row["ci_low"]) <= p <= float(row["ci_high"])
    _assert_strict_files(out)


def _compare_groups(names):
    """Compare presets grouped by what their comparison computes: the experiment and the
    settings `compare` reads (at the tiny sizes). Presets that differ only in a setting
    compare does not read (e.g. `algorithm`, the method of a run) train the same comparison,
    so one of them runs it for all: {first name: [every name]}."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        preset = experiments.PRESETS[name]
        declared = preset.experiment.declared
        settings = experiments.resolve_settings(
            preset, _set({**_run_tiny(name), "seeds": 2}), "compare")
        read = tuple(sorted((k, repr(v)) for k, v in settings.items()
                            if declared[k].commands is None or "compare" in declared[k].commands))
        groups.setdefault((id(preset.experiment), read), []).append(name)
    return {group[0]: group for group in groups.values()}


COMPARE_GROUPS = _compare_groups(COMPARE_PRESETS)


@pytest.mark.parametrize("name", list(COMPARE_GROUPS),
                         ids=["+".join(g) for g in COMPARE_GROUPS.values()])
def test_every_compare_preset_compares_tiny(tmp_path, name):
    """Each group's first preset runs the comparison every preset of the group trains."""
    out = tmp_path / "compare"
    settings = {**_run_tiny(name), "seeds": 2}
    assert _main("compare", name, "--set", *_set(settings), "--out", str(out)) == 0
    assert {"config.json", "results.csv", "results.md", "per_seed.csv", "metrics.csv",
            "comparison.png"} <= {p.name for p in out.iterdir()}
    experiment = experiments.PRESETS[name].experiment
    with open(out / "results.csv", newline="") as f:
        header = next(csv.reader(f))
    rows = _rows(out / "results.csv")
    assert [r["method"] for r in rows] == list(experiment.methods)  # one row per method
    metrics = [c[: -len("_mean")] for c in header if c.endswith("_mean")]
    assert {"train_loss", "test_loss"} <= set(metrics)
    assert header == ["method", "diverged_seeds", "seeds_used"] + stats.results_columns(
        metrics)[1:]
    assert header == ["method", "diverged_seeds", "seeds_used"] + [
        f"{m}{suffix}" for m in metrics for suffix in (
            "_mean", "_std", "_diff", "_diff_se", "_significant")]
    assert all(r["diverged_seeds"] == "0" and r["seeds_used"] == "2" for r in rows)
    for r in rows:
        assert math.isfinite(float(r["train_loss_mean"]))
        if r["method"] == experiment.baseline:
            assert r["train_loss_diff"] == r["train_loss_significant"] == ""
        else:
            assert math.isfinite(float(r["train_loss_diff"]))
            assert r["train_loss_significant"] in ("True", "False")
    assert len(_rows(out / "per_seed.csv")) == 2 * len(experiment.methods)
    # Each method's finals were also written as it finished (what a crash keeps).
    per_seed = _rows(out / "per_seed.csv")
    assert sorted(p.name for p in (out / "methods").iterdir()) == sorted(
        f"{m}.json" for m in experiment.methods)
    for method in experiment.methods:
        saved = json.loads((out / "methods" / f"{method}.json").read_text())
        assert saved["method"] == method and saved["history"]
        for i, row in enumerate(r for r in per_seed if r["method"] == method):
            got = saved["per_seed"]["train_loss"][i]
            want = float(row["train_loss"]) if row["train_loss"] else math.nan
            if got is None:  # strict JSON writes a NaN (a diverged seed) as null
                assert math.isnan(want)
            else:
                assert got == pytest.approx(want)
    _assert_strict_files(out)


def test_a_comparison_that_crashes_keeps_the_methods_it_finished(tmp_path, monkeypatch):
    from fedjax_sim import compare

    real, calls = compare.train_method, []

    def crash_on_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # a stop (or a crash) during the second method
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "train_method", crash_on_second)
    name = "ifca-synthetic-tiny"
    first = experiments.PRESETS[name].experiment.methods[0]
    out = tmp_path / "compare"
    # A stop is exit 130 (issue 21), one line saying what is kept.
    assert cli.main(["compare", name, "--set", *_set({**_run_tiny(name), "seeds": 2}), "--out",
                     str(out), "--no-progress"]) == 130
    assert [p.name for p in (out / "methods").iterdir()] == [f"{first}.json"]
    saved = json.loads((out / "methods" / f"{first}.json").read_text())
    assert len(saved["per_seed"]["train_loss"]) == 2 and saved["history"][-1]["round"] > 0
    assert not (out / "results.csv").exists()


# ----------------------------------------------------------------------------- file formats


@pytest.mark.parametrize(
    ("command", "preset", "overrides", "code"),
    [
        # Diverges: every restart's loss goes to inf (exit 3, files still written).
        ("run", "ifca-synthetic-tiny", ["rounds=10", "lr=1e6"], 3),
        # Every run of every seed diverges: NaN min_dist in trials, no median in the summary.
        ("sweep", "ifca-success-small", [*_set({**SWEEP_TINY, "rounds": 30}), "lr=1e6,1e5"], 0),
        ("run", "ifca-synthetic-tiny", ["rounds=10"], 0),
    ],
)
def test_written_json_is_strict_and_csv_lines_end_in_newline(
    tmp_path, command, preset, overrides, code
):
    out = tmp_path / "out"
    assert _main(command, preset, "--set", *overrides, "--out", str(out)) == code
    _assert_strict_files(out)
    if command == "run":
        summary = json.loads((out / "summary.json").read_text())
        assert summary["diverged"] is (code == 3)
    else:
        (row,) = _rows(out / "summary.csv")
        assert row["median_best_min_dist"] == ""  # None, not NaN
        assert all(r["all_diverged"] == "1" for r in _rows(out / "trials.csv"))


def test_json_and_csv_of_the_fixture_directories_are_strict(run_dir, sweep_dir):
    _assert_strict_files(run_dir)
    _assert_strict_files(sweep_dir)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("change", "key"),
    [("rounds=50", "rounds"), ("sigma=0.3", "sigma"), ("R=0.4,1.6", "R"), ("seeds=3", "seeds")],
)
def test_resume_with_changed_settings_is_refused_and_changes_nothing(
    tmp_path, capsys, sweep_dir, change, key
):
    out = tmp_path / "sweep"
    shutil.copytree(sweep_dir, out)
    before = _snapshot(out)
    overrides = [o for o in SMALL_SWEEP if not o.startswith(f"{key}=")] + [change]
    capsys.readouterr()
    assert _main("sweep", "ifca-success-small", "--set", *overrides, "--out", str(out),
                 "--resume") == 2
    err = capsys.readouterr().err
    assert "settings differ" in err and f" {key} (" in err, err
    # Only the changed setting is named.
    named = re.findall(r"(\w+) \(", err.split("config.json:", 1)[1])
    assert named == [key], err
    assert _snapshot(out) == before


def test_run_into_a_sweep_and_sweep_into_a_run_are_refused(tmp_path, capsys, run_dir, sweep_dir):
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    shutil.copytree(run_dir, run)
    shutil.copytree(sweep_dir, sweep)
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert _main("run", "ifca-synthetic-tiny", "--set", *SMALL_RUN, "--out", str(sweep)) == 2
    assert "holds a sweep (trials.csv)" in capsys.readouterr().err
    assert _main("sweep", "ifca-success-small", "--set", *SMALL_SWEEP, "--out", str(run)) == 2
    assert "holds a run (metrics.csv)" in capsys.readouterr().err
    assert _main("compare", "ifca-synthetic-tiny", "--out", str(run)) == 2
    assert "holds a run (metrics.csv)" in capsys.readouterr().err
    assert _main("run", "ifca-synthetic-tiny", "--set", *SMALL_RUN, "--out", str(sweep),
                 "--resume") == 2
    assert _main("sweep", "ifca-success-small", "--set", *SMALL_SWEEP, "--out", str(run),
                 "--resume") == 2
    assert _snapshot(tmp_path) == before


def test_directory_with_only_a_metrics_csv_is_not_overwritten(tmp_path, capsys, run_dir):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(run_dir / "metrics.csv", out / "metrics.csv")
    before = _snapshot(tmp_path)
    assert _main("run", "ifca-synthetic-tiny", "--set", "rounds=2", "--out", str(out)) == 2
    assert "already holds a metrics.csv" in capsys.readouterr().err
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["run", "sweep", "compare"])
@pytest.mark.parametrize("where", ["under-a-file", "out-is-a-file", "read-only-dir"])
def test_unusable_out_exits_4_naming_it_and_creates_nothing(tmp_path, capsys, command, where):
    if where == "read-only-dir" and os.geteuid() == 0:
        pytest.skip("root ignores directory permissions (under-a-file covers ENOTDIR)")
    (tmp_path / "file").write_text("not a directory\n")
    if where == "under-a-file":
        out, reason = tmp_path / "file" / "out", os.strerror(errno.ENOTDIR)
    elif where == "out-is-a-file":
        out, reason = tmp_path / "file", "not a directory"
    else:
        (tmp_path / "ro").mkdir()
        out, reason = tmp_path / "ro" / "out" / "deeper", os.strerror(errno.EACCES)
        os.chmod(tmp_path / "ro", 0o500)
    preset = "ifca-success-small" if command == "sweep" else "ifca-synthetic-tiny"
    overrides = SMALL_SWEEP if command == "sweep" else ["rounds=2"]
    before = _snapshot(tmp_path)
    capsys.readouterr()
    try:
        assert _main(command, preset, "--set", *overrides, "--out", str(out)) == 4
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith("\n"), err  # one line
        assert f"--out {out}" in err, err
        assert reason.lower() in err.lower(), err
        assert _snapshot(tmp_path) == before
    finally:
        if where == "read-only-dir":
            os.chmod(tmp_path / "ro", 0o700)


@pytest.mark.parametrize(
    ("command", "overrides", "message"),
    [
        ("run", [f"rounds={10**12}"], f"setting rounds must be an integer in [1, 1e+07]; got "
                                      f"{10**12}"),
        ("run", [f"restarts={10**12}"], "setting restarts must be an integer in [1, 10000]"),
        ("run", [f"m={10**10}", "d=1000"], f"setting m must be an integer in [1, 1e+09]; got "
                                           f"{10**10}"),
        # past the copies' bound (generated clients may go on to 1e9)
        ("run", [f"m={10**9}", "d=1000", "clients=copies"],
         f"setting m={10**9} exceeds 1e+07 with clients=copies (every client stored); set "
         "clients=generated"),
        ("run", ["m=1000000", "n=100", "d=1000", "clients=copies"], "needs about"),
        # (clients=auto would take generated clients there: they fit)
        # generated clients still hold one model per client with local models
        ("run", [f"m={10**8}", "d=1000", "clients=generated", "algorithm=local"],
         "generated clients), more than this machine's"),
        ("sweep", [f"rounds={10**12}"], "setting rounds must be an integer"),
        ("sweep", [f"m=80,{10**9}", "d=1000"], "setting m must be an integer"),
        ("compare", [f"restarts={10**12}"], "setting restarts must be an integer"),
    ],
)
def test_oversized_settings_are_refused_and_nothing_is_written(
    tmp_path, capsys, command, overrides, message
):
    preset = "ifca-success-small" if command == "sweep" else "ifca-synthetic-tiny"
    out = tmp_path / "out"
    assert _main(command, preset, "--set", *overrides, "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert message in err
    setting = re.match(r"(\w+)=", overrides[0]).group(1)
    assert f"{setting}=" in err or f"setting {setting} " in err  # names the setting
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_run_config_reproduces_the_run(tmp_path, run_dir):
    again = tmp_path / "again"
    assert _main("run", "--config", str(run_dir / "config.json"), "--out", str(again)) == 0
    original = json.loads((run_dir / "config.json").read_text())
    rerun = json.loads((again / "config.json").read_text())
    assert rerun["preset"] == original["preset"] == "ifca-synthetic-tiny"
    assert rerun["settings"] == original["settings"]
    assert (rerun["settings"]["rounds"], rerun["settings"]["seed"]) == (10, 3)  # not defaults
    assert (again / "metrics.csv").read_bytes() == (run_dir / "metrics.csv").read_bytes()


def test_run_config_with_a_preset_too_is_refused(tmp_path, capsys, run_dir):
    out = tmp_path / "out"
    assert _main("run", "ifca-synthetic-tiny", "--config", str(run_dir / "config.json"),
                 "--out", str(out)) == 2
    assert "not both" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "sweep"])
@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["--set", "k=2", "k=4"], "setting k is given twice"),
        (["--set", "k=2", "--set", "k=4"], "setting k is given twice"),
        (["--set", "R=0.1,,0.2"], "setting R: empty value"),
        (["--set", "R=0.1,"], "setting R: empty value"),
    ],
)
def test_repeated_or_empty_settings_are_refused(tmp_path, capsys, command, sets, message):
    preset = "ifca-success-small" if command == "sweep" else "ifca-synthetic-tiny"
    out = tmp_path / "out"
    assert _main(command, preset, *sets, "--out", str(out)) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_used_comparison_directory_is_refused_as_a_comparison(tmp_path, capsys):
    # A finished comparison holds results.csv and metrics.csv: it is a comparison's
    # directory (not "a run"), and the refusal offers --resume.
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "results.csv").write_text("method\nifca\n")
    (out / "metrics.csv").write_text("method,round\nifca,0\n")
    (out / "config.json").write_text('{"command": "compare", "preset": "ifca-synthetic-tiny"}')
    before = _snapshot(tmp_path)
    assert _main("compare", "ifca-synthetic-tiny", "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "holds a run (metrics.csv)" not in err
    assert "already holds a run (config.json)" in err and "--resume it" in err
    assert _snapshot(tmp_path) == before
