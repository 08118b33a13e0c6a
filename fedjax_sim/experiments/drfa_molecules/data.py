"""The federations of the DRFA / DRFLM comparison, every seed's or one shared.

Datasets: esol, freesolv, lipophilicity (data/molecules.py, scaffold clients),
and synthetic: linear regression y = xᵀθ* + ε with one θ* for everyone, where
the last `noisy_clients` clients carry heavy label noise on their training
targets only (the paper's motivating case: DRFA's λ chases the noisy clients
and its clean-test RMSE rises above FedAvg's).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim.data.federated import FederatedData
from fedjax_sim.experiments.base import stack_seeds
from fedjax_sim.models import linear_regression

MOLECULES = ("esol", "freesolv", "lipophilicity")
DATASET_NAMES = (*MOLECULES, "synthetic")


class Problem(NamedTuple):
    """What every method of the comparison shares: train/test clients with a leading
    [seeds] axis (none when shared), and metadata."""

    train: Any
    test: Any
    target_std: Any  # [seeds]: RMSE in target units is √loss · target_std
    noisy: Any  # [N] bool: the clients with label noise
    units: str
    notes: dict
    model: Any
    shared: bool  # one federation for every seed (no [seeds] axis on the clients)

    @property
    def copies(self) -> int:
        """Leading copies axes of the clients before the client axis (`study.method_run`):
        0 for one federation every seed shares, else 1."""
        return 0 if self.shared else 1


def _pad_rows(data: FederatedData, width: int) -> FederatedData:
    """The same clients padded to `width` rows (at least their own n_max)."""
    extra = max(width - data.max_examples, 0)

    def pad(a):
        return jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))

    return data.replace(x=jax.tree.map(pad, data.x), y=pad(data.y))


def _synthetic(s: dict, seed: int):
    """One seed of the noisy-clients linear problem (host numpy, seeded)."""
    rng = np.random.default_rng(seed)
    n_clients, d, n, n_test = s["num_clients"], s["d"], s["n"], s["n_test"]
    theta = rng.normal(size=d)
    noisy = np.arange(n_clients) >= n_clients - s["noisy_clients"]
    x = rng.normal(size=(n_clients, n, d))
    sigma = np.where(noisy, s["noise_std"], s["clean_noise"])[:, None]
    y = x @ theta + sigma * rng.normal(size=(n_clients, n))
    xt = rng.normal(size=(n_clients, n_test, d))
    yt = xt @ theta + s["clean_noise"] * rng.normal(size=(n_clients, n_test))  # clean test
    f32 = np.float32
    return (FederatedData.from_arrays(x.astype(f32), y.astype(f32)),
            FederatedData.from_arrays(xt.astype(f32), yt.astype(f32)), noisy)


def build_problem(s: dict) -> Problem:
    """The federation of every seed (resplit_per_seed) or one shared by all seeds."""
    seeds = s["seeds"]
    per_seed = range(seeds) if s["resplit_per_seed"] else range(1)
    if s["dataset"] == "synthetic":
        built = [_synthetic(s, s["seed"] * 1000 + i) for i in per_seed]
        train = [b[0] for b in built]
        test = [b[1] for b in built]
        std = [1.0] * len(train)
        noisy = built[0][2]
        units = "y units (unit-variance x)"
        notes = {"synthetic_problem": (
            f"y = xᵀθ* + ε, one θ* ~ N(0, I_{s['d']}) for every client, x ~ N(0, I); ε std "
            f"{s['clean_noise']} on clean clients and {s['noise_std']} on the last "
            f"{s['noisy_clients']} clients' training targets; every test set is clean")}
        model = linear_regression(s["d"])
    else:
        from fedjax_sim.data.molecules import ATOM_FEATURES, federate, load_graphs
        from fedjax_sim.models.graph import gin_regressor

        graphs, targets, units = load_graphs(s["dataset"], max_atoms=s["max_atoms"] or None,
                                             cache_dir=s["cache_dir"] or None)
        feds = [federate(graphs, targets, s["num_clients"], split=s["split"],
                         alpha=s["split_alpha"], seed=s["seed"] * 1000 + i,
                         noisy_clients=s["noisy_clients"], noise_std=s["noise_std"],
                         units=units) for i in per_seed]
        train = [f.train for f in feds]
        test = [f.test for f in feds]
        std = [f.target_std for f in feds]
        noisy = feds[0].noisy
        notes = dict(feds[0].notes)
        if feds[0].skipped["invalid"]:
            notes["invalid_smiles_rows"] = [r for r, _ in feds[0].skipped["invalid"]][:20]
        model = gin_regressor(ATOM_FEATURES, graphs.nodes.shape[1], hidden=s["hidden"],
                              layers=s["layers"], pooling=s["pooling"])
    # Test clients padded to the training width: one compiled evaluation serves both.
    test = [_pad_rows(t, max(p.max_examples for p in train)) for t in test]
    if s["resplit_per_seed"]:
        train, test = stack_seeds(train), stack_seeds(test)
        shared = False
    else:
        train, test, std = train[0], test[0], std * seeds
        shared = True
    return Problem(train, test, np.asarray(std, np.float64), np.asarray(noisy, bool), units,
                   notes, model, shared)
