"""The run configuration: typed dataclass sections, loaded from YAML with dotted command-line overrides.

    python -m jaxtrain.run --config configs/tiny.yaml --optim.lr=3e-4 --train.steps=500

The command line and the YAML file are read into one mapping by jaxtrain.cmdline; its values are decoded into the
dataclasses by draccus (the typed-config library Levanter uses); unknown keys and wrong types become a `UserError`
naming the key (config_keys, before draccus sees them); config_checks then checks the values. Pure Python: torchref
imports this module, so it must never import jax or torch. Whether run.out_dir can hold a run is runfolder.py's to
check; whether a checkpoint was written by the run a config describes, same_run.py's.

Batch sizes: `data.batch_size` is the GLOBAL number of sequences per OPTIMIZER step, summed over all
gradient-accumulation micro-steps and all devices and hosts. Each micro-step processes
batch_size / optim.grad_accum_steps sequences, split evenly over the data-parallel devices. Changing
grad_accum_steps therefore never changes the tokens per optimizer step.
"""

import copy
import dataclasses
import os
import shlex
from typing import Callable, Literal, Optional

import draccus
import yaml

from jaxtrain import cmdline
from jaxtrain import config_checks
from jaxtrain import config_keys
from jaxtrain import runfolder
from jaxtrain.param_groups import ParamGroup
from jaxtrain.errors import UserError


@dataclasses.dataclass
class RunConfig:
    out_dir: str = "out/run"  # metrics.jsonl, config.yaml, checkpoints/<step>/
    seed: int = 0  # params init, data order and dropout all derive from it
    fresh: bool = False  # start at step 0; the earlier run's checkpoints, config, logs move to <name>.before-fresh-*
    dry_run: bool = False  # compile the train step and print its memory per device; train nothing (jaxtrain/dryrun.py)
    dry_run_devices: Optional[int] = None  # devices to compile for (target_device's, or fake CPUs); null: this host's
    # the dry run compiles for these devices ahead of time, on any host (v4, v5e, v5p, v6e, a100-40gb, a100-80gb,
    # h100, h200; their jax compiler installed: jaxtrain/target_devices.py); null: this host's devices
    target_device: Optional[Literal["v4", "v5e", "v5p", "v6e", "a100-40gb", "a100-80gb", "h100", "h200"]] = None
    lock_timeout_s: float = 60.0  # gs:// run folders: a lock not renewed this long belongs to a dead run (runlock.py)


