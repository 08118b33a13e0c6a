"""Run checkpoints with orbax: the whole algorithm state, the PRNG key, the round and the history.

A checkpoint is one orbax step directory, `DIR/<round>/`, with two items:

- `state`: the algorithm state pytree (models, optimizer states, λ,
  assignments, counters; PRNG keys as their raw key data) and the run's base
  PRNG key data, written by orbax's `StandardSave`;
- `progress`: JSON with the round, the key implementations and, when the run
  keeps them, every round's metrics (numpy values keep their dtype).

The history rows so far are JSON text too (`encode_history`, numpy values
keeping their dtype, so a restored history is bit-for-bit the saved one), but
stored as the UTF-8 bytes of that text, a uint8 array beside the state
(`history_json`; its length in `progress`): a run's history grows with its
rounds, and each row is encoded once and then only copied, never re-encoded,
escaped into a JSON string or parsed by the saving thread. Checkpoints that
hold the history inside `progress` (older versions) restore as well.

Keeping the history inside the step directory makes it part of the same
atomic unit as the state: orbax writes a step into a temporary directory and
renames it when complete, so a process killed at any moment leaves the
previous steps intact and never a half-written latest one. Temporary
directories left by a killed save are removed when the directory is next
opened. The newest `max_to_keep` steps are kept.

Saves are asynchronous on one process (orbax's own asynchronous mode): `save`
copies the state to host memory in the caller and returns while orbax writes
the files, commits the step and deletes the step past `max_to_keep` in its
background thread; the next `save` first waits for it (and raises its error,
if it failed), and `close` waits for the last one, so every checkpoint a run
asked for is complete on disk when the run returns, and none is ever dropped.
No jax array is read off the caller's thread. (A save of a state of a few KB
costs ~30-50 ms of CPU, most of it orbax's fixed cost per save; running the
whole orbax save on a thread of our own cut the caller's share from ~6.5 to
~1 ms, but had the worker read device arrays while the caller ran compiled
rounds, and was given up.) Under several processes saves stay synchronous.
Before a checkpoint is written, `save` fsyncs the rows appended with
`io.append_csv(..., sync=False)` (metrics.csv): every row of the rounds a
checkpoint covers is durable before that checkpoint exists.

The directory is created on the first save, so a run shorter than its
checkpoint interval leaves none behind.

Atomic renames do not protect a step from what happens after it is written
(a disk that fills or fails, a copy that stops half-way, a hand that deletes
a file): `restore_latest_intact` tries the steps newest first, skips each one
that is empty, lacks an item or fails to restore, and deletes the skipped ones
once an older step has restored, so the resumed run can write those rounds
again. When no step restores it raises `CheckpointError`, one line naming the
directory and what each step held.

Under several processes (`jax.distributed`) every process calls `save` and
`restore` together on the same (shared) directory, as orbax's multi-host
checkpointing expects: each process writes the shards its devices hold,
process 0 writes the metadata and the JSON and commits the step. A restore
gives each process its own shards of the target's sharding. Arrays that live
on one process only (the base key, or a run without a mesh that every
process computes in full) are saved as one array replicated over every
device, and come back on this process's first device.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from fedjax_sim.io import sync_appended

_STATE, _PROGRESS = "state", "progress"
# orbax's default step directory name, `DIR/<round>`; its temporary
# `<round>.orbax-checkpoint-tmp...` directories do not match.
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")
_REASON_CHARS = 150


def _orbax():
    # Imported on first use: orbax adds ~0.6 s to `import fedjax_sim`, which most runs skip.
    import orbax.checkpoint

    if not isinstance(sys.unraisablehook, _QuietClosedLoops):
        sys.unraisablehook = _QuietClosedLoops(sys.unraisablehook)
    return orbax.checkpoint


class _QuietClosedLoops:
    """An unraisablehook that drops asyncio's "Event loop is closed" from finished restores.

    A restore that fails (a truncated or byte-flipped array file) leaves
    tensorstore reads in flight; orbax closes its event loop, and when they
    complete tensorstore's callbacks find it closed. Python prints each as an
    unraisable traceback although nothing is lost: the failure was already
    raised (and the step skipped). Those go to the `fedjax_sim.checkpoint`
    logger; every other unraisable exception to the previous hook.
    """

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            logging.getLogger(__name__).debug("ignored after a restore: %r", error)
            return
        self.previous(unraisable)


# tensorstore's status in an orbax error: `[os_error_code='28']`, or the code name alone.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _os_error(error: Exception, path: Path) -> OSError | None:
    """The OSError (errno, reason, path) behind an orbax/tensorstore write error, if it is one."""
    if isinstance(error, OSError) and error.errno:
        return OSError(error.errno, error.strerror or str(error), str(path))
    text = str(error)
    found = _OS_ERROR_CODE.search(text)
    if found:
        code = int(found.group(1))
    elif "No space left on device" in text or "RESOURCE_EXHAUSTED" in text:
        code = errno.ENOSPC
    elif "Permission denied" in text or "PERMISSION_DENIED" in text:
        code = errno.EACCES
    elif "Read-only file system" in text:
        code = errno.EROFS
    else:
        return None
    return OSError(code, os.strerror(code), str(path))


class CheckpointError(ValueError):
    """A checkpoint directory that holds step directories but no step that restores."""


class Restored(NamedTuple):
    round: int  # rounds done when the checkpoint was written
    state: Any  # the algorithm state, shaped and placed like the abstract target
    key: jax.Array  # the run's base PRNG key
    history: list  # history rows up to `round`
    round_metrics: dict | None = None  # {name: [round, ...]} when saved with them
    kernel_form: str | None = None  # the kernel form the rounds ran in (None: none recorded)
    # the client chunk the form's timing chose over the plan's (None: the plan's)
    kernel_chunk: int | None = None
    plan: dict | None = None  # `execution.plan_record` of the rounds (None: none recorded)


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keystr(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _process_local(x) -> bool:
    """Under several processes: whether x is on this process only (not a global array)."""
    if jax.process_count() == 1:
        return False
    sharding = getattr(x, "sharding", None)
    return sharding is None or sharding.is_fully_addressable


def _replicated_everywhere() -> jax.sharding.NamedSharding:
    """Replicated over every device of every process."""
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("devices",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _global(x):
    """x as an array orbax can save under several processes.

    Orbax refuses a process-local array there ("Cannot serialize host local
    jax.Array ... in multi-host setting"). Such a leaf holds the same value on
    every process (the key every process was given, or state every process
    computes in full), so it is saved as one replicated global array.
    """
    if not _process_local(x):
        return x
    return jax.make_array_from_process_local_data(_replicated_everywhere(), np.asarray(x))


def _placed(x):
    """A ShapeDtypeStruct of x with a sharding (orbax needs one to restore onto)."""
    if _process_local(x):
        sharding = _replicated_everywhere()  # then `_localized` to this process
    else:
        sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(
            jax.devices()[0]
        )
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _localized(x, like):
    """A restored leaf placed like the abstract `like`: process-local ones back on this process."""
    if not _process_local(like):
        return x
    sharding = getattr(like, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.local_devices()[0]
    )
    return jax.device_put(x.addressable_data(0), sharding)


def _key_data_like(x):
    """The abstract key data of an abstract key leaf, on the same sharding."""
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


def _one_line(error: Exception) -> str:
    """The exception's type and the first line of its message, cut to `_REASON_CHARS`."""
    lines = str(error).strip().splitlines()
    first = lines[0].strip() if lines else ""
    if len(first) > _REASON_CHARS:
        first = first[: _REASON_CHARS - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _process_0_says(flag: bool) -> bool:
    """Process 0's flag on every process, so that all of them take the same branch."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(flag)))


def _every_process_says(flag: bool) -> bool:
    """Whether the flag holds on every process."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.int32(flag))))


def _process_0_steps(steps: list[int]) -> list[int]:
    """Process 0's list of steps on every process."""
    if jax.process_count() == 1:
        return steps
    from jax.experimental import multihost_utils

    count = int(multihost_utils.broadcast_one_to_all(np.int32(len(steps))))
    padded = np.zeros(count, np.int32)
    padded[: min(count, len(steps))] = steps[:count]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)]


