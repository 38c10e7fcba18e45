"""torch.autocast's numerics in JAX: the compute dtypes' matmuls, their written-out gradients, and GELU.

Under "bf16" (or "fp16") every matmul takes operands in the compute dtype and accumulates in fp32, in the backward
pass too, and rounds its result once where autocast's does (`matmul`, `rounded_matmul`); GELU computes in fp32 and
rounds once, as torch's kernels (`gelu`). model.py builds GPT-2 from these; loss.py's tiled head reuses the weight
gradients' rule. Under "fp32" the dots run at Precision.HIGHEST, since the default may use bf16 passes on GPU/TPU.

Which kernels a rounding lands in depends on the platform (a GPU's gemm rounds its own accumulator; XLA:CPU's
default dots keep bf16 in bf16 only for row-major operands, its oneDNN dots round their own), so the platform the
model is traced for is part of the rule: `backend`, which an ahead-of-time compile for another platform sets with
`compiling_for`, and on a CPU which dots it runs (`onednn_dots`).
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.layout import Layout, with_layout_constraint

from jaxtrain import mesh

COMPUTE_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def _dot_f32acc(a, b, out=jnp.float32):
    """a @ b accumulated in fp32, the result in `out`: fp32, or rounded once to a lower dtype."""
    return jnp.matmul(a, b, preferred_element_type=out)


def _rounding_dot_dtype(low, gpu_too: bool = True):
    """The result dtype for a dot whose fp32 result is rounded to `low` next: `low` itself where the dot rounds its
    fp32 accumulator once on the way out, the same value: XLA:CPU's oneDNN dots (onednn_dots), which take a dot
    with an fp32 result on fp32 copies of its operands, off the CPU's bf16 units; and where `gpu_too`, a GPU's or
    TPU's gemm (XLA:GPU otherwise writes the fp32 result and rounds it in a pass of its own: benchmarks/NOTES.md).
    fp32 for XLA:CPU's default dots, which would run a `low`-result dot on fp32 copies of its operands instead of in
    `low` (row_major), and the rounding comes after; and, not `gpu_too`, for the dots whose fp32 result a GPU's
    measured program writes and rounds after (the weights' gradients, the written-out attention's)."""
    if backend() == "cpu":
        return low if _onednn_dots else jnp.float32
    return low if gpu_too else jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _low_matmul(a, b, dtypes, low, out=jnp.float32):
    """a @ b on `low` (bf16 or fp16) operands with fp32 accumulation, the result in `out` (fp32, or `low`: rounded
    once). b is 2-D or has a's batch axes; dtypes = (a.dtype, b.dtype), the dtypes the cotangents must come back in."""
    return _dot_f32acc(a.astype(low), b.astype(low), out)


def _low_matmul_fwd(a, b, dtypes, low, out):
    a, b = a.astype(low), b.astype(low)
    return _dot_f32acc(a, b, out), (a, b)


def _low_matmul_bwd(dtypes, low, out, res, g_f32):
    """Autodiff of a preferred_element_type dot upcasts the operands to fp32 (slower, and not autocast's numerics);
    written out, both gradient dots take `low` operands, accumulate in fp32 and round their results to `low`, as
    autocast's matmuls do (a weight's fp32 gradient is its fp16 or bf16 one, cast up). Under fp16 those roundings
    are where a loss scale too large for the gradients overflows to inf, as it does in torch."""
    a, b = res
    g = g_f32.astype(low)
    if b.ndim == 2:
        da, db = shared_weight_grads(a, b, g, _rounding_dot_dtype(low), _rounding_dot_dtype(low, gpu_too=False))
    else:
        g, out = row_major(g), _rounding_dot_dtype(low, gpu_too=False)
        da = _dot_f32acc(g, row_major(jnp.swapaxes(b, -1, -2)), out)
        db = _dot_f32acc(row_major(jnp.swapaxes(a, -1, -2)), g, out)
    return da.astype(low).astype(dtypes[0]), rounded_weight_grad(db, low, dtypes[1])


def shared_weight_grads(a, b, g, da_dtype=jnp.float32, db_dtype=jnp.float32):
    """(g b^T, a^T g), the gradients of a @ b for a 2-D weight b shared over a's leading axes (its gradient sums
    over them): in fp32, not rounded (in `da_dtype` and `db_dtype` from bf16 or fp16 operands). bf16 or fp16
    operands multiply with fp32 accumulation, as autocast's matmuls; fp32 ones at Precision.HIGHEST, as `matmul`
    under "fp32". loss.tiled_ce_sum sums a head's over its tiles."""
    def dot(x, y, out=jnp.float32):
        return jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST) if x.dtype == jnp.float32 else _dot_f32acc(
            x, y, out)
    return dot(g, b.T, da_dtype), dot(row_major(a.reshape(-1, a.shape[-1]).T), g.reshape(-1, g.shape[-1]), db_dtype)


