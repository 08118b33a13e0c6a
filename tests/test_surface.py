"""The algorithm surface: every registered factory's signature against one vocabulary.

Every factory is `factory(model, training, *, its own settings)`: how clients train
is one `ClientTraining` (`sgd(lr, steps=, batch_size=, sampling=)`), how a round is
executed rides on the data (`fedjax_sim.execution.planned`), and a name means one
thing everywhere. The signatures are read with `inspect.signature` and compared
with the vocabulary below; a smoke test then runs every factory on the ragged
federation (conftest.py) with and without a client chunk, the chunked round
against the unchunked one.
"""

from __future__ import annotations

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedjax_sim
from fedjax_sim import algorithms
from fedjax_sim.algorithms import ALGORITHMS, ClientTraining, sgd
from fedjax_sim.algorithms.base import WEIGHTINGS
from fedjax_sim.data import FederatedData, ServerData
from fedjax_sim.execution import planned

# A forbidden parameter name -> the name (or the place) the vocabulary uses for it.
SYNONYMS = {
    "server_learning_rate": "server_lr",
    "server_rate": "server_lr",
    "clients_per_round": "participation (a fraction)",
    "cohort_size": "participation (a fraction)",
    "learning_rate": "training (sgd(learning_rate))",
    "lr": "training (sgd(learning_rate))",
    "optimizer": "training (ClientTraining(optimizer))",
    "client_optimizer": "training (ClientTraining(optimizer))",
    "local_steps": "training (steps=)",
    "num_steps": "training (steps=)",
    "batch_size": "training (batch_size=)",
    "sampling": "training (sampling=)",
    "k": "num_clusters",
    "n_clusters": "num_clusters",
    "clusters": "num_clusters",
    "init_params": "with_initial_params(algorithm, init_params)",
    "pretrain_steps": "pretraining (a ClientTraining)",
    "personal_steps": "personal (a ClientTraining)",
    "weight_sharing": "with_weight_sharing(algorithm, model)",
    "freeze_shared": "with_frozen_trunk(algorithm, model, trunk_params)",
    "warm_start_rounds": "with_warm_start(algorithm, rounds)",
    "fixed_assignment": "with_fixed_assignment(algorithm, model)",
    "weights": "weighting",
}
# Parts of a name that make it another spelling of a vocabulary name: a step size is
# `*_lr` (server_lr, lambda_lr), the client's is the training's.
SYNONYM_PARTS = {"learning_rate": "*_lr, or the training's"}

# Execution is the executor's (`fedjax_sim.execution.Plan`, `simulate.run`): none of it
# is an algorithm's setting.
EXECUTION = {"client_chunk", "chunk", "mesh", "devices", "device", "keep_assignments",
             "keep_client_state", "memory", "memory_budget", "linear_form", "plan"}
EXECUTION_PARTS = ("chunk", "mesh", "device", "memory", "shard")

# A setting's allowed defaults where the vocabulary fixes them.
DEFAULTS = {
    "participation": lambda d: d == 1.0,
    "weighting": lambda d: d in WEIGHTINGS,
}

FACTORIES = sorted(ALGORITHMS)


def _parameters(name):
    return inspect.signature(ALGORITHMS[name]).parameters


def _settings(name):
    """The factory's parameters after (model, training)."""
    return list(_parameters(name).values())[2:]


def _default_kind(default) -> str:
    """What a default is, for comparing one name's defaults across factories."""
    if default is inspect.Parameter.empty:
        return "required"
    if default is None:
        return "None"
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, (int, float)):
        return "number"
    if isinstance(default, str):
        return "choice"
    return type(default).__name__


def _shared_names():
    """{setting name: [factories taking it]} for names taken by two factories or more."""
    users = {}
    for name in sorted(ALGORITHMS):
        for p in _settings(name):
            users.setdefault(p.name, []).append(name)
    return {setting: names for setting, names in sorted(users.items()) if len(names) > 1}


# --------------------------------------------------------------------------- (a) vocabulary


@pytest.mark.parametrize("name", FACTORIES)
def test_no_factory_takes_a_synonym(name):
    """No parameter of the factory is a forbidden spelling of a vocabulary name."""
    found = {}
    for p in _parameters(name):
        if p in SYNONYMS:
            found[p] = SYNONYMS[p]
            continue
        for part, use in SYNONYM_PARTS.items():
            if part in p:
                found[p] = use
    assert not found, f"{name} takes {found} (parameter -> what to use instead)"


@pytest.mark.parametrize("setting", sorted(_shared_names()))
def test_a_shared_setting_has_one_default_kind(setting):
    """A setting taken by several factories is required by all or defaults to the same kind
    of value in all (a number, None, one of a choice's values), within the values the
    vocabulary fixes (participation 1.0, weighting "uniform" or "examples")."""
    users = _shared_names()[setting]
    defaults = {name: _parameters(name)[setting].default for name in users}
    kinds = {name: _default_kind(d) for name, d in defaults.items()}
    assert len(set(kinds.values())) == 1, f"{setting} defaults: {defaults}"
    if setting in DEFAULTS:
        bad = {name: d for name, d in defaults.items() if not DEFAULTS[setting](d)}
        assert not bad, f"{setting} defaults outside the vocabulary's: {bad}"


@pytest.mark.parametrize("setting", sorted(DEFAULTS))
def test_vocabulary_settings_are_used(setting):
    """The settings whose defaults are fixed above are real settings (taken by 2+ factories):
    a rename would otherwise leave their check vacuous."""
    assert setting in _shared_names()


@pytest.mark.parametrize("name", FACTORIES)
def test_other_trainings_are_optional_client_trainings(name):
    """A factory's further trainings (ditto's personal steps, one-shot's pre-training, Mixed
    FL's central steps) are ClientTrainings that default to None (derived from `training`)."""
    for p in _settings(name):
        if "ClientTraining" in str(p.annotation):
            assert p.default is None, f"{name}({p.name}=...) defaults to {p.default!r}"


