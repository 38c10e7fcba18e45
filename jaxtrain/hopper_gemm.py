"""A Hopper gemm whose epilogue is the caller's: jax's Hopper matmul (Pallas, Mosaic GPU) for the kernels that fold
a memory-bound pass into a gemm, which XLA does not write from this program (benchmarks/NOTES.md).

    call = gemm_with_epilogue(option, epilogue, scratch, out_types, tiles, extra_inputs)   # call(a, b, *extra)

The kernel is jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu's: persistent over the SMs, a TMA producer
warpgroup feeding two wgmma consumer warpgroups side by side along n, each with an m x n fp32 accumulator; what
each consumer does with its accumulator once the k loop is done is `epilogue`'s (gelu_gemm.py: the bias and GELU,
or GELU's backward; head_lse.py: the logits and their logsumexp's partial sums; qkv_grad.py: the sum of three
products, rounded). Off a GPU it runs in Mosaic GPU's interpreter (slow: for checking). The users:
model.gelu_fwd=pallas, model.gelu_grad=pallas, model.head_lse=pallas and model.qkv_grad=pallas.
"""

import dataclasses
import functools
import importlib.util
import inspect
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxtrain import autocast, mesh
from jaxtrain.config_checks import HOPPER_GEMM_TILE as EPILOGUE_TILE  # a tile's rows, columns and k are multiples
from jaxtrain.errors import UserError
from jaxtrain.first_use import ImportedOnFirstUse

# Mosaic GPU's Pallas, imported at a Hopper kernel's trace (first_use.py); gelu_gemm.py and head_lse.py use it too
plgpu = ImportedOnFirstUse("jax.experimental.pallas.mosaic_gpu")

