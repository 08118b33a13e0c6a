"""The host loop: compiled chunks of rounds (`lax.scan`), evaluation, checkpoints, divergence.

The Python loop runs only over chunks of rounds, to evaluate, checkpoint, watch
for divergence and draw the progress bar; every round inside a chunk is one
step of a compiled scan. Round t's key is fold_in(round_key, t), so a run's
numbers do not depend on the chunk length or on when evaluation happens, and a
run resumed from a checkpoint continues bit-for-bit: the checkpoint holds the
whole state, the key and the history, and the chunks after it are the same.

What the host does between chunks costs as little as it can: one program and
one transfer read a chunk's logged round metrics and whether its metrics and
state are finite; once the state is known to be healthy, the next chunk is
dispatched before the host appends the rows, draws the progress and starts
the checkpoint, so the rounds run while it does; checkpoints are written in the
background (`checkpoint.RunCheckpoints`) and metrics.csv rows are fsynced once
per checkpoint, before it, not once per row (`io.sync_appended`).

Each chunk donates its input state (`scan_rounds(..., donate_state=True)`): its
output reuses those buffers, so a run holds one state, not two, while its rounds
run. What the host still reads of a state once the next chunk is dispatched is
kept apart: the evaluation row is on the host before, and a state that is being
checkpointed is saved as it is while the next chunk runs on a copy of it.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_sim import backend, parallel, tuning
from fedjax_sim.algorithms.base import Algorithm
from fedjax_sim.checkpoint import RunCheckpoints
from fedjax_sim.data.checks import check_run_inputs
from fedjax_sim.execution import (
    Checkpoints,
    Execution,
    PlanChanged,
    plan_of,
    plan_record,
)
from fedjax_sim.io import sync_appended
from fedjax_sim.logs import Progress
from fedjax_sim.metrics import summarize_clients


class Diverged(RuntimeError):
    """A run stopped because its state or a metric became NaN or infinite.

    Attributes:
      round: the first round whose metric (or, failing one, the state or the
        evaluation after the chunk) was non-finite.
      metric: the metric's name, or "state leaf <path>".
      value: "nan", "inf" or "-inf".
      history: the history rows up to the last good evaluation.
      checkpoint_round: the round of the last good checkpoint (None: none).
      checkpoint_dir: where the checkpoints are (None: checkpointing was off).
      round_metrics: with `Execution(round_metrics=True)`, every round's metrics up to
        the last good chunk ({name: [rounds, ...]}); None otherwise.
    """

    def __init__(self, round, metric, value, history, checkpoint_round=None,
                 checkpoint_dir=None, round_metrics=None):
        self.round = int(round)
        self.round_metrics = round_metrics
        self.metric = metric
        self.value = value
        self.history = history
        self.checkpoint_round = checkpoint_round
        self.checkpoint_dir = None if checkpoint_dir is None else str(checkpoint_dir)
        message = f"run diverged at round {self.round}: {metric} is {value}"
        if self.checkpoint_dir is not None:
            where = ("none written yet" if checkpoint_round is None
                     else f"round {checkpoint_round}")
            message += f"; last good checkpoint: {where} in {self.checkpoint_dir}"
        super().__init__(message)

    def __reduce__(self):
        return (Diverged, (self.round, self.metric, self.value, self.history,
                           self.checkpoint_round, self.checkpoint_dir, self.round_metrics))


def _scan_rounds(algorithm: Algorithm, state, data, round_key, start, length: int):
    def body(s, t):
        return algorithm.round(s, data, jax.random.fold_in(round_key, t))

    return jax.lax.scan(body, state, start + jnp.arange(length))


def scan_rounds(algorithm: Algorithm, state, data, round_key, start, length: int, *,
                donate_state: bool = False):
    """Rounds start, ..., start + length − 1 as one jit-compiled `lax.scan`: the one loop of rounds.

    Round t's key is fold_in(round_key, t). `simulate.run`, sweep cells,
    comparisons and the benchmarks all run rounds through this. Compiled
    with `backend.compiler_options` for the data's feature size; inside an
    enclosing jit/vmap (a sweep cell) it is simply traced.

    donate_state: the call may reuse the input state's buffers for its output
      (`jax.jit(donate_argnames=...)`), so the two never coexist: the caller
      must not use `state` afterwards (its arrays are deleted).

    Returns (state, metrics of every round stacked on a leading [length] axis).
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((state, data, round_key))):
        return _scan_rounds(algorithm, state, data, round_key, start, length)
    return _compiled_scan(data, donate_state)(algorithm, state, data, round_key, start, length)


