"""The update rule, written once: LR schedule, weight-decay mask, param groups, and the optax chain.

    MultiSteps(k)( clip_by_global_norm(c) -> adamw(schedule, b1, b2, eps, wd, mask) )

With optim.groups, adamw's one weight decay and mask become one (weight decay, LR multiplier) per parameter
(param_groups.py): the same chain with a per-group step in the middle (`grouped_adamw`).

Step t = 0, 1, 2, ... counts optimizer updates. MultiSteps feeds the inner chain once per k micro-batches, so the
schedule and AdamW's bias correction advance once per window, never per micro-batch. torchref writes the same rule
in PyTorch idiom (AdamW param groups, LambdaLR, clip_grad_norm_); only parity_tests puts the two side by side.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from flax import nnx

from jaxtrain import model
from jaxtrain import param_groups
from jaxtrain.config import Config

# Path components that the `names` decay rule leaves undecayed (nanoGPT-style names; see model.py).
NO_DECAY_NAMES = ("bias", "ln_1", "ln_2", "ln_f", "wte", "wpe")


def lr_schedule(cfg: Config) -> optax.Schedule:
    """LR(t), optim.schedule: a linear warmup warmup_init_lr -> lr over warmup_steps, then a cosine (the default)
    or linear decay from lr to min_lr at decay_steps, a constant lr, or cycles cosines from lr to min_lr with hard
    restarts; flat at min_lr past decay_steps. `constant` has no warmup.

    With the default warmup_init_lr = lr / (W + 1), LR(t) = lr * (t + 1) / (W + 1) during warmup (nanoGPT's
    get_lr), so the first update is never a no-op.
    """
    o, W, D = cfg.optim, cfg.optim.warmup_steps, cfg.decay_steps
    if o.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=cfg.warmup_init_lr, peak_value=o.lr, warmup_steps=W, decay_steps=D, end_value=o.min_lr)
    if o.schedule == "constant":
        return optax.constant_schedule(o.lr)
    if o.schedule == "linear":
        after_warmup = optax.linear_schedule(o.lr, o.min_lr, D - W)
    elif o.schedule == "cosine_with_restarts":
        after_warmup = cosine_restarts(o.lr, o.min_lr, D - W, o.cycles)
    else:  # constant_with_warmup
        after_warmup = optax.constant_schedule(o.lr)
    if W == 0:
        return after_warmup
    return optax.join_schedules([optax.linear_schedule(cfg.warmup_init_lr, o.lr, W), after_warmup], [W])


def cosine_restarts(peak: float, end: float, steps: int, cycles: int) -> optax.Schedule:
    """`cycles` cosines from peak to end over `steps` (HF's cosine_with_restarts), then end. The position in the
    cycle, (t * cycles mod steps) / steps, is taken in integers: exact, so each restart is at peak on its step."""
    def schedule(count):
        phase = jnp.mod(count * cycles, steps) / steps  # config_checks keeps cycles * steps within int32
        value = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * phase))
        return jnp.where(count >= steps, end, value)
    return schedule


def decay_mask(rule: str):
    """A callable params -> bool pytree: True where weight decay applies.

    `ndim`: matrices and embeddings (ndim >= 2), as nanoGPT's configure_optimizers.
    `names`: everything except biases, LayerNorms and embeddings, by parameter path.
    """
    if rule == "ndim":
        return lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)

    def by_name(params):
        def decays(path, _):
            names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
            return not names & set(NO_DECAY_NAMES)
        return jax.tree_util.tree_map_with_path(decays, params)
    return by_name


class GradNormState(NamedTuple):
    grad_norm: jax.Array  # global L2 norm of the last gradient seen, before clipping


def record_grad_norm() -> optax.GradientTransformation:
    """Identity that keeps the global gradient norm in its state, for logging.

    It sits first in the inner chain, so it sees exactly what clip_by_global_norm sees: the whole window's
    accumulated gradient, before clipping.
    """
    def init(params):
        del params
        return GradNormState(jnp.zeros([], jnp.float32))

    def update(updates, state, params=None):
        del state, params
        return updates, GradNormState(optax.tree.norm(updates).astype(jnp.float32))

    return optax.GradientTransformation(init, update)


def optimizer(cfg: Config) -> optax.MultiSteps:
    """The optax chain. Gradients fed to it must be per-micro-batch shares of the window loss
    (sum CE / valid tokens of the whole window): MultiSteps sums them (use_grad_mean=False), so the accumulated
    gradient is exactly the gradient of the window's token-weighted mean loss."""
    o = cfg.optim
    clip = optax.clip_by_global_norm(o.max_grad_norm) if o.max_grad_norm > 0 else optax.identity()
    if o.groups:
        adamw = grouped_adamw(lr_schedule(cfg), cfg)
    else:
        adamw = optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, eps_root=0.0,
                            weight_decay=o.weight_decay, mask=decay_mask(o.decay_mask))
    loss_scale = [hold_loss_scale(cfg.train.loss_scale_init)] if cfg.train.precision == "fp16" else []
    inner = optax.chain(record_grad_norm(), clip, adamw, *loss_scale)
    return optax.MultiSteps(inner, every_k_schedule=o.grad_accum_steps, use_grad_mean=False)


