"""jaxtrain.model alone: shapes, causality, names, init, tying, dropout, the bf16 policy (forward, backward, HLO), GELU."""

import collections
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtrain import model as M
from jaxtrain.config import ModelConfig
from jaxtrain.errors import UserError

V = 97
SMALL = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
apply = jax.jit(M.apply, static_argnums=0)  # op-by-op dispatch would make these tests several times slower


def _init(cfg=SMALL, precision="fp32", seed=0):
    return M.init_params(cfg, vocab_size=V, precision=precision, seed=seed)


def _idx(B=3, T=16, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V, jnp.int32)


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _dots(hlo: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) element types of every dot_general in StableHLO text."""
    sig = re.findall(r"stablehlo\.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", hlo)
    return [tuple(re.fullmatch(r"tensor<(?:\d+x)*(\w+)>", t).group(1) for t in s) for s in sig]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_logits_shape_and_dtype(precision):
    """Under bf16 the head returns bf16 logits, as autocast's lm_head does; the loss upcasts them."""
    graphdef, params = _init(precision=precision)
    logits = apply(graphdef, params, _idx())
    assert logits.shape == (3, 16, V)
    assert logits.dtype == {"fp32": jnp.float32, "bf16": jnp.bfloat16}[precision]


def test_vocab_size_argument_wins_over_config():
    cfg = ModelConfig(vocab_size=5, seq_len=16, n_layer=1, n_head=2, d_model=32)
    _, params = M.init_params(cfg, vocab_size=V, precision="fp32", seed=0)
    assert params["wte"]["weight"][...].shape == (V, 32)


def test_sequence_longer_than_seq_len_is_an_error():
    graphdef, params = _init()
    with pytest.raises(ValueError, match="seq_len"):
        apply(graphdef, params, _idx(T=17))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_causal(precision):
    graphdef, params = _init(precision=precision)
    idx, t = _idx(), 9
    changed = idx.at[:, t].set((idx[:, t] + 1) % V)
    before, after = apply(graphdef, params, idx), apply(graphdef, params, changed)
    np.testing.assert_allclose(after[:, :t], before[:, :t], atol=1e-6)
    assert not np.allclose(after[:, t:], before[:, t:], atol=1e-3)


def _expected_torch_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    """nanoGPT's state dict for cfg, shapes as torch stores them; lm_head only when untied."""
    d = cfg.d_model
    shapes = {"transformer.wte.weight": (V, d), "transformer.wpe.weight": (cfg.seq_len, d),
              "transformer.ln_f.weight": (d,)}
    for i in range(cfg.n_layer):
        p = f"transformer.h.{i}."
        shapes |= {p + "ln_1.weight": (d,), p + "ln_2.weight": (d,), p + "attn.c_attn.weight": (3 * d, d),
                   p + "attn.c_proj.weight": (d, d), p + "mlp.c_fc.weight": (4 * d, d), p + "mlp.c_proj.weight": (d, 4 * d)}
    if cfg.bias:
        shapes |= {name.replace(".weight", ".bias"): shape[:1] for name, shape in shapes.items()
                   if "ln" in name or "c_" in name}
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, d)
    return shapes


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_names_cover_every_param_once(tie, bias):
    cfg = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32, tie_embeddings=tie, bias=bias)
    _, params = _init(cfg)
    names = M.torch_names(params)
    flat = dict(nnx.to_flat_state(params))
    assert sorted(path for path, _ in names.values()) == sorted(flat)
    torch_shapes = {name: flat[path][...].shape[::-1] if transposed else flat[path][...].shape
                    for name, (path, transposed) in names.items()}
    assert torch_shapes == _expected_torch_shapes(cfg)
    assert all(transposed == (path[-1] == "kernel") for path, transposed in names.values())


def test_params_are_fp32_and_the_only_state():
    graphdef, params = _init()
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
    assert nnx.state(nnx.merge(graphdef, params), nnx.Not(nnx.Param)) == nnx.State({})


def test_init_statistics():
    cfg = ModelConfig(seq_len=256, n_layer=8, n_head=4, d_model=256, tie_embeddings=False)
    _, params = M.init_params(cfg, vocab_size=1024, precision="fp32", seed=0)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for path, param in nnx.to_flat_state(params):
        w, leaf = np.asarray(param[...]), path[-1]
        if leaf == "bias":
            assert (w == 0).all(), path
        elif path[-2] in ("ln_1", "ln_2", "ln_f"):
            assert (w == 1).all(), path
        else:
            # Every tensor has >= 65k draws, so the sample std is off by 1/sqrt(2n) <= 0.3% (1 sigma):
            # 2% is 7 sigma, and the two scales tested differ 4x.
            std = resid_std if path[-2] == "c_proj" else 0.02
            assert abs(w.std() / std - 1) < 0.02 and abs(w.mean()) < 0.02 * std, path