def _compiled_scan(data, donate_state: bool = False):
    return backend.jit(
        _scan_rounds, backend.feature_size(data), static_argnames=("algorithm", "length"),
        donate_argnames=("state",) if donate_state else (),
        linear_form=plan_of(data).linear_form,
    )


def _sample_scan(algorithm, state, data, round_key, start):
    """A thunk running `tuning.TUNE_ROUNDS` rounds from `state` (kept: not donated), compiled
    for `data`'s plan: one timed sample of a form (`tuning.plan_scan`)."""
    compiled = _compiled_scan(data).lower(algorithm, state, data, round_key, start,
                                          tuning.TUNE_ROUNDS).compile()
    return lambda: compiled(state, data, round_key, start)


def _fresh_copy(tree):
    """Every leaf copied into new buffers, with its sharding: a chunk may then donate the
    copy while the host still reads the original (a checkpoint being written).

    `Array.copy` runs a copy on the array's devices, keeping its sharding; not
    `device_put(..., may_alias=False)`, which under jax 0.5.3 (the declared minimum)
    returns a new array on the same buffers, so the donation deleted what was saved.
    """
    return jax.tree.map(lambda x: x.copy(), tree)


@functools.partial(jax.jit, static_argnames=("lead",))
def _all_finite(tree, lead: int):
    """Per leaf: True where every entry past the first `lead` axes is finite.

    Non-float leaves (ints, PRNG keys) are finite by definition.
    """

    def reduce(x):
        keep = min(lead, x.ndim)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.ones(x.shape[:keep], bool)
        return jnp.all(jnp.isfinite(x), axis=tuple(range(keep, x.ndim)))

    return jax.tree.map(reduce, tree)


@functools.partial(jax.jit, static_argnames=("names", "lead"))
def _chunk_summary(metrics, state_leaves, names: tuple, lead: int):
    """One program per chunk for what the host reads of it: the last round's value of
    each logged metric in `names`, and `_all_finite` of the round metrics (per round
    and copy) and of the state leaves (per copy)."""
    last = {name: metrics[name][-1] for name in names}
    return last, _all_finite(metrics, lead + 1), _all_finite(state_leaves, lead)


def _kind(values) -> str:
    """'nan', 'inf' or '-inf': the first non-finite entry of values."""
    flat = np.asarray(values, np.float64).ravel()
    bad = flat[~np.isfinite(flat)]
    if bad.size == 0 or np.isnan(bad[0]):
        return "nan"
    return "inf" if bad[0] > 0 else "-inf"


def _numeric(value) -> np.ndarray | None:
    array = np.asarray(value)
    return array if array.dtype.kind in "fc" else None


