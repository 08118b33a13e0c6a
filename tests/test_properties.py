"""Property-based tests (hypothesis): bad input gets a clear ValueError and never
corrupts a run directory; run-directory files are written atomically.

Three groups:
  1. FederatedData.from_clients / from_arrays over ragged client arrays (empty
     clients, one-row clients, NaN/inf features, mismatched shapes and dtypes).
  2. Preset settings: random override dicts over the run and sweep preset keys,
     valid and invalid values. Valid configurations are never run (too slow);
     only invalid ones go through run_preset / sweep_preset / the CLI, which
     must raise a ValueError naming a setting and leave no output directory.
  3. io: append_csv/read_csv round trips, crash-truncated files, atomic
     write_json / write_csv.

Hypothesis and the function-scoped `tmp_path` fixture do not mix (health
check), so every test makes its own `tempfile.TemporaryDirectory()`.
"""

from __future__ import annotations

import contextlib
import io as stdio
import json
import math
import os
import re
import tempfile
from pathlib import Path
from unittest import mock

import jax
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from fedjax_sim import cli, experiments
from fedjax_sim import io as fio
from fedjax_sim.data import FederatedData
from fedjax_sim.experiments import ifca_success, ifca_synthetic, runner
from fedjax_sim.io import append_csv, read_csv, read_json, write_csv, write_json

# ============================================================================ helpers

FLOAT32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
INT32 = st.integers(-(2**31), 2**31 - 1)


def _elements(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return st.booleans()
    if np.issubdtype(dtype, np.integer):
        return INT32
    return FLOAT32  # float32 and float64 alike: exactly representable in float32


def _no_temp_files(directory: Path, expected: set[str]) -> None:
    names = set(os.listdir(directory))
    assert names == expected, f"unexpected files left behind: {sorted(names - expected)}"


def _names_setting(message: str, keys) -> bool:
    """True when the message names one of `keys` as a whole word."""
    return any(
        re.search(r"(?<![A-Za-z0-9_])" + re.escape(key) + r"(?![A-Za-z0-9_])", message)
        for key in keys
    )


# ================================================================ 1. ragged client data


@st.composite
def ragged_clients(draw, max_clients=6, max_rows=5):
    """(xs, ys, sizes): consistent per-client arrays, including empty and one-row clients."""
    m = draw(st.integers(1, max_clients))
    feature = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    target = draw(st.sampled_from([(), (2,)]))
    xdt = draw(st.sampled_from([np.float32, np.int32, np.bool_]))
    ydt = draw(st.sampled_from([np.float32, np.int32]))
    sizes = draw(st.lists(st.integers(0, max_rows), min_size=m, max_size=m))
    if draw(st.booleans()):  # make sure the edge cases are exercised often
        sizes[draw(st.integers(0, m - 1))] = 0
        sizes[draw(st.integers(0, m - 1))] = 1
    xs = [draw(arrays(xdt, (n, *feature), elements=_elements(xdt))) for n in sizes]
    ys = [draw(arrays(ydt, (n, *target), elements=_elements(ydt))) for n in sizes]
    return xs, ys, sizes


def _check_round_trip(data: FederatedData, xs, ys, sizes, cluster, n_max):
    x, y = np.asarray(data.x), np.asarray(data.y)
    ne, cl = np.asarray(data.num_examples), np.asarray(data.cluster)
    m = len(xs)
    width = max(max(sizes), 1 if n_max is None else n_max, 1)
    assert x.shape == (m, width, *xs[0].shape[1:])
    assert y.shape == (m, width, *ys[0].shape[1:])
    assert ne.dtype == np.int32 and ne.tolist() == list(sizes)
    assert cl.dtype == np.int32
    assert cl.tolist() == ([-1] * m if cluster is None else list(cluster))
    for i, n in enumerate(sizes):
        # Unpadding with num_examples gives back the client's rows exactly.
        np.testing.assert_array_equal(x[i, :n], np.asarray(xs[i]).astype(x.dtype))
        np.testing.assert_array_equal(y[i, :n], np.asarray(ys[i]).astype(y.dtype))
        assert not np.any(x[i, n:]) and not np.any(y[i, n:]), "padding must be zeros"
    mask = np.asarray(data.mask())
    assert mask.shape == (m, width)
    np.testing.assert_array_equal(mask.astype(bool).sum(axis=1), sizes)


@settings(max_examples=40, deadline=None)
@given(
    clients=ragged_clients(),
    with_cluster=st.booleans(),
    extra=st.none() | st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_from_clients_round_trip(clients, with_cluster, extra, seed):
    xs, ys, sizes = clients
    m = len(xs)
    cluster = np.random.default_rng(seed).integers(-1, 4, m).tolist() if with_cluster else None
    n_max = None if extra is None else max(sizes) + extra
    data = FederatedData.from_clients(xs, ys, cluster=cluster, n_max=n_max)
    assert data.num_clients == m
    assert np.asarray(data.x).dtype == xs[0].dtype  # float32 / int32 / bool are kept
    _check_round_trip(data, xs, ys, sizes, cluster, n_max)


@st.composite
def chaotic_clients(draw):
    """Per-client arrays that may disagree in rows, shapes, dtypes, or hold NaN/inf."""
    m = draw(st.integers(0, 5))
    base_feature = draw(st.sampled_from([(2,), (3,), ()]))
    xs, ys = [], []
    for _ in range(m):
        n = draw(st.integers(0, 4))
        ny = n if draw(st.integers(0, 5)) else draw(st.integers(0, 4))
        feature = base_feature if draw(st.integers(0, 5)) else draw(st.sampled_from([(1,), (2, 1)]))
        xdt = (
            np.float32
            if draw(st.integers(0, 4))
            else draw(st.sampled_from([np.float64, np.int32, np.int64]))
        )
        ydt = np.float32 if draw(st.integers(0, 5)) else np.int32
        x = draw(arrays(xdt, (n, *feature), elements=_elements(xdt)))
        if n and np.issubdtype(xdt, np.floating) and not draw(st.integers(0, 5)):
            flat = x.reshape(-1)
            if flat.size:
                flat[draw(st.integers(0, flat.size - 1))] = draw(
                    st.sampled_from([np.nan, np.inf, -np.inf])
                )
        xs.append(x)
        ys.append(draw(arrays(ydt, (ny,), elements=_elements(ydt))))
    if m and not draw(st.integers(0, 6)):
        ys = ys[:-1]  # a missing client
    return xs, ys


def _expected_problem(xs, ys):
    """Independent oracle: None if the clients are well formed, else (client index or None)."""
    if len(xs) != len(ys) or not xs:
        return ("lists", None)
    for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
        if a.shape[0] != b.shape[0]:
            return ("rows", i)
        if a.shape[1:] != xs[0].shape[1:] or b.shape[1:] != ys[0].shape[1:]:
            return ("shape", i)
        if a.dtype != xs[0].dtype or b.dtype != ys[0].dtype:
            return ("dtype", i)
    if any(np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)) for a in xs):
        return ("nan", None)
    return None


