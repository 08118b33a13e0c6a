"""DP-FTRL from the experiments: cyclic participation, the tree restarted each epoch, and
ε after every evaluated round by dp-accounting's tree aggregation event.

Kairouz et al. (arXiv:2103.00039, App. D): every client at most once per tree, the tree
restarted every epoch; ε of E whole epochs of G rounds and a running one of r rounds is
that of SelfComposedDpEvent(SingleEpochTreeAggregationDpEvent(σ, G), E) composed with
SingleEpochTreeAggregationDpEvent(σ, r), by RDP under replace-with-zero adjacency. The
test builds those events with dp-accounting itself.
"""

from __future__ import annotations

import csv
import json

import dp_accounting
import jax
import numpy as np
import pytest

from fedjax_sim import accounting, cli
from fedjax_sim.algorithms import fedavg, sgd, with_dp_ftrl, with_systems
from fedjax_sim.algorithms.private import PRIVACY_STREAM
from fedjax_sim.ops import sample_cohort
from fedjax_sim.systems import Systems

LR, TAU = 0.1, 3
TINY = [
    "num_clients=40",
    "rounds=4",
    "eval_every=2",
    "seeds=2",
    "hidden=8",
    "local_steps=2",
    "dp_mechanism=ftrl",
]


def _tree_epsilon(sigma, groups, rounds, delta):
    """dp-accounting called directly: whole epochs' trees, then the running epoch's."""
    epochs, rest = divmod(rounds, groups)
    events = []
    if epochs:
        events.append(
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, groups), epochs
            )
        )
    if rest:
        events.append(dp_accounting.SingleEpochTreeAggregationDpEvent(sigma, rest))
    acc = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    )
    acc.compose(dp_accounting.ComposedDpEvent(events))
    return acc.get_epsilon(delta)


def test_tree_epsilons_are_dp_accountings_tree_aggregation():
    sigma, delta, groups = 2.5, 1e-5, 3
    rounds = [1, 2, 3, 4, 7, 9]
    got = accounting.tree_epsilons(sigma, delta, groups, rounds)
    want = [_tree_epsilon(sigma, groups, r, delta) for r in rounds]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got == sorted(got) and got[0] < got[1]  # a deeper tree costs more
    # G = 1 (every client every round): one tree of depth 1 per round
    assert accounting.tree_epsilons(sigma, delta, 1, [5]) == pytest.approx(
        [accounting.tree_epsilon(sigma, delta, 1, 5)]
    )
    assert accounting.tree_epsilons(0.0, delta, groups, [2]) == [np.inf]


def test_calibrate_tree_noise_meets_the_target_within_one_percent():
    sigma = accounting.calibrate_tree_noise(2.0, 1e-5, 4, 10)
    eps = _tree_epsilon(sigma, 4, 10, 1e-5)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=0.01)
    with pytest.raises(ValueError, match="unreachable"):
        accounting.calibrate_tree_noise(1e-4, 1e-5, 4, 10, max_noise_multiplier=10.0)


def test_cyclic_cohorts_take_turns_every_client_once_per_epoch():
    m, s = 12, 4
    systems = Systems(cyclic=True)
    seen = [
        np.asarray(sample_cohort(jax.random.key(t), m, s, systems=systems, round_=np.int32(t)).ids)
        for t in range(6)
    ]
    for t, ids in enumerate(seen):
        np.testing.assert_array_equal(ids, np.arange(s) + (t % 3) * s)
    assert sorted(np.concatenate(seen[:3]).tolist()) == list(range(m))
    with pytest.raises(ValueError, match="multiple of s"):
        sample_cohort(jax.random.key(0), 10, 4, systems=systems, round_=0)
    with pytest.raises(ValueError, match="every client available"):
        Systems(cyclic=True, availability=0.5)


def _np(data):
    return np.asarray(data.x), np.asarray(data.y), np.asarray(data.num_examples)


def _gd(ref, theta, x, y, n):
    theta = np.asarray(theta, np.float64).copy()
    for _ in range(TAU):
        theta = theta - LR * ref.grad(theta, x, y, n)
    return theta


def _clip(delta, clip):
    norm = np.linalg.norm(delta)
    return delta * min(1.0, clip / norm) if norm > 0 else delta


