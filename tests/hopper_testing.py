"""What tests/test_gelu_gemm.py, tests/test_head_lse.py and tests/test_qkv_grad.py share: when a hopper_gemm kernel
runs here, and the 2-layer model's loss and gradients compiled as the train step compiles them, with a kernel or
without."""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxtrain import autocast, config, hopper_gemm, mesh as mesh_lib, model
from jaxtrain.errors import UserError

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


def model_loss_and_grads(options: list[str], precision: str, mesh=None, remat: str = "none"):
    """The tiny config's 2-layer model under `options` (e.g. ["--model.qkv_grad=pallas"]): the mean log-probability
    of token 0 over 2 x 64 random tokens, and its gradients, as the step compiles them."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.n_layer=2", *options,
                       f"--train.precision={precision}", f"--model.remat={remat}"]).model
    graphdef, params = model.init_params(cfg, vocab_size=64, precision=precision, seed=0)
    idx = jax.random.randint(jax.random.key(0), (2, 64), 0, 64)

    def loss(params):
        logits = model.apply(graphdef, params, idx).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])
    return value_and_grad_as_the_step(loss, params, mesh)


def assert_same_model(got, want, grad_rtol: float, loss_rtol: float = 0.0) -> None:
    """The same loss (bit for bit on this CPU where the forward pass is the same code, else within `loss_rtol`, the
    caller's measured bound; on a GPU XLA may fuse its reductions otherwise around another backward: the norm
    kernels' bf16 loss bound, tests/test_fused_norm.py, at least), and each gradient within `grad_rtol` relative
    (the caller's measured bound)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    bound = max(loss_rtol, 0.0 if jax.default_backend() == "cpu" else 1e-5)
    assert abs(float(loss - ref_loss)) <= bound * abs(float(ref_loss))
    for (path, g), (_, r) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(ref_grads)):
        assert float(jnp.linalg.norm(g[...] - r[...]) / jnp.linalg.norm(r[...])) <= grad_rtol, path


# (precision, remat, inside a one-device mesh): both compute dtypes; the custom_vjp's residuals recomputed (full) or
# kept (dots); the kernel under shard_map, on each device's rows (on one device, all of them)
MODEL_CASES = [("bf16", "none", False), ("fp16", "none", False), ("bf16", "full", False), ("bf16", "dots", False),
               ("bf16", "none", True)]


def assert_kernel_keeps_the_model(keys: str | list[str], precision: str, remat: str, in_mesh: bool,
                                  grad_rtol: float, loss_rtol: float = 0.0) -> None:
    """The model with each of `keys`=pallas (e.g. model.qkv_grad) against all of them =xla: assert_same_model."""
    keys = (keys,) if isinstance(keys, str) else tuple(keys)
    mesh = mesh_lib.one_device_mesh() if in_mesh else None
    assert_same_model(model_loss_and_grads([f"--{key}=pallas" for key in keys], precision, mesh, remat),
                      _without_kernels(keys, precision), grad_rtol, loss_rtol)


@functools.cache
def _without_kernels(keys: tuple[str, ...], precision: str):
    """The reference, `keys`=xla: once a process for each keys and precision, since it depends on neither remat nor
    the mesh (a kernel's cases in MODEL_CASES share it: the three kernels' files took 298 s on one worker here, 192 s
    with it)."""
    return model_loss_and_grads([f"--{key}=xla" for key in keys], precision)


def assert_refused_on_two_cpu_devices(kernel_call) -> None:
    """Under shard_map over several CPU devices the interpreter's simulated threads wait on each other forever:
    `kernel_call` (a kernel's gradient, traced) is refused with one line instead."""
    two = jax.sharding.AbstractMesh((2, 1), ("data", "fsdp"), axis_types=mesh_lib.AUTO_AXES)
    with autocast.compiling_for("cpu"), jax.sharding.use_abstract_mesh(two), pytest.raises(
            UserError, match="on one device only, not on this mesh"):
        jax.eval_shape(kernel_call)
