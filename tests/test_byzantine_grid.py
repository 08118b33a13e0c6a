"""Attacks, Byzantine counts and the rules' f as traced values: one program for a grid.

The kernels are checked against float64 loops written from the definitions (Krum's
scores by brute force, NNM by its neighbours, the trimmed mean by sorting; the attacks'
formulas); a grid of (Byzantine count, f, attack) points vmapped by `with_grid` against
the rounds of each point written as a loop; and the `byzantine-digits` sweep's one
program per group against the same cells trained one at a time.
"""

from __future__ import annotations

import csv
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.algorithms import fedavg, sgd, with_aggregator, with_grid
from fedjax_sim.algorithms.byzantine import BYZANTINE_STREAM
from fedjax_sim.ops import attacks, robust

LR, TAU, ROUNDS = 0.1, 3, 3


def _federation():
    from conftest import make_ragged

    return make_ragged(
        5, sizes=(3, 2, 4, 1, 2, 3, 0, 2, 4, 1), clusters=(0, 1, 0, 1, 0, 1, 0, 1, 0, 1)
    )


def _gd(ref, theta, x, y, n):
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(TAU):
        theta = theta - LR * ref.grad(theta, x, y, n)
    return theta


def _whole(point, name):
    return jnp.asarray(point[name]).astype(jnp.int32)


# --------------------------------------------------------------------------- kernels


def test_a_traced_byzantine_count_flags_the_first_count_of_the_permutation():
    key, m = jax.random.key(3), 9
    order = np.asarray(jax.random.permutation(key, m))
    flags = np.asarray(
        jax.vmap(lambda c: attacks.byzantine_clients(key, m, c))(jnp.arange(m + 1, dtype=jnp.int32))
    )
    for count in range(m + 1):
        np.testing.assert_array_equal(flags[count], np.isin(np.arange(m), order[:count]))
    # a concrete count is the same draw
    np.testing.assert_array_equal(np.asarray(attacks.byzantine_clients(key, m, 4)), flags[4])


def _np_krum(x, mask, f):
    idx = [i for i in range(len(x)) if mask[i]]
    n = len(idx)
    k = min(max(n - f - 2, 1), n - 1)
    scores = {}
    for i in idx:
        d = sorted(float(np.sum((x[i] - x[j]) ** 2)) for j in idx if j != i)
        scores[i] = sum(d[:k])
    return x[min(idx, key=lambda i: (scores[i], i))]


def _np_nnm(x, mask, f):
    idx = [i for i in range(len(x)) if mask[i]]
    n = len(idx)
    out = np.zeros_like(x)
    for i in idx:
        near = sorted(idx, key=lambda j: (float(np.sum((x[i] - x[j]) ** 2)), j))[: max(n - f, 1)]
        out[i] = np.mean([x[j] for j in near], axis=0)
    return out


def _np_trimmed(x, mask, f):
    srt = np.sort(x[mask], axis=0)
    return srt[f : len(srt) - f].mean(axis=0)


def test_rules_with_a_traced_f_against_loops():
    x = np.random.default_rng(0).normal(size=(9, 4))
    x[2] += 6.0  # an outlier Krum must not pick
    mask = np.array([1, 1, 1, 1, 0, 1, 1, 1, 1], bool)  # slot 4 does not report
    fs = np.array([0, 1, 2], np.int32)

    def at(factory):
        def one(f):
            agg = robust.inject_hyperparams(factory, f=f)
            update, _ = agg.aggregate(
                jnp.asarray(x, jnp.float32),
                jnp.asarray(mask),
                jax.random.key(0),
                agg.init(jnp.zeros(4)),
            )
            return update

        return np.asarray(jax.jit(jax.vmap(one))(jnp.asarray(fs)))

    trimmed = at(lambda f: robust.trimmed_mean(f=f))
    krum = at(lambda f: robust.krum(f=f))
    nnm_krum = at(lambda f: robust.chain(robust.nearest_neighbor_mixing(f=f), robust.krum(f=f)))
    for g, f in enumerate(fs):
        np.testing.assert_allclose(trimmed[g], _np_trimmed(x, mask, f), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(krum[g], _np_krum(x, mask, f), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            nnm_krum[g], _np_krum(_np_nnm(x, mask, f), mask, f), rtol=1e-5, atol=1e-6
        )


def test_a_traced_attack_index_picks_each_attack_by_its_formula():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(6, 3))
    byz = np.array([0, 1, 0, 0, 1, 0], bool)
    mask = np.array([1, 1, 1, 0, 1, 1], bool)
    honest = mask & ~byz
    choices = (None, attacks.sign_flip(scale=3.0), attacks.inner_product_manipulation(epsilon=0.5))

    def one(i):
        return attacks.switch(
            attacks.one_of(choices, i),
            jnp.asarray(x, jnp.float32),
            jnp.asarray(byz),
            jax.random.key(0),
            mask=jnp.asarray(mask),
        )

    out = np.asarray(jax.vmap(one)(jnp.arange(3, dtype=jnp.int32)))
    expected = [x.copy(), x.copy(), x.copy()]
    expected[1][byz] = -3.0 * x[byz]
    expected[2][byz] = -0.5 * x[honest].mean(axis=0)
    for g in range(3):
        np.testing.assert_allclose(out[g], expected[g], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="index must be an integer in"):
        attacks.one_of(choices, 3)


