"""The heterogeneous-baselines experiment: partitioner settings reach the data, the methods
setting narrows and orders a comparison (here and on ifca-synthetic), refusals write nothing,
and the robust-clusters preset runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedjax_sim import cli
from fedjax_sim.algorithms import ALGORITHMS
from fedjax_sim.experiments import get_preset, hetero, resolve_settings, study
from fedjax_sim.experiments.base import available
from fedjax_sim.io import read_csv

DIGITS = 1797  # sklearn's 8×8 digits


def _clients(overrides: dict, preset: str = "hetero-digits"):
    """Seed 0's clients as (labels of train ∪ test, train count, test count) per client."""
    p = get_preset(preset)
    s = resolve_settings(p, {"seeds": 1, **overrides}, "compare")
    problem = hetero.build_problem(s)
    # On the host once (a views' `y` gathers anew on every read, and every slice of a
    # device array of another length compiles its own program).
    (tr_y, tr_n), (te_y, te_n) = ((np.asarray(problem[part].y), np.asarray(
        problem[part].num_examples)) for part in ("train", "test"))
    out = []
    for i in range(tr_n.shape[1]):
        a, b = int(tr_n[0, i]), int(te_n[0, i])
        out.append((np.concatenate([tr_y[0, i, :a], te_y[0, i, :b]]), a, b))
    return out


def _top_share(labels) -> float:
    return np.bincount(labels, minlength=10).max() / len(labels)


def test_iid_partition_balanced_sizes_and_classes():
    clients = _clients({"partitioner": "iid", "num_clients": 10})
    sizes = sorted(len(c[0]) for c in clients)
    assert sizes == [179] * 3 + [180] * 7  # 1797 = 7·180 + 3·179
    for labels, a, b in clients:
        assert b == int(0.2 * len(labels)) and a + b == len(labels)
        assert len(np.unique(labels)) == 10 and _top_share(labels) < 0.2  # ~10 % each


def test_dirichlet_tiny_alpha_one_class_dominates():
    clients = _clients({"partitioner": "dirichlet", "alpha": 0.01, "min_partition_size": 0,
                        "num_clients": 10})
    assert sum(len(c[0]) for c in clients) == DIGITS
    shares = [_top_share(c[0]) for c in clients if len(c[0])]
    assert np.median(shares) > 0.9
    broad = _clients({"partitioner": "dirichlet", "alpha": 100.0, "num_clients": 10})
    assert max(_top_share(c[0]) for c in broad) < 0.25


def test_pathological_shard_and_size_partitions():
    for labels, _, _ in _clients({"partitioner": "pathological", "classes_per_client": 3,
                                  "num_clients": 10}):
        assert len(np.unique(labels)) == 3
    shard = _clients({"partitioner": "shard", "shards_per_client": 2, "num_clients": 10})
    # 20 label-sorted shards of ⌊1797/20⌋ = 89: 178 examples, at most 4 classes per client.
    assert all(len(c[0]) == 178 and len(np.unique(c[0])) <= 4 for c in shard)
    size = _clients({"partitioner": "size", "size_fn": "linear", "num_clients": 4})
    assert [len(c[0]) for c in size] == [179, 359, 539, 720]  # ⌊1797·j/10⌋, rest to the last


def test_noisy_clients_labels_flipped_only_there():
    base = {"partitioner": "iid", "num_clients": 8, "rotations": 4, "noisy_clients": 1}
    clean = _clients({**base, "noisy_clients": 0}, "robust-clusters-digits")
    noisy = _clients({**base, "label_noise": 1.0}, "robust-clusters-digits")
    changed = []
    for i, ((a, *_), (b, *_)) in enumerate(zip(clean, noisy, strict=True)):
        if i % 2 == 0:  # the first client of each 2-client cluster is clean
            np.testing.assert_array_equal(a, b)
        else:
            changed.append(np.mean(a != b))
    # Uniform over 10 classes: a label stays with probability 1/10.
    assert 0.8 < np.mean(changed) < 0.97


def test_methods_build_with_their_settings(monkeypatch):
    """The table's `reads` reach the factory under its own keyword; the client training
    carries local_steps and the batch size; a FedOpt server_lr of 0 means its default."""
    seen = {}

    def fake(model, training, *, mu=0.0, participation=1.0, server_lr=None):
        seen.update(mu=mu, training=training, participation=participation,
                    server_lr=server_lr)
        return "built"

    s = resolve_settings(get_preset("hetero-digits"), {"prox_mu": 0.3, "local_steps": 7,
                                                         "participation": 0.5}, "compare")
    experiment = hetero.HETERO
    monkeypatch.setitem(ALGORITHMS, "fedprox", fake)
    assert study.build_method(experiment, "fedprox", s, None) == "built"
    assert seen["mu"] == 0.3 and seen["participation"] == 0.5
    assert s["batch_size"] == 0 and seen["training"].batch_size is None  # 0: full batch
    assert seen["training"].steps == 7
    monkeypatch.setitem(ALGORITHMS, "fedadam", fake)
    study.build_method(experiment, "fedadam", s, None)
    assert seen["server_lr"] is None  # server_lr=0: the server optimizer's own default
    monkeypatch.setitem(ALGORITHMS, "fedavgm", fake)
    study.build_method(experiment, "fedavgm", {**s, "server_lr": 2.0}, None)
    assert seen["server_lr"] == 2.0