def test_dp_ftrl_with_cyclic_groups_restarts_its_tree_each_epoch(ragged, linear_model, ref):
    """Round t trains group (t − 1) mod G (1-based t); within epoch e the step is
    θ_t = θ_{t−1} + (S_t + n_t − n_{t−1}) / s, n the epoch's own tree's prefix noise at
    its step t − eG, n = 0 before an epoch's first round (a loop written here)."""
    clip, sigma, groups, rounds = 0.4, 0.7, 5, 7  # ragged: 5 clients, groups of one
    alg = with_systems(
        with_dp_ftrl(
            fedavg(linear_model, sgd(LR, steps=TAU), participation=0.2),
            clip,
            sigma,
            rounds=groups,
            restart=True,
        ),
        Systems(cyclic=True),
    )
    state = alg.init(jax.random.key(0), ragged)
    x, y, n = _np(ragged)
    w = np.asarray(state.params, np.float64)
    nodes, previous = {}, np.zeros_like(w)
    for t, key in enumerate(jax.random.split(jax.random.key(3), rounds), start=1):
        state, _ = jax.jit(alg.round)(state, ragged, key)
        step = (t - 1) % groups + 1
        if step == 1:
            nodes, previous = {}, np.zeros_like(w)
        level = (step & -step).bit_length() - 1
        (leaf_key,) = jax.random.split(jax.random.fold_in(key, PRIVACY_STREAM), 1)
        nodes[level] = sigma * clip * np.asarray(jax.random.normal(leaf_key, w.shape), np.float64)
        prefix = sum(nodes[lv] for lv in range(step.bit_length()) if (step >> lv) & 1)
        i = (t - 1) % groups
        total = _clip(_gd(ref, w, x[i], y[i], n[i]) - w, clip) if n[i] else 0.0
        w = w + (total + prefix - previous) / 1.0
        previous = prefix
        np.testing.assert_allclose(state.params, w, rtol=1e-5, atol=1e-5)


def _run(tmp_path, *settings):
    out = tmp_path / "run"
    method = [] if any(s.startswith("method=") for s in settings) else ["method=fedavg"]
    code = cli.main(
        [
            "run",
            "dp-hetero-digits",
            "--out",
            str(out),
            "--no-progress",
            "--set",
            *TINY,
            *method,
            *settings,
        ]
    )
    return code, out


@pytest.mark.slow  # trains the MLP (about 25 s on 2 cores)
def test_an_ftrl_run_reports_the_tree_epsilon_after_every_evaluation(tmp_path):
    code, out = _run(tmp_path, "participation=0.5", "target_epsilon=3")
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    record = summary["privacy"]
    assert (record["sampling"], record["groups"], record["cohort_slots"]) == ("cyclic", 2, 20)
    sigma, delta = record["noise_multiplier"], record["delta"]
    final = _tree_epsilon(sigma, 2, 4, delta)
    assert final <= 3.0 and final == pytest.approx(3.0, rel=0.01)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    by_round = {int(r["round"]): float(r["epsilon"]) for r in rows if r["epsilon"]}
    assert sorted(by_round) == [0, 2, 4] and by_round[0] == 0.0
    for r in (2, 4):
        assert by_round[r] == pytest.approx(_tree_epsilon(sigma, 2, r, delta), rel=1e-5)
    assert summary["final_mean"]["epsilon"] == pytest.approx(final, rel=1e-5)
    participants = [float(r["participants"]) for r in rows if int(r["round"]) > 0]
    assert participants and set(participants) == {20.0}


@pytest.mark.parametrize(
    "settings, message",
    [
        (["dp_sampling=fixed"], "setting dp_sampling is read only with dp_mechanism=gaussian"),
        (["dp_accountant=rdp"], "setting dp_accountant is read only with dp_mechanism=gaussian"),
        (["availability=0.5"], "setting availability: dp_mechanism=ftrl takes no sampling"),
        (["method=ifca"], "cannot be trained with DP-FTRL"),
        (["participation=0.3"], "m must be a multiple of the cohort"),
        (["target_epsilon=1e-4"], "is unreachable at delta=1e-05 after 4 rounds of DP-FTRL"),
    ],
)
def test_bad_ftrl_settings_are_refused_in_one_line_and_write_nothing(
    tmp_path, capsys, settings, message
):
    code, out = _run(tmp_path, *settings)
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert len([line for line in err.splitlines() if line.strip()]) == 1
    assert not (out / "metrics.csv").exists() and not (out / "summary.json").exists()
