"""Whether a run configuration's values make sense, alone and together: counts within int32, rates in range, the
schedule's lengths consistent, the batch divisible into micro-batches and tiles, the run folder writable and the
data folder there. config.load calls `validate` on every Config it decodes; a wrong value becomes one `UserError`
naming the key and the fix. `cfg` is a jaxtrain.config.Config (config imports this module, not the other way).
Pure Python, as config is.
"""

import dataclasses
import importlib
import math
import os
import struct

from jaxtrain import cmdline
from jaxtrain import param_groups
from jaxtrain import runfolder
from jaxtrain.errors import UserError

# The schedules that decay from lr to min_lr over decay_steps (optim.py), so whose warmup must end before it and
# whose min_lr must not lie above lr; the constant ones never reach min_lr.
DECAYING_SCHEDULES = ("cosine", "linear", "cosine_with_restarts")

# optax, MultiSteps and the train state count steps in int32: a larger count would wrap around.
INT32_MAX = 2**31 - 1
PATH_KEYS = {"run.out_dir", "data.path", "data.cache_dir", "init.from"}  # the text keys that name a folder
FLOAT32_SMALLEST_NORMAL = 2.0**-126
# hopper_gemm's kernels tile their gemm in multiples of this many rows, columns and k (their epilogue's tiles)
HOPPER_GEMM_TILE = 64


def validate(cfg) -> None:
    """Check what a wrong value would otherwise turn into a shape error or a silent mistake later."""
    _check_numbers(cfg)
    _check_text(cfg)
    _check_optional(cfg)
    _check_mesh(cfg)
    _check_ranges(cfg)
    param_groups.validate(cfg.optim.groups)
    _check_float32(cfg)
    _check_schedule(cfg)
    if cfg.data.batch_size % cfg.optim.grad_accum_steps:
        raise UserError(f"data.batch_size={cfg.data.batch_size} is not divisible by optim.grad_accum_steps="
                        f"{cfg.optim.grad_accum_steps}; batch_size counts sequences per optimizer step, so pick a "
                        f"multiple")
    _check_vocab_tiles(cfg)
    _check_keep_best(cfg)
    _check_hopper_kernels(cfg)
    if cfg.model.residual_dtype == "bf16" and cfg.train.precision != "bf16":
        raise UserError(f"model.residual_dtype=bf16 rounds the residual stream to bf16, which train.precision="
                        f"{cfg.train.precision} does not compute in; use train.precision=bf16 or "
                        f"model.residual_dtype=fp32")
    _check_places(cfg)


