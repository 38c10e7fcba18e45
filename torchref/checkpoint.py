"""Torch-format checkpoints: <out_dir>/checkpoints/<step>/ holding

    model.safetensors      the state dict by nanoGPT name, fp32 (a tied lm_head.weight is left out: it is wte)
    optimizer.safetensors  AdamW's moments, `<param name>.exp_avg` and `<param name>.exp_avg_sq`
    trainer_state.json     step (windows trained), skipped (windows whose update train.nan_policy=skip left out:
                           AdamW's step count and LambdaLR stand at step - skipped), scheduler, data position and
                           fingerprint, RNG, and the config the run was started with

This is also jaxtrain's interchange format (jaxtrain.convert, --init.from), so it holds tensors and JSON only,
never pickles. A folder appears under its step number only once complete (written as .tmp-<step>, then renamed).
"""

import base64
import contextlib
import dataclasses
import json
import os
import shutil

import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from jaxtrain import checkpoint_kind, checkpoint_model, config, runfolder, same_run
from jaxtrain.config import Config
from jaxtrain.data import check_same_data
from jaxtrain.errors import UserError

# LambdaLR's position, for readers of the file; a resume rebuilds the scheduler from `step` (optim.lr_scheduler),
# so that init.from with a new optim.lr follows the new config's schedule from the checkpoint's step.
SCHEDULER_KEYS = ("last_epoch", "_step_count", "base_lrs", "_last_lr")
# What to do about a damaged checkpoint file depends on where the checkpoint is (_Damaged).
_FIX = {"resume": "that checkpoint is damaged: delete its folder (a resume then takes the previous one), or start over "
                  "with --run.fresh=true",
        "init.from": "the init.from checkpoint is damaged: copy or convert it again, or point --init.from at another "
                     "checkpoint"}


class _Damaged(UserError):
    """A checkpoint file missing, unreadable or lacking a field; resume() and init_from() add the fix (_FIX)."""


@contextlib.contextmanager
def _fix_for(source: str):
    try:
        yield
    except _Damaged as e:
        raise UserError(f"{e}; {_FIX[source]}") from None


@dataclasses.dataclass
class Progress:
    """Where training stands, besides the tensors."""
    step: int = 0  # optimizer steps completed
    data_seed: int = 0  # seed of the batch order (run.seed of the run that started it)
    tokens: int = 0  # valid target tokens trained on so far
    skipped: int = 0  # windows whose update train.nan_policy=skip, or fp16's loss scaling, left out
    loss_scale: dict | None = None  # train.precision=fp16: GradScaler.state_dict()
    best: dict | None = None  # {"step", "eval_loss"}: the lowest eval loss among this run's saves (checkpoint.keep_best)

    @property
    def updates(self) -> int:
        """Updates applied: AdamW's step count and the LambdaLR position (a skipped window advances neither)."""
        return self.step - self.skipped


def latest(out_dir: str) -> str | None:
    """The newest complete checkpoint folder in out_dir, or None."""
    step = latest_step(out_dir)
    return os.path.join(out_dir, "checkpoints", str(step)) if step is not None else None


def latest_step(out_dir: str) -> int | None:
    steps = _saved_steps(os.path.join(out_dir, "checkpoints"))
    return steps[-1] if steps else None


def remove_partial(out_dir: str) -> None:
    """Delete what a save cut short by a kill or a second signal left: its `.tmp-<step>` folder, never a
    checkpoint (a save renames its folder to the step only once it is complete)."""
    root = os.path.join(out_dir, "checkpoints")
    for name in os.listdir(root) if os.path.isdir(root) else []:
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(root, name))


