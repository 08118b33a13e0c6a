"""The chunk sizes the executor plans for experiments' footprints (`fedjax_sim.memory`), pinned.

Each expected chunk is computed here from the byte counts written out by hand
(float32 data and linear models: 4 bytes a number) and also pinned as the
number the experiments chose before planning moved into `memory`, so a change
of either the formula or its use shows.
"""

from __future__ import annotations

import math

import jax
import pytest

from fedjax_sim import memory
from fedjax_sim.data import copy_at
from fedjax_sim.execution import Execution
from fedjax_sim.experiments import PRESETS, ifca_success, ifca_synthetic
from fedjax_sim.experiments import ifca_images as images
from fedjax_sim.experiments.ifca_synthetic import sweep as synthetic_sweep
from fedjax_sim.experiments.methods import SPLIT_MODEL


def _chunk(m: int, per_client: int, available: float):
    """client_chunk_for_budget by hand: None if all fit, else the fewest even chunks."""
    if m * per_client <= available:
        return None
    fit = max(1, int(available // per_client))
    chunks = math.ceil(m / fit)
    return math.ceil(m / chunks)


def _synthetic_round_per_client(s: dict, local_training: bool) -> int:
    """One client of the linear mixture in a round: x [n, d], y [n]; a prediction [n] per
    cluster model."""
    n, d, k = s["n"], s["d"], s["k"]
    rows, act = 4 * n * d + 4 * n, 4 * n
    if not local_training:  # k forward passes and their VJP
        return rows + 2 * k * act
    return rows + k * act + 5 * 4 * d + 2 * act  # 5 model copies, one local step


def _synthetic_per_client(s: dict, local_training: bool) -> int:
    """The most one client needs in a round or an evaluation (train rows, or test rows:
    max(n_test, 1) of them), evaluation being its rows and a prediction per cluster."""
    d, k = s["d"], s["k"]

    def evaluation(rows):
        return 4 * rows * d + 4 * rows + k * 4 * rows

    return max(_synthetic_round_per_client(s, local_training), evaluation(s["n"]),
               evaluation(max(s["n_test"], 1)))


def _synthetic_state(s: dict, copies: int, algorithm: str) -> int:
    """The state of `copies` runs: the cluster models [k, d] (FedAvg: one [d]) and the round
    counter; HypCluster and CFL also remember every client's cluster ([m] int32; CFL a
    cluster count too). IFCA with every client in every round keeps nothing per client."""
    k, d, m = s["k"], s["d"], s["m"]
    models = 4 * d if algorithm == "fedavg" else 4 * k * d
    per_client = 4 * m if algorithm in ("hypcluster", "cfl") else 0
    counters = 8 if algorithm == "cfl" else 4
    return copies * (models + per_client + counters)


def _planned(s: dict, copies: int, algorithm: str | None = None):
    """The executor's chunk for a synthetic run of `copies` copies under memory_budget_gb."""
    footprint = ifca_synthetic.footprint_of(s, copies=copies, algorithm=algorithm)
    return Execution(memory_budget=s["memory_budget_gb"] * 2**30).client_chunk(footprint)


def _synthetic_chunk(s: dict, copies: int, per_client_models: bool, local_training: bool,
                     algorithm: str):
    m = s["m"]
    train = 4 * m * (s["n"] * s["d"] + s["n"] + 2)  # x, y, num_examples, cluster
    resident = train + (2 * copies * m * 4 * s["d"] if per_client_models else 0)
    state = 0 if per_client_models else _synthetic_state(s, copies, algorithm)
    budget = s["memory_budget_gb"] * 2**30 - 2 * state  # this round's state and the next
    return _chunk(m, copies * _synthetic_per_client(s, local_training), budget - resident)


SYNTHETIC = [  # (settings, copies, algorithm, the chunk chosen before the move)
    ({"memory_budget_gb": 0.2}, 10, "ifca", 34),
    ({"memory_budget_gb": 0.2}, 10, "local", 34),
    ({"memory_budget_gb": 0.1}, 5, "oneshot", 25),
    ({"memory_budget_gb": 0.3, "option": "model"}, 10, "ifca", 50),
    ({"memory_budget_gb": 0.05, "m": 400, "d": 100}, 3, "cfl", 200),
    # 143 before the test set's evaluation (n_test = 100 rows per client) was counted
    ({"memory_budget_gb": 0.5, "m": 1000, "n": 50}, 10, "hypcluster", 77),
    ({"memory_budget_gb": 0.0}, 10, "fedavg", None),
]


@pytest.mark.parametrize("over,copies,algorithm,pinned", SYNTHETIC)
def test_synthetic_client_chunk(over, copies, algorithm, pinned):
    s = {**ifca_synthetic.EXPERIMENT.defaults(), **over, "algorithm": algorithm}
    got = _planned(s, copies, algorithm)
    assert got == pinned
    if s["memory_budget_gb"]:
        local = not (algorithm == "ifca" and s["option"] == "gradient")
        assert got == _synthetic_chunk(s, copies, algorithm in ("local", "oneshot"), local,
                                       algorithm)


def test_synthetic_refuses_what_the_machine_cannot_hold():
    s = {**ifca_synthetic.EXPERIMENT.defaults(), "m": 10**6}
    with pytest.raises(ValueError, match=r"needs about .* \(m=1000000, n=100, n_test=100, "
                       r"d=1000, 10 copies: restarts × seeds\), more than this machine's"):
        _planned(s, 10)


ISSUE_SHAPE = {"n": 10, "d": 10, "k": 4}  # issue 20's runs; 10 restarts, n_test = 100


def test_generated_plan_counts_restarts_and_the_test_evaluation():
    s = {**ifca_synthetic.EXPERIMENT.defaults(), **ISSUE_SHAPE, "m": 10**8, "clients": "generated"}
    n, d, k, nt, restarts = 10, 10, 4, 100, 10
    round_ = 4 * n * d + 4 * n + 2 * k * 4 * n  # rows, k predictions and their VJP: 760 B
    test_eval = 4 * nt * d + 4 * nt + k * 4 * nt  # 100 test rows, k predictions: 6000 B
    chunk = _chunk(10**8, restarts * max(round_, test_eval), memory.GENERATED_WORK_BYTES)
    assert _planned(s, restarts) == chunk == 17893


def test_generated_plan_counts_per_client_state(monkeypatch):
    # With partial participation IFCA keeps [restarts, m] int32 assignments and stability
    # counters, this round's and the next: 2 · 10 · 8 B per client.
    monkeypatch.setattr(memory, "machine_bytes", lambda: 24 * 2**30)
    s = {**ifca_synthetic.EXPERIMENT.defaults(), **ISSUE_SHAPE, "clients": "generated",
         "participation": 0.5}
    state = 10 * (4 * 4 * 10 + 4 + 2 * 4 * 2 * 10**8)  # m = 2·10⁸: models, round, [m] × 2
    peak = 2 * state + 17893 * 10 * 6000  # the chunk as above (m = 2·10⁸ chunks the same)
    assert peak > 0.8 * 24 * 2**30
    with pytest.raises(ValueError, match=rf"needs about {peak / 2**30:.3g} GiB \(m=200000000, "
                       r"n=10, n_test=100, d=10, 10 copies: restarts × seeds, generated "):
        _planned({**s, "m": 2 * 10**8}, 10)
    assert _planned({**s, "m": 10**8}, 10) == 17893


def test_copies_plan_counts_building_the_data(monkeypatch):
    # m = 10⁶ stored copies were approved and then killed at 19.7 GB: evaluating 100 test
    # rows per client, all clients at once, and one jitted draw of every client (~5x the
    # data: train x, y, counts, clusters; test likewise) were not counted.
    monkeypatch.setattr(memory, "machine_bytes", lambda: 24 * 2**30)
    m = 10**6
    s = {**ifca_synthetic.EXPERIMENT.defaults(), **ISSUE_SHAPE, "m": m, "clients": "copies"}
    data = 4 * m * (10 * 10 + 10 + 2) + 4 * m * (100 * 10 + 100 + 2)
    state = 10 * (4 * 4 * 10 + 4)  # 10 restarts' [k, d] models and round counters
    unchunked = data + 2 * state + 10 * 6000 * m  # the test evaluation of every client
    describe = r"\(m=1000000, n=10, n_test=100, d=10, 10 copies.*or set clients=generated"
    with pytest.raises(ValueError, match=rf"needs about {unchunked / 2**30:.3g} GiB {describe}"):
        ifca_synthetic.EXPERIMENT.validate(s, "run")
    build = 5 * data  # a 12 GiB budget chunks the clients; building them still won't fit
    assert build > 0.8 * 24 * 2**30
    with pytest.raises(ValueError, match=rf"needs about {build / 2**30:.3g} GiB {describe}"):
        ifca_synthetic.EXPERIMENT.validate({**s, "memory_budget_gb": 12.0}, "run")


@pytest.mark.parametrize("over,pinned", [({}, 482081600), ({"restarts": 3, "m": 40, "n_test": 0},
                                                           64416800)])
def test_synthetic_sweep_pair_bytes_and_chunk(over, pinned):
    s = {**ifca_synthetic.EXPERIMENT.defaults(), **over}
    m, n, d = s["m"], s["n"], s["d"]
    nt = max(s["n_test"], 1)  # n_test = 0 still builds one test row per client
    data = 4 * m * (n * d + n + 2) + 4 * m * (nt * d + nt + 2)
    expected = data + s["restarts"] * m * _synthetic_round_per_client(s, local_training=False)
    assert synthetic_sweep.pair_bytes(s) == expected == pinned
    assert memory.items_per_chunk(7, expected, 3.5 * expected) == 3
    assert memory.items_per_chunk(7, expected, 0.5 * expected) == 1
    assert memory.items_per_chunk(7, expected, 100 * expected) == 7


SUCCESS = [  # (preset, m, n, budget GiB, seeds per chunk chosen before the move)
    ("ifca-success-small", 80, 5, 0.01, 13),
    ("ifca-success-small", 400, 200, 1.0, 6),
    ("ifca-success-r-noise-k2", 100, 100, 1.0, 8),
    ("ifca-success-m-n-k4", 100, 100, 1.0, 7),
    ("ifca-success-m-n-k4", 80, 5, 1.0, 40),
    ("ifca-success-m-n-k4", 400, 200, 1.0, 1),
]


@pytest.mark.parametrize("preset,m,n,gb,pinned", SUCCESS)
def test_success_seeds_per_chunk(preset, m, n, gb, pinned):
    cell = {**PRESETS[preset].defaults, "m": m, "n": n, "memory_budget_gb": gb}
    runs = len(cell["lr"]) * cell["restarts"]
    # X and y three times over, and 4 [rows, k] buffers per (lr, restart)
    per_seed = 4 * m * n * (cell["d"] + 1) * 3 + 4 * m * n * cell["k"] * runs * 4
    expected = int(max(1, min(cell["seeds"], gb * 2**30 // per_seed)))
    assert ifca_success.SUCCESS.sweep.seeds_per_chunk(cell) == expected == pinned


@pytest.fixture(scope="module")
def digits():
    # Stored copies: the formula below counts the resident client rows as a copy holds them
    # (views hold less; the planner counts them as copies, an over-estimate).
    s = {**PRESETS["ifca-rotated-digits"].defaults, "clients": "copies"}
    return s, images.DIGITS.problem(s)


IMAGES = [  # (method, budget GiB, seeds, the chunk chosen on a CPU, on an accelerator)
    ("ifca", 0.0, 3, None, None),
    ("ifca", 0.0, 200, 4, None),  # no budget, on a CPU: 256 MiB of working memory a chunk
    ("ifca", 0.005, 3, 4, 4),
    ("cfl", 0.02, 3, 20, 20),
    ("ifca_ws", 0.02, 3, 20, 20),
    ("local", 0.02, 3, 15, 15),
    ("oneshot", 0.02, 3, 15, 15),
    ("oneshot", 0.0, 200, 7, 29),
    ("local", 0.0, 3, None, None),
    ("local", 0.0, 2000, 1, 3),  # per-client models: 1 GiB a chunk on an accelerator
]


@pytest.mark.parametrize("name,gb,seeds,on_cpu,on_accelerator", IMAGES)
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_images_client_chunk(digits, monkeypatch, name, gb, seeds, on_cpu, on_accelerator,
                             backend):
    s, problem = digits
    s = {**s, "memory_budget_gb": gb, "seeds": seeds}
    model = problem["model"][SPLIT_MODEL in images.DIGITS.method_table[name].needs]
    monkeypatch.setattr(jax, "default_backend", lambda: backend)  # only the chunk rule reads it
    got = Execution(memory_budget=gb * 2**30).client_chunk(
        images.DIGITS.footprint(name, s, problem))
    assert got == (on_cpu if backend == "cpu" else on_accelerator)
    # By hand: one seed's clients; the model's own params and activations are measured.
    train = copy_at(problem["train"], 0)
    m, per_client_models = train.num_clients, name in ("local", "oneshot")
    params = memory.tree_bytes(jax.eval_shape(model.init, jax.random.key(0)))
    x = jax.ShapeDtypeStruct(train.x.shape[1:], train.x.dtype)
    act = memory.activation_bytes(model, jax.eval_shape(model.init, jax.random.key(0)), x)
    rows = memory.tree_bytes([x, jax.ShapeDtypeStruct(train.y.shape[1:], train.y.dtype)])
    if gb:  # local training with k cluster models
        per_client = seeds * (rows + s["k"] * act + 5 * params + 2 * act)
        resident = memory.tree_bytes(train) + (2 * seeds * m * params if per_client_models
                                               else 0)
        assert got == _chunk(m, per_client, gb * 2**30 - resident)
    elif backend == "cpu":  # 256 MiB of working memory at a time, k losses unless per client
        losses = 1 if per_client_models else s["k"]
        assert got == _chunk(m, seeds * (rows + losses * act + 5 * params + 2 * act), 2**28)
    elif per_client_models:  # 1 GiB of one model per client at a time
        assert got == _chunk(m, seeds * (rows + act + 5 * params + 2 * act), 2**30)
    else:
        assert got is None


def test_items_per_chunk_refuses_bad_input():
    with pytest.raises(ValueError, match="total"):
        memory.items_per_chunk(-1, 10, 100)
    with pytest.raises(ValueError, match="bytes_per_item"):
        memory.items_per_chunk(3, 0, 100)
