"""Orbax checkpoints in <out_dir>/checkpoints/<step>/ and resuming from them.

Each step folder holds `state` (params and the whole optax state, MultiSteps counters included, saved sharded
by orbax) and `meta` (JSON: the step and the resolved config). Saves are asynchronous: training continues while
the arrays are written, and orbax only renames a step folder into place once it is complete, so a crash during a
save never leaves a half-written checkpoint where resume would find it. Restore places every array directly on
its target sharding (MaxText-style), so a pod never gathers a full copy on one host.
"""

import functools
import os

import jax
import orbax.checkpoint as ocp
import yaml
from etils import epath
from jax.sharding import Mesh

from jaxtrain import config as config_lib
from jaxtrain import data as data_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import step as step_lib
from jaxtrain import torch_format
from jaxtrain.config import Config
from jaxtrain.step import TrainState
from jaxtrain.errors import UserError

class Checkpointer:
    def __init__(self, cfg: Config):
        if cfg.model.vocab_size is None:  # the saved config must say what the model was built with
            raise ValueError("Checkpointer needs a config with model.vocab_size resolved (see run.Trainer)")
        self.directory = os.path.abspath(os.path.join(cfg.run.out_dir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.checkpoint.max_to_keep,
            enable_async_checkpointing=cfg.checkpoint.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))
        self.cfg = cfg

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, state, data_seed: int, data_fingerprint: str | None) -> None:
        """Start saving `state` at its optimizer step (returns before the write completes). `data_seed` orders the
        batches (run.seed, or the data seed of a full state the run started from: data.continued_seed);
        `data_fingerprint` names the data (data.TokenData.fingerprint; None where unknown, as after a conversion)."""
        step = int(state.step)
        meta = {"step": step, "data_seed": data_seed, "data_fingerprint": data_fingerprint,
                "config": yaml.safe_load(config_lib.dump(self.cfg))}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                        meta=ocp.args.JsonSave(meta)), force=True)

    def data_seed(self, step: int, data_fingerprint: str) -> int:
        """The data seed the checkpoint at `step` was trained with (older checkpoints: their run.seed), after
        checking from its meta alone that it was written with this config and this data (`data_fingerprint`): a
        refused resume, a changed model shape included, names the changed keys before any array is read."""
        where = os.path.join(self.directory, str(step))
        if not (epath.Path(where) / "meta").is_dir():
            raise UserError(_not_jaxtrain(where, self.directory))
        meta = self._restore(step, meta=ocp.args.JsonRestore())["meta"]
        config_lib.check_same_trajectory(meta["config"], self.cfg, where)
        data_lib.check_same_data(meta, data_fingerprint, self.cfg, where)
        return meta.get("data_seed", meta["config"]["run"]["seed"])

    def restore(self, step: int, abstract_state):
        """The state saved at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings)."""
        return self._restore(step, state=ocp.args.StandardRestore(abstract_state))["state"]

    def _restore(self, step: int, **items):
        try:
            return self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # orbax raises many types (ValueError, FileNotFoundError, tensorstore errors)
            steps = [s for s in self.manager.all_steps() if s != step]
            older = f"move it aside to resume from step {max(steps)}" if steps else "move it aside"
            raise UserError(f"checkpoint {os.path.join(self.directory, str(step))} cannot be read "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:300]}); {older}, or start over with "
                            f"--run.fresh=true") from None

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def _not_jaxtrain(where: str, directory: str) -> str:
    """What a step folder without meta/ is, and what to do with it (orbax would only say an item is missing)."""
    if (epath.Path(where) / torch_format.TRAINER_STATE).exists():
        what = f"a torch-format checkpoint, which a run starts from with --init.from={where}"
    else:
        what = "not a jaxtrain checkpoint (it has no meta/)"
    return f"{where} is {what}; move it out of {directory}, or start over with --run.fresh=true or a new --run.out_dir"


def abstract_state(cfg: Config, vocab_size: int, mesh: Mesh) -> TrainState:
    """ShapeDtypeStructs of a run's state with their fsdp shardings on `mesh`: the layout a run creates its state
    in, and the target a restore places the arrays on. Nothing is allocated."""
    abstract = jax.eval_shape(functools.partial(step_lib.fresh_state, cfg, vocab_size))
    shardings = mesh_lib.fsdp_sharding(mesh, abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)
