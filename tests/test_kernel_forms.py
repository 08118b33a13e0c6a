"""The linear kernel's forms (`ops.linear.LINEAR_FORMS`) and their choice per machine
(`fedjax_sim.tuning`): every form against a per-client loop written here from the paper,
forced forms agreeing, a stored choice reused, a corrupt or foreign one ignored, and a
resumed run taking its checkpoint's form."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim import backend, memory, simulate, tuning
from fedjax_sim.algorithms import fedavg, ifca, sgd, with_initial_params, with_restarts
from fedjax_sim.data import FederatedData, linear_mixture
from fedjax_sim.execution import Checkpoints, Execution, plan_of, planned
from fedjax_sim.models import linear_regression
from fedjax_sim.ops import sample_cohort
from fedjax_sim.ops.linear import DEFAULT_LINEAR_FORM, LINEAR_FORMS


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A store of this test's own, and forms chosen, not forced (conftest.py forces one)."""
    path = tmp_path / "kernel_forms.json"
    monkeypatch.setenv(tuning.STORE_ENV, str(path))
    monkeypatch.delenv(tuning.FORM_ENV, raising=False)
    return path


def _ragged(d: int, seed: int = 0) -> FederatedData:
    """Ten clients of 5, 1, 0, 3, ... rows: a one-row client and an empty one."""
    rng = np.random.default_rng(seed)
    sizes = [5, 1, 0, 3, 4, 2, 5, 3, 1, 4]
    theta = rng.normal(size=(3, d)).astype(np.float32)
    xs = [rng.normal(size=(s, d)).astype(np.float32) for s in sizes]
    ys = [(x @ theta[i % 3] + 0.1 * rng.normal(size=len(x))).astype(np.float32)
          for i, x in enumerate(xs)]
    return FederatedData.from_clients(xs, ys)


def _loss(theta, x, y):
    """F_i(θ) = (1/n_i) Σ_rows (xᵀθ − y)² (float64); 0 for a client without rows."""
    return float(np.mean((x @ theta - y) ** 2)) if len(y) else 0.0


def _grad(theta, x, y):
    return 2.0 / len(y) * x.T @ (x @ theta - y) if len(y) else np.zeros_like(theta)


@pytest.mark.parametrize("participation", [1.0, 0.5], ids=["full", "partial"])
@pytest.mark.parametrize(("d", "chunk"), [(10, None), (63, None), (1000, None), (10, 3),
                                          (1000, 3)])
@pytest.mark.parametrize("form", LINEAR_FORMS)
def test_every_form_equals_the_per_client_loop(form, d, participation, chunk):
    """IFCA option I in each form against the paper's round as a loop: each client of the
    cohort picks ĵ_i = argmin_j F_i(θ_j) and θ_j ← θ_j − (γ/m) Σ_{i: ĵ_i = j} ∇F_i(θ_j),
    m the clients holding data; compiled with the options that go with the form, over
    the whole cohort and in chunks (the tuning's chunked candidates)."""
    data = _ragged(d, seed=d)
    k, lr = 3, 0.05
    theta0 = np.random.default_rng(1).normal(size=(k, d)).astype(np.float32)
    alg = with_initial_params(
        ifca(linear_regression(d), sgd(lr), num_clusters=k, participation=participation),
        lambda key: jnp.asarray(theta0))
    placed = planned(data, linear_form=form, client_chunk=chunk)
    assert plan_of(placed).linear_form == form
    round_ = backend.jit(alg.round, d, linear_form=form)
    state = alg.init(jax.random.key(0), placed)
    counts = np.asarray(data.num_examples)
    xs = [np.asarray(data.x[i, :c], np.float64) for i, c in enumerate(counts)]
    ys = [np.asarray(data.y[i, :c], np.float64) for i, c in enumerate(counts)]
    m, holding = data.num_clients, int(np.sum(counts > 0))
    theta = theta0.astype(np.float64)
    for key in jax.random.split(jax.random.key(2), 2):
        state, _ = round_(state, placed, key)
        s = max(1, int(round(participation * m)))
        cohort = np.asarray(sample_cohort(key, m, s).ids)
        sums = np.zeros_like(theta)
        for i in cohort:
            if counts[i] == 0:
                continue
            j = int(np.argmin([_loss(theta[c], xs[i], ys[i]) for c in range(k)]))
            assert int(state.assignment[i]) == j
            sums[j] += _grad(theta[j], xs[i], ys[i])
        theta = theta - lr * sums / holding
        np.testing.assert_allclose(state.cluster_params, theta, rtol=2e-4, atol=2e-5)


