"""Components 2 and 3: AdamW with its decay mask. jaxtrain's real chain (optim.optimizer, MultiSteps k=1, clipping
off) against torchref's real configure_optimizer + lr_scheduler, on the real GPT param trees of both backends
(mapped by model.torch_names), fed identical random gradients: no model, no loss, only the update rule.

fp64 (jax x64, torch float64): atol 1e-12 after 1,000 steps. The LR is held at 2^-10 there (lr = min_lr, no
warmup): optax evaluates any schedule in float32 (bounded on its own in test_schedule), which would otherwise put
~1e-7 relative into every update and hide the update rule's own agreement. fp32 runs the real warmup + cosine.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from jaxtrain import model, optim
from parity_tests.conftest import (FP64_ATOL, U32, assert_trajectory_close, from_torch_layout, jax_gpt, make_cfg,
                                   report, torch_layout)
from torchref import optim as torch_optim
from torchref.model import GPT

TORCH_PATHS = {  # torch AdamW's implementations; on CPU "default" (foreach=None, as configure_optimizer leaves
    "default": {},  # it) is the single-tensor loop
    "single-tensor": {"foreach": False, "fused": None},
    "foreach": {"foreach": True, "fused": None},
    "fused": {"foreach": False, "fused": True},  # CPU fused AdamW takes float64 in torch 2.13
}
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # fused fp64 AdamW is 350x slower on 2 shared threads
SMALL = ["--model.n_layer=1", "--model.d_model=8", "--model.n_head=2", "--model.seq_len=4", "--model.vocab_size=16",
         "--optim.grad_accum_steps=1", "--optim.max_grad_norm=0", "--optim.weight_decay=0.1"]
CONSTANT_LR = ["--optim.lr=0.0009765625", "--optim.min_lr=0.0009765625", "--optim.warmup_steps=0"]  # 2^-10
SCHEDULED_LR = ["--optim.lr=1e-3", "--optim.min_lr=1e-4", "--optim.warmup_steps=10"]


def small_cfg(*overrides):
    return make_cfg(*SMALL, *overrides)


def torch_gpt(cfg, dtype) -> GPT:
    """torchref's GPT with init seed 0, in `dtype`."""
    torch.manual_seed(0)
    return GPT(cfg.model).to(dtype)


def jax_params(cfg, module):
    """jaxtrain's param tree holding `module`'s values, in its dtype (float64 needs x64 on), and the name map."""
    names = model.torch_names(jax_gpt(cfg.model)[1])
    arrays = {n: p.detach().numpy() for n, p in module.named_parameters()}
    return from_torch_layout(jax_gpt(cfg.model)[1], arrays, names, arrays[next(iter(arrays))].dtype), names


def random_grads(module, steps: int, seed=1) -> dict[str, np.ndarray]:
    """{name: (steps, *torch shape)} in the module's dtype: normal directions times per-element magnitudes spread
    over 1e-4..1, so that eps (1e-8) matters to some elements."""
    rng = np.random.default_rng(seed)
    dtype = next(module.parameters()).detach().numpy().dtype
    return {n: (rng.standard_normal((steps, *p.shape)) * 10.0 ** rng.uniform(-4, 0, p.shape)).astype(dtype)
            for n, p in module.named_parameters()}


def run_jax(cfg, params, grads, names) -> dict[str, np.ndarray]:
    """jaxtrain's optimizer over the gradient sequence: {name: (T, *torch shape)}, the params after each step."""
    by_path = {path: (n, t) for n, (path, t) in names.items()}
    grads_T = nnx.from_flat_state([  # a params-shaped tree with a leading T axis, in jaxtrain's layout
        (path, var.replace(jnp.asarray(np.swapaxes(grads[by_path[path][0]], -1, -2) if by_path[path][1]
                                       else grads[by_path[path][0]], var.get_value().dtype)))
        for path, var in nnx.to_flat_state(params)])
    tx = optim.optimizer(cfg)

    def step(carry, g):
        p, state = carry
        updates, state = tx.update(g, state, p)
        p = optax.apply_updates(p, updates)
        return (p, state), p

    _, hist = jax.jit(lambda p, g: jax.lax.scan(step, (p, tx.init(p)), g))(params, grads_T)
    leaves = {path: np.asarray(var.get_value()) for path, var in nnx.to_flat_state(hist)}
    return {n: (np.swapaxes(leaves[path], -1, -2) if t else leaves[path]) for n, (path, t) in names.items()}