def rounded_weight_grad(db_f32, low, dtype):
    """A weight's fp32 gradient as autocast returns it: rounded to `low`, then cast to the weight's `dtype`."""
    return row_major(db_f32).astype(low).astype(dtype)


_compiling_for: str | None = None


def backend() -> str:
    """The platform the model is traced for: jax.default_backend(), unless compiling_for() names another. The
    CPU-only layout pins (row_major) and model.attention's choice of cuDNN depend on it."""
    return _compiling_for or jax.default_backend()


_onednn_dots = False


@contextlib.contextmanager
def onednn_dots(on: bool):
    """Trace with XLA:CPU's dots taken to be oneDNN's (kernel_choice.onednn_dots, which step.compiler_options asks
    XLA for): there a bf16 dot writes its bf16 result (_rounding_dot_dtype) and a Linear's bias rides in its gemm
    (bias_row_applies), since XLA hands oneDNN a dot with an fp32 result or an add after it on fp32 copies of its
    operands, off the CPU's bf16 units. step.py's jitted functions set it as they are traced."""
    global _onednn_dots
    previous, _onednn_dots = _onednn_dots, on
    try:
        yield
    finally:
        _onednn_dots = previous


def _cpu_dots_are_onednns() -> bool:
    """Whether the model is traced for a CPU whose dots are oneDNN's (onednn_dots)."""
    return backend() == "cpu" and _onednn_dots