@settings(max_examples=80, deadline=None)
@given(clients=chaotic_clients())
def test_from_clients_builds_exactly_or_raises_value_error(clients):
    """Any list of clients: a faithful FederatedData, or a ValueError, never anything else."""
    xs, ys = clients
    problem = _expected_problem(xs, ys)
    if problem is None:
        data = FederatedData.from_clients(xs, ys)
        _check_round_trip(data, xs, ys, [len(a) for a in xs], None, None)
        return
    with pytest.raises(ValueError) as info:
        FederatedData.from_clients(xs, ys)
    kind, client = problem
    message = str(info.value)
    if client is not None:
        assert f"client {client}" in message
    if kind == "nan":
        assert "NaN" in message


@settings(max_examples=50, deadline=None)
@given(clients=ragged_clients(), bad=st.sampled_from([np.nan, np.inf, -np.inf]), data=st.data())
def test_nan_or_inf_feature_in_a_real_row_is_rejected(clients, bad, data):
    xs, ys, sizes = clients
    assume(any(sizes))
    xs = [a.astype(np.float32) for a in xs]
    i = data.draw(st.sampled_from([j for j, n in enumerate(sizes) if n]))
    flat = xs[i].reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1))] = bad
    with pytest.raises(ValueError, match="NaN"):
        FederatedData.from_clients(xs, ys)


@settings(max_examples=50, deadline=None)
@given(clients=ragged_clients(), data=st.data())
def test_mismatched_client_is_named(clients, data):
    xs, ys, sizes = clients
    assume(len(xs) >= 2)
    xs, ys = list(xs), list(ys)
    j = data.draw(st.integers(1, len(xs) - 1))
    how = data.draw(st.sampled_from(["x_shape", "y_shape", "x_dtype", "y_dtype", "rows"]))
    n = sizes[j]
    if how == "x_shape":
        xs[j] = np.zeros((n, *xs[0].shape[1:], 2), xs[0].dtype)
    elif how == "y_shape":
        ys[j] = np.zeros((n, *ys[0].shape[1:], 3), ys[0].dtype)
    elif how == "x_dtype":
        other = np.float64 if xs[0].dtype != np.float64 else np.float32
        xs[j] = xs[j].astype(other)
    elif how == "y_dtype":
        other = np.int32 if ys[0].dtype != np.int32 else np.float32
        ys[j] = ys[j].astype(other)
    else:
        ys[j] = np.zeros((n + data.draw(st.integers(1, 3)), *ys[0].shape[1:]), ys[0].dtype)
    with pytest.raises(ValueError, match=rf"client {j}\b"):
        FederatedData.from_clients(xs, ys)


def test_from_clients_rejects_no_clients_and_unequal_lists():
    with pytest.raises(ValueError, match="at least one client"):
        FederatedData.from_clients([], [])
    with pytest.raises(ValueError, match="same clients"):
        FederatedData.from_clients([np.zeros((1, 2), np.float32)], [])
    with pytest.raises(ValueError, match="client 0"):
        FederatedData.from_clients([np.float32(1.0)], [np.float32(1.0)])  # 0-d "client"


