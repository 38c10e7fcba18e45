"""What tests/test_gelu_gemm.py and tests/test_head_lse.py share: when a hopper_gemm kernel runs here, and the
2-layer model's loss and gradients compiled as the train step compiles them."""

import jax
import pytest

from jaxtrain import autocast, hopper_gemm

# The kernels run on a Hopper GPU, or off a GPU in Mosaic GPU's interpreter, which jax 0.9's cannot run them in (the
# floors' jax)
runs_here = pytest.mark.skipif(not hopper_gemm.on_hopper_or_off_gpu() or (
    jax.default_backend() != "gpu" and not hopper_gemm.interpreter_available()),
    reason="no Hopper GPU, and no Mosaic GPU interpreter in this jax that runs the kernels")

ON_GPU_ONLY = pytest.mark.skipif(jax.default_backend() != "gpu", reason="no GPU: the interpreter runs one program "
                                 "(a GPU's 132 SMs each loop over several tiles), slowly: minutes at this size")


def value_and_grad_as_the_step(loss, params, mesh=None):
    """loss's value and gradient at params, jitted with the step's compiler options, inside `mesh` where given."""
    grad = jax.jit(jax.value_and_grad(loss), compiler_options=autocast.rounding_options(jax.default_backend()))
    if mesh is None:
        return grad(params)
    with jax.set_mesh(mesh):
        return grad(params)