@dataclasses.dataclass
class ModelConfig:
    vocab_size: Optional[int] = None  # null: the data's vocab size (meta.json); may be padded up, never down
    seq_len: int = 128  # context length T (nanoGPT's block_size)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    tie_embeddings: bool = True  # lm_head shares wte's weight, as GPT-2
    # GELU as torch's nn.GELU(approximate=...): none, the exact erf one (nanoGPT's); tanh, the approximation OpenAI's
    # GPT-2 trained with (Hugging Face's gelu_new), which its checkpoints need to compute what they were trained to
    gelu_approximate: Literal["none", "tanh"] = "none"
    # auto: cuDNN's fused flash attention on an NVIDIA GPU from Ampere on under bf16 without dropout, with a head size
    # a multiple of 8 up to 128 (256 from Hopper on); the written-out attention elsewhere; xla: always written out,
    # as torchref (its roundings); cudnn: always fused, an error where it cannot run
    attention: Literal["auto", "xla", "cudnn"] = "auto"
    # the residual adds and LayerNorms of each block: auto: one hand-written kernel each way on a GPU (Pallas), XLA's
    # ops elsewhere; xla: always XLA's; pallas: always the kernels (off a GPU through Pallas's interpreter: slow)
    norm: Literal["auto", "xla", "pallas"] = "auto"
    # the MLP's c_fc and GELU: xla: c_fc's gemm and GELU as XLA writes them (two kernels: pre written, read back);
    # pallas: one hand-written Hopper kernel that writes pre and gelu(pre) (gelu_gemm.py; bf16 or fp16, d_model a
    # multiple of 64; off a GPU through Mosaic GPU's interpreter: slow, and only with model.remat=none), not yet
    # measured on a GPU, so not the default
    gelu_fwd: Literal["xla", "pallas"] = "xla"
    # the MLP's backward from c_proj's output gradient to c_fc's: xla: c_proj's dx gemm and GELU's backward as XLA
    # writes them (two kernels); pallas: one hand-written Hopper kernel for both (gelu_gemm.py; bf16 or fp16,
    # d_model a multiple of 64; off a GPU through Mosaic GPU's interpreter: slow), not yet measured on a GPU, so not
    # the default
    gelu_grad: Literal["xla", "pallas"] = "xla"
    # the loss's logsumexp over the logits: xla: a pass of its own that reads them back (loss.logsumexp); pallas: in
    # the head gemm's epilogue, one hand-written Hopper kernel (head_lse.py; bf16 or fp16, d_model and a micro-batch's
    # tokens multiples of 64, the vocabulary a multiple of 128, model.vocab_tiles=1; off a GPU through Mosaic GPU's
    # interpreter: slow), not yet measured on a GPU, so not the default
    head_lse: Literal["xla", "pallas"] = "xla"
    # c_attn's input gradient from q's, k's and v's: xla: one gemm on the three concatenated (a copy of them); pallas:
    # one hand-written Hopper kernel that reads them where they lie (qkv_grad.py; bf16 or fp16, d_model a multiple of
    # 128, mesh.fsdp=1; q, k and v then come from three gemms everywhere, as under cuDNN's attention; off a GPU
    # through Mosaic GPU's interpreter: slow), not yet measured on a GPU, so not the default
    qkv_grad: Literal["xla", "pallas"] = "xla"
    # the residual stream between the blocks: fp32 as torch's autocast keeps it (the embeddings' fp32 sum, each
    # block's bf16 outputs added to it in fp32); bf16: rounded to bf16 once after the embeddings, so that every
    # residual add rounds to bf16 and the stream and its gradient move half the bytes, as llm.c trains (torchref does
    # the same; only under train.precision=bf16; LayerNorms still compute in fp32)
    residual_dtype: Literal["fp32", "bf16"] = "fp32"
    # the dots on a CPU: auto: oneDNN's where the CPU has bf16 matmul units (AMX, AVX-512 bf16) and jaxlib >= 0.11
    # hands oneDNN bf16 dots whole, under bf16 (each dot writes its bf16 result, a Linear's bias a row of its weights,
    # as on a GPU) and fp32; XLA's default (YNNPACK) elsewhere; xla: always XLA's default; onednn: always oneDNN's (a
    # CPU under bf16 or fp32 with jaxlib >= 0.11 only). The same math either way, summed in another order
    cpu_dots: Literal["auto", "xla", "onednn"] = "auto"
    # recompute each block's activations in the backward pass instead of keeping them: full keeps only each block's
    # input; dots keeps the outputs of its weight matmuls too (less memory than none, less recompute than full)
    remat: Literal["none", "full", "dots"] = "none"
    vocab_tiles: int = 1  # >1: the head and the loss a tile of a micro-batch's tokens at a time, never all logits


@dataclasses.dataclass
class DataConfig:
    path: Optional[str] = None  # folder with train.bin, val.bin, meta.json; null: the embedded stdlib corpus
    batch_size: int = 32  # global sequences per optimizer step (all micro-steps, all devices)
    cache_dir: Optional[str] = None  # where the embedded corpus is prepared; null: ~/.cache/jaxtrain


# LR(t) after the warmup (optim.py): cosine or linear from lr to min_lr at decay_steps; constant lr; cosine with
# hard restarts (optim.cycles cosines from lr to min_lr). constant has no warmup; the decaying ones are flat at min_lr
# past decay_steps, the constant ones stay at lr.
SCHEDULES = ("cosine", "linear", "constant", "constant_with_warmup", "cosine_with_restarts")


@dataclasses.dataclass
class OptimConfig:
    schedule: Literal[SCHEDULES] = "cosine"  # cosine | linear | constant | constant_with_warmup | cosine_with_restarts
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    min_lr: float = 1e-4  # end of the decay, and flat after decay_steps
    warmup_steps: int = 100  # optimizer steps of linear warmup
    warmup_init_lr: Optional[float] = None  # LR at step 0; null: lr / (warmup_steps + 1), as nanoGPT
    decay_steps: Optional[int] = None  # step where the cosine reaches min_lr, warmup included; null: train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_mask: Literal["ndim", "names"] = "ndim"  # ndim: decay params with ndim >= 2; names: all but bias/norm/embedding
    max_grad_norm: float = 1.0  # clip by global norm; 0 disables clipping
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    cycles: int = 1  # schedule=cosine_with_restarts: cosines between warmup and decay_steps, each from lr to min_lr
    # name pattern -> {lr_scale, weight_decay}: per-group LR multiplier and weight decay (jaxtrain/param_groups.py)
    groups: dict[str, ParamGroup] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps (never micro-steps)
    # bf16 | fp16: bf16 or fp16 matmuls, fp32 params/grads/optimizer/norms/loss; fp32: everything in fp32
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    # fp16: dynamic loss scaling as torch's GradScaler (x2 after this many finite windows in a row, x0.5 and the
    # update skipped on a non-finite gradient): the scale a run starts at, the growth interval, and the floor the
    # scale never falls below (DeepSpeed's and Megatron's, 1: a non-finite gradient there is a divergence)
    loss_scale_init: float = 65536.0
    loss_scale_growth_interval: int = 2000
    loss_scale_min: float = 1.0
    eval_every: int = 100  # optimizer steps between evaluations; 0: only at the end
    eval_batches: int = 8  # fixed validation batches of data.batch_size sequences (run in micro-batches)
    nan_policy: Literal["halt", "skip"] = "halt"  # a non-finite loss or grad norm: halt (resume from the last checkpoint) or skip that update
    nan_skip_limit: int = 10  # with nan_policy=skip: this many skipped updates in a row halt the run


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 100  # optimizer steps between saves; the last step is always saved
    max_to_keep: int = 3  # the newest checkpoints kept; older ones are deleted once a newer one is complete
    keep_best: bool = False  # also keep the lowest-eval-loss checkpoint, whatever its age (saves at eval steps)
    async_save: bool = True  # write in the background while training continues


