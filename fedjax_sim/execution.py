"""How a run is executed: the executor's choices, never an algorithm's or an experiment's.

An algorithm's round says *what* is computed; how it is run is decided by the
executor (`simulate.run`, and the comparisons and sweeps built on it) and never
appears in an algorithm's signature or an experiment's code. This module holds
the executor's vocabulary:

- `Execution`: one run's options: devices (`mesh`), the memory budget,
  checkpoints and resume, progress and what the caller is told while the run
  goes (`on_rows`, `timing`), and which leading axes hold copies of the run.
  `simulate.run` takes it whole.
- `Footprint`: what a method's round holds, declared by an experiment (its
  model, one copy's clients, how many copies, whether clients train their own
  models, ...). `Execution.client_chunk` turns it into the number of clients a
  round processes at once (`fedjax_sim.memory.plan_client_chunk`) and
  `Execution.planned` sets that chunk on the problem's clients: the one place a
  chunk is chosen.
- `Plan`: the decision itself, a small frozen value that rides on the client
  data as static pytree data: it is part of jit's cache key (two plans compile
  two programs), it survives `take`, chunking and `vmap`, and the kernels read
  it where they see the data (`plan_of`).

A `Plan` holds:

- `client_chunk`: how many clients a round (and an evaluation) processes at
  once; None: all of them. The cohort path (`ops.cohort_sums`,
  `ops.map_client_chunks`, `ops.local_update`) scans over chunks of this many,
  so peak memory is O(chunk × model); `fedjax_sim.memory` picks it.
- `keep_client_state`: False lets an algorithm drop per-client state that no
  round reads back (IFCA's assignments under full participation), for runs over
  more clients than memory holds.
- `linear_form`: the form of IFCA option I's fused linear kernel
  (`ops.linear.LINEAR_FORMS`); None: the default form. `fedjax_sim.tuning`
  times the forms once per machine and round shape and remembers the choice.

The client chunk can change a run's numbers in their last bits: a chunked round
adds the chunks' partial sums, in another order than the sum over the whole
cohort at once. Checkpoints record it (`plan_record`), and a resume whose plan
differs from its checkpoints' is refused (`PlanChanged`); the kernel form is
recorded too, and a resumed run takes its checkpoint's.

The data layer carries a plan without knowing what it holds (this module imports
only `fedjax_sim.carried` and `fedjax_sim.memory`, which import no data module).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import jax

from fedjax_sim import memory
from fedjax_sim.carried import carried, carrying


@dataclass(frozen=True)
class Plan:
    """The executor's choices for one round's programs (hashable: a jit cache key).

    Attributes:
      client_chunk: clients processed at once (None: all).
      keep_client_state: False: per-client state no round reads back may be dropped.
      linear_form: the linear kernel's form (`ops.linear.LINEAR_FORMS`), or None
        for the default.
    """

    client_chunk: int | None = None
    keep_client_state: bool = True
    linear_form: str | None = None

    def __post_init__(self):
        chunk = self.client_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                                  or chunk < 1):
            raise ValueError("a plan's client_chunk must be None (all clients at once) or an "
                             f"integer >= 1; got {chunk!r}.")
        if not isinstance(self.keep_client_state, bool):
            raise ValueError("a plan's keep_client_state must be True or False; got "
                             f"{self.keep_client_state!r}.")

    def replace(self, **changes) -> Plan:
        return replace(self, **changes)


DEFAULT_PLAN = Plan()


def plan_record(data) -> dict:
    """What of `data`'s plan may change a run's numbers, as JSON: {"client_chunk": c}."""
    return {"client_chunk": plan_of(data).client_chunk}


def describe_chunk(chunk: int | None) -> str:
    """A client chunk in words: "all clients at once", "1 client at a time", "8 clients ..."."""
    if chunk is None:
        return "all clients at once"
    return f"{chunk} client{'' if chunk == 1 else 's'} at a time"


class PlanChanged(ValueError):
    """A resume whose execution plan differs from the one its checkpoints were written with.

    Attributes:
      directory: the checkpoints' directory.
      saved, now: `plan_record`s of the checkpoints and of this run.
    """

    def __init__(self, directory, saved: dict, now: dict):
        self.directory, self.saved, self.now = directory, saved, now
        super().__init__(
            f"cannot resume: the checkpoints in {directory} were written processing "
            f"{describe_chunk(saved.get('client_chunk'))} and this run plans "
            f"{describe_chunk(now.get('client_chunk'))}; a round's sums depend on that in "
            "their last bits: resume with the plan they were written with.")

    def __reduce__(self):
        return type(self), (self.directory, self.saved, self.now)


def plan_of(data) -> Plan:
    """The plan of a client source, or of the first one in a pytree (the default if none)."""
    return carried(data, "plan", DEFAULT_PLAN)


def planned(data, **changes):
    """`data` with its plan's fields `changes` set (e.g. `planned(data, client_chunk=64)`)."""
    return with_plan(data, plan_of(data).replace(**changes))


