"""jaxtrain.hopper_gemm, what its four kernels share beyond their numerics (each kernel's own tests): the lowering
they ask of Mosaic GPU whatever jax's default is, and names a GPU profile puts with the gemms."""

import functools

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks import profile
from jaxtrain import gelu_gemm, head_lse, hopper_gemm, qkv_grad
from hopper_testing import runs_here
from jaxpr_walk import equations

SMALL = hopper_gemm.Tiles(m=64, n=64, k=32, stages=2)
ONES = functools.partial(jnp.ones, dtype=jnp.bfloat16)
KERNELS = {
    "gelu_gemm": lambda: gelu_gemm.gelu_grad_matmul(ONES((128, 128)), ONES((128, 128)), ONES((128, 128)), SMALL),
    "head_lse": lambda: head_lse.logits_and_lse(ONES((128, 128)), ONES((128, 256)), SMALL),
    "qkv_grad": lambda: qkv_grad.summed_matmul([ONES((128, 128))] * 3, [ONES((128, 128))] * 3, SMALL),
    "gelu_fwd": lambda: gelu_gemm.linear_gelu_matmul(ONES((128, 192)), ONES((128, 128)), ONES((128,)), 64, SMALL),
}


@runs_here
@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_lowers_in_lane_semantics_under_jax_011s_default(kernel, monkeypatch):
    """jax 0.11 made Mosaic GPU's Warpgroup lowering the default, which has no layout rule for erf in the jax the
    kernels were written against: each kernel's call names Lane itself. jax 0.11's default made here (the
    CompilerParams that plgpu.CompilerParams() returns there); a GPU lent runs jax 0.11.2."""
    compiler_params = plgpu.CompilerParams
    monkeypatch.setattr(plgpu, "CompilerParams", functools.partial(
        compiler_params, lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
    params = [eqn.params["compiler_params"] for eqn in equations(KERNELS[kernel])
              if isinstance(eqn.params.get("compiler_params"), compiler_params)]
    assert [p.lowering_semantics for p in params] == [plgpu.LoweringSemantics.Lane]


@runs_here
@pytest.mark.parametrize("kernel,name", [("gelu_gemm", "gemm_gelu_grad"), ("head_lse", "gemm_head_lse"),
                                         ("qkv_grad", "gemm_qkv_grad"), ("gelu_fwd", "gemm_gelu_fwd")])
def test_each_kernel_is_named_as_a_gemm(kernel, name):
    """Mosaic GPU names a kernel without a name "anonymous" (its CUDA function anonymous_mosaic_gpu_kernel, which a
    GPU profile put in no category): each kernel is named for its option, and benchmarks.profile's rule for kernel
    names puts the function's name, as ptxas reports it for jax 0.10.2's CUDA plugin, among the matmuls."""
    names = [eqn.params["name"] for eqn in equations(KERNELS[kernel]) if "compiler_params" in eqn.params]
    assert names == [name]
    assert profile.category(f"{name}_mosaic_gpu_kernel") == "matmul"