@dataclasses.dataclass
class MeshConfig:
    data: int = -1  # data-parallel axis size; -1: all devices not used by fsdp
    fsdp: int = 1  # params and optimizer state sharded over this many devices


@dataclasses.dataclass
class LogConfig:
    every: int = 1  # optimizer steps between metrics.jsonl lines
    tensorboard: bool = True  # also write TensorBoard events to <out_dir>/tb
    progress: bool = True  # progress bar on stderr
    peak_tflops: Optional[float] = None  # per-device peak for MFU; null: by the device kind (CPU: unknown, mfu null)
    wandb: bool = False  # also log to Weights & Biases, one W&B run per run folder (pip install 'jaxtrain[wandb]')
    wandb_project: str = "jaxtrain"  # W&B project (the entity: WANDB_ENTITY, else your default)
    wandb_name: Optional[str] = None  # W&B run name; null: the run folder's name
    wandb_mode: Optional[Literal["online", "offline"]] = None  # null: WANDB_MODE, else online (offline if that fails)
    sample_tokens: int = 0  # print this many tokens the model writes after sample_prompt at the end of training; 0: no
    sample_prompt: str = "\n"  # the text the end-of-training sample continues (jaxtrain.sample's defaults draw it)


@dataclasses.dataclass
class InitConfig:
    # Spelled `init.from` in YAML and on the command line (`from` is a Python keyword).
    from_: Optional[str] = dataclasses.field(default=None, metadata={"yaml": "from"})  # torch-format checkpoint dir to start from (full state, or weights only)
    reseed: bool = False  # with a full state in init.from: draw batches from run.seed, not the checkpoint's order


@dataclasses.dataclass
class Config:
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    init: InitConfig = dataclasses.field(default_factory=InitConfig)

    @property
    def micro_batch_size(self) -> int:
        """Global sequences per micro-step."""
        return self.data.batch_size // self.optim.grad_accum_steps

    # When the training loops of both backends act, at optimizer step `step` (1-based): the run's last step always.
    def logs_at(self, step: int) -> bool:
        """A training line of metrics.jsonl: every log.every steps."""
        return step % self.log.every == 0 or step == self.train.steps

    def evaluates_at(self, step: int) -> bool:
        """An evaluation: every train.eval_every steps (0: at the end only)."""
        return step == self.train.steps or bool(self.train.eval_every and step % self.train.eval_every == 0)

    def saves_at(self, step: int) -> bool:
        """A checkpoint: every checkpoint.every steps (and at a stop, which the loops decide)."""
        return step % self.checkpoint.every == 0 or step == self.train.steps

    @property
    def decay_steps(self) -> int:
        return decay_steps(self.optim.decay_steps, self.train.steps)

    @property
    def warmup_init_lr(self) -> float:
        return warmup_init_lr(self.optim.warmup_init_lr, self.optim.lr, self.optim.warmup_steps)


def decay_steps(given: int | None, train_steps: int) -> int:
    """optim.decay_steps in effect: as given, else train.steps."""
    return given if given is not None else train_steps


def warmup_init_lr(given: float | None, lr: float, warmup_steps: int) -> float:
    """optim.warmup_init_lr in effect: as given, else lr / (warmup_steps + 1), nanoGPT's first step."""
    return given if given is not None else lr / (warmup_steps + 1)