# --------------------------------------------------------------------------- (b) execution


@pytest.mark.parametrize("name", FACTORIES)
def test_no_factory_takes_an_execution_setting(name):
    """Chunks, devices, memory and per-client-state policy are the executor's (`planned`)."""
    found = [p for p in _parameters(name)
             if p in EXECUTION or any(part in p for part in EXECUTION_PARTS)]
    assert not found, f"{name} takes execution settings {found}"


# --------------------------------------------------------------------------- (c) shape


@pytest.mark.parametrize("name", FACTORIES)
def test_model_and_training_then_keywords(name):
    """(model, training) positional, every other setting keyword-only; no *args, **kwargs."""
    params = list(_parameters(name).values())
    assert [p.name for p in params[:2]] == ["model", "training"], name
    for p in params[:2]:
        assert p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD), (name, p)
        assert p.default is p.empty, (name, p)
    loose = {p.name: p.kind.description for p in params[2:] if p.kind is not p.KEYWORD_ONLY}
    assert not loose, f"{name}: not keyword-only: {loose}"


# --------------------------------------------------------------------------- (d) exports


def test_algorithms_exports_exist_and_hold_every_factory():
    missing = [n for n in algorithms.__all__ if not hasattr(algorithms, n)]
    assert not missing, missing
    assert len(set(algorithms.__all__)) == len(algorithms.__all__)
    unexported = {key: f.__name__ for key, f in ALGORITHMS.items()
                  if f.__name__ not in algorithms.__all__
                  or getattr(algorithms, f.__name__) is not f}
    assert not unexported, unexported


def test_every_factory_is_importable_from_the_top_level():
    missing = [n for n in fedjax_sim.__all__ if not hasattr(fedjax_sim, n)]
    assert not missing, missing
    for key, factory in ALGORITHMS.items():
        assert getattr(fedjax_sim, factory.__name__, None) is factory, key
        assert factory.__name__ in fedjax_sim.__all__, key
    # What every factory needs beside the model.
    assert fedjax_sim.sgd is sgd and fedjax_sim.ClientTraining is ClientTraining
    assert fedjax_sim.ALGORITHMS is ALGORITHMS


# --------------------------------------------------------------------------- (e) smoke

TRAINING = sgd(0.05, steps=2, batch_size=2)
# Settings a factory needs (or that keep the test fast), for the factories that take them.
SETTINGS = {"num_clusters": 2, "kmeans_restarts": 2,
            "pretraining": sgd(0.05, steps=3, batch_size=2)}


def _build(name, model):
    factory = ALGORITHMS[name]
    accepted = _parameters(name)
    # IFCA's option I takes one full-batch gradient per client (its optimizer steps the
    # cluster models).
    training = sgd(0.05) if name == "ifca" else TRAINING
    return factory(model, training, **{k: v for k, v in SETTINGS.items() if k in accepted})


def _inputs(name, data):
    """The client data, and for Mixed FL a datacenter dataset beside it."""
    if ALGORITHMS[name].__module__ != "fedjax_sim.algorithms.mixed":
        return data
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, data.x.shape[-1])).astype(np.float32)
    return data, ServerData({"x": x, "y": (x @ np.ones(x.shape[1], np.float32))})


def _init_two_rounds_evaluate(algorithm, inputs):
    """init, 2 jitted rounds and evaluate: (final state, [round metrics], evaluation)."""
    state = jax.jit(algorithm.init)(jax.random.key(0), inputs)
    round_ = jax.jit(algorithm.round)
    history = []
    for key in jax.random.split(jax.random.key(1), 2):
        state, metrics = round_(state, inputs, key)
        history.append(metrics)
    return state, history, jax.jit(algorithm.evaluate)(state, inputs)


def _programs(algorithm, state, inputs) -> tuple[str, str]:
    """The round's and the evaluation's jaxprs on these inputs."""
    return (str(jax.make_jaxpr(algorithm.round)(state, inputs, jax.random.key(1))),
            str(jax.make_jaxpr(algorithm.evaluate)(state, inputs)))


@pytest.mark.parametrize("name", FACTORIES)
def test_every_factory_runs_and_chunked_rounds_agree(name, ragged, linear_model):
    """init, 2 jitted rounds and evaluate, finite; the same with the data planned in chunks
    of 2 clients (5 clients: a padded last chunk), whose sums another program computes,
    agrees with the unchunked run to 1e-5."""
    algorithm = _build(name, linear_model)
    inputs = _inputs(name, ragged)
    plain = _init_two_rounds_evaluate(algorithm, inputs)
    chunked_inputs = planned(inputs, client_chunk=2)
    data = chunked_inputs[0] if isinstance(chunked_inputs, tuple) else chunked_inputs
    assert isinstance(data, FederatedData) and data.plan.client_chunk == 2
    chunked = _init_two_rounds_evaluate(algorithm, chunked_inputs)
    for run in (plain, chunked):
        state, history, evaluation = run
        chex.assert_tree_all_finite(history)
        chex.assert_tree_all_finite(evaluation)
        chex.assert_shape(evaluation["client_loss"], (ragged.num_clients,))
        chex.assert_tree_all_finite([a for a in jax.tree.leaves(state)
                                     if jnp.issubdtype(a.dtype, jnp.floating)])
    chex.assert_trees_all_close(chunked, plain, rtol=1e-5, atol=1e-5)
    # The chunk reached the kernels: the chunked round and evaluation are other programs.
    state = plain[0]
    assert _programs(algorithm, state, chunked_inputs) != _programs(algorithm, state, inputs)
