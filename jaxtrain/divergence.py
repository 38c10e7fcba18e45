"""train.nan_policy, applied on the host to each optimizer step's metrics line, by both backends (pure Python:
torchref imports it).

The loss and the gradient norm reach the host for logging anyway, so the check costs no extra sync.
- halt (the default): a non-finite loss or gradient norm stops the run with exit 2. Both loops check every step
  before they save, so no checkpoint ever follows a non-finite step, and the message names the newest one.
- skip: the step itself left the update out (jaxtrain: optim.unless_finite on device; torchref: no
  optimizer.step()), and the line's cumulative `skipped` count says so. This warns at each skip and halts after
  train.nan_skip_limit skips in a row (counted within one process: a resumed run starts counting again).
Under train.precision=fp16 a non-finite gradient with a finite loss is the loss scale's overflow, which the loss
scaling skips and backs off from as torch's GradScaler does: neither policy acts on it (it counts in `skipped`).
But at train.loss_scale_min, the floor, the scaling has nothing left to try, and there it is a divergence as any
other (DeepSpeed's scaler exits there): else a gradient NaN at any scale would skip every window, without a word.
"""

import math
import sys
from typing import Callable

from jaxtrain import same_run
from jaxtrain.config import Config
from jaxtrain.errors import UserError


class Divergence:
    """`latest_checkpoint`: the step of run.out_dir's newest checkpoint (None: none), looked up on a halt;
    `backend`, "jaxtrain" or "torchref", the format of those checkpoints. A save in flight counts: the lookup
    waits for it. `skipped`: the updates skipped before this process's first step (the state it starts from), so
    that a skip at that first step counts too."""

    def __init__(self, cfg: Config, latest_checkpoint: Callable[[], int | None], backend: str, skipped: int):
        self.cfg, self.backend = cfg, backend
        self.policy, self.limit = cfg.train.nan_policy, cfg.train.nan_skip_limit
        self.loss_scaled, self.floor = cfg.train.precision == "fp16", cfg.train.loss_scale_min
        self.latest_checkpoint = latest_checkpoint
        self.skipped, self.in_a_row = skipped, 0

    def check(self, line: dict) -> None:
        """`line`: a metrics.jsonl train line (step, loss, grad_norm; skipped under nan_policy=skip; loss_scale,
        the scale the window ran with, under fp16)."""
        # fp16, a finite loss: a non-finite gradient is the scale's overflow, GradScaler's business above its floor
        scaled_finite_loss = self.loss_scaled and math.isfinite(line["loss"])
        unscalable = scaled_finite_loss and line["loss_scale"] <= self.floor
        overflow = scaled_finite_loss and not unscalable
        if self.policy == "halt":
            if not (math.isfinite(line["loss"]) and (math.isfinite(line["grad_norm"]) or overflow)):
                self._halt(line, "training diverged", unscalable)
            return
        if line["skipped"] > self.skipped and not overflow:
            self.in_a_row += 1
            print(f"step {line['step']}: loss {line['loss']}, grad norm {line['grad_norm']}: update skipped "
                  f"({self.in_a_row} in a row, {line['skipped']} in all)", file=sys.stderr)
            if self.in_a_row >= self.limit:
                self._halt(line, f"{self.in_a_row} updates in a row were skipped (train.nan_skip_limit)", unscalable)
        else:
            self.in_a_row = 0
        self.skipped = line["skipped"]

    def _halt(self, line: dict, what: str, unscalable: bool) -> None:
        """`unscalable`: fp16's gradient overflowed at the loss scale's floor, which fp16's range explains, not the
        LR."""
        latest = self.latest_checkpoint()
        saved = (f"the newest checkpoint, step {latest}, holds only finite values"
                 if latest is not None else "no checkpoint was saved")
        if unscalable:
            what += f" (the gradient is not finite even at the loss scale's floor, train.loss_scale_min={self.floor})"
            change = "lower train.loss_scale_min or train in bf16 (--train.precision=bf16 has fp32's range)"
        else:
            clip = " or set optim.max_grad_norm" if self.cfg.optim.max_grad_norm == 0 else ""  # not when it is set
            change = f"lower optim.lr{',' if clip else ' or'} lengthen optim.warmup_steps{clip}"
        skip = ("; or resume as it is with --train.nan_policy=skip to step over rare bad batches"
                if self.policy == "halt" and latest is not None else "")
        raise UserError(f"loss {line['loss']}, grad norm {line['grad_norm']} at step {line['step']}: {what}; "
                        f"{saved}: {same_run.new_run_from(self.cfg, latest, self.backend, change)}{skip}")
