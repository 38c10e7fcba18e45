"""The PyTorch reference loop: `python -m torchref.run --config configs/X.yaml [--section.key=value ...]`.

The standard loop, in the standard order, once per optimizer step:

    zero_grad -> k x (forward under autocast, token-weighted loss, backward) -> clip_grad_norm_
              -> optimizer.step() -> scheduler.step()

It reads the same config, trains on the same batches (jaxtrain.data), and writes the same metrics.jsonl and the
torch checkpoint format, so the parity suite can lay a torchref run beside a jaxtrain run. SIGTERM and Ctrl-C
stop it as they stop jaxtrain (jaxtrain.preemption): the step in flight is finished (a signal inside
optimizer.step() could leave some tensors updated and others not), saved, and the run exits 0.
"""

if __name__ == "__main__":  # before the imports below (torch takes seconds): a signal during them stops cleanly
    from jaxtrain import preemption
    preemption.install()

import dataclasses
import math
import os
import sys
import time

import torch
from torch.nn import functional as F
from tqdm import tqdm

from jaxtrain import checkpoint_kind, config, data, data_stats, metrics, preemption, runfolder, runlock, same_run
from jaxtrain.config import Config
from jaxtrain.divergence import Divergence
from jaxtrain.errors import UserError, exit_on_user_error
from torchref import checkpoint
from torchref.checkpoint import Progress
from torchref.model import GPT, upcast
from torchref.metrics_log import MetricsLog
from torchref.optim import configure_optimizer, lr_scheduler, schedule_lr

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # train.precision -> autocast's dtype; fp32: off


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        train(config.load(sys.argv[1:] if argv is None else argv, first_check=check_local_run_folder))


def check_local_run_folder(cfg: Config) -> None:
    """The reference loop writes with torch.save and open(): local folders only (said before config validation asks
    for s3fs or gcsfs, which would not help)."""
    if runfolder.is_url(cfg.run.out_dir):
        raise UserError(f"run.out_dir={cfg.run.out_dir!r}: torchref writes its run folder on a local disk only; "
                        f"give it a local path (jaxtrain.run writes to gs:// and s3://)")


def train(cfg: Config) -> None:
    """Train cfg.train.steps optimizer steps in total, continuing from out_dir's checkpoints when there are any."""
    started = time.perf_counter()  # the summary's wall time: start-up included, as jaxtrain's
    check_local_run_folder(cfg)
    if cfg.run.dry_run:
        raise UserError("run.dry_run=true is jaxtrain's: it compiles jaxtrain's step and trains nothing, where "
                        "torchref would train; run it with python -m jaxtrain.run, or drop it")
    lock = runlock.take(cfg.run.out_dir)  # before anything touches the run folder: a refused start leaves it be
    stop = preemption.install()  # `python -m torchref.run` installed it before importing torch
    try:
        try:
            ended = _train(cfg, stop)
        finally:
            lock.release()
        if ended is not None:
            step, summary = ended
            if step == cfg.train.steps:  # a signal from here on (or in the last step) stops at once, as jaxtrain's
                stop.nothing_left_to_save(f"the run is trained and saved at step {step}")
                summary["wall_s"] = time.perf_counter() - started
                print(metrics.summary_line(summary), file=sys.stderr)  # (a stopped run's last line says where)
    finally:
        preemption.uninstall()