# --------------------------------------------------------------------------- rounds


POINTS = {"byzantine": [0, 2, 2, 3], "f": [0, 2, 2, 3], "attack": [0, 0, 1, 1]}


def test_a_grid_of_counts_f_and_attacks_is_each_points_loop(linear_model, ref):
    """One vmapped program over (Byzantine count, trimmed-mean f, attack ∈ {honest, sign
    flip ×10}) against each point's rounds: the Byzantine clients the first `count` of the
    init key's permutation, their changes replaced by −10 Δ_i under the attack, θ moved by
    the trimmed mean over the clients holding data."""
    data = _federation()
    choices = (None, attacks.sign_flip(scale=10.0))

    def build_at(p):
        rule = robust.inject_hyperparams(lambda f: robust.trimmed_mean(f=f), f=_whole(p, "f"))
        return with_aggregator(
            fedavg(linear_model, sgd(LR, steps=TAU)),
            rule,
            byzantine=_whole(p, "byzantine"),
            attack=attacks.one_of(choices, _whole(p, "attack")),
        )

    alg = with_grid(build_at, POINTS)
    key0 = jax.random.key(0)
    state = jax.jit(alg.init)(key0, data)
    order = np.asarray(jax.random.permutation(jax.random.fold_in(key0, BYZANTINE_STREAM), 10))
    x, y, n = np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)
    w = [np.asarray(state.params[g], np.float64) for g in range(4)]
    byz = [np.isin(np.arange(10), order[:c]) for c in POINTS["byzantine"]]
    np.testing.assert_array_equal(np.asarray(state.aggregation.byzantine), np.stack(byz))
    step = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(2), ROUNDS):
        state, _ = step(state, data, key)
        for g in range(4):
            changes = []
            for i in range(10):
                if n[i]:
                    delta = _gd(ref, w[g], x[i], y[i], n[i]) - w[g]
                    flip = byz[g][i] and POINTS["attack"][g] == 1
                    changes.append(-10.0 * delta if flip else delta)
            f = POINTS["f"][g]
            srt = np.sort(np.asarray(changes), axis=0)
            w[g] = w[g] + srt[f : len(srt) - f].mean(axis=0)
            np.testing.assert_allclose(state.params[g], w[g], rtol=1e-5, atol=1e-6)


def _np_softmax_gd(w, b, x, y, n):
    """τ full-batch GD steps of the mean softmax cross-entropy over the n real rows."""
    w, b = w.copy(), b.copy()
    x, onehot = x[:n].astype(np.float64), np.eye(w.shape[1])[y[:n]]
    for _ in range(TAU):
        logits = x @ w + b
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        w = w - LR * x.T @ (p - onehot) / n
        b = b - LR * (p - onehot).mean(axis=0)
    return w, b