def _problem(m=300, d=10):
    return linear_mixture(jax.random.key(0), k=4, m=m, n=10, d=d, sigma=0.1, R=0.5).train


def _ifca(d=10):
    return with_restarts(ifca(linear_regression(d), sgd(0.1), num_clusters=4), 2)


@pytest.mark.parametrize("d", [10, 100])
def test_forced_forms_give_the_same_assignments_and_models(d, monkeypatch):
    data = _problem(d=d)
    out = {}
    for form in LINEAR_FORMS:
        monkeypatch.setenv(tuning.FORM_ENV, form)
        timing = {}
        out[form] = simulate.run(_ifca(d), data, jax.random.key(1), rounds=15, eval_every=15,
                                 execution=Execution(progress=False, timing=timing))[0]
        assert timing["kernel_form"] == {"form": form, "source": "forced"}
    base = out[DEFAULT_LINEAR_FORM]
    for form, state in out.items():
        np.testing.assert_array_equal(state.assignment, base.assignment, err_msg=form)
        np.testing.assert_allclose(state.cluster_params, base.cluster_params, rtol=1e-6,
                                   atol=1e-6, err_msg=form)


def _fake_times(winner, calls):
    """tuning.time_forms stand-in: `winner` twice as fast as the rest; counts its calls."""
    def time_forms(run, samples=tuning.TUNE_SAMPLES):
        calls.append(sorted(run))
        for thunk in run.values():  # each candidate still compiles and runs
            jax.block_until_ready(thunk())
        return {form: 1.0 if form == winner else 2.0 for form in run}
    return time_forms


def _run(data, timing, alg=None):
    return simulate.run(alg or _ifca(), data, jax.random.key(1), rounds=6, eval_every=3,
                        execution=Execution(progress=False, timing=timing))[0]


def test_a_timed_choice_is_stored_and_reused(store, monkeypatch):
    data = _problem()
    calls = []
    monkeypatch.setattr(tuning, "time_forms", _fake_times("dot", calls))
    timing = {}
    _run(data, timing)
    assert timing["kernel_form"]["form"] == "dot"
    assert timing["kernel_form"]["source"] == "timed"
    assert len(calls) == 1 and set(calls[0]) <= set(LINEAR_FORMS) and "loop" in calls[0]
    entries = json.loads(store.read_text())["entries"]
    assert [e["form"] for e in entries.values()] == ["dot"]
    assert next(iter(entries.values()))["machine"] == tuning.machine()
    timing = {}
    _run(data, timing)  # the same program again: read back, nothing timed
    assert timing["kernel_form"] == {"form": "dot", "source": "stored"}
    assert len(calls) == 1


@pytest.mark.parametrize("damage", ["corrupt", "foreign", "unknown form"])
def test_a_corrupt_or_foreign_stored_choice_is_ignored(store, monkeypatch, damage):
    data = _problem()
    calls = []
    monkeypatch.setattr(tuning, "time_forms", _fake_times("dot", calls))
    _run(data, {})
    (key,) = json.loads(store.read_text())["entries"]
    if damage == "corrupt":
        store.write_text('{"entries": {"' + key + '": {"form": "do')
    else:
        entry = {"form": "dot_ynn", "machine": tuning.machine()}
        if damage == "foreign":
            entry["machine"] = {**entry["machine"], "cpu": {"model": "another CPU"}}
        else:
            entry["form"] = "no such form"
        store.write_text(json.dumps({"entries": {key: entry}}))
    timing = {}
    _run(data, timing)
    assert timing["kernel_form"]["source"] == "timed" and len(calls) == 2
    assert timing["kernel_form"]["form"] == "dot"
    assert json.loads(store.read_text())["entries"][key]["form"] == "dot"  # rewritten


def test_the_default_form_is_kept_unless_another_is_clearly_faster():
    assert tuning.fastest({"loop": 1.0, "dot": 0.97, "dot_ynn": 1.2}) == "loop"
    assert tuning.fastest({"loop": 1.0, "dot": 0.90, "dot_ynn": 0.93}) == "dot"
    assert tuning.fastest({"loop": 1.0, "dot": 0.93, "dot_ynn": 0.80}) == "dot_ynn"


