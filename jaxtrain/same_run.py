"""Whether a checkpoint was written by the run a config describes: the keys that shape a run's trajectory, compared
on resume (both backends) and hashed into torch-format checkpoints. Pure Python, as config.py: torchref imports it.
"""

import hashlib

import yaml

from jaxtrain import config
from jaxtrain.config import Config
from jaxtrain.errors import UserError

# Sections and keys that shape the trajectory: resuming with any of them changed is refused. train.steps is not
# one of them (a finished run may be extended), but the decay length it defaults to is. Where the data lies
# (data.path, data.cache_dir) is not either: its content is compared instead (data.check_same_data). How the model
# computes (attention kernel, norm kernels, rematerialisation, vocabulary tiling: the same math, rounded alike or in
# another order) is not: it may change on resume, to fit another device, and checkpoints written before these keys
# existed still resume.
TRAJECTORY_KEYS = ("model", "data.batch_size", "optim", "train.precision", "train.loss_scale", "run.seed",
                   "decay length")
HOW_NOT_WHAT = ("model.attention", "model.norm", "model.remat", "model.vocab_tiles")


def check(saved: dict, cfg: Config, where: str) -> None:
    """Refuse to resume from a checkpoint written with another config (`saved`, as `dump` wrote it), naming the
    keys that changed. Keys that do not shape the trajectory (out_dir, logging, checkpoint cadence, train.steps
    when optim.decay_steps is set) may change. A key added after `saved` was written counts as its default there."""
    saved, current = _trajectory({**_flat(Config()), **_flatten(saved)}), _trajectory(_flat(cfg))
    changed = [k for k in {**saved, **current} if saved.get(k) != current.get(k)]  # optim.groups may lose keys
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise UserError(f"the config differs from the one that wrote {where} ({diffs}); resume with the same "
                        f"config, or start over with --run.fresh=true or a new --run.out_dir")


def config_hash(cfg: Config) -> str:
    """sha256 of the resolved config's trajectory keys: written into torch-format checkpoints."""
    trajectory = _trajectory(_flat(cfg))
    return hashlib.sha256(yaml.safe_dump(trajectory, sort_keys=True).encode()).hexdigest()


def _trajectory(flat: dict) -> dict:
    """The keys (flattened) that shape the trajectory, with the effective decay length spelled out."""
    flat = dict(flat)
    flat["decay length"] = flat.get("optim.decay_steps") or flat.get("train.steps")
    return {k: v for k, v in flat.items() if k.startswith(TRAJECTORY_KEYS) and k not in HOW_NOT_WHAT}


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
