"""jaxtrain.gelu_gemm: c_fc's gemm with the bias and GELU in its epilogue, c_proj's dx gemm with GELU's backward in
its, run here through Mosaic GPU's interpreter (no GPU), on a GPU as it compiles; against GELU and its gradient
written out in float64, the model with model.gelu_fwd=pallas and model.gelu_grad=pallas against =xla, and where the
kernels are refused."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxtrain import autocast, config, gelu_gemm, hopper_gemm, model
from jaxtrain.errors import UserError
import compiled_hlo
from hopper_testing import (MODEL_CASES, ON_GPU_ONLY, assert_kernel_keeps_the_model,
                            assert_refused_on_two_cpu_devices, model_loss_and_grads, runs_here)
from test_fused_norm import _ulp_bf16


def _float64_gelu(pre):
    """x Phi(x) at x = pre, in float64: torch's GELU's formula."""
    x = np.asarray(pre, np.float64)
    return x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _float64_gelu_grad(pre, dh):
    """dh (Phi(x) + x phi(x)) at x = pre, in float64: torch's gelu_backward's formula."""
    x = np.asarray(pre, np.float64)
    phi = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    cdf = 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    return np.asarray(dh, np.float64) * (cdf + x * phi)


@runs_here
@pytest.mark.parametrize("m,k,n,tiles", [(128, 128, 256, hopper_gemm.Tiles(m=64, n=64, k=64, stages=2)),
                                         (128, 128, 512, hopper_gemm.Tiles()),
                                         (128, 256, 256, hopper_gemm.Tiles(m=64, n=64, k=64, stages=2)),
                                         pytest.param(4096, 512, 4096, hopper_gemm.Tiles(), marks=ON_GPU_ONLY)])
def test_the_kernel_is_gelus_gradient_of_the_product_rounded_once(m, k, n, tiles):
    """Small-integer operands, so that the fp32 product is exact in any sum order: the kernel's result is the
    product rounded once to bf16, times gelu'(pre) in float64, rounded to bf16 (half a spacing), give or take the
    fp32 formula's own error: below x = -3 its Phi(x) + x phi(x) cancels, so that error is absolute, a few fp32
    roundings of terms near 1 + |x| (2^-22 (1 + |x|) |dh|: 4 of them; autocast.gelu's docstring). The product left
    unrounded would be up to half a spacing of dh further. Several output tiles along m and n, two k steps; with the
    default tiles, two epilogue tiles each way, which alternate their shared-memory slots; four k steps through a
    pipeline of two stages (its buffers reused); on a GPU, 512 output tiles over its SMs (each loops over several,
    reusing its slots and barriers) and 8 k steps through 4 stages. Mosaic GPU's interpreter runs each TMA copy at
    once, so only the GPU's run can show a missing wait."""
    rng = np.random.default_rng(0)
    g = rng.integers(-4, 5, (m, k)).astype(ml_dtypes.bfloat16)
    w_t = rng.integers(-4, 5, (k, n)).astype(ml_dtypes.bfloat16)
    pre = rng.uniform(-6, 6, (m, n)).astype(ml_dtypes.bfloat16)  # erf's tails and its middle
    dh = (g.astype(np.float64) @ w_t.astype(np.float64)).astype(ml_dtypes.bfloat16)  # exact, then rounded once
    want = _float64_gelu_grad(pre, dh)
    got = np.asarray(jax.jit(gelu_gemm.gelu_grad_matmul, static_argnums=3)(g, w_t, pre, tiles), np.float64)
    bound = _ulp_bf16(want) / 2 + 2.0**-22 * (1 + np.abs(pre.astype(np.float64))) * np.abs(dh.astype(np.float64))
    assert np.all(np.abs(got - want) <= bound), np.argwhere(np.abs(got - want) > bound)[:5]


@runs_here
@pytest.mark.parametrize("m,k,n,tiles,bias,pad", [
    (128, 128, 256, hopper_gemm.Tiles(m=64, n=64, k=64, stages=2), True, 64),
    (128, 128, 512, hopper_gemm.Tiles(), True, 0), (128, 128, 512, hopper_gemm.Tiles(), False, 64),
    (128, 256, 256, hopper_gemm.Tiles(m=64, n=64, k=64, stages=2), False, 0),
    pytest.param(4096, 512, 4096, hopper_gemm.Tiles(), True, 64, marks=ON_GPU_ONLY)])
def test_the_forward_kernel_is_gelu_of_the_biased_product_rounded_once(m, k, n, tiles, bias, pad):
    """Small-integer operands, so that the fp32 product is exact in any sum order, and a bf16 bias: pre is that sum
    plus the bias rounded once to fp32 (the epilogue's add) and once to bf16, exactly; h is GELU of pre in float64,
    rounded to bf16 (half a spacing), give or take the fp32 formula's own error: below x = -3 its 1 + erf cancels, so
    that error is absolute, a few fp32 roundings of terms near 1 times |x| (2^-22 (1 + |x|): 4 of them;
    autocast.gelu's docstring). x has 64 columns more than k, large, that the kernel must not read (c_fc's input
    carries its bias row's ones columns, model.MLP.ones_width); h has `pad` columns more, the ones column
    (autocast.with_ones_column).
    Several output tiles along m and n, each with its own columns of the bias; with the default tiles, two epilogue
    tiles each way, pre's and h's alternating their shared-memory slots; on a GPU, 512 output tiles over its SMs."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.integers(-4, 5, (m, k)), np.full((m, 64), 1000)], 1).astype(ml_dtypes.bfloat16)
    w = rng.integers(-4, 5, (k, n)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-3, 3, (n,)).astype(ml_dtypes.bfloat16) if bias else None
    pre, h = jax.jit(gelu_gemm.linear_gelu_matmul, static_argnums=(3, 4))(x, w, b, pad, tiles)
    exact = x[:, :k].astype(np.float64) @ w.astype(np.float64) + (0 if b is None else b.astype(np.float64))
    want_pre = exact.astype(np.float32).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(pre), want_pre)
    want = _float64_gelu(want_pre)
    got = np.asarray(h[:, :n], np.float64)
    bound = _ulp_bf16(want) / 2 + 2.0**-22 * (1 + np.abs(want_pre.astype(np.float64)))
    assert np.all(np.abs(got - want) <= bound), np.argwhere(np.abs(got - want) > bound)[:5]
    assert h.shape == (m, n + pad)
    if pad:
        np.testing.assert_array_equal(h[:, n:], autocast.with_ones_column(jnp.zeros((m, 0)), jnp.bfloat16, pad))


@pytest.mark.parametrize("m,k,n,want", [
    (16384, 768, 3072, hopper_gemm.Tiles()),  # GPT-2 124M's c_proj, a micro-batch of 16 x 1024 on one GPU
    (128, 128, 512, hopper_gemm.Tiles()),
    (192, 64, 384, hopper_gemm.Tiles(m=64, n=64)),  # 192 rows are not 128s; 384 columns not 256s
    (96, 64, 256, None), (128, 96, 256, None), (128, 64, 192, None)])
def test_the_tiles_shrink_to_what_divides_the_gemm(m, k, n, want):
    assert hopper_gemm.tiles_for(m, k, n) == want


# With the backward's kernel the forward pass is the same code either way. The gradients differ where the kernel's
# fp32 sum order for c_proj's dx flips its rounding to the compute dtype (d_model 128: two k steps): measured on this
# CPU, the largest relative difference of a gradient 5.8e-5 (bf16) and 2.9e-4 (fp16), margin 10x; on a GPU, against
# cuBLAS's order, not yet measured.
GRAD_RTOL = 3e-3
# With the forward's kernel, c_fc's sum order flips roundings of pre, and the interpreter's GELU rounds a few values
# in erf's tail otherwise (the forward test's bound), which the loss and every gradient below see: measured on this
# CPU, the loss 9.0e-7 (bf16) and 4.3e-6 (fp16) relative apart, a gradient at most 2.2e-3 and 3.5e-4; margin 10x.
FWD_LOSS_RTOL, FWD_GRAD_RTOL = 5e-5, 2e-2
OFF_GPU_NO_REMAT = "no GPU: the interpreter's host callbacks in the forward kernel cannot be recomputed under remat"


@runs_here
@pytest.mark.parametrize("precision,remat,in_mesh", MODEL_CASES)
@pytest.mark.parametrize("keys", [["model.gelu_grad"], ["model.gelu_fwd"], ["model.gelu_fwd", "model.gelu_grad"]])
def test_the_model_with_the_kernels_is_the_model_without(keys, precision, remat, in_mesh):
    forward = "model.gelu_fwd" in keys
    if forward and remat != "none" and jax.default_backend() != "gpu":
        pytest.skip(OFF_GPU_NO_REMAT)  # refused with one line: the test below
    assert_kernel_keeps_the_model(keys, precision, remat, in_mesh, FWD_GRAD_RTOL if forward else GRAD_RTOL,
                                  FWD_LOSS_RTOL if forward else 0.0)


@runs_here
def test_remat_dots_keeps_c_fcs_output_beside_the_gradients_kernel():
    """With model.gelu_grad=pallas alone, c_fc stays outside gelu_linear's custom_vjp, where remat's dots policy sees
    its gemm and keeps its output: the gradient's program has c_fc's and c_proj's forward gemms, c_proj's dw, c_fc's
    dw and dx (5: c_proj's dx is the kernel's, off a GPU a host callback), as without remat; full recomputes c_fc
    (6). An MLP that is one custom_vjp with c_fc inside (as model.gelu_fwd=pallas's) recomputes it under dots too."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.gelu_grad=pallas"]).model
    graphdef, state = nnx.split(model.MLP(cfg, precision="bf16", rngs=nnx.Rngs(0)))
    loss = lambda state, x: jnp.sum(nnx.merge(graphdef, state)(x, None).astype(jnp.float32))
    x = jax.random.normal(jax.random.key(0), (1, 64, cfg.d_model))
    policies = {"none": None, **model.REMAT_POLICIES}
    count = {remat: len(compiled_hlo.dot_types(jax.jit(jax.value_and_grad(
        jax.checkpoint(loss, policy=policy) if policy else loss, (0, 1))).lower(state, x).as_text()))
        for remat, policy in policies.items()}
    assert count == {"none": 5, "dots": 5, "full": 6}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU the forward kernel runs under remat")
def test_the_forward_kernel_under_remat_off_a_gpu_is_refused():
    with pytest.raises(UserError, match=r"model.gelu_fwd=pallas off a GPU runs in Mosaic GPU's interpreter, .* "
                                        r"\(model.remat=full\); use model.remat=none here, or model.gelu_fwd=xla"):
        model_loss_and_grads(["--model.gelu_fwd=pallas"], "bf16", remat="full")


@pytest.mark.parametrize("key", ["model.gelu_fwd", "model.gelu_grad"])
@pytest.mark.parametrize("overrides,named", [
    (["--train.precision=fp32"], "under train.precision=fp32 use {key}=xla"),
    (["--model.d_model=96", "--model.n_head=4"],
     r"{key}=pallas needs model.d_model to be a multiple of 64 \(its kernel's tiles\), got 96"),
    (["--data.batch_size=1", "--model.seq_len=100"], r"a micro-batch's tokens .* to be a multiple of 64 .*got 100"),
    (["--run.dry_run=true", "--run.target_device=a100-80gb"],
     "a kernel for Hopper GPUs \\(h100, h200\\), not run.target_device=a100"),
    (["--model.gelu_approximate=tanh"], "{key}=pallas computes the exact GELU, not model.gelu_approximate=tanh; use "
                                        "{key}=xla")])
def test_a_config_the_kernel_cannot_run_is_refused(key, overrides, named):
    with pytest.raises(UserError, match=named.format(key=key)):
        config.load(["--config", "configs/tiny.yaml", f"--{key}=pallas", *overrides])


def _kernel_grad(rows: int, fwd_kernel: bool = False):
    """The gradient through one of gelu_gemm's kernels (the backward's by default) of `rows` tokens."""
    w_fc, w_proj = jnp.ones((64, 256), jnp.float32), jnp.ones((256, 64), jnp.float32)
    if fwd_kernel:
        mlp = lambda x: gelu_gemm.mlp(x, w_fc, None, w_proj, None, "bf16", False)
        return jax.grad(lambda x: mlp(x).astype(jnp.float32).sum())(jnp.ones((rows, 64), jnp.bfloat16))
    gelu_linear = lambda pre: gelu_gemm.gelu_linear(pre, w_proj, None, "bf16")
    return jax.grad(lambda pre: gelu_linear(pre).astype(jnp.float32).sum())(jnp.ones((rows, 256), jnp.bfloat16))


@runs_here
@pytest.mark.parametrize("fwd_kernel,key", [(False, "model.gelu_grad"), (True, "model.gelu_fwd")])
def test_rows_the_kernel_cannot_tile_are_refused_when_traced(fwd_kernel, key):
    """Each device's tokens (the config checks the micro-batch's: a mesh splits it)."""
    with pytest.raises(UserError, match=rf"{key}=pallas needs each device's tokens of a micro-batch .* here 96\) "
                                        r"to be a multiple of 64"):
        _kernel_grad(96, fwd_kernel)


@pytest.mark.parametrize("fwd_kernel", [False, True])
def test_a_tpu_is_refused(fwd_kernel):
    with autocast.compiling_for("tpu"), pytest.raises(UserError, match="a kernel for Hopper GPUs"):
        _kernel_grad(128, fwd_kernel)


@pytest.mark.parametrize("fwd_kernel", [False, True])
def test_several_devices_off_a_gpu_are_refused(fwd_kernel):
    assert_refused_on_two_cpu_devices(lambda: _kernel_grad(128, fwd_kernel))
