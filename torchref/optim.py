"""The update rule in PyTorch idiom: AdamW with two weight-decay groups and a LambdaLR warmup + cosine schedule.

jaxtrain/optim.py writes the same rule in optax; parity_tests puts the two side by side. Step t = 0, 1, 2, ...
counts optimizer updates: the scheduler is stepped once after each optimizer.step(), never per micro-batch.
"""

import math

import torch

from jaxtrain.config import Config

# Module names whose parameters the `names` rule leaves undecayed: biases, the LayerNorms and the embeddings.
NO_DECAY_NAMES = ("bias", "ln_1", "ln_2", "ln_f", "wte", "wpe")


def get_lr(t: int, cfg: Config) -> float:
    """LR applied at optimizer step t: linear warmup from warmup_init_lr to lr over warmup_steps, cosine from
    lr to min_lr at decay_steps, then flat at min_lr. With the default warmup_init_lr = lr / (W + 1) the
    warmup is nanoGPT's lr * (t + 1) / (W + 1), so step 0 already moves the weights."""
    lr, min_lr, init = cfg.optim.lr, cfg.optim.min_lr, cfg.warmup_init_lr
    W, D = cfg.optim.warmup_steps, cfg.decay_steps
    if t < W:
        return init + (lr - init) * t / W
    if t >= D:
        return min_lr
    progress = (t - W) / (D - W)
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decays(name: str, param: torch.Tensor, rule: str) -> bool:
    """Whether weight decay applies. `ndim`: matrices and embeddings, as nanoGPT. `names`: all but biases,
    LayerNorms and embeddings, read from the state-dict name."""
    if rule == "ndim":
        return param.dim() >= 2
    return not set(name.split(".")) & set(NO_DECAY_NAMES)


def configure_optimizer(model: torch.nn.Module, cfg: Config) -> torch.optim.AdamW:
    """AdamW over two groups, decayed first. A tied lm_head.weight is wte's tensor, and named_parameters()
    yields it once, as transformer.wte.weight."""
    o = cfg.optim
    params = list(model.named_parameters())
    decay = [p for n, p in params if decays(n, p, o.decay_mask)]
    no_decay = [p for n, p in params if not decays(n, p, o.decay_mask)]
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.b1, o.b2), eps=o.eps)


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, step: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR scaling optim.lr by get_lr(t) / lr, placed so that the next update uses LR(step): construction
    sets the groups' lr. step > 0 (a resume) is LambdaLR's last_epoch route, which reads each group's initial_lr."""
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.optim.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: get_lr(t, cfg) / cfg.optim.lr, last_epoch=step - 1)