def add_to_window(opt_state: optax.MultiStepsState, grads) -> optax.MultiStepsState:
    """opt_state with a micro-batch's gradient added to MultiSteps' accumulator, as MultiSteps.update adds it
    (use_grad_mean=False: grad + sum), but without running the inner chain. MultiSteps.update runs clip and AdamW
    over every param at each micro-step and keeps the result at the window's last only (optax's _do_update: jnp.where(
    emit, new, old)), a select XLA cannot skip: with k micro-batches, k - 1 AdamW updates a window computed for
    nothing. The train step adds all k here and applies the sum once (apply_window)."""
    return opt_state._replace(acc_grads=jax.tree.map(lambda g, acc: g + acc, grads, opt_state.acc_grads))


def apply_window(tx: optax.MultiSteps, opt_state: optax.MultiStepsState, params, k: int) -> tuple:
    """(updates, opt_state): the window whose k gradients add_to_window summed into opt_state, applied by
    MultiSteps.update itself at the window's last micro-step (mini_step k - 1) with a zero gradient: sum + 0 is the
    sum, exactly, and MultiSteps runs the inner chain on it, advances its counts and resets the accumulator as when
    fed the k gradients one by one. A window starts at mini_step 0 (each train step is one whole window)."""
    zeros = jax.tree.map(jnp.zeros_like, opt_state.acc_grads)
    return tx.update(zeros, opt_state._replace(mini_step=jnp.full_like(opt_state.mini_step, k - 1)), params)


def grouped_adamw(schedule: optax.Schedule, cfg: Config) -> optax.GradientTransformation:
    """optax.adamw's chain with a Setting per parameter (optim.groups):
    update = -LR(t) * lr_scale * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p), as torch AdamW steps a param
    group at lr = LR(t) * lr_scale. Adam's moments do not depend on the groups, so the state keeps adamw's
    ScaleByAdamState over all params (what the torch bridge maps)."""
    o = cfg.optim

    def labels(params):
        names = model.torch_names(params)
        by_path = {names[name][0]: _label(s) for name, s in param_settings(cfg, params).items()}
        return nnx.from_flat_state([(path, var.replace(by_path[path])) for path, var in nnx.to_flat_state(params)])

    possible = {param_groups.Setting(1.0, o.weight_decay), param_groups.Setting(1.0, 0.0)}
    for g in o.groups.values():
        wds = [o.weight_decay, 0.0] if g.weight_decay is None else [g.weight_decay]
        possible |= {param_groups.Setting(g.lr_scale, wd) for wd in wds}
    per_setting = {_label(s): optax.chain(optax.add_decayed_weights(s.weight_decay), optax.scale(s.lr_scale))
                   for s in possible}
    return optax.chain(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps, eps_root=0.0),
                       optax.multi_transform(per_setting, labels),
                       optax.scale_by_learning_rate(schedule))


def param_settings(cfg: Config, params: nnx.State) -> dict[str, param_groups.Setting]:
    """nanoGPT name -> (lr_scale, weight_decay) of every parameter: optim.groups over the decay mask."""
    mask = {path: var.get_value() for path, var in nnx.to_flat_state(decay_mask(cfg.optim.decay_mask)(params))}
    decays = {name: bool(mask[path]) for name, (path, _) in model.torch_names(params).items()}
    return param_groups.assign(decays, cfg.optim.groups, cfg.optim.weight_decay)


def _label(setting: param_groups.Setting) -> str:
    """One label per distinct Setting: a weight_decay of -0.0 is the 0.0 the set of settings holds (+ 0.0)."""
    return f"lr_scale={setting.lr_scale!r} weight_decay={setting.weight_decay + 0.0!r}"