def rounding_options(platform: str, precision: str = "bf16", bf16_stream: bool = False, onednn: bool = False) -> dict:
    """XLA compile options under which a compile for `platform` keeps every rounding to bf16 or fp16 that the traced
    program writes, as torch's autocast does (none for an fp32 program: it writes none). On a GPU XLA drops a
    rounding that an fp32 consumer follows under its default `xla_allow_excess_precision=true`
    (SimplifyFPConversions): `c + bf16(a @ b)` with fp32 `c` equalled the rounded value at 5 of 32,768 elements on an
    H100; the bit-for-bit tests against torch failed there without this option and passed with it, and GPT-2 124M's
    step took the same time (benchmarks/NOTES.md, 2026-11-28). XLA:CPU kept those (32,767 of 32,768), but not a bf16
    residual stream's (`bf16_stream`, model.residual_dtype=bf16): its adds' roundings, which the LayerNorms' fp32
    upcasts follow, it dropped (a 2-layer model's logits equal to torchref's at 34% of elements with them dropped, at
    all without: parity_tests/test_model_parity.py). XLA:CPU's oneDNN dots (`onednn`: onednn_dots) write bf16
    results, and there too XLA folded a bf16 dot's upcast into the dot: a batched dot's input gradient came back
    unrounded (tests/test_autocast.py). A TPU is unmeasured: {} there, but for the bf16 stream."""
    if precision == "fp32" or not (platform == "gpu" or bf16_stream or onednn):
        return {}
    return {"xla_allow_excess_precision": False}


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace for `platform` ("gpu", "cpu", "tpu") instead of this process's default backend: an ahead-of-time
    compile for devices the machine does not have (benchmarks/roofline.py compiles the step for an H100 on a CPU,
    where jax's default backend stays "cpu"). It acts when the model is traced: jax's trace caches do not know it,
    so trace a fresh jit inside it (dryrun.compiled_step builds one)."""
    global _compiling_for
    previous, _compiling_for = _compiling_for, platform
    try:
        yield
    finally:
        _compiling_for = previous


def row_major(x):
    """x, laid out row-major in memory on a CPU. XLA:CPU runs a bf16 dot in bf16 (YNNPACK) only when its left
    operand is row-major and contracts its last axis, and otherwise converts both operands to fp32: a transpose of
    the activations that the weight gradient x^T g contracts over, pinned to memory, made those dots 1.7x faster
    on configs/small.yaml, copy included (benchmarks/NOTES.md). Pinning the gradient too keeps XLA from folding a
    later transpose (a tied head's) into the dot, which would make its left operand column-major again. GPUs and
    TPUs read transposed operands natively, so there the layout is XLA's to choose; and across several devices the
    pin would hide the batch split from XLA's sharding propagation (it gathered the pinned activations whole)."""
    if backend() != "cpu" or mesh.batch_shards() > 1:
        return x
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


_low_matmul.defvjp(_low_matmul_fwd, _low_matmul_bwd)


def matmul(a, b, precision: str, out=jnp.float32):
    """a @ b in fp32: from bf16 or fp16 operands with fp32 accumulation ("bf16", "fp16"), or in true fp32. Under
    bf16 or fp16 the result may be `out` instead, the compute dtype: the fp32 accumulator rounded once by the dot."""
    if precision != "fp32":
        return _low_matmul(a, b, (a.dtype, b.dtype), COMPUTE_DTYPES[precision], out)
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def rounded_matmul(a, b, precision: str, gpu_too: bool = True):
    """a @ b in the compute dtype: the fp32 accumulator rounded once, by the dot itself where the dots round their
    own (on a GPU or TPU where `gpu_too`, and XLA:CPU's oneDNN dots), after it elsewhere (_rounding_dot_dtype). A
    bias-free Linear and the head (head_logits); the written-out attention's dots, not `gpu_too`."""
    low = COMPUTE_DTYPES[precision]
    return matmul(a, b, precision, _rounding_dot_dtype(low, gpu_too)).astype(low)


# The name of biased_matmul's output where it pads its input itself (_padded_here): a custom_vjp, whose dot remat's
# dots policy does not see; model.REMAT_POLICIES' dots keeps it by this name, as it keeps the dots' outputs.
BIAS_ROW_GEMM = "bias_row_gemm"

# The bias row's padding: a gemm's contraction stays a multiple of 8 elements (16 bytes of bf16), the alignment
# cuBLAS's tensor-core kernels want.
BIAS_ROW_PAD = 8


def biased_matmul(x, w, b, precision: str):
    """x @ w + b in the compute dtype, as autocast's linear computes it: the bias rounded to the compute dtype,
    added to the fp32 accumulator, the sum rounded once (addmm's beta term, cuBLASLt's bias epilogue); its
    gradient the fp32 sum of the output's gradient rounded to the compute dtype. Under fp32, in fp32.

    On a GPU the bias is the dot's last row of weights against a column of ones in x (padded with zeros to
    BIAS_ROW_PAD), so the gemm adds it and rounds once whatever kernel XLA picks (cuBLAS or a Triton fusion) and
    writes bf16: adding it to an fp32 dot result after the gemm makes XLA write that result in fp32 and round it
    in a pass of its own, and sum the bias's gradient in another (GPT-2 124M's step on an H100: benchmarks/NOTES.md).
    The gemms grow by 8 rows of K (1% at K = 768). Elsewhere the bias is added to the fp32 result: XLA:CPU and TPU
    fuse that add, and a TPU's systolic array would pad the 8 rows to 128; and so on GPUs whose mesh splits the
    weights (fsdp > 1), where a weight split along K would be resharded to take its row (all-to-alls in each layer:
    benchmarks/NOTES.md)."""
    low = COMPUTE_DTYPES[precision]
    if not bias_row_applies(precision):
        return (matmul(x, w, precision) + b.astype(low)).astype(low)
    if x.shape[-1] == w.shape[0]:  # fused_norm and gelu_gemm pad their outputs; cuDNN's attention does not
        return checkpoint_name(_padded_here(x.astype(low), w, b, precision), BIAS_ROW_GEMM)
    return _with_bias_row(x, w, b, precision)


def _with_bias_row(padded_x, w, b, precision: str):
    """padded_x (x and its ones columns) @ (w, then the bias row and zero rows to the same width), rounded once."""
    row = jnp.zeros((padded_x.shape[-1] - w.shape[0], w.shape[1]), w.dtype).at[0].set(b)
    return rounded_matmul(padded_x, jnp.concatenate([w, row], 0), precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _padded_here(x, w, b, precision: str):
    """_with_bias_row of x (in the compute dtype) with its ones columns added here (attn.c_proj's input: cuDNN's
    attention writes it without them). The gradients are autodiff's, but x's comes from a gemm on w alone, where
    autodiff's is the padded gemm's wider gradient sliced back to x's columns: a copy of it (0.72 ms of GPT-2 124M's
    step on an H100, by the roofline: benchmarks/NOTES.md)."""
    return _padded_here_fwd(x, w, b, precision)[0]


def _padded_here_fwd(x, w, b, precision):
    padded_x = with_ones_column(x, COMPUTE_DTYPES[precision])
    return _with_bias_row(padded_x, w, b, precision), (padded_x, w, b)


def _padded_here_bwd(precision, res, g):
    """x's gradient as rounded_matmul(x, w)'s (x's value, sliced from padded_x, is not read: jit drops it)."""
    padded_x, w, b = res
    (g_x,) = jax.vjp(lambda x: rounded_matmul(x, w, precision), padded_x[..., :w.shape[0]])[1](g)
    g_w, g_b = jax.vjp(lambda w, b: _with_bias_row(padded_x, w, b, precision), w, b)[1](g)
    return g_x, g_w, g_b


_padded_here.defvjp(_padded_here_fwd, _padded_here_bwd)


def linear(x, w, b, precision: str):
    """x @ w (+ b where b is not None) in the compute dtype, as autocast's linear: biased_matmul or rounded_matmul."""
    return rounded_matmul(x, w, precision) if b is None else biased_matmul(x, w, b, precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def column_blocks(x, w, b, precision: str, parts: int):
    """linear(x, w, b)'s `parts` equal column blocks, each from a dot of its own on those columns of w (and b):
    the sums of the whole output sliced, each rounded once (their fp32 order is the gemm kernel's, which may block
    K otherwise for another width). cuDNN's attention takes q, k and v as separate arrays, and a slice of one gemm's
    output is a copy; three gemms write them where they go (XLA's dot merger would merge them back:
    step.compiler_options). x's gradient is the whole linear's (one dx gemm on the blocks' gradients concatenated,
    rounded once, as torch's): not three rounded dx summed; w's and b's are each block's own (block_weight_grads)."""
    return tuple(linear(x, wi, bi, precision) for wi, bi in _column_split(w, b, parts))


def _column_blocks_fwd(x, w, b, precision, parts):
    return column_blocks(x, w, b, precision, parts), (x, w, b)


def _column_blocks_bwd(precision, parts, res, g_blocks):
    x, w, b = res
    (g_x,) = jax.vjp(lambda x: linear(x, w, b, precision), x)[1](jnp.concatenate(g_blocks, -1))
    return (g_x, *block_weight_grads(x, w, b, g_blocks, precision))


column_blocks.defvjp(_column_blocks_fwd, _column_blocks_bwd)


def block_weight_grads(x, w, b, g_blocks, precision: str):
    """The gradients of w and b (None where b is) under column_blocks(x, w, b): each column block's from its own
    linear's VJP (x^T g_i, and g_i summed over the rows), side by side: the whole linear's, each element the same
    sum. A gemm on the blocks' gradients concatenated reads a copy of them, which XLA:GPU made twice in GPT-2 124M's
    step, once for the dx gemm and again where it ran the weight's gemm through cuBLAS (benchmarks/NOTES.md)."""
    grads = [jax.vjp(lambda wi, bi: linear(x, wi, bi, precision), wi, bi)[1](g)
             for (wi, bi), g in zip(_column_split(w, b, len(g_blocks)), g_blocks)]
    g_w = jnp.concatenate([g_wi for g_wi, _ in grads], -1)
    return g_w, None if b is None else jnp.concatenate([g_bi for _, g_bi in grads], -1)


def _column_split(w, b, parts: int) -> list[tuple]:
    """(w_i, b_i) for each of `parts` equal column blocks of w and b (b_i None where b is)."""
    b_blocks = [None] * parts if b is None else jnp.split(b, parts, -1)
    return list(zip(jnp.split(w, parts, -1), b_blocks))


def bias_row_applies(precision: str) -> bool:
    """Whether biased_matmul adds the bias as the gemm's last row of weights: on a GPU under bf16 or fp16, where
    the mesh keeps each weight whole, and on a CPU whose dots are oneDNN's (onednn_dots)."""
    on_its_gemm = backend() == "gpu" or _cpu_dots_are_onednns()
    return precision != "fp32" and on_its_gemm and mesh.weight_shards() == 1


def ones_columns(has_bias: bool, precision: str, width: int = BIAS_ROW_PAD) -> int:
    """How many ones columns a Linear takes beside its input: `width` where it has a bias and the bias is its gemm's
    row (bias_row_applies), else none. The width is the writer's (fused_norm's 8; 64, a TMA tile, where a kernel
    moves the input or its gradient by TMA: gelu_gemm's forward kernel, qkv_grad's)."""
    return width if has_bias and bias_row_applies(precision) else 0


def with_ones_column(x, low, width: int = BIAS_ROW_PAD):
    """x in the compute dtype with `width` more columns: a 1, then zeros (the bias row's partner). biased_matmul
    takes any width its input comes with: gelu_gemm's forward kernel writes 64 (TMA's tile; fused_norm's, 8 or 64:
    kernel_choice.ones_width)."""
    column = jnp.zeros(x.shape[:-1] + (width,), low).at[..., 0].set(1)
    return jnp.concatenate([x.astype(low), column], -1)


@jax.custom_vjp
def gelu(x):
    """Exact (erf) GELU, x Phi(x), computed as torch's kernel computes it: in fp32 whatever x's dtype, rounded once
    to x's dtype. torch.nn.GELU() on a bf16 tensor (autocast's c_fc output) upcasts each element to fp32 ("opmath"),
    evaluates x * 0.5 * (1 + erf(x / sqrt 2)) and rounds the result once (ATen's GeluKernelImpl on CPU,
    GeluCUDAKernelImpl on GPU); jax.nn.gelu would evaluate in bf16 op by op, rounding every intermediate. x Phi(x)
    is the same product as torch's (x * 0.5) * (1 + erf): the factor 0.5 is exact. For x below about -3 the 1 + erf
    cancels, so there the result is only as accurate as the fp32 erf absolutely (|x| times a few 2^-24), as torch's.

    The gradient is written out (`gelu_grad`) so that the backward pass keeps only x, which it has anyway, and
    recomputes the rest; autodiff of jax.nn.gelu kept an extra bf16 erfc(...) tensor of c_fc's (B, T, 4D) size per
    layer, written in the forward pass and read in the backward. On GPT-2 124M (H100, the compiled step's roofline,
    an estimate: benchmarks/NOTES.md) that is 2.9 ms of a 113 ms step with cuBLAS gemms and 1.1 GiB of peak memory;
    with Triton gemms XLA stops fusing c_fc's bias-gradient sum into the backward kernel, which now recomputes erf,
    and the sum re-reads dx: no time saved there."""
    return gelu_value(x)


def gelu_value(x):
    """gelu's value, as a plain function: also the epilogue of gelu_gemm's forward kernel (Mosaic GPU lowers no
    custom_vjp inside a kernel)."""
    x_f32 = x.astype(jnp.float32)
    return (x_f32 * _normal_cdf(x_f32)).astype(x.dtype)


def _normal_cdf(x_f32):
    """Phi(x) = 0.5 (1 + erf(x / sqrt 2)), in fp32 as torch's GELU kernels write it."""
    return 0.5 * (1 + jax.lax.erf(x_f32 * math.sqrt(0.5)))


def _gelu_fwd(x):
    return gelu(x), x


def _gelu_bwd(x, dy):
    """On a CPU whose dots are oneDNN's (onednn_dots) x passes an optimization barrier first: else XLA:CPU's CSE
    takes this erf(x) for the forward's, and the forward writes the fp32 erf, 4 bytes an element of c_fc's (B, T, 4D)
    output, for this pass to read back. Recomputed from x there: configs/small.yaml's bf16 step 8% faster on the AMX
    Xeon, 0.3 GB less peak memory (the Zen 4 EPYC: the same speed, 0.3 GB less); with XLA's default dots 4%
    slower, so those keep the merged erf, as does a GPU's measured program (benchmarks/NOTES.md, CPU steps 16, 19)."""
    if _cpu_dots_are_onednns():
        x = jax.lax.optimization_barrier(x)
    return (gelu_grad(x, dy),)


def gelu_grad(x, dy):
    """dx = dy (Phi(x) + x phi(x)) in fp32, rounded once to x's dtype, as torch's gelu_backward computes it
    (GeluBackwardKernelImpl; bf16 dy and x upcast): phi(x) = exp(-x^2 / 2) / sqrt(2 pi), the normal density.
    gelu's gradient, and the epilogue of gelu_gemm's kernel."""
    x_f32 = x.astype(jnp.float32)
    pdf = jnp.exp(x_f32 * x_f32 * -0.5) * (1 / math.sqrt(2 * math.pi))
    return (dy.astype(jnp.float32) * (_normal_cdf(x_f32) + x_f32 * pdf)).astype(x.dtype)


gelu.defvjp(_gelu_fwd, _gelu_bwd)

