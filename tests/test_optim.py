"""The update rule on its own: schedule values, decay mask, MultiSteps accumulation and the grad-norm record."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from design_formulas import lr_at, schedule_lr_at
from jaxtrain import config, model, optim, param_groups, step
from jaxtrain.errors import UserError
from jaxtrain.param_groups import ParamGroup, Setting


def make_cfg(*overrides):
    return config.load(["--optim.lr=1e-3", "--optim.min_lr=1e-4", "--optim.warmup_steps=10",
                        "--train.steps=100", *overrides])


# make_cfg's lr 1e-3, min_lr 1e-4, warmup 10, train.steps 100, and what each case changes, written out by hand:
# (overrides, warmup, decay length, LR at step 0). The defaults: decay = train.steps, init = lr / (warmup + 1).
SCHEDULE_CASES = [([], 10, 100, 1e-3 / 11), (["--optim.decay_steps=60"], 10, 60, 1e-3 / 11),
                  (["--optim.warmup_init_lr=0.0"], 10, 100, 0.0), (["--optim.warmup_steps=0"], 0, 100, 1e-3)]


@pytest.mark.parametrize("overrides, warmup, decay, init", SCHEDULE_CASES)
def test_schedule_matches_formula_every_step(overrides, warmup, decay, init):
    schedule = optim.lr_schedule(make_cfg(*overrides))
    for t in range(0, 130):
        expected = lr_at(t, 1e-3, 1e-4, warmup, decay, init)
        # optax evaluates the schedule in float32: relative rounding of a few ulps (2^-24 ~ 6e-8 each).
        assert float(schedule(t)) == pytest.approx(expected, rel=1e-6, abs=1e-12), t


@pytest.mark.parametrize("schedule, cycles", [("linear", 1), ("constant_with_warmup", 1), ("cosine_with_restarts", 3),
                                             ("cosine_with_restarts", 7)])
def test_other_schedules_match_formula_every_step(schedule, cycles):
    """The schedules beside the cosine, with a min_lr (their HF counterparts have none: parity_tests compares
    those), warmup 10, decay at 100 and past it."""
    schedule_fn = optim.lr_schedule(make_cfg(f"--optim.schedule={schedule}", f"--optim.cycles={cycles}"))
    for t in range(0, 130):
        expected = schedule_lr_at(t, schedule, 1e-3, 1e-4, 10, 100, 1e-3 / 11, cycles)
        # float32 schedule: a few ulps relative (the restarts' phase is exact integer arithmetic)
        assert float(schedule_fn(t)) == pytest.approx(expected, rel=1e-6, abs=1e-12), t


def test_constant_schedule_is_lr_from_step_zero():
    schedule = optim.lr_schedule(make_cfg("--optim.schedule=constant", "--optim.warmup_steps=0"))
    for t in range(0, 130):  # lr itself, or its float32 rounding (6e-8 relative) once jitted
        assert float(schedule(t)) == pytest.approx(1e-3, rel=1e-7), t


def test_first_lr_is_not_zero_by_default():
    cfg = make_cfg()
    lr0 = float(optim.lr_schedule(cfg)(0))
    # lr * (t+1) / (W+1) at t=0, as nanoGPT; the schedule runs in float32: a few 2^-24 roundings, within 1e-6
    assert lr0 == pytest.approx(1e-3 / 11, rel=1e-6)
    assert float(optim.lr_schedule(cfg)(10)) == pytest.approx(1e-3, rel=1e-6)


PARAMS = {"wte": {"embedding": jnp.ones((5, 4))}, "h": {"0": {"ln_1": {"scale": jnp.ones(4), "bias": jnp.ones(4)},
                                                         "c_fc": {"kernel": jnp.ones((4, 8)), "bias": jnp.ones(8)}}}}


def test_ndim_mask():
    mask = optim.decay_mask("ndim")(PARAMS)
    assert mask["wte"]["embedding"] and mask["h"]["0"]["c_fc"]["kernel"]
    assert not mask["h"]["0"]["ln_1"]["scale"] and not mask["h"]["0"]["c_fc"]["bias"]


def test_names_mask():
    mask = optim.decay_mask("names")(PARAMS)
    assert mask["h"]["0"]["c_fc"]["kernel"]
    assert not mask["wte"]["embedding"]  # embeddings are excluded by name, unlike the ndim rule
    assert not mask["h"]["0"]["ln_1"]["scale"] and not mask["h"]["0"]["c_fc"]["bias"]


def test_zero_grad_step_decays_exactly_the_masked_params():
    cfg = make_cfg("--optim.weight_decay=0.5", "--optim.max_grad_norm=0")
    tx = optim.optimizer(cfg)
    state = tx.init(PARAMS)
    updates, _ = tx.update(jax.tree.map(jnp.zeros_like, PARAMS), state, PARAMS)
    moved = jax.tree.map(lambda u: bool(jnp.any(u != 0)), updates)
    assert moved == {"wte": {"embedding": True}, "h": {"0": {"ln_1": {"scale": False, "bias": False},
                                                             "c_fc": {"kernel": True, "bias": False}}}}


def test_multisteps_counts_optimizer_steps_and_sums_grads():
    k = 4
    cfg = make_cfg(f"--optim.grad_accum_steps={k}", "--optim.max_grad_norm=0.5", "--data.batch_size=8")
    tx = optim.optimizer(cfg)
    params = {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)}
    state = tx.init(params)
    rng = np.random.default_rng(0)
    micro_grads = [{"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32),
                    "b": jnp.asarray(rng.normal(size=2), jnp.float32)} for _ in range(k)]
    for i, g in enumerate(micro_grads):
        updates, state = tx.update(g, state, params)
        if i < k - 1:  # non-boundary micro-steps emit nothing and leave the schedule where it was
            assert all(float(jnp.max(jnp.abs(u))) == 0 for u in jax.tree.leaves(updates))
            assert int(state.gradient_step) == 0
    assert int(state.gradient_step) == 1 and int(optim.adam_state(state).count) == 1
    summed = jax.tree.map(lambda *g: sum(g), *micro_grads)
    # fp32 sums of 4 terms in different orders: a few ulps of a norm of ~4.
    assert float(optim.grad_norm(state)) == pytest.approx(float(optax.tree.norm(summed)), rel=1e-6)
    # The boundary update is AdamW's first step on the clipped sum: -lr0 * sign(g) for nonzero entries
    # (bias-corrected m/sqrt(v) = g/|g| when eps << |g|), no decay since params are 0.
    lr0 = 1e-3 / 11  # make_cfg's lr * (0 + 1) / (warmup 10 + 1)
    # g / (|g| + eps) differs from sign(g) by eps / |g| <= 4.1e-7 here (smallest clipped |g| 0.024, measured), plus
    # a few fp32 roundings in the bias corrections and the square root (~5e-7): rtol 1e-5 is 10x their sum.
    np.testing.assert_allclose(updates["w"], -lr0 * np.sign(summed["w"]), rtol=1e-5)


# optim.groups' rule (param_groups.assign, shared by both backends) on nanoGPT names, expectations by hand.
NAMES = {"transformer.wte.weight": True, "transformer.h.0.ln_1.weight": False, "transformer.h.0.mlp.c_fc.weight": True,
         "transformer.h.0.mlp.c_fc.bias": False, "lm_head.weight": True}  # name -> the decay mask's verdict


def test_groups_set_lr_scale_and_weight_decay_over_the_mask():
    groups = {"wte": ParamGroup(lr_scale=0.1), "c_fc": ParamGroup(lr_scale=2.0, weight_decay=0.3)}
    assert param_groups.assign(NAMES, groups, weight_decay=0.5) == {
        "transformer.wte.weight": Setting(0.1, 0.5), "transformer.h.0.ln_1.weight": Setting(1.0, 0.0),
        "transformer.h.0.mlp.c_fc.weight": Setting(2.0, 0.3), "transformer.h.0.mlp.c_fc.bias": Setting(2.0, 0.3),
        "lm_head.weight": Setting(1.0, 0.5)}


@pytest.mark.parametrize("groups, words", [
    ({"weight": ParamGroup(), "wte": ParamGroup()}, "transformer.wte.weight matches several"),
    ({"wte": ParamGroup(), "attn": ParamGroup()}, "'attn' matches no parameter"),
])
def test_groups_that_overlap_or_match_nothing_are_refused(groups, words):
    with pytest.raises(UserError, match=words):
        param_groups.assign(NAMES, groups, weight_decay=0.1)


@pytest.mark.parametrize("overrides", [['--optim.groups={"wte": {"weight_decay": -0.0}}'],
                                       ["--optim.weight_decay=-0.0", '--optim.groups={"wte": {"lr_scale": 0.5}}']])
def test_a_weight_decay_of_minus_zero_trains_as_zero(overrides):
    """-0.0 passes the >= 0 checks and equals 0.0 in the set of settings, but was labelled apart from it: optax's
    multi_transform found no transformation for its parameters, a ValueError traceback at the run's start. Now its
    parameters train as undecayed: with a zero gradient, AdamW's update leaves them where they are."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--model.n_layer=1", "--model.d_model=16", "--model.n_head=2",
                       *overrides])
    state = step.init_state(model.init_params(cfg.model, vocab_size=32, precision="fp32", seed=0)[1],
                            optim.optimizer(cfg))
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, _ = optim.optimizer(cfg).update(zeros, state.opt_state, state.params)
    assert float(jnp.max(jnp.abs(updates["wte"]["weight"][...]))) == 0.0