class _Watch:
    """Finds divergence after a chunk; with copies, only when every copy has diverged.

    A copy has diverged in a chunk when any of its round metrics, its values in
    the evaluation row or its state leaves is non-finite. Evaluation values
    already non-finite at round 0 (e.g. a cluster accuracy without ground
    truth) are not watched. `copies` is the shape of the copies axes (() for a
    run without them); values whose leading axes are not that shape count for
    every copy.
    """

    def __init__(self, copies: tuple[int, ...], first_row: dict):
        self.copies = tuple(copies)
        self.lead = len(self.copies)
        self.n = math.prod(self.copies)
        self.watched = {
            name for name, value in first_row.items()
            if name != "round" and (a := _numeric(value)) is not None and np.isfinite(a).all()
        }

    def _split(self, shape, at: int) -> bool:
        """Whether shape[at:] starts with the copies axes."""
        return self.lead > 0 and tuple(shape[at:at + self.lead]) == self.copies

    def _per_copy(self, ok: np.ndarray, rows: int | None = None) -> np.ndarray:
        """ok as [rows, n] (or [n]): entries not split by copy apply to every copy."""
        ok = np.asarray(ok)
        if rows is None:
            if self._split(ok.shape, 0):
                return ok.reshape(self.n, -1).all(axis=1)
            return np.full(self.n, bool(ok.all()))
        if self._split(ok.shape, 1):
            return ok.reshape(rows, self.n, -1).all(axis=2)
        return np.repeat(ok.reshape(rows, -1).all(axis=1)[:, None], self.n, axis=1)

    def check(self, state, metrics, row, start: int, end: int, finite=None):
        """None, or (round, metric name, 'nan'/'inf') of the run's divergence.

        finite: (metrics ok, state leaves ok) as host arrays when already read
        (`_chunk_summary`); None: computed here.
        """
        lead = self.lead
        failures: list = [None] * self.n  # per copy: (round, name, how to read the value)
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        if finite is None:
            finite = jax.tree.map(parallel.to_host, (
                _all_finite(metrics, lead + 1) if metrics else {},
                _all_finite([x for _, x in flat], lead)))
        metric_ok, state_ok = finite
        if metrics:
            for name, ok in metric_ok.items():
                ok = self._per_copy(ok, rows=end - start)
                for c in range(self.n):
                    bad = np.flatnonzero(~ok[:, c])
                    if bad.size and (failures[c] is None or start + 1 + bad[0] < failures[c][0]):
                        failures[c] = (start + 1 + int(bad[0]), name, ("metric", name, bad[0], c))
        for name in self.watched if row is not None else ():
            array = _numeric(row.get(name))
            if array is None:
                continue
            ok = self._per_copy(np.isfinite(array))
            for c in np.flatnonzero(~ok):
                if failures[c] is None:
                    failures[c] = (end, name, ("row", name, None, c))
        for (path, _), ok in zip(flat, state_ok, strict=True):
            ok = self._per_copy(ok)
            for c in np.flatnonzero(~ok):
                if failures[c] is None:
                    name = "state leaf " + jax.tree_util.keystr(path, simple=True, separator="/")
                    failures[c] = (end, name, ("state", path, None, c))
        if any(f is None for f in failures):
            return None
        # The run diverged when its last healthy copy did.
        t, name, (source, what, i, c) = max(failures, key=lambda f: f[0])
        if source == "metric":
            values = parallel.to_host(metrics[what][i])
        elif source == "row":
            values = np.asarray(row[what])
        else:
            values = parallel.to_host(next(x for p, x in flat if p == what))
        if self._split(values.shape, 0):
            values = values.reshape(self.n, *values.shape[self.lead:])[c]
        return t, name, _kind(values)


def default_evaluate(algorithm: Algorithm, data, prefix: str = "") -> Callable[[object], dict]:
    """state -> the average and worst-case client loss (and accuracy) on `data`.

    The keys are `metrics.summarize_clients`'s (`loss`, `loss_worst`, `accuracy`,
    `accuracy_worst`) after `prefix`: nothing names the data, so give test clients
    `prefix="test_"` (`test_loss`, ...), as `simulate.run`'s own default (the training
    data, no prefix) cannot be told apart from them otherwise.
    """
    evaluate = backend.jit(algorithm.evaluate, backend.feature_size(data))
    return lambda state: summarize_clients(evaluate(state, data), prefix)


