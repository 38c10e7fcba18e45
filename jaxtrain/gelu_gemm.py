"""The MLP's c_proj backward gemm with GELU's backward in its epilogue: one hand-written Hopper kernel (Pallas,
Mosaic GPU), where model.gelu_grad=pallas picks it.

    y = gelu_linear(pre, w, b, precision)   # linear(gelu(pre), w, b); its backward: pre's gradient in one kernel

Why: XLA writes c_proj's input gradient dh = g w^T (bf16) in a cuBLAS gemm and GELU's backward as a pass of its own
that reads dh back with pre and writes pre's gradient: on GPT-2 124M's H100 step 5.79 ms of 139.5 of GPU time
(benchmarks/NOTES.md, 2026-11-28), and XLA fuses no gemm epilogue that reads a second full-size operand. Here each
output tile of the gemm is multiplied by gelu'(pre) on its way out, and dh is never written: the roofline's saving is
the write and the read of dh, 2 x 2 bytes a (B, T, 4D) element, about 2.9 ms of that step (an estimate; not measured
on a GPU yet, which is why it is not the default: benchmarks/device_check.py's stages measure it).

Numerics: autocast's, as model.MLP's XLA path: the fp32 accumulator rounded once to the compute dtype (as cuBLAS
rounds c_proj's dx), then GELU's backward in fp32 from that and pre, rounded once (autocast.gelu_grad, traced into
the epilogue). The gemm's fp32 sum order is the kernel's (k tiles of 64 in order), as a cuBLAS kernel's is its own.

The kernel is jax's Hopper matmul (jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu) with this epilogue:
persistent over the SMs, a TMA producer warpgroup feeding two wgmma consumer warpgroups side by side along n, the
epilogue in 64 x 64 tiles through shared memory, where pre's tile comes in by TMA and the gradient's goes out. Off a
GPU it runs in Mosaic GPU's interpreter (slow: for checking, tests/test_gelu_gemm.py).
"""

import dataclasses
import functools
import importlib.util
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtrain import autocast, mesh
from jaxtrain.config_checks import GELU_GEMM_TILE as EPILOGUE_TILE  # a tile's rows, columns and k are multiples
from jaxtrain.errors import UserError

HOPPER = "9.0"  # wgmma and TMA: the compute capability the kernel is written for
# plgpu.kernel's name for the output's shape and dtype: out_shape until jax 0.10, which deprecated it for out_type
OUT_TYPE = "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"
SMS_UNKNOWN = 132  # an H100 SXM's and an H200's SMs: the persistent grid when compiling ahead of time


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A consumer warpgroup's output tile (m x n; the two side by side make the CTA's m x 2n), the k step, the
    pipeline's depth and the width of the planar snake the persistent loop walks the output tiles in. The default
    is jax's example's shape; 4 stages of (128 x 64 + 64 x 256) bf16 and the epilogue's buffers fill 224 KiB of an
    H100's 227 KiB of shared memory."""
    m: int = 128
    n: int = 128
    k: int = 64
    stages: int = 4
    snake: int = 8


def tiles_for(m: int, k: int, n: int, base: Tiles = Tiles()) -> Tiles | None:
    """`base` shrunk to (m, k) @ (k, n) where it does not divide it (a small model, a test); None where no tiling
    of EPILOGUE_TILE multiples does."""
    if m % EPILOGUE_TILE or k % EPILOGUE_TILE or n % (2 * EPILOGUE_TILE):
        return None
    return dataclasses.replace(base, m=base.m if m % base.m == 0 else EPILOGUE_TILE,
                               n=base.n if n % (2 * base.n) == 0 else EPILOGUE_TILE,
                               k=base.k if k % base.k == 0 else EPILOGUE_TILE)


