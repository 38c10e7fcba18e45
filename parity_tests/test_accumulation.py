"""Component 5, gradient accumulation: jaxtrain's real train step (step.make_train_step: a scan feeding
MultiSteps(k=4), clipping active) vs torchref's real train_step / accumulate_gradients, over the same four
micro-batches with unequal valid-token counts (padding targets -1). Token-weighted on both sides, the window's
gradient is that of one big batch; optimizer counts advance once per window.

Observing the window gradient through the real chain: with b1 = 0, AdamW's first moment after an update is
exactly the clipped window gradient (mu = 0 * mu + 1 * g), and torchref leaves the clipped gradient in .grad.
Gradients are compared at the first update, where both backends hold the same weights.

Precision: jaxtrain's fp32 model casts its activations and ce_sum's logits to float32 and MultiSteps accumulates
in float32, so only torchref can run this in fp64 (its model and loss pass float64 through); that is the exactness
check (1e-12), and the fp64 torch gradient is the truth the fp32 sides are measured against.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from jaxtrain import optim, step
from jaxtrain import model as jmodel
from parity_tests.conftest import (FP32_CROSS_RTOL, FP32_SIDE_RTOL, FP64_ATOL, assert_named_close, from_torch_layout,
                                   jax_gpt, make_cfg, report, torch_grads, torch_layout)
from torchref import run
from torchref.model import GPT
from torchref.optim import configure_optimizer, lr_scheduler

pytestmark = pytest.mark.usefixtures("one_torch_thread")
K, MICRO_B, T, V = 4, 2, 16, 64
VALID = [(32, 3, 19, 10), (5, 32, 32, 1), (20, 20, 7, 31)]  # valid targets per micro-batch (of 32), per window
MAX_NORM = 0.1  # the window gradient's norm is ~1.5 at init: clipping is active (asserted)
NO_AUTOCAST = torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)


def cfg_for(k: int):
    return make_cfg(f"--data.batch_size={K * MICRO_B}", f"--optim.grad_accum_steps={k}", "--optim.b1=0",
                    f"--optim.max_grad_norm={MAX_NORM}", "--optim.warmup_steps=2", "--train.steps=10")


def windows() -> list[tuple[np.ndarray, np.ndarray]]:
    """(inputs, targets) of shape (K, MICRO_B, T) per window; targets past each micro-batch's valid count are -1."""
    rng = np.random.default_rng(0)
    out = []
    for valid in VALID:
        tokens = rng.integers(0, V, (K, MICRO_B, T + 1))
        targets = tokens[..., 1:].copy()
        for k, n in enumerate(valid):
            targets[k].reshape(-1)[n:] = -1
        out.append((tokens[..., :-1].copy(), targets))
    return out


def as_k(x: np.ndarray, k: int) -> np.ndarray:
    """The window's K x MICRO_B sequences as k micro-batches (k = 1: one big batch of the same tokens)."""
    return x.reshape(k, -1, T)


@functools.cache
def init_weights() -> dict[str, np.ndarray]:
    torch.manual_seed(0)
    return {n: p.detach().numpy().copy() for n, p in GPT(cfg_for(K).model).named_parameters()}


def torch_gpt(cfg, dtype=torch.float32) -> GPT:
    module = GPT(cfg.model).to(dtype)
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(torch.from_numpy(init_weights()[n]))
    return module


@functools.cache  # one compile per k: the first-update and the count tests share the k=4 run
def jaxtrain_run(k: int, n_windows: int):
    """jaxtrain's real train step over the windows as k micro-batches each: per-window records, final state."""
    cfg = cfg_for(k)
    graphdef, template = jax_gpt(cfg.model)
    names = jmodel.torch_names(template)
    tx = optim.optimizer(cfg)
    train_step = jax.jit(step.make_train_step(graphdef, tx, optim.lr_schedule(cfg), seed=0, dropout=False))
    state = step.init_state(from_torch_layout(template, init_weights(), names), tx)
    records = []
    for x, y in windows()[:n_windows]:
        state, m = train_step(state, jnp.asarray(as_k(x, k), jnp.int32), jnp.asarray(as_k(y, k), jnp.int32))
        records.append({"clipped": torch_layout(optim.adam_state(state.opt_state).mu, names),
                        **{key: float(v) for key, v in m.items()}})
    return records, state


