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

The kernel is hopper_gemm.py's (jax's Hopper matmul: persistent over the SMs, a TMA producer warpgroup feeding two
wgmma consumer warpgroups side by side along n) with this epilogue, in 64 x 64 tiles through shared memory, where
pre's tile comes in by TMA and the gradient's goes out. Off a GPU it runs in Mosaic GPU's interpreter (slow: for
checking, tests/test_gelu_gemm.py).
"""

import functools

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxtrain import autocast, hopper_gemm, mesh
from jaxtrain.errors import UserError
from jaxtrain.hopper_gemm import EPILOGUE_TILE, Tiles, tiles_for

OPTION = "model.gelu_grad=pallas"


def _epilogue(acc_ref, at: hopper_gemm.OutputTile, ins, outs, scratch):
    """Each EPILOGUE_TILE x EPILOGUE_TILE tile of the warpgroup's output: pre's tile in by TMA, gelu_grad(pre, dh)
    out through the same shared-memory slot (once that slot's previous store has read it)."""
    (pre_gmem,), (out_gmem,) = ins, outs
    dh = acc_ref[...].astype(pre_gmem.dtype)  # the gemm's result, rounded once as cuBLAS rounds it
    for tile in hopper_gemm.epilogue_tiles(at.tiles):
        smem = scratch["smem"].at[at.wg, tile.slot]
        arrived = scratch["pre_arrived"].at[at.wg * hopper_gemm.slots_for(at.tiles) + tile.slot]
        hopper_gemm.free_slot(at.tiles)
        plgpu.copy_gmem_to_smem(pre_gmem.at[at.rows, at.cols].at[tile.index], smem, arrived)
        plgpu.barrier_wait(arrived)
        smem[...] = autocast.gelu_grad(smem[...], tile.part(dh))
        hopper_gemm.store(smem, out_gmem.at[at.rows, at.cols].at[tile.index])


def gelu_grad_matmul(g, w_t, pre, tiles: Tiles = Tiles()):
    """autocast.gelu_grad(pre, g @ w_t): (m, k) @ (k, n) in the compute dtype, accumulated in fp32 and rounded once,
    then GELU's backward with pre (m, n); one kernel, each device on its own rows under a mesh."""
    if not g.dtype == w_t.dtype == pre.dtype:
        raise TypeError(f"gelu_grad_matmul takes g, w_t and pre in one compute dtype, got {g.dtype}, {w_t.dtype}, "
                        f"{pre.dtype}")
    hopper_gemm.check_device(OPTION)
    rows = g.shape[0] // mesh.batch_shards()
    fitted = tiles_for(rows, w_t.shape[0], w_t.shape[1], tiles)
    if fitted is None:
        raise UserError(f"{OPTION} needs each device's tokens of a micro-batch (data.batch_size / "
                        f"optim.grad_accum_steps x model.seq_len / devices: here {rows}) to be a multiple of "
                        f"{EPILOGUE_TILE}; change data.batch_size or model.seq_len, or use model.gelu_grad=xla")
    scratch = {"smem": hopper_gemm.epilogue_smem(g.dtype, fitted),
               "pre_arrived": plgpu.Barrier(num_barriers=2 * hopper_gemm.slots_for(fitted))}
    call = hopper_gemm.gemm_with_epilogue(OPTION, _epilogue, scratch,
                                          jax.ShapeDtypeStruct((rows, w_t.shape[1]), g.dtype), fitted, 1)
    on_rows = mesh.on_each_devices_rows(lambda g, pre, w_t: (call(g, w_t, pre),), 2, 1, 1)
    return on_rows(g, pre, w_t)[0]


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
