"""The run configuration: typed dataclass sections, loaded from YAML with dotted command-line overrides.

    python -m jaxtrain.run --config configs/tiny.yaml --optim.lr=3e-4 --train.steps=500

YAML is read and values are decoded into the dataclasses by draccus (the typed-config library Levanter uses);
unknown keys and wrong types become a `UserError` naming the key. Pure Python: torchref imports this module, so
it must never import jax or torch.

Batch sizes: `data.batch_size` is the GLOBAL number of sequences per OPTIMIZER step, summed over all
gradient-accumulation micro-steps and all devices and hosts. Each micro-step processes
batch_size / optim.grad_accum_steps sequences, split evenly over the data-parallel devices. Changing
grad_accum_steps therefore never changes the tokens per optimizer step.
"""

import argparse
import copy
import dataclasses
import difflib
import hashlib
import math
import os
import sys
from typing import Literal, Optional

import draccus
import mergedeep
import yaml
from draccus.cfgparsing import parse_string
from draccus.utils import deflatten
from draccus.wrappers.docstring import get_attribute_docstring

from jaxtrain.errors import UserError


@dataclasses.dataclass
class RunConfig:
    out_dir: str = "out/run"  # metrics.jsonl, config.yaml, checkpoints/<step>/
    seed: int = 0  # params init, data order and dropout all derive from it
    fresh: bool = False  # ignore checkpoints already in out_dir and start from step 0 (they are kept)


@dataclasses.dataclass
class ModelConfig:
    vocab_size: Optional[int] = None  # None: the data's vocab size (meta.json); may be padded up, never down
    seq_len: int = 128  # context length T (nanoGPT's block_size)
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in Linear and LayerNorm, as GPT-2
    tie_embeddings: bool = True  # lm_head shares wte's weight, as GPT-2


@dataclasses.dataclass
class DataConfig:
    path: Optional[str] = None  # folder with train.bin, val.bin, meta.json; None: the embedded stdlib corpus
    batch_size: int = 32  # global sequences per optimizer step (all micro-steps, all devices)
    cache_dir: Optional[str] = None  # where the embedded corpus is prepared; None: ~/.cache/jaxtrain


@dataclasses.dataclass
class OptimConfig:
    lr: float = 1e-3  # peak learning rate, reached at the end of warmup
    min_lr: float = 1e-4  # end of the cosine, and flat after decay_steps
    warmup_steps: int = 100  # optimizer steps of linear warmup
    warmup_init_lr: Optional[float] = None  # LR at step 0; None: lr / (warmup_steps + 1), as nanoGPT
    decay_steps: Optional[int] = None  # step where the cosine reaches min_lr, warmup included; None: train.steps
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_mask: Literal["ndim", "names"] = "ndim"  # ndim: decay params with ndim >= 2; names: all but bias/norm/embedding
    max_grad_norm: float = 1.0  # clip by global norm; 0 disables clipping
    grad_accum_steps: int = 1  # micro-batches per optimizer step


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps (never micro-steps)
    precision: Literal["bf16", "fp32"] = "bf16"  # bf16: bf16 matmuls, fp32 params/grads/optimizer/norms/loss
    eval_every: int = 100  # optimizer steps between evaluations; 0: only at the end
    eval_batches: int = 8  # fixed validation batches of data.batch_size sequences (run in micro-batches)


@dataclasses.dataclass
class CheckpointConfig:
    every: int = 100  # optimizer steps between saves; the last step is always saved
    max_to_keep: int = 3
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
    peak_tflops: Optional[float] = None  # per-device peak for MFU; None: looked up from the device kind (CPU: unknown, mfu null)


@dataclasses.dataclass
class InitConfig:
    # Spelled `init.from` in YAML and on the command line (`from` is a Python keyword).
    from_: Optional[str] = None  # torch-format checkpoint dir to start from (full state, or weights only)
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

    @property
    def decay_steps(self) -> int:
        return self.optim.decay_steps if self.optim.decay_steps is not None else self.train.steps

    @property
    def warmup_init_lr(self) -> float:
        if self.optim.warmup_init_lr is not None:
            return self.optim.warmup_init_lr
        return self.optim.lr / (self.optim.warmup_steps + 1)


