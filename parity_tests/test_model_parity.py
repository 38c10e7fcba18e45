"""Component 6, the model: jaxtrain's GPT (fp32) vs torchref's GPT on the same weights (copied through
model.torch_names) and the same batch: forward logits, and the gradient of the production losses (step.ce_sum,
run.cross_entropy_sum) for every parameter, tied and untied. torchref's GPT in float64 is the truth both fp32
sides are measured against (FP32_SIDE_RTOL each, FP32_CROSS_RTOL between them; derivation in conftest).

The weights are drawn at unit activation scale (matrices N(0, 1/fan_in), LayerNorm gains 1 + N(0, 0.1), biases
N(0, 0.1)), not GPT-2's 0.02 init: under that init the MLP's pre-activations are ~0.1, where tanh GELU equals
erf GELU to ~1e-7, and zero biases would hide a swapped bias. Then each known trap is pinned by a test that puts
the trap into torchref's side and shows the same comparison failing by far more than its tolerance.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxtrain import kernel_choice, model, step
from parity_tests.conftest import (FP32_CROSS_RTOL, FP32_SIDE_RTOL, assert_close, assert_named_close,
                                   from_torch_layout, jax_gpt, make_cfg, report, torch_grads, torch_layout)
from torchref import run
from torchref.model import GPT, upcast

pytestmark = pytest.mark.usefixtures("one_torch_thread")
B, T, V = 3, 16, 64
TINY_EMB_STD = 1e-3  # residual stream variance ~1e-6 entering ln_1: LayerNorm's eps (1e-5) dominates it


def cfg_for(tied: bool):
    return make_cfg(f"--model.tie_embeddings={str(tied).lower()}")


@functools.cache
def parity_weights(tied: bool, emb_std: float = 1.0) -> dict[str, np.ndarray]:
    """{torch name: fp32 array} at unit activation scale (module docstring); emb_std scales wte and wpe."""
    rng = np.random.default_rng(1)
    weights = {}
    for n, p in GPT(cfg_for(tied).model).named_parameters():
        shape = tuple(p.shape)
        if n.endswith(("wte.weight", "wpe.weight")):
            x = emb_std * rng.standard_normal(shape)
        elif n.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            x = 1 + 0.1 * rng.standard_normal(shape)
        elif p.ndim == 1:
            x = 0.1 * rng.standard_normal(shape)
        else:  # Linear (out, in)
            x = rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[n] = x.astype(np.float32)
    return weights


def batch():
    rng = np.random.default_rng(2)
    idx = rng.integers(0, V, (B, T))
    targets = rng.integers(0, V, (B, T))
    targets[0, 10:] = -1  # padding is ignored by both losses
    return idx, targets


def torch_side(tied: bool, weights: dict, dtype=torch.float32, idx=None, mutate=None, cfg=None):
    """torchref's logits (at least fp32) and loss gradients {name: array}; `mutate(module)` plants a trap first.
    `cfg`: cfg_for(tied) unless given; under train.precision=bf16 the forward runs under CPU autocast."""
    cfg = cfg or cfg_for(tied)
    module = GPT(cfg.model).to(dtype)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(torch.from_numpy(weights[n]))
    if mutate is not None:
        mutate(module)
    x, y = batch()
    x = torch.from_numpy(x if idx is None else idx)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.precision == "bf16"):
        logits = module(x)
    y = torch.from_numpy(y)
    (run.cross_entropy_sum(logits, y) / (y >= 0).sum()).backward()
    return upcast(logits).detach().numpy(), torch_grads(module)


def _logits_and_grads(graphdef, params, idx, targets):
    def loss(params):
        logits = model.apply(graphdef, params, idx)
        ce, n = step.ce_sum(logits, targets)
        return ce / n, logits
    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


@functools.cache
def _jitted(options: tuple, onednn: bool):
    """_logits_and_grads jitted with the XLA options (key, value) pairs the train step compiles with, traced for the
    dots they ask for (step.traced_for_dots)."""
    return jax.jit(step.traced_for_dots(_logits_and_grads, onednn), static_argnums=0, compiler_options=dict(options))


def jax_side(tied: bool, weights: dict, idx=None, untransposed_square=False, cfg=None):
    """jaxtrain's logits (at least fp32) and loss gradients in torch layout, compiled as the train step compiles
    (step.compiler_options). untransposed_square: the Linear-transpose trap, square torch weights copied as they are
    (the only ones whose shape lets the mistake through). `cfg`: cfg_for(tied) unless given."""
    cfg = cfg or cfg_for(tied)
    graphdef, template = jax_gpt(cfg.model, cfg.train.precision)
    names = model.torch_names(template)
    if untransposed_square:
        names = {n: (path, t and weights[n].shape[0] != weights[n].shape[1]) for n, (path, t) in names.items()}
    params = from_torch_layout(template, weights, names)
    x, y = batch()
    onednn = kernel_choice.onednn_dots(cfg.model, cfg.train.precision)
    logits, grads = _jitted(tuple(step.compiler_options(cfg).items()), onednn)(
        graphdef, params, jnp.asarray(x if idx is None else idx, jnp.int32), jnp.asarray(y, jnp.int32))
    return np.asarray(logits, np.promote_types(logits.dtype, np.float32)), torch_layout(grads, names)


def scale_close(got, want, rtol, what):
    """assert_close relative to the tensor's scale, max |want| (rounding is relative to the terms summed)."""
    return assert_close(got, want, atol=rtol * float(np.abs(want).max()), what=what)