def with_plan(data, plan: Plan):
    """`data` (a client source, or a pytree holding them) with every client source's plan
    set to `plan`; other nodes as they are."""
    return carrying(data, "plan", plan)


def _rechunked(data, client_chunk: int | None):
    """`data` with every client source's own plan given `client_chunk` (its other fields
    kept: a training set's keep_client_state stays off the test set)."""
    def is_source(node) -> bool:
        return hasattr(node, "plan") and hasattr(node, "with_plan")

    def rechunk(node):
        return node.with_plan(node.plan.replace(client_chunk=client_chunk)) \
            if is_source(node) else node

    if is_source(data):
        return rechunk(data)
    return jax.tree.map(rechunk, data, is_leaf=is_source)


@dataclass(frozen=True)
class Footprint:
    """What one method's rounds hold, for the executor's memory plan (shapes only).

    An experiment declares it (`Experiment.footprint`); `Execution.client_chunk`
    turns it into the clients a round processes at once
    (`fedjax_sim.memory.plan_client_chunk`, which says how each field is counted).
    Nothing is built or run: every array field may hold `jax.ShapeDtypeStruct`s.

    Attributes:
      model: the clients' model (`models.Model`).
      clients: one copy's client data (a `FederatedData`, or its shapes); with
        `generated_clients`, one client's sample.
      copies: copies of the run side by side (seeds × restarts), each holding
        its own chunk.
      num_clusters: cluster models each client evaluates (1: one model).
      local_training: clients train their own copies of the model (False:
        one gradient per client, summed over clients).
      per_client_models: the state holds one model per client (local models,
        one-shot pre-training).
      evaluated: other clients evaluated with the same chunk (e.g. the test
        set's shapes): their evaluation's working memory is counted too.
      applies_to: the problem's client sets the plan is set on (dict keys or
        NamedTuple fields, `Execution.planned`); None: every client source in it.
      fit_machine: how a run without a memory budget is planned, and whether it
        is checked against this machine. True: every client at once (generated
        clients 1 GiB of working memory at a time), and the round (with or
        without a budget) must fit 80 % of this machine's memory, else it is
        refused naming `describe` and `remedy`. False: working memory is
        bounded instead: on a CPU any round 256 MiB at a time (faster rounds),
        elsewhere per-client models 1 GiB at a time, other rounds every client
        at once; nothing is checked against the machine.
      generated_clients: None, or the number of clients drawn inside the round
        chunk by chunk (nothing of theirs is resident; `clients` is one sample).
      resident: other arrays the run holds whatever the chunk (shapes; e.g.
        stored test clients).
      state: the algorithm's state of every copy (shapes,
        `jax.eval_shape(algorithm.init, ...)`), held twice (this round's and
        the next); leave per-client models to `per_client_models`.
      build_factor: building the data peaks at this many times the bytes of
        `clients` and `resident` (0: the data itself).
      budget_name, describe, remedy: the words of a refusal: what to raise,
        the settings behind the estimate, what to change.
    """

    model: Any
    clients: Any
    copies: int = 1
    num_clusters: int = 1
    local_training: bool = True
    per_client_models: bool = False
    evaluated: Any = None
    applies_to: tuple[str, ...] | None = None
    fit_machine: bool = False
    generated_clients: int | None = None
    resident: Any = None
    state: Any = None
    build_factor: float = 0
    budget_name: str = "the memory budget"
    describe: str = ""
    remedy: str = ""


@dataclass(frozen=True)
class Checkpoints:
    """Where and how often a run checkpoints (`checkpoint.RunCheckpoints`).

    Attributes:
      directory: where to write them. Under several processes every process
        passes the same directory, on storage they share; each writes its shards.
      every: rounds between checkpoints; None: the run's eval_every. A run's
        chunks of rounds end at multiples of both.
    """

    directory: str | os.PathLike
    every: int | None = None

    def __post_init__(self):
        if self.every is not None and (isinstance(self.every, bool)
                                       or not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"checkpoints' every must be None or an integer >= 1; got "
                             f"{self.every!r}.")