def run_torch(cfg, module, grads, path_kwargs=None) -> dict[str, np.ndarray]:
    """torchref's AdamW + LambdaLR over the gradient sequence, stepped as torchref.run.train_step does."""
    optimizer = torch_optim.configure_optimizer(module, cfg)
    for group in optimizer.param_groups:
        group.update(path_kwargs or {})
    scheduler = torch_optim.lr_scheduler(optimizer, cfg)
    named = list(module.named_parameters())
    T = len(next(iter(grads.values())))
    hist = {n: np.empty((T, *p.shape), grads[n].dtype) for n, p in named}
    for t in range(T):
        for n, p in named:
            p.grad = torch.from_numpy(grads[n][t])
        optimizer.step()
        scheduler.step()
        for n, p in named:
            hist[n][t] = p.detach().numpy()
    return hist


def histories(overrides: tuple, dtype, torch_path="default"):
    """(jaxtrain's, torchref's) param histories from the same init and gradients."""
    cfg = small_cfg(*overrides)
    module = torch_gpt(cfg, dtype)
    grads = random_grads(module, cfg.train.steps)
    return jaxtrain_history(overrides, dtype), run_torch(cfg, module, grads, TORCH_PATHS[torch_path])


@functools.cache
def jaxtrain_history(overrides: tuple, dtype):
    """jaxtrain's side depends on the config alone: computed once for all torch paths."""
    return run_jax_fresh(overrides, dtype)


def run_jax_fresh(overrides: tuple, dtype):
    """jaxtrain's param history, uncached (the missing-mask test patches optim)."""
    cfg = small_cfg(*overrides)
    module = torch_gpt(cfg, dtype)
    with jax.enable_x64(dtype == torch.float64):  # scoped: x64 never leaks into other tests
        params, names = jax_params(cfg, module)
        return run_jax(cfg, params, random_grads(module, cfg.train.steps), names)


def fp64_overrides(rule: str) -> tuple:
    return (*CONSTANT_LR, "--train.steps=1000", f"--optim.decay_mask={rule}")


@pytest.mark.parametrize("rule", ["ndim", "names"])
@pytest.mark.parametrize("torch_path", list(TORCH_PATHS))
def test_adamw_fp64_1000_steps(rule, torch_path):
    jax_hist, torch_hist = histories(fp64_overrides(rule), torch.float64, torch_path)
    # fp64: ~10 roundings of 1.1e-16 per step on params of magnitude <= ~1, 1,000 steps: ~1e-12 even if every
    # rounding added up in the same direction; measured ~2e-15.
    worst = assert_trajectory_close(jax_hist, torch_hist, FP64_ATOL,
                                    what=f"AdamW fp64 ({rule} mask, torch {torch_path}) params")
    report(f"AdamW fp64 1,000 steps, {rule} mask, torch {torch_path}: max abs diff", worst, FP64_ATOL)


def fp32_bound(torch_hist: dict) -> np.ndarray:
    """Allowed |diff| after each step t = 1..T, in fp32.

    Gradients are fed, not computed, so a param difference never feeds back into the moments: the difference is the
    sum of per-step differences. Per step, each backend rounds p - update once (<= ulp(p) / 2), and the updates
    differ by ~50 U32 relative (moment recurrences ~2 U32 / (1 - b), optax's 1 - b^t and LR in float32). The update
    is ~lr = 1e-3 while ulp(|p| ~ 1) is 1.2e-7, so the two rounded params differ by 0 or 1 ulp, each step's sign
    independent: a random walk, sd sqrt(t) * ulp. Bound: 5 sigma, with ulp at the largest |p|. Smaller params round
    finer, and their updates differ by ~50 U32 * lr = 3e-9 per step, far below that ulp: the same bound covers them."""
    T = len(next(iter(torch_hist.values())))
    p_max = max(float(np.abs(h).max()) for h in torch_hist.values())
    ulp = 2.0 ** np.floor(np.log2(p_max)) * 2 * U32
    return 5 * np.sqrt(np.arange(1, T + 1)) * ulp


