"""The form a flax model's layers run in: as written, or in forms fast on a CPU.

On CPU, XLA's convolution *weight gradient* inside the `lax.scan` of local steps, and
vmapped over the cohort, runs tens of times slower than a matmul of the same size
(benchmarks/README.md, "conv_round.py"). The same convolution written as the input's
shifted (strided, dilated) slices concatenated along the channels, then one
dot_general with the kernel reshaped [kh·kw·c_in, c_out], is an ordinary GEMM under
vmap (one batched GEMM over the clients), and its gradients are GEMMs, pads and adds.
XLA's *forward* convolution, on the other hand, is fast (faster than that GEMM: it
builds no patches), so where nothing differentiates it (evaluation) it is the one run.

`from_flax` and `split_model` run the module's apply under `flax.linen.intercept_methods`
with `patches_interceptor`, which changes two layers:

- every `nn.Conv` (2-D and 1-D/3-D alike, `feature_group_count` 1, no kernel mask, no
  user conv function) computes its convolution by `conv_patches_gradient`: XLA's
  convolution when evaluated, and under differentiation the output and derivatives of
  `patches_conv` (a `jax.custom_jvp`, so forward and reverse mode both work); the
  layer's parameters, padding (string, pairs or CIRCULAR), strides, dilations, bias
  and dtypes stay flax's;
- every `nn.Dense` (no user dot function) computes `x @ kernel` by `dense_product`,
  whose kernel gradient XLA writes in the kernel's own [in, out] layout (JAX's
  transpose rule writes it [out, in] and XLA's CPU backend then copies it across,
  transposing a whole kernel every step). A `jax.custom_vjp`: forward-mode
  differentiation (`jax.jvp`) of such a model needs the form "xla".

Anything else runs as written. Only the speed changes: the outputs and gradients equal
the module's as written to float rounding (tests/test_conv_forms.py).

The form, per model (`from_flax(..., conv_form=...)`), else the environment variable
FEDJAX_SIM_CONV_FORM, else "auto":

    "auto":    "patches" on the CPU backend, "xla" on GPU/TPU (cuDNN's and the TPU's
               convolutions are already near their peak).
    "patches": always the forms above.
    "xla":     always the module as written.

>>> import jax.numpy as jnp, flax.linen as nn
>>> from fedjax_sim.models.core import from_flax
>>> conv = nn.Sequential([nn.Conv(4, (3, 3)), lambda x: x.reshape((x.shape[0], -1))])
>>> fast = from_flax(conv, jnp.zeros((1, 5, 5, 2)), conv_form="patches")
>>> plain = from_flax(conv, jnp.zeros((1, 5, 5, 2)), conv_form="xla")
>>> params = fast.init(jax.random.key(0))
>>> x = jax.random.normal(jax.random.key(1), (2, 5, 5, 2))
>>> bool(jnp.allclose(fast.apply(params, x), plain.apply(params, x), atol=1e-5))
True
"""

from __future__ import annotations

import contextlib
import functools
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

CONV_FORMS = ("auto", "patches", "xla")
CONV_FORM_ENV = "FEDJAX_SIM_CONV_FORM"


def check_conv_form(conv_form: str | None) -> str:
    """The form asked for (argument, else the environment, else "auto"); ValueError naming
    the bad value otherwise."""
    source = "conv_form"
    if conv_form is None:
        conv_form = os.environ.get(CONV_FORM_ENV, "").strip() or "auto"
        source = CONV_FORM_ENV
    if conv_form not in CONV_FORMS:
        raise ValueError(f"{source} must be one of {CONV_FORMS}; got {conv_form!r}.")
    return conv_form


def resolve(conv_form: str) -> str:
    """The form that runs: "auto" is "patches" on the CPU backend, "xla" elsewhere."""
    if conv_form == "auto":
        return "patches" if jax.default_backend() == "cpu" else "xla"
    return conv_form


def _standard_numbers(dimension_numbers, ndim: int) -> bool:
    """Whether these are flax's channels-last numbers: (N, spatial…, C), (spatial…, I, O)."""
    if dimension_numbers is None:
        return False
    dn = lax.conv_dimension_numbers((1,) * ndim, (1,) * ndim, dimension_numbers)
    spatial = tuple(range(1, ndim - 1))
    return (
        dn.lhs_spec == (0, ndim - 1) + spatial
        and dn.rhs_spec == (ndim - 1, ndim - 2) + tuple(range(ndim - 2))
        and dn.out_spec == (0, ndim - 1) + spatial
    )


