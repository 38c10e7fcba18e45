"""GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the one OpenAI's GPT-2 trained with
(Hugging Face's activation_function="gelu_new", torch's nn.GELU(approximate="tanh")), for model.gelu_approximate=tanh,
so that GPT-2's own checkpoints compute what they were trained to. nanoGPT's exact (erf) GELU, the default, is
autocast.gelu.

Computed as torch's kernels compute it, as autocast.gelu computes the exact one: in fp32 whatever x's dtype (an
autocast c_fc output in bf16 is upcast, "opmath"), rounded once to x's dtype, with ATen's expressions in ATen's order
(GeluKernelImpl and GeluBackwardKernelImpl, approximate tanh: x_cube = x * x * x, inner = kBeta * (x + kKappa *
x_cube), 0.5 * x * (1 + tanh(inner))): op by op bit for bit ATen's around XLA's tanh; compiled, XLA may fuse and
contract them, within fp32 rounding. Its gradient is written out, as autocast.gelu's, keeping only x for the backward
pass.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

BETA, KAPPA = math.sqrt(2 / math.pi), 0.044715  # ATen's kBeta (M_SQRT2 * M_2_SQRTPI * 0.5) and kKappa
KAPPA3 = np.float32(3) * np.float32(KAPPA)  # ATen's 3 * kKappa, a product of floats: 0.134144992, not fp32(0.134145)


@jax.custom_vjp
def gelu_tanh(x):
    x_f32 = x.astype(jnp.float32)
    inner = BETA * (x_f32 + KAPPA * (x_f32 * x_f32 * x_f32))
    return (0.5 * x_f32 * (1 + jnp.tanh(inner))).astype(x.dtype)


def _gelu_tanh_fwd(x):
    return gelu_tanh(x), x


def _gelu_tanh_bwd(x, dy):
    """dx = dy (0.5 (1 + t) + 0.5 x (1 - t^2) kBeta (1 + 3 kKappa x^2)), t = tanh(inner), in fp32 and rounded once
    to x's dtype, as ATen's GeluBackwardKernelImpl."""
    x_f32 = x.astype(jnp.float32)
    x_sq = x_f32 * x_f32
    t = jnp.tanh(BETA * (x_f32 + KAPPA * (x_sq * x_f32)))
    left_derivative = 0.5 * (1 + t)
    right_derivative = (0.5 * x_f32) * (1 - t * t) * (BETA * (1 + KAPPA3 * x_sq))
    return ((dy.astype(jnp.float32) * (left_derivative + right_derivative)).astype(x.dtype),)


gelu_tanh.defvjp(_gelu_tanh_fwd, _gelu_tanh_bwd)
