"""Every method that `describe` lists for a preset runs on it, and no other is listed.

For every preset that names methods (the setting of the method a run trains,
`Experiment.method_key`, and the `methods` of a comparison): the values `describe` shows
are exactly the methods the experiment can train (`Experiment.available`); each one runs
through the command line's own Python path (`runner.run_preset`, as `fedjax-sim run` calls
it) at the preset's tiniest sizes (the golden cases' settings, one seed) and writes its
summary; every other method of the table is refused in one line naming the ones that fit,
before anything is written. The runs are slow (a compilation each): the default run keeps
the listing checks, the refusals and the cheapest method of two experiments; the slow set
one run per experiment; the exhaustive set every method once (see `_marks`).
"""

from __future__ import annotations

import json
import os

import golden
import numpy as np
import pytest

from fedjax_sim import experiments
from fedjax_sim.experiments import base, runner
from fedjax_sim.experiments.methods import METHODS

# preset -> its tiniest settings: the golden cases' (one seed), else written here.
TINY: dict[str, list[str]] = {}
for _command, _preset, _settings in golden.CASES.values():
    TINY.setdefault(_preset, [x for x in _settings if not x.startswith("methods=")])
TINY.update({
    "dp-cohorts-synthetic": ["m=2000", "n=5", "n_test=5", "d=3", "test_clients=20",
                             "rounds=2", "eval_every=1", "participation=0.01",
                             "dp_noise_cohort=0", "dp_clip=0"],  # qffl, afl: no DP
    "dp-hetero-digits": [*TINY["hetero-digits"], "dp_clip=0"],  # qffl, afl: no DP
    # One cell of the sweep-only grid, without Byzantine clients (qffl, afl: no rule).
    "byzantine-digits": [*TINY["hetero-digits"], "aggregator=mean", "pre_aggregation=none",
                         "attack=none", "byzantine=0", "alpha=100"],
    "robust-ifca-byzantine-digits": [*TINY["robust-clusters-digits"], "attack=none",
                                     "attack_scale=0", "byzantine=0"],
    "async-digits": [*TINY["hetero-digits"], "concurrency=4", "buffer_size=2"],
    "drflm-freesolv": TINY["drflm-esol"],
    "drflm-lipophilicity": TINY["drflm-esol"],
    # Data a user supplies (data_dir): written into a temporary directory by `_data`.
    "ifca-rotated-cifar": ["n=5", "batch_size=5", "local_steps=1", "rounds=1", "eval_every=1",
                           "participation=0.5"],
    "ifca-femnist": ["min_samples=10", "rounds=2", "pretrain_rounds=1", "warm_start_rounds=1",
                     "local_rounds=1", "local_steps=1", "batch_size=5", "eval_every=1",
                     "clients_per_round=3"],
})


# The shortest schedules of the settings that lengthen some method's run (pretraining,
# warm starts, local baselines), wherever a preset declares them: a run of a method that
# does not read one leaves it out (`_settings`).
SHORTEST = {"pretrain_rounds": 1, "warm_start_rounds": 1, "local_rounds": 1,
            "pretrain_steps": 2}


def _key(preset) -> str | None:
    """The setting of the method a run of `preset` trains (None: it names no method)."""
    experiment = preset.experiment
    key = experiment.method_key
    return key if experiment.methods and key in experiment.declared else None


PRESETS = [name for name, p in experiments.PRESETS.items() if _key(p) is not None]


def _listed(name: str) -> tuple[str, ...]:
    preset = experiments.PRESETS[name]
    return preset.experiment.declared[_key(preset)].choices


# The cheapest method of each experiment runs in the default selection. The slow set (CI)
# runs every experiment once (its first preset's first listed method); the exhaustive set
# (`--run-exhaustive`) every method once too (on the first preset that lists it), about
# 50 runs in all. The whole
# preset × method matrix (about 500 runs, an hour or more on two cores) runs with
# FEDJAX_SIM_EVERY_METHOD=1, the check before a release or after a change to the method
# table or an experiment's `provides`.
FAST = {"ifca_synthetic": "fedavg", "drfa_molecules": "fedavg"}
EVERY = os.environ.get("FEDJAX_SIM_EVERY_METHOD") == "1"
_FIRST = {}
for _name in PRESETS:
    _FIRST.setdefault(experiments.PRESETS[_name].experiment.name, _name)
_ONCE: set[tuple[str, str]] = set()
_seen_methods: set[str] = set()
for _name in PRESETS:
    for _method in _listed(_name):
        if _method not in _seen_methods:
            _seen_methods.add(_method)
            _ONCE.add((_name, _method))
_EACH_EXPERIMENT = {(_name, FAST.get(_experiment, _listed(_name)[0]))
                    for _experiment, _name in _FIRST.items()}
_ONCE |= _EACH_EXPERIMENT


def _fast(name: str, method: str) -> bool:
    experiment = experiments.PRESETS[name].experiment.name
    return _FIRST[experiment] == name and FAST.get(experiment) == method


