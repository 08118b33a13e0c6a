"""Per-shape compiler options: which shapes get them, and that they change speed only."""

from __future__ import annotations

import jax
import numpy as np

from fedjax_sim import backend
from fedjax_sim.algorithms import ifca, sgd
from fedjax_sim.data import linear_mixture
from fedjax_sim.models import linear_regression


def test_compiler_options_by_feature_size():
    assert backend.compiler_options(None) == {}
    assert backend.compiler_options(backend.YNN_MIN_FEATURES) == {}
    assert backend.compiler_options(1000) == {}
    assert backend.compiler_options(1000, "dot_ynn") == {}
    narrow = backend.compiler_options(10)
    if jax.default_backend() == "cpu" and backend._cpu_option_supported():
        # No YNN fusions for narrow features, but for the form that asks for YNNPACK's
        # single dots (where this jaxlib knows that value).
        assert narrow == {"xla_cpu_experimental_ynn_fusion_type": ""}
        assert backend.compiler_options(10, "loop") == narrow
        assert backend.compiler_options(10, "dot") == narrow
        assert backend.compiler_options(10, "dot_ynn")[
            "xla_cpu_experimental_ynn_fusion_type"] in ("LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT", "")
    else:
        assert narrow == {}
        assert backend.compiler_options(10, "dot_ynn") == {}


def test_options_change_only_speed():
    """The IFCA round compiled with and without the narrow-feature options agrees."""
    data = linear_mixture(jax.random.key(0), k=4, m=40, n=5, d=6, sigma=0.3, R=0.5).train
    alg = ifca(linear_regression(6), sgd(0.1), num_clusters=4)
    state = alg.init(jax.random.key(1), data)
    key = jax.random.key(2)
    narrow = backend.jit(alg.round, 6)(state, data, key)[0]
    default = backend.jit(alg.round, 1000)(state, data, key)[0]
    np.testing.assert_array_equal(narrow.assignment, default.assignment)
    np.testing.assert_allclose(narrow.cluster_params, default.cluster_params, rtol=1e-5, atol=1e-6)
    # One compilation per (function, options): the same jitted object comes back.
    assert backend.jit(alg.round, 6) is backend.jit(alg.round, 6)


def test_feature_size_reads_features_past_the_client_and_example_axes():
    """[m, n, d] data, a pytree of leaves, and data stacked over seeds ([S, m, n, d]) all
    give d per example: the seeds axis is not mistaken for a feature axis."""
    data = linear_mixture(jax.random.key(0), k=2, m=6, n=5, d=7, sigma=0.1, R=1.0).train
    assert backend.feature_size(data) == 7
    seeds = jax.vmap(lambda k: linear_mixture(k, k=2, m=6, n=5, d=7, sigma=0.1, R=1.0).train)(
        jax.random.split(jax.random.key(1), 3))
    assert seeds.x.shape == (3, 6, 5, 7)
    assert backend.feature_size(seeds) == 7
    assert backend.feature_size((seeds, {"server": np.zeros((4, 9))})) == 7
    graphs = data.replace(x={"nodes": np.zeros((6, 5, 4, 3)), "adj": np.zeros((6, 5, 4, 4))})
    assert backend.feature_size(graphs) == 4 * 3 + 4 * 4
    assert backend.feature_size({"no": np.zeros(3)}) is None
