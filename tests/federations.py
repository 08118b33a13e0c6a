"""Small federations shared by the tests that run in subprocesses (forced devices).

Importable from a `python -c` script through `subprocess_env`, which puts this
folder on PYTHONPATH.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

TESTS_DIR = str(Path(__file__).resolve().parent)


def xla_flags(devices: int) -> str:
    """XLA_FLAGS forcing `devices` CPU devices, kept after the session's flags (conftest.py)."""
    base = os.environ.get("XLA_FLAGS", "")
    kept = " ".join(f for f in base.split() if "xla_force_host_platform_device_count" not in f)
    return f"{kept} --xla_force_host_platform_device_count={devices}".strip()


def default_optimization_env() -> dict[str, str]:
    """os.environ without the session's `--xla_backend_optimization_level` (conftest.py): for
    the few compute-bound tests whose run time, not compile time, dominates."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_backend_optimization_level" not in f)
    return {**os.environ, "XLA_FLAGS": flags}


def subprocess_env(devices: int) -> dict[str, str]:
    """os.environ with `devices` forced CPU devices and this folder importable."""
    path = os.pathsep.join(p for p in (TESTS_DIR, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "XLA_FLAGS": xla_flags(devices), "PYTHONPATH": path}


def evaluate_as_run(algorithm, state, data, mesh=None):
    """Every client's evaluation through the program `simulate.run` compiled for it (the
    same `backend.jit` of `algorithm.evaluate`, on the data as run placed it: sharded on a
    mesh), so a test's check of a run's final state compiles nothing new."""
    from fedjax_sim import backend, parallel

    placed = data if mesh is None else parallel.place_inputs(data, mesh)
    return backend.jit(algorithm.evaluate, backend.feature_size(placed))(state, placed)


def run_once(tmp_path_factory, name: str, compute):
    """compute() (JSON-able) once per test session, also when pytest-xdist spreads the tests
    that need it over several workers: the first worker to need it computes it while holding
    a file lock, and leaves it in the session's common temporary folder for the others."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, shared by its workers (xdist's own recipe)
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        try:
            import fcntl
        except ImportError:  # no fcntl (Windows): each worker computes it
            fcntl = None
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        result = compute()
        path.write_text(json.dumps(result))
        return result


def eight_clients(counts=(1, 6, 4, 6, 2, 5, 6, 3)):
    """8 ragged clients (rows per client: `counts`, d=5) of two linear clusters; (data, model)."""
    import numpy as np

    from fedjax_sim import FederatedData, linear_regression

    rng = np.random.default_rng(0)
    truth = [0, 0, 0, 0, 1, 1, 1, 1]
    theta = np.stack([np.ones(5), -np.ones(5)]).astype(np.float32)
    xs = [rng.normal(size=(c, 5)).astype(np.float32) for c in counts]
    ys = [
        x @ theta[t] + 0.1 * rng.normal(size=len(x)).astype(np.float32)
        for x, t in zip(xs, truth, strict=True)
    ]
    return FederatedData.from_clients(xs, ys, cluster=truth), linear_regression(5)


def recording_context():
    """A RunContext whose on_method records (name, per_seed, history) as methods finish."""
    from fedjax_sim.experiments.base import RunContext

    finished = []
    ctx = RunContext(progress=False,
                     on_method=lambda name, per_seed, history: finished.append(
                         (name, per_seed, history)))
    return ctx, finished


def assert_reported_as_finished(finished, comparison, methods):
    """Each method was reported once, in order, with the comparison's finals and history."""
    assert [name for name, _, _ in finished] == list(methods)
    for name, per_seed, history in finished:
        assert history == comparison.histories[name]
        for metric, values in comparison.per_seed[name].items():
            np.testing.assert_array_equal(per_seed[metric], values)


