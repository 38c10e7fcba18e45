"""The torch checkpoint format, read and written with numpy and safetensors only (never torch).

A torch-format checkpoint is a folder; torchref/checkpoint.py writes and reads exactly this:

    model.safetensors      nanoGPT's state dict, fp32, Linear weights (out, in); no lm_head.weight when tied
    optimizer.safetensors  AdamW's moments by param name: `<name>.exp_avg` (our mu), `<name>.exp_avg_sq` (our nu)
    trainer_state.json     {"format", "step", "skipped", "lr_scheduler", "tied_embeddings", "data", "rng",
                            "config_hash", "config", and under fp16 "loss_scale": {"scale", "growth_tracker"}}

The bridge is lossless: params and moments are fp32 on both sides and only transposed, and a checkpoint is always
taken at a window boundary, where two numbers say where training stands: `step`, the windows trained
(MultiSteps' gradient_step, the data position), and `skipped`, those whose update train.nan_policy=skip left
out (absent: 0); step - skipped is AdamW's bias-correction count and the schedule's count. Which name maps to which param, and which are transposed,
comes from model.torch_names alone.
"""

import contextlib
import json
import os
import shutil
import tempfile
from typing import Callable

import jax
import numpy as np
import optax
import yaml
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtrain import config as config_lib
from jaxtrain import model
from jaxtrain import optim
from jaxtrain import param_groups
from jaxtrain import runfolder
from jaxtrain import same_run
from jaxtrain import checkpoint_kind
from jaxtrain import checkpoint_model
from jaxtrain.checkpoint_kind import FORMAT, MODEL, OPTIMIZER, TRAINER_STATE
from jaxtrain.config import Config
from jaxtrain.errors import UserError
from jaxtrain.step import TrainState

MOMENTS = (("mu", "exp_avg"), ("nu", "exp_avg_sq"))  # optax ScaleByAdamState field -> torch AdamW state key


def export(state: TrainState, cfg: Config, out_dir: str, data_seed: int | None = None,
           data_fingerprint: str | None = None, tokens: int | None = None) -> None:
    """Write `state` (trained with `cfg`, on batches of `data_seed`, default run.seed, of the data
    `data_fingerprint` names: data.TokenData.fingerprint, `tokens` of them: the checkpoint's count, default its
    steps' windows of cfg's size) as a torch-format folder.
    Written under a temporary name and renamed into place, so out_dir either holds a complete checkpoint or does not
    exist."""
    if int(state.opt_state.mini_step) != 0:
        raise UserError(f"the state is in the middle of a gradient-accumulation window (micro-step "
                        f"{int(state.opt_state.mini_step)} of {cfg.optim.grad_accum_steps}): the torch format has no "
                        f"place for the partly accumulated gradient. jaxtrain only saves at window ends; export one "
                        f"of its checkpoints")
    check_new_folder(out_dir)
    names, adam = model.torch_names(state.params), optim.adam_state(state.opt_state)
    step = int(state.step)
    # torchref's AdamW param groups, each with its LR in LambdaLR's state
    lr_scales = [s.lr_scale for s, _ in param_groups.torch_order(optim.param_settings(cfg, state.params))]
    moments = {f"{name}.{key}": x for field, key in MOMENTS
               for name, x in _torch_arrays(getattr(adam, field), names).items()}
    # Random windows have no padding, so every update trained on batch_size x seq_len tokens; a run started from
    # init.from's state at another batch size has counted others, which its checkpoint keeps.
    tokens = step * cfg.data.batch_size * cfg.model.seq_len if tokens is None else tokens
    trainer_state = _trainer_state(step, step - int(adam.count), "lm_head.weight" not in names, cfg, lr_scales,
                                   {"seed": cfg.run.seed if data_seed is None else data_seed, "next_step": step,
                                    "tokens": tokens}, data_fingerprint)
    if cfg.train.precision == "fp16":  # GradScaler's state, as torchref's checkpoints hold it
        scaler = optim.loss_scale(state.opt_state)
        trainer_state["loss_scale"] = {"scale": float(scaler.scale), "growth_tracker": int(scaler.good_steps)}
    with folder_into_place(out_dir) as tmp:
        for name, arrays in ((MODEL, _torch_arrays(state.params, names)), (OPTIMIZER, moments)):
            save_file(arrays, os.path.join(tmp, name))
            runfolder.as_open_makes_it(os.path.join(tmp, name))
        with open(os.path.join(tmp, TRAINER_STATE), "w", encoding="utf-8") as f:
            json.dump(trainer_state, f, indent=1)


