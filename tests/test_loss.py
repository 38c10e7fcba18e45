"""jaxtrain.loss: token_ce's written-out gradient, and the tiled loss (model.vocab_tiles) against the whole logits,
from the function alone to the compiled train step."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxtrain import autocast, config, loss, model, step
from jaxtrain.config import ModelConfig

U = 2.0**-24  # fp32's unit roundoff


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_token_ce_matches_optax_value_and_gradient(dtype):
    """token_ce's written-out gradient against autodiff of optax's cross-entropy on the upcast logits."""
    logits = (3 * jax.random.normal(jax.random.key(0), (2, 8, 50))).astype(dtype)
    labels = jax.random.randint(jax.random.key(1), (2, 8), 0, 50)
    weights = jax.random.uniform(jax.random.key(2), (2, 8))
    ours = lambda x: jnp.sum(weights * loss.token_ce(x, labels))
    ref = lambda x: jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels))
    (value, grad), (ref_value, ref_grad) = jax.value_and_grad(ours)(logits), jax.value_and_grad(ref)(logits)
    assert grad.dtype == dtype
    assert float(value) == pytest.approx(float(ref_value), rel=1e-6)  # the same fp32 ops in the same order
    # Entries of softmax - one_hot are in [-1, 1]: fp32 differs by a few roundings (1e-6); bf16 rounds each once,
    # so the two agree to one bf16 ulp at 1 (2^-7) where the fp32 values straddle a rounding boundary.
    atol = 1e-6 if dtype == jnp.float32 else 2**-7
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), atol=atol, rtol=0)


def test_token_ce_gradient_has_no_scatter():
    """The point of writing the gradient out: no scatter of the one-hot into a copy of B x T x V."""
    logits, labels = jnp.zeros((2, 8, 50), jnp.bfloat16), jnp.zeros((2, 8), jnp.int32)
    hlo = jax.jit(jax.grad(lambda x: loss.token_ce(x, labels).sum())).lower(logits).as_text()
    assert "scatter" not in hlo
    assert "scatter" in jax.jit(jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(
        x.astype(jnp.float32), labels).sum())).lower(logits).as_text()  # what autodiff of optax's emits


def _reduced_lengths(f, x) -> list[tuple[str, list[int]]]:
    """Each reduction in f's jaxpr: its primitive's name and the lengths of the axes it runs along. f is traced as
    a new function each time: jax caches a trace by function and shapes, not by autocast.compiling_for."""
    eqns = jax.make_jaxpr(lambda x: f(x))(x).jaxpr.eqns
    return [(e.primitive.name, [e.invars[0].aval.shape[a] for a in e.params.get("axes", e.params.get("dimensions"))])
            for e in eqns if e.primitive.name.startswith("reduce")]


def test_logsumexp_reads_the_logits_once_in_chains_of_at_most_1024():
    """Traced for a GPU, GPT-2's padded vocabulary: one reduction reads the logits (no separate max), along chunks of
    786, then one over the 64 chunks' pairs; no chain is longer than 1024 (XLA:CPU chains each reduction's combines
    one after another). 4096 in 4 chunks of 1024, 256 in one. 2053 (prime, no split) takes jax.nn.logsumexp, and so
    does every size traced for a CPU or a TPU."""
    with autocast.compiling_for("gpu"):
        assert _reduced_lengths(loss.logsumexp, jnp.zeros((2, 50304))) == [("reduce", [786]), ("reduce", [64])]
        assert _reduced_lengths(loss.logsumexp, jnp.zeros((2, 4096))) == [("reduce", [1024]), ("reduce", [4])]
        assert _reduced_lengths(loss.logsumexp, jnp.zeros((2, 256))) == [("reduce", [256]), ("reduce", [1])]
        assert _reduced_lengths(loss.logsumexp, jnp.zeros((2, 2053))) == [("reduce_max", [2053]),
                                                                         ("reduce_sum", [2053])]
    for platform in ("cpu", "tpu"):
        with autocast.compiling_for(platform):
            assert _reduced_lengths(loss.logsumexp, jnp.zeros((2, 50304))) == [("reduce_max", [50304]),
                                                                              ("reduce_sum", [50304])]


@pytest.mark.parametrize("V, chain", [(50304, 786 + 64), (4096, 1024 + 4), (256, 256 + 1), (2053, 2053)])
def test_logsumexp_is_float64s_within_its_chains_rounding(V, chain):
    """Traced for a GPU and run here, against float64, bf16 logits of std 3 (as a model's), within fp32's bound for
    sums of positive terms along chains of `chain` combines (derived): each term's exp errs by <= 2 U, each combine
    adds one rounding and rescales with at most one exp and one multiply (3 U), so the sum errs by <= (4 chain + 2) U
    relative; the log and the final add of the max add U |lse| each."""
    logits = (3 * jax.random.normal(jax.random.key(0), (64, V))).astype(jnp.bfloat16).astype(jnp.float32)
    want = np.log(np.exp(np.float64(logits)).sum(-1))
    with autocast.compiling_for("gpu"):
        got = np.float64(jax.jit(lambda x: loss.logsumexp(x))(logits))
    assert np.all(np.abs(got - want) <= (4 * chain + 2) * U + 2 * U * np.abs(want))


def test_logsumexp_of_minus_infinity():
    """-inf logits (a masked vocabulary entry) add nothing, and a row of them only gives -inf, as
    jax.nn.logsumexp: the reduction's empty pairs (-inf, 0) combine to themselves, not to exp(-inf + inf) = nan."""
    x = jnp.full((2, 2048), -jnp.inf).at[1, jnp.array([0, 700, 1500, 2047])].set(jnp.array([0.0, 1.0, 2.0, 3.0]))
    with autocast.compiling_for("gpu"):
        assert _reduced_lengths(loss.logsumexp, x) == [("reduce", [1024]), ("reduce", [2])]  # the pairs' path
        got = np.asarray(jax.jit(lambda x: loss.logsumexp(x))(x))
    assert got[0] == -np.inf
    assert got[1] == pytest.approx(np.log(np.exp([0.0, 1.0, 2.0, 3.0]).sum()), rel=4 * U)  # a few roundings


def _padded_targets(B: int, T: int, V: int, seed: int = 2) -> np.ndarray:
    """Random targets, about a third of them padding (-1), and the whole last sequence padding."""
    rng = np.random.default_rng(seed)
    targets = rng.integers(0, V, (B, T)).astype(np.int32)
    targets[rng.random((B, T)) < 1 / 3] = -1
    targets[-1] = -1
    return targets


def _written_out(x_NxD, w_DxV, targets_N):
    """In float64 numpy from the whole logits: the sum of CE over the valid targets and its gradients in x and w,
    each with its first-order bound on the rounding of an fp32 computation of it (unit roundoff U):
      the logits (D-term dots): |err| <= delta_n = D U max_v sum_d |x_nd w_dv| for token n;
      a log-probability l - lse (a V-term sum, exp, log): |err| <= e_n = 2 delta_n + U (V + 4 max_v |l_nv| + 8),
        so a CE term's too, and a dlogit's p - onehot (p <= 1) errs by at most e_n + 2 U;
      the sums: k terms add k U sum |term| (the CE over N tokens, dx over V, dw over N, in any order)."""
    x, w, valid = np.float64(x_NxD), np.float64(w_DxV), targets_N >= 0
    N, D, V = x.shape[0], x.shape[1], w.shape[1]
    logits = x @ w
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = np.where(valid, lse - logits[np.arange(N), np.maximum(targets_N, 0)], 0.0)
    one_hot = np.arange(V)[None, :] == targets_N[:, None]
    dlogits = np.where(valid[:, None], np.exp(logits - lse[:, None]) - one_hot, 0.0)
    delta = D * U * (np.abs(x) @ np.abs(w)).max(-1)
    e = np.where(valid, 2 * delta + U * (V + 4 * np.abs(logits).max(-1) + 8), 0.0)
    dl_err = np.where(valid, e + 2 * U, 0.0)
    bounds = (e.sum() + N * U * np.abs(ce).sum(),
              V * U * np.abs(dlogits) @ np.abs(w).T + dl_err[:, None] * np.abs(w).sum(1)[None, :],
              N * U * np.abs(x).T @ np.abs(dlogits) + np.abs(x).T @ dl_err[:, None])
    return (ce.sum(), dlogits @ w.T, x.T @ dlogits), bounds


@pytest.mark.parametrize("tiles", [None, 2, 4])
def test_fp32_tiled_ce_sum_and_gradients_are_the_written_out_ones(tiles):
    """tiled_ce_sum's value and gradients in x and w, and the untiled path's (tiles None: step.ce_sum of
    model.head_logits), against the CE of the whole logits written out in float64, within fp32's rounding bound."""
    B, T, D, V = 4, 8, 16, 50
    x = jax.random.normal(jax.random.key(0), (B, T, D))
    w = 0.5 * jax.random.normal(jax.random.key(1), (D, V))  # logits of about +-2, a spread-out softmax
    targets = _padded_targets(B, T, V)
    if tiles is None:
        f = lambda x, w: step.ce_sum(model.head_logits(x, w, "fp32"), jnp.asarray(targets))[0]
    else:
        f = lambda x, w: loss.tiled_ce_sum(x, w, jnp.asarray(targets), "fp32", tiles)
    value, (dx, dw) = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(x, w)
    expected, bounds = _written_out(np.asarray(x).reshape(-1, D), np.asarray(w), targets.reshape(-1))
    for got, want, bound in zip((value, dx.reshape(-1, D), dw), expected, bounds):
        assert np.all(np.abs(np.float64(got) - want) <= bound)


def _model_grads(cfg: ModelConfig, precision: str, tiles: int, V: int = 97, B: int = 4):
    graphdef, params = model.init_params(cfg, vocab_size=V, precision=precision, seed=0)
    inputs = jax.random.randint(jax.random.key(1), (B, cfg.seq_len), 0, V, jnp.int32)
    targets = jnp.asarray(_padded_targets(B, cfg.seq_len, V))
    f = lambda p: step.model_ce_sum(graphdef, p, inputs, targets, vocab_tiles=tiles)
    return jax.jit(jax.value_and_grad(f))(params)


SMALL = ModelConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)


