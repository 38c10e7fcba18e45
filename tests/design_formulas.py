"""DESIGN.md's rules written out by hand, in float64: the expectations the tests in this folder compare against.

Nothing here calls jaxtrain's optax schedule or mask builder, so a test that checks the trainer against these
formulas fails when the trainer's rule changes.
"""

import math

# Host float64 arithmetic against the same formula written another way: ~1e-16 per operation, so 1e-12 leaves
# thousands of operations of headroom and still catches any change of rule.
FP64 = 1e-12


def lr_at(t: int, lr: float, min_lr: float, warmup: int, decay: int, init: float) -> float:
    """LR applied at optimizer step t: linear warmup init -> lr over `warmup` steps, cosine lr -> min_lr at step
    `decay` (counted from 0, warmup included), flat at min_lr afterwards."""
    if t < warmup:
        return init + (lr - init) * t / warmup
    if t >= decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (decay - warmup)))


def default_lr_at(t: int, lr: float, min_lr: float, warmup: int, decay: int) -> float:
    """The same with the default warmup_init_lr = lr / (warmup + 1): lr * (t + 1) / (warmup + 1) in warmup."""
    return lr_at(t, lr, min_lr, warmup, decay, lr / (warmup + 1))


def schedule_lr_at(t: int, schedule: str, lr: float, min_lr: float, warmup: int, decay: int, init: float,
                   cycles: int = 1) -> float:
    """optim.schedule's LR at step t: `constant` is lr throughout (no warmup); the others warm up as lr_at, then
    constant_with_warmup stays at lr, linear falls in a straight line to min_lr at `decay`, cosine_with_restarts
    runs `cycles` equal cosines from lr to min_lr between warmup and decay; all but the constants flat at min_lr
    from `decay` on."""
    if schedule == "constant":
        return lr
    if schedule == "cosine" or t < warmup:
        return lr_at(t, lr, min_lr, warmup, decay, init)
    if schedule == "constant_with_warmup":
        return lr
    if t >= decay:
        return min_lr
    fraction = (t - warmup) / (decay - warmup)
    if schedule == "linear":
        return lr - (lr - min_lr) * fraction
    cycle_fraction = fraction * cycles - math.floor(fraction * cycles + 1e-9)  # + 1e-9: a restart is exactly 0
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * cycle_fraction))


# Top-1 by hand, ties included: each position's argmax under the lowest-index rule, and whether it hits the target.
TOP1_LOGITS = [[[1, 3, 3, 0],    # tie 1/2 -> 1; target 1: hit
                [1, 3, 3, 0],    # tie 1/2 -> 1; target 2: miss (the higher index of a tie is not the prediction)
                [5, 0, 0, 5]],   # tie 0/3 -> 0; target 0: hit
               [[0, 0, 0, 0],    # all tie -> 0; target 0: hit
                [9, 0, 0, 0],    # padding (target -1): not a hit whatever the logits
                [0, 1, 0, 2]]]   # 3; target 3: hit
TOP1_TARGETS = [[1, 2, 0], [0, -1, 3]]
TOP1_HITS = 4  # ties to the highest index would give 2