def trained(preset: str, name: str, s: dict):
    """(problem, the method's run, its state after s["rounds"] rounds) of `preset`'s
    experiment with settings `s` (the runner's init and round keys)."""
    import jax

    from fedjax_sim import simulate
    from fedjax_sim.experiments import get_preset, study

    experiment = get_preset(preset).experiment
    problem = experiment.problem(s)
    run = study.method_run(experiment, name, s, problem)
    key_init, key_rounds = jax.random.split(run.key)
    state = jax.jit(run.algorithm.init)(key_init, run.data)
    state, _ = simulate.scan_rounds(run.algorithm, state, run.data, key_rounds, 0, run.rounds)
    return problem, run, state


def local_gd(ref, theta, x, y, n, lr, steps, extra=lambda th: 0.0):
    """`steps` full-batch GD steps on F_i (+ a gradient term `extra`), float64: one client's
    local work as the papers write it, for the loops the tests compare rounds with."""
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(int(steps)):
        theta = theta - lr * (ref.grad(theta, x, y, n) + extra(theta))
    return theta


def weighted_mean(values, weights, fallback):
    """Σ w_i v_i / Σ w_i, or `fallback` when every weight is 0 (a round nobody trained in)."""
    total = sum(weights)
    if total == 0:
        return fallback
    return sum(w * v for w, v in zip(weights, values, strict=True)) / total


def work_table(m, steps):
    """τ_i per client for `Work(per_client=...)`: every value 0..steps in turn, so that among
    a few clients one holding data takes no step at all."""
    return tuple(int(t) for t in np.arange(m) % (steps + 1))


def cohort_slots(key, m, participation, systems=None, *, weights=None):
    """The round's slots as the cohort op draws them from `key`: (ids, slot keys, reports,
    straggles), every slot reporting and none straggling without `systems`."""
    from fedjax_sim.algorithms.base import cohort_size
    from fedjax_sim.systems import NO_SYSTEMS

    c = _sample_cohort()(key, m, cohort_size(m, participation), weights=weights,
                         systems=NO_SYSTEMS if systems is None else systems)
    s = c.ids.shape[0]
    reports = np.ones(s, bool) if c.reports is None else np.asarray(c.reports)
    straggles = np.zeros(s, bool) if c.straggles is None else np.asarray(c.straggles)
    return np.asarray(c.ids).tolist(), c.keys, reports, straggles


@functools.cache
def _sample_cohort():
    """`ops.sample_cohort`, jitted once (a loop calls it every round)."""
    import jax

    from fedjax_sim.ops import sample_cohort

    return jax.jit(sample_cohort, static_argnums=(1, 2), static_argnames=("systems",))


def slot_steps(taus, keys, straggles):
    """τ of each slot: its client's τ_i, or a straggler's uniform 1..τ_i − 1 drawn from its
    key (τ_i itself when τ_i ≤ 1)."""
    from fedjax_sim.ops.work import straggler_steps

    return [int(straggler_steps(k, t)) if f else t
            for t, k, f in zip(taus, keys, straggles, strict=True)]


def brute_bipartition(sim, members):
    """CFL's split by brute force: argmin over bipartitions (c₁ holding members[0]) of the
    largest cross similarity; (score, c₂, how many bipartitions reach the score)."""
    import itertools

    best, best_c2, ties = np.inf, None, 0
    rest = members[1:]
    for r in range(len(rest)):
        for c1_rest in itertools.combinations(rest, r):
            c1 = [members[0], *c1_rest]
            c2 = [i for i in members if i not in c1]
            score = max(sim[i, j] for i in c1 for j in c2)
            if score < best:
                best, best_c2, ties = score, c2, 1
            elif score == best:
                ties += 1
    return best, set(best_c2), ties


def np_simplex_projection(v):
    """Euclidean projection onto the probability simplex, sort method (Held et al.; FedTorch's
    projection_simplex_sort), float64."""
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    j = np.arange(1, len(v) + 1)
    rho = j[u - css / j > 0][-1]
    return np.maximum(v - css[rho - 1] / rho, 0.0)
