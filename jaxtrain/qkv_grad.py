"""c_attn's input gradient as one hand-written Hopper kernel over q's, k's and v's gradients where they lie (Pallas,
Mosaic GPU), where model.qkv_grad=pallas picks it.

    q, k, v = column_blocks(x, w, b, precision, 3)   # autocast.column_blocks; its backward's dx one kernel

Why: cuDNN's attention takes q, k and v as three arrays (so c_attn writes them as three gemms, autocast.column_blocks)
and gives their gradients back as three; c_attn's input gradient is one gemm over all three (one rounding, as
torch's one linear), for which XLA concatenates them first: a copy of the B x T x 3D gradients (151 MB a layer and
micro-batch on GPT-2 124M, written and read back), 2.15 ms of 2026-11-28's 139.5 ms H100 profile, at its roofline
(benchmarks/NOTES.md). Here each k step of the kernel brings a tile of each gradient and of its weight block
(hopper_gemm's pairs), whose three wgmmas add into one fp32 accumulator, rounded once: the concatenation goes, the
gemm's bytes stay. The weight and bias gradients are each block's own (XLA's gemms, x^T g_i:
autocast.block_weight_grads). An estimate, not measured on a GPU yet, which is why it is not the default:
benchmarks/device_check.py's stages measure it.

Numerics: dx is the three products' fp32 sum rounded once to the compute dtype, its k order interleaved by blocks
(one gemm's order is its kernel's own either way); each weight gradient is the whole linear's column block by the
same rule (a gemm over the rows), its fp32 order the kernel's for that width.
"""

import functools

import jax
import jax.numpy as jnp

from jaxtrain import autocast, hopper_gemm, mesh
from jaxtrain.errors import UserError
from jaxtrain.hopper_gemm import EPILOGUE_TILE, Tiles, tiles_for

OPTION = "model.qkv_grad=pallas"
# A k step brings three (A, B) pairs of tiles: 3 x (128 x 32 + 32 x 256) bf16, 72 KiB a stage; with two stages and
# the epilogue's slots ~176 KiB of an H100's 227 (at k = 64, 327,712 bytes; three stages at k = 32, 254,000: both
# refused by Mosaic GPU ahead of time). No spills (benchmarks.kernel_registers).
QKV_TILES = Tiles(m=128, n=128, k=32, stages=2)


def _epilogue(acc_ref, at: hopper_gemm.OutputTile, ins, outs, scratch):
    """The accumulator rounded once to the compute dtype, written out a tile at a time through shared memory."""
    (out_gmem,) = outs
    y = acc_ref[...].astype(out_gmem.dtype)  # rounded once, as cuBLAS rounds a gemm's output
    for tile in hopper_gemm.epilogue_tiles(at.tiles):
        hopper_gemm.store_tile(y, tile, at, scratch["smem"].at[at.wg, tile.slot], out_gmem)


def summed_matmul(gs: list, w_ts: list, tiles: Tiles = QKV_TILES, width: int | None = None):
    """sum_i gs[i] @ w_ts[i], each (m, k) @ (k, n) in one compute dtype, accumulated in fp32 and rounded once; one
    kernel, each device on its own rows under a mesh. With `width` > n the result has width - n zero columns more:
    the gradient of c_attn's input where it carries the bias row's ones columns (a whole TMA tile of them), set in
    the kernel's buffer in place, where a pad after it would copy the whole gradient (0.72 ms of GPT-2 124M's
    roofline, benchmarks/NOTES.md)."""
    if len({t.dtype for t in gs + w_ts}) != 1:
        raise TypeError(f"summed_matmul takes its operands in one compute dtype, got {[t.dtype for t in gs + w_ts]}")
    n = w_ts[0].shape[1]
    hopper_gemm.check_device(OPTION)
    rows = gs[0].shape[0] // mesh.batch_shards()
    fitted = tiles_for(rows, w_ts[0].shape[0], n, tiles)
    if fitted is None:
        raise UserError(f"{OPTION} needs each device's tokens of a micro-batch (data.batch_size / "
                        f"optim.grad_accum_steps x model.seq_len / devices: here {rows}) to be a multiple of "
                        f"{EPILOGUE_TILE} and model.d_model (here {n}) of {2 * EPILOGUE_TILE}; use "
                        f"model.qkv_grad=xla")
    width = n if width is None else width
    if width < n or width % EPILOGUE_TILE:  # Mosaic GPU's TMA stores rows of whole tiles only
        raise ValueError(f"summed_matmul writes rows of {n} or more columns in tiles of {EPILOGUE_TILE}, not {width}")
    call = hopper_gemm.gemm_with_epilogue(OPTION, _epilogue, {"smem": hopper_gemm.epilogue_smem(gs[0].dtype, fitted)},
                                          jax.ShapeDtypeStruct((rows, width), gs[0].dtype), fitted, 0,
                                          pairs=len(gs))
    on_rows = mesh.on_each_devices_rows(lambda *operands: (call(*operands),), len(gs), len(w_ts), 1)
    out = on_rows(*gs, *w_ts)[0]
    return out if width == n else out.at[:, n:].set(0)  # the columns the kernel's tiles leave unwritten


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def column_blocks(x, w, b, precision: str, parts: int):
    """autocast.column_blocks(x, w, b, precision, parts), whose input gradient is summed_matmul's one kernel over the
    blocks' gradients instead of one gemm on their concatenation. Under bf16 or fp16."""
    return autocast.column_blocks(x, w, b, precision, parts)


def _column_blocks_fwd(x, w, b, precision, parts):
    return column_blocks(x, w, b, precision, parts), (x, w, b)


def _column_blocks_bwd(precision, parts, saved, g_blocks):
    x, w, b = saved
    low = autocast.COMPUTE_DTYPES[precision]
    rows = lambda t: t.reshape(-1, t.shape[-1])  # the batch split stays on the rows
    w_blocks = jnp.split(w, parts, -1)
    # each w_i^T an array of its own (an XLA transpose of the bf16 block), as gelu_gemm's w^T; x may carry the bias
    # row's ones columns (fused_norm writes a tile of them, model.CausalSelfAttention): their gradient, which
    # nothing reads, zeros
    g_x = summed_matmul([rows(g.astype(low)) for g in g_blocks], [wi.astype(low).T for wi in w_blocks],
                        width=x.shape[-1])
    g_x = g_x.reshape(x.shape).astype(x.dtype)
    return (g_x, *autocast.block_weight_grads(x, w, b, g_blocks, precision))


column_blocks.defvjp(_column_blocks_fwd, _column_blocks_bwd)