@pytest.mark.parametrize("tiles, precision, tie", [  # each pair of values once (4 of the 8 cases)
    (2, "fp32", True), (4, "fp32", False), (2, "bf16", False), (4, "bf16", True)])
def test_tiled_loss_and_every_gradient_match_the_untiled_model(tiles, precision, tie):
    """The whole model's loss and parameter gradients, tiled and not: the only difference is the order of the
    fp32 sums over tokens (the loss, the head weight's gradient), then the rounding to bf16 of that gradient."""
    cfg = dataclasses.replace(SMALL, tie_embeddings=tie)
    (value, grads), (value_1, grads_1) = _model_grads(cfg, precision, tiles), _model_grads(cfg, precision, 1)
    n = 4 * cfg.seq_len  # tokens summed over
    # fp32: two sums of the same n terms in different orders differ by at most 2 n U sum|term| (derived); the
    # CE terms are positive, so sum|term| is the loss itself.
    assert abs(float(value) - float(value_1)) <= 2 * n * U * float(value_1)
    for (path, g), g_1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_1)):
        g, g_1 = np.asarray(g), np.asarray(g_1)
        scale = np.abs(g_1).max()
        if precision == "fp32":
            # Per entry, sums over <= n tokens in another order: 2 n U of the largest |term|, at most the largest
            # entry (derived for the head; the blocks' backward passes carry it on). Measured 1e-6 of the scale
            # (7.6e-6 allowed).
            assert np.all(np.abs(g - g_1) <= 2 * n * U * scale), path
        elif np.array_equal(g_1, g_1.astype(jnp.bfloat16).astype(np.float32)):
            # bf16: the Linears' weight gradients are rounded to bf16 (an ulp is at most 2^-7 of the value) after
            # the fp32 sums, so where two sums straddle a rounding boundary they differ by one ulp: rarely, the
            # sums differing by ~1e-7 of an ulp of 2^-8. Measured: all equal (jax 0.9.0 and 0.10.2).
            assert np.all(np.abs(g - g_1) <= 2**-7 * scale), path
            assert np.mean(g == g_1) > 0.95, path
        else:
            # bf16, the embeddings' gradients (the gathers' fp32 scatter-adds, not rounded): fp32 sums in another
            # order, as for fp32 above. Measured 1.1e-7 of the scale at jax 0.9.0 (72-80% of entries equal), 0 at
            # 0.10.2.
            assert np.all(np.abs(g - g_1) <= 2 * n * U * scale), path