def _check_ranges(cfg) -> None:
    """Counts, rates and scales each within what its formula allows."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    positive = {
        "model.seq_len": m.seq_len, "model.n_layer": m.n_layer, "model.n_head": m.n_head,
        "model.d_model": m.d_model, "data.batch_size": cfg.data.batch_size, "optim.grad_accum_steps": o.grad_accum_steps,
        "train.steps": t.steps, "train.eval_batches": t.eval_batches, "checkpoint.every": cfg.checkpoint.every,
        "checkpoint.max_to_keep": cfg.checkpoint.max_to_keep, "log.every": cfg.log.every, "optim.lr": o.lr,
        "train.nan_skip_limit": t.nan_skip_limit, "run.lock_timeout_s": cfg.run.lock_timeout_s,
        "optim.cycles": o.cycles, "train.loss_scale_init": t.loss_scale_init,
        "train.loss_scale_growth_interval": t.loss_scale_growth_interval, "train.loss_scale_min": t.loss_scale_min,
        "optim.eps": o.eps,  # AdamW's m / (sqrt(v) + eps) is 0 / 0 for a weight no gradient has reached yet
    }
    for key, value in positive.items():
        if value <= 0:
            raise UserError(f"{key} must be > 0, got {value}")
    non_negative = {"optim.warmup_steps": o.warmup_steps, "optim.min_lr": o.min_lr, "optim.weight_decay": o.weight_decay,
                    "optim.max_grad_norm": o.max_grad_norm, "train.eval_every": t.eval_every,
                    "log.sample_tokens": cfg.log.sample_tokens}
    for key, value in non_negative.items():
        if value < 0:
            raise UserError(f"{key} must be >= 0, got {value}")
    prompt_tokens = len(cfg.log.sample_prompt.encode())  # at most: a byte-level or BPE token is a byte or more
    if cfg.log.sample_tokens > INT32_MAX - prompt_tokens:  # the sample's positions are int32 (jaxtrain.sample)
        raise UserError(f"log.sample_tokens={cfg.log.sample_tokens} after a prompt of up to {prompt_tokens} tokens "
                        f"runs past the int32 positions of the sample ({INT32_MAX}); ask for at most "
                        f"{INT32_MAX - prompt_tokens}, or 0 for no sample")
    if m.d_model % m.n_head:
        raise UserError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                        f"choose n_head among the divisors of d_model (e.g. {_divisors_near(m.d_model, m.n_head)})")
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    for key in ("b1", "b2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise UserError(f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    scales = (("loss_scale_init", t.loss_scale_init, 65536), ("loss_scale_min", t.loss_scale_min, 1))
    for key, scale, example in scales:
        if not (math.log2(scale).is_integer() and 2.0**-126 <= scale <= 2.0**127):
            raise UserError(f"train.{key}={scale} must be a power of 2 (e.g. {example}) from 2**-126 to 2**127 (a "
                            f"normal fp32 number), so that scaling the loss and unscaling its gradient are exact")
    if t.loss_scale_init < t.loss_scale_min:
        raise UserError(f"train.loss_scale_init={t.loss_scale_init} is below train.loss_scale_min="
                        f"{t.loss_scale_min}, the floor the scale never falls below; lower train.loss_scale_min too")


def _check_schedule(cfg) -> None:
    """The LR schedule's lengths and levels fit together."""
    o = cfg.optim
    if o.schedule == "constant" and o.warmup_steps:
        raise UserError(f"optim.schedule=constant has no warmup, but optim.warmup_steps={o.warmup_steps}; set "
                        f"optim.warmup_steps=0, or use optim.schedule=constant_with_warmup")
    if o.schedule in DECAYING_SCHEDULES and o.warmup_steps >= cfg.decay_steps:
        raise UserError(f"optim.warmup_steps={o.warmup_steps} must be smaller than the decay length {cfg.decay_steps} "
                        f"(optim.decay_steps, default train.steps); lower warmup_steps or raise decay_steps")
    if o.schedule == "cosine_with_restarts" and not o.cycles * (cfg.decay_steps - o.warmup_steps) <= INT32_MAX:
        raise UserError(f"optim.cycles={o.cycles} over {cfg.decay_steps - o.warmup_steps} decay steps is past the "
                        f"int32 arithmetic of the schedule's phase; use fewer cycles")
    if o.schedule in DECAYING_SCHEDULES and o.min_lr > o.lr:
        raise UserError(f"optim.min_lr={o.min_lr} is larger than optim.lr={o.lr}; optim.schedule={o.schedule} decays "
                        f"from lr to min_lr: lower min_lr or raise lr")


def _check_places(cfg) -> None:
    """The run folder can be written and W&B is installed if asked for. The data folder is data.load's to check:
    each host reads its own, and a run of several processes learns there, after they joined, that one lacks it
    (refused here, the others waited for that process at the join until its timeout)."""
    if runfolder.is_url(cfg.run.out_dir):
        runfolder.check_url(cfg.run.out_dir, writes=not cfg.run.dry_run)
    elif not cfg.run.dry_run:  # which writes nothing there (the README's gpt-1b dry run names a cluster's folder)
        runfolder.check_local(cfg.run.out_dir)
    if cfg.log.wandb and not cfg.run.dry_run:
        _check_wandb(cfg)


def _check_numbers(cfg) -> None:
    """Every float finite (nan and inf would train, or fail far from the cause); every count within int32."""
    for key, value in _values(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"{key} must be a finite number, got {value}")
        if key == "run.seed" and not 0 <= value < 2**32:
            raise UserError(f"run.seed={value} must be in [0, 2**32): the batch order and the init draw from it")
        if isinstance(value, int) and not isinstance(value, bool) and key != "run.seed" and abs(value) > INT32_MAX:
            raise UserError(f"{key}={value} is out of range: counts must be at most {INT32_MAX} (2**31 - 1, "
                            f"the int32 step counters of optax)")


def _check_float32(cfg) -> None:
    """Every float one that float32 holds as a normal number. jax computes with the config's numbers in float32 (x64
    is off), where one beyond its range is inf, and one below its smallest normal (2**-126) is 0 or a subnormal,
    which XLA flushes to 0 on CPUs (optim.eps=1e-40 divided by it: inf) and TPUs have none of; torchref keeps
    Python's float64, so the two backends would not run the same config (optim.lr=1e300 was inf in jaxtrain's
    schedule). After the checks of ranges, whose messages say more for the keys they know."""
    for key, value in _float_values(cfg):
        try:
            in_float32 = struct.unpack("f", struct.pack("f", value))[0]  # rounds as numpy's float32 does
        except OverflowError:  # older Pythons refuse to pack what rounds to inf, where 3.11 packs inf
            in_float32 = math.inf
        if math.isinf(in_float32):
            raise UserError(f"{key}={value} is beyond float32's range (magnitudes up to 3.4e38), in which jax "
                            f"computes with it: there it would be inf; give a value float32 holds")
        if value and abs(in_float32) < FLOAT32_SMALLEST_NORMAL:
            raise UserError(f"{key}={value} is below float32's smallest normal magnitude (2**-126, about 1.2e-38), "
                            f"in which jax computes with it: there it would be 0, or flushed to 0; give 0 or a "
                            f"value of at least that magnitude")