def test_torch_groups_put_lr_scale_one_and_decay_first():
    """torchref's param groups: with no optim.groups [decay, no decay] as before groups existed; group 0 at
    lr_scale 1 where there is one, since the metrics' lr is read from it."""
    plain = param_groups.torch_order(param_groups.assign(NAMES, {}, weight_decay=0.5))
    assert [s for s, _ in plain] == [Setting(1.0, 0.5), Setting(1.0, 0.0)]
    grouped = param_groups.torch_order(param_groups.assign(NAMES, {"wte": ParamGroup(lr_scale=0.1)}, 0.5))
    assert [(s, names) for s, names in grouped] == [
        (Setting(1.0, 0.5), ["transformer.h.0.mlp.c_fc.weight", "lm_head.weight"]),
        (Setting(1.0, 0.0), ["transformer.h.0.ln_1.weight", "transformer.h.0.mlp.c_fc.bias"]),
        (Setting(0.1, 0.5), ["transformer.wte.weight"])]


# train.precision=fp16's loss scale against torch's own GradScaler, driven by the same sequence of finite /
# non-finite windows, with the floor (train.loss_scale_min) written out here: a scale below it is set back to it.
def _torch_scales(init: float, interval: int, floor: float, finite: list[bool]) -> list[float]:
    import torch
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=interval)
    scales = []
    for ok in finite:
        scaler.scale(torch.ones(()))  # GradScaler creates its scale tensor on first use
        param.grad = torch.tensor([1.0 if ok else float("inf")])
        scaler.step(optimizer)
        scaler.update()
        if scaler.get_scale() < floor:
            scaler.update(floor)
        scales.append(scaler.get_scale())
    return scales


@settings(deadline=None, max_examples=40, derandomize=True)
@given(finite=st.lists(st.booleans(), min_size=1, max_size=40), interval=st.integers(1, 5),
       init_exponent=st.sampled_from([0, 16, 32, 126, 127]), floor_exponent=st.sampled_from([-126, 0, 10, 30]))
def test_loss_scale_moves_as_torch_gradscaler(finite, interval, init_exponent, floor_exponent):
    """Backoff on every non-finite window down to the floor, growth on the interval-th finite one in a row, no
    growth past fp32's range (init 2^127): the scale after each window equals GradScaler's held at the floor."""
    init, floor = 2.0 ** init_exponent, 2.0 ** min(floor_exponent, init_exponent)
    state = optim.LossScaleState(jnp.float32(init), jnp.int32(0))
    ours = []
    for ok in finite:
        state = optim.next_loss_scale(state, jnp.bool_(ok), optim.LossScaling(interval, floor))
        ours.append(float(state.scale))
    assert ours == _torch_scales(init, interval, floor, finite)