def _marks(name: str, method: str):
    if _fast(name, method):
        return ()
    return pytest.mark.slow if (name, method) in _EACH_EXPERIMENT else pytest.mark.exhaustive


CASES = [pytest.param(name, method, marks=_marks(name, method))
         for name in PRESETS for method in _listed(name)
         if EVERY or (name, method) in _ONCE or _fast(name, method)]

def _data(name: str, tmp_path) -> list[str]:
    """Tiny local data for a preset that reads a user's copy (none ships)."""
    root = tmp_path / "data"
    if name not in ("ifca-rotated-cifar", "ifca-femnist"):
        return []
    if root.exists():  # written by an earlier call of the same test
        return [f"data_dir={root}"]
    if name == "ifca-rotated-cifar":
        rng = np.random.default_rng(0)
        (root / "cifar10").mkdir(parents=True)
        for split, size in (("train", 20), ("test", 10)):
            np.savez(root / "cifar10" / f"{split}.npz",
                     x=rng.integers(0, 256, size=(size, 32, 32, 3), dtype=np.uint8),
                     y=rng.integers(0, 10, size=size))
    else:
        from test_femnist import write_tiny_femnist

        write_tiny_femnist(root, rows=(9, 3))
    return [f"data_dir={root}"]


def _settings(name: str, method: str, tmp_path) -> list[str]:
    """The preset's tiny settings for a run of `method`: one seed, no checkpoints, and
    without the settings a run of `method` does not read (a run refuses those)."""
    preset = experiments.PRESETS[name]
    declared = preset.experiment.declared
    tiny = [x for x in TINY[name] if x != golden.TINY_CIFAR10]
    if len(tiny) < len(TINY[name]):  # the golden cases' tiny CIFAR-10 archive
        root = tmp_path / "tiny_cifar10"
        if not root.exists():
            golden.tiny_cifar10(root)
        tiny.append(f"data_dir={root}")
    items = [x for x in [*tiny, *_data(name, tmp_path)] if not x.startswith("seeds=")]
    given = {x.split("=", 1)[0] for x in items}
    items += [f"{k}={v}" for k, v in SHORTEST.items() if k in declared and k not in given]
    items += [f"{k}={v}" for k, v in (("seeds", 1), ("checkpoint_every", 0)) if k in declared]
    out = []
    for item in items:
        setting = declared[item.split("=", 1)[0]]
        if ((setting.methods is None or method in setting.methods)
                and (setting.commands is None or "run" in setting.commands)):
            out.append(item)
    return [*out, f"{_key(preset)}={method}"]


def test_every_preset_that_names_methods_has_tiny_settings():
    assert set(PRESETS) <= set(TINY), sorted(set(PRESETS) - set(TINY))


@pytest.mark.parametrize("name", PRESETS)
def test_describe_lists_exactly_the_methods_the_experiment_can_train(name, capsys):
    from fedjax_sim import cli

    preset = experiments.PRESETS[name]
    experiment = preset.experiment
    available = base.available(experiment)
    assert _listed(name) == available
    assert set(experiment.methods) <= set(available)
    assert preset.defaults[_key(preset)] in available
    if "methods" in experiment.declared:
        assert experiment.declared["methods"].choices == available
    assert cli.main(["describe", name]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()
             if line.startswith("  ")}
    for key in (_key(preset), "methods"):
        if key in lines:
            assert f"range {' | '.join(available)} " in lines[key]


@pytest.mark.parametrize("name", PRESETS)
def test_an_unlisted_method_is_refused_in_one_line_before_writing(name, tmp_path):
    unlisted = [m for m in METHODS if m not in _listed(name)]
    if not unlisted:
        pytest.skip(f"{name} lists every method")
    listed = ", ".join(_listed(name))
    table = experiments.PRESETS[name].experiment.method_table
    for method in unlisted:
        out = tmp_path / method
        with pytest.raises(ValueError) as err:
            runner.run_preset(name, _settings(name, method, tmp_path), out, progress=False)
        message = str(err.value)
        assert "\n" not in message
        if method in table:  # in the experiment's table, but it does not fit: says why
            assert message.startswith(f"method {method} needs "), message
            assert message.endswith(f"it can train {listed}."), message
        else:  # a table of the experiment's own: the setting's choices are those listed
            assert message.startswith(f"setting {_key(experiments.PRESETS[name])} must be one "
                                      f"of {listed}; got {method!r}"), message
        assert not out.exists()


@pytest.mark.parametrize(("name", "method"), CASES)
def test_every_listed_method_runs_tiny(name, method, tmp_path):
    out = tmp_path / "run"
    runner.run_preset(name, _settings(name, method, tmp_path), out, progress=False)
    summary = json.loads((out / "summary.json").read_text())
    assert summary.get("method", summary.get("algorithm")) == method
    assert (out / "metrics.csv").read_text().count("\n") >= 2  # a header and a row
    config = json.loads((out / "config.json").read_text())
    assert config["settings"][_key(experiments.PRESETS[name])] == method
