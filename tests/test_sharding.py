"""Sharded == unsharded: every algorithm on 1, 2 and 4 (forced CPU) devices, and two processes.

JAX fixes its device count when it initialises, so each configuration runs in a
fresh subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from federations import run_once, subprocess_env, xla_flags

from fedjax_sim import ALGORITHMS

# Settings of each registered algorithm for the check; a new algorithm must be added here.
# The personalised/clustered/agnostic baselines (issue 19) and FedProx, SCAFFOLD, q-FFL and
# FedAvg with a server optimizer (FedOpt) are checked here with the settings their own test
# files used to run on devices (minibatches, partial participation, client chunks, server
# optimizers, k-means++ init), in the same one subprocess as every other algorithm.
#
# A case is JSON (it goes to the subprocess): "training" (and "pretraining", "personal",
# "central") are `sgd(**value)`; "server_optimizer"/"server_lr" wrap the algorithm in
# `with_server_optimizer`; "client_chunk" is the data's execution plan (`planned`); the
# other keys are the factory's settings.
TRAIN = {"learning_rate": 0.1, "steps": 2, "batch_size": 3}
ALGORITHM_KWARGS = {
    "ifca": [
        {"training": {"learning_rate": 0.1}, "num_clusters": 2},
        {"training": TRAIN, "num_clusters": 2, "option": "model", "participation": 0.5,
         "stable_rounds": 2},
    ],
    "fedavg": [{"training": TRAIN, "participation": 0.5, "server_optimizer": "adam",
                "server_lr": 0.05}],
    "fedavgm": [{"training": TRAIN, "participation": 0.5}],
    "fedadam": [{"training": TRAIN, "participation": 0.5, "server_lr": 0.05}],
    "fedyogi": [{"training": TRAIN, "participation": 0.5, "server_lr": 0.05}],
    "fedadagrad": [{"training": TRAIN, "participation": 0.5, "server_lr": 0.05}],
    "local": [{"training": TRAIN}],
    "oneshot": [{"training": {"learning_rate": 0.1}, "num_clusters": 2,
                 "pretraining": {"learning_rate": 0.1, "steps": 10}}],
    # Mixed FL: the script adds a server-side regularizer as the centralized loss.
    "mixed_parallel": [{"training": TRAIN, "participation": 0.5}],
    "mixed_gt1": [{"training": TRAIN}],
    "mixed_gt2": [{"training": {"learning_rate": 0.1, "steps": 2}, "participation": 0.5}],
    "oracle": [{"training": TRAIN, "participation": 0.5}],
    "drfa": [{"training": TRAIN, "participation": 0.5, "lambda_lr": 0.05}],
    "drflm": [{"training": TRAIN, "participation": 0.5, "lambda_lr": 0.05}],
    "afl": [{"training": TRAIN, "participation": 0.5, "lambda_lr": 0.1}],
    "hypcluster": [{"training": TRAIN, "num_clusters": 2, "participation": 0.5,
                    "init": "kmeans++"}],
    # eps1 = 10 splits a cluster within the rounds run (test_compared_cfl_runs_split_a_cluster).
    "cfl": [{"training": {"learning_rate": 0.1, "steps": 2}, "participation": 0.75,
             "max_clusters": 3, "eps1": 10.0, "eps2": 0.0}],
    "ditto": [{"training": TRAIN, "participation": 0.5, "ditto_lambda": 0.5}],
    "robust_ifca": [{"training": TRAIN, "num_clusters": 2, "participation": 0.5,
                     "lambda_lr": 0.1}],
    "fedprox": [{"training": TRAIN, "participation": 0.5, "mu": 0.3,
                 "server_optimizer": "sgdm"}],
    "scaffold": [{"training": TRAIN, "participation": 0.5, "client_chunk": 2,
                  "server_lr": 0.8}],
    "qffl": [{"training": TRAIN, "participation": 0.5, "q": 2.0, "client_chunk": 3}],
    # Heterogeneous systems: "work" is the training's `Work(**value)`, "systems" wraps the
    # algorithm in `with_systems(Systems(**value))`: the same masks on 1 and 4 devices.
    "fednova": [{"training": {"learning_rate": 0.1, "steps": 4, "batch_size": 3},
                 "work": {"low": 1, "per_round": True}, "participation": 0.5,
                 "systems": {"availability": 0.7, "dropout": 0.2, "stragglers": 0.5}},
                {"training": TRAIN, "work": {"per_client": [2, 0, 1, 2, 1, 2, 2, 1]},
                 "momentum": 0.5, "client_chunk": 3,
                 "systems": {"stragglers": 0.5, "straggler_policy": "drop"}}],
    # Asynchronous: one round is one server step (default clock: equal speeds).
    "fedbuff": [{"training": TRAIN, "concurrency": 5, "buffer_size": 2, "max_staleness": 2,
                 "systems": {"availability": 0.7, "dropout": 0.2}}],
    "fedasync": [{"training": TRAIN, "concurrency": 4, "alpha": 0.5, "client_chunk": 3}],
    "async_ifca": [{"training": TRAIN, "num_clusters": 2, "concurrency": 5, "buffer_size": 3,
                    "max_staleness": 2, "client_chunk": 2}],
}

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from fedjax_sim import ALGORITHMS, simulate
    from fedjax_sim.execution import Execution
    from federations import eight_clients, evaluate_as_run
    from fedjax_sim.algorithms import Work, sgd, with_server_optimizer, with_systems
    from fedjax_sim.systems import Systems
    from fedjax_sim.execution import planned
    from fedjax_sim.parallel import make_mesh
    from fedjax_sim.algorithms.mixed import l2_regularizer

    def build(name, case, model, data):
        kwargs = dict(case)
        chunk = kwargs.pop("client_chunk", None)
        server = kwargs.pop("server_optimizer", None)
        server_lr = kwargs.pop("server_lr", None) if server else None
        work = kwargs.pop("work", None)
        systems = kwargs.pop("systems", None)
        for field in ("training", "pretraining", "personal", "central"):
            if field in kwargs:
                kwargs[field] = sgd(**kwargs[field])
        if work is not None:
            kwargs["training"] = kwargs["training"].replace(work=Work(**work))
        if ALGORITHMS[name].__module__ == "fedjax_sim.algorithms.mixed":
            kwargs["central_loss"] = l2_regularizer(0.1)
        algorithm = ALGORITHMS[name](model, kwargs.pop("training"), **kwargs)
        if server:
            algorithm = with_server_optimizer(algorithm, server, server_lr)
        if systems is not None:
            algorithm = with_systems(algorithm, Systems(**systems))
        return algorithm, (data if chunk is None else planned(data, client_chunk=chunk))

    cases = json.loads(sys.argv[1])
    clients, model = eight_clients()
    out = {}
    for devices in (1, 2, 4):
        mesh = None if devices == 1 else make_mesh(devices)
        for name, index, case in cases:
            if devices == 2 and (name, index) != ("ifca", 0):
                continue  # 2 devices for one algorithm; 1 vs 4 for all of them
            algorithm, data = build(name, case, model, clients)
            state, history = simulate.run(
                algorithm, data, jax.random.key(7), rounds=5, eval_every=5,
                execution=Execution(progress=False, mesh=mesh),
            )
            ev = evaluate_as_run(algorithm, state, data, mesh)
            out[f"{name}/{index}/{devices}"] = {
                "leaves": [np.asarray(x).tolist() for x in jax.tree.leaves(state)],
                "assignment": np.asarray(ev["assignment"]).tolist(),
                "client_loss": np.asarray(ev["client_loss"]).tolist(),
                "history": history,
            }
    print("RESULT" + json.dumps(out))
    """
)


