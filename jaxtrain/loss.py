"""Cross-entropy: per token from the logits (`token_ce`), and summed from the hidden states a tile at a time.

`tiled_ce_sum` (model.vocab_tiles > 1) never forms the B x T x V logits, the step's largest tensor (GPT-2 124M at
16 x 1024 tokens: 1.6 GB in bf16, plus the loss's fp32 passes over them). The tokens are split into tiles; for each
tile the head's logits are computed and reduced to the loss, and in the backward pass computed again to form the
gradient: MaxText's vocabulary tiling (num_vocab_tiling), Liger's fused linear cross-entropy. It keeps the untiled
path's numerics (model.head_logits, token_ce's gradient, autocast._low_matmul's backward) but for the order in which
the head weight's fp32 gradient sums over the tokens, at the price of the head's forward matmul run twice.
Across several devices each device sums its own tokens' share of the head weight's gradient over the tiles, and
the shares are reduced once after the scan, as the untiled path reduces its one gradient (_by_shard).
"""

import functools

import jax
import jax.numpy as jnp

from jaxtrain import autocast, mesh, model


@jax.custom_vjp
def token_ce(logits_BxTxV: jax.Array, labels_BxT: jax.Array) -> jax.Array:
    """Per-token cross-entropy in fp32, logsumexp(logits) - logits[label], from logits of any float dtype.

    What optax.softmax_cross_entropy_with_integer_labels computes, with the logsumexp in one read of the logits
    (`logsumexp`) and the gradient written out: softmax - one_hot in fp32, rounded once to the logits' dtype, in one
    elementwise pass. Autodiff's version scatters the one-hot into an fp32 copy of B x T x V and casts it in further
    passes: on GPT-2 124M (an H100, bf16) 20 ms of a 180 ms step went to those passes over the logits
    (benchmarks/NOTES.md)."""
    return _token_ce_fwd(logits_BxTxV, labels_BxT)[0]


def _token_ce_fwd(logits_BxTxV, labels_BxT):
    lse_BxT = logsumexp(logits_BxTxV.astype(jnp.float32))
    return ce_given_lse(logits_BxTxV, labels_BxT, lse_BxT), (logits_BxTxV, labels_BxT, lse_BxT)


def ce_given_lse(logits_BxTxV, labels_BxT, lse_BxT):
    """token_ce given each token's logsumexp of the logits: it less the label's logit, in fp32 (also head_lse.py's,
    whose logsumexp a kernel computes)."""
    return lse_BxT - jnp.take_along_axis(logits_BxTxV, labels_BxT[..., None], axis=-1)[..., 0].astype(jnp.float32)


def _token_ce_bwd(residuals, g_BxT):
    return token_ce_grad(*residuals, g_BxT), None


def token_ce_grad(logits_BxTxV, labels_BxT, lse_BxT, g_BxT):
    """The logits' gradient of token_ce given each token's logsumexp of them: (softmax - one_hot) x g in fp32,
    rounded once to the logits' dtype (also head_lse.py's, whose logsumexp a kernel computes)."""
    probs = jnp.exp(logits_BxTxV.astype(jnp.float32) - lse_BxT[..., None])
    vocab_axis = logits_BxTxV.ndim - 1  # 1 for a tile's (tokens, V)
    one_hot = jax.lax.broadcasted_iota(labels_BxT.dtype, logits_BxTxV.shape, vocab_axis) == labels_BxT[..., None]
    return ((probs - one_hot) * g_BxT[..., None]).astype(logits_BxTxV.dtype)


token_ce.defvjp(_token_ce_fwd, _token_ce_bwd)

MAX_CHAIN = 1024  # the longest run of one reduction's combines that logsumexp lets a backend chain, inner or outer


