"""jaxtrain.hopper_gemm, what its three kernels share beyond their numerics (each kernel's own tests): the lowering
they ask of Mosaic GPU whatever jax's default is."""

import functools

import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtrain import gelu_gemm, head_lse, hopper_gemm, qkv_grad
from hopper_testing import runs_here
from jaxpr_walk import equations

SMALL = hopper_gemm.Tiles(m=64, n=64, k=32, stages=2)
ONES = functools.partial(jnp.ones, dtype=jnp.bfloat16)
KERNELS = {
    "gelu_gemm": lambda: gelu_gemm.gelu_grad_matmul(ONES((128, 128)), ONES((128, 128)), ONES((128, 128)), SMALL),
    "head_lse": lambda: head_lse.logits_and_lse(ONES((128, 128)), ONES((128, 256)), SMALL),
    "qkv_grad": lambda: qkv_grad.summed_matmul([ONES((128, 128))] * 3, [ONES((128, 128))] * 3, SMALL),
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
