"""jaxtrain.model alone: shapes, causality, names, init, tying, dropout, the bf16 policy through the model (dtypes,
the gradient dots, Linear against torch, the compiled CPU dots), attention choice, remat, exact GELU in the MLP."""

import collections
import contextlib
import dataclasses
import types
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import compiled_hlo
from compiled_hlo import traced_for
from jaxtrain import autocast, kernel_choice, model as M
from jaxtrain.config import ModelConfig
from jaxtrain.errors import UserError
from jaxtrain.mesh import AUTO_AXES

V = 97
SMALL = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
apply = jax.jit(M.apply, static_argnums=0)  # op-by-op dispatch would make these tests several times slower
# A bf16 step compiles keeping every rounding the program writes on this machine's backend (step.compiler_options):
# the bit-for-bit tests against torch compile so too (on a GPU, without it, XLA dropped some: benchmarks/NOTES.md).
AS_THE_STEP = autocast.rounding_options(jax.default_backend())


def _init(cfg=SMALL, precision="fp32", seed=0):
    return M.init_params(cfg, vocab_size=V, precision=precision, seed=seed)


def _idx(B=3, T=16, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V, jnp.int32)


def _rel_err(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


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
    # Positions before t see identical inputs through identical ops, and the masked scores add exact zeros
    # (exp(-inf)): bit for bit (measured 0). A changed token moves the logits from t on by O(1) (measured 0.57).
    np.testing.assert_array_equal(after[:, :t], before[:, :t])
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
    # Dropout 0.1 zeroes a tenth of the activations: the logits move by O(0.1) (measured 0.19 and 0.29 below).
    assert not np.allclose(apply(graphdef, params, idx, dropout_key=k1), reference, atol=1e-3)
    assert not np.allclose(apply(graphdef, params, idx, dropout_key=k1),
                           apply(graphdef, params, idx, dropout_key=k2), atol=1e-3)
    np.testing.assert_array_equal(apply(graphdef_no_drop, params, idx, dropout_key=k1), reference)


def test_bf16_policy_dtypes():
    linear = M.Linear(8, 4, bias=True, std=0.02, precision="bf16", rngs=nnx.Rngs(0))
    assert linear(jnp.ones((2, 8))).dtype == jnp.bfloat16  # autocast's linear output
    assert M.LayerNorm(8, bias=True)(jnp.ones((2, 8), jnp.bfloat16)).dtype == jnp.float32
    assert autocast.matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((8, 4)), "bf16").dtype == jnp.float32


def test_bf16_forward_close_to_fp32():
    graphdef_32, params = _init(precision="fp32")
    graphdef_16, _ = _init(precision="bf16")
    idx = _idx()
    err = _rel_err(apply(graphdef_16, params, idx), apply(graphdef_32, params, idx))
    # Each bf16 rounding is off by <= 2^-9 relative and the roundings are independent, so they average out in the
    # dots: the logits' RMS relative error is about bf16's epsilon 2^-8 = 0.4% (measured 0.3%), not growing with d.
    assert 1e-4 < err < 0.01