def load(argv: list[str], first_check: Callable[[Config], None] | None = None) -> Config:
    """Parse `--config PATH [--section.key=value ...]` into a validated Config; -h/--help prints the keys.
    `first_check(cfg)`: a caller's own refusal, before validation's (torchref's of a gs:// run folder, which
    validation would otherwise ask a package for)."""
    if "-h" in argv or "--help" in argv:
        print(cmdline.usage(Config))
        raise SystemExit(0)
    cfg = _home_expanded(from_dict(cmdline.read(argv, text_keys())))
    if first_check:
        first_check(cfg)
    config_checks.validate(cfg)
    if cmdline.given(argv, "run.out_dir") is None:
        runfolder.note_moved_run(cmdline.given(argv, "config"), cfg.run.out_dir)
    return cfg


def _home_expanded(cfg: Config) -> Config:
    """A leading ~ in a path key is the user's home, as in a shell: no shell expands it after `--run.out_dir=`, nor
    in a YAML file, and a run folder was made under ./~ (data.cache_dir, too, already read it so)."""
    def home(path: str | None) -> str | None:
        return os.path.expanduser(path) if path and path.startswith("~") else path
    return dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, out_dir=home(cfg.run.out_dir)),
        data=dataclasses.replace(cfg.data, path=home(cfg.data.path), cache_dir=home(cfg.data.cache_dir)),
        init=dataclasses.replace(cfg.init, from_=home(cfg.init.from_)))


def from_dict(raw: dict) -> Config:
    """A config mapping (YAML names) -> Config, keys and types checked but values not validated: a saved config
    may name a data.path that does not exist on the machine reading it."""
    raw = copy.deepcopy(raw)
    config_keys.check(raw, Config)
    for section, f in _spelled_otherwise():
        if isinstance(raw.get(section), dict) and cmdline.yaml_name(f) in raw[section]:
            raw[section][f.name] = raw[section].pop(cmdline.yaml_name(f))
    try:
        return draccus.decode(Config, raw)
    except Exception as e:  # draccus raises DecodingError (and sometimes TypeError) with the key path
        path = ".".join(str(p) for p in getattr(e, "key_path", ()) or ())
        where = f" for {path}" if path else ""
        problem = " ".join(str(e).split())  # draccus lists a union's alternatives on several lines
        raise UserError(f"bad config value{where}: {problem}; fix it in the YAML or with "
                        f"--{path or 'section.key'}=VALUE") from None


def text_keys() -> frozenset[str]:
    """section.key of each key that holds free text (a path, a name, a prompt), not one of a few choices."""
    return frozenset(f"{section.name}.{cmdline.yaml_name(f)}" for section in dataclasses.fields(Config)
                     for f in dataclasses.fields(section.type) if f.type in config_keys.TEXT_TYPES)


def _spelled_otherwise():
    """(section, field) for each field whose YAML name is not its Python name (`init.from`: a Python keyword)."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            if cmdline.yaml_name(f) != f.name:
                yield section.name, f


def dump(cfg: Config) -> str:
    """The resolved config as YAML that `load` reads back (keyword fields under their YAML names)."""
    raw = yaml.safe_load(draccus.dump(cfg))
    for section, f in _spelled_otherwise():
        raw[section][cmdline.yaml_name(f)] = raw[section].pop(f.name)
    return yaml.safe_dump(raw, sort_keys=False)


def save(cfg: Config, out_dir: str) -> None:
    """<out_dir>/config.yaml: the run's config, readable by --config. run.fresh is written false: it acts once, when
    the run starts, so `--config <out_dir>/config.yaml` resumes the run instead of setting it aside again."""
    folder = runfolder.path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    runfolder.write_whole(folder / "config.yaml", dump(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, fresh=False))))


def start_up_stop_hint(cfg: Config, module: str) -> str:
    """What a stop before the first step says to do, in both backends: a fresh start has moved nothing aside yet,
    so the same command starts over; any other, resume_hint."""
    if cfg.run.fresh:
        return "run.fresh has moved nothing aside yet: run the same command to start over"
    return resume_hint(cfg, module)


def resume_hint(cfg: Config, module: str) -> str:
    """How to resume a stopped run, for both backends' stop messages (`module`: jaxtrain.run or torchref.run): the
    same command, not with run.fresh (which starts over); or, where the run wrote it, the run folder's config.yaml,
    the run's whole config (run.fresh off), for whoever no longer has the command."""
    same = "run the same command" + (" without --run.fresh=true" if cfg.run.fresh else "") + " to resume"
    saved = runfolder.path(cfg.run.out_dir, "config.yaml")
    return f"{same}, or python -m {module} --config {shlex.quote(str(saved))}" if saved.exists() else same