def _cfg(*overrides) -> config.Config:
    return config.load(["--data.batch_size=8", "--optim.grad_accum_steps=2", "--model.n_layer=2", "--model.n_head=2",
                        "--model.d_model=32", "--model.seq_len=16", "--model.vocab_size=97", "--optim.warmup_steps=2",
                        "--train.steps=10", *overrides])


def _window(cfg: config.Config):
    """A window of 2 micro-batches of 4 sequences, with padding targets."""
    k, T, V = cfg.optim.grad_accum_steps, cfg.model.seq_len, cfg.model.vocab_size
    inputs = jax.random.randint(jax.random.key(1), (cfg.data.batch_size, T), 0, V, jnp.int32)
    targets = _padded_targets(cfg.data.batch_size, T, V)
    return inputs.reshape(k, -1, T), jnp.asarray(targets).reshape(k, -1, T)


def _train(cfg: config.Config, steps: int):
    """(initial params, params after `steps` steps of the run's jitted train step on one window, each step's
    metrics), params as flat numpy."""
    state, train_step, window = step.fresh_state(cfg, cfg.model.vocab_size), step.jit_train_step(cfg, 0), _window(cfg)
    flat = lambda params: np.concatenate([np.ravel(p) for p in jax.tree.leaves(params)])
    init, history = flat(state.params), []  # copied: the step donates the state
    for _ in range(steps):
        state, metrics = train_step(state, *window)
        history.append({k: float(v) for k, v in metrics.items()})
    return init, flat(state.params), history


