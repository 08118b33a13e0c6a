"""A broken newest checkpoint: resume falls back to the newest intact one, or says none is.

Rounds 10, 20 and 30 of a small state are saved, then round 30 is broken the
ways a full disk, a stopped copy or a stray `rm` break it. Each fault is first
checked to make a plain `restore` of round 30 raise, so a test cannot pass on a
fault orbax shrugs off (deleting `_CHECKPOINT_METADATA` or `state/_METADATA`
alone, for one, does not stop a restore).
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_sim.checkpoint import CheckpointError, RunCheckpoints

ROUNDS = (10, 20, 30)
BASE_KEY_SEED = 7


def _state(round_: int) -> dict:
    return {
        "weights": jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3) * round_ + 0.5,  # [4, 3]
        "counts": jnp.arange(5, dtype=jnp.int32) + round_,  # [5]
        "key": jax.random.key(round_),
    }


ABSTRACT_STATE = jax.eval_shape(lambda: _state(0))
ABSTRACT_KEY = jax.eval_shape(lambda: jax.random.key(0))


def _history(round_: int) -> list:
    return [{"round": r, "loss": np.float32(1.0 / r)} for r in ROUNDS if r <= round_]


def _save(directory, round_: int, state=None) -> None:
    with RunCheckpoints(directory, max_to_keep=3) as checkpoints:
        checkpoints.save(round_, _state(round_) if state is None else state,
                         jax.random.key(BASE_KEY_SEED), _history(round_))


@pytest.fixture
def saved(tmp_path):
    directory = tmp_path / "checkpoints"
    for round_ in ROUNDS:
        _save(directory, round_)
    return directory


def _assert_restored(restored, round_: int, state=None) -> None:
    expected = _state(round_) if state is None else state
    assert restored.round == round_
    np.testing.assert_array_equal(restored.state["weights"], expected["weights"])
    np.testing.assert_array_equal(restored.state["counts"], expected["counts"])
    assert restored.state["counts"].dtype == jnp.int32
    np.testing.assert_array_equal(jax.random.key_data(restored.state["key"]),
                                  jax.random.key_data(expected["key"]))
    assert jax.random.key_impl(restored.state["key"]) == jax.random.key_impl(expected["key"])
    np.testing.assert_array_equal(jax.random.key_data(restored.key),
                                  jax.random.key_data(jax.random.key(BASE_KEY_SEED)))
    assert [row["round"] for row in restored.history] == [r for r in ROUNDS if r <= round_]


def _largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _halve(path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _truncate_largest_state_file(step):
    # With arrays this small the largest file is the JSON `state/_METADATA`.
    _halve(_largest_file(step / "state"))


def _truncate_array_data(step):
    # The OCDBT data file the arrays are read from (`state/d/<hash>`).
    _halve(_largest_file(step / "state" / "d"))


def _delete_ocdbt_manifest(step):
    (step / "state" / "manifest.ocdbt").unlink()


def _delete_metadata(step):
    for name in ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt"):
        (step / name).unlink()


def _empty_step(step):
    shutil.rmtree(step)
    step.mkdir()


def _delete_progress(step):
    shutil.rmtree(step / "progress")


FAULTS = {
    "truncated largest state file": _truncate_largest_state_file,
    "truncated array data": _truncate_array_data,
    "no ocdbt manifest": _delete_ocdbt_manifest,
    "no metadata files": _delete_metadata,
    "empty step directory": _empty_step,
    "no progress item": _delete_progress,
}


def _break(directory, fault: str, round_: int = 30) -> None:
    FAULTS[fault](directory / str(round_))
    # orbax raises ValueError (tensorstore, JSON), KeyError (a missing item) or
    # FileNotFoundError (a missing file).
    with RunCheckpoints(directory, max_to_keep=3) as checkpoints:
        with pytest.raises((ValueError, KeyError, OSError)):
            checkpoints.restore(ABSTRACT_STATE, ABSTRACT_KEY, round_)


@pytest.mark.parametrize("fault", FAULTS)
def test_falls_back_to_the_newest_intact_step(saved, fault):
    _break(saved, fault)
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
        _assert_restored(restored, 20)
        assert [step for step, _ in skipped] == [30]
        reason = skipped[0][1]
        assert reason and "\n" not in reason and len(reason) < 200
        # The broken step is gone, so the run can write round 30 again.
        assert not (saved / "30").exists()
        assert checkpoints.steps() == [10, 20]


@pytest.mark.parametrize("fault", FAULTS)
def test_saves_the_skipped_round_again_after_a_fallback(saved, fault):
    _break(saved, fault)
    new_state = _state(33)
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        restored, _ = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
        assert restored.round == 20
        checkpoints.save(30, new_state, jax.random.key(BASE_KEY_SEED), _history(30))
        assert checkpoints.steps() == [10, 20, 30]
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
        assert skipped == []
        _assert_restored(restored, 30, new_state)
        _assert_restored(checkpoints.restore(ABSTRACT_STATE, ABSTRACT_KEY), 30, new_state)


def test_no_intact_step_is_a_one_line_error_naming_the_directory(saved):
    _break(saved, "truncated array data", 30)
    _break(saved, "empty step directory", 20)
    _break(saved, "no progress item", 10)
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        with pytest.raises(CheckpointError) as error:
            checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
    message = str(error.value)
    assert "\n" not in message
    assert str(saved) in message
    assert "round 30 (ValueError: " in message
    assert "round 20 (empty step directory)" in message
    assert "round 10 (no 'progress' item)" in message
    assert message.index("round 30") < message.index("round 20") < message.index("round 10")
    # Nothing is deleted when there is nothing to fall back to.
    assert sorted(p.name for p in saved.iterdir()) == ["10", "20", "30"]


@pytest.mark.parametrize("listed_by_orbax", [True, False], ids=["listed", "unlisted"])
def test_an_empty_newer_step_directory_is_reported(saved, monkeypatch, listed_by_orbax):
    (saved / "60").mkdir()
    if not listed_by_orbax:
        # orbax on a local disk lists every `DIR/<int>/`; on GCS it skips one
        # without `commit_success.txt`. The unlisted kind must be reported too.
        _hide_from_orbax(monkeypatch, 60)
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
        _assert_restored(restored, 30)
        assert skipped == [(60, "empty step directory")]
        assert not (saved / "60").exists()
        checkpoints.save(40, _state(40), jax.random.key(BASE_KEY_SEED), _history(40))
        assert checkpoints.steps() == [20, 30, 40]


def test_a_full_step_directory_orbax_does_not_list_is_reported(saved, monkeypatch):
    shutil.copytree(saved / "30", saved / "60")
    _hide_from_orbax(monkeypatch, 60)
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
    _assert_restored(restored, 30)
    assert skipped == [(60, "not a finished orbax step")]


def test_a_step_directory_made_after_opening_is_seen(saved):
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        assert checkpoints.steps() == [10, 20, 30]
        shutil.copytree(saved / "20", saved / "60")
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
    assert restored.round == 20 and skipped == []  # the copy holds round 20's progress


def _hide_from_orbax(monkeypatch, step: int) -> None:
    import orbax.checkpoint as ocp

    all_steps = ocp.CheckpointManager.all_steps
    monkeypatch.setattr(ocp.CheckpointManager, "all_steps",
                        lambda self, *a, **kw: [s for s in all_steps(self, *a, **kw) if s != step])


def test_temporary_and_other_directories_are_not_steps(saved):
    with RunCheckpoints(saved, max_to_keep=3) as checkpoints:
        assert checkpoints.steps() == [10, 20, 30]  # opening removed orbax's temporary dirs
        (saved / "40.orbax-checkpoint-tmp-1234").mkdir()
        (saved / "50.bak").mkdir()
        (saved / "notes").mkdir()
        restored, skipped = checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY)
    _assert_restored(restored, 30)
    assert skipped == []


@pytest.mark.parametrize("make_directory", [False, True], ids=["missing", "empty"])
def test_no_step_directories_is_no_checkpoint(tmp_path, make_directory):
    directory = tmp_path / "checkpoints"
    if make_directory:
        directory.mkdir()
    with RunCheckpoints(directory, max_to_keep=3) as checkpoints:
        assert checkpoints.restore_latest_intact(ABSTRACT_STATE, ABSTRACT_KEY) == (None, [])
    assert directory.exists() == make_directory