def save(out_dir: str, progress: Progress, model, optimizer, scheduler, cfg: Config, data_fingerprint: str,
         eval_loss: float | None = None) -> None:
    """Write checkpoints/<step>/ whole or not at all, then keep the newest checkpoint.max_to_keep, and with
    checkpoint.keep_best the save of the lowest eval loss too (`eval_loss`: the evaluation at this step), as
    jaxtrain's Checkpointer does. `data_fingerprint` (data.TokenData.fingerprint) names the data the run trains on.
    Refuses a state holding inf or NaN (an overflowed update can follow a finite loss and gradient norm)."""
    if not all(torch.isfinite(p).all() for p in model.parameters()):
        go_on = same_run.new_run_from(cfg, latest_step(out_dir), "torchref", "lower optim.lr")
        raise UserError(f"the state after step {progress.step} holds inf or NaN although its loss and gradient norm "
                        f"are finite (an update overflowed); it was not saved: {go_on}")
    root = os.path.join(out_dir, "checkpoints")
    tmp, final = os.path.join(root, f".tmp-{progress.step}"), os.path.join(root, str(progress.step))
    if eval_loss is not None and (progress.best is None or eval_loss < progress.best["eval_loss"]):
        progress.best = {"step": progress.step, "eval_loss": eval_loss}
    try:
        _write(tmp, model, optimizer, _trainer_state(progress, scheduler, model.cfg.tie_embeddings, cfg,
                                                     data_fingerprint))
    except (OSError, SafetensorError) as e:  # a full disk: safetensors' error is no OSError
        shutil.rmtree(tmp, ignore_errors=True)
        raise runfolder.unwritten_checkpoint(root, e, latest_step(out_dir)) from None
    if os.path.isdir(final):  # a run.fresh run reaching a step that is still on disk
        os.replace(final, tmp + ".old")
        shutil.rmtree(tmp + ".old")
    os.replace(tmp, final)
    best = progress.best["step"] if cfg.checkpoint.keep_best and progress.best else None
    for step in _saved_steps(root)[:-cfg.checkpoint.max_to_keep]:
        if step != best:
            shutil.rmtree(os.path.join(root, str(step)))


def _write(tmp: str, model, optimizer, trainer_state: dict) -> None:
    """A checkpoint's files into the folder `tmp`, made afresh."""
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tied = model.cfg.tie_embeddings
    # safetensors refuses shared tensors; a tied lm_head.weight is wte's, and the loader ties it back.
    weights = {n: t.detach().float().cpu().contiguous() for n, t in model.state_dict().items()
               if not (tied and n == "lm_head.weight")}
    for name, tensors in (("model.safetensors", weights), ("optimizer.safetensors", _adam_moments(model, optimizer))):
        save_file(tensors, os.path.join(tmp, name))
        runfolder.as_open_makes_it(os.path.join(tmp, name))
    with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
        json.dump(trainer_state, f, indent=1)


def resume(path: str, cfg: Config, data_fingerprint: str, model, optimizer) -> tuple[Progress, Config]:
    """Restore everything from one of this run's checkpoints; a changed config or other data is an error. Returns
    where training stands and the config the run goes on with (same_run.check: the run's own init.from)."""
    with _fix_for("resume"):
        state = _read_trainer_state(path)
        other = checkpoint_kind.other_step_held(state.get("step"), int(os.path.basename(path)), path)
        if other:  # jaxtrain sets such a folder aside, having older steps to fall back to; torchref refuses it
            raise UserError(f"{other}; move it out of {os.path.dirname(path)}")
        check_same_data(state, data_fingerprint, cfg, path)  # first, as jaxtrain: other data changes a null vocab
        cfg = same_run.check(state.get("config", {}), cfg, path, state.get("step"), "torchref")
        load_weights(path, model, checkpoint_kind.TRAINER_STATE)
        progress = _restore_training(path, state, model, optimizer)
        progress.best = state.get("best")  # this run's own: init.from starts a run with none
        runfolder.warn_best_released(progress.best, _saved_steps(os.path.dirname(path)), cfg.checkpoint.keep_best,
                                     cfg.checkpoint.max_to_keep)
        return progress, cfg


def init_from(path: str, model, optimizer, tokens) -> Progress | None:
    """--init.from: the weights, and the whole training state when optimizer.safetensors and trainer_state.json
    are there too, to train on `tokens` (data.TokenData), whose ids its embedding must hold. Returns the Progress
    to continue from, or None when only weights were loaded."""
    checkpoint_kind.check_torch_source(path, "init.from")
    checkpoint_model.check_written(path, model.cfg)
    checkpoint_model.check_vocab_rows(path, tokens)
    with _fix_for("init.from"):
        load_weights(path, model)
        if not checkpoint_kind.holds_training_state(path):
            return None
        return _restore_training(path, _read_trainer_state(path), model, optimizer)


