"""Molecules: SMILES parsing, padding, scaffold clients, the archive reader and the GIN."""

from __future__ import annotations

import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.data import molecules
from fedjax_sim.data.molecules import (
    ATOM_FEATURES,
    ELEMENTS,
    featurize,
    federate_smiles,
    load_graphs,
    scaffold_clients,
)

BENZENES = ["c1ccccc1O", "c1ccccc1N", "c1ccccc1C", "c1ccccc1Cl", "c1ccccc1CC"]
CYCLOHEXANES = ["OC1CCCCC1", "NC1CCCCC1", "CC1CCCCC1"]
PYRIDINES = ["c1ccncc1C", "c1ccncc1O"]
ACYCLIC = ["CCO", "CCCC", "CC(=O)O", "CCN"]
SMILES = BENZENES + CYCLOHEXANES + PYRIDINES + ACYCLIC


def test_featurize_ethanol_by_hand():
    g = featurize(["CCO"])
    assert g.nodes.shape == (1, 3, ATOM_FEATURES)
    np.testing.assert_array_equal(g.atom_mask, [[1, 1, 1]])
    want_adj = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]], np.float32)
    np.testing.assert_array_equal(g.adjacency[0], want_adj)
    e = len(ELEMENTS) + 1
    carbon, oxygen = g.nodes[0, 0], g.nodes[0, 2]
    assert carbon[ELEMENTS.index("C")] == 1 and oxygen[ELEMENTS.index("O")] == 1
    assert carbon[e + 1] == 1 and g.nodes[0, 1, e + 2] == 1  # degrees 1 and 2
    h = e + molecules.DEGREES + len(molecules.CHARGES)
    assert carbon[h + 3] == 1 and oxygen[h + 1] == 1  # CH3 and OH
    assert carbon[-2] == 0 and carbon[-1] == 0  # not aromatic, not in a ring
    assert g.scaffolds == [""]  # acyclic


def test_invalid_smiles_skipped_and_too_large_refused_with_rows():
    smiles = ["CCO", "not-a-smiles", "c1ccccc1", "C1CC", "", "CC"]
    g = featurize(smiles, max_atoms=4)
    assert [r for r, _ in g.skipped["invalid"]] == [1, 3, 4]
    assert [(r, a) for r, _, a in g.skipped["too_large"]] == [(2, 6)]
    np.testing.assert_array_equal(g.rows, [0, 5])
    assert g.nodes.shape == (2, 4, ATOM_FEATURES)
    np.testing.assert_array_equal(g.atom_mask.sum(1), [3, 2])
    # max_atoms=None pads to the largest molecule instead: nothing too large.
    g_all = featurize(smiles)
    assert g_all.nodes.shape[1] == 6 and not g_all.skipped["too_large"]
    np.testing.assert_array_equal(g_all.rows, [0, 2, 5])


@pytest.mark.parametrize("split", ["round_robin", "contiguous", "dirichlet"])
def test_scaffold_clients_partition(split):
    g = featurize(SMILES)
    clients = scaffold_clients(g.scaffolds, 3, split, alpha=0.5, seed=1)
    assert sorted(np.concatenate(clients).tolist()) == list(range(len(SMILES)))
    owners = {}
    for c, idx in enumerate(clients):
        for i in idx:
            owners.setdefault(g.scaffolds[i], set()).add(c)
    if split != "dirichlet":  # whole scaffold groups go to one client
        assert all(len(v) == 1 for v in owners.values())
    if split == "round_robin":  # groups by size: benzene (5), acyclic (4), cyclohexane (3), ...
        benz = owners["c1ccccc1"].pop()
        acyc = owners[""].pop()
        cyc = owners["C1CCCCC1"].pop()
        pyr = owners["c1ccncc1"].pop()
        assert (benz, acyc, cyc, pyr) == (0, 1, 2, 0)


