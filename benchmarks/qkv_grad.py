"""c_attn's input gradient from q's, k's and v's gradients (jaxtrain/qkv_grad.py) alone, against XLA's kernels for
the same math, on GPT-2 124M's shapes: each one's time, and the gemm alone as what the concatenation adds to.

    python -m benchmarks.qkv_grad [--rows 16384] [--d 768] [--tiles 128x128x2x8x32,...] [--iters 50]

A tile setting is the kernel's m x n (one consumer warpgroup's output tile; the CTA's is m x 2n), pipeline stages,
planar-snake width and k (hopper_gemm.Tiles). Inputs as in the step: the three gradients (rows, d) and the weight
blocks' transposes (d, d) in bf16; the kernel writes its result as the step on a GPU has it write it, at c_attn's
input's width (d and a tile of 64 zero columns for its ones columns: qkv_grad.summed_matmul's `width`). Each
kernel's result is compared with XLA's (elements equal, and elements further than a rounding: two fp32 sums of 3d
products in other orders, each rounded once; a nonzero padding element counts as one further), so a setting that
is fast and wrong shows, and fails the command (exit 1) as a setting Mosaic GPU refuses does. Off a GPU the kernel
runs in Mosaic GPU's interpreter: very slow, for a few rows only.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gelu_gemm import kernel_cli, kernel_table
from benchmarks.head_lse import abs_product, products_beyond_rounding
from benchmarks.norm_kernels import timed
from jaxtrain import autocast, hopper_gemm, qkv_grad
from jaxtrain.errors import exit_on_user_error

LOW = jnp.bfloat16
TILE = hopper_gemm.EPILOGUE_TILE  # the ones columns of c_attn's input on a GPU (model.CausalSelfAttention.ones_width)


def xla_dx(gq, gk, gv, wq_t, wk_t, wv_t):
    """c_attn's dx as the step writes it under model.qkv_grad=xla: one gemm on the gradients concatenated."""
    return gemm_alone(jnp.concatenate([gq, gk, gv], -1), jnp.concatenate([wq_t, wk_t, wv_t], 0))


def gemm_alone(g, w_t):
    """The dx gemm on gradients already side by side, its fp32 sums rounded once to bf16."""
    return autocast.rounded_matmul(g, w_t, "bf16")


def inputs(rows: int, d: int):
    keys = jax.random.split(jax.random.key(0), 6)
    gs = [jax.random.normal(key, (rows, d), jnp.float32).astype(LOW) for key in keys[:3]]
    return gs + [(0.02 * jax.random.normal(key, (d, d), jnp.float32)).astype(LOW) for key in keys[3:]]


def check(got, want, scale, d: int) -> tuple[str, bool]:
    """A kernel's row's cells (elements equal to XLA's %, beyond a rounding of it: sums of 3d products, `scale`
    their |g| @ |w|; and its padding columns not zero) and whether it is wrong."""
    got, padding = got[:, :d], np.asarray(got[:, d:])
    beyond = products_beyond_rounding(got, want, scale, 3 * d) + int(np.count_nonzero(padding))
    return f"{100 * float(np.mean(np.asarray(got) == np.asarray(want))):.3f} | {beyond}", beyond > 0


def table(rows: int, d: int, settings, iters: int) -> tuple[str, list[str]]:
    args = inputs(rows, d)
    options = autocast.rounding_options(jax.default_backend())  # as the step compiles
    flops = 2 * rows * 3 * d * d
    xla = jax.jit(xla_dx, compiler_options=options)
    want = xla(*args)
    scale = jax.jit(lambda *a: abs_product(jnp.concatenate(a[:3], -1), jnp.concatenate(a[3:], 0)))(*args)
    side_by_side = (jnp.concatenate(args[:3], -1), jnp.concatenate(args[3:], 0))
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; dq, dk, dv ({rows}, {d}) each @ their weight "
             f"blocks' transposes ({d}, {d}), summed, bf16; best of 3 runs of {iters} calls", "",
             "| what | us | TFLOP/s of the gemm | elements equal to XLA's % | elements beyond a rounding of it |",
             "|---|---|---|---|---|"]
    rate = lambda s: f"{s * 1e6:,.0f} | {flops / s / 1e12:,.0f}"
    alone = timed(jax.jit(gemm_alone, compiler_options=options), side_by_side, iters)
    lines.append(f"| the gemm alone, its input already side by side (XLA) | {rate(alone)} | - | - |")
    lines.append(f"| XLA: the concatenation, then the gemm | {rate(timed(xla, args, iters))} | 100.000 | 0 |")
    kernel = lambda tiles: lambda *a: qkv_grad.summed_matmul(list(a[:3]), list(a[3:]), tiles, d + TILE)
    return kernel_table(lines, settings, kernel, args, iters, rate, lambda got: check(got, want, scale, d))


parser, main = kernel_cli("python -m benchmarks.qkv_grad", __doc__, "the model's width (c_attn's input)",
                          "128x128x2x8x32,128x128x2x4x32,128x128x2x16x32,128x64x2x8,64x128x2x8x32", 50, table,
                          small="--rows 128 --d 128")

if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
