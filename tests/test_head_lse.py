"""jaxtrain.head_lse: the head gemm with the loss's logsumexp in its epilogue, run here through Mosaic GPU's
interpreter (no GPU), on a GPU as it compiles; against the product and the logsumexp written out in float64, the
loss with model.head_lse=pallas against model.head_lse=xla, and where the kernel is refused."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxtrain import autocast, config, head_lse, hopper_gemm, model, step
from jaxtrain.errors import UserError
from jaxtrain.mesh import one_device_mesh
from hopper_testing import ON_GPU_ONLY, runs_here, value_and_grad_as_the_step


def _float64_lse(logits):
    x = np.asarray(logits, np.float64)
    top = x.max(axis=1)
    return top + np.log(np.exp(x - top[:, None]).sum(axis=1))


def _lse_bound(vocab: int, lse):
    """fp32's bound for the kernel's logsumexp of given logits: its sum of `vocab` positive terms in any order is
    within vocab - 1 roundings relative, each term's exp within 1, and each of the at most 3 rescalings of a
    partial sum to a larger max (2 in a warpgroup's 3 tiles of 64 columns, 1 in the combine) within 2 (an exp and a
    product): vocab + 6 relative, which the log turns absolute; the max's subtraction and the log's own result
    within a rounding of |lse| each."""
    return (vocab + 6) * 2.0**-24 + 2 * 2.0**-24 * np.abs(lse)


@runs_here
@pytest.mark.parametrize("m,k,n,tiles,low", [
    (128, 128, 256, hopper_gemm.Tiles(m=64, n=64, k=64, stages=2), ml_dtypes.bfloat16),
    (128, 128, 768, head_lse.HEAD_TILES, ml_dtypes.bfloat16),
    (128, 256, 768, head_lse.HEAD_TILES, np.float16),
    (192, 64, 384, head_lse.HEAD_TILES, ml_dtypes.bfloat16),
    pytest.param(4096, 768, 50304, head_lse.HEAD_TILES, ml_dtypes.bfloat16, marks=ON_GPU_ONLY)])
def test_the_kernel_writes_the_rounded_product_and_its_logsumexp(m, k, n, tiles, low):
    """Small-integer operands, so that the fp32 product is exact in any sum order: the logits are it rounded once to
    the compute dtype, every element; the logsumexp is of those rounded logits (of the unrounded product it would
    be up to half a spacing of the largest logit off: several units here). Several output tiles along m and n, two
    epilogue tiles each way (the slots alternating); with HEAD_TILES two CTAs of 384 columns, three tiles of 64 a
    warpgroup's row (the online rescaling), four k steps through two stages in fp16, and rows that are not 128s
    (tiles shrunk to 64); on a GPU GPT-2's head for 4096 tokens, 32 x 131 output tiles over the SMs."""
    rng = np.random.default_rng(0)
    x = rng.integers(-8, 9, (m, k)).astype(low)
    w = rng.integers(-8, 9, (k, n)).astype(low)
    want_logits = (x.astype(np.float64) @ w.astype(np.float64)).astype(low)
    logits, lse = jax.jit(head_lse.logits_and_lse, static_argnums=2)(x, w, tiles)
    assert np.array_equal(np.asarray(logits).view(np.uint16), want_logits.view(np.uint16))
    want_lse = _float64_lse(want_logits)
    assert np.all(np.abs(np.asarray(lse, np.float64) - want_lse) <= _lse_bound(n, want_lse))


@runs_here
@pytest.mark.parametrize("m,k,n", [(128, 128, 768), pytest.param(4096, 768, 50304, marks=ON_GPU_ONLY)])
def test_the_logsumexp_of_logits_spread_as_gpt2s(m, k, n):
    """Logits of std ~3, as a trained head's: the logsumexp of the logits the kernel wrote (their values checked
    above) against float64's; on a GPU at GPT-2's size, where every row's sums meet from 262 column blocks."""
    keys = jax.random.split(jax.random.key(1), 2)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (3 / k**0.5 * jax.random.normal(keys[1], (k, n), jnp.float32)).astype(jnp.bfloat16)
    logits, lse = jax.jit(head_lse.logits_and_lse)(x, w)
    want = _float64_lse(np.asarray(logits))
    assert np.all(np.abs(np.asarray(lse, np.float64) - want) <= _lse_bound(n, want))


@pytest.mark.parametrize("m,k,n,want", [
    (16384, 768, 50304, head_lse.HEAD_TILES),  # GPT-2's head, a micro-batch of 16 x 1024 on one GPU
    (16384, 768, 32768, hopper_gemm.Tiles(m=128, n=128, stages=2)),  # 256s but not 384s
    (128, 128, 640, hopper_gemm.Tiles(m=128, n=64, stages=2)), (128, 128, 192, None)])
