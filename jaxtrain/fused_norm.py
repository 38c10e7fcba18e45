"""The residual add and the LayerNorm after it as one hand-written GPU kernel each way (Pallas, Triton backend).

    x, h = residual_norm(x, delta, w, b, precision)   # x + delta, LayerNorm(x + delta) in the compute dtype

Why: XLA cannot write these passes as one. On GPT-2 124M's H100 step (the compiled step's roofline,
benchmarks/NOTES.md) it ran each LayerNorm's backward as two row-reduction fusions and a column reduction,
reading the fp32 residual stream three times, and each forward as a reduction fusion, a copy into the bias row's
padded input and a separate residual add: 18 ms of a 99 ms roofline. Here each row is read once and written once:
the forward reads x and delta and writes x + delta and h; the backward reads h's and x's gradients and x + delta,
and writes x's gradient (the residual stream's and the LayerNorm's summed), delta's, and per-block partial sums of
the weight's and bias's gradients.

Numerics are autocast's and the XLA path's (model.LayerNorm): the add and the LayerNorm in fp32 (two-pass
variance, eps 1e-5), h rounded once to the compute dtype, the backward in fp32 with delta's gradient rounded to
delta's dtype; only the order of the fp32 sums differs. A bf16 stream (model.residual_dtype=bf16) is added in fp32
and rounded to bf16 before the LayerNorm reads it, and its gradient is torch's: the LayerNorm's input gradient
rounded to bf16, added to the stream's, the sum rounded (autograd's accumulation of two bf16 gradients); delta's
is then the same array, written once. Where the bias is the gemm's row (autocast.bias_row_applies),
h carries autocast.with_ones_column's padding, written here, so the next Linear takes it as it is.

Under a mesh the kernels run on each device's rows (shard_map over the batch split); off a GPU, through Pallas's
interpreter (tests/test_fused_norm.py checks the kernels that way against XLA's autodiff).
"""

import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxtrain import autocast, mesh
from jaxtrain.first_use import ImportedOnFirstUse
from jaxtrain.layer_norm import LN_EPS

# Pallas's Triton backend, imported at a kernel's trace (first_use.py). Deprecated since jax 0.11.0 ("will be
# removed in a future JAX version"): a jax without it runs XLA's ops.
TRITON = "jax.experimental.pallas.triton"
pl_triton = ImportedOnFirstUse(TRITON)

# Rows a kernel instance holds (the backward writes one partial-sum row of dw and db per instance) and its warps:
# the fastest of six settings on an H100 (benchmarks.norm_kernels, 32768 rows of 768, 2026-11-27: forward 123 us
# and backward 195, against 136 and 213 for the 8 rows and 8 warps set before; the whole GPT-2 step the same within
# noise).
MAX_ROWS = 16
NUM_WARPS = 4


def triton_available() -> bool:
    """Whether this jax has Pallas's Triton backend, which the kernels are written for (imported to know: asked
    only on a GPU, or where model.norm=pallas)."""
    try:
        importlib.import_module(TRITON)
    except ImportError:
        return False
    return True


def pieces(d: int) -> list[slice]:
    """d columns as power-of-two slices (Triton's tensors are powers of two): 768 -> [0:512], [512:768]."""
    out, start = [], 0
    for bit in reversed(range(d.bit_length())):
        if d >> bit & 1:
            out.append(slice(start, start + (1 << bit)))
            start += 1 << bit
    return out


def _rows(n: int) -> int:
    """Rows per kernel instance: the largest power of two up to MAX_ROWS that divides n (1 token when decoding)."""
    return next(r for r in (MAX_ROWS >> i for i in range(MAX_ROWS.bit_length())) if n % r == 0)