def _check_text(cfg) -> None:
    """Paths and names not empty (`--run.out_dir=` would write into the current folder) and free of control
    characters (a newline in a path is a paste gone wrong, and would split every message that names it)."""
    for key, value in _values(cfg):
        if key == "log.sample_prompt":  # text to continue, not a path: any characters, new lines included
            if not value:
                raise UserError(f"{key} is empty: the sample needs text to continue; leave it out for a new line")
            continue
        kind = "folder" if key in PATH_KEYS else "name"
        if isinstance(value, str) and not value.strip():
            raise UserError(f"{key} is empty; give it a {kind}, or leave it out for its default")
        if isinstance(value, str) and any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise UserError(f"{key}={value!r} holds a control character; give a plain {kind}")


def _check_vocab_tiles(cfg) -> None:
    """model.vocab_tiles splits a micro-batch's tokens into equal tiles (loss.tiled_ce_sum)."""
    tiles, tokens = cfg.model.vocab_tiles, cfg.micro_batch_size * cfg.model.seq_len
    if tiles < 1:
        raise UserError(f"model.vocab_tiles must be >= 1 (1: the whole logits at once), got {tiles}")
    if tokens % tiles:
        raise UserError(f"model.vocab_tiles={tiles} does not divide the {tokens} tokens of a micro-batch (data.batch_"
                        f"size / optim.grad_accum_steps x model.seq_len); choose a divisor, e.g. {math.gcd(tokens, tiles)}")


def _check_hopper_kernels(cfg) -> None:
    """model.gelu_fwd=pallas's, model.gelu_grad=pallas's, model.head_lse=pallas's and model.qkv_grad=pallas's kernels
    are written for Hopper
    GPUs (a dry run compiling for another one would say it fits) and multiply bf16 or fp16 operands (wgmma) in tiles
    of HOPPER_GEMM_TILE rows, columns and k: d_model and the tokens, and the head's n, the vocabulary, in two tiles'
    columns (hopper_gemm), and so d_model where it is qkv_grad's n. Each device's tokens of a micro-batch are checked
    where the devices are known (the kernels), and a vocabulary taken from the data where it is (head_lse).
    qkv_grad's weight blocks are columns of c_attn's weight, whole on each device only where fsdp does not split
    it."""
    for key in [k for k, value in {"model.gelu_fwd": cfg.model.gelu_fwd, "model.gelu_grad": cfg.model.gelu_grad,
                                   "model.head_lse": cfg.model.head_lse, "model.qkv_grad": cfg.model.qkv_grad}.items()
                if value == "pallas"]:
        if cfg.train.precision == "fp32":
            raise UserError(f"{key}=pallas is a bf16 or fp16 kernel; under train.precision=fp32 use {key}=xla")
        if key.startswith("model.gelu_") and cfg.model.gelu_approximate != "none":
            raise UserError(f"{key}=pallas computes the exact GELU, not model.gelu_approximate="
                            f"{cfg.model.gelu_approximate}; use {key}=xla")
        if cfg.run.target_device not in (None, "h100", "h200"):
            raise UserError(f"{key}=pallas is a kernel for Hopper GPUs (h100, h200), not "
                            f"run.target_device={cfg.run.target_device}; use {key}=xla")
        sizes = {"model.d_model": (cfg.model.d_model, HOPPER_GEMM_TILE),
                 "a micro-batch's tokens (data.batch_size / optim.grad_accum_steps x model.seq_len)":
                     (cfg.micro_batch_size * cfg.model.seq_len, HOPPER_GEMM_TILE)}
        if key == "model.head_lse" and cfg.model.vocab_size is not None:
            sizes["model.vocab_size"] = (cfg.model.vocab_size, 2 * HOPPER_GEMM_TILE)
        if key == "model.qkv_grad":  # d_model is its gemm's n
            sizes["model.d_model"] = (cfg.model.d_model, 2 * HOPPER_GEMM_TILE)
        for name, (size, tile) in sizes.items():
            if size % tile:
                raise UserError(f"{key}=pallas needs {name} to be a multiple of {tile} (its kernel's tiles), got "
                                f"{size}; use {key}=xla")
    if cfg.model.qkv_grad == "pallas" and cfg.mesh.fsdp > 1:
        raise UserError(f"model.qkv_grad=pallas reads c_attn's weight whole on each device, which mesh.fsdp="
                        f"{cfg.mesh.fsdp} splits; use model.qkv_grad=xla, or mesh.fsdp=1")
    if cfg.model.head_lse == "pallas" and cfg.model.vocab_tiles > 1:
        raise UserError(f"model.head_lse=pallas computes the whole logits, which model.vocab_tiles="
                        f"{cfg.model.vocab_tiles} never forms; use one of the two (model.vocab_tiles=1 or "
                        f"model.head_lse=xla)")


