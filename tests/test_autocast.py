"""jaxtrain.autocast alone: the compute dtypes' matmuls and their gradients against float64 products rounded as
autocast rounds them, the dots' dtypes in the lowered program, and GELU against torch's kernels and the formula."""

import contextlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compiled_hlo
from compiled_hlo import options_for, traced_for
from jaxtrain import autocast
from jaxtrain.mesh import AUTO_AXES


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _ulp(rounded, dtype):
    """The spacing of `dtype` at each value of `rounded` (float64 holding `dtype` values): the wider side of a power
    of 2; a subnormal's fixed spacing."""
    info = jnp.finfo(dtype)
    return 2.0 ** (np.maximum(np.floor(np.log2(np.abs(rounded) + 1e-300)), info.minexp) - info.nmant)


def _operands(shape_a, shape_b):
    return (jax.random.normal(jax.random.key(3), shape_a), jax.random.normal(jax.random.key(4), shape_b),
            jax.random.normal(jax.random.key(5), shape_a[:-1] + shape_b[-1:]))


@pytest.mark.parametrize("low", ["bf16", "fp16"])
@pytest.mark.parametrize("shape_a,shape_b", [((4, 16, 64), (64, 48)), ((2, 3, 16, 32), (2, 3, 32, 16))])
@pytest.mark.parametrize("platform", ["cpu", "cpu-onednn", "gpu"])
def test_low_precision_matmul_gradient(shape_a, shape_b, low, platform):
    """Linear (a weight shared over the batch axes) and attention (batched) shapes, in bf16 and fp16; traced for a
    CPU, for a CPU whose dots are oneDNN's and for a GPU (traced_for; run here), where the gradient dots return
    `low` themselves (the left operand's on a GPU, both on oneDNN's CPU)."""
    a, b, w = _operands(shape_a, shape_b)

    def grad(prec):
        with traced_for(platform):
            return jax.jit(jax.grad(lambda a, b: (w * autocast.matmul(a, b, prec)).sum(), argnums=(0, 1)),
                           compiler_options=options_for(platform, prec))(a, b)
    (da, db), (da32, db32) = grad(low), grad("fp32")
    assert da.dtype == db.dtype == jnp.float32
    # Rounding the operands to bf16 (relative 2^-9 each) gives about 0.4% RMS relative error; fp16 less.
    assert _rel_err(da, da32) < 0.01 and _rel_err(db, db32) < 0.01
    # The float64 gradient of the rounded operands, rounded to `low` as autocast's matmuls return it: fp32
    # accumulation over <= 768 terms of O(1) errs by ~1e-6 absolute, so the result is that rounding, or where the
    # exact value lies that close to a rounding boundary its neighbour: one ulp of `low`, plus the original 1e-5
    # absolute where a sum cancels to a value smaller than its terms' rounding.
    dtype = autocast.COMPUTE_DTYPES[low]
    r = lambda x: np.asarray(x.astype(dtype), np.float64)
    a64, b64, g64 = r(a), r(b), r(w)
    da64 = g64 @ np.swapaxes(b64, -1, -2)
    if len(shape_b) == 2:
        a64, g64 = a64.reshape(-1, a64.shape[-1]), g64.reshape(-1, g64.shape[-1])
    db64 = np.swapaxes(a64, -1, -2) @ g64
    for got, exact in ((da, da64), (db, db64)):
        rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float64)
        assert np.all(np.abs(np.asarray(got, np.float64) - rounded) <= _ulp(rounded, dtype) + 1e-5), low
        # Off the exact value's rounding only where that value lies within fp32's accumulation error (~sqrt(K)
        # 2^-24 relative) of a midpoint of `low` (2^-8 apart relative in bf16, 2^-11 in fp16): ~1e-3 of the results
        # in fp16. Measured: bf16 1.0 everywhere, fp16 >= 0.9983; 0.99 allows 6x the worst measured miss rate.
        assert np.mean(np.asarray(got, np.float64) == rounded) > 0.99