# YAML/CLI spelling -> dataclass field name, for keys that are Python keywords.
_KEYWORD_FIELDS = {("init", "from"): ("init", "from_")}


def load(argv: list[str]) -> Config:
    """Parse `--config PATH [--section.key=value ...]` into a validated Config; -h/--help prints the keys."""
    if "-h" in argv or "--help" in argv:
        print(usage())
        raise SystemExit(0)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--config")
    known, rest = ap.parse_known_args(argv)
    raw = _read_yaml(known.config) if known.config else {}
    mergedeep.merge(raw, _parse_overrides(rest))
    cfg = from_dict(raw)
    validate(cfg)
    return cfg


def usage() -> str:
    """Every key with its type, default and the comment beside it above."""
    script = os.path.abspath(sys.argv[0])  # python -m jaxtrain.run or torchref.run
    prog = f"python -m {os.path.basename(os.path.dirname(script))}.{os.path.splitext(os.path.basename(script))[0]}"
    lines = [f"usage: {prog} --config FILE.yaml [--section.key=VALUE ...]", "",
             "Keys (YAML sections; the same names override on the command line):"]
    for section in dataclasses.fields(Config):
        lines.append(f"  {section.name}:")
        for f in dataclasses.fields(section.type):
            name = _yaml_name((section.name,), f.name)
            default = getattr(section.type(), f.name)
            comment = get_attribute_docstring(section.type, f.name).comment_inline
            lines.append(f"    {f'--{section.name}.{name}={default}':<34} {comment}".rstrip())
    return "\n".join(lines)


def _read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"config file {path!r} not found; pass an existing YAML file to --config (see configs/)")
    with open(path, encoding="utf-8") as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise UserError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise UserError(f"config file {path!r} must hold a mapping of sections (run:, model:, ...)")
    return raw


def _parse_overrides(args: list[str]) -> dict:
    """`--optim.lr=3e-4` or `--optim.lr 3e-4` -> {'optim': {'lr': 3e-4}}; values are parsed as YAML scalars."""
    flat, i = {}, 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise UserError(f"override --{key} has no value; write --{key}=VALUE")
            value, i = args[i + 1], i + 1
        flat[key] = parse_string(value)
        i += 1
    return deflatten(flat, sep=".")


def from_dict(raw: dict) -> Config:
    """A config mapping (YAML names) -> Config, keys and types checked but values not validated: a saved config
    may name a data.path that does not exist on the machine reading it."""
    raw = copy.deepcopy(raw)
    _check_keys(raw, Config, ())
    for (section, key), (_, field) in _KEYWORD_FIELDS.items():
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raw[section][field] = raw[section].pop(key)
    try:
        return draccus.decode(Config, raw)
    except Exception as e:  # draccus raises DecodingError (and sometimes TypeError) with the key path
        path = ".".join(str(p) for p in getattr(e, "key_path", ()) or ())
        where = f" for {path}" if path else ""
        raise UserError(f"bad config value{where}: {e}; fix it in the YAML or with --{path or 'section.key'}=VALUE") from None