def test_the_heads_tiles_shrink_to_what_divides_its_vocabulary(m, k, n, want):
    assert hopper_gemm.tiles_for(m, k, n, head_lse.HEAD_TILES) == want


def _loss_and_grads(lse: str, precision: str, mesh=None):
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.n_layer=2", f"--model.head_lse={lse}",
                       f"--train.precision={precision}"]).model
    graphdef, params = model.init_params(cfg, vocab_size=256, precision=precision, seed=0)
    idx = jax.random.randint(jax.random.key(0), (2, 64), 0, 256)
    # Three padding targets a row, counted nowhere; not at the first row's end, where the halves of the logits'
    # gradient meet (head_lse._ce_grad_over_logits): a padding target's gradient is 0, whatever the halves do
    targets = jnp.roll(idx, -1, axis=1).at[:, 10:13].set(-1)

    def loss(params):
        return step.model_ce_sum(graphdef, params, idx, targets, lse_in_head=lse == "pallas") / 122
    return value_and_grad_as_the_step(loss, params, mesh)


@functools.cache
def _without_kernel(precision: str):
    """The reference, model.head_lse=xla: once a process for each precision, which the mesh's test shares with the
    loss's test (arrays, never changed)."""
    return _loss_and_grads("xla", precision)


def _assert_same_loss(got, want, precision: str):
    """The logits are the same either way (the same gemm's rounding; on this CPU the same dot); each token's
    logsumexp is summed in another order, within _lse_bound of the other, and so is their mean (its 128 terms
    summed in another order: 128 roundings more). The gradients go through the same backward from those logits
    and logsumexps; where a token's logsumexp differs in its last bit, a probability's difference may round to the
    compute dtype otherwise, and that flip spreads through the backward: measured on this CPU, the largest relative
    difference of a gradient 0 (bf16: no flip, asserted here) and 6.3e-4 (fp16, ln_1's weight of the first block),
    margin 5x; on a GPU, against loss.logsumexp's one-pass reduction there, not yet measured."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(float(loss - ref_loss)) <= _lse_bound(256, float(ref_loss)) + 128 * 2.0**-24 * abs(float(ref_loss))
    exact = jax.default_backend() == "cpu" and precision == "bf16"
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        assert float(jnp.linalg.norm(g[...] - r[...]) / jnp.linalg.norm(r[...])) <= (0.0 if exact else 3e-3), path


@runs_here
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_loss_with_the_kernel_is_the_loss_without(precision):
    _assert_same_loss(_loss_and_grads("pallas", precision), _without_kernel(precision), precision)


@runs_here
def test_the_kernel_runs_inside_a_one_device_mesh():
    _assert_same_loss(_loss_and_grads("pallas", "bf16", one_device_mesh()), _without_kernel("bf16"), "bf16")


@pytest.mark.parametrize("overrides,named", [
    (["--train.precision=fp32"], "under train.precision=fp32 use model.head_lse=xla"),
    (["--model.vocab_size=300"], r"model.vocab_size to be a multiple of 128 \(its kernel's tiles\), got 300"),
    (["--model.d_model=96", "--model.n_head=4"], r"model.d_model to be a multiple of 64 .*got 96"),
    (["--model.vocab_tiles=2"], r"model.vocab_tiles=2 never forms; use one of the two"),
    (["--run.dry_run=true", "--run.target_device=a100-80gb"],
     r"a kernel for Hopper GPUs \(h100, h200\), not run.target_device=a100")])
def test_a_config_the_kernel_cannot_run_is_refused(overrides, named):
    with pytest.raises(UserError, match=named):
        config.load(["--config", "configs/tiny.yaml", "--model.head_lse=pallas", *overrides])


@runs_here
@pytest.mark.parametrize("rows,vocab,named", [(96, 256, r"tokens of a micro-batch \(here 96\)"),
                                              (128, 320, r"the vocabulary \(here 320\) of 128")])
def test_shapes_the_kernel_cannot_tile_are_refused_when_traced(rows, vocab, named):
    """Each device's tokens (the config checks the micro-batch's: a mesh splits it), and a vocabulary the data gave
    (model.vocab_size null)."""
    x, w = jnp.ones((rows, 128), jnp.bfloat16), jnp.ones((128, vocab), jnp.bfloat16)
    with pytest.raises(UserError, match=named):
        head_lse.logits_and_lse(x, w)


def test_a_tpu_is_refused():
    with autocast.compiling_for("tpu"), pytest.raises(UserError, match="head_lse=pallas is a kernel for Hopper"):
        head_lse.logits_and_lse(jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 256), jnp.bfloat16))