def load_weights(path: str, model, config_from: str | None = None) -> None:
    """Copy model.safetensors into the model's parameters in place (the optimizer keeps pointing at them).
    `config_from`: the file the model's config was read from where it is not the run's
    (checkpoint_model.model_keys_hint)."""
    file = os.path.join(path, "model.safetensors")
    tensors = _read_tensors(file)
    tied = model.cfg.tie_embeddings
    expected = {n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")}
    hint = checkpoint_model.model_keys_hint({n: tuple(t.shape) for n, t in tensors.items()}, model.cfg, config_from)
    for name, t in expected.items():
        if name not in tensors:
            raise UserError(f"{file} has no tensor {name!r}; {hint}")
        if tensors[name].shape != t.shape:
            raise UserError(f"{file}: {name!r} has shape {tuple(tensors[name].shape)}, the model expects "
                            f"{tuple(t.shape)}; {hint}")
    extra = sorted(tensors.keys() - expected.keys())
    if extra:
        raise UserError(f"{file} has tensor {extra[0]!r}, which the model lacks; {hint}")
    model.load_state_dict(tensors, strict=False)


def _resolved(cfg: Config) -> dict:
    return yaml.safe_load(config.dump(cfg))


def _saved_steps(root: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def _adam_moments(model, optimizer) -> dict:
    """AdamW's moments by parameter name; zeros before its first update (every window so far skipped by fp16's loss
    scaling or nan_policy=skip), where torch has made no state yet: what AdamW starts from, and what jaxtrain's
    export of such a state holds."""
    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            moment = state[key] if state else torch.zeros_like(p, dtype=torch.float32)
            out[f"{name}.{key}"] = moment.detach().cpu().contiguous()
    return out


def _trainer_state(progress: Progress, scheduler, tied: bool, cfg: Config, data_fingerprint: str) -> dict:
    cuda_rng = _b64(torch.cuda.get_rng_state()) if torch.cuda.is_available() else None
    return {
        "format": checkpoint_kind.FORMAT,
        "step": progress.step,
        "lr_scheduler": {k: scheduler.state_dict()[k] for k in SCHEDULER_KEYS},
        "tied_embeddings": tied,
        "data": {"seed": progress.data_seed, "next_step": progress.step, "tokens": progress.tokens},
        "skipped": progress.skipped,
        "best": progress.best,
        **({"loss_scale": _scaler_state(progress.loss_scale)} if progress.loss_scale else {}),
        "rng": {"torch": _b64(torch.get_rng_state()), "cuda": cuda_rng},
        "data_fingerprint": data_fingerprint,
        "config_hash": same_run.config_hash(cfg),
        "config": _resolved(cfg),
    }


def _restore_training(path: str, state: dict, model, optimizer) -> Progress:
    """Optimizer moments, RNG and data position, after the weights are in place."""
    step, data, rng = state["step"], state["data"], state.get("rng") or {}  # fields read_trainer_state checked
    skipped = state.get("skipped", 0)  # absent before train.nan_policy existed: nothing was skipped
    _load_adam_moments(os.path.join(path, "optimizer.safetensors"), model, optimizer, step - skipped)
    try:  # null in jaxtrain's exports: jaxtrain has no torch RNG state to give
        if rng.get("torch") is not None:
            torch.set_rng_state(_unb64(rng["torch"]))
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(_unb64(rng["cuda"]))
    except (ValueError, RuntimeError) as e:  # not base64, or not the bytes of an RNG state
        raise _Damaged(f"{os.path.join(path, 'trainer_state.json')}: 'rng' does not hold torch's RNG states ({e})") \
            from None
    scaler = state.get("loss_scale")  # fp16 runs: {"scale", "growth_tracker"}
    loss_scale = None if scaler is None else {"scale": scaler["scale"], "_growth_tracker": scaler["growth_tracker"]}
    return Progress(step=step, data_seed=data["seed"], tokens=data.get("tokens", 0), skipped=skipped,
                    loss_scale=loss_scale)


def _scaler_state(state: dict) -> dict:
    """GradScaler's scale and growth tracker, as the torch format (and jaxtrain's optim.LossScaleState) hold them."""
    return {"scale": float(state["scale"]), "growth_tracker": int(state["_growth_tracker"])}


def _load_adam_moments(file: str, model, optimizer, updates: int) -> None:
    tensors = _read_tensors(file)
    for name, p in model.named_parameters():
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            t = tensors.get(f"{name}.{key}")
            if t is None or t.shape != p.shape:
                raise UserError(f"{file}: {name}.{key} is missing or not of shape {tuple(p.shape)}; the optimizer "
                                f"state does not match the model")
            moments[key] = t.to(device=p.device, dtype=torch.float32)
        # AdamW keeps its bias-correction count per parameter as a float32 scalar tensor.
        optimizer.state[p] = {"step": torch.tensor(float(updates), dtype=torch.float32), **moments}


def _read_tensors(file: str) -> dict:
    try:
        return load_file(file)
    except (OSError, SafetensorError) as e:
        raise _Damaged(f"checkpoint file {file} is missing or unreadable ({e})") from None


def _read_trainer_state(path: str) -> dict:
    try:
        return checkpoint_kind.read_trainer_state(path)
    except checkpoint_kind.DamagedTrainerState as e:
        raise _Damaged(e.problem) from None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)
