"""Whether a checkpoint was written by the run a config describes: the keys that shape a run's trajectory, compared
on resume (both backends) and hashed into torch-format checkpoints. Pure Python, as config.py: torchref imports it.
"""

import dataclasses
import hashlib
import sys

import yaml

from jaxtrain import config
from jaxtrain.config import Config
from jaxtrain.config_checks import DECAYING_SCHEDULES
from jaxtrain.errors import UserError

# Sections and keys that shape the trajectory: resuming with any of them changed is refused. train.steps is not
# one of them (a finished run may be extended), but the decay length it defaults to is. Where the data lies
# (data.path, data.cache_dir) is not either: its content is compared instead (data.check_same_data). How the model
# computes (attention kernel, the norm and gemm kernels, rematerialisation, vocabulary tiling: the same math,
# rounded alike or in another order) is not: it may change on resume, to fit another device, and checkpoints written
# before these keys existed still resume.
TRAJECTORY_KEYS = ("model", "data.batch_size", "optim", "train.precision", "train.loss_scale", "run.seed",
                   "decay length")
HOW_NOT_WHAT = ("model.attention", "model.norm", "model.gelu_fwd", "model.gelu_grad", "model.head_lse",
                "model.qkv_grad", "model.remat", "model.vocab_tiles", "model.cpu_dots")

# Keys compared only where they act: the decay length (train.steps or optim.decay_steps, compared as the effective
# value) and min_lr where the schedule decays, its cycles where it restarts, the warmup's start where there is one,
# the loss scaling under fp16. The accumulation only with dropout: without it a window's batches are the same at any
# accumulation (data.window) and so is its gradient, up to the order of the sums; dropout's masks are drawn per
# micro-batch.
_ACTS_ONLY_IF = {
    "decay length": lambda f: f["optim.schedule"] in DECAYING_SCHEDULES,
    "optim.min_lr": lambda f: f["optim.schedule"] in DECAYING_SCHEDULES,
    "optim.cycles": lambda f: f["optim.schedule"] == "cosine_with_restarts",
    "optim.warmup_init_lr": lambda f: f["optim.warmup_steps"] > 0,
    "train.loss_scale_init": lambda f: f["train.precision"] == "fp16",
    "train.loss_scale_growth_interval": lambda f: f["train.precision"] == "fp16",
    "train.loss_scale_min": lambda f: f["train.precision"] == "fp16",
    "optim.grad_accum_steps": lambda f: f["model.dropout"] > 0,
}


def check(saved: dict, cfg: Config, where: str, step: int, backend: str) -> Config:
    """Refuse to resume from the checkpoint `where` of step `step` (written by `backend`, "jaxtrain" or "torchref")
    with another config (`saved`, as `dump` wrote it), naming the keys that changed and the ways on; warn that an
    init.from other than the run's own is not read. Keys that do not shape the trajectory (out_dir, logging,
    checkpoint cadence, train.steps when optim.decay_steps is set) may change. A key added after `saved` was written
    counts as its default there.

    Returns `cfg` as the resumed run goes on with it: with the init.from the run started from, which its config.yaml
    and later checkpoints record (a stray one recorded would make a later --run.fresh=true start from it)."""
    started_from = saved.get("init", {}).get("from")
    saved, current = _trajectory({**_flat(Config()), **_flatten(saved)}), _trajectory(_flat(cfg))
    _warmup_start_given_on_one_side(saved, current)
    if saved != current:
        raise UserError(f"the config differs from the one that wrote {where} ({_changes(saved, current, cfg)}); "
                        f"{_ways_on(saved, current, cfg, step, backend)}")
    if cfg.init.from_ is not None and cfg.init.from_ != started_from:
        began = f"from {started_from}" if started_from is not None else "from scratch"
        print(f"warning: init.from={cfg.init.from_!r} is not read: the run resumes from {where} (init.from starts a "
              f"run; this one started {began}, which its config.yaml keeps)", file=sys.stderr)
    return dataclasses.replace(cfg, init=dataclasses.replace(cfg.init, from_=started_from))