@pytest.mark.parametrize("kind", ["str", "object", "datetime"])
@pytest.mark.parametrize("where", ["x", "y"])
def test_non_numeric_client_arrays_are_a_value_error(kind, where):
    """Wrong dtypes (strings, objects, dates) must get a clear ValueError, not a JAX TypeError."""
    n = 2
    bad = {
        "str": np.array([["a", "b"]] * n),
        "object": np.array([[1.0, None]] * n, dtype=object),
        "datetime": np.array([[1, 2]] * n, dtype="datetime64[s]"),
    }[kind]
    good_x = np.zeros((n, 2), np.float32)
    good_y = np.zeros((n,), np.float32)
    xs, ys = ([bad], [good_y]) if where == "x" else ([good_x], [bad[:, 0]])
    with pytest.raises(ValueError):
        FederatedData.from_clients(xs, ys)


@settings(max_examples=25, deadline=None)
@given(
    case=st.tuples(
        st.just("float64"),
        st.floats(min_value=3.5e38, max_value=1e308)
        | st.floats(min_value=-1e308, max_value=-3.5e38),
    )
    | st.tuples(st.just("int64"), st.integers(2**31, 2**62) | st.integers(-(2**62), -(2**31) - 1)),
    where=st.sampled_from(["x", "y"]),
)
def test_values_outside_the_device_dtype_are_rejected_not_corrupted(case, where):
    """Finite float64 beyond float32 range, or int64 beyond int32: a ValueError, or kept exactly.

    With jax_enable_x64 off (the default), JAX casts float64 -> float32 and
    int64 -> int32; a finite 1e300 must not silently become inf, nor 2**40 become 0.
    """
    kind, big = case
    dtype = np.float64 if kind == "float64" else np.int64
    value = np.array(big, dtype)
    arr = np.array([[value]], dtype) if where == "x" else np.array([value], dtype)
    xs = [arr] if where == "x" else [np.zeros((1, 1), np.float32)]
    ys = [arr] if where == "y" else [np.zeros((1,), np.float32)]
    try:
        data = FederatedData.from_clients(xs, ys)
    except ValueError:
        return
    stored = np.asarray(data.x if where == "x" else data.y).reshape(-1)[0]
    assert np.isfinite(stored), f"finite input {value!r} was stored as {stored!r}"
    assert math.isclose(float(stored), float(value), rel_tol=1e-6), (
        f"input {value!r} was stored as {stored!r}"
    )


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 5), n_max=st.integers(0, 5), d=st.integers(1, 3), data=st.data())
def test_from_arrays_valid_num_examples_and_nan_in_padding(m, n_max, d, data):
    num = data.draw(st.lists(st.integers(0, n_max), min_size=m, max_size=m))
    x = np.ones((m, n_max, d), np.float32)
    rows = np.arange(n_max)[None, :] >= np.asarray(num)[:, None]
    x[rows] = np.nan  # padding may hold anything: it is masked
    y = np.zeros((m, n_max), np.float32)
    fd = FederatedData.from_arrays(x, y, np.asarray(num, np.int64))
    assert np.asarray(fd.num_examples).tolist() == num
    np.testing.assert_array_equal(np.asarray(fd.mask()).sum(axis=1), num)
    assert np.asarray(fd.cluster).tolist() == [-1] * m


@settings(max_examples=80, deadline=None)
@given(
    m=st.integers(1, 5),
    n_max=st.integers(1, 5),
    how=st.sampled_from(
        [
            "ne_long",
            "ne_2d",
            "ne_scalar",
            "ne_negative",
            "ne_too_big",
            "ne_float",
            "ne_bool",
            "ne_str",
            "cl_long",
            "cl_2d",
            "cl_float",
            "x_1d",
            "y_rows",
            "y_clients",
            "nan_real",
        ]
    ),
    data=st.data(),
)
def test_from_arrays_bad_arguments_are_value_errors(m, n_max, how, data):
    x = np.ones((m, n_max, 2), np.float32)
    y = np.zeros((m, n_max), np.float32)
    num = np.full((m,), n_max, np.int32)
    cluster = None
    expect = {"ne": "num_examples", "cl": "cluster", "x": "x", "y": "y", "nan": "NaN"}[
        how.split("_")[0]
    ]
    if how == "ne_long":
        num = np.zeros((m + 1,), np.int32)
    elif how == "ne_2d":
        num = num[:, None]
    elif how == "ne_scalar":
        num = np.int32(1)
    elif how == "ne_negative":
        num[data.draw(st.integers(0, m - 1))] = -data.draw(st.integers(1, 2**31 - 1))
    elif how == "ne_too_big":
        num[data.draw(st.integers(0, m - 1))] = n_max + data.draw(st.integers(1, 2**20))
    elif how == "ne_float":
        num = num.astype(np.float32)
    elif how == "ne_bool":
        num = np.ones((m,), bool)
    elif how == "ne_str":
        num = np.array(["1"] * m)
    elif how == "cl_long":
        cluster = np.zeros((m + data.draw(st.integers(1, 3)),), np.int32)
    elif how == "cl_2d":
        cluster = np.zeros((m, 1), np.int32)
    elif how == "cl_float":
        cluster = np.zeros((m,), np.float32)
    elif how == "x_1d":
        x = np.ones((m,), np.float32)
    elif how == "y_rows":
        y = np.zeros((m, n_max + 1), np.float32)
    elif how == "y_clients":
        y = np.zeros((m + 1, n_max), np.float32)
    elif how == "nan_real":
        x[data.draw(st.integers(0, m - 1)), data.draw(st.integers(0, n_max - 1)), 0] = np.nan
    with pytest.raises(ValueError) as info:
        FederatedData.from_arrays(x, y, num, cluster)
    assert _names_setting(str(info.value), [expect])