@pytest.mark.parametrize("tie", [True, False])
def test_tied_head_shares_wte(tie):
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, tie_embeddings=tie)
    graphdef, params = _init(cfg)
    idx = _idx() % 50  # tokens 50.. never appear, so only the head can give their wte rows a gradient
    grads = jax.jit(jax.grad(lambda p: apply(graphdef, p, idx).std()))(params)
    unseen_rows_grad = jnp.abs(grads["wte"]["weight"][...][50:]).max()
    assert ("lm_head" in params) != tie
    assert (unseen_rows_grad > 0) == tie


def test_dropout():
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.1)
    graphdef, params = _init(cfg)
    graphdef_no_drop, _ = _init(ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32))
    idx, k1, k2 = _idx(), jax.random.key(1), jax.random.key(2)
    reference = apply(graphdef_no_drop, params, idx)
    np.testing.assert_array_equal(apply(graphdef, params, idx), reference)  # no key: deterministic, no dropout
    np.testing.assert_array_equal(apply(graphdef, params, idx, dropout_key=k1),
                                  apply(graphdef, params, idx, dropout_key=k1))
    assert not np.allclose(apply(graphdef, params, idx, dropout_key=k1), reference, atol=1e-3)
    assert not np.allclose(apply(graphdef, params, idx, dropout_key=k1),
                           apply(graphdef, params, idx, dropout_key=k2), atol=1e-3)
    np.testing.assert_array_equal(apply(graphdef_no_drop, params, idx, dropout_key=k1), reference)


def test_bf16_policy_dtypes():
    linear = M.Linear(8, 4, bias=True, std=0.02, precision="bf16", rngs=nnx.Rngs(0))
    assert linear(jnp.ones((2, 8))).dtype == jnp.bfloat16  # autocast's linear output
    assert M.LayerNorm(8, bias=True)(jnp.ones((2, 8), jnp.bfloat16)).dtype == jnp.float32
    assert M.matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4)), "bf16").dtype == jnp.float32


def test_bf16_forward_close_to_fp32():
    graphdef_32, params = _init(precision="fp32")
    graphdef_16, _ = _init(precision="bf16")
    idx = _idx()
    err = _rel_err(apply(graphdef_16, params, idx), apply(graphdef_32, params, idx))
    # Each bf16 rounding is off by <= 2^-9 relative and the roundings are independent, so they average out in the
    # dots: the logits' RMS relative error is about bf16's epsilon 2^-8 = 0.4% (measured 0.3%), not growing with d.
    assert 1e-4 < err < 0.01


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
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_low_precision_matmul_gradient(shape_a, shape_b, low, platform):
    """Linear (a weight shared over the batch axes) and attention (batched) shapes, in bf16 and fp16; traced for a
    CPU and for a GPU (model.compiling_for; run here), where the left operand's gradient dot returns `low` itself."""
    a, b, w = _operands(shape_a, shape_b)

    def grad(prec):
        with M.compiling_for(platform):
            return jax.jit(jax.grad(lambda a, b: (w * M.matmul(a, b, prec)).sum(), argnums=(0, 1)))(a, b)
    (da, db), (da32, db32) = grad(low), grad("fp32")
    assert da.dtype == db.dtype == jnp.float32
    # Rounding the operands to bf16 (relative 2^-9 each) gives about 0.4% RMS relative error; fp16 less.
    assert _rel_err(da, da32) < 0.01 and _rel_err(db, db32) < 0.01
    # The float64 gradient of the rounded operands, rounded to `low` as autocast's matmuls return it: fp32
    # accumulation over <= 768 terms of O(1) errs by ~1e-6 absolute, so the result is that rounding, or where the
    # exact value lies that close to a rounding boundary its neighbour: one ulp of `low`, plus the original 1e-5
    # absolute where a sum cancels to a value smaller than its terms' rounding.
    dtype = M.COMPUTE_DTYPES[low]
    r = lambda x: np.asarray(x.astype(dtype), np.float64)
    a64, b64, g64 = r(a), r(b), r(w)
    da64 = g64 @ np.swapaxes(b64, -1, -2)
    if len(shape_b) == 2:
        a64, g64 = a64.reshape(-1, a64.shape[-1]), g64.reshape(-1, g64.shape[-1])
    db64 = np.swapaxes(a64, -1, -2) @ g64
    for got, exact in ((da, da64), (db, db64)):
        rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float64)
        assert np.all(np.abs(np.asarray(got, np.float64) - rounded) <= _ulp(rounded, dtype) + 1e-5), low
        assert np.mean(np.asarray(got, np.float64) == rounded) > 0.99  # almost always the exact value's rounding