def encode_history(value):
    """History rows as JSON-able values; numpy arrays and scalars keep their dtype."""
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        return {
            "__ndarray__": array.tolist(),
            "dtype": array.dtype.str,
            "scalar": isinstance(value, np.generic),
        }
    if isinstance(value, dict):
        return {str(k): encode_history(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_history(v) for v in value]
    return value


def decode_history(value):
    """Inverse of `encode_history` (JSON lists come back as lists, arrays as numpy)."""
    if isinstance(value, dict):
        if "__ndarray__" in value:
            dtype = np.dtype(value["dtype"])
            if value["scalar"]:
                return dtype.type(value["__ndarray__"])
            return np.asarray(value["__ndarray__"], dtype=dtype)
        return {k: decode_history(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_history(v) for v in value]
    return value


class RunCheckpoints:
    """The checkpoints of one run in `directory` (orbax `CheckpointManager`; saves are
    asynchronous on one process, complete at the next `save` or at `close`).

    Under several processes every method is collective: every process calls
    it, in the same order, on the same shared directory.
    """

    def __init__(self, directory, max_to_keep: int = 2):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an integer >= 1; got {max_to_keep!r}.")
        self.directory = Path(directory).absolute()
        self.max_to_keep = max_to_keep
        self._manager = None
        self._pending: int | None = None  # the step an asynchronous save is writing
        # The history rows saved so far and their JSON texts: a run's history only
        # grows, so each save encodes only the rows added since the previous one.
        self._rows: list = []
        self._encoded: list[str] = []

    def _open(self):
        """The orbax CheckpointManager (opening it removes a killed save's temporary directory)."""
        ocp = _orbax()
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                enable_async_checkpointing=jax.process_count() == 1,
                cleanup_tmp_directories=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=(_STATE, _PROGRESS)
            )
        return self._manager

    def _exists(self) -> bool:
        # Opening the manager syncs the processes, so they must all choose
        # alike: process 0's view decides.
        return _process_0_says(self.directory.exists())

    def _step_dirs(self) -> list[int]:
        """Rounds of the `DIR/<round>/` directories on disk, whatever orbax makes of them."""
        if not self.directory.is_dir():
            return []
        return [int(p.name) for p in self.directory.iterdir()
                if p.is_dir() and _STEP_NAME.fullmatch(p.name)]

    def _incomplete(self, step: int, listed) -> str | None:
        """Why `DIR/<step>/` cannot be a checkpoint, seen without reading it (None: it may be)."""
        path = self.directory / str(step)
        if not path.is_dir():
            return "no step directory"
        if not any(path.iterdir()):
            return "empty step directory"
        missing = [item for item in (_STATE, _PROGRESS) if not (path / item).is_dir()]
        if missing:
            return f"no {' or '.join(repr(item) for item in missing)} item"
        if step not in listed:
            return "not a finished orbax step"
        return None

    def _delete_steps(self, steps: list[int]) -> None:
        """Removes the step directories (process 0 deletes, every process waits for it)."""
        if not steps:
            return
        if jax.process_index() == 0:
            for step in steps:
                shutil.rmtree(self.directory / str(step), ignore_errors=True)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("fedjax_sim:deleted_broken_steps")
        # orbax caches its list of steps; it would refuse to save a deleted one again.
        self._open().reload()

    def steps(self) -> list[int]:
        """Rounds with a complete checkpoint, oldest first (after waiting for a save)."""
        self.wait()
        if self._manager is None and not self._exists():
            return []
        return sorted(self._open().all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def _encode_history(self, history: list) -> np.ndarray:
        """The UTF-8 bytes of the JSON text of encode_history(history), as uint8, reusing
        the texts of the same row objects saved before (rows are not changed once saved:
        `simulate.run` only appends)."""
        done = len(self._rows)
        if done > len(history) or any(
                a is not b for a, b in zip(self._rows, history[:done], strict=True)):
            self._rows, self._encoded, done = [], [], 0  # not the same history
        self._rows += history[done:]
        self._encoded += [json.dumps(encode_history(row), allow_nan=True)
                          for row in history[done:]]
        text = "[" + ",".join(self._encoded) + "]"
        return np.frombuffer(text.encode("utf-8"), np.uint8)

    def _translated(self, error: Exception, step: int):
        """The OSError (naming the step) behind an orbax write error, the temporary
        directory of the unfinished step removed; None when it is not one."""
        failed = _os_error(error, self.directory / str(step))
        if failed is not None and jax.process_index() == 0:
            # The unfinished step is only a temporary directory: give its space back
            # (orbax would remove it when the directory is next opened).
            for tmp in self.directory.glob(f"{int(step)}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        return failed

    def wait(self) -> None:
        """Waits until the last save is complete on disk.

        Raises:
          OSError: the save failed for an OS reason (e.g. ENOSPC), naming its step.
        """
        if self._manager is None or self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            failed = self._translated(error, step)
            if failed is None:
                raise
            raise failed from None

    def save(self, step: int, state, key, history: list, *, round_metrics=None,
             kernel_form: str | None = None, kernel_chunk: int | None = None,
             plan: dict | None = None) -> None:
        """Writes the checkpoint of round `step`.

        First every row appended with `io.append_csv(..., sync=False)` is fsynced
        (`io.sync_appended`) and the previous save is waited for. On one process
        the files are then written in the background: the checkpoint is complete
        at the next `save`, `wait` or `close` (which raise its error); a process
        killed before then keeps the previous checkpoints intact. Under several
        processes it returns once the checkpoint is complete.

        round_metrics: optional {name: host array [step, ...]}, every round's metrics
        so far (`Execution(round_metrics=True)`), restored with the checkpoint.
        kernel_form: the kernel form the rounds ran in (`fedjax_sim.tuning`), which a
        resumed run takes again.
        kernel_chunk: the client chunk the form's timing chose over the plan's
          (`tuning.Choice.client_chunk`; None: the plan's), which a resumed run takes
          again.
        plan: what of the execution plan may change the numbers
        (`execution.plan_record`: the client chunk), which a resume must keep.

        Raises:
          OSError: this save, or the previous one, failed for an OS reason.
        """
        sync_appended()
        self.wait()
        flat, treedef = jax.tree_util.tree_flatten_with_path(state)
        key_impls = {_keystr(p): str(jax.random.key_impl(x)) for p, x in flat if _is_key(x)}
        saveable = jax.tree_util.tree_unflatten(
            treedef, [jax.random.key_data(x) if _is_key(x) else x for _, x in flat]
        )
        typed = _is_key(key)
        progress = {
            "round": int(step),
            "key_impl": str(jax.random.key_impl(key)) if typed else None,
            "state_key_impls": key_impls,
            "kernel_form": kernel_form,
            "kernel_chunk": kernel_chunk,
            "plan": plan,
        }
        history_json = self._encode_history(history)
        progress["history_json_bytes"] = int(history_json.size)
        arrays = {}
        if round_metrics is not None:
            # As arrays beside the state (their shapes and dtypes in progress), not JSON:
            # they grow with the rounds. Empty ones (no round yet) and dtypes JAX would
            # narrow (float64 without x64) stay in the JSON.
            values = {name: np.asarray(v) for name, v in round_metrics.items()}
            arrays = {name: v for name, v in values.items()
                      if v.size and jax.dtypes.canonicalize_dtype(v.dtype) == v.dtype}
            progress["round_metrics"] = encode_history(
                {name: v for name, v in values.items() if name not in arrays})
            progress["round_metrics_names"] = list(values)
            progress["round_metrics_shapes"] = {name: list(v.shape) for name, v in values.items()}
            progress["round_metrics_arrays"] = {
                name: {"shape": list(v.shape), "dtype": v.dtype.str} for name, v in arrays.items()}
        items = {"state": saveable, "key": jax.random.key_data(key) if typed else key,
                 "history_json": history_json}
        if arrays:
            items["round_metrics"] = arrays
        items = jax.tree.map(_global, items)
        ocp = _orbax()
        manager = self._open()
        if jax.process_count() == 1:
            # orbax writes later: numpy arrays the caller may change are copied now.
            items = jax.tree.map(
                lambda x: x.copy() if isinstance(x, np.ndarray) and x.flags.writeable else x,
                items)
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(items),
                                     _PROGRESS: ocp.args.JsonSave(progress)})
        try:
            manager.save(int(step), args=args, force=True)
            self._pending = int(step)
            if jax.process_count() > 1:
                self.wait()
        except Exception as error:
            self._pending = None
            failed = self._translated(error, step)
            if failed is None:
                raise
            raise failed from None

    def restore(self, abstract_state, abstract_key, step: int | None = None) -> Restored:
        """The checkpoint of round `step` (default: the latest).

        Args:
          abstract_state: the state's structure, shapes and dtypes (e.g.
            `jax.eval_shape(algorithm.init, key, data)`); leaves with a
            `sharding` are restored onto it, the rest onto the first device.
          abstract_key: the base key (or its ShapeDtypeStruct).
          step: the round to restore.
        """
        if step is None:
            step = self.latest_step()
        if step is None or step not in self.steps():
            raise ValueError(
                f"no checkpoint of round {step} in {self.directory}; it has {self.steps()}."
            )
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
        target_state = jax.tree_util.tree_unflatten(
            treedef, [_placed(_key_data_like(x) if _is_key(x) else x) for _, x in flat]
        )
        key_target = _placed(_key_data_like(abstract_key) if _is_key(abstract_key)
                             else abstract_key)
        ocp = _orbax()
        manager = self._open()
        # The progress item first: it says how long the history's bytes are.
        progress = manager.restore(
            int(step), args=ocp.args.Composite(**{_PROGRESS: ocp.args.JsonRestore()}),
        )[_PROGRESS]
        target = {"state": target_state, "key": key_target}
        if "history_json_bytes" in progress:
            target["history_json"] = _placed(
                jax.ShapeDtypeStruct((int(progress["history_json_bytes"]),), np.uint8))
        if progress.get("round_metrics_arrays"):
            target["round_metrics"] = {
                name: _placed(jax.ShapeDtypeStruct(tuple(spec["shape"]), np.dtype(spec["dtype"])))
                for name, spec in progress["round_metrics_arrays"].items()}
        restored = manager.restore(
            int(step), args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(target)}),
        )
        if "history_json_bytes" in progress:
            text = np.asarray(restored[_STATE]["history_json"].addressable_data(0)).tobytes()
            history = json.loads(text.decode("utf-8"))
        else:  # written by an older version: the history inside the progress item
            history = progress["history"]
        round_metrics = None
        if "round_metrics" in progress:
            round_metrics = decode_history(progress["round_metrics"])
            round_metrics.update({name: np.asarray(x.addressable_data(0)) for name, x
                                  in restored[_STATE].get("round_metrics", {}).items()})
            order = progress.get("round_metrics_names", list(round_metrics))
            shapes = progress.get("round_metrics_shapes", {})
            round_metrics = {name: round_metrics[name] if name not in shapes
                             else np.reshape(round_metrics[name], shapes[name])
                             for name in order}
        impls = progress["state_key_impls"]
        restored_flat = jax.tree_util.tree_leaves(restored[_STATE]["state"])
        if len(restored_flat) != len(flat):
            raise ValueError(
                f"the checkpoint of round {int(step)} in {self.directory} holds "
                f"{len(restored_flat)} state arrays where this run's state has {len(flat)}: "
                "written by another version or with other settings; resume with those, or "
                "start the run again in another directory.")
        leaves = [
            jax.random.wrap_key_data(_localized(x, a), impl=impls[_keystr(p)]) if _is_key(a)
            else _localized(x, a)
            for (p, a), x in zip(flat, restored_flat, strict=True)
        ]
        key = _localized(restored[_STATE]["key"], abstract_key)
        if progress["key_impl"] is not None:
            key = jax.random.wrap_key_data(key, impl=progress["key_impl"])
        return Restored(
            round=int(progress["round"]),
            state=jax.tree_util.tree_unflatten(treedef, leaves),
            key=key,
            history=decode_history(history),
            round_metrics=round_metrics,
            kernel_form=progress.get("kernel_form"),
            kernel_chunk=progress.get("kernel_chunk"),
            plan=progress.get("plan"),
        )

    def restore_latest_intact(self, abstract_state, abstract_key) -> tuple[
        Restored | None, list[tuple[int, str]]
    ]:
        """The newest checkpoint that restores, skipping (and then deleting) broken newer ones.

        Every `DIR/<round>/` directory counts, also one orbax does not list: an
        empty one, one without the `state` or `progress` item, and one whose
        restore raises (a truncated array file, missing metadata, bad JSON) is
        skipped. Once an older step restores, the skipped step directories
        are deleted, so that the resumed run can save those rounds again
        (orbax refuses to save a step it already has); when none restores,
        nothing is deleted.

        Args:
          abstract_state: as for `restore`.
          abstract_key: as for `restore`.

        Returns:
          (restored, skipped): the newest checkpoint that restores (None when
          the directory holds no step directory at all) and the (round,
          one-line reason) of each newer step skipped, newest first.

        Raises:
          CheckpointError: step directories exist but none restores.
        """
        self.wait()
        if self._manager is None and not self._exists():
            return None, []
        manager = self._open()
        manager.reload()  # its list of steps dates from when it was opened
        listed = set(manager.all_steps())
        candidates = _process_0_steps(sorted(listed | set(self._step_dirs()), reverse=True))
        skipped = []
        for step in candidates:
            reason = self._incomplete(step, listed)
            if _process_0_says(reason is not None):
                skipped.append((step, reason or "incomplete on process 0"))
                continue
            try:
                restored = self.restore(abstract_state, abstract_key, step)
            except Exception as error:  # orbax, tensorstore and json raise many kinds
                restored, reason = None, _one_line(error)
            if _every_process_says(reason is None):
                self._delete_steps([s for s, _ in skipped])
                return restored, skipped
            skipped.append((step, reason or "failed to restore on another process"))
        if not skipped:
            return None, []
        found = ", ".join(f"round {step} ({reason})" for step, reason in skipped)
        raise CheckpointError(
            f"no intact checkpoint in {self.directory}: {found}; remove the directory or "
            "start a new run in another output directory (--out)."
        )

    def close(self) -> None:
        """Waits for the last save (raising its error, as `wait`), then closes orbax."""
        try:
            self.wait()
        finally:
            if self._manager is not None:
                self._manager.close()
                self._manager = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