def scale_diff(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


WEIGHTS = {"unit scale": 1.0, "tiny-variance embeddings": TINY_EMB_STD}


@pytest.mark.parametrize("emb", list(WEIGHTS))
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_and_gradients_match(tied, emb):
    weights = parity_weights(tied, WEIGHTS[emb])
    case = f"{'tied' if tied else 'untied'}, {emb}"
    j_logits, j_grads = jax_side(tied, weights)
    t_logits, t_grads = torch_side(tied, weights)
    truth_logits, truth_grads = torch_side(tied, weights, torch.float64)
    assert sorted(j_grads) == sorted(t_grads), "the two GPTs name different parameters"

    scale_close(j_logits, truth_logits, FP32_SIDE_RTOL, f"jaxtrain logits vs fp64 ({case})")
    scale_close(t_logits, truth_logits, FP32_SIDE_RTOL, f"torchref logits vs fp64 ({case})")
    scale_close(j_logits, t_logits, FP32_CROSS_RTOL, f"logits, jaxtrain vs torchref ({case})")
    report(f"model {case}: logits max diff / max |logit|", scale_diff(j_logits, t_logits), FP32_CROSS_RTOL)

    assert_named_close(j_grads, truth_grads, scale_atol=FP32_SIDE_RTOL, what=f"jaxtrain gradient vs fp64 ({case})")
    assert_named_close(t_grads, truth_grads, scale_atol=FP32_SIDE_RTOL, what=f"torchref gradient vs fp64 ({case})")
    assert_named_close(j_grads, t_grads, scale_atol=FP32_CROSS_RTOL, what=f"gradient, jaxtrain vs torchref ({case})")
    worst = max(scale_diff(j_grads[n], t_grads[n]) for n in t_grads)
    report(f"model {case}: per-param gradient max diff / max |grad|, worst param", worst, FP32_CROSS_RTOL)


def test_a_tanh_gelu_model_matches():
    """model.gelu_approximate=tanh (GPT-2's own GELU, for its checkpoints) on both sides: the same comparison as
    above, fp32 against the fp64 truth and against each other; the exact-GELU model's logits differ from it by far
    more (so the option acts on both sides: test_trap_tanh_gelu shows that on torchref's, this on jaxtrain's)."""
    weights, cfg = parity_weights(True), make_cfg("--model.gelu_approximate=tanh")
    j_logits, j_grads = jax_side(True, weights, cfg=cfg)
    t_logits, t_grads = torch_side(True, weights, cfg=cfg)
    truth_logits, truth_grads = torch_side(True, weights, torch.float64, cfg=cfg)
    scale_close(j_logits, truth_logits, FP32_SIDE_RTOL, "jaxtrain logits vs fp64 (tanh GELU)")
    scale_close(j_logits, t_logits, FP32_CROSS_RTOL, "logits, jaxtrain vs torchref (tanh GELU)")
    assert_named_close(j_grads, truth_grads, scale_atol=FP32_SIDE_RTOL, what="jaxtrain gradient vs fp64 (tanh GELU)")
    assert_named_close(j_grads, t_grads, scale_atol=FP32_CROSS_RTOL,
                       what="gradient, jaxtrain vs torchref (tanh GELU)")
    report("model tanh GELU: logits max diff / max |logit|", scale_diff(j_logits, t_logits), FP32_CROSS_RTOL)
    assert scale_diff(jax_side(True, weights)[0], j_logits) > 10 * FP32_CROSS_RTOL


def bf16_sides(residual_dtype: str) -> dict[str, tuple]:
    """{backend: (logits, gradients)} of the tied model at unit scale under bf16, the stream in `residual_dtype`. On
    XLA's default CPU dots, which sum these small dots' fp32 products in torch's order: oneDNN's (model.cpu_dots=auto
    on an AMX CPU under jaxlib >= 0.11) sum them in another, and where that flips a bf16 rounding the bf16 stream
    carries it through the backward pass (1 bf16 unit at the head's input gradient, 968 of c_attn's 3,072 weight
    gradients in layer 0, logits equal; tests/test_cpu_dots.py bounds that path)."""
    cfg = make_cfg("--train.precision=bf16", f"--model.residual_dtype={residual_dtype}", "--model.cpu_dots=xla")
    return {"jaxtrain": jax_side(True, parity_weights(True), cfg=cfg),
            "torchref": torch_side(True, parity_weights(True), cfg=cfg)}


def test_a_bf16_residual_stream_is_the_same_in_both():
    """model.residual_dtype=bf16 (llm.c's stream: every residual add rounded to bf16) on both sides: the logits are
    torchref's bit for bit, as they are with the fp32 stream (each op's rounding is torch's: jaxtrain's step keeps
    the stream's roundings, which XLA:CPU drops by default; torchref's LayerNorms take the stream upcast, as CUDA's
    autocast runs them), and the gradients within the fp32 bound (the sum order of the LayerNorms' weight
    gradients). Each side's own bf16 stream moves its logits and gradients by far more: the option acts on both."""
    fp32_stream, bf16_stream = bf16_sides("fp32"), bf16_sides("bf16")
    for sides in (fp32_stream, bf16_stream):
        np.testing.assert_array_equal(sides["jaxtrain"][0], sides["torchref"][0])
        assert_named_close(sides["jaxtrain"][1], sides["torchref"][1], scale_atol=FP32_CROSS_RTOL,
                           what="bf16 gradient, jaxtrain vs torchref")
    for backend in ("jaxtrain", "torchref"):
        moved = scale_diff(bf16_stream[backend][0], fp32_stream[backend][0])
        assert moved > 100 * FP32_CROSS_RTOL, (backend, moved)  # measured 5.8e-3 (torchref), 6.6e-3 (jaxtrain)


# ---------------------------------------------------------------- the traps, each shown to fail the comparison

def assert_trap_caught(trap: tuple, good: tuple, what: str) -> float:
    """The parity comparison (logits, then every gradient) fails on the trap, by at least 10x its tolerance in
    logits or gradients. trap, good: (logits, grads). Returns the larger diff, relative to scale."""
    def compare():
        scale_close(trap[0], good[0], FP32_CROSS_RTOL, f"{what}: logits")
        assert_named_close(trap[1], good[1], scale_atol=FP32_CROSS_RTOL, what=f"{what}: gradient")
    with pytest.raises(AssertionError, match="diverged: first at index"):
        compare()
    logits_diff = scale_diff(trap[0], good[0])
    grads_diff = max(scale_diff(trap[1][n], good[1][n]) for n in good[1])
    diff = max(logits_diff, grads_diff)
    assert diff > 10 * FP32_CROSS_RTOL, f"{what}: the trap moves logits and gradients by only {diff:.3g}"
    print(f"[parity] trap {what}: logits off by {logits_diff:.3g}, gradients by {grads_diff:.3g} of their scale "
          f"(tolerance {FP32_CROSS_RTOL:g})")
    return diff


def test_trap_tanh_gelu():
    """Logits move by ~1e-4 of their scale (11x the tolerance), gradients by ~5e-4 (55x)."""
    weights = parity_weights(True)

    def tanh_gelu(module):
        for block in module.transformer.h:
            block.mlp.gelu = torch.nn.GELU(approximate="tanh")
    assert_trap_caught(torch_side(True, weights, mutate=tanh_gelu), jax_side(True, weights), "tanh GELU in torchref")


def test_trap_layernorm_eps():
    """eps 1e-6 instead of 1e-5 is invisible at unit variance (measured 4e-6 in logits, 8e-6 in gradients: under the
    tolerance), but not when the residual stream's variance is ~1e-6 (the 'tiny-variance embeddings' parity case
    passes with the right eps)."""
    weights = parity_weights(True, TINY_EMB_STD)

    def eps_1e6(module):
        for m in module.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.eps = 1e-6
    assert_trap_caught(torch_side(True, weights, mutate=eps_1e6), jax_side(True, weights),
                       "LayerNorm eps 1e-6 in torchref")


def test_trap_linear_not_transposed():
    """Copying torch's (out, in) weights into Flax's (in, out) kernels without the transpose: the non-square ones
    fail on shape, the square ones (attn.c_proj) go through and change the logits."""
    weights = parity_weights(True)
    assert_trap_caught(jax_side(True, weights, untransposed_square=True), torch_side(True, weights),
                       "square Linear weights copied untransposed into jaxtrain")
    graphdef, template = jax_gpt(cfg_for(True).model)
    names = {n: (path, False) for n, (path, _) in model.torch_names(template).items()}
    with pytest.raises((TypeError, ValueError)):  # the non-square kernels' shapes do not fit the matmuls
        _logits_and_grads(graphdef, from_torch_layout(template, weights, names), *map(jnp.asarray, batch()))


def test_trap_attention_mask():
    """Future tokens never reach a position, on either backend; torchref without its mask differs."""
    weights = parity_weights(True)
    idx, _ = batch()
    changed = idx.copy()
    changed[:, 9:] = (changed[:, 9:] + 1) % V  # every token from position 9 on
    for side, logits_of in (("jaxtrain", lambda i: jax_side(True, weights, idx=i)[0]),
                            ("torchref", lambda i: torch_side(True, weights, idx=i)[0])):
        a, b = logits_of(idx), logits_of(changed)
        # positions 0..8 see only unchanged tokens; masked keys weigh exactly 0 (-inf scores), so exactly equal
        assert_close(b[:, :9], a[:, :9], what=f"{side}: logits before the changed tokens (future leaked)")
        # a changed token moves the logits from its position on by O(10) here (measured 25.5 on both sides)
        assert np.abs(b[:, 9:] - a[:, 9:]).max() > 1e-3, f"{side}: changing tokens changed nothing"


    def no_mask(module):
        for block in module.transformer.h:
            block.attn.causal.fill_(True)
    assert_trap_caught(torch_side(True, weights, mutate=no_mask), jax_side(True, weights),
                       "non-causal attention in torchref")
