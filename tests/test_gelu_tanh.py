"""gelu_tanh (model.gelu_approximate=tanh, GPT-2's own GELU) against torch's nn.GELU(approximate="tanh") over every
bf16 value, and against the formula in float64 under fp32, value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxtrain.gelu_tanh import BETA, KAPPA, gelu_tanh
from test_autocast import _every_bf16, _gelu_and_grad, _ulp

# The two sides' fp32 tanh differ by a few 2^-24 absolutely (|tanh| <= 1); where 1 + tanh and 1 - tanh^2 cancel
# (x below about -3) that absolute error is most of the result, as ERF_ABS is for the exact GELU: 2^-21 for both
# together, times how much an error in tanh moves each result (_sensitivities).
TANH_ABS = 2.0 ** -21


def _sensitivities(x, dy):
    """|d value / d tanh| = 0.5 |x|, and |d gradient / d tanh| = |dy| (0.5 + |x| BETA (1 + 3 KAPPA x^2)) (its left
    term's 0.5 (1 + t), and its right term's 1 - t^2 near t = +-1): the scale TANH_ABS applies to."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    return 0.5 * np.abs(x), np.abs(dy) * (0.5 + np.abs(x) * BETA * (1 + 3 * KAPPA * x * x))


def _torch_gelu_tanh_and_grad(x, dy):
    x_t = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).requires_grad_(True)
    y_t = torch.nn.functional.gelu(x_t, approximate="tanh")
    y_t.backward(torch.from_numpy(np.asarray(dy, np.float32)).to(torch.bfloat16))
    return y_t.detach().float().numpy(), x_t.grad.float().numpy()


def test_gelu_tanh_bf16_is_torchs():
    """Every bf16 value below 2^32 in magnitude (x^3 stays finite in fp32): both sides upcast, evaluate ATen's fp32
    expressions and round once to bf16, so they agree but where their tanh straddle a bf16 rounding midpoint (one
    ulp) or 1 + tanh cancels (TANH_ABS times _sensitivities)."""
    x = _every_bf16(2.0 ** 32)
    dy = np.asarray(jax.random.normal(jax.random.key(0), x.shape).astype(jnp.bfloat16), np.float32)
    y, dx = _gelu_and_grad(jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16), gelu_tanh)
    assert y.dtype == dx.dtype == jnp.bfloat16
    y_torch, dx_torch = _torch_gelu_tanh_and_grad(x, dy)
    nontrivial = (x >= -3) & (x <= 6) & (np.abs(x) >= 2.0 ** -8)
    for got, want, scale in zip((y, dx), (y_torch, dx_torch), _sensitivities(x, dy)):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        flushed = np.where(np.abs(want) <= np.finfo(np.float32).tiny, np.finfo(np.float32).tiny, 0.0)  # XLA:CPU FTZ
        assert np.all(np.abs(got - want) <= _ulp(want, jnp.bfloat16) + TANH_ABS * scale + flushed)
        # measured 1.0 (all 2,562), value and gradient; 1% of slack for another jax's tanh, as for the exact GELU
        assert np.mean(got[nontrivial] == want[nontrivial]) > 0.99


def test_gelu_tanh_fp32_is_the_formula():
    """Under fp32, value and gradient are the float64 formula's to fp32 rounding (a handful of ops, 2^-21 of the
    result), plus TANH_ABS times _sensitivities where 1 + tanh cancels; and not the exact GELU's (the approximation's
    own error, up to ~5e-4 absolutely near |x| = 2, is far above that bound)."""
    x = np.concatenate([np.linspace(-12, 12, 24001), [0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4]])
    dy = np.asarray(jax.random.normal(jax.random.key(0), x.shape), np.float64)
    y, dx = _gelu_and_grad(jnp.asarray(x, jnp.float32), jnp.asarray(dy, jnp.float32), gelu_tanh)
    t = np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))  # the formula written out, not the module's constants
    want_y = 0.5 * x * (1 + t)
    want_dx = dy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x * x))
    for got, want, scale in zip((y, dx), (want_y, want_dx), _sensitivities(x, dy)):
        got = np.asarray(got, np.float64)
        assert np.all(np.abs(got - want) <= 2.0 ** -21 * np.abs(want) + TANH_ABS * scale)
    exact = np.asarray(jax.nn.gelu(jnp.asarray(x, jnp.float32), approximate=False), np.float64)
    assert np.abs(exact - np.asarray(y, np.float64)).max() > 1e-4


def test_gelu_tanh_is_atens_expressions_in_fp32_op_by_op():
    """Op by op (eagerly: each op rounded to fp32, as ATen's scalar kernel rounds), value and gradient are bit for bit
    ATen's expressions in fp32 around jnp.tanh's value, written out here from GeluKernelImpl and
    GeluBackwardKernelImpl (approximate tanh), constants as ATen forms them (3 * kKappa a product of floats: as a
    double, 0.134145 rounds to another fp32, and 17% of gradients move). Compiled, XLA may fuse and contract these
    ops: within fp32 rounding of this (the parity suite's bounds), not bit for bit."""
    f = np.float32
    x = np.linspace(-6, 6, 200001, dtype=f)
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(f)
    y, dx = _gelu_and_grad(jnp.asarray(x), jnp.asarray(dy), gelu_tanh)
    beta, kappa = f(np.sqrt(2) * (2 / np.sqrt(np.pi)) * 0.5), f(0.044715)  # M_SQRT2 * M_2_SQRTPI * 0.5
    x_sq = x * x
    t = np.asarray(jnp.tanh(jnp.asarray(beta * (x + kappa * (x_sq * x)))))
    left, tanh_derivative, inner_derivative = f(0.5) * x, f(1) - t * t, beta * (f(1) + (f(3) * kappa) * x_sq)
    np.testing.assert_array_equal(y, left * (f(1) + t))
    np.testing.assert_array_equal(dx, dy * (f(0.5) * (f(1) + t) + left * tanh_derivative * inner_derivative))