def test_label_flip_trains_the_byzantine_clients_on_c_minus_1_minus_y():
    """Points {honest, label flip} of one program against a loop: the Byzantine clients'
    labels y → C − 1 − y before their τ steps (C = 3), every client's change averaged."""
    from fedjax_sim.data import FederatedData
    from fedjax_sim.models import mlp_classifier

    rng = np.random.default_rng(4)
    sizes = (3, 1, 4, 0, 2, 3)
    xs = [rng.normal(size=(k, 2)).astype(np.float32) for k in sizes]
    ys = [rng.integers(0, 3, size=k).astype(np.int32) for k in sizes]
    data = FederatedData.from_clients(xs, ys)
    model = mlp_classifier((2,), [], 3)
    choices = (None, attacks.label_flip(3))

    def build_at(p):
        return with_aggregator(
            fedavg(model, sgd(LR, steps=TAU)),
            robust.mean(),
            byzantine=2,
            attack=attacks.one_of(choices, _whole(p, "attack")),
        )

    alg = with_grid(build_at, {"attack": [0, 1]})
    state = jax.jit(alg.init)(jax.random.key(0), data)
    byz = np.asarray(state.aggregation.byzantine[0])
    assert byz.sum() == 2
    x, y, n = np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)
    params = [
        (
            np.asarray(state.params["Dense_0"]["kernel"][g], np.float64),
            np.asarray(state.params["Dense_0"]["bias"][g], np.float64),
        )
        for g in range(2)
    ]
    step = jax.jit(alg.round)
    for key in jax.random.split(jax.random.key(1), 2):
        state, _ = step(state, data, key)
        for g in range(2):
            w, b = params[g]
            moves = [
                np.concatenate(
                    [
                        a.ravel()
                        for a in _np_softmax_gd(
                            w, b, x[i], 2 - y[i] if (g == 1 and byz[i]) else y[i], n[i]
                        )
                    ]
                )
                - np.concatenate([w.ravel(), b])
                for i in range(len(n))
                if n[i]
            ]
            move = np.mean(moves, axis=0)
            params[g] = (w + move[: w.size].reshape(w.shape), b + move[w.size :])
            np.testing.assert_allclose(
                state.params["Dense_0"]["kernel"][g], params[g][0], rtol=1e-5, atol=1e-6
            )
            np.testing.assert_allclose(
                state.params["Dense_0"]["bias"][g], params[g][1], rtol=1e-5, atol=1e-6
            )
    assert not np.allclose(params[0][0], params[1][0])  # the flip changed the model
    direct = with_aggregator(
        fedavg(model, sgd(LR, steps=TAU)), robust.mean(), byzantine=2, attack=attacks.label_flip(3)
    )
    alone = direct.init(jax.random.key(0), data)
    for key in jax.random.split(jax.random.key(1), 2):
        alone, _ = jax.jit(direct.round)(alone, data, key)
    np.testing.assert_allclose(
        alone.params["Dense_0"]["kernel"], params[1][0], rtol=1e-5, atol=1e-6
    )


# --------------------------------------------------------------------------- the sweep


def test_byzantine_digits_runs_one_program_per_rule_and_alpha():
    from fedjax_sim.experiments.hetero.experiment import BYZANTINE
    from fedjax_sim.experiments.registry import get_preset
    from fedjax_sim.experiments.runner import (
        SWEEP,
        _group_cells,
        expand_cells,
        resolve_settings,
        sweep_axes,
    )

    preset = get_preset("byzantine-digits", SWEEP)
    settings = resolve_settings(preset, {}, SWEEP, None)
    cells = expand_cells(settings, sweep_axes(preset, settings))
    groups = _group_cells(BYZANTINE, BYZANTINE.sweep, cells)
    # aggregator × pre_aggregation × alpha programs, each over attack × byzantine
    assert len(groups) == 4 * 2 * 2
    assert {len(g) for g in groups} == {4 * 4}
    for group in groups:
        assert len({(c["aggregator"], c["pre_aggregation"], c["alpha"]) for c in group}) == 1
        # byzantine=0 is one point for every attack: 1 + 3 shares × 4 attacks
        assert BYZANTINE.sweep.program_size(group) == (1 + 3 * 4) * settings["seeds"]


TINY = [
    "num_clients=10",
    "rounds=2",
    "eval_every=2",
    "seeds=2",
    "hidden=8",
    "local_steps=2",
    "alpha=0.5",
    "aggregator=trimmed_mean",
    "pre_aggregation=nnm",
    "attack=none,sign_flip,alie,label_flip",
    "byzantine=0,0.1,0.2",
]


