"""Cross-entropy from the head's logits: per token, with its gradient written out (`token_ce`)."""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def token_ce(logits_BxTxV: jax.Array, labels_BxT: jax.Array) -> jax.Array:
    """Per-token cross-entropy in fp32, logsumexp(logits) - logits[label], from logits of any float dtype.

    What optax.softmax_cross_entropy_with_integer_labels computes, with the gradient written out: softmax - one_hot
    in fp32, rounded once to the logits' dtype, in one elementwise pass. Autodiff's version scatters the one-hot
    into an fp32 copy of B x T x V and casts it in further passes: on GPT-2 124M (an H100, bf16) 20 ms of a 180 ms
    step went to those passes over the logits (benchmarks/NOTES.md)."""
    return _token_ce_fwd(logits_BxTxV, labels_BxT)[0]


def _token_ce_fwd(logits_BxTxV, labels_BxT):
    logits_f32 = logits_BxTxV.astype(jnp.float32)
    lse_BxT = jax.nn.logsumexp(logits_f32, axis=-1)
    picked_BxT = jnp.take_along_axis(logits_f32, labels_BxT[..., None], axis=-1)[..., 0]
    return lse_BxT - picked_BxT, (logits_BxTxV, labels_BxT, lse_BxT)


def _token_ce_bwd(residuals, g_BxT):
    logits_BxTxV, labels_BxT, lse_BxT = residuals
    probs = jnp.exp(logits_BxTxV.astype(jnp.float32) - lse_BxT[..., None])
    vocab_axis = logits_BxTxV.ndim - 1  # 1 for a tile's (tokens, V)
    one_hot = jax.lax.broadcasted_iota(labels_BxT.dtype, logits_BxTxV.shape, vocab_axis) == labels_BxT[..., None]
    return ((probs - one_hot) * g_BxT[..., None]).astype(logits_BxTxV.dtype), None


token_ce.defvjp(_token_ce_fwd, _token_ce_bwd)