def logsumexp(x_f32: jax.Array) -> jax.Array:
    """log(sum(exp(x))) over the last axis, on a GPU reading x once: a reduction of (max, sum of exp(x - max))
    pairs, each pair rescaled to the larger max as two combine (the online softmax's rule). jax.nn.logsumexp reads x
    twice, for the max and then the sum: on GPT-2 124M (the H100 roofline) 1.98 ms a step for the second read of the
    logits. Not differentiable (a reduction with a computation of its own): token_ce's gradient is written out.

    The axis is reduced in chunks and then over the chunks, each run at most MAX_CHAIN long, so that the rounding
    does not depend on the order a backend combines in: XLA:CPU chains a variadic reduction's combines one after
    another, where a GPU reduces in a tree (50,304 bf16 logits of std 3 on this CPU: 1.7e-4 against float64 in one
    chain, 2.3e-6 in chunks of 786, jax.nn.logsumexp 9.6e-7). An axis with no such split (a prime longer than
    MAX_CHAIN) takes jax.nn.logsumexp, and so does every backend but a GPU: XLA:TPU lays the logits out
    vocabulary-major for a variadic reduction, an fp32 copy of them (configs/pod-fsdp.yaml on 64 v5e, libtpu's
    compile: 5.49 -> 6.26 GiB a device), and XLA:CPU runs it as a scalar loop where its two passes vectorize (8192
    x 256 logits: 3.7 against 0.9 ns a logit)."""
    size = x_f32.shape[-1]
    chunk = max(c for c in range(1, min(size, MAX_CHAIN) + 1) if size % c == 0)
    if autocast.backend() != "gpu" or size // chunk > MAX_CHAIN:
        return jax.nn.logsumexp(x_f32, axis=-1)
    chunked = x_f32.reshape(*x_f32.shape[:-1], size // chunk, chunk)
    max_sum = _reduce_pairs((chunked, jnp.ones_like(chunked)), axis=x_f32.ndim)
    max_, sum_ = _reduce_pairs(max_sum, axis=x_f32.ndim - 1)
    return max_ + jnp.log(sum_)


def _reduce_pairs(max_sum, axis: int):
    return jax.lax.reduce(max_sum, (jnp.float32(-jnp.inf), jnp.float32(0)), _combine_pairs, (axis,))


def _combine_pairs(a, b):
    """(max, sum) pairs into one, the smaller max's sum scaled by exp(its max - the larger): one exp a combine.
    Two empty pairs (-inf, 0), which a reduction's padding combines, give (-inf, 0), not exp(-inf + inf) = nan."""
    (max_a, sum_a), (max_b, sum_b) = a, b
    a_larger = max_a >= max_b
    larger, smaller = jnp.maximum(max_a, max_b), jnp.minimum(max_a, max_b)
    scale = jnp.where(smaller == -jnp.inf, 0.0, jnp.exp(smaller - larger))
    return larger, jnp.where(a_larger, sum_a, sum_b) + jnp.where(a_larger, sum_b, sum_a) * scale


def tiled_ce_sum(x_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array, precision: str,
                 tiles: int) -> jax.Array:
    """Sum of fp32 cross-entropy over the valid targets (>= 0) of the logits model.head_logits(x, w, precision),
    computed `tiles` tiles of tokens at a time; tiles must divide B x T. The gradient reaches x and w."""
    if targets_BxT.size % tiles:
        raise ValueError(f"{tiles} vocabulary tiles do not divide the micro-batch's {targets_BxT.size} tokens")
    valid_N = targets_BxT.reshape(-1) >= 0
    labels_N = jnp.where(valid_N, targets_BxT.reshape(-1), 0)
    return _tiled_ce_sum(x_BxTxD.reshape(-1, x_BxTxD.shape[-1]), w_DxV, labels_N, valid_N, precision, tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled_ce_sum(x_NxD, w_DxV, labels_N, valid_N, precision, tiles):
    return _tiled_ce_sum_fwd(x_NxD, w_DxV, labels_N, valid_N, precision, tiles)[0]


def _tiled_ce_sum_fwd(x_NxD, w_DxV, labels_N, valid_N, precision, tiles):
    """The sum, a lax.scan over the tiles; kept for the backward pass: x, w and each token's logsumexp, not the
    logits."""
    w_low = w_DxV.astype(autocast.COMPUTE_DTYPES[precision])

    def tile(total, tile_inputs):
        x_MxD, labels_M, valid_M = tile_inputs
        ce_M, (_, _, lse_M) = _token_ce_fwd(model.head_logits(x_MxD, w_low, precision), labels_M)
        return total + jnp.sum(jnp.where(valid_M, ce_M, 0.0)), lse_M

    total, lse_KxM = jax.lax.scan(tile, jnp.zeros((), jnp.float32), _tiled((x_NxD, labels_N, valid_N), tiles))
    return total, (x_NxD, w_DxV, labels_N, valid_N, lse_KxM)


def _tiled_ce_sum_bwd(precision, tiles, residuals, g):
    """Per tile, the logits again (the forward's matmul on the same operands), token_ce's gradient of them (fp32,
    rounded once to the compute dtype; times the fp16 loss scale, in g, before that rounding), and the head's
    two gradient dots, as autocast._low_matmul's backward: x's rounded per tile, w's summed in fp32 (over each
    device's tokens of each tile, then over the tiles, then over the devices) and rounded once at the end (under
    fp32, nothing is rounded)."""
    x_NxD, w_DxV, labels_N, valid_N, lse_KxM = residuals
    low = autocast.COMPUTE_DTYPES[precision]
    w_low = w_DxV.astype(low)

    shards = mesh.batch_shards()
    weight_grads = jax.vmap(autocast.shared_weight_grads, in_axes=(0, None, 0))

    def tile(dw_SxDxV, tile_inputs):
        x_MxD, labels_M, valid_M, lse_M = tile_inputs
        x_low = x_MxD.astype(low)
        logits_MxV = model.head_logits(x_low, w_low, precision)
        dlogits_MxV = token_ce_grad(logits_MxV, labels_M, lse_M, jnp.where(valid_M, g, 0.0))
        dx_SxLxD, dw_tile = weight_grads(_by_shard(x_low, shards), w_low, _by_shard(dlogits_MxV, shards))
        return dw_SxDxV + dw_tile, dx_SxLxD.reshape(x_MxD.shape).astype(low)

    dw_SxDxV = mesh.batch_sharded(jnp.zeros((shards, *w_DxV.shape), jnp.float32))
    dw_SxDxV, dx_KxMxD = jax.lax.scan(tile, dw_SxDxV, (*_tiled((x_NxD, labels_N, valid_N), tiles), lse_KxM))
    dx_NxD = jnp.swapaxes(dx_KxMxD, 0, 1).reshape(x_NxD.shape).astype(x_NxD.dtype)
    return dx_NxD, autocast.rounded_weight_grad(jnp.sum(dw_SxDxV, axis=0), low, w_DxV.dtype), None, None


_tiled_ce_sum.defvjp(_tiled_ce_sum_fwd, _tiled_ce_sum_bwd)


def _tiled(arrays_N, tiles: int) -> tuple:
    """Each (N, ...) array as (tiles, N / tiles, ...), tile i holding tokens i, i + tiles, i + 2 tiles, ...: every
    tile spans the whole micro-batch, so it keeps the batch's split over the devices, where a run of consecutive
    tokens would lie on some of them only."""
    return tuple(jnp.swapaxes(a.reshape(-1, tiles, *a.shape[1:]), 0, 1) for a in arrays_N)


def _by_shard(a_MxF, shards: int):
    """A tile's (M, F) rows as (shards, M / shards, F), row block s the rows device s holds, pinned there. The head
    weight's gradient of a tile, summed over each block alone (shards, D, V), stays a partial sum on its device,
    added to that device's running sum in the scan and reduced over the devices once after it. Summed over all the
    rows, it would be reduced over the devices inside the scan, once per tile: the compiled HLO of test_mesh.py's
    8-device FSDP step held two all-reduces of the head's gradient in the scan's body."""
    return mesh.batch_sharded(a_MxF.reshape(shards, -1, a_MxF.shape[-1]))