def test_federate_split_standardisation_and_noise():
    targets = np.arange(len(SMILES), dtype=np.float64) * 0.5 - 2
    fed = federate_smiles(SMILES, targets, 2, split="round_robin", noisy_clients=1,
                          noise_std=3.0, seed=0)
    clean = federate_smiles(SMILES, targets, 2, split="round_robin", seed=0)
    train_n = np.asarray(fed.train.num_examples)
    test_n = np.asarray(fed.test.num_examples)
    sizes = np.array([len(c) for c in scaffold_clients(featurize(SMILES).scaffolds, 2)])
    np.testing.assert_array_equal(train_n + test_n, sizes)
    np.testing.assert_array_equal(test_n, np.maximum(1, np.round(0.2 * sizes)))
    # Standardised with the pooled training targets (of the clean federation).
    y = np.asarray(clean.train.y)
    real = np.concatenate([y[i, :n] for i, n in enumerate(train_n)])
    np.testing.assert_allclose([real.mean(), real.std()], [0.0, 1.0], atol=1e-5)
    back = real * clean.target_std + clean.target_mean  # every one a training molecule's target
    assert np.abs(back[:, None] - targets[None, :]).min(1).max() < 1e-4
    # Noise on the last client's training targets only; every test target stays clean.
    assert fed.noisy.tolist() == [False, True]
    np.testing.assert_allclose(fed.train.y[0], clean.train.y[0], atol=1e-6)
    assert np.abs(np.asarray(fed.train.y[1] - clean.train.y[1])[: train_n[1]]).max() > 0.1
    np.testing.assert_allclose(fed.test.y, clean.test.y, atol=1e-6)
    with pytest.raises(ValueError, match="fewer than 2 molecules"):
        federate_smiles(SMILES, targets, 12)


def _fake_wheel(tmp_path, rows):
    archives = tmp_path / "archives"
    archives.mkdir()
    text = "Compound ID,measured log(solubility:mol/L),ESOL predicted log(solubility:mol/L)," \
           "SMILES\n" + "".join(f'"m{i}",{t},0,{s}\n' for i, (s, t) in enumerate(rows))
    with zipfile.ZipFile(archives / "chemloader-0.1.4-py3-none-any.whl", "w") as zf:
        zf.writestr(molecules.SOURCES["esol"].member, text)


def test_load_from_archive_reports_invalid_and_caches(tmp_path, monkeypatch):
    rows = [("CCO", -0.5), ("xyz", 1.0), ("c1ccccc1", -2.0), ("CC", "n/a"), ("CCCl", -1.0)]
    _fake_wheel(tmp_path, rows)
    g, y, units = load_graphs("esol", cache_dir=tmp_path)
    assert [r for r, _ in g.skipped["invalid"]] == [1, 3]  # bad SMILES, non-numeric target
    np.testing.assert_array_equal(g.rows, [0, 2, 4])
    np.testing.assert_allclose(y, [-0.5, -2.0, -1.0])
    assert units == "log10(mol/L)"
    caches = list(tmp_path.rglob("*.npz"))
    assert len(caches) == 1

    def boom(*a, **k):
        raise AssertionError("featurize must not run on a cached dataset")

    monkeypatch.setattr(molecules, "featurize", boom)
    g2, y2, _ = load_graphs("esol", cache_dir=tmp_path)
    np.testing.assert_array_equal(g2.nodes, g.nodes)
    assert g2.scaffolds == g.scaffolds and g2.skipped == g.skipped
    np.testing.assert_allclose(y2, y)


def test_gin_pooling_invariances_and_drflm_trains_through_embeddings():
    from fedjax_sim.algorithms import drflm, sgd
    from fedjax_sim.models.graph import gin_regressor

    g = featurize(["c1ccccc1O", "CCO"])
    x = {k: jnp.asarray(v) for k, v in g.features().items()}
    for pooling in ("sum", "mean"):
        model = gin_regressor(ATOM_FEATURES, 7, hidden=8, layers=2, pooling=pooling)
        params = model.init(jax.random.key(0))
        emb = model.features(params["trunk"], x)
        assert emb.shape == (2, 8) and model.apply(params, x).shape == (2,)
        perm = np.array([3, 1, 0, 2, 6, 5, 4])  # relabel phenol's atoms
        xp = {"nodes": x["nodes"][:1, perm], "adjacency": x["adjacency"][:1][:, perm][:, :, perm],
              "atom_mask": x["atom_mask"][:1, perm]}
        np.testing.assert_allclose(model.features(params["trunk"], xp), emb[:1], rtol=1e-5,
                                   atol=1e-5)
    # One DRFLM round on graph clients: finite, and g (the trunk) moves.
    fed = federate_smiles(SMILES, np.linspace(-1, 1, len(SMILES)), 2, seed=0)
    model = gin_regressor(ATOM_FEATURES, fed.train.x["nodes"].shape[2], hidden=8, layers=1)
    alg = drflm(model, sgd(0.1, steps=2, batch_size=4), lambda_lr=0.1)
    state = alg.init(jax.random.key(0), fed.train)
    new, metrics = jax.jit(alg.round)(state, fed.train, jax.random.key(1))
    assert np.isfinite(float(metrics["cohort_loss"]))
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new.params["trunk"],
                         state.params["trunk"])
    assert max(jax.tree.leaves(moved)) > 0