@contextlib.contextmanager
def folder_into_place(out_dir: str):
    """Yields a temporary folder to write into, whose files become out_dir's when the block ends without an error,
    and which is deleted when it raises: out_dir holds a complete conversion, or is as it was (absent, or empty:
    check_new_folder). A new out_dir is the temporary folder renamed; an existing one (a symlink or a mount point,
    which no rename replaces, among them) is kept, the files moved into it from a temporary folder made inside it,
    on its file system. The temporary folder lies in a fresh mkdtemp one, so that no folder of the user's is taken
    for a stale one (a fixed name `<out_dir>.tmp` was deleted), and is made by makedirs, with the permissions
    out_dir would have had."""
    existing = os.path.isdir(out_dir)
    parent = out_dir if existing else os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    fresh = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.tmp-", dir=parent)
    try:
        tmp = os.path.join(fresh, "out")
        os.makedirs(tmp)
        yield tmp
        if not existing:
            os.replace(tmp, out_dir)
            return
        others = sorted(set(os.listdir(out_dir)) - {os.path.basename(fresh)})
        if others:  # written while the conversion was: never replaced
            raise UserError(f"{out_dir} was empty and now holds {others[0]!r}, written there while the conversion "
                            f"ran; convert again into a new output folder")
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
    finally:
        shutil.rmtree(fresh, ignore_errors=True)


def load(path: str, template: TrainState, cfg: Config, config_from: str | None = None) -> tuple[TrainState, str]:
    """`template` (a concrete state built from `cfg`) with the checkpoint at `path` in it, and what was loaded:

    "full" when optimizer.safetensors and trainer_state.json are there: params, AdamW's moments, and the state at
    the window boundary after trainer_state's step (every count at step, nothing accumulated); the grad-norm
    record, a logging value the format does not carry, stays the template's. "weights" otherwise: params only,
    the template's optimizer state (a fresh one starts at step 0). Every leaf keeps the template's dtype and
    sharding. `config_from`: the file `cfg` was read from where it is not the run's
    (checkpoint_model.model_keys_hint)."""
    if not os.path.isdir(path):
        raise UserError(f"torch-format checkpoint {path!r} is not a folder; point at a folder holding {MODEL}")
    params = load_params(path, template.params,
                         lambda found: checkpoint_model.model_keys_hint(found, cfg.model, config_from))
    if not checkpoint_kind.holds_training_state(path):
        return template._replace(params=params), "weights"
    trainer_state = checkpoint_kind.read_trainer_state(path)
    step, skipped = trainer_state["step"], trainer_state.get("skipped", 0)
    names = model.torch_names(template.params)
    moment_shapes = {f"{name}.{key}": shape for name, shape in _shapes(template.params, names).items()
                     for _, key in MOMENTS}
    moments = _read_tensors(os.path.join(path, OPTIMIZER), moment_shapes, lambda found: (
        f"it does not hold the moments of the weights in {MODEL} beside it (copied from another checkpoint?); "
        f"copy or convert the whole folder again"))
    adam = optim.adam_state(template.opt_state)
    mu, nu = (_from_torch(getattr(adam, field), {n: moments[f"{n}.{key}"] for n in names}, names)
              for field, key in MOMENTS)
    opt_state = _at_window_boundary(template.opt_state, mu, nu, step, skipped, trainer_state.get("loss_scale"))
    return TrainState(params, opt_state), "full"


def load_params(path: str, template: nnx.State, hint: Callable[[dict], str]) -> nnx.State:
    """`template` (params) with the weights of the torch-format folder `path` in it; `hint(found)`: what to do where
    their names or shapes (found: name -> shape) are not the model's."""
    names = model.torch_names(template)
    weights = _read_tensors(os.path.join(path, MODEL), _shapes(template, names), hint)
    return _from_torch(template, weights, names)