@pytest.mark.parametrize("platform", ["cpu", "cpu-onednn", "gpu"])
@pytest.mark.parametrize("precision,bias", [("bf16", True), ("bf16", False), ("fp32", True)])
def test_model_gradient_dots_follow_the_policy(precision, bias, platform):
    """Every dot takes the compute dtype's operands and accumulates in fp32. Traced for a CPU, every one returns
    fp32 (rounded after it where it must be); traced for a GPU (autocast.compiling_for), a dot whose result is rounded
    to bf16 next returns bf16 itself (_rounding_dot_dtype): the head's forward, the forward of the four Linears per
    layer (a bias rides in the gemm as a row of weights: autocast.biased_matmul) and, in the backward pass, the
    gradient of the activations a weight multiplies (the head's, and four Linears' per layer); weight gradients
    stay fp32, and so do the written-out attention's (on a GPU, cuDNN's kernel runs attention). Traced for a CPU
    whose dots are oneDNN's (autocast.onednn_dots), every one returns bf16: those too. Under fp32, every dot is true
    fp32, on GPU/TPU too, whose default precision may use bf16 passes."""
    graphdef, params = _init(dataclasses.replace(SMALL, bias=bias), precision=precision)
    with traced_for(platform):  # M.apply, not this module's jitted apply: its trace cache ignores the platform
        hlo = jax.jit(jax.grad(lambda p, idx: M.apply(graphdef, p, idx).std())).lower(params, _idx()).as_text()
    dots = collections.Counter(compiled_hlo.dot_types(hlo))
    if precision == "bf16" and platform == "cpu-onednn":
        assert set(dots) == {("bf16", "bf16", "bf16")}
    elif precision == "bf16":
        rounding_dots = 2 + 8 * SMALL.n_layer if platform == "gpu" else 0
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
    assert kernel_choice.fused_attention(cfg, precision) == fused


def test_compiling_for_names_the_backend_the_model_is_traced_for():
    """autocast.compiling_for("gpu") on any machine: cuDNN attention under auto, no CPU layout pins (an ahead-of-time
    compile for a GPU, benchmarks/roofline.py); outside it, jax's default backend again."""
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=0.0, attention="auto")
    pinned = lambda: "layout" in str(jax.make_jaxpr(lambda x: autocast.row_major(x))(jnp.ones((4, 8))))  # a fresh trace
    with autocast.compiling_for("gpu"):
        assert autocast.backend() == "gpu" and kernel_choice.fused_attention(cfg, "bf16") and not pinned()
    assert autocast.backend() == jax.default_backend()
    assert pinned() == (jax.default_backend() == "cpu")
    assert kernel_choice.fused_attention(cfg, "bf16") == (jax.default_backend() == "gpu")


@pytest.mark.parametrize("precision,dropout", [("fp32", 0.0), ("bf16", 0.1)] + (
    [] if jax.default_backend() == "gpu" else [("bf16", 0.0)]))
def test_cudnn_attention_where_it_cannot_run_is_a_user_error(precision, dropout):
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=32, dropout=dropout, attention="cudnn")
    with pytest.raises(UserError, match="model.attention=cudnn needs"):
        kernel_choice.fused_attention(cfg, precision)


@pytest.mark.parametrize("d_model, n_head", [(48, 4), (96, 8), (80, 8), (272, 2), (1024, 2)])  # 12, 12, 10, 136, 512
def test_auto_attention_writes_out_a_head_size_cudnn_refuses(d_model, n_head, monkeypatch):
    """cuDNN's flash attention takes head sizes that are a multiple of 8, up to 128 (256 on a Hopper or later GPU,
    where one is local) only: jax's cudnn path raises NotImplementedError on any other (check_is_flash_attention).
    model.attention=auto on a GPU under bf16 went to it whatever the head size, so such a config stopped on a GPU
    with that traceback; now auto writes attention out there, and model.attention=cudnn is refused naming the head
    size. The GPU is compiling_for's, its cuDNN a stand-in that refuses as jax's does."""
    local = jax.devices()[0]
    hopper = local.platform == "gpu" and tuple(map(int, local.compute_capability.split("."))) >= (9, 0)
    largest = 256 if hopper else 128

    def cudnn(q, k, v, **kwargs):
        if q.shape[-1] % 8 or q.shape[-1] > largest:
            raise NotImplementedError(f"The head dim must be <= {largest} and a multiple of 8, got {q.shape[-1]}")
        return q
    monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn)
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=n_head, d_model=d_model)
    with autocast.compiling_for("gpu"):  # abstract params: a concrete init compiled each new shape's ops, 2-3 s
        graphdef, params = nnx.eval_shape(lambda: M.init_params(cfg, vocab_size=V, precision="bf16", seed=0))
        assert jax.eval_shape(lambda p, idx: M.apply(graphdef, p, idx), params, _idx()).shape == (3, 16, V)
        with pytest.raises(UserError, match=f"a multiple of 8 .*head size {d_model // n_head}"):
            kernel_choice.fused_attention(dataclasses.replace(cfg, attention="cudnn"), "bf16")
        head_size_8 = dataclasses.replace(cfg, d_model=8 * n_head)
        assert kernel_choice.fused_attention(head_size_8, "bf16")  # cuDNN's