def patches_conv(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    precision=None,
    preferred_element_type=None,
    **unused,
):
    """`lax.conv_general_dilated` on channels-last operands as slices and one dot_general.

    lhs [n, s_1, …, s_d, c_in], rhs [k_1, …, k_d, c_in, c_out] -> [n, o_1, …, o_d, c_out]:
    lhs padded (padding, and lhs_dilation as interior padding), then for each kernel
    offset (k_1, …, k_d), row-major, its strided slice [n, o…, c_in]; the slices
    concatenated along the channels [n, o…, Π k · c_in] times rhs reshaped
    [Π k · c_in, c_out] (the same order). Other layouts or grouped convolutions go to
    `lax.conv_general_dilated` unchanged (as does string padding with lhs_dilation,
    which it refuses).
    """
    d = lhs.ndim - 2
    if (
        feature_group_count != 1
        or unused.get("batch_group_count", 1) != 1
        or not _standard_numbers(dimension_numbers, lhs.ndim)
        or (isinstance(padding, str) and any(v != 1 for v in lhs_dilation or ()))
    ):
        return lax.conv_general_dilated(
            lhs,
            rhs,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dimension_numbers,
            feature_group_count,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **unused,
        )
    patches = _patches_of(lhs, rhs.shape[:d], window_strides, padding, lhs_dilation,
                          rhs_dilation)
    weights = rhs.reshape((-1, rhs.shape[-1]))  # [Π k · c_in, c_out], offsets row-major
    return lax.dot_general(
        patches,
        weights,
        (((lhs.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def _patches_of(lhs, kernel, window_strides, padding, lhs_dilation, rhs_dilation):
    """lhs [n, s…, c_in] -> its patches [n, o…, Π k · c_in] (offsets row-major)."""
    d = lhs.ndim - 2
    strides = tuple(window_strides)
    lhs_dilation = tuple(lhs_dilation or (1,) * d)
    rhs_dilation = tuple(rhs_dilation or (1,) * d)
    if isinstance(padding, str):
        dilated_k = [(k - 1) * rd + 1 for k, rd in zip(kernel, rhs_dilation, strict=True)]
        padding = lax.padtype_to_pads(lhs.shape[1:-1], dilated_k, strides, padding)
    config = [(0, 0, 0)] + [
        (lo, hi, ld - 1) for (lo, hi), ld in zip(padding, lhs_dilation, strict=True)
    ]
    x = lax.pad(lhs, np.zeros((), lhs.dtype), config + [(0, 0, 0)])
    out = [
        (size - (k - 1) * rd - 1) // s + 1
        for size, k, rd, s in zip(x.shape[1:-1], kernel, rhs_dilation, strides, strict=True)
    ]
    slices = []
    for offset in np.ndindex(*kernel):
        start = [o * rd for o, rd in zip(offset, rhs_dilation, strict=True)]
        limit = [st + (o - 1) * s + 1 for st, o, s in zip(start, out, strides, strict=True)]
        slices.append(
            lax.slice(x, (0, *start, 0), (x.shape[0], *limit, x.shape[-1]), (1, *strides, 1))
        )
    return slices[0] if len(slices) == 1 else lax.concatenate(slices, lhs.ndim - 1)


def _hashable(value):
    """Lists as tuples (named tuples kept), for a static, cached configuration."""
    if hasattr(value, "_fields"):
        return type(value)(*(_hashable(v) for v in value))
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


def conv_patches_gradient(lhs, rhs, window_strides, padding, lhs_dilation=None,
                          rhs_dilation=None, dimension_numbers=None, feature_group_count=1,
                          precision=None, preferred_element_type=None, **unused):
    """`lax.conv_general_dilated` when evaluated; under differentiation, `patches_conv`'s
    output and derivatives (the GEMM form above). Arguments as `patches_conv`'s; what it
    does not rewrite goes to `lax.conv_general_dilated` unchanged."""
    config = (
        ("window_strides", _hashable(window_strides)),
        ("padding", _hashable(padding)),
        ("lhs_dilation", _hashable(lhs_dilation)),
        ("rhs_dilation", _hashable(rhs_dilation)),
        ("dimension_numbers", _hashable(dimension_numbers)),
        ("feature_group_count", feature_group_count),
        ("precision", precision),
        ("preferred_element_type", preferred_element_type),
        *sorted((k, _hashable(v)) for k, v in unused.items()),
    )
    if _AS_DIFFERENTIATED[0]:
        return patches_conv(lhs, rhs, **dict(config))
    return _conv_patches_gradient_cached(config)(lhs, rhs)


_AS_DIFFERENTIATED = [False]


@contextlib.contextmanager
def as_differentiated():
    """Within it, `conv_patches_gradient` traces as it runs under differentiation (the
    patches form) also when evaluated: what a memory estimate of training counts."""
    before = _AS_DIFFERENTIATED[0]
    _AS_DIFFERENTIATED[0] = True
    try:
        yield
    finally:
        _AS_DIFFERENTIATED[0] = before


@functools.lru_cache(maxsize=256)
def _conv_patches_gradient_cached(config: tuple):
    kwargs = dict(config)

    @jax.custom_jvp
    def convolve(x, w):
        return lax.conv_general_dilated(x, w, **kwargs)

    def patches(x, w):
        return patches_conv(x, w, **kwargs)

    def jvp(primals, tangents):
        (x, w), (dx, dw) = primals, tangents
        if isinstance(dx, SymbolicZero) and isinstance(dw, SymbolicZero):
            out = patches(x, w)
            return out, jnp.zeros_like(out)
        if isinstance(dx, SymbolicZero):  # e.g. the first layer: its input is data
            return jax.jvp(lambda w: patches(x, w), (w,), (dw,))
        if isinstance(dw, SymbolicZero):
            return jax.jvp(lambda x: patches(x, w), (x,), (dx,))
        return jax.jvp(patches, (x, w), (dx, dw))

    convolve.defjvp(jvp, symbolic_zeros=True)
    return convolve


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense_product(x, kernel, precision=None):
    """x [..., in] @ kernel [in, out]; the kernel's gradient is computed as
    x.reshape(-1, in)ᵀ · g.reshape(-1, out) in the kernel's own layout."""
    return lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _dense_forward(x, kernel, precision):
    return dense_product(x, kernel, precision), (x, kernel)


def _dense_backward(precision, residuals, g):
    x, kernel = residuals
    dx = lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())), precision=precision)
    dkernel = lax.dot_general(
        x.reshape((-1, x.shape[-1])),
        g.reshape((-1, g.shape[-1])),
        (((0,), (0,)), ((), ())),
        precision=precision,
    )
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


dense_product.defvjp(_dense_forward, _dense_backward)


def _dense_dot_general(lhs, rhs, dimension_numbers, precision=None, **kwargs):
    """nn.Dense's dot_general: `dense_product` for its x @ kernel, else lax's."""
    standard = (((lhs.ndim - 1,), (0,)), ((), ()))
    if (
        rhs.ndim == 2
        and not kwargs
        and lhs.dtype == rhs.dtype
        and _hashable(dimension_numbers) == standard
    ):
        return dense_product(lhs, rhs, precision)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision, **kwargs)


