"""The head gemm with the loss's logsumexp in its epilogue: one hand-written Hopper kernel (Pallas, Mosaic GPU),
where model.head_lse=pallas picks it.

    ce_BxT = head_token_ce(x_BxTxD, w_DxV, labels_BxT, precision)   # loss.token_ce(model.head_logits(x, w), labels)

Why: XLA writes the logits (B x T x V in the compute dtype, GPT-2 124M's 16 x 1024 tokens: 1.65 GB a micro-batch)
in a cuBLAS gemm, then reads them all back for the loss's logsumexp (loss.logsumexp: one pass, a variadic
reduction), a kernel of its own that on 2026-11-28's H100 profile took 5.11 ms of a 139.5 ms step, 2.6x its
roofline (benchmarks/NOTES.md). Here each consumer warpgroup's accumulator, once rounded to the logits it writes,
is reduced on its way out to each row's (max, sum of exp(logit - max)) over its n columns; the logsumexp is those
pairs combined, a read of V / n pairs a token instead of V logits. The backward pass is the one token_ce has
(loss.token_ce_grad: softmax - one_hot from the logits and the logsumexp, then the head's two gradient gemms),
written over the logits (_ce_grad_over_logits). An estimate, not measured on a GPU yet, which is why it is not
the default: benchmarks/device_check.py's stages measure it.

Numerics: the logits are autocast's (the fp32 accumulator rounded once, as cuBLAS rounds the head's output); the
logsumexp is of those rounded logits in fp32, summed in another order than loss.logsumexp's (within fp32 roundings
of it: tests/test_head_lse.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain import autocast, hopper_gemm, loss, mesh, model
from jaxtrain.errors import UserError
from jaxtrain.hopper_gemm import EPILOGUE_TILE, Tiles, plgpu, tiles_for

OPTION = "model.head_lse=pallas"
# GPT-2's padded vocabulary, 50,304 = 131 x 384 columns (not 256s: 393 x 128): two warpgroups of 128 x 192. Two
# stages of (128 x 64 + 64 x 384) bf16, the logits' two slots a warpgroup and the pairs: 162 KiB; with three, 233,520
# bytes, over an H100's 232,448 (Mosaic GPU's check, compiling ahead of time for an H100 through jax's CUDA plugin)
HEAD_TILES = Tiles(m=128, n=192, stages=2)


def _epilogue(acc_ref, at: hopper_gemm.OutputTile, ins, outs, scratch):
    """The accumulator rounded to the logits, written out a tile at a time through shared memory; each row's max
    and sum of exp(logit - max) over the warpgroup's columns, a tile at a time (the online softmax's rescaling), to
    the pairs' column block. A tile's fp32 copy at a time: at 128 x 192 the fp32 accumulator takes 192 of a
    thread's 232 registers and its bf16 copy 96; an fp32 copy of all of it beside the bf16 one would spill."""
    logits_gmem, pairs_gmem = outs
    logits = acc_ref[...].astype(logits_gmem.dtype)  # rounded once, as cuBLAS rounds the head's output
    pairs = scratch["pairs"].at[at.wg]  # free: hopper_gemm waits for every store before an epilogue
    row_max = row_sum = None  # of the tiles of the current row of tiles so far
    for tile in hopper_gemm.epilogue_tiles(at.tiles):
        hopper_gemm.store_tile(logits, tile, at, scratch["smem"].at[at.wg, tile.slot], logits_gmem)
        x = tile.part(logits).astype(jnp.float32)
        new_max = x.max(axis=1) if tile.first else jnp.maximum(row_max, x.max(axis=1))
        tile_sum = jnp.exp(x - lax.broadcast_in_dim(new_max, x.shape, [0])).sum(axis=1)
        row_sum = tile_sum if tile.first else row_sum * jnp.exp(row_max - new_max) + tile_sum
        row_max = new_max
        if tile.last:
            pairs.at[0, tile.index[0]][...] = row_max
            pairs.at[1, tile.index[0]][...] = row_sum
    plgpu.commit_smem()
    for i in range(2):
        plgpu.copy_smem_to_gmem(pairs.at[i], pairs_gmem.at[i, at.column_block, at.rows])


def combine_pairs(pairs_2xCxN):
    """Each row's logsumexp from its column blocks' (max, sum of exp(x - max)) pairs: the largest max, plus the log
    of the sums each rescaled to it."""
    block_max, block_sum = pairs_2xCxN[0], pairs_2xCxN[1]
    row_max = jnp.max(block_max, axis=0)
    return row_max + jnp.log(jnp.sum(block_sum * jnp.exp(block_max - row_max), axis=0))