TINY = ["rounds=2", "eval_every=1", "seeds=2", "num_clients=6", "hidden=8", "local_steps=2"]


def test_compare_cli_orders_methods_with_paired_differences(tmp_path):
    out = tmp_path / "cmp"
    code = cli.main(["compare", "hetero-digits", "--set", *TINY, "partitioner=dirichlet",
                     "alpha=0.1", "methods=ifca,fedavg", "--out", str(out), "--no-progress"])
    assert code == 0
    rows = read_csv(out / "results.csv")
    assert [r["method"] for r in rows] == ["ifca", "fedavg"]
    assert json.loads((out / "config.json").read_text())["methods"] == ["ifca", "fedavg"]
    assert sorted(p.name for p in (out / "methods").iterdir()) == ["fedavg.json", "ifca.json"]
    per_seed = read_csv(out / "per_seed.csv")
    for metric in ("test_accuracy", "test_loss_worst", "train_loss"):
        x = {m: np.array([float(r[metric]) for r in per_seed if r["method"] == m])
             for m in ("ifca", "fedavg")}
        assert float(rows[0][f"{metric}_diff"]) == pytest.approx(np.mean(x["ifca"] - x["fedavg"]))
        assert rows[1][f"{metric}_diff"] in ("", None)
        assert np.all(np.isfinite(x["fedavg"]))


@pytest.mark.parametrize("overrides, named", [
    (["methods=fedavg,bogus"], "setting methods must be one of fedavg, "),
    (["methods=ifca"], "include the baseline fedavg"),
    (["methods=fedavg,ifca", "prox_mu=0.5"],
     "setting prox_mu is read only by method fedprox; this compare trains fedavg, ifca"),
    (["partitioner=iid", "alpha=0.1"],
     "setting alpha is read only with partitioner=dirichlet; this compare has partitioner=iid"),
    (["partitioner=shard", "shards_per_client=2000"], "setting partitioner=shard"),
])
def test_refusals_name_the_setting_and_write_nothing(tmp_path, capsys, overrides, named):
    out = tmp_path / "refused"
    code = cli.main(["compare", "hetero-digits", "--set", *TINY, *overrides, "--out", str(out),
                     "--no-progress"])
    assert code == 2
    assert named in capsys.readouterr().err
    assert not out.exists()


def test_methods_setting_narrows_ifca_synthetic(tmp_path):
    out = tmp_path / "syn"
    code = cli.main(["compare", "ifca-synthetic-tiny", "--set", "methods=ifca,fedavg",
                     "rounds=4", "eval_every=2", "seeds=2", "restarts=2", "m=8", "n=10", "d=3",
                     "n_test=5", "--out", str(out), "--no-progress"])
    assert code == 0
    assert [r["method"] for r in read_csv(out / "results.csv")] == ["ifca", "fedavg"]
    assert sorted(p.name for p in (out / "methods").iterdir()) == ["fedavg.json", "ifca.json"]


def test_robust_clusters_preset_tiny(tmp_path):
    out = tmp_path / "robust"
    code = cli.main(["compare", "robust-clusters-digits", "--set", "rounds=2", "eval_every=1",
                     "seeds=2", "hidden=8", "local_steps=2", "num_clients=8", "noisy_clients=1",
                     "methods=ifca,drfa,fedavg", "--out", str(out), "--no-progress"])
    assert code == 0
    rows = read_csv(out / "results.csv")
    assert [r["method"] for r in rows] == ["ifca", "drfa", "fedavg"]
    for r in read_csv(out / "per_seed.csv"):
        worst = [float(r[f"test_loss_worst_c{c}"]) for c in range(4)]
        mean = [float(r[f"test_loss_c{c}"]) for c in range(4)]
        assert all(w >= m - 1e-6 for w, m in zip(worst, mean, strict=True))
        assert float(r["test_loss_worst"]) == pytest.approx(max(worst))
        assert float(r["test_loss_worst_cluster_mean"]) == pytest.approx(np.mean(worst))
        # Two clients per cluster, one noisy: the mean loss lies between clean and noisy.
        lo, hi = sorted([float(r["test_loss_noisy"]), float(r["test_loss_clean"])])
        assert lo - 1e-6 <= float(r["test_loss"]) <= hi + 1e-6


def test_default_methods_are_the_declared_ones_and_every_fitting_method_is_offered():
    for experiment, declared in ((hetero.HETERO, hetero.HETERO_METHODS),
                                 (hetero.ROBUST, hetero.ROBUST_METHODS)):
        assert experiment.defaults()["methods"] == list(declared)
        offered = available(experiment)
        assert offered[:len(declared)] == declared and {"fedavg", "ifca"} <= set(offered)
        # Registered algorithms the images fit are offered too (not only the declared).
        assert "fedyogi" in offered and "mixed_gt2" not in offered