def _norm_forward_kernel(*refs, d: int, has_delta: bool, has_bias: bool, pad: int):
    refs = list(refs)
    x_ref, delta_ref = refs.pop(0), refs.pop(0) if has_delta else None
    w_ref, b_ref = refs.pop(0), refs.pop(0) if has_bias else None
    sum_ref = refs.pop(0) if has_delta else None
    h_ref, mean_ref, rstd_ref = refs
    xs = []
    for cols in pieces(d):
        x = x_ref[:, cols].astype(jnp.float32)
        if sum_ref is not None:  # rounded to the stream's dtype (a no-op for fp32) before the LayerNorm reads it
            x = (x + delta_ref[:, cols].astype(jnp.float32)).astype(sum_ref.dtype)
            sum_ref[:, cols] = x
            x = x.astype(jnp.float32)
        xs.append((cols, x))
    mean = sum(x.sum(1, keepdims=True) for _, x in xs) / d
    rstd = jax.lax.rsqrt(sum(jnp.square(x - mean).sum(1, keepdims=True) for _, x in xs) / d + LN_EPS)
    for cols, x in xs:
        h = (x - mean) * rstd * w_ref[cols][None, :]
        h_ref[:, cols] = (h if b_ref is None else h + b_ref[cols][None, :]).astype(h_ref.dtype)
    if pad:
        column = jax.lax.broadcasted_iota(jnp.int32, (h_ref.shape[0], pad), 1)
        h_ref[:, d:] = jnp.where(column == 0, 1, 0).astype(h_ref.dtype)
    mean_ref[...] = mean[:, 0]
    rstd_ref[...] = rstd[:, 0]


def _norm_backward_kernel(*refs, d: int, has_delta: bool):
    gh_ref, gsum_ref, x_ref, mean_ref, rstd_ref, w_ref, gx_ref, *refs = refs
    gdelta_ref = refs.pop(0) if has_delta else None
    gw_ref, gb_ref = refs
    mean, rstd = mean_ref[...][:, None], rstd_ref[...][:, None]
    parts, s_g, s_gx = [], 0.0, 0.0
    for cols in pieces(d):
        xhat = (x_ref[:, cols].astype(jnp.float32) - mean) * rstd
        gh = gh_ref[:, cols].astype(jnp.float32)
        g = gh * w_ref[cols][None, :]
        s_g, s_gx = s_g + g.sum(1, keepdims=True), s_gx + (g * xhat).sum(1, keepdims=True)
        gw_ref[0, cols] = (gh * xhat).sum(0)
        gb_ref[0, cols] = gh.sum(0)
        parts.append((cols, xhat, g))
    for cols, xhat, g in parts:  # the residual stream's gradient + LayerNorm's, rstd (g - mean g - xhat mean(g xhat))
        g_ln = (rstd * (g - s_g / d - xhat * (s_gx / d))).astype(gx_ref.dtype)  # the stream's dtype, as autograd
        gx = gsum_ref[:, cols].astype(jnp.float32) + g_ln.astype(jnp.float32)
        gx_ref[:, cols] = gx.astype(gx_ref.dtype)
        if gdelta_ref is not None:
            gdelta_ref[:, cols] = gx.astype(gdelta_ref.dtype)