# ======================================================================= 2. settings

# The synthetic run presets: the keys and ranges below are theirs (the comparison presets'
# runs have their own settings, tested in test_compare_lifecycle).
RUN_PRESETS = sorted(n for n, p in experiments.PRESETS.items()
                     if p.experiment is ifca_synthetic.EXPERIMENT)
SWEEP_PRESETS = ["ifca-success-small", "ifca-success-m-n-k4", "ifca-success-r-noise-k2"]
RUN_KEYS = list(ifca_synthetic.EXPERIMENT.defaults())
RUN_INT_KEYS = [
    "k", "m", "n", "d", "rounds", "restarts", "seeds", "eval_every", "n_test", "local_steps",
    "pretrain_steps",
]
MAX_COUNT = 10**7  # no size setting may exceed this (a mistyped 1e12 must not abort or hang)
MAX_SEED = 2**32 - 1
ALGORITHMS = ("ifca", "fedavg", "local", "oneshot")
SWEEP_INT_KEYS = ["k", "m", "n", "d", "rounds", "restarts", "seeds"]
UNKNOWN_KEYS = ["K", "foo", "lr ", "seeds_", "learning_rate"]

BAD_ATOMS = st.sampled_from(
    [
        "0",
        "-1",
        "-7",
        "nan",
        "NaN",
        "inf",
        "-inf",
        "1e400",
        "abc",
        "",
        " ",
        "2.5",
        "1e-3",
        "None",
        "True",
        "gradient",
        "model",
        "1,2",
        ",",
        ",,",
        "4,",
        "1e20",
    ]
)
PY_ATOMS = st.sampled_from([0, -1, 2.5, float("nan"), float("inf"), -float("inf"), None, True, []])
VALUES = st.one_of(
    st.integers(-3, 64),
    st.integers(-3, 64).map(str),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(-1, 4).map(repr),
    st.integers(2**62, 2**70),  # seeds a PRNG key cannot take
    BAD_ATOMS,
    PY_ATOMS,
    st.text(max_size=4),
)
RUN_OVERRIDES = st.dictionaries(st.sampled_from(RUN_KEYS + UNKNOWN_KEYS), VALUES, max_size=4)


def _assert_sane_run_settings(preset, s: dict) -> None:
    """An independent statement of what a valid run setting is."""
    assert set(s) == set(preset.defaults)
    for key in RUN_INT_KEYS:
        assert type(s[key]) is int and 1 <= s[key] <= MAX_COUNT, (key, s[key])
    assert type(s["seed"]) is int and 0 <= s["seed"] <= MAX_SEED
    jax.random.key(s["seed"])  # the run's first step must accept the seed
    if "checkpoint_every" in s:  # 0: no checkpoints
        assert type(s["checkpoint_every"]) is int and 0 <= s["checkpoint_every"] <= MAX_COUNT
    for key in ("sigma", "R", "lr", "memory_budget_gb"):
        v = s[key]
        assert isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, (key, v)
    assert math.isfinite(s["participation"]) and 0 < s["participation"] <= 1
    assert s["algorithm"] in ALGORITHMS
    assert s["option"] in ("gradient", "model")
    assert s["divide_by"] in ("m", "cohort")
    assert s["m"] % s["k"] == 0
    # A setting the algorithm would not read keeps its default (never silently ignored).
    if s["algorithm"] != "ifca":
        assert s["option"] == "gradient" and s["divide_by"] == "m", s
    if s["algorithm"] != "oneshot":
        assert s["pretrain_steps"] == ifca_synthetic.EXPERIMENT.defaults()["pretrain_steps"], s
    if s["algorithm"] == "local":
        assert s["participation"] == 1.0, s
    if s["algorithm"] == "ifca" and s["option"] == "gradient":
        assert s["local_steps"] == 1, s  # option I takes one full-batch gradient per client
    if s["option"] == "model":
        assert s["divide_by"] == "m", s
    # The algorithm the run builds (after config.json is written) must take the settings too.
    ifca_synthetic.build_algorithm(s["algorithm"], s)