def _check_keep_best(cfg) -> None:
    """checkpoint.keep_best ranks the saves that have an eval loss: those where an evaluation falls on a save step,
    every lcm(checkpoint.every, train.eval_every) steps. Where none does before the last step (the newest, kept
    anyway), it kept nothing extra without a word."""
    every, eval_every, steps = cfg.checkpoint.every, cfg.train.eval_every, cfg.train.steps
    if cfg.checkpoint.keep_best and (eval_every == 0 or math.lcm(every, eval_every) >= steps):
        raise UserError(f"checkpoint.keep_best keeps the save with the lowest eval loss, and a save has one only "
                        f"at an evaluation: with checkpoint.every={every} and train.eval_every={eval_every} none "
                        f"falls on one before the last step ({steps}); make checkpoint.every a multiple of "
                        f"train.eval_every (> 0), e.g. --train.eval_every={every}")


def _check_optional(cfg) -> None:
    """Keys that may be null (meaning: derive it) must be in range when set."""
    m, o = cfg.model, cfg.optim
    for key, value in {"model.vocab_size": m.vocab_size, "optim.decay_steps": o.decay_steps,
                       "log.peak_tflops": cfg.log.peak_tflops, "run.dry_run_devices": cfg.run.dry_run_devices}.items():
        if value is not None and value <= 0:
            raise UserError(f"{key} must be > 0 (or null to derive it), got {value}")
    for key, value in {"run.target_device": cfg.run.target_device,
                       "run.dry_run_devices": cfg.run.dry_run_devices}.items():
        if value is not None and not cfg.run.dry_run:  # a "will it fit" command without its dry_run trained
            raise UserError(f"{key}={value} acts in a dry run only (what the dry run compiles for and judges); add "
                            f"--run.dry_run=true, or leave {key} out to train on this machine's devices")
    if o.warmup_init_lr is not None and o.warmup_init_lr < 0:
        raise UserError(f"optim.warmup_init_lr must be >= 0 (or null for lr / (warmup_steps + 1)), "
                        f"got {o.warmup_init_lr}")


def _check_mesh(cfg) -> None:
    """The axis sizes alone; mesh.validate_devices checks them against the devices a run finds."""
    if cfg.mesh.fsdp <= 0:
        raise UserError(f"mesh.fsdp must be > 0 (1: no sharding), got {cfg.mesh.fsdp}")
    if cfg.mesh.data != -1 and cfg.mesh.data <= 0:
        raise UserError(f"mesh.data must be > 0, or -1 for all devices not used by fsdp, got {cfg.mesh.data}")


def _check_wandb(cfg) -> None:
    """log.wandb=true needs the wandb package (an optional extra), a project name W&B takes and a mode it knows,
    each judged by wandb's own Settings before anything starts (wandb.init raised them after the step compiled)."""
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as e:
        raise UserError(f"log.wandb=true needs the wandb package ({e}): pip install 'jaxtrain[wandb]', "
                        f"or drop --log.wandb=true") from None
    checks = [("log.wandb_project", cfg.log.wandb_project, "project", "choose another project name")]
    if cfg.log.wandb_mode is None:  # the config's own mode is online or offline; the environment's may be anything
        checks.append(("WANDB_MODE", wandb_mode(cfg), "mode", "set another, unset it, or pass --log.wandb_mode"))
    for key, value, setting, fix in checks:
        try:
            wandb.Settings(**{setting: value})
        except (wandb.errors.Error, ValueError) as e:  # UsageError; pydantic's ValidationError, a ValueError
            reason = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
            raise UserError(f"{key}={value!r} is not one W&B takes ({reason}); {fix}") from None


def wandb_mode(cfg) -> str:
    """The mode a W&B run starts in: log.wandb_mode, else WANDB_MODE, else online."""
    return cfg.log.wandb_mode or os.environ.get("WANDB_MODE") or "online"


def _values(cfg):
    """(`section.key` as spelled in YAML, value) for every field."""
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(section.type):
            yield f"{section.name}.{cmdline.yaml_name(f)}", getattr(getattr(cfg, section.name), f.name)


def _float_values(cfg):
    """(key, value) for every float of the config, the parameter groups' among them."""
    yield from ((key, value) for key, value in _values(cfg) if isinstance(value, float))
    for pattern, group in cfg.optim.groups.items():
        for name in ("lr_scale", "weight_decay"):
            if getattr(group, name) is not None:
                yield f"optim.groups[{pattern!r}].{name}", float(getattr(group, name))


def _divisors_near(n: int, k: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(divisors, key=lambda d: abs(d - k))[:3])