def _warmup_start_given_on_one_side(saved: dict, current: dict) -> None:
    """Where one side leaves optim.warmup_init_lr null and the other gives it, the null as the value it stands for
    (lr / (warmup_steps + 1)): a resume that writes out the default is the same run. Both null stay null, so that a
    change of lr alone is named as that. Not in _trajectory: the config hash keeps hashing what the config says."""
    key = "optim.warmup_init_lr"
    if key in saved and key in current and (saved[key] is None) != (current[key] is None):
        for side in (saved, current):
            side[key] = config.warmup_init_lr(side[key], side["optim.lr"], side["optim.warmup_steps"])


def _changes(saved: dict, current: dict, cfg: Config) -> str:
    """The changed keys with their values. A key that acts on one side only (_ACTS_ONLY_IF) is left out: what made it
    act or not, another key, is named. optim.groups may lose keys."""
    changed = [k for k in {**saved, **current} if saved.get(k) != current.get(k)
               and not (k in _ACTS_ONLY_IF and (k in saved) != (k in current))]
    diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
    keep = (f"; to go on with the schedule it had, pass --optim.decay_steps={saved['decay length']}"
            if "decay length" in changed and cfg.optim.decay_steps is None else "")
    return diffs + keep


def _ways_on(saved: dict, current: dict, cfg: Config, step: int, backend: str) -> str:
    """Resume unchanged; or, where the weights still fit the model (no model.* key changed but dropout and the
    residual stream's dtype), keep the changes and go on from the checkpoint in a new run (init.from takes its whole
    training state); or start over."""
    over = "start over with --run.fresh=true or a new --run.out_dir"
    reshaped = any(k.startswith("model.") and k not in ("model.dropout", "model.residual_dtype")
                   and saved.get(k) != current.get(k) for k in {**saved, **current})
    if reshaped:
        return f"resume with the same config, or {over}"
    return f"resume with the same config, or {new_run_from(cfg, step, backend, 'keep the changes')}; or {over}"


def new_run_from(cfg: Config, step: int | None, backend: str, change: str) -> str:
    """How to `change` the config (an imperative: "lower optim.lr") and go on from run.out_dir's checkpoint `step`
    (None: there is none), which a resume of that folder refuses (check): a new run from that checkpoint's whole
    training state, through init.from, in a new folder. `backend` ("jaxtrain" or "torchref") names the format of
    the run's checkpoints."""
    if step is None:
        return f"{change} and start over with --run.fresh=true"
    checkpoint = f"{cfg.run.out_dir}/checkpoints/{step}"
    start = (f"python -m jaxtrain.convert to-torch {checkpoint} DST, then run with --init.from=DST" if backend ==
             "jaxtrain" else f"run with --init.from={checkpoint}")
    return (f"{change} and go on from step {step} in a new run (a resume of {cfg.run.out_dir} refuses the changed "
            f"keys): {start} --run.out_dir=NEW")


def check_init_step(cfg: Config, step: int) -> None:
    """A new run starts from init.from's full training state at `step`: one at or past train.steps would train
    nothing, and a new run folder would end "already trained" with exit 0 (both backends)."""
    if step >= cfg.train.steps:
        raise UserError(f"init.from={cfg.init.from_} is a training state at step {step}, at or past "
                        f"train.steps={cfg.train.steps}: raise train.steps to train on from it")


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config's trajectory keys: written into torch-format checkpoints."""
    trajectory = _trajectory(_flat(cfg))
    return hashlib.sha256(yaml.safe_dump(trajectory, sort_keys=True).encode()).hexdigest()


def _trajectory(flat: dict) -> dict:
    """The keys (flattened) that shape the trajectory, each where it acts (_ACTS_ONLY_IF), with the effective decay
    length spelled out (a run whose decay followed train.steps extends with that length given)."""
    flat = dict(flat)
    flat["decay length"] = config.decay_steps(flat.pop("optim.decay_steps"), flat["train.steps"])
    return {k: v for k, v in flat.items() if k.startswith(TRAJECTORY_KEYS) and k not in HOW_NOT_WHAT
            and _ACTS_ONLY_IF.get(k, lambda f: True)(flat)}


def _flat(cfg: Config) -> dict:
    """{"section.key": value} of the config as config.yaml holds it."""
    return _flatten(yaml.safe_load(config.dump(cfg)))


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