def _next_boundary(done: int, rounds: int, every: tuple[int, ...]) -> int:
    return min(rounds, *((done // e + 1) * e for e in every))


def _abstract_state(algorithm, key, data, mesh):
    """Shapes, dtypes and placements of `algorithm.init`'s state, without computing it."""
    abstract = jax.eval_shape(algorithm.init, key, data)
    if mesh is None:
        return abstract
    shardings = parallel.state_shardings(algorithm.client_axes(abstract), mesh)
    return jax.tree.map(
        lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        abstract, shardings,
    )


def _same_key(a, b) -> bool:
    def data(k):
        return np.asarray(jax.random.key_data(k) if jax.dtypes.issubdtype(
            k.dtype, jax.dtypes.prng_key) else k)

    return np.array_equal(data(a), data(b))


def _resume(checkpoints, resume, rounds, algorithm, key, key_init, data, mesh):
    """(state, history, rounds done, round metrics or None) of the newest intact checkpoint,
    or None when there is none.

    A corrupt or partial newer checkpoint is skipped, saying which and why. One written
    under another plan (`execution.plan_record`: the client chunk) is refused
    (`execution.PlanChanged`): its rounds' sums were added in another order.
    """
    latest = checkpoints.latest_step()
    if latest is None:
        return None
    if not resume:
        raise ValueError(
            f"{checkpoints.directory} already holds checkpoints (latest: round {latest}); "
            "resume from them or choose another checkpoint directory."
        )
    if latest > rounds:
        raise ValueError(
            f"cannot resume: the latest checkpoint in {checkpoints.directory} is of round "
            f"{latest}, past rounds={rounds}."
        )
    restored, skipped = checkpoints.restore_latest_intact(
        _abstract_state(algorithm, key_init, data, mesh), key)
    for step, reason in skipped:
        print(f"fedjax-sim: skipped checkpoint of round {step} in {checkpoints.directory}: "
              f"{reason}", file=sys.stderr)
    if restored is None:
        return None
    if not _same_key(restored.key, key):
        raise ValueError(
            f"cannot resume: the checkpoints in {checkpoints.directory} were written with "
            "another key (seed)."
        )
    if restored.plan is not None and restored.plan != plan_record(data):
        raise PlanChanged(checkpoints.directory, restored.plan, plan_record(data))
    form = restored.kernel_form
    if form is not None:  # with the chunk its timing chose, as the candidate's name
        form = tuning.arm(form, restored.kernel_chunk)
    return restored.state, restored.history, restored.round, restored.round_metrics, form


# JAX's compilation stages, as `jax.monitoring` reports their durations.
_COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})
_compile_clock = threading.local()  # .seconds: a list while a thread counts, else absent


def _on_jax_event(event: str, duration: float, **_) -> None:
    counting = getattr(_compile_clock, "seconds", None)
    if counting is not None and event in _COMPILE_EVENTS:
        counting.append(duration)


@functools.cache  # once per process: jax.monitoring has no public way to unregister
def _listen_to_compiles() -> None:
    jax.monitoring.register_event_duration_secs_listener(_on_jax_event)


def _compile_seconds_during(fn, *args):
    """(fn(*args), the seconds JAX spent tracing, lowering and compiling in the call, this
    thread only): what of an evaluation's first call is compilation, not evaluation."""
    _listen_to_compiles()
    outer = getattr(_compile_clock, "seconds", None)
    _compile_clock.seconds = []
    try:
        out = fn(*args)
        return out, math.fsum(_compile_clock.seconds)
    finally:
        if outer is not None:
            outer.extend(_compile_clock.seconds)
        _compile_clock.seconds = outer


class _Timer:
    """Seconds spent compiling, evaluating and running rounds, for rounds_per_second
    without compilation and for a summary that says where a run's time went."""

    def __init__(self):
        self.compile_seconds = 0.0
        self.evaluate_seconds = 0.0
        self._lowered = {}
        self._compiled = {}

    def lower(self, algorithm, state, data, round_key, start, length):
        """The chunk of `length` rounds traced and lowered, once per length (timed as
        compilation); its `out_info` gives the round metrics' shapes. The chunk donates
        its input state: the state it returns reuses those buffers."""
        lowered = self._lowered.get((length, plan_of(data)))
        if lowered is None:
            t0 = time.perf_counter()
            lowered = _compiled_scan(data, donate_state=True).lower(
                algorithm, state, data, round_key, start, length)
            self.compile_seconds += time.perf_counter() - t0
            self._lowered[length, plan_of(data)] = lowered
        return lowered

    def scan(self, algorithm, state, data, round_key, start, length):
        """scan_rounds, compiled ahead of time once per chunk length (compile timed apart);
        `state` is donated (deleted once the chunk has run)."""
        compiled = self._compiled.get((length, plan_of(data)))
        if compiled is None:
            lowered = self.lower(algorithm, state, data, round_key, start, length)
            t0 = time.perf_counter()
            compiled = lowered.compile()
            self.compile_seconds += time.perf_counter() - t0
            self._compiled[length, plan_of(data)] = compiled
        return compiled(state, data, round_key, start)

    def plan(self, algorithm, state, data, round_key, start, length, forced=None):
        """(data, tuning.Choice or None): the kernel form of the run's chunks
        (`tuning.plan_scan`), its lowerings, compiles and timed samples counted as
        compilation."""
        before, t0 = self.compile_seconds, time.perf_counter()
        planned = tuning.plan_scan(
            lambda d: self.lower(algorithm, state, d, round_key, start, length),
            lambda d: _sample_scan(algorithm, state, d, round_key, start), data, forced)
        self.compile_seconds = before + time.perf_counter() - t0
        return planned

    def compiled_call(self, jitted, *args):
        """jitted(*args), compiled ahead of time (timed as compilation)."""
        t0 = time.perf_counter()
        compiled = jitted.lower(*args).compile()
        self.compile_seconds += time.perf_counter() - t0
        return compiled(*args)

    def evaluation(self, fn):
        """fn timed as evaluation, less the compilation JAX reports inside it (its first
        call traces and compiles; a chunked evaluation may compile again for a last,
        smaller chunk), which counts as compilation."""

        def wrapped(*args):
            t0 = time.perf_counter()
            out, compiling = _compile_seconds_during(fn, *args)
            seconds = time.perf_counter() - t0
            compiling = min(compiling, seconds)
            self.compile_seconds += compiling
            self.evaluate_seconds += seconds - compiling
            return out

        return wrapped


def _copies_shape(state, axes: int) -> tuple[int, ...]:
    """The shape of the copies axes: the first `axes` axes of the state's first leaf."""
    if axes == 0:
        return ()
    leaves = jax.tree.leaves(state)
    if not leaves or leaves[0].ndim < axes:
        return ()
    return tuple(leaves[0].shape[:axes])


def _logged_round_metrics(chunk_metrics, copies: tuple[int, ...]) -> dict:
    """{name: shape} of the round metrics a history row carries, from a chunk's abstract
    metrics ([length, ...] leaves): those that are one number per round and copy, i.e.
    whose per-round shape is exactly the copies axes' shape (() without copies). Vectors
    such as cluster sizes stay in the chunk's output."""
    return {name: tuple(s.shape[1:]) for name, s in chunk_metrics.items()
            if tuple(s.shape[1:]) == copies}


class _RoundMetrics:
    """Every round's logged metrics so far, as host arrays, chunk by chunk."""

    def __init__(self, names, restored: dict | None):
        self.names = tuple(names)
        self.parts = {name: [] for name in self.names}
        for name, values in (restored or {}).items():
            if name in self.parts:
                self.parts[name].append(np.asarray(values))

    def add(self, metrics) -> None:
        for name in self.names:
            self.parts[name].append(np.asarray(parallel.to_host(metrics[name])))

    def stacked(self, shapes: dict) -> dict:
        """{name: [rounds, ...]}: a name with no part yet is an empty [0, ...] array."""
        return {name: np.concatenate(parts) if parts
                else np.zeros((0, *shapes.get(name, ())), np.float32)
                for name, parts in self.parts.items()}


def _on_host(values: dict) -> dict:
    """An evaluation row's jax arrays as host numpy arrays (other values as they are)."""
    return {name: np.asarray(parallel.to_host(v)) if isinstance(v, jax.Array) else v
            for name, v in values.items()}


def _row_value(value):
    """A round metric's value for a history row: a float, or a host array per copy."""
    array = np.asarray(parallel.to_host(value))
    return float(array) if array.ndim == 0 else array


# The keyword arguments `run` took before `Execution`: accepted (with a DeprecationWarning)
# for one release, each as the Execution field it became.
_DEPRECATED = {"mesh": "mesh", "resume": "resume", "progress": "progress",
               "description": "description", "progress_summary": "progress_summary",
               "on_rows": "on_rows", "timing": "timing", "round_metrics": "round_metrics",
               "copies_axis": "copies", "data_copies_axis": "data_copies"}


def _execution(execution: Execution | None, old: dict) -> Execution:
    """`execution`, or the Execution the deprecated keywords `old` describe."""
    if not old:
        return Execution() if execution is None else execution
    unknown = sorted(set(old) - set(_DEPRECATED) - {"checkpoint_dir", "checkpoint_every"})
    if unknown:
        raise TypeError(f"run() got unexpected keyword arguments {unknown}; a run's execution "
                        "options are fields of Execution (execution=Execution(...)).")
    if execution is not None:
        raise TypeError(f"run() takes execution=Execution(...) or the deprecated keywords "
                        f"{sorted(old)}, not both.")
    warnings.warn(
        f"simulate.run's keywords {', '.join(sorted(old))} are deprecated; pass "
        "execution=Execution(...) (fedjax_sim.execution) instead.", DeprecationWarning,
        stacklevel=3)
    fields = {_DEPRECATED[name]: value for name, value in old.items() if name in _DEPRECATED}
    if isinstance(fields.get("copies"), bool):
        fields["copies"] = int(fields["copies"])
    directory, every = old.get("checkpoint_dir"), old.get("checkpoint_every")
    if directory is not None:
        fields["checkpoints"] = Checkpoints(directory, every)
    return Execution(**fields)


def run(
    algorithm: Algorithm,
    data,
    key,
    *,
    rounds: int,
    eval_every: int = 1,
    evaluate: Callable[[object], dict] | None = None,
    execution: Execution | None = None,
    **deprecated,
):
    """Runs `rounds` rounds of `algorithm` on `data`, evaluating every `eval_every`.

    How the rounds run (devices, checkpoints and resume, progress, what the
    caller is told, which axes hold copies) is `execution`'s (`Execution`); the
    body reads as its steps: **place** the data on the devices, **resume** the
    state from the newest intact checkpoint (or initialise it), **start** (the
    chunks' kernel form, the first chunk's program, the round-0 row), then
    **scan** the rounds chunk by chunk, **watch** each chunk for divergence and
    **record** its rows, progress and checkpoint.

    After every chunk of rounds the round metrics of each round, the
    evaluation row and the state leaves are checked: a NaN or inf stops the
    run with `Diverged` (no checkpoint of the bad state is written; the last
    good one stays).

    Args:
      algorithm: Algorithm(init, round, evaluate).
      data: the algorithm's inputs: a FederatedData, or any pytree holding
        one beside server-side arrays (`ServerData`); its clients carry the
        plan they run under (`Execution.planned`).
      key: PRNG key; the same key gives the same numbers.
      rounds: number of communication rounds (>= 0).
      eval_every: evaluate after every this many rounds (and at round 0 and
        at the last round).
      evaluate: state -> dict of host values for one history row; default:
        loss / loss_worst (and accuracy) of `algorithm.evaluate` on `data`.
      execution: how the rounds run (`Execution`; default: one device, no
        checkpoints, progress on, no copies axes).
      **deprecated: the keywords `run` took before `Execution` (mesh,
        checkpoint_dir, checkpoint_every, resume, progress, description,
        progress_summary, on_rows, timing, round_metrics, copies_axis,
        data_copies_axis), accepted with a DeprecationWarning for one release.

    Returns:
      (final state, history), and with `execution.round_metrics` (final
      state, history, metrics). history is a list of dict rows, each with
      `round`, the round metrics of the last round before it that are one
      number per round and copy (their shape is the copies axes' shape; NaN
      in the round-0 row) and the evaluation; an evaluation value of the same
      name wins. The columns are fixed before round 0, from the first chunk's
      compiled program. metrics is {name: host array [rounds, *copies]}: row
      t − 1 holds round t's value, for the same metrics as the history.

    Raises:
      Diverged: a NaN or inf appeared (in every copy); it carries the round,
        the metric, the history up to the last good evaluation and the last
        good checkpoint.
    """
    execution = _execution(execution, deprecated)
    if not isinstance(rounds, int) or rounds < 0:
        raise ValueError(f"rounds must be an integer >= 0; got {rounds!r}.")
    if not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"eval_every must be an integer >= 1; got {eval_every!r}.")
    check_run_inputs(data)
    if jax.process_count() == 1:
        # The algorithm's trace-time checks (the model against the data) then see the data's
        # values: labels outside the model's classes are refused before anything compiles.
        jax.eval_shape(lambda k: algorithm.init(k, data), key)
    rounds_run = _Rounds(algorithm, key, rounds, eval_every, execution)
    try:
        rounds_run.place(data, evaluate)
        rounds_run.resume()
        rounds_run.start()
        rounds_run.scan()
    finally:
        rounds_run.close()
    return rounds_run.result()