def params_from(template: nnx.State, tensors: dict[str, np.ndarray], where: str,
                hint: Callable[[dict], str]) -> nnx.State:
    """`template` (params) with the torch-format `tensors` (nanoGPT's names and layout) in it, read from `where`,
    whose names and shapes must be the model's (`hint`, as load_params's)."""
    names = model.torch_names(template)
    found = {name: tuple(x.shape) for name, x in tensors.items()}
    _check_tensors(where, _shapes(template, names), found, hint(found))
    return _from_torch(template, tensors, names)


def _shapes(template: nnx.State, names: dict) -> dict[str, tuple]:
    """nanoGPT name -> the shape of its tensor (torch's layout) in the params `template`."""
    leaves = {p: var.get_value() for p, var in nnx.to_flat_state(template)}
    return {name: tuple(leaves[p].shape[::-1] if transposed else leaves[p].shape)
            for name, (p, transposed) in names.items()}


def check_new_folder(out_dir: str) -> None:
    """Conversions never overwrite: out_dir must not exist yet, or be empty; and it must be writable, which is
    checked before the source is read. It cannot be the folder the command runs in: a conversion is a folder
    of its own; nor a link to a folder that does not exist, nor inside a run's checkpoints/, where rotation deletes
    it with its step and a resume refuses a folder that is no step."""
    runfolder.check_not_url(out_dir, "DST")
    if not out_dir.strip() or os.path.abspath(out_dir) == os.getcwd():
        raise UserError(f"DST {out_dir!r} is the folder this command runs in; the conversion is made as a new "
                        f"folder: name one, e.g. ./converted")
    out_dir = out_dir.rstrip(os.sep) or out_dir  # "link/" is no link to os.path
    if os.path.islink(out_dir) and not os.path.exists(out_dir):
        raise UserError(f"DST {out_dir} is a symbolic link to {os.readlink(out_dir)}, which does not exist; make "
                        f"that folder, or choose another DST")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"{out_dir} already exists and is not an empty folder; choose a new output folder or "
                        f"delete it")
    checkpoints = next((folder for folder in _itself_and_above(out_dir) if os.path.basename(folder) == "checkpoints"
                        and os.path.isfile(os.path.join(os.path.dirname(folder), "config.yaml"))), None)
    if checkpoints is not None:
        raise UserError(f"DST {out_dir} lies in the run folder's {checkpoints}, where the run's rotation would "
                        f"delete it with its step, or a resume refuse it; choose a folder outside checkpoints/")
    runfolder.check_writable(out_dir, "DST")


def _itself_and_above(path: str) -> list[str]:
    """`path` and each folder above it, nearest first, links resolved (a DST reached through a link into a run)."""
    found = [os.path.realpath(path)]
    while os.path.dirname(found[-1]) != found[-1]:
        found.append(os.path.dirname(found[-1]))
    return found


def _trainer_state(step: int, skipped: int, tied: bool, cfg: Config, lr_scales: list[float], data: dict,
                   data_fingerprint: str | None) -> dict:
    """What torchref resumes from besides the tensors. LambdaLR, stepped once per applied update, stands at
    last_epoch = step - skipped with the next update's LR; jaxtrain has no torch RNG state to give, hence the
    nulls."""
    updates = step - skipped
    with jax.enable_x64(True):  # torch keeps the LR as a Python float; an fp32 one would differ in its low bits
        next_lr = float(optim.lr_schedule(cfg)(np.int64(updates)))
    return {
        "format": FORMAT,
        "step": step,
        "skipped": skipped,
        "lr_scheduler": {"last_epoch": updates, "_step_count": updates + 1,
                         "base_lrs": [cfg.optim.lr * s for s in lr_scales], "_last_lr": [next_lr * s for s in lr_scales]},
        "tied_embeddings": tied,
        "data": data,
        "data_fingerprint": data_fingerprint,
        "rng": {"torch": None, "cuda": None},
        "config_hash": same_run.config_hash(cfg),
        "config": yaml.safe_load(config_lib.dump(cfg)),
    }