def _check_keys(raw: dict, cls, prefix: tuple) -> None:
    """Unknown keys name themselves and the closest valid key."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = {_yaml_name(prefix, n): f for n, f in fields.items()}
    for key, value in raw.items():
        dotted = ".".join(prefix + (str(key),))
        if key not in names:
            close = difflib.get_close_matches(str(key), list(names), n=1)
            hint = f"did you mean {'.'.join(prefix + (close[0],))}?" if close else f"valid keys: {', '.join(names)}"
            raise UserError(f"unknown config key {dotted!r}; {hint}")
        field_type = names[key].type
        if dataclasses.is_dataclass(field_type):
            if not isinstance(value, dict):
                raise UserError(f"config section {dotted!r} must be a mapping of keys, got {value!r}")
            _check_keys(value, field_type, prefix + (str(key),))


def _yaml_name(prefix: tuple, field_name: str) -> str:
    for (section, key), (_, field) in _KEYWORD_FIELDS.items():
        if prefix == (section,) and field_name == field:
            return key
    return field_name


# optax, MultiSteps and the train state count steps in int32: a larger count would wrap around.
INT32_MAX = 2**31 - 1


def validate(cfg: Config) -> None:
    """Check what a wrong value would otherwise turn into a shape error or a silent mistake later."""
    _check_numbers(cfg)
    m, o, t = cfg.model, cfg.optim, cfg.train
    positive = {
        "model.seq_len": m.seq_len, "model.n_layer": m.n_layer, "model.n_head": m.n_head,
        "model.d_model": m.d_model, "data.batch_size": cfg.data.batch_size, "optim.grad_accum_steps": o.grad_accum_steps,
        "train.steps": t.steps, "train.eval_batches": t.eval_batches, "checkpoint.every": cfg.checkpoint.every,
        "checkpoint.max_to_keep": cfg.checkpoint.max_to_keep, "log.every": cfg.log.every, "optim.lr": o.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UserError(f"{key} must be > 0, got {value}")
    non_negative = {"optim.warmup_steps": o.warmup_steps, "optim.min_lr": o.min_lr, "optim.weight_decay": o.weight_decay,
                    "optim.max_grad_norm": o.max_grad_norm, "optim.eps": o.eps, "train.eval_every": t.eval_every}
    for key, value in non_negative.items():
        if value < 0:
            raise UserError(f"{key} must be >= 0, got {value}")
    if m.d_model % m.n_head:
        raise UserError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}; "
                        f"choose n_head among the divisors of d_model (e.g. {_divisors_near(m.d_model, m.n_head)})")
    if not 0.0 <= m.dropout < 1.0:
        raise UserError(f"model.dropout must be in [0, 1), got {m.dropout}")
    for key in ("b1", "b2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise UserError(f"optim.{key} must be in [0, 1), got {getattr(o, key)}")
    if o.warmup_steps >= cfg.decay_steps:
        raise UserError(f"optim.warmup_steps={o.warmup_steps} must be smaller than the decay length {cfg.decay_steps} "
                        f"(optim.decay_steps, default train.steps); lower warmup_steps or raise decay_steps")
    if o.min_lr > o.lr:
        raise UserError(f"optim.min_lr={o.min_lr} is larger than optim.lr={o.lr}; the cosine decays from lr to min_lr")
    if cfg.data.batch_size % o.grad_accum_steps:
        raise UserError(f"data.batch_size={cfg.data.batch_size} is not divisible by optim.grad_accum_steps="
                        f"{o.grad_accum_steps}; batch_size counts sequences per optimizer step, so pick a multiple")
    if cfg.data.path is not None and not os.path.isdir(cfg.data.path):
        raise UserError(f"data.path={cfg.data.path!r} is not a folder; create it with "
                        f"`python -m jaxtrain.data prepare --input TEXT --out DIR`, or drop data.path for the embedded corpus")
    if m.vocab_size is not None and m.vocab_size <= 0:
        raise UserError(f"model.vocab_size must be > 0 (or null to take it from the data), got {m.vocab_size}")


def _check_numbers(cfg: Config) -> None:
    """Every float finite (nan and inf would train, or fail far from the cause); every count within int32."""
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.type):
            value = getattr(getattr(cfg, section.name), f.name)
            key = f"{section.name}.{_yaml_name((section.name,), f.name)}"
            if isinstance(value, float) and not math.isfinite(value):
                raise UserError(f"{key} must be a finite number, got {value}")
            if isinstance(value, int) and not isinstance(value, bool) and key != "run.seed" and abs(value) > INT32_MAX:
                raise UserError(f"{key}={value} is out of range: counts must be at most {INT32_MAX} (2**31 - 1, "
                                f"the int32 step counters of optax)")


def validate_devices(cfg: Config, n_devices: int) -> tuple[int, int]:
    """The (data, fsdp) mesh shape for n_devices; checks that each micro-batch splits evenly over it."""
    fsdp = cfg.mesh.fsdp
    data = cfg.mesh.data if cfg.mesh.data != -1 else n_devices // max(fsdp, 1)
    if fsdp <= 0 or data <= 0 or data * fsdp != n_devices:
        raise UserError(f"mesh.data={cfg.mesh.data} x mesh.fsdp={cfg.mesh.fsdp} does not cover the {n_devices} "
                        f"devices; set mesh.data=-1 and an fsdp that divides {n_devices}")
    if cfg.micro_batch_size % n_devices:
        raise UserError(f"the micro-batch of {cfg.micro_batch_size} sequences (data.batch_size / optim.grad_accum_steps)"
                        f" does not split over {n_devices} devices; make data.batch_size a multiple of "
                        f"{n_devices * cfg.optim.grad_accum_steps}")
    return data, fsdp


def _divisors_near(n: int, k: int) -> str:
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(str(d) for d in sorted(divisors, key=lambda d: abs(d - k))[:3])


def dump(cfg: Config) -> str:
    """The resolved config as YAML that `load` reads back (keyword fields under their YAML names)."""
    raw = yaml.safe_load(draccus.dump(cfg))
    for (section, key), (_, field) in _KEYWORD_FIELDS.items():
        raw[section][key] = raw[section].pop(field)
    return yaml.safe_dump(raw, sort_keys=False)


def save(cfg: Config, out_dir: str) -> None:
    """<out_dir>/config.yaml: the run's config, readable by --config. run.fresh is written false: it acts once, when
    the run starts, so `--config <out_dir>/config.yaml` resumes the run instead of setting it aside again."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(dump(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, fresh=False))))