def _run_decision(preset, overrides):
    """The library's own pre-write check: ValueError or the resolved settings."""
    return experiments.resolve_settings(preset, overrides, "run")


def _assert_writes_nothing(driver, name, overrides, expected_message):
    """`driver` (run_preset or sweep_preset) refuses the settings and creates nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out", "dir")
        with pytest.raises(ValueError) as info:
            driver(name, overrides, out, progress=False)
        assert str(info.value) == expected_message
        assert not out.parent.exists(), f"{driver.__name__} created a directory for bad settings"
        _no_temp_files(Path(tmp), set())


def _assert_run_writes_nothing(name, overrides, expected_message):
    _assert_writes_nothing(experiments.run_preset, name, overrides, expected_message)


@settings(max_examples=250, deadline=None)
@given(name=st.sampled_from(RUN_PRESETS), overrides=RUN_OVERRIDES)
@example(name="ifca-synthetic-tiny", overrides={"k": 3})  # m=20 not divisible by 3
@example(name="ifca-synthetic-tiny", overrides={"lr": "-0.1"})
@example(name="ifca-synthetic-tiny", overrides={"rounds": "2.5"})
@example(name="ifca-synthetic-tiny", overrides={"bogus": "1"})
@example(name="ifca-synthetic-tiny", overrides={"participation": "0"})
@example(name="ifca-synthetic-tiny", overrides={"option": "both"})
@example(name="ifca-synthetic-tiny", overrides={"m": "1e12"})  # past the size bound
@example(name="ifca-synthetic-tiny", overrides={"local_steps": "2"})  # option I ignores it
@example(name="fedavg-synthetic", overrides={"option": "model"})  # FedAvg has no option
@example(name="ifca-synthetic-tiny", overrides={"R": "0.5,1.0"})  # a list outside a sweep
@example(name="ifca-synthetic", overrides={"n_test": "2000000"})  # test data past memory
def test_run_settings_are_valid_or_a_named_error_with_nothing_written(name, overrides):
    preset = experiments.get_preset(name, "run")
    try:
        settings_ = _run_decision(preset, overrides)
    except ValueError as err:
        assert _names_setting(str(err), overrides), f"{err} names none of {sorted(overrides)}"
        _assert_run_writes_nothing(name, overrides, str(err))
    else:
        _assert_sane_run_settings(preset, settings_)


@settings(max_examples=60, deadline=None)
@given(
    key=st.sampled_from(RUN_KEYS),
    value=st.sampled_from(["-1", "nan", "inf", "-inf", "1e400", "abc", "", ",", "1,2", "0.5"]),
)
def test_one_bad_run_setting_is_named(key, value):
    """A single override: valid and sane, or an error naming exactly that key."""
    preset = experiments.get_preset("ifca-synthetic-tiny", "run")
    overrides = {key: value}
    try:
        settings_ = _run_decision(preset, overrides)
    except ValueError as err:
        assert _names_setting(str(err), [key]), f"{err!s} does not name {key}"
        _assert_run_writes_nothing("ifca-synthetic-tiny", overrides, str(err))
    else:
        _assert_sane_run_settings(preset, settings_)


@pytest.mark.parametrize(
    ("key", "value"), [("k", "inf"), ("rounds", "1e400"), ("seed", "-inf"), ("n_test", math.inf)]
)
def test_infinite_integer_setting_is_a_value_error(key, value):
    """`int(float('inf'))` raises OverflowError; it must surface as a ValueError naming the key."""
    preset = experiments.get_preset("ifca-synthetic-tiny", "run")
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        _run_decision(preset, {key: value})


@pytest.mark.parametrize(("key", "value"), [("k", ","), ("lr", ",,"), ("option", " , ")])
def test_empty_comma_list_for_a_run_setting_is_a_value_error(key, value):
    preset = experiments.get_preset("ifca-synthetic-tiny", "run")
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        _run_decision(preset, {key: value})


@pytest.mark.parametrize(("key", "value"), [("sigma", "inf"), ("R", "1e400")])
def test_infinite_sigma_or_r_is_rejected(key, value):
    """check_mixture_settings promises 'a finite number >= 0' but lets inf through."""
    preset = experiments.get_preset("ifca-synthetic-tiny", "run")
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        _run_decision(preset, {key: value})


@pytest.mark.parametrize("seed", [2**63, 2**70])
def test_seed_a_prng_key_cannot_take_is_rejected_before_writing(seed):
    """A seed jax.random.key cannot take must be refused by the settings check, not fail after
    config.json is written."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        with pytest.raises(ValueError, match="seed"):
            experiments.run_preset("ifca-synthetic-tiny", {"seed": str(seed)}, out, progress=False)
        assert not out.exists(), f"left behind: {sorted(os.listdir(out))}"


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(RUN_PRESETS),
    items=st.lists(
        st.tuples(
            st.sampled_from(RUN_KEYS + ["foo"]),
            st.one_of(BAD_ATOMS, st.integers(-3, 64).map(str), st.floats().map(repr)),
        ),
        min_size=1,
        max_size=3,
    ),
    malformed=st.sampled_from([None, "k", "=4", " =1", "nokey"]),
)
@example(name="ifca-synthetic-tiny", items=[("k", "3")], malformed=None)  # m=20, k=3
@example(name="ifca-synthetic-tiny", items=[("lr", "0.1")], malformed="nokey")
@example(name="ifca-synthetic-tiny", items=[("rounds", "inf")], malformed=None)
@example(name="ifca-synthetic-tiny", items=[("k", "2"), ("k", "4")], malformed=None)  # twice
def test_cli_run_bad_settings_exit_2_and_write_nothing(name, items, malformed):
    """`fedjax-sim run --set ...`: invalid settings exit 2 with a message, and no --out dir."""
    assignments = [f"{k}={v}" for k, v in items] + ([malformed] if malformed else [])
    preset = experiments.get_preset(name, "run")
    try:
        settings_ = _run_decision(preset, assignments)
    except ValueError as err:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp, "out")
            err_buf, out_buf = stdio.StringIO(), stdio.StringIO()
            argv = ["run", name, "--set", *assignments, "--out", str(out), "--no-progress"]
            with contextlib.redirect_stderr(err_buf), contextlib.redirect_stdout(out_buf):
                rc = cli.main(argv)
            assert rc == 2
            assert str(err) in err_buf.getvalue()
            assert not out.exists()
    else:
        assert malformed is None
        _assert_sane_run_settings(preset, settings_)