def test_adamw_fp32_100_and_1000_steps():
    """One 1,000-step fp32 run under the real warmup + cosine; its first 100 steps are the 100-step case."""
    jax_hist, torch_hist = histories((*SCHEDULED_LR, "--train.steps=1000"), torch.float32)
    bound_T = fp32_bound(torch_hist)
    worst = assert_trajectory_close(jax_hist, torch_hist, bound_T, what="AdamW fp32 params")
    at_100 = max(float(np.abs(jax_hist[n][:100] - torch_hist[n][:100]).max()) for n in torch_hist)
    report("AdamW fp32 100 steps (real schedule): max abs diff", at_100, bound_T[99])
    report("AdamW fp32 1,000 steps (real schedule): max abs diff", worst, bound_T[-1])


# ---------------------------------------------------------------- component 3: the decay mask

# DESIGN.md: `ndim` decays params with ndim >= 2; `names` decays all but biases, LayerNorms and embeddings, which
# in nanoGPT's layout leaves the four Linear weights of each block and an untied lm_head.
NAMES_DECAYED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight", "lm_head.weight")


def zero_gradient_step(cfg) -> tuple[dict, dict, dict]:
    """(params before, jaxtrain's after, torchref's after) one step with zero gradients from torchref's init, by
    nanoGPT name: Adam's direction is 0 / (0 + eps) = 0, so only weight decay moves a param."""
    torch.manual_seed(0)
    module = GPT(cfg.model)
    graphdef, template = jax_gpt(cfg.model)
    names = model.torch_names(template)
    before = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    params = from_torch_layout(template, before, names)
    assert sorted(names) == sorted(before), "jaxtrain and torchref name different parameters"

    tx = optim.optimizer(cfg)
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    jax_after = {n: before[n] + u for n, u in torch_layout(updates, names).items()}

    optimizer = torch_optim.configure_optimizer(module, cfg)
    torch_optim.lr_scheduler(optimizer, cfg)  # sets the groups' LR to LR(0), as torchref.run does
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return before, jax_after, {n: p.detach().numpy() for n, p in module.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("rule", ["ndim", "names"])
def test_zero_gradient_step_moves_exactly_the_decayed_params(rule, tied):
    """One step with zero gradients moves a param by exactly lr(0) * wd * p, or not at all. Both backends, on the
    real GPT trees (one block: every kind of param)."""
    cfg = make_cfg("--model.n_layer=1", "--optim.weight_decay=0.5", "--optim.max_grad_norm=1",
                   f"--optim.decay_mask={rule}", f"--model.tie_embeddings={str(tied).lower()}")
    before, jax_after, torch_after = zero_gradient_step(cfg)
    if rule == "ndim":
        want = {n for n, x in before.items() if x.ndim >= 2}
    else:
        want = {n for n in before if n.endswith(NAMES_DECAYED)}
    assert want, "the expected decay set is empty: the test would prove nothing"
    for side, after in (("jaxtrain", jax_after), ("torchref", torch_after)):
        moved = {n for n in before if not np.array_equal(after[n], before[n])}
        assert moved == want, (f"{side} ({rule} rule, {'tied' if tied else 'untied'}): zero-gradient step moved "
                               f"{sorted(moved - want)} that must not decay, left {sorted(want - moved)} undecayed")
    lr0 = cfg.warmup_init_lr
    for n in want:  # decoupled decay p <- p (1 - lr wd): one fp32 multiply-subtract, a few U32 of |p|
        for side, after in (("jaxtrain", jax_after), ("torchref", torch_after)):
            np.testing.assert_allclose(before[n] - after[n], lr0 * 0.5 * before[n], rtol=1e-3, atol=4 * U32,
                                       err_msg=f"{side}: decay step of {n} is not lr(0) * wd * p")


@pytest.mark.parametrize("broken", ["jaxtrain mask=None", "torchref one group"])
def test_missing_mask_fails_the_fp64_comparison(broken, monkeypatch):
    """Test 2 demonstrably catches a missing mask: decaying every param on one side (optax's mask=None, or one
    torch group holding everything) leaves the 1,000-step fp64 comparison off by ~lr * wd * |p| * steps on the
    LayerNorm weights (~0.1), 8+ orders of magnitude past its tolerance."""
    if broken.startswith("jaxtrain"):
        monkeypatch.setattr(optim, "decay_mask", lambda rule: None)
        jax_hist = run_jax_fresh(fp64_overrides("ndim"), torch.float64)  # uncached: optim is patched
        torch_hist = histories(fp64_overrides("ndim"), torch.float64)[1]
    else:
        monkeypatch.setattr(torch_optim, "decays", lambda name, param, rule: True)
        jax_hist, torch_hist = histories(fp64_overrides("ndim"), torch.float64)
    with pytest.raises(AssertionError, match=r"diverged first at step 1 in transformer\.") as failure:
        assert_trajectory_close(jax_hist, torch_hist, FP64_ATOL, what=f"AdamW fp64 with {broken}")
    worst = max(float(np.abs(jax_hist[n] - torch_hist[n]).max()) for n in torch_hist)
    assert worst > 1e6 * FP64_ATOL, worst  # the rule, not rounding, moves it: far outside the bound, not a near miss
    print(f"[parity] missing mask ({broken}): {failure.value}")



# ---------------------------------------------------------------- optim.groups: per-group LR and weight decay

# Every kind of group: an LR multiplier alone (the embeddings: decay from the mask), a weight decay alone (the
# LayerNorms, which the ndim mask leaves undecayed), and both (the MLP's first Linear, weight and bias).
GROUPS = '--optim.groups={"wte|wpe": {lr_scale: 0.1}, "ln_": {weight_decay: 0.05}, "mlp.c_fc": {lr_scale: 3.0, weight_decay: 0.2}}'
GROUP_OF = {"wte": (0.1, None), "wpe": (0.1, None), "ln_": (1.0, 0.05), "mlp.c_fc": (3.0, 0.2)}  # by hand, from GROUPS


@pytest.mark.parametrize("rule", ["ndim", "names"])
def test_param_groups_fp64_1000_steps(rule):
    """jaxtrain's grouped chain (optax.multi_transform) against torch AdamW's param groups, fp64, the bound of
    test_adamw_fp64_1000_steps; and the groups change the trajectory by far more than that bound, so a backend
    that ignored them would fail."""
    jax_hist, torch_hist = histories((*fp64_overrides(rule), GROUPS), torch.float64)
    worst = assert_trajectory_close(jax_hist, torch_hist, FP64_ATOL, what=f"AdamW fp64 with optim.groups ({rule} mask)")
    report(f"AdamW fp64 1,000 steps, optim.groups, {rule} mask: max abs diff", worst, FP64_ATOL)
    plain = jaxtrain_history(fp64_overrides(rule), torch.float64)
    moved_by_groups = max(float(np.abs(plain[n] - torch_hist[n]).max()) for n in torch_hist)
    assert moved_by_groups > 1e6 * FP64_ATOL, moved_by_groups  # the groups matter: far outside the bound


def test_zero_gradient_step_with_groups_decays_each_group_by_its_own_rate():
    """Zero gradients: each param moves by exactly lr(0) * lr_scale * weight_decay * p, with (lr_scale,
    weight_decay) read off GROUPS by hand (the ndim mask, wd 0.5, for what no group sets)."""
    cfg = make_cfg("--model.n_layer=1", "--optim.weight_decay=0.5", "--optim.max_grad_norm=1", GROUPS)
    before, jax_after, torch_after = zero_gradient_step(cfg)
    for n, x in before.items():
        scale, wd = next((g for key, g in GROUP_OF.items() if key in n), (1.0, None))
        rate = cfg.warmup_init_lr * scale * (wd if wd is not None else (0.5 if x.ndim >= 2 else 0.0))
        for side, after in (("jaxtrain", jax_after), ("torchref", torch_after)):
            # p (1 - rate): one fp32 multiply-subtract, a few U32 of |p|; rtol 1e-3 of the move tells the groups apart
            np.testing.assert_allclose(before[n] - after[n], rate * x, rtol=1e-3, atol=4 * U32,
                                       err_msg=f"{side}: {n} did not decay at lr(0) * {scale} * {wd}")