@pytest.mark.parametrize("platform_version, capability, largest", [
    ("cuda 12080", "10.0", 256), ("cuda 12080", "9.0", 256), ("cuda 12080", "8.9", 128), ("cuda 12080", "8.0", 128),
    ("cuda 12080", "7.0", 0), ("rocm 60300", None, 0)])
def test_cudnn_attention_is_picked_only_on_gpus_cudnn_runs_it_on(platform_version, capability, largest, monkeypatch):
    """cuDNN's SDPA needs an NVIDIA GPU of SM80 or later (its support matrix) and takes head sizes up to 256 from
    Hopper on, 128 before (jax's check_is_flash_attention): on a V100 or an AMD GPU (jax's "gpu" too) auto took it
    and the run stopped in cuDNN. The local GPU here is a stand-in with the fields jax's check reads."""
    device = types.SimpleNamespace(client=types.SimpleNamespace(platform_version=platform_version),
                                   compute_capability=capability, platform="gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: [device])
    assert kernel_choice.cudnn_max_head_size() == largest
    cfg = ModelConfig(seq_len=16, n_layer=1, n_head=2, d_model=128)  # head size 64
    with autocast.compiling_for("gpu"):
        assert kernel_choice.fused_attention(cfg, "bf16") == (largest > 0)
        if not largest:
            with pytest.raises(UserError, match="an NVIDIA GPU of compute capability 8.0 or later"):
                kernel_choice.fused_attention(dataclasses.replace(cfg, attention="cudnn"), "bf16")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs an NVIDIA GPU")
def test_cudnn_attention_matches_the_written_out_one():
    cfg = ModelConfig(seq_len=128, n_layer=2, n_head=4, d_model=256)
    graphdef_xla, params = M.init_params(dataclasses.replace(cfg, attention="xla"), vocab_size=V, precision="bf16",
                                         seed=0)
    graphdef_cudnn = M.graphdef(dataclasses.replace(cfg, attention="cudnn"), vocab_size=V, precision="bf16")
    idx = _idx(B=4, T=128)
    # Both take bf16 q, k, v and accumulate in fp32; they differ in where probabilities are rounded to bf16. The
    # logits alone are rounded to bf16 on each side (2^-9 relative), so they may differ by ~2^-8 = 0.004 before the
    # probabilities' roundings: 0.01 is 2.5x that (derived; the assert prints the measured value on a GPU).
    err = _rel_err(apply(graphdef_cudnn, params, idx).astype(jnp.float32),
                   apply(graphdef_xla, params, idx).astype(jnp.float32))
    assert err < 0.01, f"cuDNN's attention against the written-out one: relative error {err:.2e}"


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
        count[remat] = len(compiled_hlo.dot_types(grad.lower(params, _idx()).as_text()))
    assert count["full"] - count["none"] == SMALL.n_layer * 5
    assert count["dots"] - count["none"] == SMALL.n_layer * 2


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_keeps_the_stream_added_up_at_each_block(remat):
    """A block hands on x and its MLP's output not yet added (the next norm kernel adds them), but under remat a
    block's inputs are what the backward pass keeps: each checkpointed block takes the stream as one B x T x D
    tensor, added before it, not the pair (a B x T x D more a layer: gpt-1b on an H100, 28.36 -> 29.43 GiB)."""
    graphdef, params = _init(dataclasses.replace(SMALL, remat=remat))
    jaxpr = jax.make_jaxpr(lambda p, idx: M.apply(graphdef, p, idx))(params, _idx()).jaxpr
    stream_shape = (3, SMALL.seq_len, SMALL.d_model)
    blocks = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "remat2"]  # jax.checkpoint's primitive
    assert len(blocks) == SMALL.n_layer
    assert all(sum(v.aval.shape == stream_shape for v in eqn.invars) == 1 for eqn in blocks)