def _run(script_args, devices=4, timeout=600):
    env = subprocess_env(devices)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *script_args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_every_registered_algorithm_has_a_sharding_case():
    assert set(ALGORITHM_KWARGS) == set(ALGORITHMS)


CASES = [
    (name, i, kwargs)
    for name, kwarg_list in ALGORITHM_KWARGS.items()
    for i, kwargs in enumerate(kwarg_list)
]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Every case on 1 and 4 devices (ifca case 0 also on 2): one subprocess for them all
    (a launch costs seconds; each case compiles its own programs anyway), run once per
    session and shared by the xdist workers."""
    return run_once(tmp_path_factory, "sharded_runs",
                    lambda: _run([json.dumps([list(case) for case in CASES])]))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "i", "kwargs"), CASES, ids=[f"{n}-{i}" for n, i, _ in CASES])
def test_sharded_equals_unsharded(sharded_runs, name, i, kwargs):
    results = sharded_runs
    base = results[f"{name}/{i}/1"]
    assert f"{name}/{i}/4" in results
    for devices in (2, 4):
        if f"{name}/{i}/{devices}" not in results:
            continue
        got = results[f"{name}/{i}/{devices}"]
        where = f"{name} case {i} on {devices} devices"
        assert got["assignment"] == base["assignment"], where
        np.testing.assert_allclose(
            got["client_loss"], base["client_loss"], rtol=1e-5, atol=1e-6, err_msg=where
        )
        assert len(got["leaves"]) == len(base["leaves"]), where
        for a, b in zip(got["leaves"], base["leaves"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=where)
        assert len(got["history"]) == len(base["history"]) == 2, where
        for row_a, row_b in zip(got["history"], base["history"], strict=True):
            assert row_a.keys() == row_b.keys(), where
            for key in row_a:
                np.testing.assert_allclose(row_a[key], row_b[key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{where}: {key}")
    if (name, i) == ("ifca", 0):
        assert f"{name}/{i}/2" in results


@pytest.mark.slow
def test_compared_cfl_runs_split_a_cluster(sharded_runs):
    # CFLState's leaves: cluster_params (one leaf for the linear model), assignment,
    # num_clusters, round. The runs compared above went through a split, so the split
    # (its bipartition of the clients) is checked on devices too.
    num_clusters = sharded_runs["cfl/0/1"]["leaves"][2]
    assert isinstance(num_clusters, int) and num_clusters > 1


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _cli(args, devices=1, env_extra=None, **kw):
    env = {**os.environ, "XLA_FLAGS": xla_flags(devices),
           **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "fedjax_sim.cli", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw,
    )


def _assert_same_metrics(a, b, rtol=1e-5):
    rows_a, rows_b = _rows(a / "metrics.csv"), _rows(b / "metrics.csv")
    assert [r["round"] for r in rows_a] == [r["round"] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra["cluster_accuracy"] == rb["cluster_accuracy"]
        for key in ra:
            np.testing.assert_allclose(float(ra[key]), float(rb[key]), rtol=rtol, atol=1e-7,
                                       err_msg=key)


@pytest.mark.slow
def test_sweep_on_four_devices_equals_one(tmp_path):
    args = ["sweep", "ifca-success-small", "--set", "R=0.4", "seeds=6", "rounds=20",
            "restarts=2", "--no-progress", "--out"]
    one = _cli([*args, str(tmp_path / "one")], devices=1)
    assert one.wait(timeout=600) == 0, one.stdout.read()
    four = _cli([*args, str(tmp_path / "four"), "--devices", "4"], devices=4)
    assert four.wait(timeout=600) == 0, four.stdout.read()
    assert json.loads((tmp_path / "four" / "config.json").read_text())["mesh_devices"] == 4
    rows_one = _rows(tmp_path / "one" / "trials.csv")
    rows_four = _rows(tmp_path / "four" / "trials.csv")
    assert len(rows_one) == len(rows_four) == 6
    for a, b in zip(rows_one, rows_four, strict=True):
        assert (a["R"], a["data_seed"], a["success"]) == (b["R"], b["data_seed"], b["success"])
        np.testing.assert_allclose(float(a["best_min_dist"]), float(b["best_min_dist"]),
                                   rtol=1e-4)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    """`--distributed` on two local CPU processes (gloo) reproduces the one-process run."""
    settings = ["--set", "rounds=20", "eval_every=10", "restarts=3", "--no-progress"]
    single = _cli(["run", "ifca-synthetic-tiny", *settings, "--out", str(tmp_path / "one")])
    assert single.wait(timeout=600) == 0, single.stdout.read()
    port = _free_port()
    procs = [
        _cli(["run", "ifca-synthetic-tiny", *settings, "--out", str(tmp_path / "two"),
              "--distributed", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
              "--process-id", str(i)])
        for i in range(2)
    ]
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [p.stdout.read() for p in procs]
    assert codes == [0, 0], logs
    config = json.loads((tmp_path / "two" / "config.json").read_text())
    assert config["processes"] == 2 and config["mesh_devices"] == 2
    _assert_same_metrics(tmp_path / "one", tmp_path / "two")
    assert "wrote" in logs[0] and "wrote" not in logs[1]  # only process 0 writes