class _Rounds:
    """One call of `run`, as its steps: place, resume, start, scan (each chunk watched and
    recorded), close.

    What the steps share: the placed data, the state and the rounds done, the history,
    the timer, the checkpoints, the plan and the kernel form of the chunks.
    """

    def __init__(self, algorithm, key, rounds, eval_every, execution):
        self.algorithm, self.key, self.rounds = algorithm, key, rounds
        self.eval_every, self.execution = eval_every, execution
        self.wall, self.timer = time.perf_counter(), _Timer()
        saved = execution.checkpoints
        self.checkpoint_every = None if saved is None else saved.every or eval_every
        self.every = (eval_every,) if saved is None else (eval_every, self.checkpoint_every)
        self.checkpoints = None  # RunCheckpoints, once `resume` opens them
        self.timing = execution.timing if execution.timing is not None else {}
        self.key_init, self.key_rounds = jax.random.split(key)
        self.on_rows = execution.on_rows or (lambda rows: None)
        self.state = self.history = self.kept = None
        self.done = self.start_round = 0
        self.last_saved = self.saved_metrics = self.saved_form = self.kernel = None
        self.logged: dict = {}
        self.logged_names: tuple = ()

    # ---- place: the data on the devices, its plan recorded, the evaluation

    def place(self, data, evaluate) -> None:
        mesh = self.execution.mesh
        if mesh is not None:
            data = parallel.place_inputs(data, mesh, self.execution.data_copies)
        self.data = data
        self.plan = plan_record(data)  # what of the plan checkpoints record (and a resume keeps)
        self.timing["client_chunk"] = self.plan["client_chunk"]
        self.evaluate = self.timer.evaluation(evaluate or default_evaluate(self.algorithm, data))

    # ---- resume: the newest intact checkpoint's state and history, or round 0's state

    def resume(self) -> None:
        algorithm, execution = self.algorithm, self.execution
        restored = None
        if execution.checkpoints is not None:
            self.checkpoints = RunCheckpoints(execution.checkpoints.directory)
            restored = _resume(self.checkpoints, execution.resume, self.rounds, algorithm,
                               self.key, self.key_init, self.data, execution.mesh)
        if restored is not None:
            self.state, self.history, self.done, self.saved_metrics, self.saved_form = restored
            self.last_saved = self.done
            if execution.round_metrics and self.saved_metrics is None:
                raise ValueError(
                    f"cannot resume with round_metrics=True: the checkpoint of round "
                    f"{self.done} in {self.checkpoints.directory} was written without its "
                    "round metrics; resume without round_metrics or start the run again in "
                    "another directory.")
            return
        self.state = self.timer.compiled_call(jax.jit(algorithm.init), self.key_init, self.data)
        if execution.mesh is not None:
            self.state = parallel.shard_state(self.state, algorithm.client_axes(self.state),
                                              execution.mesh)

    # ---- start: the chunks' kernel form and first program; the round-0 row

    def start(self) -> None:
        """The kernel form of the chunks (forced, stored or timed now: a resumed run takes
        its checkpoint's, so it continues bit for bit) and the round metrics history rows
        carry, from the first chunk's lowering (which its compilation then reuses: the round
        is traced once); then the round-0 row, whose columns fix the history's."""
        copies = _copies_shape(self.state, self.execution.copies)
        if self.done < self.rounds:
            length = _next_boundary(self.done, self.rounds, self.every) - self.done
            self.data, self.kernel = self.timer.plan(
                self.algorithm, self.state, self.data, self.key_rounds, self.done, length,
                forced=self.saved_form)
            self.timing["kernel_form"] = None if self.kernel is None else self.kernel.record()
            first = self.timer.lower(self.algorithm, self.state, self.data, self.key_rounds,
                                     self.done, length)
            self.logged = _logged_round_metrics(first.out_info[1], copies)
        elif self.saved_metrics is not None:
            self.logged = {name: np.shape(v)[1:] for name, v in self.saved_metrics.items()}
        if self.history is None:
            # Round 0 carries every logged round metric as NaN (no round has run), so the
            # history's columns are fixed from its first row (metrics.csv writes them then).
            unrun = {name: np.full(shape, np.nan) if shape else float("nan")
                     for name, shape in self.logged.items()}
            self.history = [{"round": 0, **unrun, **_on_host(self.evaluate(self.state))}]
        self.start_round = self.done
        self.watch = _Watch(copies, self.history[0])
        # Only columns the history already has (a run resumed from an older version's
        # checkpoint keeps its metrics.csv columns).
        self.logged_names = tuple(name for name in self.logged if name in self.history[0])
        if self.execution.round_metrics:
            self.kept = _RoundMetrics(self.logged_names, self.saved_metrics)

    # ---- scan: chunks of rounds, each watched and recorded

    def scan(self) -> None:
        """Every chunk of rounds, dispatched one ahead: once a chunk's state is known to be
        healthy (`watched`), the next chunk runs while the host records this one."""
        if self.done == 0 and (found := self.watch.check(self.state, {}, None, 0, 0)) is not None:
            raise self.diverged(found)
        self.on_rows(list(self.history))
        execution, timer = self.execution, self.timer
        with Progress(self.rounds, initial=self.done, description=execution.description,
                      unit="round", enabled=execution.progress,
                      summary=execution.progress_summary,
                      # the ETA and rate leave out compiling (the first chunk's, mostly)
                      clock=lambda: time.perf_counter() - timer.compile_seconds) as bar:
            shown = _Shown(self.logged_names)
            ahead = None  # the next chunk, dispatched before the host's work on this one
            while self.done < self.rounds:
                end = _next_boundary(self.done, self.rounds, self.every)
                if ahead is None:
                    ahead = self.chunk(self.state, self.done, end)
                self.state, metrics = ahead
                row = self.watched(metrics, end)
                saving = self.checkpoints is not None and end % self.checkpoint_every == 0
                ahead = None
                if end < self.rounds:
                    # The state is healthy: the next chunk runs while the host writes this
                    # one's rows, progress and checkpoint. It donates its input, so the
                    # input and output states never coexist; when this state is still to
                    # be saved, it gets a copy (the save reads this one).
                    after = _next_boundary(end, self.rounds, self.every)
                    ahead = self.chunk(_fresh_copy(self.state) if saving else self.state,
                                       end, after)
                self.record(metrics, row, end, saving, bar, shown)

    def chunk(self, state, start: int, end: int):
        """Rounds start + 1, ..., end dispatched (not waited for); `state` is donated."""
        return self.timer.scan(self.algorithm, state, self.data, self.key_rounds, start,
                               end - start)

    # ---- watch: the chunk read on the host, checked for divergence

    def watched(self, metrics, end: int) -> dict | None:
        """The chunk's history row (None when `end` is not evaluated), after checking its
        round metrics, row and state for NaN or inf (`Diverged`)."""
        evaluated = end % self.eval_every == 0 or end == self.rounds
        # What the host reads of the chunk, in one program and one transfer.
        last, *finite = jax.tree.map(parallel.to_host, _chunk_summary(
            metrics, jax.tree.leaves(self.state), self.logged_names if evaluated else (),
            self.watch.lead))
        row = None
        if evaluated:
            last = {name: _row_value(value) for name, value in last.items()}
            # On the host now: an evaluation may hand back a leaf of the state, which the
            # next chunk donates.
            row = {"round": end, **last, **_on_host(self.evaluate(self.state))}
        found = self.watch.check(self.state, metrics, row, self.done, end, finite)
        if found is not None:
            raise self.diverged(found)
        return row

    def diverged(self, found) -> Diverged:
        checkpoints = self.checkpoints
        return Diverged(*found, history=list(self.history), checkpoint_round=self.last_saved,
                        checkpoint_dir=None if checkpoints is None else checkpoints.directory,
                        round_metrics=None if self.kept is None
                        else self.kept.stacked(self.logged))

    # ---- record: the chunk's rows, progress and checkpoint

    def record(self, metrics, row, end: int, saving: bool, bar, shown) -> None:
        if self.kept is not None:
            self.kept.add(metrics)
        if row is not None:
            self.history.append(row)
            self.on_rows([row])
        bar.advance(end - self.done, postfix=shown(row))
        self.done = end
        if saving:
            # Saving fsyncs the rows appended so far first, and writes in the background;
            # the last save is complete once `close` returns.
            self.checkpoints.save(
                end, self.state, self.key, self.history,
                kernel_form=None if self.kernel is None else self.kernel.form,
                kernel_chunk=None if self.kernel is None else self.kernel.client_chunk,
                plan=self.plan,
                round_metrics=None if self.kept is None else self.kept.stacked(self.logged))
            self.last_saved = end

    def close(self) -> None:
        """The timing filled in, the appended rows fsynced, the last checkpoint complete."""
        timer = self.timer
        self.timing.update(
            rounds_run=self.done - self.start_round, start_round=self.start_round,
            compile_seconds=timer.compile_seconds,
            run_seconds=max(time.perf_counter() - self.wall - timer.compile_seconds, 0.0),
            evaluate_seconds=timer.evaluate_seconds)
        try:
            sync_appended()  # metrics.csv rows appended since the last checkpoint
        finally:
            if self.checkpoints is not None:
                self.checkpoints.close()

    def result(self):
        if self.kept is not None:
            return self.state, self.history, self.kept.stacked(self.logged)
        return self.state, self.history


class _Shown:
    """What a progress line shows of a history row: all of it but the round counters
    that have said nothing yet.

    A counter is a round metric whose values are whole numbers (e.g. IFCA's
    `frozen_clients`, `downlink_floats`; a cohort's `participants`). At the defaults
    most never move (no communication reduction: 0 frozen clients and the full
    downlink every round), so a counter is shown once it takes a second value, and
    from then on; metrics.csv has every value either way.
    """

    def __init__(self, round_metrics: tuple[str, ...]):
        self.counters = set(round_metrics)
        self.first: dict = {}

    def __call__(self, row: dict | None) -> dict | None:
        if row is None:
            return None
        out = {}
        for name, value in row.items():
            if name in self.counters:
                array = np.asarray(value, np.float64)
                whole = bool(np.isfinite(array).all() and (array == np.round(array)).all())
                first = self.first.setdefault(name, array)
                if whole and array.shape == first.shape and (array == first).all():
                    continue
                self.counters.discard(name)  # it has moved (or is no counter): shown
            out[name] = value
        return out


__all__ = ["Checkpoints", "Diverged", "Execution", "default_evaluate", "run", "scan_rounds"]
