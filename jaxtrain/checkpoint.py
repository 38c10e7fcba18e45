"""Orbax checkpoints in <out_dir>/checkpoints/<step>/ and resuming from them.

Each step folder holds `state` (params and the whole optax state, MultiSteps counters included, saved sharded
by orbax) and `meta` (JSON: the step and the resolved config). Saves are asynchronous: training continues while
the arrays are written, and orbax only renames a step folder into place once it is complete, so a crash during a
save never leaves a half-written checkpoint where resume would find it. Restore places every array directly on
its target sharding (MaxText-style), so a pod never gathers a full copy on one host.
"""

import os

import jax
import orbax.checkpoint as ocp
import yaml

from jaxtrain import config as config_lib
from jaxtrain.config import Config
from jaxtrain.errors import UserError

# Config sections and keys that shape the trajectory: resuming with any of them changed is refused.
TRAJECTORY_KEYS = ("model", "data", "optim", "train.steps", "train.precision", "run.seed")


class Checkpointer:
    def __init__(self, cfg: Config):
        self.directory = os.path.abspath(os.path.join(cfg.run.out_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.max_to_keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self.config_yaml = config_lib.dump(cfg)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state) -> None:
        """Start saving `state` at its optimizer step (returns before the write completes)."""
        step = int(state.step)
        meta = {"step": step, "config": yaml.safe_load(self.config_yaml)}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def restore(self, step: int, abstract_state):
        """The state saved at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings)."""
        path = os.path.join(self.directory, str(step))
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax raises many types (ValueError, FileNotFoundError, tensorstore errors)
            steps = [s for s in self.manager.all_steps() if s != step]
            older = f"move it aside to resume from step {max(steps)}" if steps else "move it aside"
            raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e)[:300]}); "
                            f"{older}, or start over with --run.fresh=true") from None
        check_same_trajectory(restored["meta"]["config"], yaml.safe_load(self.config_yaml), path)
        return restored["state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def check_same_trajectory(saved: dict, current: dict, path: str) -> None:
    """Refuse to resume when a key that shapes the trajectory changed since the checkpoint was written."""
    saved, current = _flatten(saved), _flatten(current)
    changed = [k for k in current if k.startswith(TRAJECTORY_KEYS) and saved.get(k) != current[k]]
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {current[k]!r}" for k in changed)
        raise UserError(f"the config differs from the one that wrote {path} ({diffs}); resume with the same "
                        f"config, or start over with --run.fresh=true or a new --run.out_dir")


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def abstract_like(state, shardings):
    """ShapeDtypeStructs of `state`'s leaves with the given shardings: the restore target."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
