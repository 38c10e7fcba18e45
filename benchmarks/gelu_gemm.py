"""c_proj's dx gemm with GELU's backward in its epilogue (jaxtrain/gelu_gemm.py) alone, against XLA's two kernels for
the same math, on GPT-2 124M's shapes: each one's time, and the gemm alone as what the epilogue may add to.

    python -m benchmarks.gelu_gemm [--rows 16384] [--d 768] [--tiles 128x128x4x8,128x64x4x8] [--iters 50]

A tile setting is the kernel's m x n (one consumer warpgroup's output tile; the CTA's is m x 2n), pipeline stages
and planar-snake width (hopper_gemm.Tiles). Inputs as in the step: the output's gradient g (rows, d) and w^T (d, 4d)
in bf16, pre (rows, 4d) in bf16 spread as GPT-2's c_fc outputs are. Each kernel's result is compared with XLA's
(elements equal, and elements further than a rounding: SPACINGS_APART), so a setting that is fast and wrong
shows, and fails the command (exit 1) as a setting Mosaic GPU refuses does. The forward pass does not change: only
this part of the backward. Off a GPU the kernel runs in Mosaic GPU's interpreter: very slow, for a few rows only.
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.norm_kernels import timed, warn_off_a_gpu
from jaxtrain import autocast, gelu_gemm, hopper_gemm
from jaxtrain.cmdline import positive_int
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error

LOW = jnp.bfloat16
# A kernel further from XLA's result than this is wrong, not rounded otherwise: dh's sum order may flip its rounding
# (a spacing of dh, up to 1.13 of the result through gelu'), the result's own rounding another spacing; below
# x = -3 the fp32 formula cancels (tests/test_gelu_gemm.py), where another erf or exp (the kernel's libdevice or
# MLIR one against XLA's) may differ by a few fp32 roundings of terms near 1 + |x|: 2^-20 (1 + |x|) |dh|
SPACINGS_APART = 3


def beyond_rounding(got, want, pre, dh) -> int:
    """How many elements of the kernel's result `got` lie further from XLA's `want` than SPACINGS_APART bf16
    spacings and the formula's error allow."""
    got, want, pre, dh = (np.asarray(t, np.float64) for t in (got, want, pre, dh))
    spacing = 2.0 ** (np.floor(np.log2(np.abs(want) + 1e-30)) - 7)
    return int(np.sum(np.abs(got - want) > SPACINGS_APART * spacing + 2.0**-20 * (1 + np.abs(pre)) * np.abs(dh)))


def xla_gelu_grad(g, w_t, pre):
    """model.MLP's backward as XLA writes it: the dx gemm rounded to bf16, then GELU's backward, two kernels."""
    return autocast.gelu_grad(pre, gemm_alone(g, w_t, pre))


def gemm_alone(g, w_t, pre):
    """The dx gemm, its fp32 sums rounded once to bf16 (on a GPU by the gemm: autocast.rounded_matmul)."""
    return autocast.rounded_matmul(g, w_t, "bf16")


def parse_tiles(text: str) -> list[hopper_gemm.Tiles]:
    """'128x128x4x8,128x128x2x8x32' -> Tiles (m, n, stages, snake[, k]: 64 where not given), m and n multiples of
    64 where a tile is."""
    try:
        fields = [[int(f) for f in t.split("x")] for t in text.split(",")]
        tiles = [hopper_gemm.Tiles(m=m, n=n, stages=s, snake=w, k=k[0] if k else 64) for m, n, s, w, *k in fields
                 if len(k) <= 1]
        tiles = tiles if len(tiles) == len(fields) else []
    except ValueError:
        tiles = []
    if not tiles or any(t.m % 64 or t.n % 64 or t.k % 32 or t.stages < 1 or t.snake < 1 for t in tiles):
        raise UserError(f"--tiles {text!r}: give m x n x stages x snake [x k], m and n multiples of 64, k of 32, "
                        f"comma-separated, e.g. --tiles 128x128x4x8")
    return tiles


def inputs(rows: int, d: int):
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (rows, d), jnp.float32).astype(LOW),
            (0.02 * jax.random.normal(keys[1], (d, 4 * d), jnp.float32)).astype(LOW),
            jax.random.normal(keys[2], (rows, 4 * d), jnp.float32).astype(LOW))


