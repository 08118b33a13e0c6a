"""The benchmark harness (benchmarks/harness.py) and the old-vs-new table (compare_runs.py).

Only the pieces that can fail are tested, on tiny inputs; no benchmark runs.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.models.recsys import compiled_flops

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import compare_runs  # noqa: E402
import harness  # noqa: E402


@pytest.fixture
def fake_checkout(tmp_path):
    """A checkout-shaped directory whose tiny fedjax_sim says where it was imported from."""
    root = tmp_path / "fake_checkout"
    package = root / "fedjax_sim"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("FAKE = True\n")
    (package / "core.py").write_text("def f():\n    return 1\n")
    return root


def _python(code: str, *args: str) -> dict:
    """Runs code in a fresh Python that can import harness; its printed JSON object."""
    prelude = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r})\n"
    return harness.run_point_subprocess("-c", [prelude + textwrap.dedent(code), *args])


# --------------------------------------------------------------------------- timing


def test_compile_then_time_compiles_apart_then_times_steady_calls():
    fn = jax.jit(lambda x: jnp.sin(x) * 2.0 + 1.0)
    timing = harness.compile_then_time(fn, jnp.ones(64), reps=5)
    assert timing.compile_s is not None and timing.compile_s > 0
    assert timing.first_call_s > 0
    assert timing.count == len(timing.times) == 5
    assert timing.median_s >= timing.min_s > 0
    assert timing.min_s == min(timing.times)
    np.testing.assert_allclose(timing.output, np.sin(1.0) * 2 + 1, rtol=1e-6)
    assert set(timing.summary()) == {"compile_s", "first_call_s", "median_s", "min_s", "count"}


def test_compile_then_time_plain_callable_chaining_and_budget():
    calls = []

    def step(x):
        calls.append(x)
        return x + 1

    # Not jitted: no compile_s; next_args chains each output into the next call.
    timing = harness.compile_then_time(
        step, 0, reps=3, next_args=lambda i, args, out: (out,),
        on_call=lambda i, s, out: calls.append(("seen", i)),
    )
    assert timing.compile_s is None
    assert [c for c in calls if not isinstance(c, tuple)] == [0, 1, 2, 3]
    assert [c[1] for c in calls if isinstance(c, tuple)] == [0, 1, 2, 3]
    assert timing.output == 4 and timing.count == 3

    # A spent budget with min_reps=0: only the warm-up runs.
    none = harness.compile_then_time(step, 0, reps=3, min_reps=0, budget_s=0.0)
    assert none.count == 0 and none.median_s is None and none.min_s is None
    with pytest.raises(ValueError, match="min_reps"):
        harness.compile_then_time(step, 0, reps=1, min_reps=2)


def test_interleaved_blocks_alternates_arms():
    order = []
    arms = {
        "a": harness.Arm(lambda: order.append("a"), min_calls=2, max_calls=2),
        "b": harness.Arm(lambda: order.append("b"), min_calls=1, max_calls=1),
    }
    times = harness.interleaved_blocks(arms, blocks=3)
    assert order == ["a", "a", "b"] * 3
    assert len(times["a"]) == 6 and len(times["b"]) == 3
    assert all(t >= 0 for t in times["a"] + times["b"])


def test_thunk_profile_counts_loop_bodies_and_self_times():
    """A 20-step loop's body instructions run 20 times per call; the loop's own event
    spans them, and its self time has theirs subtracted (never negative)."""
    def f(x):
        return jax.lax.fori_loop(0, 20, lambda i, a: jnp.tanh(a @ a) + i, x)

    x = jnp.eye(64) * 0.5
    compiled = jax.jit(f).lower(x).compile()
    profile = harness.thunk_profile(compiled, x, calls=3)
    assert profile, "no instruction was traced"
    assert all(p["us_per_call"] >= 0 for p in profile.values())
    assert any(p["count_per_call"] == 20 for p in profile.values())  # the body, per call
    loops = [p for p in profile.values() if "while" in p["op_name"] and p["count_per_call"] == 1]
    body = sum(p["us_per_call"] for p in profile.values() if p["count_per_call"] == 20)
    assert loops and body > 0, profile
    # Without the subtraction the loop's time would include its body's, so exceed it.
    assert max(p["us_per_call"] for p in loops) < body, profile


def test_probes_report_positive_ceilings():
    stream = harness.stream_bandwidth(1 << 14, reps=2)
    matmul = harness.matmul_peak(32, reps=2)
    assert stream["stream_GBps"] > 0 and stream["stream_bytes_moved"] == 3 * (1 << 14) * 4
    assert matmul["matmul_peak_GFLOPs"] > 0 and matmul["matmul_size"] == 32
    assert harness.linear_round_bytes(2, 3, 5) == 2 * 2 * 3 * 5 * 4 + 2 * 3 * 4


# --------------------------------------------------------------------------- meta


def test_meta_has_machine_and_provenance():
    meta = harness.collect_meta(harness.REPO, quick=True)
    assert isinstance(meta["cpu_model"], str) and meta["cpu_model"]
    assert meta["host_cpus"] >= 1 and len(meta["loadavg_start"]) == 3
    for key in ("date_utc", "python", "jax", "jaxlib", "numpy", "backend", "devices"):
        assert meta[key], key
    assert meta["checkout"] == str(harness.REPO) and meta["quick"] is True
    assert len(meta["fedjax_sim_sources_sha256"]) == 16
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=harness.REPO, capture_output=True, text=True
    )
    if head.returncode == 0:  # a git checkout (an unpacked sdist has none)
        assert meta["git_head"] == head.stdout.strip()
        assert isinstance(meta["git_dirty"], bool)
    else:
        assert meta["git_head"] is None
    done = harness.finish_meta(meta, started=0.0)
    assert len(done["loadavg_end"]) == 3 and done["total_seconds"] > 0


def test_git_provenance_is_none_outside_fedjax_sims_repo(fake_checkout, tmp_path):
    assert harness.git_provenance(fake_checkout / "fedjax_sim") == {
        "git_head": None, "git_dirty": None,
    }
    # Inside some other repository (its top is not the package's parent): still None.
    outer = tmp_path / "outer"
    shutil.copytree(fake_checkout, outer / "sub")
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    assert harness.git_provenance(outer / "sub" / "fedjax_sim")["git_head"] is None
    assert harness.source_provenance(fake_checkout)["git_head"] is None


def test_sources_hash_follows_the_sources(fake_checkout, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(fake_checkout, copy)
    package = copy / "fedjax_sim"
    before = harness.sources_sha256(package)
    assert before == harness.sources_sha256(fake_checkout / "fedjax_sim")  # content, not place
    (package / "notes.txt").write_text("not a source")
    assert harness.sources_sha256(package) == before
    (package / "core.py").write_text("def f():\n    return 2\n")
    changed = harness.sources_sha256(package)
    assert changed != before
    (package / "core.py").rename(package / "kernels.py")
    assert harness.sources_sha256(package) != changed


# --------------------------------------------------------------------------- JSON


def test_write_json_is_strict(tmp_path):
    path = tmp_path / "sub" / "out.json"
    harness.write_json(path, {
        "nan": float("nan"), "inf": [np.float32("inf"), -math.inf, 1.5],
        "np_int": np.int64(3), "tuple": (1, 2), "array": np.array([1.0, np.nan]),
        "nested": [{"x": np.float64("nan")}], "path": pathlib.Path("/a"),
    })
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(name):
        raise AssertionError(f"non-strict constant {name}")

    loaded = json.loads(text, parse_constant=refuse)
    assert loaded == {
        "nan": None, "inf": [None, None, 1.5], "np_int": 3, "tuple": [1, 2],
        "array": [1.0, None], "nested": [{"x": None}], "path": "/a",
    }
    with pytest.raises(TypeError):
        harness.write_json(tmp_path / "bad.json", {"obj": object()})


# --------------------------------------------------------------------------- checkout


def test_use_checkout_refuses_a_directory_without_fedjax_sim(tmp_path):
    with pytest.raises(harness.CheckoutError, match="not a fedjax_sim checkout"):
        harness.use_checkout(tmp_path)
    with pytest.raises(harness.CheckoutError):
        harness.resolve_checkout(tmp_path / "missing")


def test_use_checkout_default_is_this_repository():
    module = harness.use_checkout()
    assert pathlib.Path(module.__file__).resolve().is_relative_to(harness.REPO / "fedjax_sim")


def test_use_checkout_imports_from_the_checkout_and_detects_another_copy(fake_checkout, tmp_path):
    got = _python(
        """
        import json, harness
        m = harness.use_checkout(sys.argv[1])
        print(json.dumps({"file": m.__file__, "fake": m.FAKE}))
        """,
        str(fake_checkout),
    )
    assert got == {"file": str(fake_checkout / "fedjax_sim" / "__init__.py"), "fake": True}

    other = tmp_path / "other"
    shutil.copytree(fake_checkout, other)
    got = _python(
        """
        import json, harness
        sys.path.insert(0, sys.argv[2]); import fedjax_sim  # another copy, first
        try:
            harness.use_checkout(sys.argv[1])
        except harness.CheckoutError as err:
            print(json.dumps({"refused": str(err)}))
        """,
        str(fake_checkout), str(other),
    )
    assert "not from the checkout" in got["refused"]


def test_checkout_from_argv():
    assert harness.checkout_from_argv(["--out", "x", "--checkout", "/tmp/old"]) == "/tmp/old"
    assert harness.checkout_from_argv(["--checkout=/tmp/old"]) == "/tmp/old"
    assert harness.checkout_from_argv(["--quick"]) is None


# --------------------------------------------------------------------------- subprocesses


def test_run_point_subprocess_parses_the_childs_json():
    got = harness.run_point_subprocess(
        "-c",
        ["import json, os; print('compiling...'); "
         "print(json.dumps({'x': 1, 'env': os.environ['HARNESS_TEST']}))"],
        env={"HARNESS_TEST": "yes"},
    )
    assert got == {"x": 1, "env": "yes"}


def test_run_point_subprocess_reports_failures():
    failed = harness.run_point_subprocess("-c", ["raise ValueError('boom')"])
    assert failed["returncode"] == 1 and "ValueError: boom" in failed["error"]
    silent = harness.run_point_subprocess("-c", ["print('no json')"])
    assert "no JSON" in silent["error"]
    slow = harness.run_point_subprocess("-c", ["import time; time.sleep(30)"], timeout=0.5)
    assert "ran past" in slow["error"]


# --------------------------------------------------------------------------- old vs new table


def _run_file(path, seconds, cell_seconds, head):
    meta = {"git_head": head, "checkout": "/x", "loadavg_start": [1, 1, 1],
            "loadavg_end": [1, 1, 1], "fedjax_sim_sources_sha256": head * 4}
    rows = [
        {"kind": "config", "m": 10, "n": 10, "d": 20, "k": 2,
         "vectorized_s_per_round": seconds[0], "meta": meta,
         "sweep_cell": {"seconds_per_seed": cell_seconds,
                        "official_40_seed_seconds": 40 * cell_seconds, "seeds_measured": 1,
                        "official_40_seed_seconds_is": "extrapolated"}},
        {"kind": "config", "m": 100, "n": 5, "d": 5, "k": 4,
         "vectorized_s_per_round": seconds[1], "meta": meta},
    ]
    harness.write_json(path, rows)
    return path


def test_compare_runs_flags_rows_more_than_5_percent_slower(tmp_path):
    old = _run_file(tmp_path / "old.json", (1.0e-3, 2.0e-3), 10.0, "aaaa")
    new = _run_file(tmp_path / "new.json", (1.04e-3, 2.2e-3), 12.0, "bbbb")
    text, flagged = compare_runs.compare(str(old), str(new))
    assert flagged == 2  # (100, 5, 5, 4) at 1.10 and the sweep cell at 1.2; 1.04 is not
    lines = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert "slower" not in lines["10"] and "1.040" in lines["10"]
    assert "slower" in lines["100"] and "1.100" in lines["100"]
    assert "slower" in lines["seconds per seed"]
    assert compare_runs.main([str(old), str(new), "--fail-on-slower"]) == 1


def test_dense_flops_counts_what_xla_computes_for_an_sgd_step():
    """One SGD step of a 256-64-10 MLP on 32 rows: XLA's own flop count (a written-out
    flax-free MLP, differentiated by jax.grad over its weights only) is the counted matmul
    work plus a few percent of biases and activations; the '6 × params' rule is far above."""
    rng = np.random.default_rng(0)
    w1, b1 = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32), jnp.zeros(64)
    w2, b2 = jnp.asarray(rng.normal(size=(64, 10)), jnp.float32), jnp.zeros(10)
    x = jnp.asarray(rng.normal(size=(32, 256)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 32))

    def loss(params, x, y):
        (w1, b1), (w2, b2) = params
        logits = jax.nn.relu(x @ w1 + b1) @ w2 + b2
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))

    params = ((w1, b1), (w2, b2))
    xla = compiled_flops(jax.grad(loss), params, x, y)
    counted = harness.dense_flops((256, 64, 10), steps=32)
    assert counted == 2 * 32 * (256 * 64 + 64 * 10) + 2 * 32 * (256 * 64 + 64 * 10) \
        + 2 * 32 * (64 * 10)
    assert counted <= xla <= 1.05 * counted
    six_params = 6 * 32 * (256 * 64 + 64 + 64 * 10 + 10)
    assert six_params > 1.4 * xla
    assert harness.dense_flops((256, 64, 10), forward=32) == 2 * 32 * (256 * 64 + 64 * 10)
