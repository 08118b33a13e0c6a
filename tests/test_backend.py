"""Per-shape compiler options: which shapes get them, and that they change speed only."""

from __future__ import annotations

import jax
import numpy as np

from fedjax_sim import backend
from fedjax_sim.algorithms import ifca
from fedjax_sim.data import linear_mixture
from fedjax_sim.models import linear_regression


def test_compiler_options_by_feature_size():
    assert backend.compiler_options(None) == {}
    assert backend.compiler_options(backend.YNN_MIN_FEATURES) == {}
    assert backend.compiler_options(1000) == {}
    narrow = backend.compiler_options(10)
    if jax.default_backend() == "cpu" and backend._cpu_option_supported():
        assert narrow == {"xla_cpu_experimental_ynn_fusion_type": ""}
    else:
        assert narrow == {}


def test_options_change_only_speed():
    """The IFCA round compiled with and without the narrow-feature options agrees."""
    data = linear_mixture(jax.random.key(0), k=4, m=40, n=5, d=6, sigma=0.3, R=0.5).train
    alg = ifca(linear_regression(6), num_clusters=4, learning_rate=0.1)
    state = alg.init(jax.random.key(1), data)
    key = jax.random.key(2)
    narrow = backend.jit(alg.round, 6)(state, data, key)[0]
    default = backend.jit(alg.round, 1000)(state, data, key)[0]
    np.testing.assert_array_equal(narrow.assignment, default.assignment)
    np.testing.assert_allclose(narrow.cluster_params, default.cluster_params, rtol=1e-5, atol=1e-6)
    # One compilation per (function, options): the same jitted object comes back.
    assert backend.jit(alg.round, 6) is backend.jit(alg.round, 6)
