"""The update rule in PyTorch idiom: AdamW with weight-decay (and optim.groups) param groups, and a LambdaLR
schedule (warmup, then cosine, linear, constant or cosine with restarts).

jaxtrain/optim.py writes the same rule in optax; parity_tests puts the two side by side. Step t = 0, 1, 2, ...
counts optimizer updates: the scheduler is stepped once after each optimizer.step(), never per micro-batch.
"""

import math

import torch

from jaxtrain import param_groups
from jaxtrain.config import Config

# Module names whose parameters the `names` rule leaves undecayed: biases, the LayerNorms and the embeddings.
NO_DECAY_NAMES = ("bias", "ln_1", "ln_2", "ln_f", "wte", "wpe")


def get_lr(t: int, cfg: Config) -> float:
    """LR applied at optimizer step t (optim.schedule): linear warmup from warmup_init_lr to lr over warmup_steps,
    then cosine or linear from lr to min_lr at decay_steps, constant lr, or `cycles` cosines from lr to min_lr
    with hard restarts; flat at min_lr past decay_steps; `constant` has no warmup. With the default
    warmup_init_lr = lr / (W + 1) the warmup is nanoGPT's lr * (t + 1) / (W + 1), so step 0 already moves the
    weights."""
    o, init = cfg.optim, cfg.warmup_init_lr
    W, D = o.warmup_steps, cfg.decay_steps
    if o.schedule == "constant":
        return o.lr
    if t < W:
        return init + (o.lr - init) * t / W
    if o.schedule == "constant_with_warmup":
        return o.lr
    if t >= D:
        return o.min_lr
    progress = (t - W) / (D - W)
    if o.schedule == "linear":
        return o.lr + (o.min_lr - o.lr) * progress
    if o.schedule == "cosine_with_restarts":
        progress = (t - W) * o.cycles % (D - W) / (D - W)  # where in its cycle, in exact integers
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decays(name: str, param: torch.Tensor, rule: str) -> bool:
    """Whether weight decay applies. `ndim`: matrices and embeddings, as nanoGPT. `names`: all but biases,
    LayerNorms and embeddings, read from the state-dict name."""
    if rule == "ndim":
        return param.dim() >= 2
    return not set(name.split(".")) & set(NO_DECAY_NAMES)


def configure_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW over one param group per (lr_scale, weight_decay) that optim.groups and the decay mask give
    (param_groups.torch_order: with no optim.groups, [decay, no decay]). A tied lm_head.weight is wte's tensor, and
    named_parameters() yields it once, as transformer.wte.weight."""
    o = cfg.optim
    params = dict(model.named_parameters())
    settings = param_groups.assign({n: decays(n, p, o.decay_mask) for n, p in params.items()}, o.groups,
                                   o.weight_decay)
    groups = [{"params": [params[n] for n in names], "weight_decay": s.weight_decay, "lr_scale": s.lr_scale}
              for s, names in param_groups.torch_order(settings)]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR scaling each group's lr * lr_scale by get_lr(t) / lr, placed so that the next update uses LR(step):
    construction sets the groups' lr. step > 0 (a resume) is LambdaLR's last_epoch route, which reads each group's
    initial_lr."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.optim.lr * group["lr_scale"]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: get_lr(t, cfg) / cfg.optim.lr, last_epoch=step - 1)


def schedule_lr(optimizer: torch.optim.Optimizer) -> float:
    """LR(t) of the next update, before any group's lr_scale: what the metrics' lr column reports."""
    group = optimizer.param_groups[0]  # lr_scale 1 where any group has it (param_groups.torch_order)
    return group["lr"] / group["lr_scale"]