def torchref_run(k: int, n_windows: int, dtype=torch.float32):
    """torchref's real train_step over the same windows: per-window records, the optimizer and the scheduler."""
    cfg = cfg_for(k)
    module = torch_gpt(cfg, dtype)
    optimizer = configure_optimizer(module, cfg)
    scheduler = lr_scheduler(optimizer, cfg)
    records = []
    for x, y in windows()[:n_windows]:
        loss, grad_norm, lr, _ = run.train_step(module, optimizer, scheduler, torch.from_numpy(as_k(x, k)),
                                                torch.from_numpy(as_k(y, k)), NO_AUTOCAST, MAX_NORM)
        records.append({"clipped": torch_grads(module), "loss": loss, "grad_norm": grad_norm, "lr": lr})
    return records, optimizer, scheduler


def fp64_window_gradient(k: int, accumulate=run.accumulate_gradients) -> tuple[dict, float]:
    """torchref's accumulated gradient of window 0 in float64 (unclipped), and the window loss."""
    module = torch_gpt(cfg_for(k), torch.float64)
    x, y = windows()[0]
    loss = accumulate(module, torch.from_numpy(as_k(x, k)), torch.from_numpy(as_k(y, k)), NO_AUTOCAST)
    return torch_grads(module), float(loss)


def mean_of_means(module, inputs, targets, autocast, scaler=None):
    """The 2024 HF accumulation bug: each micro-batch's own mean CE, averaged over the k micro-batches (fp32: no
    loss scaler)."""
    loss = 0.0
    for x, y in zip(inputs, targets):
        micro = run.cross_entropy_sum(module(x), y) / (y >= 0).sum() / len(inputs)
        micro.backward()
        loss = loss + micro.detach()
    return loss


@pytest.fixture(scope="module")
def first_update():
    """Window 0 through each path: jaxtrain k=4 and k=1, torchref k=4 and k=1 (fp32), and the fp64 truth."""
    truth, truth_loss = fp64_window_gradient(1)
    norm = float(np.sqrt(sum(np.sum(g ** 2) for g in truth.values())))
    return {"jax4": jaxtrain_run(K, len(VALID))[0][0], "jax1": jaxtrain_run(1, 1)[0][0],
            "torch4": torchref_run(K, 1)[0][0], "torch1": torchref_run(1, 1)[0][0],
            "truth": truth, "truth_loss": truth_loss, "truth_norm": norm}


def test_token_weighted_accumulation_is_one_big_batch_fp64():
    """torchref, float64: k=4 backward passes of sum(CE) / N_window add up to the big batch's gradient."""
    acc, acc_loss = fp64_window_gradient(K)
    big, big_loss = fp64_window_gradient(1)
    worst, _ = assert_named_close(acc, big, atol=FP64_ATOL,
                                  what="torchref fp64 accumulated (k=4) vs big-batch gradient")
    assert acc_loss == pytest.approx(big_loss, rel=1e-14, abs=0)  # float64 sums reordered: ~1e-16 relative per add
    report("accumulation fp64 (torchref, k=4 vs big batch): max abs diff", worst, FP64_ATOL)
    # The rule is what makes this exact: mean-of-means weighs the 3-token micro-batch like the 32-token one.
    wrong, _ = fp64_window_gradient(K, mean_of_means)
    off = max(float(np.abs(wrong[n] - big[n]).max()) for n in big)
    assert off > 1e6 * FP64_ATOL, off  # the rule, not rounding, moves it: far outside the bound, not a near miss


def unclip(clipped: dict, coef: float) -> dict:
    return {n: g / coef for n, g in clipped.items()}


