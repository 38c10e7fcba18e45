"""The head gemm with the loss's logsumexp in its epilogue (jaxtrain/head_lse.py) alone, against XLA's kernels for
the same math, on GPT-2 124M's shapes: each one's time, and the head gemm alone as what the epilogue may add to.

    python -m benchmarks.head_lse [--rows 16384] [--d 768] [--vocab 50304] [--tiles 128x192x2x8,...] [--iters 20]

A tile setting is the kernel's m x n (one consumer warpgroup's output tile; the CTA's is m x 2n), pipeline stages
and planar-snake width (hopper_gemm.Tiles). Inputs as in the step: the final hidden states x (rows, d) and the head
weight (d, vocab) in bf16, scaled so that the logits spread as a trained GPT-2's (std ~3). Each kernel's logits
are compared with XLA's (equal, and further than a rounding), its logsumexp with loss.logsumexp of its own logits
(the largest difference, and rows further than fp32's bound), so a setting that is fast and wrong shows, and fails
the command (exit 1) as a setting Mosaic GPU refuses does. Off a GPU the kernel runs in Mosaic GPU's interpreter:
very slow, for a few rows only.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gelu_gemm import kernel_parser, kernel_table, parse_tiles, report
from benchmarks.norm_kernels import timed, warn_off_a_gpu
from jaxtrain import autocast, head_lse, loss
from jaxtrain.cmdline import positive_int
from jaxtrain.errors import exit_on_user_error

LOW = jnp.bfloat16


def xla_logits_and_lse(x, w):
    """The step's head and logsumexp as XLA writes them: the gemm rounded to bf16, then loss.logsumexp's pass."""
    logits = head_alone(x, w)
    return logits, loss.logsumexp(logits.astype(jnp.float32))


def head_alone(x, w):
    return autocast.rounded_matmul(x, w, "bf16")


def beyond_rounding(got, want_logits, abs_product, d: int) -> tuple[int, int, float]:
    """(logits further than a rounding of XLA's, rows whose logsumexp is further than fp32's bound from XLA's
    logsumexp of the same logits, the largest such difference). Two fp32 sums of d products in different orders lie
    within 2 d 2^-24 of |x| @ |w| of each other (a logit near 0 by cancellation: more than its own spacing), each
    then rounded to bf16 (a spacing more); two sums of vocab exps within (vocab + 4) 2^-24 relative, and the
    logsumexp's max and log within 2 roundings of |lse| (tests/test_head_lse.py)."""
    logits, lse = got
    want_lse = np.asarray(jax.jit(lambda v: loss.logsumexp(v.astype(jnp.float32)))(logits), np.float64)
    logits, lse, want_logits = (np.asarray(t, np.float64) for t in (logits, lse, want_logits))
    far_logits = products_beyond_rounding(logits, want_logits, abs_product, d)
    bound = (logits.shape[1] + 4 + 2 * np.abs(want_lse)) * 2.0**-24
    return far_logits, int(np.sum(np.abs(lse - want_lse) > bound)), float(np.max(np.abs(lse - want_lse)))


def products_beyond_rounding(got, want, abs_product, k: int) -> int:
    """How many elements of `got` lie further from `want` than two fp32 sums of k products in different orders
    may (2 k 2^-24 of |x| @ |w|), each then rounded to bf16 (a spacing more). Also benchmarks.qkv_grad's."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    spacing = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 7)
    return int(np.sum(np.abs(got - want) > spacing + 2 * k * 2.0**-24 * np.asarray(abs_product)))


def abs_product(x, w):
    """|x| @ |w| in fp32 at full precision (no TF32 passes): the scale of each logit's rounding error."""
    return jnp.matmul(jnp.abs(x).astype(jnp.float32), jnp.abs(w).astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def inputs(rows: int, d: int, vocab: int):
    keys = jax.random.split(jax.random.key(0), 2)
    return (jax.random.normal(keys[0], (rows, d), jnp.float32).astype(LOW),
            (3 / d**0.5 * jax.random.normal(keys[1], (d, vocab), jnp.float32)).astype(LOW))


def table(rows: int, d: int, vocab: int, settings, iters: int) -> tuple[str, list[str]]:
    args = inputs(rows, d, vocab)
    options = autocast.rounding_options(jax.default_backend())  # as the step compiles
    flops = 2 * rows * d * vocab
    xla = jax.jit(xla_logits_and_lse, compiler_options=options)
    want, scale = xla(*args), jax.jit(abs_product)(*args)
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; x ({rows}, {d}) @ w ({d}, {vocab}) rounded to "
             f"bf16, and each row's fp32 logsumexp; best of 3 runs of {iters} calls", "",
             "| what | us | TFLOP/s of the gemm | logits equal to XLA's % | logits beyond a rounding | "
             "logsumexp: largest difference from XLA's of these logits, rows beyond fp32's bound |",
             "|---|---|---|---|---|---|"]
    rate = lambda s: f"{s * 1e6:,.0f} | {flops / s / 1e12:,.0f}"
    gemm = timed(jax.jit(head_alone, compiler_options=options), args, iters)
    lines.append(f"| the head gemm alone (XLA) | {rate(gemm)} | - | - | - |")
    lines.append(f"| XLA: the gemm, then loss.logsumexp | {rate(timed(xla, args, iters))} | 100.000 | 0 | 0, 0 |")
    return kernel_table(lines, settings, lambda tiles: lambda x, w: head_lse.logits_and_lse(x, w, tiles), args,
                        iters, rate, lambda got: check(got, want[0], scale, d))


def check(got, want_logits, abs_product, d: int) -> tuple[str, bool]:
    """A kernel's row's cells (logits equal to XLA's, beyond a rounding; the logsumexp's largest difference, rows
    beyond fp32's bound) and whether it is wrong."""
    far_logits, far_rows, largest = beyond_rounding(got, want_logits, abs_product, d)
    equal = 100 * float(jnp.mean(got[0] == want_logits))
    return f"{equal:.3f} | {far_logits} | {largest:.2e}, {far_rows}", bool(far_logits or far_rows)


def parser() -> argparse.ArgumentParser:
    ap = kernel_parser("python -m benchmarks.head_lse", __doc__, "the model's width (the head's k)",
                       "128x192x2x8,128x192x2x16,128x192x2x4,64x192x3x8,128x64x4x8", 20)
    ap.add_argument("--vocab", type=positive_int, default=50304, help="the padded vocabulary (the head's n)")
    return ap


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    warn_off_a_gpu(f"{args.rows} rows of {args.d} and a vocabulary of {args.vocab}", "--rows 128 --d 64 --vocab 768")
    report(*table(args.rows, args.d, args.vocab, parse_tiles(args.tiles), args.iters))

if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