def logits_and_lse(x_NxD, w_DxV, tiles: Tiles = HEAD_TILES):
    """(x @ w rounded once to the compute dtype, the fp32 logsumexp of each of its rows): one kernel and a small
    combine, each device on its own rows under a mesh. x and w in one compute dtype, bf16 or fp16."""
    if x_NxD.dtype != w_DxV.dtype:
        raise TypeError(f"logits_and_lse takes x and w in one compute dtype, got {x_NxD.dtype} and {w_DxV.dtype}")
    hopper_gemm.check_device(OPTION)
    (rows, d), vocab = (x_NxD.shape[0] // mesh.batch_shards(), x_NxD.shape[1]), w_DxV.shape[1]
    fitted = tiles_for(rows, d, vocab, tiles)
    if fitted is None:
        raise UserError(f"{OPTION} needs each device's tokens of a micro-batch (here {rows}) and model.d_model "
                        f"(here {d}) to be multiples of {EPILOGUE_TILE} and the vocabulary (here {vocab}) of "
                        f"{2 * EPILOGUE_TILE}; pad the vocabulary (model.vocab_size) or use model.head_lse=xla")
    scratch = {"smem": hopper_gemm.epilogue_smem(x_NxD.dtype, fitted),
               "pairs": plgpu.SMEM((2, 2, fitted.m), jnp.float32)}
    out_types = (jax.ShapeDtypeStruct((rows, vocab), x_NxD.dtype),
                 jax.ShapeDtypeStruct((2, vocab // fitted.n, rows), jnp.float32))
    call = hopper_gemm.gemm_with_epilogue(OPTION, _epilogue, scratch, out_types, fitted, 0)

    def on_rows(x, w):
        logits, pairs = call(x, w)
        return logits, combine_pairs(pairs)
    return mesh.on_each_devices_rows(on_rows, 1, 1, 2)(x_NxD, w_DxV)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def head_token_ce(x_BxTxD, w_DxV, labels_BxT, precision: str):
    """loss.token_ce(model.head_logits(x, w, precision), labels): per-token fp32 cross-entropy from the final
    hidden states, with the logsumexp in the head gemm's epilogue (logits_and_lse). Under bf16 or fp16."""
    return _head_token_ce_fwd(x_BxTxD, w_DxV, labels_BxT, precision)[0]


def _head_token_ce_fwd(x_BxTxD, w_DxV, labels_BxT, precision):
    low = autocast.COMPUTE_DTYPES[precision]
    _, head_vjp = jax.vjp(lambda x, w: model.head_logits(x, w, precision), x_BxTxD, w_DxV)  # its logits unused
    logits_NxV, lse_N = logits_and_lse(x_BxTxD.reshape(-1, x_BxTxD.shape[-1]).astype(low), w_DxV.astype(low))
    labels_N = labels_BxT.reshape(-1)
    ce_N = loss.ce_given_lse(logits_NxV, labels_N, lse_N)
    return ce_N.reshape(labels_BxT.shape), (logits_NxV, labels_N, lse_N, head_vjp)


def _head_token_ce_bwd(precision, saved, g_BxT):
    logits_NxV, labels_N, lse_N, head_vjp = saved
    grad_NxV = _ce_grad_over_logits(logits_NxV, labels_N, lse_N, g_BxT.reshape(-1))
    g_x, g_w = head_vjp(grad_NxV.reshape(*g_BxT.shape, -1))
    return g_x, g_w, None


def _ce_grad_over_logits(logits_NxV, labels_N, lse_N, g_N):
    """loss.token_ce_grad written over the logits, which die there, each device on its rows: each half of them an
    update of the logits in place (a dynamic_update_slice, which XLA runs in the buffer it updates). Written whole,
    the gradient took a buffer of its own (+0.77 GiB at GPT-2's 8192 tokens a micro-batch, the dry run's step
    temporaries): XLA gives an elementwise pass its operand's buffer only where the pass uses the instruction that
    defined it, and the logits are one output of the kernel's two. In the kernel's (N, V) shape: a reshape between
    the two made XLA copy the logits for the update."""
    def on_rows(logits, labels, lse, g):
        cut = logits.shape[0] // 2
        for part in (slice(0, cut), slice(cut, None)):
            logits = logits.at[part].set(loss.token_ce_grad(logits[part], labels[part], lse[part], g[part]))
        return (logits,)
    return mesh.on_each_devices_rows(on_rows, 4, 0, 1)(logits_NxV, labels_N, lse_N, g_N)[0]


head_token_ce.defvjp(_head_token_ce_fwd, _head_token_ce_bwd)
