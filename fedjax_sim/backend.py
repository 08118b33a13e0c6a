"""Per-shape XLA compiler options, and the jit that applies them.

On CPU, XLA hands dots, reductions and elementwise fusions to its YNNPACK
library ("YNN fusions"). For wide features (a linear model with d = 1000, an
MLP on 784 pixels) that is what makes the GEMMs fast. For narrow ones
(d = 10, the IFCA synthetic success sweeps) each round is many small
reductions over [m, n, k] arrays, which YNNPACK runs several times slower
than XLA's own loop fusions. Measured on the 2-core CPU (jaxlib 0.10.2,
one jitted IFCA option-I round, both settings timed in turn in one process):
(m, n, d, k) = (10⁴, 10, 10, 4) took 4.3 ms with YNN fusions and 1.8 ms
without; (100, 100, 1000, 2) took 9.6 ms with and 13.0 ms without. The time
without/with was 0.42 at d = 10, 0.89 at d = 32, 1.16 at d = 100 and
1.22–1.36 from d = 100 to 1000 (n = 100), hence `YNN_MIN_FEATURES`.
Narrow features still send single dots to YNNPACK where this jaxlib can say
so (the fusion type "individual dot"; the elementwise and reduction fusions
stay XLA's): the round's forward [m·n, d] × [d, k] product with k = 4 took
4.7 ms of CPU time in YNNPACK against 7.5 ms in XLA's own dot at m·n = 10⁶
(d = 10), and the IFCA option-I round at (10⁵, 10, 10, 4) 15.6 against
20–23 ms (issue 20, benchmarks/README.md).

Only the speed changes: both settings compute the same function (to float
rounding, from the order of summation), and a given shape always gets the same
setting, so a seed still gives the same numbers run after run.
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


def compiler_options(feature_size: int | None) -> dict[str, str]:
    """XLA options for a computation whose examples have `feature_size` features.

    Empty (XLA's defaults) off CPU, for wide features, for unknown sizes, or
    where this jaxlib lacks the option.
    """
    if feature_size is None or feature_size >= YNN_MIN_FEATURES:
        return {}
    if jax.default_backend() != "cpu" or not _cpu_option_supported():
        return {}
    return {_YNN_OPTION: _narrow_value()}  # no YNN fusions but single dots


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
        donate_argnames: tuple[str, ...] = ()):
    """`jax.jit(fun)` with `compiler_options(feature_size)`; cached per options (and per
    the arguments whose buffers the call may reuse, `donate_argnames`)."""
    options = tuple(sorted(compiler_options(feature_size).items()))
    return _jitted(fun, options, tuple(static_argnames), tuple(donate_argnames))
