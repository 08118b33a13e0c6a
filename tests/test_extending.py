"""Every example of docs/extending.md runs as the page shows it: the new algorithm (its
module, its example and its reference tests), the new model, the new dataset and the new
experiment (declared, then run, compared with a tune_* grid and swept through the command
line's own path)."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import fedjax_sim.algorithms
from fedjax_sim import cli, experiments
from fedjax_sim.algorithms import sgd
from fedjax_sim.data import linear_mixture
from fedjax_sim.io import read_csv
from fedjax_sim.models import linear_regression
from fedjax_sim.models.core import check_model_data

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _blocks(heading: str) -> list[str]:
    """The python blocks under a heading of the page (up to the next heading of its level
    or above)."""
    text = PAGE.read_text()
    level = heading.split()[0]
    start = text.index(heading + "\n")
    rest = text[start + len(heading):]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    section = rest[: end.start()] if end else rest
    return re.findall(r"```python\n(.*?)```", section, re.S)


def _run(code: str) -> dict:
    """The block run as a module of its own (flax's modules look theirs up)."""
    module = types.ModuleType(f"extending_example_{abs(hash(code))}")
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, str(PAGE), "exec"), module.__dict__)  # noqa: S102
    finally:
        del sys.modules[module.__name__]
    return module.__dict__


@pytest.fixture
def loss_weighted(monkeypatch):
    """The page's algorithm module, registered where its tests import it from."""
    (module,) = _blocks("### 1. One module")
    factory = _run(module)["loss_weighted"]
    monkeypatch.setattr(fedjax_sim.algorithms, "loss_weighted", factory, raising=False)
    return factory


def test_the_new_algorithm_runs_its_example(loss_weighted):
    data = linear_mixture(jax.random.key(0), k=2, m=8, n=10, d=3, sigma=0.1, R=1.0).train
    alg = loss_weighted(linear_regression(3), sgd(0.1, steps=5), power=2.0)
    state = alg.init(jax.random.key(1), data)
    state, metrics = jax.jit(alg.round)(state, data, jax.random.key(2))
    assert state.params.shape == (3,) and int(state.round) == 1
    assert np.isfinite(float(metrics["cohort_loss"]))


def test_the_new_algorithms_reference_tests_pass(loss_weighted, ragged, linear_model, ref):
    (tests,) = _blocks("### 4. Its reference test")
    namespace = _run(tests)
    for power in (0.0, 1.0, 2.0):
        namespace["test_loss_weighted_rounds_equal_loop"](ragged, linear_model, ref, power)
    namespace["test_power_zero_is_fedavg"](ragged, linear_model)
    namespace["test_chunked_cohort_equals_whole"](ragged, linear_model)


def test_the_new_model_fits_its_data():
    (code,) = _blocks("## A new model")
    namespace = _run(code)
    for split in (False, True):
        model = namespace["tiny_cnn"]((8, 8), 10, split=split)
        x = np.random.default_rng(0).normal(size=(4, 8, 8)).astype(np.float32)
        data = fedjax_sim.data.FederatedData(
            x=x.reshape(2, 2, 8, 8), y=np.array([[1, 2], [3, 4]], np.int32),
            num_examples=np.array([2, 2], np.int32), cluster=np.array([-1, -1], np.int32))
        check_model_data(model, model.init(jax.random.key(0)), data)


def test_the_new_dataset_reads_what_was_written(tmp_path):
    (code,) = _blocks("## A new dataset")
    load = _run(code)["writer_clients"]
    writer = np.array([7, 3, 7, 3, 7, 9])
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    y = np.array([0, 1, 2, 3, 4, 5], np.int32)
    np.savez(tmp_path / "writers.npz", x=x, y=y, writer=writer)
    data = load(tmp_path, min_rows=2)
    # Writers 3 and 7 (sorted), in dataset order; writer 9 has one row and is left out.
    assert np.asarray(data.num_examples).tolist() == [2, 3]
    assert np.asarray(data.y)[0, :2].tolist() == [1, 3]
    assert np.asarray(data.y)[1, :3].tolist() == [0, 2, 4]
    np.testing.assert_array_equal(np.asarray(data.x)[1, :3], x[[0, 2, 4]])
    with pytest.raises(FileNotFoundError, match="data_dir"):
        load(tmp_path / "missing")


def test_the_new_experiment_runs_compares_and_sweeps(tmp_path, monkeypatch):
    (code,) = _blocks("## A new experiment or preset")
    (preset,) = _run(code)["PRESETS"]
    monkeypatch.setitem(experiments.PRESETS, preset.name, preset)
    tiny = ["m=6", "n=8", "d=3", "rounds=4", "eval_every=2", "seeds=2", "local_steps=2"]

    def main(*args):
        assert cli.main([*args, "--no-progress"]) == 0

    assert cli.main(["describe", "noisy-clusters"]) == 0
    main("compare", "noisy-clusters", "--out", str(tmp_path / "cmp"), "--set", *tiny,
         "tune_lr=0.02,0.05")
    results = read_csv(tmp_path / "cmp" / "results.csv")
    assert [r["method"] for r in results] == ["fedavg", "fedprox", "ifca"]
    assert all(0.02 <= float(r["chosen_lr"]) <= 0.05 for r in results)
    main("run", "noisy-clusters", "--out", str(tmp_path / "run"), "--set", *tiny,
         "method=fedprox", "prox_mu=0.1")
    assert {int(r["seed"]) for r in read_csv(tmp_path / "run" / "metrics.csv")} == {0, 1}
    main("sweep", "noisy-clusters", "--out", str(tmp_path / "sweep"), "--set", *tiny,
         "sigma=0.1,0.5")
    assert len(read_csv(tmp_path / "sweep" / "trials.csv")) == 4
    assert len(read_csv(tmp_path / "sweep" / "summary.csv")) == 2