def test_a_program_without_the_kernel_has_no_form(store, monkeypatch):
    calls = []
    monkeypatch.setattr(tuning, "time_forms", _fake_times("dot", calls))
    timing = {}
    alg = fedavg(linear_regression(10), sgd(0.1, steps=2))
    _run(_problem(), timing, alg)
    assert timing["kernel_form"] is None and not calls and not store.exists()


def test_a_bad_forced_form_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv(tuning.FORM_ENV, "fastest")
    with pytest.raises(ValueError, match="FEDJAX_SIM_KERNEL_FORM='fastest'.*loop, dot, dot_ynn"):
        _run(_problem(), {})


def test_a_resumed_run_takes_its_checkpoints_form(tmp_path, monkeypatch):
    """Killed after round 4 in form "dot", resumed under another forced form: the rounds
    after it still run in "dot", so the run equals an uninterrupted "dot" run bit for bit."""
    data = _problem()

    def run(rounds, where, form, resume=False):
        monkeypatch.setenv(tuning.FORM_ENV, form)
        timing = {}
        state, _ = simulate.run(_ifca(), data, jax.random.key(1), rounds=rounds, eval_every=2,
                                execution=Execution(progress=False, checkpoints=Checkpoints(where),
                                                    resume=resume, timing=timing))
        return state, timing["kernel_form"]

    whole, _ = run(8, tmp_path / "whole", "dot")
    run(4, tmp_path / "killed", "dot")
    resumed, form = run(8, tmp_path / "killed", "loop", resume=True)
    assert form == {"form": "dot", "source": "forced"}
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_compile_round_times_calls_one_by_one(store, monkeypatch):
    calls = []
    monkeypatch.setattr(tuning, "time_forms", _fake_times("dot_ynn", calls))
    data = _problem()
    alg = ifca(linear_regression(10), sgd(0.1), num_clusters=4)
    state = alg.init(jax.random.key(0), data)
    key = jax.random.key(1)
    round_fn, placed, choice = tuning.compile_round(alg, state, data, key)
    assert choice.source == "timed" and len(calls) == 1
    if "dot_ynn" in calls[0]:  # narrow features on a CPU whose jaxlib has YNNPACK dots
        assert choice.form == "dot_ynn"
    assert plan_of(placed).linear_form == choice.form
    new, _ = round_fn(state, placed, key)
    want, _ = jax.jit(alg.round)(state, data, key)
    np.testing.assert_array_equal(new.assignment, want.assignment)
    np.testing.assert_allclose(new.cluster_params, want.cluster_params, rtol=1e-6, atol=1e-6)
    # Per-call and scanned programs are stored apart.
    _run(data, {}, alg)
    assert len(calls) == 2 and len(json.loads(store.read_text())["entries"]) == 2