@pytest.mark.slow
def test_a_grouped_sweep_equals_its_cells_run_one_at_a_time(tmp_path):
    """`fedjax-sim sweep byzantine-digits` over attack × byzantine (f varying with the
    share; label_flip on the clients' views) as one program: every trial equals the cell
    trained alone (float rounding)."""
    from fedjax_sim import cli
    from fedjax_sim.experiments import study
    from fedjax_sim.experiments.hetero.experiment import BYZANTINE

    out = tmp_path / "sweep"
    assert (
        cli.main(["sweep", "byzantine-digits", "--out", str(out), "--no-progress", "--set", *TINY])
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert list(config["plan"]["trials_per_program"].values()) == [(1 + 2 * 4) * 2]
    with open(out / "trials.csv") as f:
        grouped = list(csv.DictReader(f))
    assert len(grouped) == 12 * 2
    base = {
        **BYZANTINE.defaults(),
        **{k: type(BYZANTINE.defaults()[k])(v) for k, v in (kv.split("=") for kv in TINY[:7])},
        "aggregator": "trimmed_mean",
        "pre_aggregation": "nnm",
    }
    plain = study.sweep_of(dataclasses.replace(BYZANTINE, sweep=None))
    for row in grouped:
        cell = {**base, "attack": row["attack"], "byzantine": float(row["byzantine"])}
        if cell["byzantine"] == 0:
            cell["attack"] = "none"
        alone = plain.trials(cell, [int(row["data_seed"])])[0]
        for metric in ("test_accuracy", "test_accuracy_worst", "train_loss", "test_loss"):
            np.testing.assert_allclose(
                float(row[metric]),
                alone[metric],
                rtol=2e-5,
                atol=1e-6,
                err_msg=f"{metric} of {cell['attack']}, byzantine={cell['byzantine']}",
            )


def test_the_summary_bands_and_plots_the_worst_case_against_the_share(tmp_path):
    """Each rule's worst attack per share, with ±1 standard error of that cell's seeds
    (mean ± s/√n, s with ddof 1), drawn against the share."""
    from fedjax_sim.experiments.hetero.byzantine import plot_fractions, worst_case
    from fedjax_sim.experiments.hetero.experiment import BYZANTINE

    base = BYZANTINE.defaults()
    acc = {
        ("median", "alie"): 0.5,
        ("median", "ipm"): 0.6,
        ("krum", "alie"): 0.7,
        ("krum", "ipm"): 0.45,
    }
    seeds = (0.02, -0.01, 0.005)
    cells, trials = [], []
    for share in (0.1, 0.2):
        for (rule, attack), value in acc.items():
            cid = f"{rule}/{attack}/{share}"
            cells.append(
                {**base, "aggregator": rule, "attack": attack, "byzantine": share, "cell_id": cid}
            )
            trials += [
                {"cell_id": cid, "data_seed": i, "test_accuracy": value - share + d}
                for i, d in enumerate(seeds)
            ]
    summary = BYZANTINE.sweep.summarize(trials, cells, ["aggregator", "attack", "byzantine"])
    worst = worst_case(summary)
    assert {(r["rule"], r["byzantine"], r["worst_attack"]) for r in worst} == {
        ("median", 0.1, "alie"),
        ("median", 0.2, "alie"),
        ("krum", 0.1, "ipm"),
        ("krum", 0.2, "ipm"),
    }
    half = np.std(seeds, ddof=1) / np.sqrt(3)
    for r in worst:
        mean = acc[(r["rule"], r["worst_attack"])] - r["byzantine"] + np.mean(seeds)
        np.testing.assert_allclose(
            [r["worst_test_accuracy_lo"], r["worst_test_accuracy_hi"]],
            [mean - half, mean + half],
            rtol=1e-9,
        )
    written = plot_fractions(worst, summary, tmp_path)
    assert [p.name for p in written] == ["worst_case.png", "accuracy_by_attack.png"]
    assert all(p.stat().st_size > 0 for p in written)


@pytest.mark.exhaustive  # the grouped sweep twice in a subprocess (CI's set checks the rules'
# rounds on 1 and 4 devices in tests/test_devices_rules.py)
def test_a_grouped_sweep_on_two_devices_equals_one(tmp_path):
    """The one program per group on 2 forced CPU devices (`--devices 2`, the clients
    sharded) gives the trials of 1 device, label flip on views among the attacks."""
    import subprocess
    import sys
    from pathlib import Path

    from federations import subprocess_env

    from fedjax_sim import cli

    tiny = [*TINY[:9], "attack=none,sign_flip,label_flip", "byzantine=0,0.2"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert (
        cli.main(["sweep", "byzantine-digits", "--out", str(one), "--no-progress", "--set", *tiny])
        == 0
    )
    script = (
        f"import sys; from fedjax_sim import cli; sys.exit(cli.main(['sweep', "
        f"'byzantine-digits', '--out', {str(two)!r}, '--no-progress', '--devices', '2', "
        f"'--set', *{tiny!r}]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=subprocess_env(2),
        cwd=Path(__file__).resolve().parents[1],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = {}
    for out in (one, two):
        with open(out / "trials.csv") as f:
            rows[out.name] = {(r["cell_id"], r["data_seed"]): r for r in csv.DictReader(f)}
    assert rows["one"].keys() == rows["two"].keys() and len(rows["one"]) == 6 * 2
    for key, a in rows["one"].items():
        b = rows["two"][key]
        for metric in ("test_accuracy", "train_loss", "test_loss"):
            np.testing.assert_allclose(
                float(b[metric]),
                float(a[metric]),
                rtol=1e-5,
                atol=1e-6,
                err_msg=f"{metric} of {key}",
            )
