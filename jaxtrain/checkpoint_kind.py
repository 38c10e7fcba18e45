"""What a checkpoint folder is, told from the names of its files, so that a tool given a folder of another kind
than it takes says what the folder is and the command that takes it, instead of calling it damaged:

    jaxtrain step   <run>/checkpoints/<step>/ as Orbax writes it (checkpoint.py): the `state` item, and Orbax's
                    `_CHECKPOINT_METADATA`
    torch           model.safetensors, with optimizer.safetensors and trainer_state.json for a whole training state
                    (torch_format.py): torchref's checkpoints, and what convert to-torch writes
    jaxtrain run,   a run folder whose newest checkpoints/<step>/ is a jaxtrain step, or a torch folder
    torchref run

Pure Python (no jax, no torch): both backends and the converter ask it.
"""

import os

from etils import epath

from jaxtrain.errors import UserError

MODEL, OPTIMIZER, TRAINER_STATE = "model.safetensors", "optimizer.safetensors", "trainer_state.json"
JAXTRAIN_STEP, TORCH, JAXTRAIN_RUN, TORCHREF_RUN = "jaxtrain step", "torch", "jaxtrain run", "torchref run"
# The names whose presence makes a folder a step of each format.
MARKERS = {JAXTRAIN_STEP: ("state", "_CHECKPOINT_METADATA"), TORCH: (TRAINER_STATE, MODEL, OPTIMIZER)}
_RUN_OF = {JAXTRAIN_STEP: JAXTRAIN_RUN, TORCH: TORCHREF_RUN}


def kind(path: str) -> str | None:
    """The kind of the local folder `path`; None when it is none of them, or not a folder."""
    if not os.path.isdir(path):
        return None
    for step_kind, names in MARKERS.items():
        if any(os.path.exists(os.path.join(path, name)) for name in names):
            return step_kind
    step = newest_step(path)
    return _RUN_OF.get(kind(step)) if step else None


def newest_step(run_dir: str) -> str | None:
    """The step folder of run_dir's checkpoints with the highest step number, or None."""
    root = os.path.join(run_dir, "checkpoints")
    steps = [int(n) for n in os.listdir(root) if n.isdigit()] if os.path.isdir(root) else []
    return os.path.join(root, str(max(steps))) if steps else None


def _run_of(step_dir: str) -> str:
    """The run folder of a step folder <run>/checkpoints/<step>."""
    parent = os.path.dirname(os.path.abspath(step_dir))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else "<its run folder>"


def _convert_first(step_dir: str) -> str:
    return (f"to start another run from it, convert it first: python -m jaxtrain.convert to-torch {step_dir} DST, "
            f"then --init.from=DST")


def check_torch_source(path: str, flag: str) -> None:
    """UserError unless `path`, given as `flag` (init.from), is a torch-format folder: otherwise one line says what
    it is and the command that takes it."""
    if not os.path.isdir(path):
        raise UserError(f"{flag}={path!r} {'is a file' if os.path.exists(path) else 'does not exist'}; point it at "
                        f"a torch-format checkpoint folder (one holding {MODEL})")
    found = kind(path)
    if found == JAXTRAIN_STEP:
        raise UserError(f"{flag}={path!r} is a jaxtrain checkpoint (an Orbax step folder), not a torch-format one: "
                        f"jaxtrain.run resumes it with --run.out_dir={_run_of(path)}; {_convert_first(path)}")
    if found == JAXTRAIN_RUN:
        raise UserError(f"{flag}={path!r} is a jaxtrain run folder (Orbax checkpoints), not a torch-format "
                        f"checkpoint: jaxtrain.run resumes it with --run.out_dir={path}; "
                        f"{_convert_first(newest_step(path))}")


def check_own_steps(directory: str, backend: str) -> None:
    """The step folders in `directory` (a run folder's checkpoints/, a path or URL) are of `backend`'s format
    ("jaxtrain" or "torchref"): one the other backend wrote is named, with the way to use it, before a resume would
    read it as a damaged checkpoint of its own."""
    other = TORCH if backend == "jaxtrain" else JAXTRAIN_STEP
    found = {str(p.parent) for name in MARKERS[other] for p in epath.Path(directory).glob(f"*/{name}")}
    if not found:
        return
    where = max(found, key=lambda step: (len(step), step))  # the newest step: what a resume would have read
    how = (f"a torch-format checkpoint, which a jaxtrain run starts from with --init.from={where}" if other == TORCH
           else f"a jaxtrain checkpoint (an Orbax step folder), which torchref starts from once converted: "
                f"python -m jaxtrain.convert to-torch {where} DST, then --init.from=DST")
    raise UserError(f"{where} is {how}; move it out of {directory}, or choose another --run.out_dir (or start over "
                    f"with --run.fresh=true, which sets the checkpoints aside)")
