"""c_fc's gemm with the bias and GELU in its epilogue (jaxtrain/gelu_gemm.py, model.gelu_fwd=pallas) alone, against
XLA's two kernels for the same math, on GPT-2 124M's shapes: each one's time, and the gemm alone as what the
epilogue may add to.

    python -m benchmarks.gelu_fwd [--rows 16384] [--d 768] [--tiles 128x128x4x8,...] [--iters 50]

A tile setting is the kernel's m x n (one consumer warpgroup's output tile; the CTA's is m x 2n), pipeline stages
and planar-snake width (hopper_gemm.Tiles). Inputs as in the step on a GPU: x (rows, d) with the ones columns of
c_fc's bias row as fused_norm writes them (8 for XLA's gemm, which takes the bias as a row; 64 for the kernel, which
reads the first d and adds the bias itself: gelu_gemm.linear_gelu_matmul), w (d, 4d) and the bias in bf16; outputs
pre (rows, 4d) and gelu(pre) with c_proj's ones columns. Each kernel's results are compared with XLA's (pre:
elements equal, and elements further than two fp32 sums of d products in other orders, each rounded once;
gelu(pre), where the two pre agree: further than a rounding and the fp32 formula's error in erf's tail), so a
setting that is fast and wrong shows, and fails the command (exit 1) as a setting Mosaic GPU refuses does. Off a
GPU the kernel runs in Mosaic GPU's interpreter: very slow, for a few rows only.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gelu_gemm import kernel_cli, kernel_table
from benchmarks.head_lse import abs_product, products_beyond_rounding
from benchmarks.norm_kernels import timed
from jaxtrain import autocast, gelu_gemm, hopper_gemm
from jaxtrain.errors import exit_on_user_error

LOW = jnp.bfloat16


def pad() -> int:
    """c_proj's ones column where its bias rides in its gemm (a GPU), as gelu_gemm.mlp asks the kernel for it."""
    return autocast.ones_columns(True, "bf16", hopper_gemm.EPILOGUE_TILE)


def xla_pre_and_h(x, w, b):
    """c_fc and GELU as the step writes them under model.gelu_fwd=xla: the gemm (on x with the ones column where the
    bias is a row), then GELU with the ones column."""
    pre = gemm_alone(x, w, b)
    h = autocast.gelu(pre)
    return pre, autocast.with_ones_column(h, LOW, pad()) if pad() else h


def gemm_alone(x, w, b):
    """c_fc's gemm, the bias added to its fp32 sums, rounded once to bf16 (on a GPU in the gemm: its bias row)."""
    return autocast.linear(x, w, b, "bf16")


def inputs(rows: int, d: int):
    """(x, w, b) as the kernel takes them and as XLA's gemm does: x with the ones columns fused_norm writes for each
    where the bias is a row (model.MLP.ones_width)."""
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(LOW)
    w = (0.02 * jax.random.normal(keys[1], (d, 4 * d), jnp.float32)).astype(LOW)
    b = (0.02 * jax.random.normal(keys[2], (4 * d,), jnp.float32)).astype(LOW)
    padded = lambda width: autocast.with_ones_column(x, LOW, width) if pad() else x
    return (padded(hopper_gemm.EPILOGUE_TILE), w, b), (padded(autocast.BIAS_ROW_PAD), w, b)


def check(got, want, scale, d: int) -> tuple[str, bool]:
    """A kernel's row's cells (pre's elements equal to XLA's %, pre's elements beyond a rounding of it: sums of d
    products, `scale` their |x| @ |w| + |b|; gelu(pre)'s, where the two pre agree, beyond a rounding and 2^-20
    (1 + |pre|): the fp32 formula's error in erf's tail, each implementation within 2^-22 (1 + |pre|) of float64
    (tests/test_gelu_gemm.py), the kernel's erf on a GPU libdevice's or MLIR's, XLA's its own, margin 2x) and
    whether it is wrong."""
    (pre, h), (want_pre, want_h) = got, want
    pre_beyond = products_beyond_rounding(pre, want_pre, scale, d)
    same = np.asarray(pre) == np.asarray(want_pre)
    p = np.asarray(want_pre, np.float64)
    h, want_h = np.asarray(h[:, :p.shape[1]], np.float64), np.asarray(want_h[:, :p.shape[1]], np.float64)
    spacing = 2.0 ** (np.floor(np.log2(np.abs(want_h) + 1e-30)) - 7)
    h_beyond = int(np.sum(same & (np.abs(h - want_h) > spacing + 2.0**-20 * (1 + np.abs(p)))))
    ones_wrong = int(np.sum(np.asarray(got[1][:, p.shape[1]:]) != np.asarray(want[1][:, p.shape[1]:])))
    return (f"{100 * float(np.mean(same)):.3f} | {pre_beyond} | {h_beyond + ones_wrong}",
            pre_beyond + h_beyond + ones_wrong > 0)


def table(rows: int, d: int, settings, iters: int) -> tuple[str, list[str]]:
    args, xla_args = inputs(rows, d)
    options = autocast.rounding_options(jax.default_backend())  # as the step compiles
    flops = 2 * rows * d * 4 * d
    xla = jax.jit(xla_pre_and_h, compiler_options=options)
    want = xla(*xla_args)
    scale = jax.jit(lambda x, w, b: abs_product(x[:, :d], w) + jnp.abs(b).astype(jnp.float32))(*args)
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; x ({rows}, {d}) @ w ({d}, {4 * d}) + b, then "
             f"GELU, bf16; best of 3 runs of {iters} calls", "",
             "| what | us | TFLOP/s of the gemm | pre's elements equal to XLA's % | pre's elements beyond a rounding "
             "of it | gelu(pre)'s beyond a rounding of it |", "|---|---|---|---|---|---|"]
    rate = lambda s: f"{s * 1e6:,.0f} | {flops / s / 1e12:,.0f}"
    alone = timed(jax.jit(gemm_alone, compiler_options=options), xla_args, iters)
    lines.append(f"| the gemm alone, pre (XLA) | {rate(alone)} | - | - | - |")
    lines.append(f"| XLA: the gemm, then GELU | {rate(timed(xla, xla_args, iters))} | 100.000 | 0 | 0 |")
    kernel = lambda tiles: lambda x, w, b: gelu_gemm.linear_gelu_matmul(x, w, b, pad(), tiles)
    return kernel_table(lines, settings, kernel, args, iters, rate, lambda got: check(got, want, scale, d))


parser, main = kernel_cli("python -m benchmarks.gelu_fwd", __doc__, "the model's width (c_fc's input)",
                          "128x128x4x8,128x128x3x8,128x128x4x4,128x128x4x16,128x64x4x8", 50, table)

if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