def test_config_json_records_the_form_that_ran(tmp_path):
    from fedjax_sim.experiments.runner import compare_preset, run_preset

    out = run_preset("ifca-synthetic-tiny", ["rounds=4", "eval_every=2"], tmp_path / "run",
                     progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["kernel_form"] == {"form": "loop", "source": "forced"}
    assert json.loads((out / "summary.json").read_text())["kernel_form"]["form"] == "loop"
    out = compare_preset("ifca-synthetic-tiny", ["rounds=4", "eval_every=2", "seeds=1"],
                         tmp_path / "cmp", progress=False)
    forms = json.loads((out / "config.json").read_text())["kernel_forms"]
    assert forms["ifca"] == {"form": "loop", "source": "forced"}
    assert "fedavg" not in forms  # no kernel with forms in its rounds


# --------------------------------------------------------------------- the chunked candidates


def _rows_bytes(n=10, d=10):
    return 4 * n * d + 4 * n  # one client's x [n, d] and y [n], float32


@pytest.mark.parametrize(("m", "chunk"), [(1000, None), (10**4, 3334), (10**5, 4762)])
def test_the_cache_chunk_of_the_headline_rows(m, chunk, monkeypatch):
    """Shapes only: with a 2 MiB core cache (this project's Intel Xeon's L2), the rows of
    (m, n, d) = (10⁴, 10, 10) (4.4 MB) are timed in 3 chunks of 3334 clients and those of
    10⁵ in 21 of 4762 (each chunk's rows ≤ 2 MiB); 10³ clients' rows fit at once."""
    monkeypatch.setattr(memory, "core_cache_bytes", lambda: 2 * 2**20)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    shapes = jax.eval_shape(lambda key: linear_mixture(key, k=4, m=m, n=10, d=10, sigma=0.1,
                                                       R=0.25).train, jax.random.key(0))
    assert memory.cache_chunk(shapes) == chunk
    assert tuning.chunk_candidate(shapes) == chunk
    if chunk is not None:
        assert chunk * _rows_bytes() <= 2 * 2**20
        assert "loop/" + str(chunk) in tuning.candidates(10, chunk)
        # never above a memory plan's chunk; a plan's smaller chunk is timed alone
        assert tuning.chunk_candidate(planned(shapes, client_chunk=chunk + 1)) == chunk
        assert tuning.chunk_candidate(planned(shapes, client_chunk=chunk)) is None
    seeded = jax.eval_shape(lambda key: jax.vmap(lambda k: linear_mixture(
        k, k=4, m=m, n=10, d=10, sigma=0.1, R=0.25).train)(jax.random.split(key, 2)),
        jax.random.key(0))
    assert memory.cache_chunk(seeded) is None  # copies before the client axis: no candidate


def _small_cache(monkeypatch, clients=100):
    """A core cache of `clients` clients' rows: 300 clients are timed in chunks of 100."""
    monkeypatch.setattr(memory, "core_cache_bytes", lambda: clients * _rows_bytes())


def test_a_faster_chunk_is_chosen_and_equals_the_whole_cohort(store, monkeypatch):
    """The chunked candidate timed fastest is run (its chunk recorded beside the form):
    the same assignments as the whole-cohort round and the same models to float
    rounding."""
    _small_cache(monkeypatch)
    data = _problem()
    assert tuning.chunk_candidate(data) == 100
    calls = []
    monkeypatch.setattr(tuning, "time_forms", _fake_times("loop/100", calls))
    timing = {}
    chunked = _run(data, timing)
    assert timing["kernel_form"]["form"] == "loop"
    assert timing["kernel_form"]["client_chunk"] == 100
    assert timing["client_chunk"] is None  # the memory plan, as the checkpoints record it
    assert {"loop", "loop/100", "dot", "dot/100"} <= set(calls[0])
    entries = json.loads(store.read_text())["entries"]
    assert [e["form"] for e in entries.values()] == ["loop/100"]
    timing = {}
    _run(data, timing)
    assert timing["kernel_form"] == {"form": "loop", "source": "stored", "client_chunk": 100}
    monkeypatch.setenv(tuning.FORM_ENV, "loop")  # forced: the plan's chunk, nothing timed
    timing = {}
    whole = _run(data, timing)
    assert timing["kernel_form"] == {"form": "loop", "source": "forced"} and len(calls) == 1
    np.testing.assert_array_equal(chunked.assignment, whole.assignment)
    np.testing.assert_allclose(chunked.cluster_params, whole.cluster_params, rtol=1e-6,
                               atol=1e-6)


def test_a_slower_chunk_is_not_chosen(store, monkeypatch):
    _small_cache(monkeypatch)
    monkeypatch.setattr(tuning, "time_forms", _fake_times("loop", []))
    timing = {}
    _run(_problem(), timing)
    assert timing["kernel_form"]["form"] == "loop"
    assert "client_chunk" not in timing["kernel_form"]


def test_a_resumed_run_takes_its_checkpoints_chunk(store, tmp_path, monkeypatch):
    """Killed after round 4 with the chunk its timing chose, resumed where the timing now
    prefers the whole cohort: the rounds after it still run in chunks, so the run equals
    an uninterrupted chunked run bit for bit."""
    _small_cache(monkeypatch)
    data = _problem()

    def run(rounds, where, winner, resume=False):
        monkeypatch.setenv(tuning.STORE_ENV, "off")
        monkeypatch.setattr(tuning, "time_forms", _fake_times(winner, []))
        timing = {}
        state, _ = simulate.run(_ifca(), data, jax.random.key(1), rounds=rounds, eval_every=2,
                                execution=Execution(progress=False, checkpoints=Checkpoints(where),
                                                    resume=resume, timing=timing))
        return state, timing["kernel_form"]

    whole, form = run(8, tmp_path / "whole", "dot/100")
    assert form["client_chunk"] == 100
    run(4, tmp_path / "killed", "dot/100")
    resumed, form = run(8, tmp_path / "killed", "loop", resume=True)
    assert form == {"form": "dot", "source": "forced", "client_chunk": 100}
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)