def _call(kernel, row_inputs, whole_inputs, row_outputs, partial_outputs: int = 0):
    """pallas_call over blocks of rows: each (n, k) or (n,) input and output a block of rows, each (d,) input whole
    in every instance, and `partial_outputs` fp32 (instances, d) outputs, a row per instance; row outputs given as
    (shape, dtype). Under a mesh each device runs it on its own rows (the batch split's), the partial rows of all
    devices concatenated."""
    n, d = row_inputs[0].shape[0] // mesh.batch_shards(), whole_inputs[0].shape[0]
    rows = _rows(n)
    by_rows = lambda shape: pl.BlockSpec((rows,) + tuple(shape[1:]), lambda i: (i,) + (0,) * (len(shape) - 1))
    outputs = [((n,) + tuple(shape[1:]), dtype) for shape, dtype in row_outputs]
    partials = [((n // rows, d), jnp.float32)] * partial_outputs
    call = pl.pallas_call(
        kernel, grid=(n // rows,), out_shape=tuple(jax.ShapeDtypeStruct(s, t) for s, t in outputs + partials),
        in_specs=[by_rows(a.shape) for a in row_inputs] + [pl.BlockSpec(a.shape, lambda i: (0,)) for a in whole_inputs],
        out_specs=tuple([by_rows(s) for s, _ in outputs] + [pl.BlockSpec((1, d), lambda i: (i, 0))] * partial_outputs),
        compiler_params=pl_triton.CompilerParams(num_warps=NUM_WARPS),
        interpret=autocast.backend() != "gpu")
    call = mesh.on_each_devices_rows(call, len(row_inputs), len(whole_inputs), len(outputs) + partial_outputs)
    return call(*row_inputs, *whole_inputs)


def _forward(x, delta, w, b, low, pad):
    n, d = x.shape
    present = lambda *ts: [t for t in ts if t is not None]
    row_outputs = ([((n, d), x.dtype)] if delta is not None else []) + [
        ((n, d + pad), low), ((n,), jnp.float32), ((n,), jnp.float32)]
    kernel = functools.partial(_norm_forward_kernel, d=d, has_delta=delta is not None, has_bias=b is not None,
                               pad=pad)
    out = _call(kernel, present(x, delta), present(w, b), row_outputs)
    x_sum, (h, mean, rstd) = (x, out) if delta is None else (out[0], out[1:])
    empty_like = lambda t: None if t is None else jnp.zeros((0,), t.dtype)  # what the backward must know of them
    return (x_sum, h), (x_sum, mean, rstd, w, empty_like(delta), empty_like(b))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _residual_norm(x, delta, w, b, low, pad):
    return _forward(x, delta, w, b, low, pad)[0]


def _backward(low, pad, saved, grads):
    x_sum, mean, rstd, w, delta_like, b_like = saved
    g_sum, g_h = grads
    n, d = x_sum.shape
    # delta's gradient is x's rounded to delta's dtype: the same array where the stream is in delta's dtype (bf16)
    own_delta = delta_like is not None and delta_like.dtype != x_sum.dtype
    row_outputs = [((n, d), x_sum.dtype)] + ([((n, d), delta_like.dtype)] if own_delta else [])
    kernel = functools.partial(_norm_backward_kernel, d=d, has_delta=own_delta)
    g_x, *g_delta, g_w, g_b = _call(kernel, [g_h, g_sum, x_sum, mean, rstd], [w], row_outputs, partial_outputs=2)
    g_delta = g_delta[0] if own_delta else None if delta_like is None else g_x
    return g_x, g_delta, g_w.sum(0), None if b_like is None else g_b.sum(0)


_residual_norm.defvjp(_forward, _backward)


def residual_norm(x_BxTxD, delta_BxTxD, w, b, precision: str, ones_width: int = autocast.BIAS_ROW_PAD):
    """(x + delta, LayerNorm(x + delta)), delta None for none; the second in the compute dtype, padded with the
    ones column where the next Linear's bias rides in its gemm (autocast.bias_row_applies): `ones_width` columns,
    a 1 and zeros (autocast.with_ones_column; gelu_gemm's forward kernel reads its input, and qkv_grad's kernel
    writes its input's gradient, by TMA in tiles of 64 columns, so there the row must be a multiple of 64)."""
    B, T, D = x_BxTxD.shape
    rows = lambda t: None if t is None else t.reshape(B * T, D)  # the batch split stays on the rows
    low = autocast.COMPUTE_DTYPES[precision]
    pad = autocast.ones_columns(b is not None, precision, ones_width)
    x_sum, h = _residual_norm(rows(x_BxTxD), rows(delta_BxTxD), w, b, low, pad)
    return x_sum.reshape(B, T, D), h.reshape(B, T, h.shape[-1])