def test_remat_dots_keeps_the_column_blocks():
    """Linear.column_blocks' gemms (q, k and v, where attention is cuDNN's) run inside a custom_vjp, whose dots
    remat's dots policy does not see: named, the blocks are kept, and the backward pass recomputes none of them.
    Dots in the gradient's program: the three blocks' forward gemms and the backward's one dx and a dw a block
    (autocast.block_weight_grads): 7, as without remat; full recomputes the three blocks (10)."""
    graphdef, state = nnx.split(M.Linear(16, 24, bias=True, std=0.02, precision="bf16", rngs=nnx.Rngs(0)))

    def loss(state, x):
        q, k, v = nnx.merge(graphdef, state).column_blocks(x, 3)
        return jnp.sum((q * k * v).astype(jnp.float32))  # the backward pass needs all three blocks

    assert _dots_under_each_remat(loss, state) == {"none": 7, "dots": 7, "full": 10}


def test_remat_dots_keeps_a_bias_row_gemm_on_an_input_padded_there():
    """On a GPU a Linear whose input comes without the bias row's ones columns (attn.c_proj's, from cuDNN's
    attention) pads it inside a custom_vjp (autocast.biased_matmul), whose dot remat's dots policy does not see:
    named, its output is kept. Dots in the gradient's program: the forward gemm, the backward's dx and dw (3), as
    without remat; full recomputes the forward (4)."""
    with autocast.compiling_for("gpu"):
        graphdef, state = nnx.split(M.Linear(16, 8, bias=True, std=0.02, precision="bf16", rngs=nnx.Rngs(0)))
        loss = lambda state, x: jnp.sum(jnp.square(nnx.merge(graphdef, state)(x).astype(jnp.float32)))
        assert _dots_under_each_remat(loss, state) == {"none": 3, "dots": 3, "full": 4}


def _dots_under_each_remat(loss, state) -> dict:
    """The dots in the compiled program of loss's value and gradient (with respect to state and x), under each of
    model.remat's settings."""
    x = jax.random.normal(jax.random.key(0), (2, 8, 16))
    policies = {"none": None, **M.REMAT_POLICIES}
    return {remat: len(compiled_hlo.dot_types(jax.jit(jax.value_and_grad(  # the loss too: forward dots stay
        jax.checkpoint(loss, policy=policy) if policy else loss, (0, 1))).lower(state, x).as_text()))
        for remat, policy in policies.items()}


def _erf_gelu(x):
    return 0.5 * x * (1 + jax.scipy.special.erf(x / math.sqrt(2)))


def test_mlp_uses_exact_gelu():
    x = jnp.linspace(-5, 5, 1001)
    # The same fp32 formula, x / sqrt 2 here and x sqrt(1/2) there: a rounding apart at most (measured 0; an fp32
    # ulp of 5 is 4.8e-7). The tanh approximation errs by up to 4.7e-4 on [-5, 5] (measured), 5x the 1e-4.
    np.testing.assert_allclose(autocast.gelu(x), _erf_gelu(x), atol=1e-6)
    assert jnp.abs(jax.nn.gelu(x, approximate=True) - _erf_gelu(x)).max() > 1e-4
    mlp = M.MLP(SMALL, precision="fp32", rngs=nnx.Rngs(0))
    x_BxTxD = 20 * jax.random.normal(jax.random.key(0), (2, 4, 32))  # pre-activations span about [-7, 7]
    h = mlp.c_fc(x_BxTxD)
    exact, tanh = mlp.c_proj(_erf_gelu(h)), mlp.c_proj(jax.nn.gelu(h, approximate=True))
    out = mlp(x_BxTxD, None)
    # fp32, the same dots on the same GELU values: measured 0 (atol: one fp32 ulp of outputs below 1). With the
    # tanh approximation the output moves by 9e-5 (measured), 90x the 1e-6.
    np.testing.assert_allclose(out, exact, atol=1e-7)
    assert jnp.abs(out - tanh).max() > 1e-6


