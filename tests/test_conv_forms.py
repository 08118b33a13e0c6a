"""The convolution forms (`models.conv`): patches × kernel equals XLA's convolution.

Against `lax.conv_general_dilated` itself (forward, and the gradients with respect to
the input and the kernel) for several strides, paddings, dilations and channel counts;
through `from_flax` for flax `nn.Conv` layers (the interceptor, and its fallback for what
it does not rewrite); and a FedAvg round of a small flax CNN (the cohort vmapped, the
local steps scanned, patches form) against a loop over clients written here with the
module as written (XLA's convolution), one client at a time, explicit SGD.
"""

from __future__ import annotations

import doctest
import json
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from fedjax_sim.algorithms import fedavg, sgd
from fedjax_sim.data import FederatedData
from fedjax_sim.models import conv
from fedjax_sim.models.core import from_flax, split_model

NHWC = ("NHWC", "HWIO", "NHWC")


def _close(a, b, rtol=2e-5):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(np.max(np.abs(b)), 1e-6)
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize(
    "kernel, c_in, c_out, strides, padding, lhs_dilation, rhs_dilation",
    [
        ((3, 3), 3, 8, (1, 1), "VALID", None, None),
        ((3, 3), 2, 5, (1, 1), "SAME", None, None),
        ((5, 5), 4, 3, (2, 2), "SAME", None, None),
        ((3, 2), 3, 4, (2, 1), ((1, 2), (0, 1)), None, None),
        ((3, 3), 2, 3, (1, 2), "VALID", None, (2, 1)),
        ((2, 2), 3, 2, (1, 1), ((1, 1), (0, 1)), (2, 2), None),
        ((3, 3), 2, 2, (2, 1), ((2, 0), (1, 1)), (1, 3), (2, 1)),
        ((1, 1), 6, 4, (1, 1), "VALID", None, None),
        ((3, 3), 1, 1, (3, 3), ((-1, 2), (1, 0)), None, None),
    ],
)
def test_patches_conv_equals_xla_conv(
    kernel, c_in, c_out, strides, padding, lhs_dilation, rhs_dilation
):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 9, 8, c_in))
    w = jax.random.normal(kw, (*kernel, c_in, c_out))

    def xla(x, w):
        return lax.conv_general_dilated(x, w, strides, padding, lhs_dilation, rhs_dilation, NHWC)

    def ours(x, w):
        return conv.patches_conv(x, w, strides, padding, lhs_dilation, rhs_dilation, NHWC)

    want = xla(x, w)
    got = ours(x, w)
    assert got.shape == want.shape
    _close(got, want)
    cot = jax.random.normal(kg, want.shape)
    grads_want = jax.vjp(xla, x, w)[1](cot)
    grads_got = jax.vjp(ours, x, w)[1](cot)
    for g, gw in zip(grads_got, grads_want, strict=True):
        _close(g, gw)
    assert "conv_general_dilated" not in str(
        jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(ours(x, w) ** 2), argnums=(0, 1)))(x, w)
    )


def test_patches_conv_falls_back_for_grouped_convolutions():
    x = jax.random.normal(jax.random.key(0), (2, 6, 6, 4))
    w = jax.random.normal(jax.random.key(1), (3, 3, 2, 6))
    want = lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=2
    )
    got = conv.patches_conv(x, w, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=2)
    np.testing.assert_array_equal(got, want)


class _Net(nn.Module):
    layer: nn.Module

    @nn.compact
    def __call__(self, x):
        y = self.layer(x)
        return nn.Dense(3)(y.reshape((y.shape[0], -1)))


