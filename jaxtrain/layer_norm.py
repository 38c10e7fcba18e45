"""LayerNorm as torch computes it, in fp32, with its backward written out where that serves XLA:CPU.

    y = layer_norm(x, w, b)   # (x - mean) / sqrt(var + eps) * w + b over the last axis; b None for none

The math is torch.nn.LayerNorm's: fp32 whatever the input (as autocast runs it), the biased variance taken in two
passes, eps 1e-5. On a GPU the blocks' LayerNorms run as fused_norm.py's kernels and this is the rest (ln_f, and
model.norm=xla); there, and on a TPU, the backward is XLA's autodiff of the forward.

On a CPU the backward is written out, torch's formula (and fused_norm's backward kernel's), from the row's mean and
1 / std kept by the forward:

    xhat = (x - mean) rstd,   g = dy w
    dx = rstd (g - mean(g) - xhat mean(g xhat)),   dw = sum over rows of dy xhat,   db = sum over rows of dy

Why: XLA:CPU wrote autodiff's backward of configs/small.yaml's LayerNorms as about ten passes over the rows and
kept more of the forward's intermediates alive; written out, the bf16 step took 0.2 GB less peak memory
(benchmarks/NOTES.md "CPU step 17"). Only the order of the fp32 sums differs from autodiff's.
"""

import jax
import jax.numpy as jnp

from jaxtrain.autocast import backend

LN_EPS = 1e-5  # torch.nn.LayerNorm's default


def layer_norm(x, w, b):
    """LayerNorm(x) in fp32 over the last axis, weight w and bias b (None for none), both fp32."""
    x = x.astype(jnp.float32)
    if backend() == "cpu":
        return _written_backward(x, w, b)
    return _forward(x, w, b)[0]


def _forward(x, w, b):
    """(y, (mean, rstd)): the rows' statistics are what the written backward keeps besides x and w."""
    mean = x.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + LN_EPS)  # biased variance, as torch's
    y = (x - mean) * rstd * w
    return (y if b is None else y + b), (mean, rstd)


@jax.custom_vjp
def _written_backward(x, w, b):
    return _forward(x, w, b)[0]


def _written_backward_fwd(x, w, b):
    y, (mean, rstd) = _forward(x, w, b)
    return y, (x, mean, rstd, w, b)


def _written_backward_bwd(res, dy):
    x, mean, rstd, w, b = res
    xhat, g = (x - mean) * rstd, dy * w
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    rows = tuple(range(x.ndim - 1))
    return dx, (dy * xhat).sum(rows), None if b is None else dy.sum(rows)


_written_backward.defvjp(_written_backward_fwd, _written_backward_bwd)