def _multiples(key, shape, step, bound):
    """Random multiples of `step` in [-bound, bound]: exact in bf16 when bound / step <= 256, and sums of their
    products stay exact in fp32, so every result below is a sum rounded once to bf16, whatever the summation order."""
    return step * jax.random.randint(jax.random.key(key), shape, -int(bound / step), int(bound / step) + 1)


def _jitted_vjp(f, g, *args):
    """(f(*args), the gradients of <f(*args), g> for args), forward and backward in one compile, as the train step
    compiles them: with its XLA options on this backend (a nested jit may not take compile options)."""
    def forward_backward(g, *args):
        y, vjp = jax.vjp(f, *args)
        return y, vjp(g)
    return jax.jit(forward_backward, compiler_options=AS_THE_STEP)(g, *args)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_linear_bf16_is_torchs(bias, platform):
    """Linear under bf16 against torch.nn.functional.linear under torch.autocast: the output and the gradients of
    the input, weight and bias, bit for bit. The operands are chosen so that every fp32 sum is exact (_multiples;
    the bias's entries, multiples of 2^-10 below 2, need more bits than bf16 has), so both sides can differ only
    in what they round: autocast rounds the bias to bf16 before adding it and returns its gradient rounded to bf16.
    Traced for a CPU and for a GPU (autocast.compiling_for; run here), where the dots round their own results."""
    import torch  # the [test] extra installs it: a failure to import is a failure, not a skip
    x, w, g = _multiples(0, (4, 16, 16), 2.0 ** -3, 2), _multiples(1, (16, 8), 2.0 ** -3, 2), _multiples(
        2, (4, 16, 8), 2.0 ** -4, 4)
    b = _multiples(3, (8,), 2.0 ** -10, 2)
    linear = M.Linear(16, 8, bias=bias, std=0.02, precision="bf16", rngs=nnx.Rngs(0))
    linear.kernel[...] = w
    if bias:
        linear.bias[...] = b
    graphdef, state = nnx.split(linear)
    with autocast.compiling_for(platform):
        y, (d_state, dx) = _jitted_vjp(lambda s, x: nnx.merge(graphdef, s)(x), g.astype(jnp.bfloat16), state, x)

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