def table(rows: int, d: int, settings: list[hopper_gemm.Tiles], iters: int) -> str:
    args = inputs(rows, d)
    options = autocast.rounding_options(jax.default_backend())  # as the step compiles
    flops = 2 * rows * d * 4 * d
    want = jax.jit(xla_gelu_grad, compiler_options=options)(*args)
    dh = jax.jit(gemm_alone, compiler_options=options)(*args)
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; g ({rows}, {d}) @ w^T ({d}, {4 * d}), then "
             f"GELU's backward with pre ({rows}, {4 * d}), bf16; best of 3 runs of {iters} calls", "",
             "| what | us | TFLOP/s of the gemm | elements equal to XLA's % | elements beyond a rounding of it |",
             "|---|---|---|---|---|"]
    rate = lambda s: f"{s * 1e6:,.0f} | {flops / s / 1e12:,.0f}"
    lines.append(f"| the gemm alone (XLA) | {rate(timed(jax.jit(gemm_alone, compiler_options=options), args, iters))}"
                 f" | - | - |")
    xla = jax.jit(xla_gelu_grad, compiler_options=options)
    lines.append(f"| XLA: the gemm, then GELU's backward | {rate(timed(xla, args, iters))} | 100.000 | 0 |")
    return kernel_table(
        lines, settings, lambda tiles: lambda g, w_t, pre: gelu_gemm.gelu_grad_matmul(g, w_t, pre, tiles), args,
        iters, rate, lambda got: check(got, want, args[2], dh))


def check(got, want, pre, dh) -> tuple[str, bool]:
    """A kernel's row's cells (elements equal to XLA's %, beyond a rounding of it) and whether it is wrong."""
    beyond = beyond_rounding(got, want, pre, dh)
    return f"{100 * float(jnp.mean(got == want)):.3f} | {beyond}", beyond > 0


def kernel_table(lines: list[str], settings, kernel_for, args, iters: int, rate, check) -> tuple[str, list[str]]:
    """`lines` (the table's head and XLA's rows), then a row per tile setting: the jitted kernel_for(tiles)'s time
    (`rate`) and check(its result) -> (the row's other cells, whether it is wrong); a setting Mosaic GPU refuses
    (shared memory, registers) is a row saying so. The table, and the names of the settings refused or wrong. Also
    the other kernels' benchmarks'."""
    lines, failed = list(lines), []
    for tiles in settings:
        k = "" if tiles.k == 64 else f", k {tiles.k}"
        name = f"kernel {tiles.m}x{tiles.n}{k}, {tiles.stages} stages, snake {tiles.snake}"
        kernel = jax.jit(kernel_for(tiles))
        try:
            seconds, got = timed(kernel, args, iters), kernel(*args)
        except UserError:
            raise
        except Exception as e:
            lines.append(f"| {name} | refused: {str(e).splitlines()[0][:120]} |")
            failed.append(name)
            continue
        cells, wrong = check(got)
        lines.append(f"| {name} | {rate(seconds)} | {cells} |")
        if wrong:
            failed.append(name)
    return "\n".join(lines), failed


def kernel_parser(prog: str, doc: str, d_help: str, tiles: str, iters: int) -> argparse.ArgumentParser:
    """The flags both kernels' benchmarks take: one GPU's rows, the model's width, tile settings, calls timed."""
    ap = OneLineParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--rows", type=positive_int, default=16384,
                    help="tokens of a micro-batch on one GPU (16 x 1024: the profile's batch 64 in 4)")
    ap.add_argument("--d", type=positive_int, default=768, help=d_help)
    ap.add_argument("--tiles", default=tiles,
                    help="kernel settings m x n x stages x snake, comma-separated (the first: the kernel's default)")
    ap.add_argument("--iters", type=positive_int, default=iters)
    return ap


def report(text: str, failed: list[str]) -> None:
    """The table; exit 1 naming the settings refused or wrong."""
    print(text)
    if failed:
        print(f"failed: {'; '.join(failed)} (refused, or further from XLA's result than a rounding)", file=sys.stderr)
        sys.exit(1)


def kernel_cli(prog: str, doc: str, d_help: str, tiles: str, iters: int, table, small: str = "--rows 128 --d 64"):
    """(parser, main) of a kernel's benchmark that takes --rows, --d, --tiles and --iters (kernel_parser's): main
    prints its table and exits 1 naming the settings refused or wrong; `small`, sizes the kernel takes that run
    quickly off a GPU. Also benchmarks.qkv_grad's and benchmarks.gelu_fwd's."""
    parser = functools.partial(kernel_parser, prog, doc, d_help, tiles, iters)

    def main(argv: list[str]) -> None:
        args = parser().parse_args(argv)
        warn_off_a_gpu(f"{args.rows} rows of {args.d}", small)
        report(*table(args.rows, args.d, parse_tiles(args.tiles), args.iters))
    return parser, main


parser, main = kernel_cli("python -m benchmarks.gelu_gemm", __doc__, "the model's width (c_proj's output)",
                          "128x128x4x8,128x128x3x8,128x128x4x4,128x128x4x16,128x64x4x8", 50, table)

if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
