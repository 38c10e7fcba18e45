"""The residual-add-and-LayerNorm kernels (jaxtrain/fused_norm.py) alone, against XLA's ops for the same math: each
pass's time and the GB/s it moves, for each setting of rows per kernel instance and warps.

    python -m benchmarks.norm_kernels [--tokens 32768] [--d 768] [--rows 4,8,16] [--warps 4,8] [--iters 50]

This says whether the kernels run near the memory bandwidth, measured here as a read and a write of the same fp32 rows
(`ceiling`), and which setting of rows per instance and warps to keep (fused_norm.MAX_ROWS, NUM_WARPS: the fastest on
an H100, 2026-11-27, where the kernels ran at 94% of that ceiling forward and 79% backward). A pass's bytes are what
its kernels must read and write once (pass_bytes), so XLA's row and the kernels' are rated on the same work. Inputs as
in a GPT-2 block on a GPU: fp32 residual stream, bf16 branch output, LayerNorm bias, the output padded with the bias
row's column. Off a GPU the kernels run through Pallas's interpreter: slow, for the tests only.
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp

from jaxtrain import autocast, fused_norm
from jaxtrain.cmdline import positive_int
from jaxtrain.errors import OneLineParser, UserError, exit_on_user_error
from jaxtrain.layer_norm import layer_norm

LOW = jnp.bfloat16


def pass_bytes(n: int, d: int) -> tuple[int, int]:
    """(forward, backward) bytes of one block's residual add and LayerNorm over n rows of d, bias row padded.
    Forward: reads x (fp32) and delta (bf16), writes x + delta (fp32), h (bf16, d + pad) and each row's mean and
    1/std (fp32). Backward: reads h's gradient (bf16, d + pad), the residual stream's gradient and x + delta (fp32),
    the mean and 1/std; writes x's gradient (fp32) and delta's (bf16). The weights and their partial sums: d-sized."""
    padded = d + autocast.BIAS_ROW_PAD
    forward = n * (4 * d + 2 * d + 4 * d + 2 * padded + 8)
    backward = n * (2 * padded + 4 * d + 4 * d + 8 + 4 * d + 2 * d)
    return forward, backward


def xla_residual_norm(x, delta, w, b):
    """model.Block's XLA path, as the next Linear receives it: x + delta, LayerNorm in fp32, bf16 with the ones
    column (autocast.biased_matmul pads its input so)."""
    x = x + delta.astype(jnp.float32)
    return x, autocast.with_ones_column(layer_norm(x, w, b), LOW)


def kernel_residual_norm(x, delta, w, b):
    return fused_norm._residual_norm(x, delta, w, b, LOW, autocast.BIAS_ROW_PAD)


def warn_off_a_gpu(shape: str, small: str) -> None:
    """One line where there is no GPU: the kernels then run in Pallas's interpreter, where GPT-2's shapes take many
    minutes before the table prints (a README walk killed two such runs at 300 s, silent)."""
    if jax.default_backend() != "gpu":
        print(f"warning: no GPU ({jax.default_backend()}): the kernels run in Pallas's interpreter, and {shape} take "
              f"many minutes here; {small} --iters 1 checks that it runs", file=sys.stderr, flush=True)


def timed(fn, args, iters: int) -> float:
    """Seconds a call of `fn(*args)`: after one that compiles, `iters` calls queued back to back (the device never
    waits for the host's dispatch) and waited for, the best of three such runs."""
    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(iters)])
        runs.append((time.perf_counter() - t0) / iters)
    return min(runs)


def measure(residual_norm, inputs, cotangents, iters: int) -> tuple[float, float]:
    """(forward s, backward s): the backward timed alone, from the forward's saved values (jax.vjp's closure).
    New functions, traced afresh: fused_norm's settings are read when the kernels are traced, which jax's jit
    cache (by function) does not know."""
    forward = jax.jit(lambda *a: residual_norm(*a))
    _, backward_fn = jax.vjp(residual_norm, *inputs)
    backward = jax.jit(lambda fn, g: fn(g))
    return timed(forward, inputs, iters), timed(backward, (backward_fn, cotangents), iters)


def parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m benchmarks.norm_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, default=32768,
                    help="rows: the sequences x length of one micro-batch (the README's GPT-2 table: 32 x 1024)")
    ap.add_argument("--d", type=positive_int, default=768, help="the model's width")
    ap.add_argument("--rows", default="4,8,16", help="fused_norm.MAX_ROWS settings, comma-separated")
    ap.add_argument("--warps", default="4,8", help="fused_norm.NUM_WARPS settings, comma-separated")
    ap.add_argument("--iters", type=positive_int, default=50)
    return ap


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    warn_off_a_gpu(f"{args.tokens} rows of {args.d}", "--tokens 64 --d 96")
    print(table(args.tokens, args.d, settings(args.rows, args.warps), args.iters))


def settings(rows: str, warps: str) -> list[tuple[int, int]]:
    """--rows 4,8 --warps 4,8 -> every pair; each a power of two (Triton's blocks and warps are)."""
    try:
        pairs = [(int(r), int(w)) for r in rows.split(",") for w in warps.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(v < 1 or v & (v - 1) for pair in pairs for v in pair):
        raise UserError(f"--rows {rows!r} --warps {warps!r}: give powers of two, comma-separated, e.g. --rows 4,8")
    return pairs


def table(n: int, d: int, settings: list[tuple[int, int]], iters: int) -> str:
    keys = jax.random.split(jax.random.key(0), 4)
    inputs = (jax.random.normal(keys[0], (n, d), jnp.float32), jax.random.normal(keys[1], (n, d), LOW),
              1 + jax.random.normal(keys[2], (d,), jnp.float32), jax.random.normal(keys[3], (d,), jnp.float32))
    cotangents = (jnp.ones((n, d), jnp.float32), jnp.ones((n, d + autocast.BIAS_ROW_PAD), LOW))
    copy_s = timed(jax.jit(lambda x: x * 2), inputs[:1], iters)  # one fp32 read and write of every row
    forward_bytes, backward_bytes = pass_bytes(n, d)
    rate = lambda nbytes, s: f"{s * 1e6:,.0f} | {nbytes / s / 1e9:,.0f}"
    lines = [f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {n} rows of {d}; ceiling (x * 2, fp32): "
             f"{8 * n * d / copy_s / 1e9:,.0f} GB/s; best of 3 runs of {iters} calls", "",
             "| residual add + LayerNorm | forward us | GB/s | backward us | GB/s |", "|---|---|---|---|---|"]
    fwd, bwd = measure(xla_residual_norm, inputs, cotangents, iters)
    lines.append(f"| XLA's ops | {rate(forward_bytes, fwd)} | {rate(backward_bytes, bwd)} |")
    default = (fused_norm.MAX_ROWS, fused_norm.NUM_WARPS)
    try:
        for rows, warps in settings:
            fused_norm.MAX_ROWS, fused_norm.NUM_WARPS = rows, warps  # read when the kernels are traced
            fwd, bwd = measure(kernel_residual_norm, inputs, cotangents, iters)
            mark = " (fused_norm's)" if (rows, warps) == default else ""
            lines.append(f"| kernels, {rows} rows, {warps} warps{mark} | {rate(forward_bytes, fwd)} | "
                         f"{rate(backward_bytes, bwd)} |")
    finally:
        fused_norm.MAX_ROWS, fused_norm.NUM_WARPS = default
    return "\n".join(lines)


if __name__ == "__main__":
    with exit_on_user_error():
        main(sys.argv[1:])