def test_bf16_head_logits_are_the_product_rounded_once():
    """The head's dot returns bf16 itself (head_logits): the product of the bf16-rounded operands (in float64, where
    each product of two bf16 values is exact and a sum of 64 of them within 2^-46 relative) rounded once to bf16, as
    an fp32 accumulator rounded at the end gives it; where the fp32 sum lies within its rounding error of a bf16
    rounding boundary, the neighbour: so within one bf16 ulp everywhere, and equal almost everywhere."""
    x, w, _ = _operands((4, 16, 64), (64, 48))
    logits = M.head_logits(x, w, "bf16")
    assert logits.dtype == jnp.bfloat16
    exact = np.asarray(x.astype(jnp.bfloat16), np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64)
    rounded = np.asarray(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16), np.float64)
    ulp = 2.0 ** (np.floor(np.log2(np.abs(rounded) + 1e-30)) - 7)
    got = np.asarray(logits, np.float64)
    assert np.all(np.abs(got - rounded) <= ulp) and np.mean(got == rounded) > 0.99


def test_bf16_matmul_backward_dots_are_bf16_with_fp32_accumulation():
    """Autodiff of a preferred_element_type dot would make fp32 (or bf16-output) dots; the custom_vjp must not."""
    a, b, w = _operands((4, 16, 64), (64, 48))
    grad = jax.jit(jax.grad(lambda a, b: (w * M.matmul(a, b, "bf16")).sum(), argnums=(0, 1)))
    dots = _dots(grad.lower(a, b).as_text())
    assert len(dots) >= 2 and set(dots) == {("bf16", "bf16", "f32")}


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("precision,bias", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_model_gradient_dots_follow_the_policy(precision, bias, platform):
    """Every dot takes the compute dtype's operands and accumulates in fp32. Traced for a CPU, every one returns
    fp32 (rounded after it where it must be); traced for a GPU (model.compiling_for), a dot whose result is rounded
    to bf16 next returns bf16 itself (_rounding_dot_dtype): the head's forward, the forward of the four Linears per
    layer when they have no bias (a bias is added to the fp32 result first) and, in the backward pass, the
    gradient of the activations a weight multiplies (the head's, and four Linears' per layer); weight gradients
    stay fp32, and so do the written-out attention's (on a GPU, cuDNN's kernel runs attention). Under fp32, every
    dot is true fp32, on GPU/TPU too, whose default precision may use bf16 passes."""
    graphdef, params = _init(dataclasses.replace(SMALL, bias=bias), precision=precision)
    with M.compiling_for(platform):  # M.apply, not this module's jitted apply: its trace cache ignores the platform
        hlo = jax.jit(jax.grad(lambda p, idx: M.apply(graphdef, p, idx).std())).lower(params, _idx()).as_text()
    dots = collections.Counter(_dots(hlo))
    if precision == "bf16":
        rounding_dots = (2 + 4 * SMALL.n_layer + (0 if bias else 4 * SMALL.n_layer)) if platform == "gpu" else 0
        assert set(dots) - {("bf16", "bf16", "bf16")} == {("bf16", "bf16", "f32")}
        assert dots[("bf16", "bf16", "bf16")] == rounding_dots
    else:
        assert set(dots) == {("f32", "f32", "f32")}
        dot_lines = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
        assert all("precision = [HIGHEST, HIGHEST]" in line for line in dot_lines)


@pytest.mark.parametrize("attention,precision,dropout,fused", [
    ("auto", "bf16", 0.0, jax.default_backend() == "gpu"), ("auto", "fp32", 0.0, False), ("auto", "bf16", 0.1, False),
    ("xla", "bf16", 0.0, False)])
def test_attention_choice(attention, precision, dropout, fused):
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=dropout, attention=attention)
    assert M.fused_attention(cfg, precision) == fused