def resume_hint(cfg: Config) -> str:
    """How to resume a stopped run, for both backends' stop messages: not with run.fresh, which starts over."""
    return "run the same command" + (" without --run.fresh=true" if cfg.run.fresh else "") + " to resume"


# Sections and keys that shape the trajectory: resuming with any of them changed is refused. train.steps is not
# one of them (a finished run may be extended), but the decay length it defaults to is. Where the data lies
# (data.path, data.cache_dir) is not either: its content is compared instead (data.check_same_data).
TRAJECTORY_KEYS = ("model", "data.batch_size", "optim", "train.precision", "run.seed", "decay length")


def check_same_trajectory(saved: dict, cfg: Config, where: str) -> None:
    """Refuse to resume from a checkpoint written with another config (`saved`, as `dump` wrote it), naming the
    keys that changed. Keys that do not shape the trajectory (out_dir, logging, checkpoint cadence, train.steps
    when optim.decay_steps is set) may change."""
    saved, current = _trajectory(saved), _trajectory(yaml.safe_load(dump(cfg)))
    changed = [k for k in current if saved.get(k) != current[k]]
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in changed)
        raise UserError(f"the config differs from the one that wrote {where} ({diffs}); resume with the same "
                        f"config, or start over with --run.fresh=true or a new --run.out_dir")


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config's trajectory keys: written into torch-format checkpoints."""
    trajectory = _trajectory(yaml.safe_load(dump(cfg)))
    return hashlib.sha256(yaml.safe_dump(trajectory, sort_keys=True).encode()).hexdigest()


def _trajectory(raw: dict) -> dict:
    """The flattened keys that shape the trajectory, with the effective decay length spelled out."""
    flat = _flatten(raw)
    flat["decay length"] = flat.get("optim.decay_steps") or flat.get("train.steps")
    return {k: v for k, v in flat.items() if k.startswith(TRAJECTORY_KEYS)}


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