def test_bf16_rounded_matmul_is_the_product_rounded_once():
    """rounded_matmul (the head's logits, a bias-free Linear) returns bf16: the product of the bf16-rounded operands (in float64, where
    each product of two bf16 values is exact and a sum of 64 of them within 2^-46 relative) rounded once to bf16, as
    an fp32 accumulator rounded at the end gives it; where the fp32 sum lies within its rounding error of a bf16
    rounding boundary, the neighbour: so within one bf16 ulp everywhere, and equal almost everywhere."""
    x, w, _ = _operands((4, 16, 64), (64, 48))
    logits = autocast.rounded_matmul(x, w, "bf16")
    assert logits.dtype == jnp.bfloat16
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
    rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(rounded) + 1e-30)) - 7)
    got = np.asarray(logits, np.float64)
    assert np.all(np.abs(got - rounded) <= ulp) and np.mean(got == rounded) > 0.99  # measured 1.0, as above


@pytest.mark.parametrize("platform,fsdp,row", [("gpu", None, True), ("gpu", 1, True), ("gpu", 2, False),
                                               ("cpu", None, False), ("cpu-onednn", None, True),
                                               ("cpu-onednn", 2, False), ("tpu", None, False)])
def test_the_bias_rides_in_the_gemm_where_dots_round_and_weights_are_whole(platform, fsdp, row):
    """biased_matmul pads x with a column of ones and w with the bias row (a concatenate in the trace) only on a GPU
    or a CPU whose dots are oneDNN's, and where the mesh does not split the weights (fsdp 1, or no mesh); and it is
    the same function either way:
    x @ w + b, with bf16 operands accumulated in fp32 and rounded once (operands exact in bf16 and sums exact in
    fp32, so both routes give the same bits)."""
    x, w, b = (jnp.asarray(np.random.default_rng(i).integers(-8, 9, shape) / 8, jnp.float32)
               for i, shape in enumerate([(2, 5, 16), (16, 8), (8,)]))
    f = jax.jit(lambda x, w, b: autocast.biased_matmul(x, w, b, "bf16"), compiler_options=options_for(platform))
    mesh = jax.sharding.AbstractMesh((4 // fsdp, fsdp), ("data", "fsdp"), axis_types=AUTO_AXES) if fsdp else None
    with traced_for(platform), jax.sharding.use_abstract_mesh(mesh) if mesh else contextlib.nullcontext():
        assert ("concatenate" in str(jax.make_jaxpr(f.__wrapped__)(x, w, b))) == row
        if fsdp is None:
            y = f(x, w, b)
    if fsdp is None:
        want = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
        assert y.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(y, np.float64), np.asarray(jnp.asarray(want).astype(jnp.bfloat16),
                                                                            np.float64))


@pytest.mark.parametrize("platform,fsdp,precision,bias,want", [
    ("gpu", None, "bf16", True, 64), ("gpu", 1, "fp16", True, 64), ("gpu", None, "bf16", False, 0),
    ("gpu", None, "fp32", True, 0), ("gpu", 2, "bf16", True, 0), ("cpu", None, "bf16", True, 0),
    ("cpu-onednn", None, "bf16", True, 64), ("cpu-onednn", None, "fp32", True, 0), ("tpu", None, "bf16", True, 0)])
def test_a_linear_takes_ones_columns_only_where_its_bias_rides_in_the_gemm(platform, fsdp, precision, bias, want):
    """The ones columns a writer puts beside a Linear's input (fused_norm, gelu_gemm's forward kernel): the width
    it asks for on a GPU (or a CPU whose dots are oneDNN's) under bf16 or fp16 with whole weights and a bias, none
    anywhere else (a Linear without bias, fp32, a mesh that splits the weights, XLA's CPU dots, a TPU): the cases
    written out by hand."""
    mesh = jax.sharding.AbstractMesh((4 // fsdp, fsdp), ("data", "fsdp"), axis_types=AUTO_AXES) if fsdp else None
    with traced_for(platform), jax.sharding.use_abstract_mesh(mesh) if mesh else contextlib.nullcontext():
        assert autocast.ones_columns(bias, precision, 64) == want


@pytest.mark.parametrize("width", [autocast.BIAS_ROW_PAD, 64])
def test_an_input_that_brings_its_ones_columns_is_taken_as_it_is(width):
    """On a GPU a Linear's input may come with the ones column already (fused_norm writes 8 columns, gelu_gemm's
    forward kernel 64: a TMA tile): biased_matmul then pads only the weight, with a bias row and zero rows to that
    width, and gives what it gives the bare input (operands exact in bf16 and sums exact in fp32: the same bits),
    and the same gradients of the weight, the bias and the input's first k columns."""
    x, w, b = (jnp.asarray(np.random.default_rng(i).integers(-8, 9, shape) / 8, jnp.float32)
               for i, shape in enumerate([(2, 5, 16), (16, 8), (8,)]))
    g = jnp.asarray(np.random.default_rng(3).integers(-8, 9, (2, 5, 8)) / 8, jnp.bfloat16)
    padded = autocast.with_ones_column(x, jnp.bfloat16, width)
    value_and_vjp = jax.jit(lambda x, w, b: (lambda y, vjp: (y, vjp(g)))(
        *jax.vjp(lambda x, w, b: autocast.biased_matmul(x, w, b, "bf16"), x, w, b)))
    with autocast.compiling_for("gpu"):
        (y, (g_x, g_w, g_b)), (want, (want_g_x, want_g_w, want_g_b)) = (
            value_and_vjp(padded, w, b), value_and_vjp(x.astype(jnp.bfloat16), w, b))
    assert padded.shape[-1] == 16 + width
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(g_x[..., :16], want_g_x)
    np.testing.assert_array_equal(g_w, want_g_w)
    np.testing.assert_array_equal(g_b, want_g_b)


def test_an_input_padded_here_takes_its_gradient_from_a_gemm_on_w_alone():
    """On a GPU, an input that comes without its ones columns (attn.c_proj's: cuDNN's attention output) is padded
    in biased_matmul, and its gradient is g w^T from a gemm k columns wide, not the padded gemm's k + 8 columns
    sliced back (a copy). The values are autocast's: each gradient's exact sum (small-integer operands: exact in
    float64 and in fp32) rounded once to bf16, the weight's and the bias's cast up to their fp32 params."""
    x, w, b = (jnp.asarray(np.random.default_rng(i).integers(-8, 9, shape) / 8, dtype)
               for i, (shape, dtype) in enumerate([((2, 5, 16), jnp.bfloat16), ((16, 8), jnp.float32),
                                                   ((8,), jnp.float32)]))
    g = jnp.asarray(np.random.default_rng(3).integers(-8, 9, (2, 5, 8)) / 8, jnp.bfloat16)
    grads = jax.jit(lambda x, w, b: jax.vjp(lambda x, w, b: autocast.biased_matmul(x, w, b, "bf16"), x, w, b)[1](g))
    with autocast.compiling_for("gpu"):
        g_x, g_w, g_b = grads(x, w, b)
        dots = re.findall(r"stablehlo\.dot_general .*-> tensor<((?:\d+x)+)\w+>", grads.lower(x, w, b).as_text())
    g64, x64, w64 = (np.asarray(a, np.float64) for a in (g, x, w))
    bf16 = lambda a: np.asarray(jnp.asarray(a).astype(jnp.bfloat16), np.float64)
    np.testing.assert_array_equal(np.asarray(g_x, np.float64), bf16(g64 @ w64.T))
    np.testing.assert_array_equal(np.asarray(g_w, np.float64), bf16(x64.reshape(10, 16).T @ g64.reshape(10, 8)))
    np.testing.assert_array_equal(np.asarray(g_b, np.float64), bf16(g64.sum((0, 1))))
    assert g_x.dtype == jnp.bfloat16 and g_w.dtype == g_b.dtype == jnp.float32
    widths = sorted(int(shape.split("x")[-2]) for shape in dots)  # each dot's result's last axis
    assert widths == [8, 16], dots  # the padded weight's gradient (8 out) and x's (16 in), none 16 + 8 wide


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("platform", ["cpu", "cpu-onednn", "gpu"])
def test_column_blocks_are_the_linear_split_and_take_its_gradient(platform, precision, bias):
    """column_blocks (q, k and v as three gemms) gives the whole linear's output split in three, up to the order of
    each fp32 sum (a gemm of another width may block K otherwise), and exactly the whole linear's gradients: one dx
    from the blocks' gradients together, rounded once, not three rounded dx summed. The expectation is autodiff of
    jnp.split(linear(...)), the one-gemm linear whose numerics are torch's (tests/test_model.py); traced for a GPU
    and oneDNN's CPU dots too, where the bias rides in the gemm."""
    x, w, b, *gs = (jax.random.normal(jax.random.key(i), shape) for i, shape in
                    enumerate([(2, 5, 24), (24, 48), (48,), (2, 5, 16), (2, 5, 16), (2, 5, 16)]))
    b = b if bias else None

    def loss(blocks):  # each block weighted by its own cotangent: the gradients reach the blocks apart
        return sum(jnp.vdot(block.astype(jnp.float32), g) for block, g in zip(blocks, gs))

    by_blocks = lambda x, w, b: loss(autocast.column_blocks(x, w, b, precision, 3))
    by_split = lambda x, w, b: loss(jnp.split(autocast.linear(x, w, b, precision), 3, -1))
    options = options_for(platform, precision)
    with traced_for(platform):
        got = jax.jit(lambda *a: autocast.column_blocks(*a, precision, 3), compiler_options=options)(x, w, b)
        want = jax.jit(lambda *a: jnp.split(autocast.linear(*a, precision), 3, -1), compiler_options=options)(x, w, b)
        grads = (jax.jit(jax.grad(by_blocks, (0, 1, 2)), compiler_options=options)(x, w, b),
                 jax.jit(jax.grad(by_split, (0, 1, 2)), compiler_options=options)(x, w, b))
    # two orders of a fp32 sum of K = 24 products are each within K units of rounding of sum |x w| (+ |b|) of it
    magnitude = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)) + (
        0 if b is None else np.abs(np.asarray(b, np.float64)))
    bound = 2 * 24 * 2.0 ** -24 * magnitude
    want = np.concatenate([np.asarray(t, np.float64) for t in want], -1)
    if precision == "bf16":  # and the sums' roundings to bf16 one bf16 unit apart at most
        bound = bound + _ulp(want, jnp.bfloat16)
    assert np.all(np.abs(np.concatenate([np.asarray(t, np.float64) for t in got], -1) - want) <= bound)
    jax.tree.map(np.testing.assert_array_equal, *grads)


@pytest.mark.parametrize("platform,precision", [("cpu", "bf16"), ("cpu-onednn", "bf16"), ("gpu", "bf16"),
                                                ("gpu", "fp32")])
def test_q_k_v_blocks_take_their_weight_gradients_from_a_gemm_each(platform, precision):
    """column_blocks' gradient as XLA:CPU compiles it (on every machine: XLA:GPU names its gemms otherwise): one dx
    gemm on the blocks' gradients together (10 rows of x's 24 columns) and a weight-gradient gemm per block (K rows
    of the block's 16 columns: 24, or 32 where the bias rides in it as a row, padded to 8), none on all 48 columns,
    which would read the blocks' gradients concatenated."""
    x, w, b, *gs = (jax.device_put(jax.random.normal(jax.random.key(i), shape), jax.devices("cpu")[0]) for i, shape
                    in enumerate([(2, 5, 24), (24, 48), (48,), (2, 5, 16), (2, 5, 16), (2, 5, 16)]))
    loss = lambda x, w, b: sum(jnp.vdot(block.astype(jnp.float32), g)
                               for block, g in zip(autocast.column_blocks(x, w, b, precision, 3), gs))
    with traced_for(platform):
        hlo = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, w, b).compile().as_text()
    k = 32 if (platform, precision) in (("gpu", "bf16"), ("cpu-onednn", "bf16")) else 24
    assert sorted(re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} dot\(", hlo)) == ["10,24"] + [f"{k},16"] * 3


def test_bf16_matmul_backward_dots_are_bf16_with_fp32_accumulation():
    """Autodiff of a preferred_element_type dot would make fp32 (or bf16-output) dots; the custom_vjp must not."""
    a, b, w = _operands((4, 16, 64), (64, 48))
    grad = jax.jit(jax.grad(lambda a, b: (w * autocast.matmul(a, b, "bf16")).sum(), argnums=(0, 1)))
    dots = compiled_hlo.dot_types(grad.lower(a, b).as_text())
    assert len(dots) >= 2 and set(dots) == {("bf16", "bf16", "f32")}


def _gelu_and_grad(x, dy, gelu=autocast.gelu):
    """gelu(x) and its gradient with cotangent dy, each in x's dtype; autocast.gelu unless told."""
    y, vjp = jax.vjp(gelu, x)
    return y, vjp(dy)[0]


def _torch_gelu_and_grad(x, dy):
    """torch.nn.functional.gelu(x) (exact erf) and its autograd gradient with cotangent dy."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    x_t = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).requires_grad_(True)
    y_t = torch.nn.functional.gelu(x_t)
    y_t.backward(torch.from_numpy(np.asarray(dy, np.float32)).to(torch.bfloat16))
    return y_t.detach().float().numpy(), x_t.grad.float().numpy()


def _every_bf16(limit):
    """Every bf16 value of magnitude below `limit`, in float32 (bf16 is float32's top 16 bits): zeros of both signs,
    subnormals, negatives, and large |x|."""
    x = (np.arange(2 ** 16, dtype=np.uint32) << 16).view(np.float32)
    return x[np.abs(x) < limit]  # drops inf and nan too


# XLA's fp32 erf errs by up to 3.1e-7 absolutely, torch's by 3.2e-8 (both measured against float64 over [-6, 6]):
# under 2^-21 = 4.8e-7 together. Where 1 + erf cancels (x below about -3, erf near -1) that absolute error is most
# of the result, so a bound relative to the result alone cannot hold there, for torch's fp32 result either.
ERF_ABS = 2.0 ** -21


def test_gelu_bf16_is_torchs():
    """Exhaustive over bf16 (|x| < 2^64; above about 1.7e38 torch's vectorised kernel overflows to inf). Both sides
    evaluate the same fp32 expressions (upcast, erf and exp, products) and round once to bf16. Their erf and exp
    differ by a few 2^-24 relative to the terms, and rounding to bf16 (spacing 2^-8 relative) maps values that close
    to the same bf16 unless they straddle a rounding midpoint: then one ulp apart. Where 1 + erf cancels, the terms
    are 0.5 |x| (forward) and 0.5 |dy| (gradient) times the erfs' absolute error, ERF_ABS."""
    x = _every_bf16(2.0 ** 64)
    dy = np.asarray(jax.random.normal(jax.random.key(0), x.shape).astype(jnp.bfloat16), np.float32)
    y, dx = _gelu_and_grad(jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16))
    assert y.dtype == dx.dtype == jnp.bfloat16
    y_torch, dx_torch = _torch_gelu_and_grad(x, dy)
    # Where neither 1 + erf cancels nor the result is trivially x/2, 0 or x to bf16's precision:
    nontrivial = (x >= -3) & (x <= 6) & (np.abs(x) >= 2.0 ** -8)
    for got, want, scale in ((y, y_torch, 0.5 * np.abs(x)), (dx, dx_torch, 0.5 * np.abs(dy))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        # XLA:CPU flushes subnormals to zero; torch's AVX2 kernels keep them (measured: gelu(2.76e-40) = 1.84e-40),
        # so a result at or below the smallest normal may be 0 on jaxtrain's side (its fp32 terms subnormal).
        flushed = np.where(np.abs(want) <= np.finfo(np.float32).tiny, np.finfo(np.float32).tiny, 0.0)
        assert np.all(np.abs(got - want) <= _ulp(want, jnp.bfloat16) + ERF_ABS * scale + flushed)
        # A midpoint straddle takes a few 2^-24 of the 2^-8 between midpoints: rare, and measured never (all 2,562
        # bit-exact, forward and gradient). An intermediate rounded to bf16 stays near one ulp but is exact on only
        # 73-75% of them, so this catches what the bound alone lets through.
        assert np.mean(got[nontrivial] == want[nontrivial]) > 0.99


def _formula64(x, dy):
    """GELU x Phi(x) and its gradient dy (Phi(x) + x phi(x)) in float64, written out with math.erf."""
    x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    cdf = 0.5 * (1 + np.frompyfunc(math.erf, 1, 1)(x / math.sqrt(2)).astype(np.float64))
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    return x * cdf, dy * (cdf + x * pdf)


def _assert_fp32_close(got, want, scale):
    """got within fp32 rounding of want: a handful of ops (erf, exp, products) each off by a few 2^-24 relative,
    2^-21 (8 ulps) of the result, plus ERF_ABS times the size of the terms, which can cancel."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.abs(got - want) <= 2.0 ** -21 * np.abs(want) + ERF_ABS * scale)


def test_gelu_fp32_is_the_formula_and_jax_nn_gelus():
    """Under fp32 the written-out GELU and gradient are the float64 formula's and jax.nn.gelu's (its autodiff), to
    fp32 rounding; jax.nn.gelu's erfc does not cancel, so they differ where 1 + erf does, by ERF_ABS x the terms."""
    x = np.concatenate([np.linspace(-12, 12, 24001), [0.0, -0.0, 1e-30, -1e-30, 1e4, -1e4, 1e30, -1e30]])
    x = jnp.asarray(x, jnp.float32)
    dy = jax.random.normal(jax.random.key(0), x.shape)
    y, dx = _gelu_and_grad(x, dy)
    old_y, old_dx = _gelu_and_grad(x, dy, lambda x: jax.nn.gelu(x, approximate=False))
    for want_y, want_dx in (_formula64(x, dy), (old_y, old_dx)):
        _assert_fp32_close(y, want_y, 0.5 * np.abs(x))
        _assert_fp32_close(dx, want_dx, 0.5 * np.abs(dy))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("platform, erfs", [("cpu-onednn", 2), ("cpu", 1)])
def test_gelus_backward_computes_its_own_erf_where_the_cpus_dots_are_onednns(platform, erfs, dtype):
    """Traced for oneDNN's CPU dots, the compiled value and gradient evaluate erf in two fused computations, the
    forward's and the backward's; for XLA's default dots in one: its CSE merges them, and the forward writes erf in
    fp32 for the backward to read (measured on jaxlib 0.10.2 and 0.12.0.1)."""
    x, w = (jax.random.normal(jax.random.key(seed), (64, 256), dtype) for seed in (0, 1))
    loss = jax.value_and_grad(lambda x, w: (autocast.gelu(x) * w).astype(jnp.float32).sum())
    with traced_for(platform):
        hlo = jax.jit(loss).lower(x, w).compile().as_text()
    with_erf = [name for name, body in compiled_hlo.computations(hlo) if re.search(r" erf\(", body)]
    assert len(with_erf) == erfs, with_erf
