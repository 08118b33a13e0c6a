"""Client chunks on a device mesh: IFCA chunked on 4 (forced CPU) devices == unchunked on 1.

`scan_client_chunks` lays chunk t over clients t, S + t, 2S + t, ... so that
with the client axis sharded over D devices every chunk takes an equal share
of every device's block. The compiled programs are checked for collectives:
a chunked map over the clients must move no client data between devices.

JAX fixes its device count when it initialises, so the check runs in a fresh
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from federations import subprocess_env

SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, numpy as np
    from fedjax_sim import parallel, simulate
    from fedjax_sim.execution import Execution
    from federations import eight_clients, evaluate_as_run
    from fedjax_sim.algorithms import ifca, sgd
    from fedjax_sim.execution import planned
    from fedjax_sim.ops import cluster_losses

    data, model = eight_clients()
    mesh = parallel.make_mesh(4)
    options = {  # (training, settings)
        "I": (sgd(0.1), {"num_clusters": 2}),
        "II": (sgd(0.1, steps=2, batch_size=3),
               {"num_clusters": 2, "option": "model", "stable_rounds": 2}),
        "II-partial": (sgd(0.1, steps=2, batch_size=3),
                       {"num_clusters": 2, "option": "model", "participation": 0.5}),
    }
    COLLECTIVE = re.compile(
        r"= (.+?) (all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter)"
        r"(-start)?\\(")
    SHAPE = re.compile(r"[a-z]+[0-9]*\\[[0-9,]*\\]")

    def collectives(compiled):
        # [result shape, op] of every cross-device collective in the compiled HLO
        # (one entry per array of a tuple-shaped collective).
        found = {(shape, m.group(2)) for m in COLLECTIVE.finditer(compiled.as_text())
                 for shape in SHAPE.findall(m.group(1))}
        return sorted(found)

    out = {"runs": {}, "hlo": {}}
    for name, (training, kwargs) in options.items():
        algorithm = ifca(model, training, **kwargs)
        for devices, chunk in ((1, None), (4, 4), (4, 3)):
            chunked = planned(data, client_chunk=chunk)  # the chunk rides on the data
            run_mesh = None if devices == 1 else mesh
            state, history = simulate.run(
                algorithm, chunked, jax.random.key(7), rounds=5, eval_every=5,
                execution=Execution(progress=False, mesh=run_mesh),
            )
            ev = evaluate_as_run(algorithm, state, chunked, run_mesh)
            out["runs"][f"{name}/{devices}/{chunk}"] = {
                "leaves": [np.asarray(x).tolist() for x in jax.tree.leaves(state)],
                "assignment": np.asarray(ev["assignment"]).tolist(),
                "client_loss": np.asarray(ev["client_loss"]).tolist(),
                "history": history,
            }

    sharded = parallel.shard_clients(planned(data, client_chunk=4), mesh)
    for name in ("I", "II"):
        training, kwargs = options[name]
        algorithm = ifca(model, training, **kwargs)
        state = jax.jit(algorithm.init)(jax.random.key(0), sharded)
        state = parallel.shard_state(state, algorithm.client_axes(state), mesh)
        out["hlo"][f"round {name}"] = collectives(
            jax.jit(algorithm.round).lower(state, sharded, jax.random.key(1)).compile())
        out["hlo"][f"evaluate {name}"] = collectives(
            jax.jit(algorithm.evaluate).lower(state, sharded).compile())
    params = jax.device_put(state.cluster_params, parallel.replicated(mesh))
    out["hlo"]["cluster_losses"] = collectives(
        jax.jit(lambda p, d: cluster_losses(model, p, d, 4)).lower(params, sharded).compile())
    out["data_shapes"] = [f"f32[{','.join(map(str, a.shape))}]" for a in (data.x, data.y)]
    print("RESULT" + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def results():
    env = subprocess_env(4)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
@pytest.mark.parametrize("option", ["I", "II", "II-partial"])
def test_chunked_on_four_devices_equals_unchunked_on_one(results, option):
    runs = results["runs"]
    base = runs[f"{option}/1/None"]
    # chunk 4: every chunk takes one client from each device; chunk 3 does not divide
    # m = 8, so chunks are gathered by index and the last one is padded. (Unchunked on 4
    # devices against 1: the IFCA cases of test_sharding.py.)
    for devices, chunk in ((4, 4), (4, 3)):
        got = runs[f"{option}/{devices}/{chunk}"]
        where = f"option {option}, client_chunk={chunk} on {devices} devices"
        assert got["assignment"] == base["assignment"], where
        np.testing.assert_allclose(got["client_loss"], base["client_loss"], rtol=1e-5,
                                   atol=1e-6, err_msg=where)
        assert len(got["leaves"]) == len(base["leaves"]), where
        for a, b in zip(got["leaves"], base["leaves"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=where)
        assert [r["round"] for r in got["history"]] == [r["round"] for r in base["history"]]
        for row_a, row_b in zip(got["history"], base["history"], strict=True):
            assert row_a.keys() == row_b.keys(), where
            for key in row_a:
                np.testing.assert_allclose(row_a[key], row_b[key], rtol=1e-5, atol=1e-6,
                                           err_msg=f"{where}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("program", ["cluster_losses", "evaluate I", "evaluate II"])
def test_chunked_map_moves_no_data_between_devices(results, program):
    # A map over client chunks (the loss matrix, IFCA's evaluation) has nothing to
    # reduce across clients: with 4 | client_chunk | m its compiled program on the
    # 4-device mesh holds no collective at all. (The contiguous chunks used before
    # moved every chunk's [4, 6, 5] rows with an all-reduce per step.)
    assert results["hlo"][program] == [], results["hlo"][program]


@pytest.mark.slow
@pytest.mark.parametrize("option", ["I", "II"])
def test_chunked_round_never_gathers_the_whole_data(results, option):
    # The whole [m, n, d] data is never all-gathered in a chunked IFCA round.
    shapes = {shape for shape, _ in results["hlo"][f"round {option}"]}
    assert not shapes & set(results["data_shapes"]), results["hlo"][f"round {option}"]


@pytest.mark.slow
@pytest.mark.parametrize("option", ["I", "II"])
def test_chunked_round_moves_only_cluster_sums(results, option):
    # With every client taking part, the chunk body gets its rows from
    # scan_client_chunks (which scans `data` itself), so what crosses devices is
    # the per-cluster sums (all-reduce over [k, d]), never a chunk's rows. (Reading
    # them with data.take(ids) instead compiled to a masked local gather plus an
    # all-reduce of each chunk's [chunk, n, d] rows.)
    chunk_rows = {"f32[4,6,5]", "f32[4,6]"}  # x and y of one chunk of 4 clients
    shapes = {shape for shape, _ in results["hlo"][f"round {option}"]}
    assert not shapes & chunk_rows, results["hlo"][f"round {option}"]