def _kernel(g_gmem, w_gmem, pre_gmem, out_gmem, t: Tiles):
    """jax's hopper_matmul_mgpu.kernel with this file's epilogue, lowered in Mosaic GPU's Lane semantics, not its
    Warpgroup one as jax's: the Warpgroup lowering of jax 0.10.2 has no layout rule for erf (GELU's gradient)."""
    m, k = g_gmem.shape
    n = w_gmem.shape[1]
    low = g_gmem.dtype
    swizzled = lambda cols: (plgpu.TilingTransform((8, plgpu.find_swizzle(cols * low.itemsize * 8) // low.itemsize)),
                             plgpu.SwizzleTransform(plgpu.find_swizzle(cols * low.itemsize * 8)))
    in_transforms, epi_transforms = swizzled(t.k), swizzled(EPILOGUE_TILE)
    cta_n = 2 * t.n  # the two consumer warpgroups side by side
    m_tiles, n_tiles = m // t.m, n // cta_n
    slots = min(2, (t.m // EPILOGUE_TILE) * (t.n // EPILOGUE_TILE))

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma, grid=(k // t.k,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((t.m, t.k), lambda i: (0, i), transforms=in_transforms),
                      plgpu.BlockSpec((t.k, cta_n), lambda i: (i, 0), transforms=in_transforms)])

    nothing = lambda *_, **__: None  # the allocations do not depend on the bodies
    epi_shape = (2, slots, EPILOGUE_TILE, EPILOGUE_TILE)

    @functools.partial(pl.run_scoped, allocations=pipeline(nothing, nothing).get_allocations(g_gmem, w_gmem),
                       epi_smem=plgpu.SMEM(epi_shape, low, transforms=epi_transforms),
                       pre_arrived=plgpu.Barrier(num_barriers=2 * slots), collective_axes="wg")
    def _scope(allocations, epi_smem, pre_arrived):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _output_tile(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1, t.snake)
            rows, cols = pl.ds(mi * t.m, t.m), pl.ds(ni * cta_n + wg * t.n, t.n)

            def context(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.m, t.n), jnp.float32))
                def _epilogue(acc_ref):
                    run_pipeline(acc_ref)
                    dh = acc_ref[...].astype(low)  # the gemm's result, rounded once as cuBLAS rounds it
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for i in range(t.m // EPILOGUE_TILE):
                        for j in range(t.n // EPILOGUE_TILE):
                            _epilogue_tile(dh, pre_gmem.at[rows, cols], out_gmem.at[rows, cols], i, j,
                                           epi_smem.at[wg, (i * (t.n // EPILOGUE_TILE) + j) % 2],
                                           pre_arrived.at[wg * slots + (i * (t.n // EPILOGUE_TILE) + j) % 2])

            def mma(_, g_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, g_smem, w_smem.at[:, pl.ds(wg * t.n, t.n)])
                plgpu.wgmma_wait(0)
                return acc_ref

            pipeline(mma, context)(g_gmem.at[rows, :], w_gmem.at[:, pl.ds(ni * cta_n, cta_n)],
                                   allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _epilogue_tile(dh, pre_gmem, out_gmem, i: int, j: int, smem, arrived):
    """Tile (i, j) of the warpgroup's output: pre's tile in by TMA, gelu_grad(pre, dh) out through the same
    shared-memory slot (waiting first until that slot's previous store has been read)."""
    tile = (pl.ds(i * EPILOGUE_TILE, EPILOGUE_TILE), pl.ds(j * EPILOGUE_TILE, EPILOGUE_TILE))
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    plgpu.copy_gmem_to_smem(pre_gmem.at[tile], smem, arrived)
    plgpu.barrier_wait(arrived)
    smem[...] = autocast.gelu_grad(smem[...], dh[i * EPILOGUE_TILE:(i + 1) * EPILOGUE_TILE,
                                                 j * EPILOGUE_TILE:(j + 1) * EPILOGUE_TILE])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, out_gmem.at[tile])


def gelu_grad_matmul(g, w_t, pre, tiles: Tiles = Tiles()):
    """autocast.gelu_grad(pre, g @ w_t): (m, k) @ (k, n) in the compute dtype, accumulated in fp32 and rounded once,
    then GELU's backward with pre (m, n); one kernel, each device on its own rows under a mesh."""
    if not g.dtype == w_t.dtype == pre.dtype:
        raise TypeError(f"gelu_grad_matmul takes g, w_t and pre in one compute dtype, got {g.dtype}, {w_t.dtype}, "
                        f"{pre.dtype}")
    _check_device()
    rows = g.shape[0] // mesh.batch_shards()
    fitted = tiles_for(rows, w_t.shape[0], w_t.shape[1], tiles)
    if fitted is None:
        raise UserError(f"model.gelu_grad=pallas needs each device's tokens of a micro-batch (data.batch_size / "
                        f"optim.grad_accum_steps x model.seq_len / devices: here {rows}) to be a multiple of "
                        f"{EPILOGUE_TILE}; change data.batch_size or model.seq_len, or use model.gelu_grad=xla")
    out = jax.ShapeDtypeStruct((rows, w_t.shape[1]), g.dtype)
    output_tiles = (rows // fitted.m) * (w_t.shape[1] // (2 * fitted.n))
    on_gpu = autocast.backend() == "gpu"
    call = plgpu.kernel(functools.partial(_kernel, t=fitted), **{OUT_TYPE: out},
                        grid=(min(_sm_count(), output_tiles) if on_gpu else 1,), grid_names=("sm",), num_threads=3,
                        thread_name="wg", compiler_params=plgpu.CompilerParams(),  # Lane: see _kernel
                        interpret=None if on_gpu else _interpreter())
    on_rows = mesh.on_each_devices_rows(lambda g, pre, w_t: (call(g, w_t, pre),), 2, 1, 1)
    return on_rows(g, pre, w_t)[0]


def _check_device() -> None:
    """The kernel runs on Hopper GPUs, or in the interpreter on one CPU device (under shard_map over several, the
    interpreter's simulated threads wait on each other forever); not on a TPU or another GPU. An ahead-of-time
    compile names its GPU in the config (config_checks: run.target_device)."""
    if autocast.backend() == "tpu" or (autocast.backend() == "gpu" and not on_hopper_or_off_gpu()):
        kind = "TPU" if autocast.backend() == "tpu" else jax.devices()[0].device_kind
        raise UserError(f"model.gelu_grad=pallas is a kernel for Hopper GPUs (compute capability {HOPPER}: H100, "
                        f"H200), not this {kind}; use model.gelu_grad=xla")
    if autocast.backend() == "cpu" and mesh.batch_shards() > 1:
        raise UserError(f"model.gelu_grad=pallas runs off a GPU in Mosaic GPU's interpreter, on one device only, "
                        f"not on this mesh of {mesh.batch_shards()}; use model.gelu_grad=xla here")


def on_hopper_or_off_gpu() -> bool:
    """Whether this process's devices are Hopper GPUs, or no GPU (an ahead-of-time compile, the interpreter)."""
    return jax.default_backend() != "gpu" or jax.devices()[0].compute_capability == HOPPER


def _sm_count() -> int:
    """The persistent grid: the local GPU's SMs; an H100's where compiling ahead of time. The interpreter runs one
    program, which loops over every output tile."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else SMS_UNKNOWN


def interpreter_available() -> bool:
    """Whether this jax's Mosaic GPU interpreter runs the kernel off a GPU: jax 0.10's does; jax 0.9's interpreted
    no barrier in allocated memory nor a grid of more than one program. Its parameters are not in jax's public API;
    0.10 moved them here."""
    return importlib.util.find_spec("jax._src.pallas.mosaic_gpu.interpret.params") is not None


def _interpreter():
    if not interpreter_available():
        raise UserError(f"model.gelu_grad=pallas off a GPU runs in Mosaic GPU's interpreter, which jax "
                        f"{jax.__version__}'s cannot run it in (jax 0.10's can); use model.gelu_grad=xla here")
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gelu_linear(pre, w, b, precision: str):
    """autocast.linear(autocast.gelu(pre), w, b): the MLP's GELU and c_proj, whose backward computes pre's gradient
    in gelu_grad_matmul's one kernel instead of c_proj's dx gemm and GELU's backward pass. Under bf16 or fp16."""
    return autocast.linear(autocast.gelu(pre), w, b, precision)


def _gelu_linear_fwd(pre, w, b, precision):
    y, linear_vjp = jax.vjp(lambda h, w, b: autocast.linear(h, w, b, precision), autocast.gelu(pre), w, b)
    return y, (pre, w, linear_vjp)


def _gelu_linear_bwd(precision, saved, g):
    pre, w, linear_vjp = saved
    _, g_w, g_b = linear_vjp(g)  # its gradient of gelu(pre) goes unused: XLA drops that gemm
    rows = lambda t: t.reshape(-1, t.shape[-1])  # the batch split stays on the rows
    # w^T as an array of its own (an XLA transpose of the bf16 weight): the kernel could read w transposed in shared
    # memory (plgpu.transpose_ref), but Mosaic GPU's interpreter, where the tests run it, ignores that transpose
    g_pre = gelu_grad_matmul(rows(g.astype(pre.dtype)), w.astype(pre.dtype).T, rows(pre))
    return g_pre.reshape(pre.shape), g_w, g_b


gelu_linear.defvjp(_gelu_linear_fwd, _gelu_linear_bwd)
