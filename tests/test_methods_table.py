"""The one method table (`experiments.methods`): every registered algorithm is a method,
every comparison experiment can build every method that fits it, and one that does not
fit is refused in one line saying why."""

from __future__ import annotations

import golden
import jax
import pytest

from fedjax_sim import experiments
from fedjax_sim.algorithms import ALGORITHMS
from fedjax_sim.experiments import base, study
from fedjax_sim.experiments.methods import METHODS
from fedjax_sim.experiments.runner import resolve_settings

# One tiny comparison per experiment (the golden cases' settings).
_CASES = {}
for _case, (_command, _preset, _settings) in golden.CASES.items():
    _experiment = experiments.PRESETS[_preset].experiment
    if (_command == "compare" and _experiment.name not in _CASES
            and golden.TINY_CIFAR10 not in _settings):
        _CASES[_experiment.name] = (_preset, [x for x in _settings
                                              if not x.startswith("methods=")])
# Experiments with no golden comparison: their presets' tiniest settings
# (tests/test_every_listed_method.py's).
for _preset in ("dp-hetero-digits", "dp-cohorts-synthetic", "byzantine-digits",
                "robust-ifca-byzantine-digits", "async-digits"):
    from test_every_listed_method import TINY

    _CASES.setdefault(experiments.PRESETS[_preset].experiment.name, (_preset, TINY[_preset]))
EXPERIMENTS = sorted(_CASES)


def test_every_registered_algorithm_is_a_method():
    used = {m.algorithm for m in METHODS.values()}
    assert set(ALGORITHMS) <= used, sorted(set(ALGORITHMS) - used)
    assert used <= set(ALGORITHMS), sorted(used - set(ALGORITHMS))


# Experiments that run only on a user's own copy of their data (data_dir), so no case here
# can resolve their settings; their tests write tiny data into a tmp dir instead
# (tests/test_femnist.py; pfl_cifar10's golden cases write tiny archives, tests/golden.py).
NEEDS_USER_DATA = {"ifca_rotated_cifar", "ifca_femnist", "pfl_cifar10"}


def test_every_comparison_experiment_has_a_tiny_case():
    compared = {p.experiment.name for p in experiments.PRESETS.values() if p.experiment.methods}
    assert compared - NEEDS_USER_DATA <= set(_CASES), sorted(compared - set(_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_fitting_method_builds_in_every_comparison(name):
    """Each method the experiment offers is built as its comparison would train it, and its
    init and round trace on the experiment's data (shapes only: nothing is trained)."""
    preset, settings = _CASES[name]
    experiment = experiments.PRESETS[preset].experiment
    available = base.available(experiment)
    assert set(experiment.methods) <= set(available)
    s = resolve_settings(experiments.PRESETS[preset],
                         [*settings, "methods=" + ",".join(available)], "compare")
    problem = experiment.problem(s)
    for method in available:
        spec = study.method_run(experiment, method, s, problem)
        state = jax.eval_shape(spec.algorithm.init, spec.key, spec.data)
        new, metrics = jax.eval_shape(spec.algorithm.round, state, spec.data, spec.key)
        assert jax.tree.structure(new) == jax.tree.structure(state), method
        assert metrics, method


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_a_method_that_does_not_fit_is_refused_in_one_line(name):
    preset, settings = _CASES[name]
    experiment = experiments.PRESETS[preset].experiment
    # (an experiment with a method table of its own refuses methods outside it as a
    # setting's choices: tests/test_every_listed_method.py)
    unfit = [m for m in experiment.method_table if m not in base.available(experiment)]
    if not unfit:
        pytest.skip(f"every method fits {name}")
    baseline = [experiment.baseline] if experiment.baseline else []
    with pytest.raises(ValueError, match=rf"^method {unfit[0]} needs .*, which {name} does "
                       r"not have; it can train ") as err:
        resolve_settings(experiments.PRESETS[preset],
                         [*settings, "methods=" + ",".join([*baseline, unfit[0]])], "compare")
    assert "\n" not in str(err.value)
