"""jaxtrain.gelu_gemm: c_proj's dx gemm with GELU's backward in its epilogue, run here through Mosaic GPU's
interpreter (no GPU), on a GPU as it compiles; against GELU's gradient written out in float64, the model with
model.gelu_grad=pallas against model.gelu_grad=xla, and where the kernel is refused."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxtrain import autocast, config, gelu_gemm, hopper_gemm
from jaxtrain.errors import UserError
from hopper_testing import (MODEL_CASES, ON_GPU_ONLY, assert_kernel_keeps_the_model,
                            assert_refused_on_two_cpu_devices, runs_here)
from test_fused_norm import _ulp_bf16


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


@pytest.mark.parametrize("m,k,n,want", [
    (16384, 768, 3072, hopper_gemm.Tiles()),  # GPT-2 124M's c_proj, a micro-batch of 16 x 1024 on one GPU
    (128, 128, 512, hopper_gemm.Tiles()),
    (192, 64, 384, hopper_gemm.Tiles(m=64, n=64)),  # 192 rows are not 128s; 384 columns not 256s
    (96, 64, 256, None), (128, 96, 256, None), (128, 64, 192, None)])
def test_the_tiles_shrink_to_what_divides_the_gemm(m, k, n, want):
    assert hopper_gemm.tiles_for(m, k, n) == want


# The forward pass is the same code either way. The gradients differ where the kernel's fp32 sum order for c_proj's
# dx flips its rounding to the compute dtype (d_model 128: two k steps): measured on this CPU, the largest relative
# difference of a gradient 5.8e-5 (bf16) and 2.9e-4 (fp16), margin 10x; on a GPU, against cuBLAS's order, not yet
# measured.
GRAD_RTOL = 3e-3


@runs_here
@pytest.mark.parametrize("precision,remat,in_mesh", MODEL_CASES)
def test_the_model_with_the_kernel_is_the_model_without(precision, remat, in_mesh):
    assert_kernel_keeps_the_model("model.gelu_grad", precision, remat, in_mesh, GRAD_RTOL)


@pytest.mark.parametrize("overrides,named", [
    (["--train.precision=fp32"], "under train.precision=fp32 use model.gelu_grad=xla"),
    (["--model.d_model=96", "--model.n_head=4"],
     r"model.d_model to be a multiple of 64 \(its kernel's tiles\), got 96"),
    (["--data.batch_size=1", "--model.seq_len=100"], r"a micro-batch's tokens .* to be a multiple of 64 .*got 100"),
    (["--run.target_device=a100-80gb"], "a kernel for Hopper GPUs \\(h100, h200\\), not run.target_device=a100")])
def test_a_config_the_kernel_cannot_run_is_refused(overrides, named):
    with pytest.raises(UserError, match=named):
        config.load(["--config", "configs/tiny.yaml", "--model.gelu_grad=pallas", *overrides])


def _kernel_grad(rows: int):
    pre = jnp.ones((rows, 256), jnp.bfloat16)
    w = jnp.ones((256, 64), jnp.float32)
    return jax.grad(lambda p: gelu_gemm.gelu_linear(p, w, None, "bf16").astype(jnp.float32).sum())(pre)


@runs_here
def test_rows_the_kernel_cannot_tile_are_refused_when_traced():
    """Each device's tokens (the config checks the micro-batch's: a mesh splits it)."""
    with pytest.raises(UserError, match=r"tokens of a micro-batch .* here 96\) to be a multiple of 64"):
        _kernel_grad(96)


def test_a_tpu_is_refused():
    with autocast.compiling_for("tpu"), pytest.raises(UserError, match="a kernel for Hopper GPUs"):
        _kernel_grad(128)


def test_several_devices_off_a_gpu_are_refused():
    assert_refused_on_two_cpu_devices(lambda: _kernel_grad(128))
