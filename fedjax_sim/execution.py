"""How a round is executed: the executor's choices, carried to the kernels beside the data.

An algorithm's round says *what* is computed; how the compiled program computes
it (which form of a kernel, on this machine) is decided by the executor
(`simulate.run`, and the comparisons and sweeps built on it) and never appears
in an algorithm's signature. The decision is a `Plan`, a small frozen value
that rides on the client data as static pytree data: it is part of jit's cache
key (two plans compile two programs), it survives `take`, chunking and
`vmap`, and the kernels read it where they see the data (`plan_of`).

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
only `fedjax_sim.carried`, which finds and sets it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