@pytest.mark.parametrize(
    "layer, shape",
    [
        (nn.Conv(4, (3, 3), padding="SAME"), (7, 6, 2)),
        (nn.Conv(5, (3, 3), strides=2, padding="VALID", use_bias=False), (9, 9, 3)),
        (nn.Conv(3, (2, 3), padding=((1, 0), (2, 1)), kernel_dilation=(2, 1)), (8, 7, 2)),
        (nn.Conv(2, (3, 3), padding="CIRCULAR"), (5, 5, 1)),
        (nn.Conv(2, (3, 3), padding=((1, 1), (2, 0)), input_dilation=2), (5, 4, 1)),
        (nn.Conv(4, (3,), padding="SAME"), (10, 3)),  # 1-D
        (nn.Conv(4, (2, 2, 2), padding="VALID"), (4, 4, 4, 2)),  # 3-D
        (nn.Conv(4, (3, 3), feature_group_count=2), (6, 6, 4)),  # not rewritten
    ],
)
def test_from_flax_patches_form_equals_xla_form(layer, shape):
    module = _Net(layer)
    example = jnp.zeros((1, *shape))
    patches = from_flax(module, example, conv_form="patches")
    xla = from_flax(module, example, conv_form="xla")
    params = patches.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (3, *shape))
    y = jnp.array([0, 2, 1])

    def loss(model):
        return lambda p: jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y)
        )

    _close(patches.apply(params, x), xla.apply(params, x))
    chex_leaves = zip(
        jax.tree.leaves(jax.grad(loss(patches))(params)),
        jax.tree.leaves(jax.grad(loss(xla))(params)),
        strict=True,
    )
    for got, want in chex_leaves:
        _close(got, want)
    rewritten = layer.feature_group_count == 1
    program = str(jax.make_jaxpr(jax.grad(loss(patches)))(params))
    assert ("conv_general_dilated" not in program) == rewritten
    assert "conv_general_dilated" in str(jax.make_jaxpr(jax.grad(loss(xla)))(params))


def test_conv_form_resolution_and_refusal(monkeypatch):
    assert conv.resolve("auto") == ("patches" if jax.default_backend() == "cpu" else "xla")
    assert conv.resolve("xla") == "xla"
    monkeypatch.setenv(conv.CONV_FORM_ENV, "xla")
    assert conv.check_conv_form(None) == "xla"
    assert conv.check_conv_form("patches") == "patches"
    monkeypatch.setenv(conv.CONV_FORM_ENV, "im2col")
    with pytest.raises(ValueError, match="FEDJAX_SIM_CONV_FORM"):
        conv.check_conv_form(None)
    with pytest.raises(ValueError, match="conv_form"):
        from_flax(nn.Dense(2), jnp.zeros((1, 3)), conv_form="fast")


class _TinyCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3), padding="VALID")(x))
        x = nn.relu(nn.Conv(6, (3, 3), strides=2, padding="SAME")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        return nn.Dense(3)(x.reshape((x.shape[0], -1)))


def test_fedavg_round_of_a_cnn_equals_a_loop_over_clients():
    """Every client (one with a single example) runs `steps` full-batch SGD steps from the
    global params on its real rows' mean cross-entropy; the new params are the mean of the
    clients' (uniform weighting). Reference: the module as written (XLA's convolution),
    one client at a time."""
    lr, steps = 0.3, 3
    counts = np.array([5, 1, 3, 5])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 5, 10, 10, 2)).astype(np.float32)
    y = rng.integers(0, 3, (4, 5)).astype(np.int32)
    data = FederatedData.from_arrays(x, y, num_examples=counts)
    module = _TinyCNN()
    model = from_flax(module, jnp.zeros((1, 10, 10, 2)), conv_form="patches")
    alg = fedavg(model, sgd(lr, steps=steps))
    state = alg.init(jax.random.key(0), data)
    program = str(jax.make_jaxpr(alg.round)(state, data, jax.random.key(1)))
    assert "conv_general_dilated" not in program  # the round runs the patches form
    new, _ = jax.jit(alg.round)(state, data, jax.random.key(1))

    def client_loss(params, xs, ys):
        logits = module.apply({"params": params}, xs)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, ys))

    grad = jax.jit(jax.grad(client_loss))
    updated = []
    for i in range(len(counts)):
        params = state.params
        for _ in range(steps):
            g = grad(params, x[i, : counts[i]], y[i, : counts[i]])
            params = jax.tree.map(lambda p, d: p - lr * d, params, g)
        updated.append(params)
    want = jax.tree.map(lambda *ps: np.mean(np.stack(ps), axis=0), *updated)
    for got, ref, before in zip(
        jax.tree.leaves(new.params),
        jax.tree.leaves(want),
        jax.tree.leaves(state.params),
        strict=True,
    ):
        _close(got, ref, rtol=1e-5)
        assert not np.allclose(got, before)  # the round moves every leaf