# ----------------------------------------------------------------------------- sweeps

SWEEP_KEYS = list(experiments.PRESETS["ifca-success-small"].defaults)
LIST_ITEM = st.one_of(
    st.integers(-2, 40).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "x", "", "0", "2.5"]),
)
SWEEP_VALUES = st.one_of(
    VALUES,
    st.lists(LIST_ITEM, min_size=0, max_size=3).map(",".join),
    st.lists(st.one_of(st.integers(-2, 40), st.floats(-1, 3)), max_size=3),
)
SWEEP_OVERRIDES = st.dictionaries(
    st.sampled_from(SWEEP_KEYS + UNKNOWN_KEYS), SWEEP_VALUES, max_size=4
)


def _sweep_decision(preset, overrides):
    """sweep_preset's own pre-write checks (resolve, including the memory budget; every cell)."""
    settings_ = experiments.resolve_settings(preset, overrides, "sweep")
    cells = runner.expand_cells(settings_, runner.sweep_axes(preset, settings_))
    for cell in cells:
        ifca_success.SUCCESS.validate(cell)
    return settings_, cells


def _assert_sane_sweep(preset, s, cells):
    assert set(s) == set(preset.defaults)
    assert cells, "a sweep with no cells would write a run directory and then crash"
    # lr is the grid searched within a cell: a list, or one learning rate.
    lrs = s["lr"] if isinstance(s["lr"], list) else [s["lr"]]
    assert lrs, "lr grid must be non-empty"
    for cell in cells:
        assert set(cell) == set(preset.defaults)
        for key, value in cell.items():  # every other comma list is an axis of cells
            assert key == "lr" or not isinstance(value, list), (key, value)
        for key in SWEEP_INT_KEYS:
            assert type(cell[key]) is int and 1 <= cell[key] <= MAX_COUNT, (key, cell[key])
        assert cell["m"] % cell["k"] == 0
        assert type(cell["seed"]) is int and 0 <= cell["seed"] <= MAX_SEED
        jax.random.key(cell["seed"])
        for key in ("sigma", "R", "threshold_offset"):
            assert math.isfinite(cell[key]) and cell[key] >= 0, (key, cell[key])
        cell_lrs = cell["lr"] if isinstance(cell["lr"], list) else [cell["lr"]]
        assert cell_lrs == lrs
        for lr in cell_lrs:
            assert math.isfinite(lr) and lr >= 0
        assert math.isfinite(cell["memory_budget_gb"]) and cell["memory_budget_gb"] > 0


def _assert_sweep_writes_nothing(name, overrides, expected_message):
    _assert_writes_nothing(experiments.sweep_preset, name, overrides, expected_message)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(SWEEP_PRESETS), overrides=SWEEP_OVERRIDES)
@example(name="ifca-success-small", overrides={"m": "81"})  # not divisible by k=4
@example(name="ifca-success-small", overrides={"k": "3"})  # m=80 not divisible by 3
@example(name="ifca-success-small", overrides={"lr": "1.0,-0.5"})  # negative lr in the grid
@example(name="ifca-success-small", overrides={"k": "0"})
@example(name="ifca-success-small", overrides={"lr": ","})  # empty lr list
@example(name="ifca-success-small", overrides={"lr": []})
@example(name="ifca-success-m-n-k4", overrides={"m": "100,101"})  # one bad cell of many
@example(name="ifca-success-small", overrides={"memory_budget_gb": "nan"})
@example(name="ifca-success-small", overrides={"seeds": "0"})
@example(name="ifca-success-small", overrides={"R": "0.1,,0.2"})  # an empty item in a list
@example(name="ifca-success-small", overrides={"memory_budget_gb": "0"})
@example(name="ifca-success-small", overrides={"seed": str(2**32)})
def test_sweep_settings_are_valid_or_a_named_error_with_nothing_written(name, overrides):
    preset = experiments.get_preset(name, "sweep")
    try:
        settings_, cells = _sweep_decision(preset, overrides)
    except ValueError as err:
        assert _names_setting(str(err), overrides), f"{err} names none of {sorted(overrides)}"
        _assert_sweep_writes_nothing(name, overrides, str(err))
    else:
        _assert_sane_sweep(preset, settings_, cells)


