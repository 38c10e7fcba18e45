"""jaxtrain.layer_norm: the forward against the float64 formula, the written-out backward (a CPU's) against torch's
LayerNorm in float64 and XLA's autodiff of the same forward, and where it is written out."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtrain import autocast, layer_norm as L
from jaxpr_walk import equations

EPS32 = 2.0 ** -24  # fp32's unit roundoff
ROWS, D = 64, 96


def _inputs(seed=0):
    """x with rows far from zero mean (the two-pass variance's reason), w and b around their init, dy."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, ROWS // 2, D)) * 3 + 1
    return tuple(jnp.asarray(a, jnp.float32) for a in (x, rng.normal(size=D) * 0.1 + 1, rng.normal(size=D) * 0.1,
                                                       rng.normal(size=x.shape)))


def _torch_float64(x, w, b, dy):
    """torch.nn.functional.layer_norm in float64 and autograd: (y, dx, dw, db), db None without b."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    leaf = lambda a: torch.from_numpy(np.asarray(a, np.float64)).requires_grad_(True)
    x_t, w_t, b_t = leaf(x), leaf(w), None if b is None else leaf(b)
    y_t = torch.nn.functional.layer_norm(x_t, (x.shape[-1],), w_t, b_t, eps=1e-5)
    y_t.backward(torch.from_numpy(np.asarray(dy, np.float64)))
    return y_t.detach().numpy(), x_t.grad.numpy(), w_t.grad.numpy(), None if b is None else b_t.grad.numpy()


def _value_and_grads(x, w, b, dy, platform):
    with autocast.compiling_for(platform):  # traced here, run on this CPU either way; a fresh function each time, as
        y, vjp = jax.vjp(jax.jit(lambda *a: L.layer_norm(*a)), x, w, b)  # jax's trace caches do not know the platform
    return (y, *vjp(dy))


@pytest.mark.parametrize("platform", ["cpu", "gpu"])  # written out; autodiff's
@pytest.mark.parametrize("with_bias", [True, False])
def test_value_and_gradients_are_torchs_float64_ones_within_fp32_rounding(platform, with_bias):
    """Each fp32 row or column sum of n terms is within n u of its exact value, relative to the sum of the terms'
    magnitudes (u = 2^-24); the backward composes a few such sums over D = 96 columns (the row means) and 64 rows
    (dw, db), so every entry is within 4 (D + rows) u of torch's float64 value, relative to the largest entry of
    its array. A formula with a term missing (mean(g), or xhat mean(g xhat)) is off by O(1) of it."""
    x, w, b, dy = _inputs()
    b = b if with_bias else None
    got = _value_and_grads(x, w, b, dy, platform)
    want = _torch_float64(x, w, b, dy)
    assert (got[3] is None) == (b is None)
    for name, got_a, want_a in zip(("y", "dx", "dw", "db"), got, want):
        if want_a is not None:
            assert got_a.dtype == jnp.float32 and got_a.shape == want_a.shape, name
            error = np.max(np.abs(np.asarray(got_a, np.float64) - want_a)) / np.max(np.abs(want_a))
            assert error <= 4 * (D + ROWS) * EPS32, (name, error)


def test_written_backward_is_autodiffs_within_fp32_rounding():
    """The CPU's written-out backward against XLA's autodiff of the same fp32 forward (the GPU's trace): two orders
    of the same fp32 sums, each within (D + rows) u of the exact value relative to the largest entry (as above),
    so within twice that of each other."""
    x, w, b, dy = _inputs(seed=1)
    written, autodiff = (_value_and_grads(x, w, b, dy, platform) for platform in ("cpu", "gpu"))
    np.testing.assert_array_equal(written[0], autodiff[0])  # one forward
    for name, a, c in zip(("dx", "dw", "db"), written[1:], autodiff[1:]):
        error = np.max(np.abs(np.asarray(a, np.float64) - np.asarray(c, np.float64))) / np.max(np.abs(c))
        assert error <= 2 * 4 * (D + ROWS) * EPS32, (name, error)


def test_a_bf16_input_gets_a_bf16_gradient():
    """The input upcast to fp32 inside (autocast's LayerNorm): its gradient comes back in the input's dtype, the
    fp32 one rounded once."""
    x, w, b, dy = _inputs(seed=2)
    x16 = x.astype(jnp.bfloat16)
    with autocast.compiling_for("cpu"):
        y, vjp = jax.vjp(lambda *a: L.layer_norm(*a), x16, w, b)
        dx16 = vjp(dy)[0]
        dx32 = jax.vjp(lambda *a: L.layer_norm(*a), x16.astype(jnp.float32), w, b)[1](dy)[0]
    assert y.dtype == jnp.float32 and dx16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(dx16, dx32.astype(jnp.bfloat16))


@pytest.mark.parametrize("platform,written", [("cpu", True), ("gpu", False), ("tpu", False)])
def test_the_backward_is_written_out_on_a_cpu_only(platform, written):
    """The written-out backward is measured on a CPU (benchmarks/NOTES.md "CPU step 17"); a GPU's and a TPU's
    programs keep XLA's autodiff, as measured there."""
    x, w, b, _ = _inputs()
    with autocast.compiling_for(platform):
        names = [eqn.primitive.name for eqn in equations(lambda *a: L.layer_norm(*a), x, w, b)]
    assert any(name.startswith("custom_vjp") for name in names) == written, names