def _set_for_call(module, field, value, next_fun, args, kwargs):
    # flax reads the layer's function from this (deprecated-for-users) field at call
    # time; set it for this call only, on this bound instance.
    object.__setattr__(module, field, value)
    try:
        return next_fun(*args, **kwargs)
    finally:
        object.__setattr__(module, field, None)


def patches_interceptor(next_fun, args, kwargs, context):
    """`nn.intercept_methods` interceptor: an `nn.Conv`'s call convolves by
    `conv_patches_gradient`, an `nn.Dense`'s multiplies by `dense_product` (flax's own
    code around them: parameters, padding, bias, dtypes)."""
    module = context.module
    if context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    if (
        type(module) is nn.Conv
        and module.feature_group_count == 1
        and module.mask is None
        and module.conv_general_dilated is None
        and module.conv_general_dilated_cls is None
    ):
        return _set_for_call(module, "conv_general_dilated_cls",
                             lambda: conv_patches_gradient, next_fun, args, kwargs)
    if (
        type(module) is nn.Dense
        and module.dot_general is None
        and module.dot_general_cls is None
    ):
        return _set_for_call(module, "dot_general_cls", lambda: _dense_dot_general,
                             next_fun, args, kwargs)
    return next_fun(*args, **kwargs)


def conv_context(conv_form: str):
    """The context an apply runs in for this (checked) form; resolved at trace time."""
    if resolve(conv_form) == "patches":
        return nn.intercept_methods(patches_interceptor)
    return contextlib.nullcontext()