def test_clustered_test_set_served_by_the_training_assignment():
    """Train labels all 0, test labels all 1: cluster 0 predicts 0, cluster 1 predicts 1.
    The training data picks cluster 0, so test accuracy is 0 (choosing by the test loss
    would give 1)."""
    import jax
    import jax.numpy as jnp

    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.algorithms.ifca import IFCAState
    from fedjax_sim.data.federated import FederatedData
    from fedjax_sim.models import mlp_classifier

    model = mlp_classifier((2,), [2], 10)
    params = jax.tree.map(jnp.zeros_like, model.init(jax.random.key(0)))

    def predicting(c):  # zero weights, the output bias on class c
        head = {**params["Dense_1"], "bias": params["Dense_1"]["bias"].at[c].set(10.0)}
        return {**params, "Dense_1": head}

    clusters = jax.tree.map(lambda a, b: jnp.stack([a, b]), predicting(0), predicting(1))
    m, n = 3, 4
    x = np.ones((m, n, 2), np.float32)

    def fed(label):
        d = FederatedData.from_arrays(x, np.full((m, n), label, np.int32))
        return jax.tree.map(lambda a: a[None], d)  # one seed

    state = IFCAState(cluster_params=clusters, shared_params={}, frozen_params={}, opt_state=(),
                      assignment=jnp.zeros(m, jnp.int32), stable=jnp.zeros(m, jnp.int32),
                      pinned_until=jnp.zeros((), jnp.int32), round=jnp.zeros((), jnp.int32))
    state = jax.tree.map(lambda a: a[None], state)
    algorithm = ifca(model, sgd(0.1), num_clusters=2, option="model")
    problem = {"train": fed(0), "test": fed(1), "cluster": np.zeros(m, int),
               "noisy": np.zeros(m, bool)}
    out = hetero.metrics_fn(algorithm, model, problem, {})(state)
    assert out["test_accuracy"][0] == 0.0 and out["test_accuracy_worst"][0] == 0.0
    assert out["train_loss"][0] < 1e-3 and out["test_loss"][0] > 5.0



@pytest.mark.parametrize("preset, sizes, methods", [
    ("hetero-digits", {"partitioner": "dirichlet", "alpha": 0.1, "num_clients": 6},
     "fedavg,ditto"),
    # IFCA alone (the preset's baseline): robust_ifca reads the clients as IFCA does and
    # differs only in the server's aggregation.
    ("robust-clusters-digits", {"num_clients": 8, "noisy_clients": 1}, "ifca"),
])
def test_views_compare_equals_copies(tmp_path, preset, sizes, methods):
    """clients=views (partition indices + a rotation into the images held once; a noisy
    client's relabelled rows appended to them) gives the clients of clients=copies and
    writes their per_seed.csv byte for byte."""
    import jax.numpy as jnp

    from fedjax_sim.data import copy_at

    tiny = {"rounds": 2, "eval_every": 1, "seeds": 2, "hidden": 8, "local_steps": 2, **sizes}
    problems, per_seed = {}, {}
    for clients in ("copies", "views"):
        s = resolve_settings(get_preset(preset), {**tiny, "clients": clients}, "compare")
        problems[clients] = hetero.build_problem(s)
        out = tmp_path / clients
        assert cli.main(["compare", preset, "--set", *(f"{k}={v}" for k, v in tiny.items()),
                         f"methods={methods}", f"clients={clients}", "--out", str(out),
                         "--no-progress"]) == 0
        per_seed[clients] = (out / "per_seed.csv").read_text()
    assert per_seed["views"] == per_seed["copies"]
    copies, views = problems["copies"], problems["views"]
    assert views["train"].shared_base and views["train"].base_x.ndim == 3  # one for both seeds
    for part in ("train", "test"):
        for seed in range(2):
            a, b = (copy_at(p[part], seed) for p in (copies, views))
            ids = jnp.array([0, 3, a.num_clients - 1, 3])  # a repeat too
            for got, want in ((b.take(ids), a.take(ids)), (b.materialize(), a)):
                for field in ("x", "y", "num_examples", "cluster"):
                    np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                                  err_msg=f"{part} seed {seed} {field}")


def test_methods_cannot_be_reassigned_once_settings_are_read():
    """A notebook set `experiment.methods = ...` after resolving settings, which was silently
    ignored (the methods setting decides what compare trains); a declared experiment is a
    frozen record, and `replace` declares another one, its methods setting completed anew."""
    import dataclasses

    two = hetero.HETERO.replace(name="two", methods=("fedavg", "ifca", "local"))
    assert two.defaults()["methods"] == ["fedavg", "ifca", "local"]
    narrowed = two.replace(methods=("fedavg", "ifca"))
    assert narrowed.defaults()["methods"] == ["fedavg", "ifca"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        narrowed.methods = ("fedavg",)
    assert narrowed.methods == ("fedavg", "ifca")
    assert two.defaults()["methods"] == ["fedavg", "ifca", "local"]  # the original unchanged
    preset = get_preset("hetero-digits")
    resolve_settings(preset, {}, "compare")
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.experiment.methods = ("ifca",)