HOPPER = "9.0"  # wgmma and TMA: the compute capability the kernels are written for
SMS_UNKNOWN = 132  # an H100 SXM's and an H200's SMs: the persistent grid when compiling ahead of time
# The name scope of every kernel here, in its custom call's op_name: how benchmarks.roofline knows a Mosaic GPU
# custom call for a gemm of its first two operands (m, k) @ (k, n), and counts its 2 m k n FLOPs; a kernel of p
# pairs (gemm_with_epilogue) is scoped hopper_gemm_pairs<p>, its operands a_1 .. a_p, b_1 .. b_p: 2 m k n p
SCOPE = "hopper_gemm"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A consumer warpgroup's output tile (m x n; the two side by side make the CTA's m x 2n), the k step, the
    pipeline's depth and the width of the planar snake the persistent loop walks the output tiles in. The default
    is jax's example's shape: 4 stages of (128 x 64 + 64 x 256) bf16 and the epilogue's slots fill 224 KiB of an
    H100's 227 KiB of shared memory; its fp32 accumulator takes 128 of a consumer thread's 232 registers (m n / 128;
    head_lse's 128 x 192, 192)."""
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
    n_tile = next(c for c in (base.n, 2 * EPILOGUE_TILE, EPILOGUE_TILE) if n % (2 * c) == 0)
    return dataclasses.replace(base, m=base.m if m % base.m == 0 else EPILOGUE_TILE, n=n_tile,
                               k=base.k if k % base.k == 0 else EPILOGUE_TILE)


@dataclasses.dataclass(frozen=True)
class OutputTile:
    """Where a consumer warpgroup's accumulator lies in the (m, n) result: its rows and columns, and `wg`, the
    warpgroup (0 or 1), which indexes the per-warpgroup scratch; column_block is the accumulator's column index in
    units of n (2 per CTA tile); tiles, the kernel's."""
    rows: pl.Slice
    cols: pl.Slice
    wg: jax.Array
    column_block: jax.Array
    tiles: Tiles


def _kernel(*refs, t: Tiles, epilogue: Callable, scratch: dict, extra_inputs: int, pairs: int):
    """jax's hopper_matmul_mgpu.kernel with the caller's epilogue, lowered in Mosaic GPU's Lane semantics, not its
    Warpgroup one as jax's: the Warpgroup lowering of jax 0.10.2 has no layout rule for erf (GELU's gradient).
    `epilogue(acc_ref, OutputTile, inputs, outputs, scratch_refs)` runs in each consumer warpgroup after its k loop;
    every shared-memory store it started before has been read by then (its scratch is free again). With `pairs`
    > 1 the product is a sum of pairs' products, sum_i a_i @ b_i: each k step brings a tile of every pair and its
    wgmmas add into the one accumulator."""
    a_gmems, b_gmems = refs[:pairs], refs[pairs:2 * pairs]
    ins, outs = refs[2 * pairs:2 * pairs + extra_inputs], refs[2 * pairs + extra_inputs:]
    m, (k, n) = a_gmems[0].shape[0], b_gmems[0].shape  # a may be wider than k: its first k columns are read
    transforms = _tma_transforms(t.k, a_gmems[0].dtype)
    cta_n = 2 * t.n  # the two consumer warpgroups side by side
    m_tiles, n_tiles = m // t.m, n // cta_n

    def pipeline(mma, context):
        return plgpu.emit_pipeline_warp_specialized(
            mma, grid=(k // t.k,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
            max_concurrent_steps=t.stages, compute_context=context,
            in_specs=[plgpu.BlockSpec((t.m, t.k), lambda i: (0, i), transforms=transforms)] * pairs
            + [plgpu.BlockSpec((t.k, cta_n), lambda i: (i, 0), transforms=transforms)] * pairs)

    nothing = lambda *_, **__: None  # the allocations do not depend on the bodies

    @functools.partial(pl.run_scoped, allocations=pipeline(nothing, nothing).get_allocations(*a_gmems, *b_gmems),
                       scratch_refs=scratch, collective_axes="wg")
    def _scope(allocations, scratch_refs):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
        def _output_tile(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_tiles, n_tiles), 1, t.snake)
            at = OutputTile(rows=pl.ds(mi * t.m, t.m), cols=pl.ds(ni * cta_n + wg * t.n, t.n), wg=wg,
                            column_block=ni * 2 + wg, tiles=t)

            def context(run_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((t.m, t.n), jnp.float32))
                def _epilogue(acc_ref):
                    run_pipeline(acc_ref)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    epilogue(acc_ref, at, ins, outs, scratch_refs)

            def mma(_, *smem_and_acc):
                *smem, acc_ref = smem_and_acc
                for a_smem, b_smem in zip(smem[:pairs], smem[pairs:]):
                    plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, pl.ds(wg * t.n, t.n)])
                plgpu.wgmma_wait(0)
                return acc_ref

            pipeline(mma, context)(*[a.at[at.rows, :] for a in a_gmems],
                                   *[b.at[:, pl.ds(ni * cta_n, cta_n)] for b in b_gmems], allocations=allocations)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def slots_for(t: Tiles) -> int:
    """The shared-memory tiles a consumer warpgroup's epilogue alternates between: two, or one where its
    accumulator is a single EPILOGUE_TILE x EPILOGUE_TILE tile (as jax's example)."""
    return min(2, (t.m // EPILOGUE_TILE) * (t.n // EPILOGUE_TILE))


def epilogue_smem(low, t: Tiles) -> "plgpu.SMEM":
    """Each consumer warpgroup's slots of EPILOGUE_TILE x EPILOGUE_TILE in the compute dtype, swizzled for TMA:
    where an epilogue's output tiles pass on their way to global memory."""
    return plgpu.SMEM((2, slots_for(t), EPILOGUE_TILE, EPILOGUE_TILE), low,
                      transforms=_tma_transforms(EPILOGUE_TILE, low))


def _tma_transforms(cols: int, dtype):
    """Shared memory laid out for TMA and wgmma, as jax's example lays it: rows of `cols` elements swizzled by the
    widest swizzle that divides them, in tiles of 8 rows."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(cols * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


@dataclasses.dataclass(frozen=True)
class EpilogueTile:
    """One EPILOGUE_TILE x EPILOGUE_TILE tile of a warpgroup's accumulator: where it lies (index: two pl.ds), its
    shared-memory slot, and its place in its row of tiles (first, last)."""
    rows: slice
    cols: slice
    slot: int
    first: bool
    last: bool

    @property
    def index(self):
        return pl.ds(self.rows.start, EPILOGUE_TILE), pl.ds(self.cols.start, EPILOGUE_TILE)

    def part(self, value):
        """This tile of `value`, an array of the accumulator's shape (a register array: a slice, no copy)."""
        return value[self.rows, self.cols]


def epilogue_tiles(t: Tiles) -> list[EpilogueTile]:
    """A warpgroup's accumulator in EPILOGUE_TILE x EPILOGUE_TILE tiles, row by row, the slots alternating."""
    per_row, size = t.n // EPILOGUE_TILE, EPILOGUE_TILE
    return [EpilogueTile(slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size),
                         (i * per_row + j) % slots_for(t), j == 0, j == per_row - 1)
            for i in range(t.m // size) for j in range(per_row)]


def free_slot(t: Tiles) -> None:
    """Wait until the store that last used the next tile's slot has read it (the one after it may run on)."""
    plgpu.wait_smem_to_gmem(slots_for(t) - 1, wait_read_only=True)


def store(smem, gmem) -> None:
    """A shared-memory tile the warpgroup wrote, out to global memory by TMA (its own bulk group)."""
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, gmem)


def store_tile(value, tile: EpilogueTile, at: OutputTile, smem, out_gmem) -> None:
    """`tile` of `value` (an array of the accumulator's shape) to its place in `out_gmem`, through its shared-memory
    slot `smem` once the store that last used that slot has read it."""
    free_slot(at.tiles)
    smem[...] = tile.part(value)
    store(smem, out_gmem.at[at.rows, at.cols].at[tile.index])


def gemm_with_epilogue(option: str, epilogue: Callable, scratch: dict, out_types, t: Tiles, extra_inputs: int,
                       pairs: int = 1):
    """(a, b, *extra) -> out_types: (m, k) @ (k, n) in the compute dtype through `epilogue`, on one device's rows
    (of an a wider than k, its first k columns: the ones columns of a Linear's bias row, in a whole TMA tile);
    with `pairs` > 1, (a_1 .. a_p, b_1 .. b_p, *extra) and sum_i a_i @ b_i, each (m, k) @ (k, n). Persistent: a
    grid of the GPU's SMs (at most one per output tile); the interpreter runs one program. `option`: the config's
    key=value that picks the kernel, for messages."""
    def call(*operands):
        a, b = operands[0], operands[pairs]
        output_tiles = (a.shape[0] // t.m) * (b.shape[1] // (2 * t.n))
        on_gpu = autocast.backend() == "gpu"
        kernel = functools.partial(_kernel, t=t, epilogue=epilogue, scratch=scratch, extra_inputs=extra_inputs,
                                   pairs=pairs)
        with jax.named_scope(SCOPE if pairs == 1 else f"{SCOPE}_pairs{pairs}"):
            return plgpu.kernel(kernel, **{_out_type_name(): out_types},
                                grid=(min(_sm_count(), output_tiles) if on_gpu else 1,), grid_names=("sm",),
                                num_threads=3, thread_name="wg", compiler_params=_lane_semantics(),
                                kernel_name=kernel_name(option),
                                interpret=None if on_gpu else _interpreter(option))(*operands)
    return call


def _out_type_name() -> str:
    """plgpu.kernel's name for the output's shape and dtype: out_shape until jax 0.10, which deprecated it for
    out_type."""
    return "out_type" if "out_type" in inspect.signature(plgpu.kernel).parameters else "out_shape"


def kernel_name(option: str) -> str:
    """The kernel's name in a GPU profile and in ptxas's report, from the option that picks it: "gemm_gelu_grad"
    for model.gelu_grad=pallas (Mosaic GPU names a kernel without one "anonymous")."""
    return "gemm_" + option.split("=")[0].split(".")[-1]


def _lane_semantics():
    """Mosaic GPU's Lane lowering, named: jax 0.11 made Warpgroup the default ("[Mosaic GPU] Turn WG on by
    default"), whose lowering has no layout rule for erf (gelu_gemm's epilogue) in jax 0.10.2 to 0.12.0.1; a GPU
    lent runs jax 0.11.2."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def check_device(option: str) -> None:
    """The kernels run on Hopper GPUs, or in the interpreter on one CPU device (under shard_map over several, the
    interpreter's simulated threads wait on each other forever); not on a TPU or another GPU. An ahead-of-time
    compile names its GPU in the config (config_checks: run.target_device). `option`: the config's key=value."""
    key = option.split("=")[0]
    if autocast.backend() == "tpu" or (autocast.backend() == "gpu" and not on_hopper_or_off_gpu()):
        kind = "TPU" if autocast.backend() == "tpu" else jax.devices()[0].device_kind
        raise UserError(f"{option} is a kernel for Hopper GPUs (compute capability {HOPPER}: H100, H200), not this "
                        f"{kind}; use {key}=xla")
    if autocast.backend() == "cpu" and mesh.batch_shards() > 1:
        raise UserError(f"{option} runs off a GPU in Mosaic GPU's interpreter, on one device only, not on this mesh "
                        f"of {mesh.batch_shards()}; use {key}=xla here")


def on_hopper_or_off_gpu() -> bool:
    """Whether this process's devices are Hopper GPUs, or no GPU (an ahead-of-time compile, the interpreter)."""
    return jax.default_backend() != "gpu" or jax.devices()[0].compute_capability == HOPPER


def _sm_count() -> int:
    """The persistent grid: the local GPU's SMs; an H100's where compiling ahead of time. The interpreter runs one
    program, which loops over every output tile."""
    return jax.devices()[0].core_count if jax.default_backend() == "gpu" else SMS_UNKNOWN


def interpreter_available() -> bool:
    """Whether this jax's Mosaic GPU interpreter runs the kernels off a GPU: jax 0.10's does; jax 0.9's interpreted
    no barrier in allocated memory nor a grid of more than one program. Its parameters are not in jax's public API;
    0.10 moved them here."""
    return importlib.util.find_spec("jax._src.pallas.mosaic_gpu.interpret.params") is not None


def _interpreter(option: str):
    if not interpreter_available():
        key = option.split("=")[0]
        raise UserError(f"{option} off a GPU runs in Mosaic GPU's interpreter, which jax {jax.__version__}'s cannot "
                        f"run it in (jax 0.10's can); use {key}=xla here")
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
