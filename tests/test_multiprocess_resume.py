"""Checkpoints and `--resume` in a two-process run (jax.distributed on localhost, gloo).

Both processes of a `--distributed` run are SIGKILLed once a checkpoint is on
disk, relaunched with `--resume`, and the resumed metrics.csv and
summary.json are compared, as strings, with an uninterrupted two-process run.
The reference is a two-process run, not a one-process one: sharding the
clients over two processes changes the order of float sums, so the two agree
only to rounding (tests/test_sharding.py checks that), while a two-process run
is deterministic and its resumed copy must match it bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from federations import xla_flags

# The settings of tests/test_sharding.py's two-process test with 40 rounds and a
# checkpoint every 10: each chunk of 10 rounds is evaluated (gathers across the
# processes) and checkpointed (orbax syncs the processes, ~0.5 s), which leaves the
# kill a window of over a second after the first checkpoint. The test fails, never
# passes, if the kill misses it.
ROUNDS = 40
SETTINGS = ["--set", f"rounds={ROUNDS}", "eval_every=10", "checkpoint_every=10", "restarts=3",
            "--no-progress"]
# Timing, and rounds_run (the rounds this process ran: fewer after a resume, by design).
TIMING = ("seconds", "rounds_per_second", "compile_seconds", "evaluate_seconds", "run_seconds",
          "rounds_run")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(out, cache, *extra):
    """The two processes of `fedjax-sim run ifca-synthetic-tiny --distributed`.

    The three launches share a persistent XLA compilation cache (the same
    programs each time): it saves ~5 s of compiling per launch on 2 cores and
    cannot change a number, since a cached executable is the one compiled.
    """
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": xla_flags(1),
           "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "fedjax_sim.cli", "run", "ifca-synthetic-tiny", *SETTINGS,
             "--out", str(out), "--distributed", "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i), *extra],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]


def _finish(procs, timeout=300):
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    logs = [p.stdout.read() for p in procs]
    for p in procs:
        p.stdout.close()
    assert codes == [0, 0], logs
    return logs


def _checkpoint_steps(directory):
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _summary(out):
    summary = json.loads((out / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k not in TIMING}


@pytest.mark.slow
def test_killed_two_process_run_resumes_to_identical_results(tmp_path):
    killed, whole, cache = tmp_path / "killed", tmp_path / "whole", tmp_path / "xla-cache"
    procs = _launch(killed, cache)
    try:
        deadline = time.monotonic() + 240
        while not _checkpoint_steps(killed / "checkpoints"):
            if any(p.poll() is not None for p in procs):
                for p in procs:
                    p.kill()
                pytest.fail("a process ended before the first checkpoint was seen:\n"
                            + "\n".join(p.stdout.read() for p in procs))
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint within 240 s")
            time.sleep(0.01)
        for p in procs:
            p.send_signal(signal.SIGKILL)
        assert [p.wait(timeout=60) for p in procs] == [-signal.SIGKILL] * 2
    finally:
        for p in procs:
            p.kill()
            p.stdout.close()
    steps = _checkpoint_steps(killed / "checkpoints")
    assert not (killed / "summary.json").exists(), "the kill landed after the run had finished"
    assert steps and max(steps) < ROUNDS, steps

    # A native multi-host orbax checkpoint: each process wrote its own array store.
    state_dir = killed / "checkpoints" / str(steps[-1]) / "state"
    assert (state_dir / "ocdbt.process_0").is_dir() and (state_dir / "ocdbt.process_1").is_dir()

    resumed_logs = _finish(_launch(killed, cache, "--resume"))
    whole_logs = _finish(_launch(whole, cache))
    assert "wrote" in resumed_logs[0] and "wrote" not in resumed_logs[1]  # only process 0 writes
    assert "wrote" in whole_logs[0]

    text = (whole / "metrics.csv").read_text()
    assert text.count("\n") == 1 + 3 * (ROUNDS // 10 + 1)  # header, rounds 0..ROUNDS × 3 restarts
    assert (killed / "metrics.csv").read_text() == text
    assert _summary(killed) == _summary(whole)
    config = json.loads((killed / "config.json").read_text())
    assert config["processes"] == 2 and config["mesh_devices"] == 2
    assert len(config["resumed"]) == 1
    assert _checkpoint_steps(killed / "checkpoints") == [ROUNDS - 10, ROUNDS]


# Each process saves, then restores, a state with a client-sharded leaf (its rows
# differ per process), a replicated one, a typed key and a process-local leaf.
CHECKPOINT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from fedjax_sim import parallel

    directory, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    parallel.initialize_distributed(f"127.0.0.1:{port}", 2, pid)
    from fedjax_sim.checkpoint import RunCheckpoints

    mesh = parallel.make_mesh()
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)  # 4 clients, 2 per process
    ids = parallel.process_client_ids(4, mesh)
    state = {
        "w": parallel.assemble_clients(rows[ids], 4, mesh),
        "c": jax.jit(lambda: np.float32(2.5), out_shardings=parallel.replicated(mesh))(),
        "k": jax.jit(lambda: jax.random.key(3), out_shardings=parallel.replicated(mesh))(),
        "local": jax.numpy.arange(3),
    }
    key = jax.random.key(5)
    with RunCheckpoints(directory) as checkpoints:
        before = checkpoints.steps()
        checkpoints.save(4, state, key, [{"round": 4, "loss": np.float32(0.5)}])
    abstract = jax.eval_shape(lambda: state)
    abstract = {**abstract,
                "w": jax.ShapeDtypeStruct((4, 2), np.float32,
                                          sharding=parallel.client_sharding(mesh)),
                "c": jax.ShapeDtypeStruct((), np.float32, sharding=parallel.replicated(mesh))}
    with RunCheckpoints(directory) as checkpoints:
        steps = checkpoints.steps()
        restored = checkpoints.restore(abstract, key)
    w = restored.state["w"]
    print("RESULT" + json.dumps({
        "before": before, "steps": steps, "round": restored.round,
        "ids": ids.tolist(),
        "w_shards": [np.asarray(s.data).tolist() for s in w.addressable_shards],
        "w_global": not w.is_fully_addressable,
        "c": float(restored.state["c"]),
        "k": jax.random.key_data(restored.state["k"]).tolist(),
        "local": np.asarray(restored.state["local"]).tolist(),
        "local_on_this_process": restored.state["local"].is_fully_addressable,
        "key": jax.random.key_data(restored.key).tolist(),
        "history": [{k: float(v) for k, v in row.items()} for row in restored.history],
    }))
    """
)


@pytest.mark.slow
def test_each_process_restores_its_own_shards(tmp_path):
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": xla_flags(1)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHECKPOINT_SCRIPT, str(tmp_path / "c"), str(port), str(i)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    logs = _finish(procs, timeout=120)
    results = [
        json.loads(next(l for l in log.splitlines() if l.startswith("RESULT"))[len("RESULT"):])
        for log in logs
    ]
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    for result in results:
        assert result["before"] == [] and result["steps"] == [4] and result["round"] == 4
        assert result["w_global"]  # one array over both processes, not a local copy
        assert result["w_shards"] == [rows[result["ids"]].tolist()], result
        assert result["c"] == 2.5 and result["local"] == [0, 1, 2]
        assert result["local_on_this_process"]
        assert result["k"] == [0, 3] and result["key"] == [0, 5]
        assert result["history"] == [{"round": 4.0, "loss": 0.5}]
    assert sorted(r["ids"][0] for r in results) == [0, 2]  # each process held its own rows