def test_compiling_for_names_the_backend_the_model_is_traced_for():
    """model.compiling_for("gpu") on any machine: cuDNN attention under auto, no CPU layout pins (an ahead-of-time
    compile for a GPU, benchmarks/roofline.py); outside it, jax's default backend again."""
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0, attention="auto")
    pinned = lambda: "layout" in str(jax.make_jaxpr(lambda x: M._row_major(x))(jnp.ones((4, 8))))  # a fresh trace
    with M.compiling_for("gpu"):
        assert M.backend() == "gpu" and M.fused_attention(cfg, "bf16") and not pinned()
    assert M.backend() == jax.default_backend()
    assert pinned() == (jax.default_backend() == "cpu")
    assert M.fused_attention(cfg, "bf16") == (jax.default_backend() == "gpu")


@pytest.mark.parametrize("precision,dropout", [("fp32", 0.0), ("bf16", 0.1)] + (
    [] if jax.default_backend() == "gpu" else [("bf16", 0.0)]))
def test_cudnn_attention_where_it_cannot_run_is_a_user_error(precision, dropout):
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=dropout, attention="cudnn")
    with pytest.raises(UserError, match="model.attention=cudnn needs"):
        M.fused_attention(cfg, precision)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_the_written_out_one():
    cfg = ModelConfig(seq_len=128, n_layer=2, n_head=4, d_model=256)
    graphdef_xla, params = M.init_params(dataclasses.replace(cfg, attention="xla"), vocab_size=V, precision="bf16",
                                         seed=0)
    graphdef_cudnn = M.graphdef(dataclasses.replace(cfg, attention="cudnn"), vocab_size=V, precision="bf16")
    idx = _idx(B=4, T=128)
    # Both take bf16 q, k, v and accumulate in fp32; they differ in where probabilities are rounded to bf16.
    assert _rel_err(apply(graphdef_cudnn, params, idx).astype(jnp.float32),
                    apply(graphdef_xla, params, idx).astype(jnp.float32)) < 0.01


def _grad_fn(remat: str, precision: str = "fp32"):
    cfg = dataclasses.replace(SMALL, remat=remat)
    graphdef, params = M.init_params(cfg, vocab_size=V, precision=precision, seed=0)
    return jax.jit(jax.grad(lambda p, idx: apply(graphdef, p, idx).astype(jnp.float32).std())), params


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_the_same_gradient(remat):
    """Recomputing the forward in the backward pass changes no math: fp32 gradients agree to rounding (measured
    4e-7 relative on a larger model; XLA may fuse the recomputation differently)."""
    (plain, params), (rematted, _) = _grad_fn("none"), _grad_fn(remat)
    for a, b in zip(jax.tree.leaves(rematted(params, _idx())), jax.tree.leaves(plain(params, _idx()))):
        assert _rel_err(a, b) < 1e-5


def test_remat_recomputes_what_its_policy_does_not_keep():
    """Dots in the gradient's program: none computes each forward dot once; full recomputes in the backward pass
    every forward dot whose output the backward needs (c_attn, q k^T, probs v, attn.c_proj, c_fc: all but the
    MLP's c_proj, whose output only joins the residual stream); dots keeps the weight matmuls' outputs and
    recomputes only attention's two batched dots."""
    count = {}
    for remat in ("none", "full", "dots"):
        grad, params = _grad_fn(remat)
        count[remat] = len(_dots(grad.lower(params, _idx()).as_text()))
    assert count["full"] - count["none"] == SMALL.n_layer * 5
    assert count["dots"] - count["none"] == SMALL.n_layer * 2


def _erf_gelu(x):
    return 0.5 * x * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


def test_mlp_uses_exact_gelu():
    x = jnp.linspace(-5, 5, 1001)
    np.testing.assert_allclose(M.gelu(x), _erf_gelu(x), atol=1e-6)
    assert jnp.abs(jax.nn.gelu(x, approximate=True) - _erf_gelu(x)).max() > 1e-4
    mlp = M.MLP(SMALL, precision="fp32", rngs=nnx.Rngs(0))
    x_BxTxD = 20 * jax.random.normal(jax.random.key(0), (2, 4, 32))  # pre-activations span about [-7, 7]
    h = mlp.c_fc(x_BxTxD)
    exact, tanh = mlp.c_proj(_erf_gelu(h)), mlp.c_proj(jax.nn.gelu(h, approximate=True))
    out = mlp(x_BxTxD, None)
    np.testing.assert_allclose(out, exact, atol=1e-7)
    assert jnp.abs(out - tanh).max() > 1e-6


