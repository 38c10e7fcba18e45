"""torchref's metrics.jsonl (and W&B lines): the lines jaxtrain's MetricsLogger writes, through the same rules
(jaxtrain.metrics: the line's fields, a resume's truncation, throughput over training time only), so the parity
suite reads both runs alike; and the one-time note naming the jaxtrain-only keys a config sets, which torchref
does not act on.
"""

import functools
import os
import sys
import time

from tqdm import tqdm

from jaxtrain import metrics, runfolder, wandb_log
from jaxtrain.config import Config
from jaxtrain.divergence import Divergence
from torchref.checkpoint import Progress

# The keys torchref does not read, each with the value that asks nothing of a trainer: what jaxtrain writes besides
# metrics.jsonl, and how it computes (over devices, with which kernels), not what (torchref/model.py's GPT).
JAXTRAIN_ONLY = {"log.tensorboard": False, "log.sample_tokens": 0, "mesh.data": -1, "mesh.fsdp": 1,
                 "model.attention": "auto", "model.norm": "auto", "model.gelu_fwd": "xla", "model.gelu_grad": "xla",
                 "model.head_lse": "xla", "model.qkv_grad": "xla", "model.remat": "none", "model.vocab_tiles": 1,
                 "model.cpu_dots": "auto"}


def jaxtrain_only(cfg: Config) -> list[str]:
    """`key=value` for each of JAXTRAIN_ONLY's keys that cfg sets to something torchref would leave undone."""
    values = {key: functools.reduce(getattr, key.split("."), cfg) for key in JAXTRAIN_ONLY}
    return [f"{key}={value}" for key, value in values.items() if value != JAXTRAIN_ONLY[key]]


class MetricsLog:
    """<out_dir>/metrics.jsonl: a line every log.every optimizer steps and at the last one (Config.logs_at), and
    eval lines. Throughput counts training time only (evaluation and checkpoints left out), over the steps since
    the previous line.

    A resumed run first drops the lines past its checkpoint, so the file reads as if it had never stopped;
    any other start begins the file empty. log.wandb=true: the same lines to W&B (jaxtrain.wandb_log)."""

    def __init__(self, cfg: Config, resumed_step: int | None, flops_per_token: float, peak_flops: float | None):
        self.path = os.path.join(cfg.run.out_dir, "metrics.jsonl")
        self.cfg, self.flops_per_token, self.peak_flops = cfg, flops_per_token, peak_flops
        unread = jaxtrain_only(cfg)
        if unread:  # said once training starts, after every refusal
            print(f"torchref: {', '.join(unread)}: jaxtrain's (its TensorBoard events, end-of-run sample, devices "
                  f"and kernels), not read here; torchref trains the same math on one device, and metrics.jsonl "
                  f"holds the same lines", file=sys.stderr)
        kept = metrics.kept_lines(self.path, resumed_step)
        self.wandb = wandb_log.WandbLog(cfg, start_step=resumed_step or 0, resumed=resumed_step is not None,
                                        last_jsonl_step=metrics.last_step(self.path)) if cfg.log.wandb else None
        self.kept = kept
        self.tokens = self.seconds = 0  # since the last line
        self.run = metrics.RunThroughput()  # for the summary
        self.last_time = time.perf_counter()

    def __enter__(self):
        # jaxtrain's file: written whole first (a kill leaves the old file or the new), a full disk named
        self.file = runfolder.GrowingFile(runfolder.path(self.path), self.kept)
        return self

    def __exit__(self, *exc):
        self.file.close()
        if self.wandb:
            self.wandb.close()

    def train(self, progress: Progress, loss: float, lr: float, grad_norm: float, n_tokens: int,
              divergence: Divergence, loss_scale: float | None = None) -> float:
        """Record one optimizer step, and apply train.nan_policy to it (before anything is saved); returns its
        tokens/s for the progress bar. Its time: since the step before was recorded, or since the last
        exclude_time (jaxtrain's rule, MetricsLogger.train: the host's work between steps counts)."""
        now = time.perf_counter()
        seconds, self.last_time = max(now - self.last_time, 1e-9), now
        self.tokens, self.seconds = self.tokens + n_tokens, self.seconds + seconds
        self.run.add(n_tokens, seconds)
        line = metrics.train_line(progress.step, loss, lr, grad_norm, progress.tokens, self.tokens / self.seconds,
                                  self.flops_per_token, self.peak_flops)
        if divergence.policy == "skip" or loss_scale is not None:
            line["skipped"] = progress.skipped
        if loss_scale is not None:  # train.precision=fp16
            line["loss_scale"] = loss_scale
        if self.cfg.logs_at(progress.step):
            self._write(line)  # its time counts, as in jaxtrain
            self.tokens = self.seconds = 0
        divergence.check(line)
        return n_tokens / seconds

    def eval(self, step: int, eval_loss: float, eval_accuracy: float) -> None:
        self._write({"step": step, "eval_loss": eval_loss, "eval_accuracy": eval_accuracy})
        tqdm.write(metrics.eval_text(step, eval_loss, eval_accuracy))  # above any progress bar, as jaxtrain's

    def sync(self) -> None:
        if self.wandb:
            self.wandb.sync()

    def exclude_time(self) -> None:
        """Leave the time since the last recorded step (an evaluation, a checkpoint save) out of tokens_per_s."""
        self.last_time = time.perf_counter()

    def mean_tokens_per_s(self) -> float | None:
        return self.run.tokens_per_s()

    def _write(self, record: dict) -> None:
        self.file.write(metrics.json_line(record))
        if self.wandb:  # after metrics.jsonl, whose last step bounds what W&B may have (jaxtrain.wandb_log)
            self.wandb.log(record["step"], metrics.scalars(record))