@pytest.mark.parametrize("head_size", [16, 32, 64])  # 1/sqrt(32) is not a power of 2: the scaling rounds too
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_written_out_attention_bf16_is_torchs(head_size, platform):
    """The written-out attention under bf16 against torchref's expression under torch.autocast (copied here): the
    output and q's, k's and v's gradients, bit for bit. autocast rounds q k^T to bf16 and rounds it again when it
    scales it, before the fp32 softmax; jaxtrain kept the scores in fp32, and half the outputs differed. The
    operands make every dot's fp32 sum exact (_multiples); the softmax's fp32 differences (exp, sum order) stay
    below the bf16 roundings after it on these inputs (measured: none). Traced for a CPU and for a GPU."""
    import torch
    B, T, H = 2, 32, 2
    q, k, v = (_multiples(i, (B, T, H, head_size), 2.0 ** -3, 2) for i in range(3))
    g = _multiples(3, (B, T, H, head_size), 2.0 ** -4, 4)
    attention = M.CausalSelfAttention(ModelConfig(seq_len=T, n_layer=1, n_head=H, d_model=H * head_size),
                                      precision="bf16", rngs=nnx.Rngs(0))
    with autocast.compiling_for(platform):
        y, grads = _jitted_vjp(lambda q, k, v: attention._written_out(q, k, v, None), g.astype(jnp.bfloat16),
                               *(a.astype(jnp.bfloat16) for a in (q, k, v)))

    def leaf(a):  # (B, H, T, hs), as torchref's attention holds them
        return torch.from_numpy(np.array(a, np.float32)).to(torch.bfloat16).transpose(1, 2).requires_grad_(True)
    q_t, k_t, v_t = leaf(q), leaf(k), leaf(v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        att = (q_t @ k_t.transpose(-2, -1)) * (1.0 / math.sqrt(head_size))
        att = att.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
        y_t = (torch.softmax(att.float(), dim=-1) @ v_t).transpose(1, 2)
    y_t.backward(torch.from_numpy(np.array(g, np.float32)).to(torch.bfloat16))
    as_np = lambda a: np.asarray(a, np.float32)
    np.testing.assert_array_equal(as_np(y), y_t.detach().float().numpy())
    for grad, leaf_t in zip(grads, (q_t, k_t, v_t)):
        np.testing.assert_array_equal(as_np(grad), leaf_t.grad.transpose(1, 2).float().numpy())


def _compiled_dot_operand_types(hlo: str) -> list[tuple[str, str]]:
    """(lhs, rhs) element types of every dot in optimized HLO text, operands looked up by their definitions."""
    defined = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    operands = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    return [(defined[lhs], defined[rhs]) for lhs, rhs in operands]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's rule for which dots stay bf16")
@pytest.mark.parametrize("tie", [True, False])
def test_compiled_cpu_gradient_keeps_every_dot_bf16(tie):
    """XLA:CPU converts a bf16 dot whose left operand contracts along columns to fp32 (the weight gradients, x^T g,
    were such dots: 2 per Linear and per attention matmul); autocast.row_major lays the transposes out so none is.
    d_model 64 and 32 tokens keep every dot above YNNPACK's size floor (8)."""
    cfg = dataclasses.replace(SMALL, d_model=64, tie_embeddings=tie)
    graphdef, params = _init(cfg, precision="bf16")
    grad = jax.jit(jax.grad(lambda p, idx: apply(graphdef, p, idx).astype(jnp.float32).std()))
    types = _compiled_dot_operand_types(grad.lower(params, _idx(B=2)).compile().as_text())
    assert len(types) >= 3 * (4 * cfg.n_layer + 1) and set(types) == {("bf16", "bf16")}


@pytest.mark.parametrize("attention, fsdp, blocks", [("cudnn", None, True), ("cudnn", 1, True), ("cudnn", 2, False),
                                                    ("xla", None, False)])
def test_qkv_are_three_gemms_where_attention_is_cudnns_and_the_weights_whole(attention, fsdp, blocks, monkeypatch):
    """c_attn writes q, k and v as three gemms (Linear.column_blocks, their outputs named GEMM_BLOCKS) only where
    cuDNN's attention takes them as three arrays and the mesh traced under keeps each weight whole (fsdp 1, or no
    mesh); split over 2 devices it is one gemm sliced, as with the written-out attention (traced for a GPU; jax
    traces cuDNN's attention only where cuDNN is installed, so a stand-in of its shape takes its place)."""
    monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kwargs: q + k + v)
    cfg = dataclasses.replace(SMALL, attention=attention)
    mesh = jax.sharding.AbstractMesh((4 // fsdp, fsdp), ("data", "fsdp"), axis_types=AUTO_AXES) if fsdp else None
    with autocast.compiling_for("gpu"):
        graphdef, params = _init(cfg, precision="bf16")
        idx = _idx(B=4)  # outside the abstract mesh: jax 0.12.0.1 refuses to run anything concrete in one
        with jax.sharding.use_abstract_mesh(mesh) if mesh else contextlib.nullcontext():
            jaxpr = str(jax.make_jaxpr(lambda p, idx: M.apply(graphdef, p, idx))(params, idx))
    assert jaxpr.count(f"name={M.GEMM_BLOCKS}") == (3 * SMALL.n_layer if blocks else 0)
