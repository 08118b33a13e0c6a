"""Learning rate and clip chosen on the validation split (`tune_lr`, `tune_dp_clip`) for
the DP methods of dp-hetero-digits: each grid point trained alone here (one program per
value), its validation accuracy read from the experiment's own evaluation on the
validation rows, and the chosen point per seed is the argmax computed in the test."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fedjax_sim import experiments, simulate
from fedjax_sim.execution import Execution
from fedjax_sim.experiments import privacy, study, tuned
from fedjax_sim.experiments.base import RunContext

SMALL = {
    "num_clients": 20,
    "rounds": 2,
    "eval_every": 2,
    "seeds": 2,
    "hidden": 8,
    "local_steps": 2,
    "methods": "fedavg",
    "tune_lr": [0.05, 0.5],
    "tune_dp_clip": [0.05, 2.0],
}


def _settings(**more):
    preset = experiments.get_preset("dp-hetero-digits", "compare")
    return preset.experiment, experiments.resolve_settings(preset, {**SMALL, **more}, "compare")


def test_a_clip_grid_turns_dp_on_for_every_method_and_refuses_a_zero_clip():
    experiment, s = _settings()
    assert privacy.enabled({**s, "dp_clip": 0.0})
    grid = tuned.method_grid(experiment.method_table["fedavg"], s)
    assert grid == {"lr": [0.05, 0.5], "dp_clip": [0.05, 2.0]}
    with pytest.raises(ValueError, match="tune_dp_clip must hold clips > 0"):
        tuned.check({**s, "tune_dp_clip": [0.0, 1.0]})


def _train_alone(experiment, s, problem):
    spec = study.method_run(experiment, "fedavg", s, problem.fit)
    state, history = simulate.run(
        spec.algorithm,
        spec.data,
        spec.key,
        rounds=spec.rounds,
        eval_every=spec.eval_every,
        evaluate=spec.evaluate,
        execution=Execution(progress=False, copies=1, data_copies=spec.data_copies),
    )
    val = study.method_run(experiment, "fedavg", s, problem.val).evaluate(state)
    return history[-1], np.asarray(val["test_accuracy"], np.float64)


@pytest.mark.slow  # the grid and its four points alone (about 40 s on 2 cores)
def test_chosen_lr_and_clip_are_the_argmax_of_validation_accuracy():
    experiment, s = _settings()
    comparison = study.compare(experiment, s, RunContext(progress=False))
    problem = study.problem_for(experiment, s)
    assert isinstance(problem, tuned.Tuned)
    points = list(itertools.product(s["tune_lr"], s["tune_dp_clip"]))  # the grid's order
    runs = [
        _train_alone(experiment, {**s, "lr": lr, "dp_clip": clip}, problem) for lr, clip in points
    ]
    val = np.stack([v for _, v in runs])  # [G, seeds]
    best = np.argmax(val, axis=0)  # ties: the first point, as the comparison
    assert best.tolist() != [0] * s["seeds"]  # the choice is not the default first point
    got = comparison.per_seed["fedavg"]
    np.testing.assert_array_equal(got["chosen_lr"], [points[g][0] for g in best])
    np.testing.assert_array_equal(got["chosen_dp_clip"], [points[g][1] for g in best])
    for metric in ("test_accuracy", "train_loss", "epsilon"):
        want = np.array([runs[g][0][metric][i] for i, g in enumerate(best)])
        np.testing.assert_allclose(got[metric], want, rtol=1e-4)
    np.testing.assert_allclose(
        comparison.results["fedavg"].per_seed["val_accuracy"],
        val[best, np.arange(s["seeds"])],
        rtol=1e-5,
    )
