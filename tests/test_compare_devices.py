"""`fedjax-sim compare --devices`: a comparison's client axis (axis 1, after the seeds) over
4 (forced CPU) devices gives the numbers of one device, to float summation order.

Sharding changes the order of the cross-client sums (as `run --devices` does), so the
floats agree to a few ulps of float32, not bit for bit; counts, verdicts and every
discrete column agree exactly. JAX fixes its device count when it initialises, so the
comparisons run in one fresh subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federations import subprocess_env
from jax.sharding import PartitionSpec as P

from fedjax_sim import compare, parallel
from fedjax_sim.data.federated import FederatedData, ServerData

IFCA = ["ifca-synthetic-tiny", "--set", "seeds=2", "rounds=6", "eval_every=3", "restarts=2",
        "methods=fedavg,ifca", "checkpoint_every=0"]
# One federation shared by every seed (resplit_per_seed=false): data without a seeds axis.
DRFA = ["drfa-synthetic-noise", "--set", "seeds=2", "rounds=4", "eval_every=2",
        "num_clients=8", "local_steps=2", "methods=fedavg,drfa", "checkpoint_every=0",
        "resplit_per_seed=false"]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, json, pathlib, shutil, sys
    import jax
    from fedjax_sim import cli, parallel, simulate
    from fedjax_sim.data.federated import FederatedData

    out, ifca, drfa = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    placed = []  # the partition spec of every client-data leaf simulate.run placed
    place = parallel.place_inputs

    def spy(inputs, mesh, copy_axes=0):
        result = place(inputs, mesh, copy_axes)
        for node in jax.tree.leaves(result, is_leaf=lambda n: isinstance(n, FederatedData)):
            if isinstance(node, FederatedData):
                placed.append([list(node.num_examples.sharding.spec),
                               list(node.y.sharding.spec)])
        return result

    simulate.parallel.place_inputs = spy

    def main(args):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli.main([*args, "--no-progress"])
        return {"code": code, "stderr": err.getvalue(), "placed": placed[:]}

    result = {}
    for name, args in (("ifca", ifca), ("drfa", drfa)):
        for d in (1, 4):
            placed.clear()
            result[f"{name}{d}"] = main(["compare", *args, "--devices", str(d),
                                         "--out", f"{out}/{name}{d}"])
    # Resume on another device count: ifca retrains on 4 devices, fedavg is kept.
    shutil.copytree(f"{out}/ifca1", f"{out}/resumed")
    for name in ("results.csv", "methods/ifca.json"):
        (pathlib.Path(out) / "resumed" / name).unlink()
    placed.clear()
    result["resumed"] = main(["compare", "--resume", "--out", f"{out}/resumed", "--devices", "4"])
    for name, devices in (("more", "8"), ("indivisible", "3")):
        placed.clear()
        result[name] = main(["compare", *ifca, "--devices", devices, "--out", f"{out}/{name}"])
    print("RESULT" + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare_devices")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out), json.dumps(IFCA), json.dumps(DRFA)],
        capture_output=True, text=True, env=subprocess_env(4), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return out, json.loads(line[len("RESULT"):])


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _number(text):
    try:
        return float(text)
    except ValueError:
        return None


def _assert_close_csv(a, b, abs_columns=()):
    """Same rows, same columns, same text for every non-number; numbers within float32
    summation order (columns in abs_columns, differences that may be ~0, absolutely)."""
    rows_a, rows_b = _rows(a), _rows(b)
    assert len(rows_a) == len(rows_b) > 0
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert ra.keys() == rb.keys()
        for key in ra:
            x, y = _number(ra[key]), _number(rb[key])
            if x is None or y is None or key in ("seed", "round", "seeds_used",
                                                 "diverged_seeds", "cluster_accuracy"):
                assert ra[key] == rb[key], (a.name, key, ra, rb)
            elif any(key.endswith(c) for c in abs_columns):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-5, err_msg=f"{a.name} {key}")
            else:
                np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=f"{a.name} {key}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ifca", "drfa"])
def test_four_devices_give_the_numbers_of_one(runs, name):
    out, result = runs
    assert result[f"{name}1"]["code"] == result[f"{name}4"]["code"] == 0, result
    for table in ("per_seed.csv", "per_seed_metrics.csv", "metrics.csv"):
        _assert_close_csv(out / f"{name}1" / table, out / f"{name}4" / table)
    _assert_close_csv(out / f"{name}1" / "results.csv", out / f"{name}4" / "results.csv",
                      abs_columns=("_diff", "_diff_se"))
    one, four = (json.loads((out / f"{name}{d}" / "config.json").read_text()) for d in (1, 4))
    assert (one["mesh_devices"], four["mesh_devices"]) == (1, 4)
    # --devices is no setting: it changes no result beyond summation order, so a resume
    # may change it.
    assert one["settings"] == four["settings"] and "devices" not in four["settings"]


@pytest.mark.slow
def test_the_client_axis_is_sharded_not_the_seeds(runs):
    _, result = runs
    assert result["ifca1"]["placed"] == result["drfa1"]["placed"] == []  # one device: no mesh
    # ifca: a data set per seed, [seeds, m, ...]; drfa here: one shared [m, ...].
    assert result["ifca4"]["placed"] == [[[None, "clients"]] * 2] * 2
    assert result["drfa4"]["placed"] == [[["clients"]] * 2] * 2


@pytest.mark.slow
def test_resume_on_another_device_count(runs):
    out, result = runs
    assert result["resumed"]["code"] == 0, result["resumed"]["stderr"]
    assert result["resumed"]["placed"] == [[[None, "clients"]] * 2]  # ifca only
    config = json.loads((out / "resumed" / "config.json").read_text())
    assert config["mesh_devices"] == 4 and len(config["resumed"]) == 1
    _assert_close_csv(out / "ifca1" / "per_seed.csv", out / "resumed" / "per_seed.csv")


@pytest.mark.slow
@pytest.mark.parametrize(("case", "says"), [
    ("more", "devices must be an integer in [1, 4]"),
    ("indivisible", "clients=20 must be divisible by the number of devices (3) to shard it; "
                    "choose --devices dividing it (here: 1, 2, 4)"),
])
def test_refused_before_anything_is_written(runs, case, says):
    out, result = runs
    refused = result[case]
    assert refused["code"] == 2
    assert refused["stderr"].count("\n") == 1 and says in refused["stderr"], refused["stderr"]
    assert not (out / case).exists()
    assert refused["placed"] == []


# ----------------------------------------------------------------------------- in process


def _stacked(seeds=2, m=4):
    return FederatedData(x=jnp.zeros((seeds, m, 3, 2)), y=jnp.zeros((seeds, m, 3)),
                         num_examples=jnp.ones((seeds, m), jnp.int32),
                         cluster=jnp.zeros((seeds, m), jnp.int32))


def test_input_shardings_follow_the_declared_copies_axes():
    mesh = parallel.make_mesh(1)
    inputs = (_stacked(), ServerData({"x": jnp.zeros((2, 5, 2)), "y": jnp.zeros((2, 5))}))
    specs = parallel.input_shardings(inputs, mesh, copy_axes=1)
    clients, server = specs
    assert {s.spec for s in jax.tree.leaves(clients)} == {P(None, parallel.AXIS)}
    assert {s.spec for s in jax.tree.leaves(server)} == {P()}
    assert parallel.num_clients(inputs[0], 1) == 4
    with pytest.raises(ValueError, match=r"num_examples has shape \(2, 4\), but 0 leading"):
        parallel.input_shardings(inputs, mesh)


def test_a_method_whose_data_has_other_copies_axes_is_refused():
    spec = compare.MethodRun(algorithm=None, data=_stacked(), key=None, rounds=1,
                             evaluate=lambda state: {}, data_copies=0)
    with pytest.raises(ValueError, match="0 leading copies axes were declared"):
        compare.method_clients(spec)
    assert compare.method_clients(spec._replace(data_copies=1)) == 4