@dataclass(frozen=True, eq=False)
class Execution:
    """How `simulate.run` (and a comparison's methods) run: everything but the maths.

    Attributes:
      mesh: a `jax.sharding.Mesh` (`parallel.make_mesh`) to shard the clients
        and the state's declared per-client leaves over; None: one device.
      memory_budget: bytes for the client axis of a planned method
        (`planned`, `client_chunk`); 0: this machine's default
        (`Footprint.fit_machine`). A run's data carry the plan they were
        given: `simulate.run` runs it.
      checkpoints: `Checkpoints(directory, every)`, or None: no checkpoints.
        A save runs in the background until the next one starts; every one is
        complete on disk when the run returns or raises, and the rows `on_rows`
        appended with `io.append_csv(..., sync=False)` (metrics.csv) are fsynced
        before each is written and when the run ends.
      resume: continue from the newest intact checkpoint (from round 0 if there
        is none; a corrupt or partial newer one is skipped with a message).
        Needs `checkpoints`; without it, a directory that already holds
        checkpoints is refused.
      progress: report progress (`logs.Progress`: a bar on a terminal, one
        plain line per chunk elsewhere); its ETA leaves compilation out.
      description: what starts each progress line.
      progress_summary: how a progress line sums up values per copy
        (`logs.mean_of_copies`, `logs.best_copy`); None: the mean.
      on_rows: called first with the history so far (the round-0 row, or a
        resumed run's restored rows), then with each new row as soon as it
        exists (before the chunk's checkpoint is written), e.g. to append them
        to metrics.csv.
      timing: a dict the run fills in: `rounds_run` (not counting rounds
        restored from a checkpoint), `start_round`, `compile_seconds` (tracing
        and compiling: the round chunks, the kernel-form samples and what JAX
        reports compiling inside the evaluations), `run_seconds` (the rest of
        the wall time), `evaluate_seconds` (the part of run_seconds spent
        evaluating), `kernel_form` (`tuning.Choice.record`: the form, and the
        client chunk its timing chose where it chose one) and `client_chunk` (the
        data's plan; None: all clients at once), which the checkpoints record.
      round_metrics: also return every round's logged round metrics (saved in
        the checkpoints, so a resumed run returns the same arrays; resuming
        from a checkpoint written without them is refused).
      copies: the number of leading axes of every state leaf, round metric and
        evaluation value that hold independent copies of the run (1 for
        `with_restarts` or `with_seeds`, 2 for [seeds, restarts]): a diverged
        copy is a failed copy and the run goes on; it diverges only when every
        copy has. Evaluation values without those axes count for every copy.
      data_copies: the number of leading copies axes of the client data before
        the client axis (1 for data stacked per seed, 0 for data every copy
        shares); over a mesh the client axis is sharded, these are not.
    """

    mesh: Any = None
    memory_budget: float = 0.0
    checkpoints: Checkpoints | None = None
    resume: bool = False
    progress: bool = True
    description: str = "rounds"
    progress_summary: Callable | None = None
    on_rows: Callable[[list[dict]], None] | None = None
    timing: dict | None = None
    round_metrics: bool = False
    copies: int = 0
    data_copies: int = 0

    def __post_init__(self):
        budget = self.memory_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise ValueError(f"memory_budget must be a number of bytes >= 0 (0: the machine's "
                             f"default); got {budget!r}.")
        if self.checkpoints is not None and not isinstance(self.checkpoints, Checkpoints):
            raise ValueError("checkpoints must be None or Checkpoints(directory, every); got "
                             f"{self.checkpoints!r}.")
        for name in ("resume", "progress", "round_metrics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}.")
        if self.resume and self.checkpoints is None:
            raise ValueError("resume=True needs the checkpoints to resume from.")
        for name in ("copies", "data_copies"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"{name} must be the number of leading copies axes (an integer >= 0, e.g. "
                    f"2 for [seeds, restarts]); got {value!r}.")

    def replace(self, **changes) -> Execution:
        return replace(self, **changes)

    def client_chunk(self, footprint: Footprint) -> int | None:
        """The clients a round of `footprint` processes at once under this execution
        (`memory.plan_client_chunk`); None: all of them.

        Raises:
          ValueError: the round does not fit (the budget, or this machine), in one
            line saying what to change.
        """
        return memory.plan_client_chunk(footprint, self.memory_budget)

    def check(self, footprint: Footprint) -> None:
        """Raises `client_chunk`'s ValueError when `footprint` does not fit; nothing else."""
        self.client_chunk(footprint)

    def planned(self, problem, footprint: Footprint | None):
        """`problem` with its client sets (`footprint.applies_to`) planned for
        `footprint`: every client source there processes `client_chunk(footprint)`
        clients at once (its other plan fields kept). None: `problem` as it is."""
        if footprint is None:
            return problem
        chunk = self.client_chunk(footprint)
        names = footprint.applies_to
        if names is None:
            return _rechunked(problem, chunk)
        changed = {name: _rechunked(problem[name] if isinstance(problem, dict)
                                    else getattr(problem, name), chunk) for name in names}
        return {**problem, **changed} if isinstance(problem, dict) else problem._replace(**changed)
