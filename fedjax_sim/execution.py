"""How a round is executed: the executor's choices, carried to the kernels beside the data.

An algorithm's round says *what* is computed; how the compiled program computes
it (which form of a kernel, on this machine) is decided by the executor
(`simulate.run`, and the comparisons and sweeps built on it) and never appears
in an algorithm's signature. The decision is a `Plan`, a small frozen value
that rides on the client data as static pytree data: it is part of jit's cache
key (two plans compile two programs), it survives `take`, chunking and
`vmap`, and the kernels read it where they see the data (`plan_of`).

A `Plan` holds:

- `linear_form`: the form of IFCA option I's fused linear kernel
  (`ops.linear.LINEAR_FORMS`); None: the default form. `fedjax_sim.tuning`
  times the forms once per machine and round shape and remembers the choice.

This module imports nothing from fedjax_sim: the data layer carries a plan
without knowing what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax


@dataclass(frozen=True)
class Plan:
    """The executor's choices for one round's programs (hashable: a jit cache key).

    Attributes:
      linear_form: the linear kernel's form (`ops.linear.LINEAR_FORMS`), or None
        for the default.
    """

    linear_form: str | None = None

    def replace(self, **changes) -> Plan:
        return replace(self, **changes)


DEFAULT_PLAN = Plan()


def _is_carrier(node) -> bool:
    return hasattr(node, "plan") and hasattr(node, "with_plan")


def plan_of(data) -> Plan:
    """The plan of a client source, or of the first one in a pytree (the default if none)."""
    if _is_carrier(data):
        return data.plan
    for node in jax.tree.leaves(data, is_leaf=_is_carrier):
        if _is_carrier(node):
            return node.plan
    return DEFAULT_PLAN


def with_plan(data, plan: Plan):
    """`data` (a client source, or a pytree holding them) with every client source's plan
    set to `plan`; other nodes as they are."""
    if _is_carrier(data):
        return data.with_plan(plan)
    return jax.tree.map(lambda n: n.with_plan(plan) if _is_carrier(n) else n, data,
                        is_leaf=_is_carrier)
