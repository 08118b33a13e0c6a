"""Small shared fixtures: a ragged federation and a linear model.

The ragged federation has clients of 4, 1, 0, 3 and 2 real rows (padded to 4),
so every kernel test sees a one-example client and an empty client.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import numpy as np
import pytest

from fedjax_sim.data import FederatedData
from fedjax_sim.models import linear_regression

DIM = 3
RAGGED_SIZES = (4, 1, 0, 3, 2)
RAGGED_CLUSTERS = (0, 1, 0, 1, 0)


def make_ragged(seed: int = 0, sizes=RAGGED_SIZES, clusters=RAGGED_CLUSTERS, d: int = DIM):
    """FederatedData with the given client sizes; y = x·θ*_c + small noise."""
    rng = np.random.default_rng(seed)
    theta_star = rng.normal(size=(max(clusters) + 1, d)).astype(np.float32)
    xs, ys = [], []
    for n_i, c in zip(sizes, clusters, strict=True):
        x = rng.normal(size=(n_i, d)).astype(np.float32)
        y = (x @ theta_star[c] + 0.1 * rng.normal(size=n_i)).astype(np.float32)
        xs.append(x)
        ys.append(y)
    return FederatedData.from_clients(xs, ys, cluster=list(clusters))


# Session scope: both are immutable, and sharing one Model object lets the kernels
# jitted with the model as a static argument reuse their compilations across tests.
@pytest.fixture(scope="session")
def ragged():
    data = make_ragged()
    # The fixture promises the edge cases the tests rely on.
    sizes = np.asarray(data.num_examples)
    assert 1 in sizes and 0 in sizes
    return data


@pytest.fixture(scope="session")
def linear_model():
    return linear_regression(DIM)


def np_client_loss(theta, x, y, n):
    """F_i(θ) = mean over the n real rows of (xᵀθ − y)², 0 for an empty client (float64)."""
    if n == 0:
        return 0.0
    x = np.asarray(x[:n], np.float64)
    r = x @ np.asarray(theta, np.float64) - np.asarray(y[:n], np.float64)
    return float(np.mean(r**2))


def np_client_grad(theta, x, y, n):
    """∇F_i(θ) = (2/n) Xᵀ(Xθ − y) over the n real rows, 0 for an empty client (float64)."""
    theta = np.asarray(theta, np.float64)
    if n == 0:
        return np.zeros_like(theta)
    x = np.asarray(x[:n], np.float64)
    r = x @ theta - np.asarray(y[:n], np.float64)
    return 2.0 / n * x.T @ r


def permutation_accuracy(pred, true, k):
    """Best fraction of agreement over all relabellings of pred."""
    pred = np.asarray(pred)
    true = np.asarray(true)
    return max(np.mean(np.asarray(perm)[pred] == true) for perm in itertools.permutations(range(k)))


@pytest.fixture(scope="session")
def ref():
    """Plain numpy references the tests compare the vectorized code against."""
    return SimpleNamespace(
        loss=np_client_loss, grad=np_client_grad, perm_accuracy=permutation_accuracy
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, JAX's in-memory caches of traced and compiled programs are
    dropped (`jax.clear_caches`): a worker runs hundreds of modules' programs, and kept
    they grew it to ~5 GB of RSS. A program needed again is read back from the session's
    persistent compilation cache (conftest.py at the root)."""
    yield
    if os.environ.get("FEDJAX_SIM_TEST_KEEP_CACHES") != "1":
        import gc

        import jax

        jax.clear_caches()
        gc.collect()