@pytest.mark.parametrize(("key", "value"), [("k", ","), ("R", ",,")])
def test_sweep_with_an_empty_axis_is_rejected_before_writing(key, value):
    """`--set k=,` resolves the axis to [], so there are no cells to validate; sweep_preset
    then writes config.json and crashes in write_summary (IndexError on summary[0])."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out")
        with pytest.raises(ValueError, match=rf"\b{key}\b"):
            experiments.sweep_preset("ifca-success-small", {key: value}, out, progress=False)
        assert not out.exists(), f"left behind: {sorted(os.listdir(out))}"


# ============================================================================ 3. io

COLUMN_NAMES = st.lists(
    st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True), min_size=1, max_size=4, unique=True
)
# Text the csv round trip must keep: commas, quotes, spaces, non-ASCII letters; no
# control or line/paragraph-separator characters.
PLAIN_TEXT = st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=8)
ASCII_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=8)
# Anything a Python str can hold and a UTF-8 file can store.
ANY_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=8)
MISSING = object()


def _cell_values(text):
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(width=32).map(np.float32),
        st.integers(-(2**63), 2**63),
        st.integers(-5, 5).map(np.int64),
        text,
        st.just(MISSING),
    )


def _rows(columns, text, min_size=0, max_size=6):
    return st.lists(
        st.tuples(*[_cell_values(text) for _ in columns]).map(
            lambda vals: {c: v for c, v in zip(columns, vals, strict=True) if v is not MISSING}
        ),
        min_size=min_size,
        max_size=max_size,
    )


def _assert_cell(read: str, value, where):
    assert isinstance(read, str), where
    if value is MISSING:
        assert read == "", where
    elif isinstance(value, str):
        assert read == value, where
    elif isinstance(value, (float, np.floating)):
        got = float(read)
        assert (math.isnan(got) and math.isnan(value)) or got == float(value), (where, read, value)
    else:
        assert int(read) == int(value), (where, read, value)


def _assert_rows(read_rows, rows, columns):
    assert len(read_rows) == len(rows), (read_rows, rows)
    for i, (got, want) in enumerate(zip(read_rows, rows, strict=True)):
        assert list(got) == columns
        for c in columns:
            _assert_cell(got[c], want.get(c, MISSING), (i, c))


@st.composite
def csv_case(draw, text):
    columns = draw(COLUMN_NAMES)
    rows = draw(_rows(columns, text))
    cuts = sorted(draw(st.lists(st.integers(0, len(rows)), max_size=2)))
    return columns, rows, cuts


def _append_in_batches(path, columns, rows, cuts):
    bounds = [0, *cuts, len(rows)]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        append_csv(path, rows[a:b], columns)


@settings(max_examples=50, deadline=None)
@given(case=csv_case(PLAIN_TEXT))
def test_append_then_read_csv_round_trip(case):
    columns, rows, cuts = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trials.csv")
        _append_in_batches(path, columns, rows, cuts)
        raw = path.read_text(encoding="utf-8")
        assert raw.split("\n", 1)[0] == ",".join(columns)  # the header, written once
        assert raw.endswith("\n")
        _assert_rows(read_csv(path), rows, columns)
        _no_temp_files(Path(tmp), {"trials.csv"})


@settings(max_examples=50, deadline=None)
@given(case=csv_case(ANY_TEXT))
@example(case=(["a", "b"], [{"a": "p\nq", "b": 1}], []))
@example(case=(["a", "b"], [{"a": "r\rs", "b": 1}], []))
@example(case=(["a", "b"], [{"a": "x\x0cy", "b": 1}], []))
@example(case=(["a", "b"], [{"a": "u\u2028v", "b": 1}], []))
def test_append_then_read_csv_round_trip_any_text(case):
    """csv quoting must carry any string: newlines, \\r, form feeds, U+2028 included."""
    columns, rows, cuts = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trials.csv")
        _append_in_batches(path, columns, rows, cuts)
        _assert_rows(read_csv(path), rows, columns)


def _complete_rows_before(data: bytes, offset: int) -> int:
    """Data rows wholly (newline included) in data[:offset]; fields hold no newlines."""
    return max(0, data[:offset].count(b"\n") - 1)


@settings(max_examples=60, deadline=None)
@given(
    columns=COLUMN_NAMES,
    data=st.data(),
)
def test_crash_truncated_csv_keeps_only_complete_rows(columns, data):
    """A crash leaves trials.csv cut at any byte; reading drops the partial line, and the
    next append starts on a fresh line, never glued to the partial one."""
    before = data.draw(_rows(columns, ASCII_TEXT, min_size=1), label="before")
    after = data.draw(_rows(columns, ASCII_TEXT), label="after")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trials.csv")
        append_csv(path, before, columns)
        full = path.read_bytes()
        offset = data.draw(st.integers(0, len(full)), label="offset")
        path.write_bytes(full[:offset])  # the crash
        kept = _complete_rows_before(full, offset)
        _assert_rows(read_csv(path), before[:kept], columns)  # a resume reads first
        append_csv(path, after, columns)
        _assert_rows(read_csv(path), before[:kept] + after, columns)
        text = path.read_text(encoding="utf-8")
        assert text.endswith("\n")
        lines = text.split("\n")[:-1]
        assert lines[0] == ",".join(columns)
        assert len(lines) == 1 + kept + len(after), "a partial line survived the append"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(
        st.characters(min_codepoint=0x80, exclude_categories=("Cc", "Cs", "Zl", "Zp")),
        min_size=1,
        max_size=4,
    ),
    data=st.data(),
)
def test_crash_truncated_csv_mid_utf8_character_is_readable(text, data):
    """A crash can cut a multi-byte UTF-8 character; read_csv must still give the complete rows."""
    columns = ["name", "value"]
    rows = [{"name": text, "value": 1}, {"name": text + "x", "value": 2}]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trials.csv")
        append_csv(path, rows, columns)
        full = path.read_bytes()
        offset = data.draw(st.integers(0, len(full)), label="offset")
        path.write_bytes(full[:offset])
        _assert_rows(read_csv(path), rows[: _complete_rows_before(full, offset)], columns)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=12,
)


class _Unencodable:
    pass


def _as_strict_json(value):
    """What write_json must store for `value`: a non-finite float becomes null."""
    if isinstance(value, dict):
        return {k: _as_strict_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@settings(max_examples=40, deadline=None)
@given(first=JSON_VALUES, second=JSON_VALUES)
def test_write_json_is_atomic(first, second):
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        path = d / "config.json"
        write_json(path, first)
        assert read_json(path) == _as_strict_json(first)
        _no_temp_files(d, {"config.json"})
        before = path.read_bytes()
        # Serialisation fails midway: the previous content is intact, no temp file is left.
        with pytest.raises(TypeError):
            write_json(path, {"ok": second, "bad": [1, _Unencodable()], "after": second})
        assert path.read_bytes() == before
        _no_temp_files(d, {"config.json"})
        # The disk fails between writing and renaming: same guarantees.
        with mock.patch.object(fio.os, "replace", side_effect=OSError("disk full")):
            with pytest.raises(OSError, match="disk full"):
                write_json(path, second)
        assert path.read_bytes() == before
        _no_temp_files(d, {"config.json"})
        with mock.patch.object(fio.os, "fsync", side_effect=OSError("io error")):
            with pytest.raises(OSError, match="io error"):
                write_json(path, second)
        assert path.read_bytes() == before
        _no_temp_files(d, {"config.json"})
        write_json(path, second)
        assert read_json(path) == _as_strict_json(second)
        _no_temp_files(d, {"config.json"})


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=4))
def test_write_json_numpy_values(values):
    arr = np.asarray(values, np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "summary.json")
        write_json(path, {"array": arr, "scalar": arr[0], "int": np.int64(3)})
        got = read_json(path)
        want = {"array": arr.tolist(), "scalar": float(arr[0]), "int": 3}
        assert got == _as_strict_json(want)
        json.dumps(got)  # plain Python again


class _BadStr:
    def __str__(self):
        raise RuntimeError("cannot format")


@settings(max_examples=30, deadline=None)
@given(case=csv_case(PLAIN_TEXT), second=st.data())
def test_write_csv_is_atomic(case, second):
    columns, rows, _ = case
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        path = d / "summary.csv"
        write_csv(path, rows, columns)
        _assert_rows(read_csv(path), rows, columns)
        _no_temp_files(d, {"summary.csv"})
        before = path.read_bytes()
        more = second.draw(_rows(columns, PLAIN_TEXT), label="more")
        # Formatting fails midway through the rows.
        with pytest.raises(RuntimeError):
            write_csv(path, [*more, {columns[0]: _BadStr()}, *more], columns)
        assert path.read_bytes() == before
        _no_temp_files(d, {"summary.csv"})
        # Encoding fails while the temporary file is being written (a lone surrogate).
        with pytest.raises(UnicodeEncodeError):
            write_csv(path, [*more, {columns[0]: "\ud800"}], columns)
        assert path.read_bytes() == before
        _no_temp_files(d, {"summary.csv"})
        write_csv(path, more, columns)
        _assert_rows(read_csv(path), more, columns)
        _no_temp_files(d, {"summary.csv"})