def _gelu_and_grad(x, dy, gelu=M.gelu):
    """gelu(x) and its gradient with cotangent dy, each in x's dtype; model.gelu unless told."""
    y, vjp = jax.vjp(gelu, x)
    return y, vjp(dy)[0]


def _torch_gelu_and_grad(x, dy):
    """torch.nn.functional.gelu(x) (exact erf) and its autograd gradient with cotangent dy."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    x_t = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).requires_grad_(True)
    y_t = torch.nn.functional.gelu(x_t)
    y_t.backward(torch.from_numpy(np.asarray(dy, np.float32)).to(torch.bfloat16))
    return y_t.detach().float().numpy(), x_t.grad.float().numpy()


def _multiples(key, shape, step, bound):
    """Random multiples of `step` in [-bound, bound]: exact in bf16 when bound / step <= 256, and sums of their
    products stay exact in fp32, so every result below is a sum rounded once to bf16, whatever the summation order."""
    return step * jax.random.randint(jax.random.key(key), shape, -int(bound / step), int(bound / step) + 1)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_linear_bf16_is_torchs(bias, platform):
    """Linear under bf16 against torch.nn.functional.linear under torch.autocast: the output and the gradients of
    the input, weight and bias, bit for bit. The operands are chosen so that every fp32 sum is exact (_multiples;
    the bias's entries, multiples of 2^-10 below 2, need more bits than bf16 has), so both sides can differ only
    in what they round: autocast rounds the bias to bf16 before adding it and returns its gradient rounded to bf16.
    Traced for a CPU and for a GPU (model.compiling_for; run here), where the dots round their own results."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    x, w, g = _multiples(0, (4, 16, 16), 2.0 ** -3, 2), _multiples(1, (16, 8), 2.0 ** -3, 2), _multiples(
        2, (4, 16, 8), 2.0 ** -4, 4)
    b = _multiples(3, (8,), 2.0 ** -10, 2)
    linear = M.Linear(16, 8, bias=bias, std=0.02, precision="bf16", rngs=nnx.Rngs(0))
    linear.kernel[...] = w
    if bias:
        linear.bias[...] = b
    graphdef, state = nnx.split(linear)
    with M.compiling_for(platform):
        y, vjp = jax.vjp(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)), state, x)
        d_state, dx = vjp(g.astype(jnp.bfloat16))

    t = lambda a: torch.from_numpy(np.array(a, np.float32)).requires_grad_(True)
    x_t, w_t, b_t = t(x), t(w.T), t(b) if bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_t = torch.nn.functional.linear(x_t, w_t, b_t)
    y_t.backward(torch.from_numpy(np.array(g, np.float32)).to(torch.bfloat16))
    assert y.dtype == jnp.bfloat16 and y_t.dtype == torch.bfloat16
    np.testing.assert_array_equal(np.asarray(y, np.float32), y_t.detach().float().numpy())
    np.testing.assert_array_equal(dx, x_t.grad.numpy())
    np.testing.assert_array_equal(d_state["kernel"][...], w_t.grad.numpy().T)
    if bias:
        np.testing.assert_array_equal(d_state["bias"][...], b_t.grad.numpy())


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
        assert np.all(np.abs(got - want) <= _ulp(want, jnp.bfloat16) + ERF_ABS * scale)
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


def _compiled_dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in optimized HLO text, operands looked up by their definitions."""
    defined = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    operands = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return [(defined[lhs], defined[rhs]) for lhs, rhs in operands]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's rule for which dots stay bf16")
@pytest.mark.parametrize("tie", [True, False])
def test_compiled_cpu_gradient_keeps_every_dot_bf16(tie):
    """XLA:CPU converts a bf16 dot whose left operand contracts along columns to fp32 (the weight gradients, x^T g,
    were such dots: 2 per Linear and per attention matmul); model._row_major lays the transposes out so none is.
    d_model 64 and 32 tokens keep every dot above YNNPACK's size floor (8)."""
    cfg = dataclasses.replace(SMALL, d_model=64, tie_embeddings=tie)
    graphdef, params = _init(cfg, precision="bf16")
    grad = jax.jit(jax.grad(lambda p, idx: apply(graphdef, p, idx).astype(jnp.float32).std()))
    types = _compiled_dot_operand_types(grad.lower(params, _idx(B=2)).compile().as_text())
    assert len(types) >= 3 * (4 * cfg.n_layer + 1) and set(types) == {("bf16", "bf16")}
