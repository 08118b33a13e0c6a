"""Method-scoped settings (`Setting.methods`): a value for a method that ignores it is refused
before anything is written, and each declaration matches what the methods read.

The declarations are checked against the code by training: every method of the
experiment gives the same state, round metrics and round count when every scoped
setting it is not declared to read is changed at once, and one declared reader of
each setting gives different ones when that setting alone is changed. So a
setting that a method reads but is not declared for (a refusal of a meaningful
value) fails the first check, and a declaration no method honours fails the second.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fedjax_sim import cli, simulate
from fedjax_sim.experiments import get_preset, resolve_settings, study
from fedjax_sim.experiments.base import available
from fedjax_sim.experiments.settings import resolve


def _host(tree):
    def leaf(x):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [leaf(x) for x in jax.tree.leaves(tree)]


def _trained(experiment, name: str, s: dict):
    """(rounds, leaves of the state after the settings' rounds and of their round metrics)."""
    run = study.method_run(experiment, name, s, experiment.problem(s))
    key_init, key_rounds = jax.random.split(run.key)
    state = jax.jit(run.algorithm.init)(key_init, run.data)
    state, metrics = simulate.scan_rounds(run.algorithm, state, run.data, key_rounds, 0,
                                          run.rounds)
    return run.rounds, _host((state, metrics))


def _same(a, b) -> bool:
    (rounds_a, leaves_a), (rounds_b, leaves_b) = a, b
    return rounds_a == rounds_b and len(leaves_a) == len(leaves_b) and all(
        x.shape == y.shape and np.array_equal(x, y, equal_nan=True)
        for x, y in zip(leaves_a, leaves_b, strict=True))


# The settings of the methods every comparison can name (methods.METHOD_SETTINGS).
COMMON = {"prox_mu": ({}, 0.5), "q": ({}, 3.0), "ditto_lambda": ({}, 0.5),
          "lambda_lr": ({}, 0.5), "server_lr": ({}, 0.5),
          # IFCA's communication reduction: a client whose cluster held for a round is
          # pinned from the next (its downlink falls), so it shows from the third round on.
          "stable_rounds": ({"rounds": 6}, 1)}

# preset: (settings for a small, fast run; {scoped setting: (base values that let its
# reader use it, its changed value)})
CASES = {
    "ifca-rotated-digits": (
        {"seeds": 1, "rounds": 2, "local_rounds": 1, "pretrain_rounds": 1,
         "warm_start_rounds": 1},
        {"local_rounds": ({}, 2),
         "pretrain_rounds": ({}, 2),
         "warm_start_rounds": ({}, 2),
         "init_tries": ({}, 3),
         # k = 4: no init gives every cluster 35 %, so the most balanced of 20 is taken;
         # at 1 % (a client per cluster) the first that passes is.
         "init_min_fraction": ({"init_tries": 20}, 0.01),
         # CFL splits when the mean update norm is below ε₁ and the largest above ε₂:
         # always at (ε₁, ε₂) = (1e6, 0); never when either is changed to its other end.
         "cfl_eps1": ({"cfl_eps1": 1e6, "cfl_eps2": 0.0}, 0.0),
         "cfl_eps2": ({"cfl_eps1": 1e6, "cfl_eps2": 0.0}, 1e6),
         **COMMON}),
    "drfa-synthetic-noise": (
        {"seeds": 1, "rounds": 2},
        {"optimizer": ({}, "adam"), "lr": ({}, 0.05), "lambda_lr": ({}, 0.5),
         "q": ({}, 3.0), "qffl_lr": ({}, 0.2), "lambda_floor": ({}, 0.05),
         "weighting": ({}, "uniform"), "official_code": ({}, True),
         "mixup_alpha": ({}, 0.2), "mixup_beta": ({}, 3.0),
         "lambda_loss": ({}, "clean"), "k": ({}, 3),
         "cfl_eps1": ({"cfl_eps1": 1e6, "cfl_eps2": 0.0}, 0.0),
         "cfl_eps2": ({"cfl_eps1": 1e6, "cfl_eps2": 0.0}, 1e6),
         **{k: v for k, v in COMMON.items() if k not in ("q", "lambda_lr")}}),
    "mixed-synthetic": (
        {"seeds": 1, "rounds": 2, "central_batch_size": 20},
        {"server_lr": ({}, 0.5), "central_batch_size": ({}, 50),
         "combine": ({"w_f": 0.3}, "mixing"), "transfer": ({}, "stale"),
         **{k: COMMON[k] for k in ("prox_mu", "q", "lambda_lr")}}),  # (no IFCA here)
    "fednova-quadratic": (
        {"seeds": 1, "rounds": 2, "num_clients": 4, "tau_max": 4},
        {"weighting": ({}, "uniform"),
         **{k: v for k, v in COMMON.items() if k not in ("ditto_lambda", "stable_rounds")}}),
}


@pytest.mark.parametrize("preset", sorted(CASES))
def test_scoped_settings_match_what_methods_read(preset):
    # Each case compiles a few hundred programs; dropping the earlier cases' executables
    # keeps one worker's compiler state small (XLA's CPU compiler crashed in the third
    # case otherwise, on a 2-core machine, with jax 0.10.2).
    jax.clear_caches()
    p = get_preset(preset)
    experiment = p.experiment
    small, changes = CASES[preset]
    # A tune_* grid is scoped as the setting it tunes (tests/test_tuned.py checks that the
    # grid reaches exactly those methods); `method_run` alone, trained here, reads none.
    scoped = {s.name: s.methods for s in experiment.declared.values()
              if s.methods and not s.name.startswith("tune_")}
    assert set(scoped) == set(changes), "every scoped setting has a change to try here"
    # The declarations' own checks only: the runner would refuse the small values of
    # settings that the preset's compared methods do not read.
    base = resolve(experiment.declared, p.defaults, small)
    # Every method a run can train, with every setting it does not read changed at once:
    # the same run.
    for name in available(experiment):
        ignored = {k: v for k, (_, v) in changes.items() if name not in scoped[k]}
        if not ignored:
            continue
        changed = {**base, **ignored}
        assert _same(_trained(experiment, name, base), _trained(experiment, name, changed)), (
            f"{preset}: method {name} reads one of {sorted(ignored)}")
    # One reader of each setting, with that setting alone changed: another run.
    for key, (extra, value) in changes.items():
        reader = scoped[key][0]
        before = {**base, **extra}
        after = {**before, key: value}
        assert before[key] != value
        assert not _same(_trained(experiment, reader, before),
                         _trained(experiment, reader, after)), (
            f"{preset}: {key} is declared read by {reader}, which ignores it")


@pytest.mark.parametrize("argv, message", [
    (["run", "ifca-rotated-digits", "--set", "cfl_eps1=0.3"],
     "setting cfl_eps1 is read only by method cfl; this run trains ifca: leave it at 0.4 or "
     "--set method=cfl."),
    (["compare", "ifca-rotated-digits", "--set", "init_tries=3", "methods=fedavg,local"],
     "setting init_tries is read only by methods ifca, ifca_ws; this compare trains fedavg, "
     "local: leave it at 1."),
    (["run", "drfa-synthetic-noise", "--set", "method=qffl", "lambda_lr=0.5"],
     "setting lambda_lr is read only by methods drfa, drflm, afl, robust_ifca; this run trains "
     "qffl: leave it at 0.01."),
    # The rule needs a share above 0 (it refused 0 only once the run had started).
    (["run", "ifca-rotated-digits", "--set", "init_tries=3", "init_min_fraction=0"],
     "setting init_min_fraction must be a finite number in [1e-09, 1]; got 0.0."),
    (["run", "mixed-synthetic", "--set", "method=mixed_gt1", "transfer=stale"],
     "setting transfer is read only by method mixed_gt2; this run trains mixed_gt1: leave it "
     "at 'current' or --set method=mixed_gt2."),
    # Settings of another kind of data (`Setting.when`).
    (["run", "drfa-synthetic-noise", "--set", "hidden=32"],
     "setting hidden is read only with dataset=esol or freesolv or lipophilicity; this run has "
     "dataset=synthetic: leave it at 64."),
    (["compare", "drfa-synthetic-noise", "--set", "dataset=esol", "clean_noise=0.5"],
     "setting clean_noise is read only with dataset=synthetic; this compare has dataset=esol: "
     "leave it at 0.1."),
    (["run", "drfa-synthetic-noise", "--set", "split_alpha=0.3"],
     "setting split_alpha is read only with split=dirichlet; this run has split=round_robin: "
     "leave it at 1.0."),
    (["run", "ifca-rotated-digits", "--set", "weight_decay=0.01"],
     "setting weight_decay is read only with dataset=cifar; this run has dataset=digits: leave "
     "it at 0.004."),
])
def test_a_setting_the_trained_methods_or_data_ignore_is_refused(argv, message, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([*argv, "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err.strip().endswith(message)
    assert not out.exists()


@pytest.mark.parametrize("overrides, command", [
    ({"method": "cfl", "cfl_eps1": 0.3}, "run"),  # its reader is trained
    ({"init_tries": 3}, "compare"),  # ifca is among the compared methods
    ({"cfl_eps1": 0.4}, "run"),  # the preset's own value, given again
])
def test_a_setting_a_trained_method_reads_is_accepted(overrides, command):
    s = resolve_settings(get_preset("ifca-rotated-digits"), overrides, command)
    assert all(s[k] == v for k, v in overrides.items())


# Settings read with one kind of data only (`Setting.when`): (preset, the small run's
# settings, the method trained, {setting: a changed value}) for data that does not read them.
UNREAD_WITH_DATA = [
    ("drfa-synthetic-noise", {"seeds": 1, "rounds": 2}, "drflm",
     {"split": "dirichlet", "max_atoms": 5, "hidden": 8, "layers": 1, "pooling": "sum"}),
    ("ifca-rotated-digits", {"seeds": 1, "rounds": 2}, "ifca",
     {"weight_decay": 0.5, "data_dir": "/nonexistent"}),
]


@pytest.mark.parametrize("preset, small, method, unread", UNREAD_WITH_DATA,
                         ids=[case[0] for case in UNREAD_WITH_DATA])
def test_data_scoped_settings_match_what_the_data_reads(preset, small, method, unread):
    p = get_preset(preset)
    experiment = p.experiment
    base = resolve(experiment.declared, p.defaults, small)
    for key in unread:
        other, allowed = experiment.declared[key].when
        assert base[other] not in allowed, (key, base[other])
    assert _same(_trained(experiment, method, base),
                 _trained(experiment, method, {**base, **unread}))


def test_molecule_data_ignores_the_synthetic_settings():
    pytest.importorskip("rdkit")
    p = get_preset("drflm-esol")
    experiment = p.experiment
    base = resolve(experiment.declared, p.defaults, {"seeds": 1})
    unread = {"d": 3, "n": 7, "n_test": 9, "clean_noise": 2.0}
    assert all(experiment.declared[k].when == ("dataset", ("synthetic",)) for k in unread)
    a, b = experiment.problem(base), experiment.problem({**base, **unread})
    leaves_a, leaves_b = _host((a.train, a.test)), _host((b.train, b.test))
    assert len(leaves_a) == len(leaves_b)
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