def test_accumulated_gradient_matches_big_batch_and_other_backend(first_update):
    r, truth, norm = first_update, first_update["truth"], first_update["truth_norm"]
    assert norm > 10 * MAX_NORM, f"clipping is not active: window gradient norm {norm}"
    coef_jax, coef_torch = MAX_NORM / norm, MAX_NORM / (norm + 1e-6)  # optax's and torch's clip (see test_clip)

    # Each fp32 side against the fp64 truth: the window's pre-clip norm, loss, and clipped gradient.
    for side in ("jax4", "jax1", "torch4", "torch1"):
        assert r[side]["grad_norm"] == pytest.approx(norm, rel=FP32_SIDE_RTOL), f"{side}: pre-clip window grad norm"
        assert r[side]["loss"] == pytest.approx(r["truth_loss"], rel=FP32_SIDE_RTOL), f"{side}: token-weighted loss"
        coef = coef_jax if side.startswith("jax") else coef_torch
        worst = assert_named_close(unclip(r[side]["clipped"], coef), truth, scale_atol=FP32_SIDE_RTOL,
                                   what=f"{side} window gradient vs fp64 big batch, relative to each tensor's max")
        report(f"accumulation fp32 {side} vs fp64 big-batch gradient: max abs diff", worst[0],
               FP32_SIDE_RTOL * max(float(np.abs(g).max()) for g in truth.values()))

    # Pairwise: MultiSteps(k=4) vs one big batch per backend, and jaxtrain vs torchref (torch's epsilon undone).
    pairs = {"jaxtrain k=4 vs k=1 (big batch)": ("jax4", "jax1", 1.0, 1.0),
             "torchref k=4 vs k=1 (big batch)": ("torch4", "torch1", 1.0, 1.0),
             "jaxtrain vs torchref, k=4": ("jax4", "torch4", coef_jax, coef_torch)}
    for what, (a, b, ca, cb) in pairs.items():
        worst = assert_named_close(unclip(r[a]["clipped"], ca), unclip(r[b]["clipped"], cb),
                                   scale_atol=FP32_CROSS_RTOL, what=f"{what}: clipped window gradient")
        report(f"accumulation fp32 {what}: max abs diff", worst[0],
               FP32_CROSS_RTOL * max(float(np.abs(g).max()) for g in truth.values()))


def test_mean_of_means_accumulation_would_fail(first_update, monkeypatch):
    """The comparison above catches the HF bug: torchref with mean-of-means accumulation misses jaxtrain's
    gradient by far more than FP32_CROSS_RTOL."""
    monkeypatch.setattr(run, "accumulate_gradients", mean_of_means)
    wrong = torchref_run(K, 1)[0][0]
    norm = first_update["truth_norm"]
    with pytest.raises(AssertionError, match="diverged: first at index") as failure:
        assert_named_close(unclip(first_update["jax4"]["clipped"], MAX_NORM / norm),
                           unclip(wrong["clipped"], MAX_NORM / (wrong["grad_norm"] + 1e-6)),
                           scale_atol=FP32_CROSS_RTOL, what="jaxtrain vs torchref mean-of-means, k=4")
    print(f"[parity] mean-of-means accumulation: {failure.value}")


def test_optimizer_counts_windows_not_micro_batches():
    """Three windows of k=4 micro-batches: every count on both sides is 3, and each update applied LR(0..2)."""
    n = len(VALID)
    jax_records, state = jaxtrain_run(K, n)  # cached: the same run as first_update's
    torch_records, optimizer, scheduler = torchref_run(K, n)
    opt_state = state.opt_state
    assert int(opt_state.gradient_step) == n and int(opt_state.mini_step) == 0, "MultiSteps' counts"
    assert int(optim.adam_state(opt_state).count) == n, "AdamW's bias-correction count (jaxtrain)"
    schedule_counts = [int(s.count) for s in jax.tree.leaves(
        opt_state.inner_opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByScheduleState))
        if isinstance(s, optax.ScaleByScheduleState)]
    assert schedule_counts == [n], f"the LR schedule's count (jaxtrain): {schedule_counts}"
    assert {int(s["step"]) for s in optimizer.state.values()} == {n}, "AdamW's step (torchref)"
    assert scheduler.last_epoch == n, "LambdaLR's count (torchref)"
    schedule = optim.lr_schedule(cfg_for(K))
    for t, (j, tr) in enumerate(zip(jax_records, torch_records)):
        assert j["lr"] == pytest.approx(tr["lr"], rel=1e-5), f"LR applied at optimizer step {t}"  # test_schedule
        assert j["lr"] == pytest.approx(float(schedule(t)), rel=0), f"jaxtrain's LR at step {t} is not schedule({t})"
        assert j["tokens"] == sum(VALID[t]), f"window {t}: valid tokens"
