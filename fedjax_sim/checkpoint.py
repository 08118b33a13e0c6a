"""Run checkpoints with orbax: the whole algorithm state, the PRNG key, the round and the history.

A checkpoint is one orbax step directory, `DIR/<round>/`, with two items:

- `state`: the algorithm state pytree (models, optimizer states, λ,
  assignments, counters; PRNG keys as their raw key data) and the run's base
  PRNG key data, written by orbax's `StandardSave`;
- `progress`: JSON with the round, the key implementations and the history
  rows so far (numpy values keep their dtype, so a restored history is
  bit-for-bit the saved one).

Keeping the history inside the step directory makes it part of the same
atomic unit as the state: orbax writes a step into a temporary directory and
renames it when complete, and saving here is synchronous
(`wait_until_finished`), so a process killed at any moment leaves the
previous steps intact and never a half-written latest one. Temporary
directories left by a killed save are removed when the directory is next
opened. The newest `max_to_keep` steps are kept.

The directory is created on the first save, so a run shorter than its
checkpoint interval leaves none behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

_STATE, _PROGRESS = "state", "progress"


def _orbax():
    # Imported on first use: orbax adds ~0.6 s to `import fedjax_sim`, which most runs skip.
    import orbax.checkpoint

    return orbax.checkpoint


class Restored(NamedTuple):
    round: int  # rounds done when the checkpoint was written
    state: Any  # the algorithm state, shaped and placed like the abstract target
    key: jax.Array  # the run's base PRNG key
    history: list  # history rows up to `round`


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _keystr(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _placed(x):
    """A ShapeDtypeStruct of x with a sharding (orbax needs one to restore onto)."""
    sharding = getattr(x, "sharding", None) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0]
    )
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _key_data_like(x):
    """The abstract key data of an abstract key leaf, on the same sharding."""
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)


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
    """The checkpoints of one run in `directory` (orbax `CheckpointManager`, synchronous).

    Single-process only: under several processes orbax needs every process to
    save a shared directory, which the run drivers do not set up.
    """

    def __init__(self, directory, max_to_keep: int = 2):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an integer >= 1; got {max_to_keep!r}.")
        self.directory = Path(directory).absolute()
        self.max_to_keep = max_to_keep
        self._manager = None

    def _open(self):
        """The orbax CheckpointManager (opening it removes a killed save's temporary directory)."""
        ocp = _orbax()
        if self._manager is None:
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            )
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_names=(_STATE, _PROGRESS)
            )
        return self._manager

    def steps(self) -> list[int]:
        """Rounds with a complete checkpoint, oldest first."""
        if not self.directory.exists():
            return []
        return sorted(self._open().all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state, key, history: list) -> None:
        """Writes the checkpoint of round `step` and waits until it is complete on disk."""
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
            "history": encode_history(history),
        }
        items = {"state": saveable, "key": jax.random.key_data(key) if typed else key}
        ocp = _orbax()
        manager = self._open()
        manager.save(
            int(step),
            args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(items), _PROGRESS: ocp.args.JsonSave(progress)}
            ),
            force=True,
        )
        manager.wait_until_finished()

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
        restored = self._open().restore(
            int(step),
            args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore({"state": target_state, "key": key_target}),
                _PROGRESS: ocp.args.JsonRestore(),
            }),
        )
        progress = restored[_PROGRESS]
        impls = progress["state_key_impls"]
        restored_flat = jax.tree_util.tree_leaves(restored[_STATE]["state"])
        leaves = [
            jax.random.wrap_key_data(x, impl=impls[_keystr(p)]) if _is_key(a) else x
            for (p, a), x in zip(flat, restored_flat, strict=True)
        ]
        key = restored[_STATE]["key"]
        if progress["key_impl"] is not None:
            key = jax.random.wrap_key_data(key, impl=progress["key_impl"])
        return Restored(
            round=int(progress["round"]),
            state=jax.tree_util.tree_unflatten(treedef, leaves),
            key=key,
            history=decode_history(progress["history"]),
        )

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
