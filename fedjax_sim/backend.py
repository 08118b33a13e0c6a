"""Per-shape XLA compiler options, and the jit that applies them.

On CPU, XLA hands dots, reductions and elementwise fusions to its YNNPACK
library ("YNN fusions"). For wide features (a linear model with d = 1000, an
MLP on 784 pixels) that is what makes the GEMMs fast, and every program keeps
XLA's defaults. For narrow ones (d < `YNN_MIN_FEATURES`, the IFCA synthetic
success sweeps) a round is many small reductions over [m, n, k] arrays, which
YNNPACK runs several times slower than XLA's own loop fusions, so narrow
programs are compiled with YNN fusions off. Whether YNNPACK's single dots
still pay for narrow features depends on the CPU (faster where the dot gets
its thread, slower where it waits for it): the IFCA option-I round's
`ops.linear` form "dot_ynn" turns them on, and `fedjax_sim.tuning` decides per
machine whether it is taken (benchmarks/README.md, "kernel_forms.py").

Only the speed changes: every setting computes the same function (to float
rounding, from the order of summation), and a given shape and form always get
the same setting, so a seed still gives the same numbers run after run.
"""

from __future__ import annotations

import functools

import jax

from fedjax_sim.data.federated import is_client_source

YNN_MIN_FEATURES = 64
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


_INDIVIDUAL_DOTS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"


def _compiles_with(value: str) -> bool:
    try:
        jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options={_YNN_OPTION: value})
    except Exception:  # an older or newer XLA without the (experimental) flag or value
        return False
    return True


@functools.cache
def _narrow_value() -> str | None:
    """The YNN fusion types for narrow features: single dots only, or none where this jaxlib
    lacks that value; None where it lacks the option."""
    for value in (_INDIVIDUAL_DOTS, ""):
        if _compiles_with(value):
            return value
    return None


def _cpu_option_supported() -> bool:
    """Whether this jaxlib's CPU compiler knows the YNN fusion option."""
    return _narrow_value() is not None


def compiler_options(feature_size: int | None, linear_form: str | None = None
                     ) -> dict[str, str]:
    """XLA options for a computation whose examples have `feature_size` features.

    Narrow features on CPU: no YNN fusions, or (linear_form "dot_ynn", where this
    jaxlib can say so) none but YNNPACK's single dots. Empty (XLA's defaults) off
    CPU, for wide features, for unknown sizes, or where this jaxlib lacks the option.
    """
    if feature_size is None or feature_size >= YNN_MIN_FEATURES:
        return {}
    if jax.default_backend() != "cpu" or not _cpu_option_supported():
        return {}
    if linear_form == "dot_ynn" and _narrow_value() == _INDIVIDUAL_DOTS:
        return {_YNN_OPTION: _INDIVIDUAL_DOTS}
    return {_YNN_OPTION: ""}  # an empty list of fusion types: no YNN fusions


def feature_size(data) -> int | None:
    """Features per example of client data (x: leaves [..., m, n, *features]), summed over leaves.

    `data` may be a FederatedData or any pytree holding one (an algorithm's
    inputs); None when there is none.
    """
    found = [n for n in jax.tree.leaves(data, is_leaf=is_client_source) if is_client_source(n)]
    if not found:
        return None
    # Views and generated clients count what their rows will hold, so they get the
    # copies' compiler options (and the copies' numbers).
    return found[0].features_per_example()


@functools.lru_cache(maxsize=64)
def _jitted(fun, options: tuple, static_argnames: tuple, donate_argnames: tuple = ()):
    return jax.jit(fun, static_argnames=static_argnames, donate_argnames=donate_argnames,
                   compiler_options=dict(options) or None)


def jit(fun, feature_size: int | None, static_argnames: tuple[str, ...] = (),
        donate_argnames: tuple[str, ...] = (), linear_form: str | None = None):
    """`jax.jit(fun)` with `compiler_options(feature_size, linear_form)`; cached per options
    (and per the arguments whose buffers the call may reuse, `donate_argnames`).

    linear_form: the form the program's linear kernel takes (its data's execution plan,
    `execution.plan_of(data).linear_form`), which picks the options that go with it.
    """
    options = tuple(sorted(compiler_options(feature_size, linear_form).items()))
    return _jitted(fun, options, tuple(static_argnames), tuple(donate_argnames))