def test_split_model_features_run_the_patches_form():
    trunk = nn.Sequential([nn.Conv(3, (3, 3)), lambda x: x.reshape((x.shape[0], -1))])
    example = jnp.zeros((1, 5, 5, 2))
    patches = split_model(trunk, nn.Dense(2), example, conv_form="patches")
    xla = split_model(trunk, nn.Dense(2), example, conv_form="xla")
    params = patches.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 5, 5, 2))

    def loss(model):
        return lambda p: jnp.sum(model.apply(p, x) ** 2)

    # Evaluated: XLA's convolution; differentiated: no convolution, only the GEMM form.
    assert "custom_jvp_call" in str(jax.make_jaxpr(patches.apply)(params, x))
    assert "conv_general_dilated" not in str(jax.make_jaxpr(jax.grad(loss(patches)))(params))
    _close(patches.apply(params, x), xla.apply(params, x))
    for got, ref in zip(jax.tree.leaves(jax.grad(loss(patches))(params)),
                        jax.tree.leaves(jax.grad(loss(xla))(params)), strict=True):
        _close(got, ref)


def _conv64(x, w, strides, padding):
    """A float64 loop: out[n, i, j, o] = Σ_{a, b, c} x_pad[n, i·s + a, j·s + b, c] w[a, b, c, o]."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    (pt, pb), (pl, pr) = padding
    x = np.pad(x, ((0, 0), (pt, pb), (pl, pr), (0, 0)))
    kh, kw = w.shape[:2]
    oh = (x.shape[1] - kh) // strides[0] + 1
    ow = (x.shape[2] - kw) // strides[1] + 1
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for i in range(oh):
        for j in range(ow):
            window = x[:, i * strides[0]:i * strides[0] + kh, j * strides[1]:j * strides[1] + kw]
            out[:, i, j] = np.einsum("nabc,abco->no", window, w)
    return out


@pytest.mark.parametrize("strides, padding", [((1, 1), ((0, 0), (0, 0))),
                                              ((2, 1), ((1, 2), (0, 1)))])
def test_conv_patches_gradient_values_and_both_modes_against_a_loop(strides, padding):
    """Evaluated, differentiated in reverse (wrt the kernel only, the input only, both)
    and in forward mode: against the float64 loop and its finite differences' linearity
    (the convolution is bilinear, so its derivatives are convolutions of the tangents)."""
    kx, kw, kg, kt = jax.random.split(jax.random.key(3), 4)
    x = jax.random.normal(kx, (2, 7, 6, 3))
    w = jax.random.normal(kw, (3, 2, 3, 4))
    conv_fn = lambda x, w: conv.conv_patches_gradient(  # noqa: E731
        x, w, strides, padding, dimension_numbers=NHWC)
    out = conv_fn(x, w)
    _close(out, _conv64(x, w, strides, padding))
    g = jax.random.normal(kg, out.shape)
    g64 = np.asarray(g, np.float64)
    # reverse mode: <g, conv(x, w)> is linear in each; its gradients by the loop's adjoint
    gw = jax.grad(lambda w: jnp.sum(conv_fn(x, w) * g))(w)
    gx = jax.grad(lambda x: jnp.sum(conv_fn(x, w) * g))(x)
    gxw = jax.grad(lambda x, w: jnp.sum(conv_fn(x, w) * g), argnums=(0, 1))(x, w)
    eye_w = np.eye(w.size).reshape(w.size, *w.shape)
    want_w = np.array([np.sum(_conv64(x, e, strides, padding) * g64) for e in eye_w])
    eye_x = np.eye(x.size).reshape(x.size, *x.shape)
    want_x = np.array([np.sum(_conv64(e, w, strides, padding) * g64) for e in eye_x])
    _close(np.ravel(gw), want_w)
    _close(np.ravel(gx), want_x)
    _close(np.ravel(gxw[0]), want_x)
    _close(np.ravel(gxw[1]), want_w)
    # forward mode
    dx, dw = jax.random.normal(kt, x.shape), jax.random.normal(kg, w.shape)
    _, tangent = jax.jvp(conv_fn, (x, w), (dx, dw))
    _close(tangent, _conv64(dx, w, strides, padding) + _conv64(x, dw, strides, padding))


def test_dense_product_values_and_gradients_against_numpy():
    kx, kw, kg = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(kx, (3, 2, 5))
    w = jax.random.normal(kw, (5, 4))
    g = jax.random.normal(kg, (3, 2, 4))
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    _close(conv.dense_product(x, w), x64 @ w64)
    gx, gw = jax.grad(lambda x, w: jnp.sum(conv.dense_product(x, w) * g), argnums=(0, 1))(x, w)
    _close(gx, g64 @ w64.T)
    _close(gw, np.einsum("abi,abo->io", x64, g64))
    # vmapped over clients, as local training runs it
    xs, ws = jnp.stack([x, 2 * x]), jnp.stack([w, -w])
    grads = jax.vmap(jax.grad(lambda w, x: jnp.sum(conv.dense_product(x, w) * g)))(ws, xs)
    _close(grads[1], np.einsum("abi,abo->io", 2 * x64, g64))


def test_dense_layers_run_dense_product_with_flax_numbers():
    module = nn.Sequential([nn.Dense(6), nn.relu, nn.Dense(3)])
    example = jnp.zeros((1, 4))
    fast = from_flax(module, example, conv_form="patches")
    plain = from_flax(module, example, conv_form="xla")
    params = fast.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (7, 4))
    assert "custom_vjp_call" in str(jax.make_jaxpr(fast.apply)(params, x))
    assert "custom_vjp_call" not in str(jax.make_jaxpr(plain.apply)(params, x))
    loss = lambda m: lambda p: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
    _close(fast.apply(params, x), plain.apply(params, x))
    for got, ref in zip(jax.tree.leaves(jax.grad(loss(fast))(params)),
                        jax.tree.leaves(jax.grad(loss(plain))(params)), strict=True):
        _close(got, ref)


def test_module_example_runs():
    failures, tried = doctest.testmod(conv, optionflags=doctest.ELLIPSIS)
    assert tried and not failures


@pytest.mark.slow
def test_benchmark_dry_run_times_both_forms_as_strict_json(tmp_path):
    """benchmarks/conv_round.py --dry-run: both forms, and the full cohort whole and in the
    executor's chunk, their round's FLOPs and fraction of the matmul peak, the same
    parameters after one round to float rounding."""
    repo = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "cr.json"
    done = subprocess.run(
        [
            sys.executable,
            str(repo / "benchmarks" / "conv_round.py"),
            "--dry-run",
            "--budget",
            "0",
            "--out",
            str(out),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    payload = json.loads(out.read_text(), parse_constant=refuse)
    assert payload["meta"]["cpu_model"] and payload["meta"]["dry_run"] is True
    rows = [(row["form"], row["chunk"]) for row in payload["rows"]]
    assert rows == [("xla", "whole"), ("patches", "whole"), ("patches", "whole"),
                    ("patches", "executor")]
    for row in payload["rows"]:
        assert row["round_s"] > 0 and row["round_flops"] > 0
        assert row["fraction_of_matmul_peak"] > 0
    assert payload["max_abs_param_difference_after_one_round"] < 1e-5
    assert payload["max_abs_param_difference_chunked_vs_whole"] < 1e-5