def _train(cfg: Config, stop: preemption.StopRequest) -> tuple[int, dict] | None:
    """The step the run ended at and its summary, once its saves are done and its logs closed; None where it
    trained nothing (already trained, or stopped in start-up)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(cfg.run.seed)
    tokens = data.load(cfg.data, cfg.model.seq_len)
    vocab_size, too_small = data.vocab_size_before_resume(cfg.model.vocab_size, tokens, cfg.run.fresh)
    # Written down, so that config.yaml and every checkpoint say what the model was built with.
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    model = GPT(cfg.model).to(device)
    optimizer = configure_optimizer(model, cfg)
    cfg, progress, resumed = start(cfg, model, optimizer, tokens)
    data.refuse_vocab_size_after_resume(too_small, resumed, tokens, cfg.run.out_dir)
    scheduler = lr_scheduler(optimizer, cfg, progress.updates)
    if progress.step >= cfg.train.steps:  # config.yaml stays the one of the run that trained, as in jaxtrain
        print(f"nothing to train: at step {progress.step} of train.steps={cfg.train.steps}", file=sys.stderr)
        return
    if stop.requested:  # before run.fresh moves anything, as jaxtrain
        print(f"stopped before the first step, nothing new to save; {config.start_up_stop_hint(cfg, 'torchref.run')}",
              file=sys.stderr)
        return
    stop.training_started()
    if cfg.run.fresh:
        runfolder.set_aside_previous_run(cfg.run.out_dir)
    config.save(cfg, cfg.run.out_dir)
    data_stats.warn_small_val(tokens, cfg)  # after every check, as jaxtrain
    return _loop(cfg, device, tokens, model, optimizer, scheduler, progress, resumed, stop)


def _loop(cfg: Config, device: str, tokens, model, optimizer, scheduler, progress: Progress, resumed: bool,
          stop: preemption.StopRequest) -> tuple[int, dict]:
    """Steps progress.step+1 .. train.steps, each logged, evaluated and saved as the config says, until a signal
    saves the step in flight; (the step it ended at, its summary)."""
    autocast = torch.autocast(device, dtype=AUTOCAST_DTYPES.get(cfg.train.precision, torch.bfloat16),
                              enabled=cfg.train.precision in AUTOCAST_DTYPES)
    scaler = loss_scaler(cfg, device, progress)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    flops_per_token = metrics.flops_per_token(cfg, model.num_params())  # jaxtrain's rule
    log = MetricsLog(cfg, progress.step if resumed else None, flops_per_token, metrics.peak_flops(cfg, device_name))
    bar = tqdm(total=cfg.train.steps, initial=progress.step, disable=not cfg.log.progress, unit="step")
    loss = eval_loss = eval_accuracy = None
    divergence = Divergence(cfg, lambda: checkpoint.latest_step(cfg.run.out_dir), "torchref", progress.skipped)
    skip_non_finite = cfg.train.nan_policy == "skip"
    start_step = progress.step
    with log, bar:
        log.exclude_time()  # from here on, as jaxtrain's: its training steps and what happens between them
        for step in range(progress.step, cfg.train.steps):
            inputs, targets = data.window(tokens, seed=progress.data_seed, step=step, batch_size=cfg.data.batch_size,
                                          accum_steps=cfg.optim.grad_accum_steps, seq_len=cfg.model.seq_len)
            loss_scale = scaler.get_scale() if scaler else None  # the scale this window's backward runs with
            loss, grad_norm, lr, applied = train_step(
                model, optimizer, scheduler, to_device(inputs, device), to_device(targets, device), autocast,
                cfg.optim.max_grad_norm, skip_non_finite, scaler)
            n_tokens = int((targets >= 0).sum())
            progress.step, progress.tokens = step + 1, progress.tokens + n_tokens
            progress.skipped += not applied
            progress.loss_scale = scaler.state_dict() if scaler else None
            tokens_per_s = log.train(progress, loss, lr, grad_norm, n_tokens, divergence, loss_scale)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            bar.update()  # redraws the bar with the step's numbers
            evaluated = cfg.evaluates_at(progress.step)
            if evaluated:
                eval_loss, eval_accuracy = evaluate(model, tokens, cfg, progress.data_seed, device, autocast)
                log.eval(progress.step, eval_loss, eval_accuracy)
            if cfg.saves_at(progress.step) or stop.requested:
                log.sync()  # W&B has this step before its checkpoint can exist
                checkpoint.save(cfg.run.out_dir, progress, model, optimizer, scheduler, cfg, tokens.fingerprint,
                                eval_loss if evaluated else None)
            if evaluated or cfg.saves_at(progress.step) or stop.requested:
                log.exclude_time()  # evaluation and checkpoint saves are no training step's time
            if stop.requested and progress.step < cfg.train.steps:  # at the last one the run is complete
                hint = config.resume_hint(cfg, "torchref.run")
                print(f"\ninterrupted: saved step {progress.step}; {hint}", file=sys.stderr)
                break
    tokens_per_s = log.mean_tokens_per_s()
    return progress.step, {"start_step": start_step, "step": progress.step, "loss": loss, "eval_loss": eval_loss,
                           "eval_accuracy": eval_accuracy, "tokens_per_s": tokens_per_s,
                           "mfu": metrics.mfu(tokens_per_s, log.flops_per_token, log.peak_flops)}


def start(cfg: Config, model, optimizer, tokens: data.TokenData) -> tuple[Config, Progress, bool]:
    """Where training begins: out_dir's newest checkpoint (unless run.fresh; trained on `tokens`), else init.from,
    else step 0 with the fresh init. Also the config the run goes on with (a resume keeps the run's own init.from:
    checkpoint.resume) and whether this is a resume, whose metrics.jsonl is kept up to the resumed step. run.fresh's
    move of the previous run aside is the caller's, after init.from has loaded (the last check that can refuse the
    start) and no stop was asked: a refused or stopped fresh start leaves it in place, to resume."""
    runfolder.refuse_unfinished_set_aside(cfg.run.out_dir, cfg.run.fresh)
    checkpoint.remove_partial(cfg.run.out_dir)
    # A jaxtrain checkpoint is named for what it is: a resume would call it damaged (run.fresh sets it aside below).
    if not cfg.run.fresh:
        checkpoint_kind.check_own_steps(os.path.join(cfg.run.out_dir, "checkpoints"), "torchref")
    if not cfg.run.fresh and (path := checkpoint.latest(cfg.run.out_dir)) is not None:
        progress, cfg = checkpoint.resume(path, cfg, tokens.fingerprint, model, optimizer)
        print(f"resuming from step {progress.step} ({path})", file=sys.stderr)
        return cfg, progress, True
    progress = Progress(data_seed=cfg.run.seed)
    if cfg.init.from_ is not None:
        loaded = checkpoint.init_from(cfg.init.from_, model, optimizer, tokens)
        what = f"weights and training state at step {loaded.step}" if loaded else "weights"
        print(f"init.from: loaded {what} from {cfg.init.from_}", file=sys.stderr)
        if loaded is not None:  # the data seed rule jaxtrain follows too, and its step's
            same_run.check_init_step(cfg, loaded.step)
            loaded.data_seed = data.continued_seed(loaded.data_seed, cfg)
            progress = loaded
    return cfg, progress, False


def train_step(model, optimizer, scheduler, inputs, targets, autocast, max_grad_norm: float,
               skip_non_finite: bool = False, scaler: "FlooredGradScaler | None" = None):
    """One optimizer update from a window of k micro-batches, inputs and targets (k, B/k, T).
    Returns the window's mean CE, the global gradient norm before clipping, the LR this update applies, and
    whether it was applied: with skip_non_finite (train.nan_policy=skip) a non-finite loss or gradient norm leaves
    the update out, neither optimizer.step() nor scheduler.step() (AdamW's step count and the schedule stay), as
    HF Trainer and Megatron skip an overflowed step; jaxtrain's optim.unless_finite does the same.

    With a GradScaler (train.precision=fp16), in its documented order: scale each micro-batch's loss, backward,
    unscale_, clip, scaler.step (which leaves the update out on an inf or NaN gradient), scaler.update; the
    scheduler steps only after an applied update, as HF Trainer steps it (optimizer_step_was_skipped), so a skip
    leaves AdamW's count and the LR where they were, as nan_policy=skip does. The data moves on either way."""
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_gradients(model, inputs, targets, autocast, scaler)
    if scaler:
        scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    lr = schedule_lr(optimizer)
    loss, grad_norm = loss.item(), grad_norm.item()
    if scaler:
        return loss, grad_norm, lr, scaled_step(scaler, optimizer, scheduler)
    if skip_non_finite and not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return loss, grad_norm, lr, False
    optimizer.step()
    scheduler.step()
    return loss, grad_norm, lr, True


class FlooredGradScaler(torch.amp.GradScaler):
    """torch's GradScaler whose backoff stops at `floor` (train.loss_scale_min), as DeepSpeed's and Megatron's
    scalers stop (jaxtrain: optim.next_loss_scale). `backed_off`: whether the last update() halved the scale, that
    is whether the last scaler.step skipped (the test accelerate uses), which the scale alone no longer tells at the
    floor."""

    def __init__(self, device: str, floor: float, **kwargs):
        super().__init__(device, **kwargs)
        self.floor, self.backed_off = floor, False

    def update(self, new_scale=None) -> None:
        before = self.get_scale()
        super().update(new_scale)
        self.backed_off = new_scale is None and self.get_scale() < before
        if self.get_scale() < self.floor:
            super().update(self.floor)


def scaled_step(scaler: FlooredGradScaler, optimizer, scheduler) -> bool:
    """scaler.step and scaler.update, then the scheduler after an applied update; whether it was applied."""
    scaler.step(optimizer)
    scaler.update()
    if not scaler.backed_off:
        scheduler.step()
    return not scaler.backed_off


def loss_scaler(cfg: Config, device: str, progress) -> FlooredGradScaler | None:
    """train.precision=fp16's GradScaler with the config's initial scale, growth interval and floor (growth x2,
    backoff x0.5: its defaults), at a resumed run's scale and growth tracker."""
    if cfg.train.precision != "fp16":
        return None
    scaler = FlooredGradScaler(device, cfg.train.loss_scale_min, init_scale=cfg.train.loss_scale_init,
                               growth_interval=cfg.train.loss_scale_growth_interval)
    if progress.loss_scale is not None:  # the checkpoint's scale and growth tracker over the config's factors
        scaler.load_state_dict({**scaler.state_dict(), **progress.loss_scale})
    return scaler


def accumulate_gradients(model, inputs, targets, autocast, scaler=None) -> torch.Tensor:
    """Backward through the k micro-batches of one window, leaving in .grad the gradient of the window's
    token-weighted mean CE; returns that mean.

    Each micro-batch's loss is its summed CE over the valid targets of the WHOLE window, so the k backward passes
    add up to exactly the gradient of one big batch however the padding falls. (A mean of per-micro-batch means
    overweights the tokens of sparse micro-batches: the 2024 HF accumulation bug.)"""
    n_valid = (targets >= 0).sum()
    loss = 0.0
    for x, y in zip(inputs, targets):
        with autocast:
            logits = model(x)
        micro_loss = cross_entropy_sum(logits, y) / n_valid
        (scaler.scale(micro_loss) if scaler else micro_loss).backward()
        loss = loss + micro_loss.detach()
    return loss


def cross_entropy_sum(logits, targets) -> torch.Tensor:
    """Summed CE over the valid targets (ids >= 0), in fp32.

    Under bf16 autocast the head's matmul returns bf16 logits, and torch has no CPU matmul that takes bf16 and
    returns fp32 (torch.mm's out_dtype=torch.float32 is CUDA-only), so the logits are cast up here: the loss and
    its softmax run in fp32, from logits rounded once to bf16, as jaxtrain's head rounds them (loss.token_ce
    upcasts them the same way). Any negative target is padding; ignore_index takes a single value, so all of them
    become -1."""
    return F.cross_entropy(upcast(logits).view(-1, logits.size(-1)), targets.view(-1).clamp(min=-1),
                           ignore_index=-1, reduction="sum")


def correct_sum(logits, targets) -> torch.Tensor:
    """Number of targets that are the logits' top-1 prediction; a padding target (< 0) never is one. torch.argmax
    takes the lowest index among equal logits (documented), as jaxtrain's jnp.argmax does; a NaN logit counts as
    the largest in both."""
    return (logits.argmax(dim=-1) == targets).sum()


@torch.no_grad()
def evaluate(model, tokens, cfg: Config, seed: int, device: str, autocast) -> tuple[float, float]:
    """Token-weighted mean CE and top-1 accuracy over the train.eval_batches fixed validation batches, each of
    data.batch_size sequences taken one micro-batch at a time."""
    model.eval()
    total, correct, count = 0.0, 0, 0
    for index in range(cfg.train.eval_batches):
        inputs, targets = data.eval_batch(tokens, seed=seed, index=index, batch_size=cfg.data.batch_size,
                                          accum_steps=cfg.optim.grad_accum_steps, seq_len=cfg.model.seq_len)
        for x, y in zip(to_device(inputs, device), to_device(targets, device)):
            with autocast:
                logits = model(x)
            total += cross_entropy_sum(logits, y).item()
            correct += int(correct_sum(logits, y))
            count += int((y >= 0).sum())
    model.train()
    return total / count, correct / count


def to_device(batch, device: str) -> torch.Tensor:
    """int32 numpy ids -> int64 tensor (what nn.Embedding and cross_entropy index with)."""
    return torch.from_numpy(batch).to(device=device, dtype=torch.long)


if __name__ == "__main__":
    main()
