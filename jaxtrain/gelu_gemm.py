"""The MLP's gemms with GELU in their epilogues: one hand-written Hopper kernel each (Pallas, Mosaic GPU), c_fc's
forward with the bias and GELU where model.gelu_fwd=pallas picks it, c_proj's dx gemm with GELU's backward where
model.gelu_grad=pallas does.

    y = mlp(x, w_fc, b_fc, w_proj, b_proj, precision, grad_kernel)   # c_proj(gelu(c_fc(x))), c_fc's kernel
    y = gelu_linear(pre, w_proj, b_proj, precision)                    # c_proj(gelu(pre)), the backward's alone

Why: XLA writes c_fc's output pre (B, T, 4D) in a cuBLAS gemm and GELU as a pass of its own that reads pre back
and writes gelu(pre): 2.89 ms of GPT-2 124M's H100 step by the roofline (benchmarks/NOTES.md), and XLA forms no gemm
fusion that writes both a gemm's result and its GELU (pre is kept for the backward). In the backward it writes
c_proj's input gradient dh = g w^T (bf16) in a cuBLAS gemm and GELU's backward as a pass that reads dh back with
pre: 5.79 ms of 2026-11-28's 139.5 ms of GPU time, and XLA fuses no gemm epilogue that reads a second full-size
operand. Here c_fc's kernel writes pre and gelu(pre) from each output tile on its way out (the GELU pass and its
read of pre back go; gelu(pre)'s write moves into the gemm), and c_proj's dx kernel multiplies each output tile by
gelu'(pre) on its way out, dh never written nor read back. By the step's roofline, -1.9 ms for the first (with the
others on: -2.2) and about -2.9 ms for the second (estimates; neither is measured on a GPU yet, which is why
neither is the default: benchmarks/device_check.py's stages measure them).

Numerics: autocast's, as model.MLP's XLA path: c_fc's fp32 accumulator plus the bias rounded to the compute dtype,
rounded once (as cuBLAS's bias epilogue, or the bias row, rounds it), GELU of that in fp32 rounded once
(autocast.gelu_value, traced into the epilogue); the dx accumulator rounded once (as cuBLAS rounds c_proj's dx),
then GELU's backward in fp32 from that and pre, rounded once (autocast.gelu_grad, likewise). A gemm's fp32 sum
order is the kernel's (k tiles of 64 in order), as a cuBLAS kernel's is its own.

The kernels are hopper_gemm.py's (jax's Hopper matmul: persistent over the SMs, a TMA producer warpgroup feeding
two wgmma consumer warpgroups side by side along n) with these epilogues, in 64 x 64 tiles through shared memory
(pre's tile comes in by TMA for the backward; the bias's columns once an output tile for the forward). Off a GPU
they run in Mosaic GPU's interpreter (slow: for checking, tests/test_gelu_gemm.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxtrain import autocast, hopper_gemm, mesh
from jaxtrain.errors import UserError
from jaxtrain.hopper_gemm import EPILOGUE_TILE, Tiles, plgpu, tiles_for

FWD_OPTION, GRAD_OPTION = "model.gelu_fwd=pallas", "model.gelu_grad=pallas"


def _grad_epilogue(acc_ref, at: hopper_gemm.OutputTile, ins, outs, scratch):
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
    hopper_gemm.check_device(GRAD_OPTION)
    rows = g.shape[0] // mesh.batch_shards()
    fitted = _fitted(GRAD_OPTION, rows, w_t.shape[0], w_t.shape[1], tiles)
    scratch = {"smem": hopper_gemm.epilogue_smem(g.dtype, fitted),
               "pre_arrived": plgpu.Barrier(num_barriers=2 * hopper_gemm.slots_for(fitted))}
    call = hopper_gemm.gemm_with_epilogue(GRAD_OPTION, _grad_epilogue, scratch,
                                          jax.ShapeDtypeStruct((rows, w_t.shape[1]), g.dtype), fitted, 1)
    on_rows = mesh.on_each_devices_rows(lambda g, pre, w_t: (call(g, w_t, pre),), 2, 1, 1)
    return on_rows(g, pre, w_t)[0]


def _fitted(option: str, rows: int, k: int, n: int, tiles: Tiles) -> Tiles:
    """`tiles` fitted to a (rows, k) @ (k, n) gemm of either GELU kernel (the config checks d_model: these are each
    device's tokens of a micro-batch, which a mesh splits); one line naming `option` where they do not tile."""
    fitted = tiles_for(rows, k, n, tiles)
    if fitted is None:
        key = option.split("=")[0]
        raise UserError(f"{option} needs each device's tokens of a micro-batch (data.batch_size / "
                        f"optim.grad_accum_steps x model.seq_len / devices: here {rows}) to be a multiple of "
                        f"{EPILOGUE_TILE}; change data.batch_size or model.seq_len, or use {key}=xla")
    return fitted


def _forward_epilogue(acc_ref, at: hopper_gemm.OutputTile, ins, outs, scratch):
    """Each EPILOGUE_TILE x EPILOGUE_TILE tile of the accumulator plus its columns of the bias (where there is a
    bias), rounded once to pre; the tile of pre and of gelu(pre) out through the shared-memory slots in turn (each
    once its previous store has read it). The bias is added a tile at a time: the accumulator plus the bias whole
    would be a second fp32 copy of it (spills on jax 0.11.2, benchmarks.kernel_registers)."""
    pre_gmem, h_gmem = outs
    acc = acc_ref[...]
    if ins:  # the bias, rounded to the compute dtype: its columns of this output tile in by TMA
        (b_gmem,) = ins
        bias_smem, arrived = scratch["bias"].at[at.wg], scratch["bias_arrived"].at[at.wg]
        plgpu.copy_gmem_to_smem(b_gmem.at[at.cols], bias_smem, arrived)
        plgpu.barrier_wait(arrived)
    slots = hopper_gemm.slots_for(at.tiles)
    for i, tile in enumerate(hopper_gemm.epilogue_tiles(at.tiles)):
        x = tile.part(acc)
        if ins:
            bias = _across_rows(bias_smem[tile.cols]).astype(jnp.float32)
            x = x + lax.broadcast_in_dim(bias, x.shape, [1])
        pre = x.astype(pre_gmem.dtype)  # rounded once, as cuBLAS's bias epilogue rounds it
        for j, (value, gmem) in enumerate(((pre, pre_gmem), (autocast.gelu_value(pre), h_gmem))):
            smem = scratch["smem"].at[at.wg, (2 * i + j) % slots]
            hopper_gemm.free_slot(at.tiles)
            smem[...] = value
            hopper_gemm.store(smem, gmem.at[at.rows, at.cols].at[tile.index])


def _across_rows(column_values):
    """A vector of the output tile's columns laid out to broadcast down its rows: the accumulator's layout reduced
    over its rows (as jax's Hopper attention backward lays out its per-column vectors). A layout is the GPU
    lowering's: the interpreter has no rule for the cast and needs none."""
    if autocast.backend() != "gpu":
        return column_values
    return plgpu.layout_cast(column_values, plgpu.Layout.WGMMA.reduce(0))


def linear_gelu_matmul(x, w, b, pad: int, tiles: Tiles = Tiles()):
    """(pre, h): pre = x @ w (+ b) in the compute dtype, accumulated in fp32 and rounded once, h = gelu(pre) with
    `pad` more columns, the ones column (autocast.with_ones_column) where c_proj takes its bias in a row (a multiple
    of EPILOGUE_TILE: Mosaic GPU's TMA stores no row of 3,080 elements in tiles of 64, and c_proj's gemm runs the
    same k steps at 3,136 as at 3,080); one kernel, each device on its own rows under a mesh. x (m, k), or wider:
    its first k columns read (fused_norm's output with the ones columns of c_fc's bias row, a whole tile of 64 of
    them, model.MLP.ones_width: the kernel adds the bias itself, and XLA's backward gemms take the row), w (k, n),
    b (n,) or None, in one compute dtype."""
    low = w.dtype
    if x.dtype != low or (b is not None and b.dtype != low):
        raise TypeError(f"linear_gelu_matmul takes x, w and b in one compute dtype, got {x.dtype}, {low}, "
                        f"{None if b is None else b.dtype}")
    hopper_gemm.check_device(FWD_OPTION)
    rows, n = x.shape[0] // mesh.batch_shards(), w.shape[1]
    fitted = _fitted(FWD_OPTION, rows, w.shape[0], n, tiles)
    scratch = {"smem": hopper_gemm.epilogue_smem(low, fitted)}
    if b is not None:
        scratch |= {"bias": plgpu.SMEM((2, fitted.n), low), "bias_arrived": plgpu.Barrier(num_barriers=2)}
    whole = [w] + ([] if b is None else [b])
    call = hopper_gemm.gemm_with_epilogue(FWD_OPTION, _forward_epilogue, scratch,
                                          (jax.ShapeDtypeStruct((rows, n), low),
                                           jax.ShapeDtypeStruct((rows, n + pad), low)), fitted, len(whole) - 1)
    pre, h = mesh.on_each_devices_rows(call, 1, len(whole), 2)(x, *whole)
    if pad:  # the ones column, in the kernel's buffer (an update in place)
        h = h.at[:, n:].set(autocast.with_ones_column(jnp.zeros((h.shape[0], 0), low), low, pad))
    return pre, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gelu_linear(pre, w, b, precision: str):
    """autocast.linear(autocast.gelu(pre), w, b): the MLP's GELU and c_proj, whose backward computes pre's gradient
    in gelu_grad_matmul's one kernel instead of c_proj's dx gemm and GELU's backward pass. Under bf16 or fp16. c_fc
    stays outside (model.MLP), where model.remat=dots's policy keeps its output."""
    return _gelu_linear_fwd(pre, w, b, precision)[0]


def _gelu_linear_fwd(pre, w, b, precision):
    h = autocast.gelu(pre)
    return autocast.linear(h, w, b, precision), (pre, h, w, b)


def _gelu_linear_bwd(precision, saved, g):
    return _proj_and_gelu_grads(*saved, g, precision, True)


gelu_linear.defvjp(_gelu_linear_fwd, _gelu_linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def mlp(x, w_fc, b_fc, w_proj, b_proj, precision: str, grad_kernel: bool):
    """autocast.linear(autocast.gelu(autocast.linear(x, w_fc, b_fc)), w_proj, b_proj): the MLP's c_fc, GELU and
    c_proj under bf16 or fp16, with c_fc and GELU in linear_gelu_matmul's kernel, and the backward from c_proj's
    output gradient to pre's in gelu_grad_matmul's kernel where `grad_kernel`; XLA's gemms and passes for the rest
    (the weight and bias gradients, c_fc's dx). model.remat=dots's policy does not look inside a custom_vjp: there
    the kernel runs again in the backward pass for pre and gelu(pre) (model.remat=none keeps them)."""
    return _mlp_fwd(x, w_fc, b_fc, w_proj, b_proj, precision, grad_kernel)[0]


def _mlp_fwd(x, w_fc, b_fc, w_proj, b_proj, precision, grad_kernel):
    low = autocast.COMPUTE_DTYPES[precision]
    pad = autocast.ones_columns(b_proj is not None, precision, EPILOGUE_TILE)  # c_proj's, beside gelu(pre)
    rows = lambda t: t.reshape(-1, t.shape[-1])  # the batch split stays on the rows
    cast = lambda t: None if t is None else t.astype(low)
    pre, h = linear_gelu_matmul(rows(x.astype(low)), w_fc.astype(low), cast(b_fc), pad)
    pre, h = pre.reshape(*x.shape[:-1], -1), h.reshape(*x.shape[:-1], -1)
    return autocast.linear(h, w_proj, b_proj, precision), (x, pre, h, w_fc, b_fc, w_proj, b_proj)


def _mlp_bwd(precision, grad_kernel, saved, g):
    x, pre, h, w_fc, b_fc, w_proj, b_proj = saved
    g_pre, g_w_proj, g_b_proj = _proj_and_gelu_grads(pre, h, w_proj, b_proj, g, precision, grad_kernel)
    _, fc_vjp = jax.vjp(lambda x, w, b: autocast.linear(x, w, b, precision), x, w_fc, b_fc)
    return (*fc_vjp(g_pre), g_w_proj, g_b_proj)


mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _proj_and_gelu_grads(pre, h, w_proj, b_proj, g, precision, grad_kernel):
    """(pre's, w_proj's and b_proj's gradients) of autocast.linear(h, w_proj, b_proj) with h = gelu(pre), from the
    output's gradient g: pre's in gelu_grad_matmul's kernel where `grad_kernel`, else c_proj's dx gemm and GELU's
    backward (XLA's); the weight's and the bias's from c_proj's VJP (XLA's gemms)."""
    _, proj_vjp = jax.vjp(lambda h, w, b: autocast.linear(h, w, b, precision), h, w_proj, b_proj)
    g_h, g_w_proj, g_b_proj = proj_vjp(g)  # its forward's gemm goes unused: XLA drops it
    if not grad_kernel:
        return autocast.gelu_grad(pre, g_h[..., :pre.shape[-1]]), g_w_proj, g_b_proj  # less the ones columns
    rows = lambda t: t.reshape(-1, t.shape[-1])  # the batch split stays on the rows
    # g_h goes unused (XLA drops its gemm). w^T as an array of its own (an XLA transpose of the bf16 weight): the
    # kernel could read w transposed in shared memory (plgpu.transpose_ref), but Mosaic GPU's interpreter, where the
    # tests run it, ignores that transpose
    g_pre = gelu_grad_matmul(rows(g.astype(pre.dtype)), w_proj.astype(pre.dtype).T, rows(pre)).reshape(pre.shape)
    return g_pre, g_w_proj, g_b_proj
