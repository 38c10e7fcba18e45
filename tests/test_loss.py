"""jaxtrain.loss: token_ce's written-out gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import loss


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_ce_matches_optax_value_and_gradient(dtype):
    """token_ce's written-out gradient against autodiff of optax's cross-entropy on the upcast logits."""
    logits = (3 * jax.random.normal(jax.random.key(0), (2, 8, 50))).astype(dtype)
    labels = jax.random.randint(jax.random.key(1), (2, 8), 0, 50)
    weights = jax.random.uniform(jax.random.key(2), (2, 8))
    ours = lambda x: jnp.sum(weights * loss.token_ce(x, labels))
    ref = lambda x: jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels))
    (value, grad), (ref_value, ref_grad) = jax.value_and_grad(ours)(logits), jax.value_and_grad(ref)(logits)
    assert grad.dtype == dtype
    assert float(value) == pytest.approx(float(ref_value), rel=1e-6)  # the same fp32 ops in the same order
    # Entries of softmax - one_hot are in [-1, 1]: fp32 differs by a few roundings (1e-6); bf16 rounds each once,
    # so the two agree to one bf16 ulp at 1 (2^-7) where the fp32 values straddle a rounding boundary.
    atol = 1e-6 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), atol=atol, rtol=0)


def test_token_ce_gradient_has_no_scatter():
    """The point of writing the gradient out: no scatter of the one-hot into a copy of B x T x V."""
    logits, labels = jnp.zeros((2, 8, 50), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    hlo = jax.jit(jax.grad(lambda x: loss.token_ce(x, labels).sum())).lower(logits).as_text()
    assert "scatter" not in hlo
    assert "scatter" in jax.jit(jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), labels).sum())).lower(logits).as_text()  # what autodiff of optax's emits