def model_tensors(params: nnx.State) -> dict[str, np.ndarray]:
    """The params as the torch format's model.safetensors holds them: nanoGPT's names and layout, fp32."""
    return _torch_arrays(params, model.torch_names(params))


def _torch_arrays(tree: nnx.State, names: dict) -> dict[str, np.ndarray]:
    """nanoGPT name -> fp32 host array in torch's layout, for the params or a tree shaped like them (mu, nu)."""
    leaves = {path: var.get_value() for path, var in nnx.to_flat_state(tree)}
    arrays = {}
    for name, (path, transposed) in names.items():
        x = np.asarray(jax.device_get(leaves[path]), np.float32)
        arrays[name] = np.ascontiguousarray(x.T if transposed else x)
    return arrays


def _from_torch(template: nnx.State, arrays: dict[str, np.ndarray], names: dict) -> nnx.State:
    """`template` (params, mu or nu) with each leaf replaced by its torch array, transposed back."""
    by_path = {path: (name, transposed) for name, (path, transposed) in names.items()}

    def leaf(path, var):
        name, transposed = by_path[path]
        return var.replace(_put(arrays[name].T if transposed else arrays[name], var.get_value()))

    return nnx.from_flat_state([(path, leaf(path, var)) for path, var in nnx.to_flat_state(template)])


def _at_window_boundary(template: optax.MultiStepsState, mu, nu, step: int, skipped: int,
                        loss_scale: dict | None) -> optax.MultiStepsState:
    """MultiSteps' state right after window `step`: AdamW's moments in place, gradient_step at step, AdamW's
    bias-correction count and the LR schedule's count at the updates applied (step - skipped), fp16's loss scale
    where the checkpoint has one (GradScaler's scale and growth tracker), no micro-step taken and nothing
    accumulated."""
    def counted(s):
        if isinstance(s, optim.LossScaleState) and loss_scale is not None:
            return optim.LossScaleState(_put(loss_scale["scale"], s.scale), _put(loss_scale["growth_tracker"],
                                                                                   s.good_steps))
        if isinstance(s, optax.ScaleByAdamState):
            return s._replace(count=_put(step - skipped, s.count), mu=mu, nu=nu)
        if isinstance(s, optax.ScaleByScheduleState):
            return s._replace(count=_put(step - skipped, s.count))
        return s

    inner = jax.tree.map(counted, template.inner_opt_state,
                         is_leaf=lambda s: isinstance(s, (optax.ScaleByAdamState, optax.ScaleByScheduleState,
                                                          optim.LossScaleState)))
    return template._replace(
        inner_opt_state=inner, gradient_step=_put(step, template.gradient_step),
        mini_step=_put(0, template.mini_step),
        acc_grads=jax.tree.map(lambda x: _put(np.zeros(x.shape), x), template.acc_grads))


def _put(value, like: jax.Array) -> jax.Array:
    """`value` as an array with `like`'s dtype and sharding."""
    return jax.device_put(np.asarray(value, like.dtype), like.sharding)


def _read_tensors(file: str, expected: dict[str, tuple], hint) -> dict[str, np.ndarray]:
    """The tensors of `file`, whose names and shapes must be exactly `expected` (torch layout); `hint(found)`: what
    to do where they are not, from the names and shapes found."""
    try:
        with safe_open(file, framework="np") as f:
            found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
            _check_tensors(file, expected, found, hint(found))
            return {name: f.get_tensor(name) for name in expected}
    except (OSError, SafetensorError) as e:
        raise UserError(f"{file} is missing or unreadable ({e}); re-export the checkpoint, or copy it again "
                        f"if it was truncated") from None


def _check_tensors(file: str, expected: dict[str, tuple], found: dict[str, tuple], hint: str) -> None:
    """One UserError naming the first tensor that is missing, unexpected or of another shape."""
    for name, shape in expected.items():
        if found.get(name) != shape:
            got = f"shape {found[name]}" if name in found else "no such tensor"
            raise UserError(f"{file}: tensor {name!r} expected with shape {shape}, found {got}; {hint}")
    extra = sorted(found.keys() - expected.keys())
    if extra:
        raise UserError(f"{file}: unexpected tensor {extra[0]!r} (shape {found[extra[0]]}), which the model lacks; "
                        f"{hint}")