class LossScaleState(NamedTuple):
    """train.precision=fp16's dynamic loss scale, torch's GradScaler state: the scale (fp32, a power of 2, so that
    scaling and unscaling are exact) and the finite windows in a row since it last changed (its growth tracker)."""
    scale: jax.Array
    good_steps: jax.Array


class LossScaling(NamedTuple):
    """train.precision=fp16's rule for the scale: double it after `growth_interval` finite windows in a row, halve
    it on a non-finite one down to `floor` (train.loss_scale_min), where the loss scaling has no more to give."""
    growth_interval: int
    floor: float


def loss_scaling(cfg: Config) -> LossScaling | None:
    """The run's LossScaling under train.precision=fp16, else None (no loss scaling)."""
    t = cfg.train
    return LossScaling(t.loss_scale_growth_interval, t.loss_scale_min) if t.precision == "fp16" else None


def hold_loss_scale(init_scale: float) -> optax.GradientTransformation:
    """Identity that keeps the loss scale in the optimizer state (so checkpoints carry it), last in the inner
    chain: the train step reads it (`loss_scale`) and writes its next value (`with_loss_scale`)."""
    def init(params):
        del params
        return LossScaleState(jnp.asarray(init_scale, jnp.float32), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        return updates, state

    return optax.GradientTransformation(init, update)


def loss_scale(opt_state: optax.MultiStepsState) -> LossScaleState:
    return opt_state.inner_opt_state[3]


def with_loss_scale(opt_state: optax.MultiStepsState, scaler: LossScaleState) -> optax.MultiStepsState:
    inner = opt_state.inner_opt_state
    return opt_state._replace(inner_opt_state=(*inner[:3], scaler))


def next_loss_scale(scaler: LossScaleState, finite: jax.Array, scaling: LossScaling) -> LossScaleState:
    """GradScaler.update (torch's _amp_update_scale_): a non-finite window halves the scale, but not below the
    floor (as DeepSpeed's and Megatron's scalers stop), and restarts the count; the growth_interval-th finite window
    in a row doubles it (unless that overflows fp32) and restarts the count."""
    good_steps = scaler.good_steps + 1
    grow = finite & (good_steps == scaling.growth_interval)
    grown, backed_off = scaler.scale * 2.0, jnp.maximum(scaler.scale * 0.5, scaling.floor)
    scale = jnp.where(finite, jnp.where(grow & jnp.isfinite(grown), grown, scaler.scale), backed_off)
    return LossScaleState(scale, jnp.where(finite & ~grow, good_steps, 0))


def grad_norm(opt_state: optax.MultiStepsState) -> jax.Array:
    """The pre-clipping global norm of the last completed window's gradient."""
    return opt_state.inner_opt_state[0].grad_norm


def unless_finite(finite: jax.Array, before: tuple, after: tuple) -> tuple:
    """train.nan_policy=skip: (params, opt_state) `after` the window's update where `finite`, else the update left
    out. Left out means params, AdamW's moments and counts (so the LR schedule too) as `before`, as HF Trainer and
    Megatron skip an overflowed step; but the window counts as trained (gradient_step advanced, nothing left
    accumulated: MultiSteps' reset, 0 * the non-finite sum, would keep NaN), so the data moves on. torchref skips
    the same way (no optimizer.step(), no scheduler.step())."""
    def keep(b, a):
        return jnp.where(finite, a, b)
    params = jax.tree.map(keep, before[0], after[0])
    inner = jax.tree.map(keep, before[1].inner_opt_state, after[1].inner_opt_state)
    acc_grads = jax.tree.map(lambda a: keep(jnp.zeros_like(a), a), after[1].acc_grads)
    return params, after[1]._replace(inner_opt_state=inner, acc_grads=acc_grads)


def applied_updates(opt_state: optax.MultiStepsState) -> jax.Array:
    """Updates applied so far: AdamW's bias-correction count, which is also the LR schedule's position. It trails
    the windows trained (gradient_step) by the updates that train.nan_policy=skip left out."""
    return adam_state(opt_state).count


def skipped_updates(opt_state: optax.MultiStepsState) -> jax.Array:
    """Windows whose update was skipped for a non-finite loss or gradient (train.nan_policy=skip)."""
    return opt_state.gradient_step - applied_updates(opt_state)


def adam_state(opt_state: optax.MultiStepsState) -> optax.ScaleByAdamState:
    """AdamW's moments (mu, nu) and bias-correction count inside the chain: what the torch bridge maps."""
    adamw_state = opt_state.inner_opt_state[2]
    return next(s for s in adamw_state if isinstance(s, optax.ScaleByAdamState))