def _update_gap(tiled, untiled) -> float:
    """|params tiled - params untiled| / |params untiled - initial params|: how far apart the two runs' updates
    went, relative to how far they went. AdamW's update of a gradient entry near zero turns with its rounding (its
    size is lr whatever the gradient's), so the gap is measured, not derived."""
    (init, params, _), (_, params_1, _) = tiled, untiled
    return float(np.linalg.norm(params - params_1) / np.linalg.norm(params_1 - init))


@pytest.mark.parametrize("precision,loss_rtol,gap", [
    ("fp32", 1e-6, 1e-4),  # loss: fp32 sums in another order, measured 1e-7; gap measured 4e-6, margin 25x
    ("bf16", 1e-4, 1e-2)])  # measured 0 for both (bit for bit on this CPU); room for one-ulp flips of the head's
def test_three_train_steps_tiled_as_untiled(precision, loss_rtol, gap):  # gradient on other backends
    """The run's train step (jit_train_step, 2 micro-batches per window) with vocab_tiles=2 and without: the same
    losses and, after 3 AdamW steps, the same params to rounding."""
    tiled, untiled = [_train(_cfg(f"--train.precision={precision}", f"--model.vocab_tiles={tiles}"), 3)
                      for tiles in (2, 1)]
    for metrics, metrics_1 in zip(tiled[2], untiled[2]):
        assert metrics["loss"] == pytest.approx(metrics_1["loss"], rel=loss_rtol)
    assert _update_gap(tiled, untiled) <= gap


def test_fp16_overflow_skips_the_same_windows_tiled_as_untiled():
    """fp16 with a loss scale of 2^24: the scaled dlogits overflow fp16 where they are rounded to it (in each tile
    as in the whole logits), so the window is skipped, params untouched, and the scale halves, until it fits. Tiled
    and untiled take the same decisions and hold the same scale at every step."""
    tiled, untiled = [_train(_cfg("--train.precision=fp16", f"--train.loss_scale_init={2.0 ** 24}",
                                  f"--model.vocab_tiles={tiles}"), 8) for tiles in (2, 1)]
    decisions = [(m["skipped"], m["loss_scale"]) for m in tiled[2]]
    assert decisions == [(m["skipped"], m["loss_scale"]) for m in untiled[2]]
    assert decisions[0] == (1, 2.0**24) and math.isfinite(tiled[2][0]["loss"])  # the loss fits; its gradient not
    assert decisions[-1][0] == decisions[-2][0] < len(decisions)  # then windows that fit train
    assert _update_gap(tiled, untiled) <= 5e-2  # measured 4.9e-3 after 3 updates, margin 10x


def test_fp16_skipped_window_leaves_params_as_they_were():
    init, params, history = _train(_cfg("--train.precision=fp16", f"--train.loss_scale_init={2.0 ** 24}",
                                        "--model.vocab_tiles=4"), 1)
    assert history[0]["skipped"] == 1 and np.array_equal(params, init)


def test_tiled_step_never_holds_the_logits():
    """Compiled as the run compiles it, on a config whose logits dominate (V 4096, d 64, micro-batch 16 x 128, bf16):
    the untiled step's program has the (16, 128, 4096) logits, the tiled one's never a tensor that large, and its
    temporaries are smaller by most of the logits' bytes."""
    B, T, V = 16, 128, 4096
    compiled = {}
    for tiles in (1, 4):
        cfg = config.load([f"--data.batch_size={B}", f"--model.seq_len={T}", f"--model.vocab_size={V}",
                           "--model.d_model=64", "--model.n_layer=1", "--model.n_head=2", "--train.precision=bf16",
                           f"--model.vocab_tiles={tiles}"])
        abstract = jax.eval_shape(lambda: step.fresh_state(cfg, V))
        window = jax.ShapeDtypeStruct((1, B, T), jnp.int32)
        lowered = step.jit_train_step(cfg, 0).lower(abstract, window, window)
        compiled[tiles] = (lowered.as_text(), lowered.compile().memory_analysis().temp_size_in_bytes)
    assert f"tensor<{B}x{T}x{V}xbf16>" in compiled[1][0]
    assert f"{B}x{T}x{V}x" not in compiled[4][0] and f"{B * T}x{V}x" not in compiled[4][0]
    logits_bytes = B * T * V * 2  # bf16: 16 MiB
    saving = compiled[1][1] - compiled[4][1]
    # The untiled step keeps the bf16 logits for the backward pass and forms their bf16 gradient, 2 x 16 MiB; the
    # tiled one a tile of each, a quarter: 24 MiB less, by hand. Measured 64.3 -> 31.8 MiB (32.5 less: XLA:CPU's
    # fp32 passes over the logits go too).
    assert saving >= 2 * logits_bytes * (1 - 1 / 4)
