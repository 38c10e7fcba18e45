"""What a checkpoint folder is, told from the names of its files, so that a tool given a folder of another kind
than it takes says what the folder is and the command that takes it, instead of calling it damaged:

    jaxtrain step   <run>/checkpoints/<step>/ as Orbax writes it (checkpoint.py): the `state` item, and Orbax's
                    `_CHECKPOINT_METADATA`
    torch           model.safetensors, with optimizer.safetensors and trainer_state.json for a whole training state
                    (torch_format.py): torchref's checkpoints, and what convert to-torch and from-hf write
    hf              Hugging Face's GPT-2 folder (hf_format.py): config.json beside a model.safetensors whose
                    attention weight is laid out as HF's Conv1D keeps it, (d, 3d), the transpose of nanoGPT's Linear
                    (from-hf keeps config.json beside nanoGPT's layout: a torch folder), or beside the shards a
                    model.safetensors.index.json maps
    jaxtrain run,   a run folder whose newest checkpoints/<step>/ is a jaxtrain step, or a torch folder
    torchref run

Pure Python (no jax, no torch): both backends and the converter ask it.
"""

import json
import math
import os
import re

from etils import epath
from safetensors import SafetensorError, safe_open

from jaxtrain import runfolder
from jaxtrain.errors import UserError

MODEL, OPTIMIZER, TRAINER_STATE = "model.safetensors", "optimizer.safetensors", "trainer_state.json"
FORMAT = "jaxtrain-torch/1"  # trainer_state.json's "format"
HF_CONFIG, C_ATTN = "config.json", "attn.c_attn.weight"
HF_SHARD_INDEX = "model.safetensors.index.json"  # a sharded HF save's: tensor name -> the file holding it
WTE, WPE = "transformer.wte.weight", "transformer.wpe.weight"  # rows: vocab size, seq_len, whatever a config says
JAXTRAIN_STEP, TORCH, HF = "jaxtrain step", "torch", "hf"
JAXTRAIN_RUN, TORCHREF_RUN = "jaxtrain run", "torchref run"
# The names whose presence makes a folder a step of each format.
MARKERS = {JAXTRAIN_STEP: ("state", "_CHECKPOINT_METADATA"), TORCH: (TRAINER_STATE, MODEL, OPTIMIZER)}
_RUN_OF = {JAXTRAIN_STEP: JAXTRAIN_RUN, TORCH: TORCHREF_RUN}


def kind(path: str) -> str | None:
    """The kind of the folder `path` (local, or in a bucket whose store answers: runfolder.check_readable); None when
    it is none of them, or not a folder."""
    if not is_folder(path):
        return None
    if _exists(os.path.join(path, HF_CONFIG)) and _hf_weights(path):
        return HF
    for step_kind, names in MARKERS.items():
        if any(_exists(os.path.join(path, name)) for name in names):
            return step_kind
    step = newest_step(path)
    return _RUN_OF.get(kind(step)) if step else None


def is_folder(path: str) -> bool:
    """os.path.isdir, for a folder in a bucket too (epath: gs://, s3://)."""
    return epath.Path(path).is_dir() if runfolder.is_url(path) else os.path.isdir(path)


def _exists(path: str) -> bool:
    return epath.Path(path).exists() if runfolder.is_url(path) else os.path.exists(path)


def holds_training_state(path: str) -> bool:
    """Whether a torch-format folder holds a whole training state (optimizer and trainer state), not weights alone:
    what convert from-torch resumes, and what init.from continues from in both backends."""
    return all(os.path.exists(os.path.join(path, f)) for f in (OPTIMIZER, TRAINER_STATE))


class DamagedTrainerState(UserError):
    """trainer_state.json unreadable, or a field it lacks or holds wrong: `problem` says which, the message adds the
    fix for a folder convert wrote or copied (torchref's own checkpoints take another: torchref/checkpoint.py)."""

    def __init__(self, problem: str, fix: str = "the file is damaged, re-export the checkpoint"):
        super().__init__(f"{problem}; {fix}")
        self.problem = problem


def read_trainer_state(path: str) -> dict:
    """trainer_state.json of the torch-format folder `path`, checked for every field either backend reads, so that
    a damaged one is one DamagedTrainerState in both, not a KeyError where the field is first used."""
    file = os.path.join(path, TRAINER_STATE)
    try:
        with open(file, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise DamagedTrainerState(f"{file} is missing or not valid JSON ({e})", f"re-export the checkpoint, or "
                                  f"delete {OPTIMIZER} next to it to load the weights alone") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise DamagedTrainerState(f"{file} is not a {FORMAT} trainer state (format {found!r})",
                                  "point at a torch-format folder")
    for key, (kind, words) in {"step": (int, "an integer from 0 to 2^31 - 1"), "tied_embeddings": (bool, "a boolean"),
                               "data": (dict, "an object"), "config": (dict, "an object")}.items():
        if not isinstance(state.get(key), kind) or (key == "step" and not (_is_int(state[key]) and  # int32 steps
                                                                            0 <= state[key] < 2**31)):
            _damaged(file, key, f"missing or not {words}", state.get(key))
    data, step = state["data"], state["step"]
    if not _is_int(data.get("seed")):
        _damaged(file, "data.seed", "missing or not an integer", data.get("seed"))
    if data.get("tokens") is not None and not (_is_int(data["tokens"]) and data["tokens"] >= 0):
        _damaged(file, "data.tokens", "not an integer >= 0", data["tokens"])
    if not (_is_int(state.get("skipped", 0)) and 0 <= state.get("skipped", 0) <= step):
        _damaged(file, "skipped", f"not an integer from 0 to step ({step})", state.get("skipped"))
    rng = state.get("rng") or {}  # torchref's RNG states, base64; null in jaxtrain's exports
    if not isinstance(rng, dict) or any(not isinstance(rng.get(k), (str, type(None))) for k in ("torch", "cuda")):
        _damaged(file, "rng", "not {torch: <base64> or null, cuda: <base64> or null}", state.get("rng"))
    _check_loss_scale(file, state.get("loss_scale"))
    return state


def _check_loss_scale(file: str, scaler) -> None:
    """fp16 runs' GradScaler state, {scale, growth_tracker}; null or absent otherwise."""
    if scaler is None:
        return
    scale = scaler.get("scale") if isinstance(scaler, dict) else None
    tracker = scaler.get("growth_tracker") if isinstance(scaler, dict) else None
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0
            and _is_int(tracker) and tracker >= 0):
        _damaged(file, "loss_scale", "not {scale: a finite number > 0, growth_tracker: an integer >= 0}", scaler)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _damaged(file: str, key: str, problem: str, found) -> None:
    raise DamagedTrainerState(f"{file}: {key!r} is {problem} (got {found!r})")


def _hf_weights(path: str) -> bool:
    """Whether the folder's model.safetensors is in HF's layout (_conv1d_layout), or, with none, a sharded save's
    index maps its tensors (transformers reads model.safetensors where both are, and so does from-hf)."""
    model, index = os.path.join(path, MODEL), os.path.join(path, HF_SHARD_INDEX)
    return bool(_conv1d_layout(model)) if _exists(model) else _exists(index)


def _conv1d_layout(file: str) -> bool | None:
    """Whether `file` holds the first attention weight as HF's Conv1D, (d, 3d); None where it cannot be read (the
    loader names that)."""
    try:
        with safe_open(file, framework="np") as f:
            shapes = [f.get_slice(name).get_shape() for name in f.keys() if name.endswith(C_ATTN)]
    except (OSError, SafetensorError):
        return None
    return bool(shapes) and len(shapes[0]) == 2 and shapes[0][1] == 3 * shapes[0][0] > 0


def newest_step(run_dir: str) -> str | None:
    """The step folder of run_dir's checkpoints with the highest step number, or None."""
    root = os.path.join(run_dir, "checkpoints")
    steps = _step_names(root)
    return os.path.join(root, steps[-1]) if steps else None


def _step_names(root: str) -> list[str]:
    """The names of the step folders under a run's checkpoints folder `root`, in step order; none where it is no
    folder or cannot be listed."""
    try:
        names = [p.name for p in epath.Path(root).iterdir()] if runfolder.is_url(root) else os.listdir(root)
    except OSError:  # none, not a folder, or not this user's to list
        return []
    return sorted((n for n in names if n.isdigit()), key=int)


def _run_of(step_dir: str) -> str:
    """The run folder of a step folder <run>/checkpoints/<step>."""
    parent, _ = runfolder.parent_and_name(step_dir if runfolder.is_url(step_dir) else os.path.abspath(step_dir))
    run, name = runfolder.parent_and_name(parent)
    return run if name == "checkpoints" else "<its run folder>"


def _convert_first(step_dir: str) -> str:
    return (f"to start another run from it, convert it first: python -m jaxtrain.convert to-torch {step_dir} DST, "
            f"then --init.from=DST")


def check_torch_source(path: str, flag: str) -> None:
    """UserError unless `path`, given as `flag` (init.from, SRC), is a torch-format folder: otherwise one line says
    what it is and the command that takes it."""
    if not os.path.isdir(path):
        raise UserError(f"{flag}={path!r} {'is a file' if os.path.exists(path) else 'does not exist'}; point it at "
                        f"a torch-format checkpoint folder (one holding {MODEL})")
    found = kind(path)
    if found == TORCH:
        return
    step = newest_step(path)
    what = {
        JAXTRAIN_STEP: f"is a jaxtrain checkpoint (an Orbax step folder), not a torch-format one: jaxtrain.run "
                       f"resumes it with --run.out_dir={_run_of(path)}; {_convert_first(path)}",
        JAXTRAIN_RUN: f"is a jaxtrain run folder (Orbax checkpoints), not a torch-format checkpoint: jaxtrain.run "
                      f"resumes it with --run.out_dir={path}; {_convert_first(step)}",
        TORCHREF_RUN: f"is a torchref run folder, not a checkpoint; point {flag} at one of its checkpoints, e.g. "
                      f"{step}",
        HF: f"is a Hugging Face GPT-2 folder (its Conv1D weights are laid out (in, out)), not a torch-format "
            f"checkpoint; convert it first: python -m jaxtrain.convert from-hf {path} DST, then --init.from=DST",
        None: f"holds no checkpoint (no {MODEL}); point it at a torch-format checkpoint folder",
    }
    raise UserError(f"{flag}={path!r} {what[found]}")


def check_jaxtrain_step(path: str, command: str) -> None:
    """UserError unless `path` is a jaxtrain step folder named by its step (Orbax finds a step by its folder's
    name), given as `command`'s SRC (to-torch; to-hf, which takes a torch-format folder itself; sample's and
    evaluate's --from, which check the other kinds themselves): otherwise one line says what it is and what to pass
    instead."""
    reads_from = command in ("sample", "evaluate")
    given_as, verb = (f"{command} --from", command) if reads_from else (f"{command} SRC", "convert")
    if runfolder.is_url(path):
        runfolder.check_readable(path, given_as)
    found, name = kind(path), runfolder.parent_and_name(path)[1]
    if found == JAXTRAIN_STEP and name.isdigit():
        return
    step = newest_step(path)
    renamed = (f"is a jaxtrain step folder renamed {name!r}; Orbax finds a step by its folder's name: give it back "
               f"its step number (as in <run>/checkpoints/400)")
    if re.fullmatch(r"\d+\.orbax-checkpoint-tmp(-\d+)?", name):  # Orbax writes a step here, then renames it
        complete = newest_step(_run_of(path))
        renamed = (f"is a save that did not finish (its run stopped while writing it; the run's next start removes "
                   f"it); {verb} a complete step folder of the run"
                   f"{f', e.g. {complete}' if complete else ''}")
    what = {
        JAXTRAIN_STEP: renamed,
        JAXTRAIN_RUN: f"is a jaxtrain run folder; pass one of its step folders, e.g. {step}",
        TORCH: "is a torch-format checkpoint already: torchref and --init.from take it as it is",
        TORCHREF_RUN: f"is a torchref run folder, whose checkpoints are torch-format already, e.g. {step}",
        HF: f"is a Hugging Face GPT-2 folder; python -m jaxtrain.convert from-hf {path} DST makes a torch-format "
            f"checkpoint of it",
        None: f"{'is not a jaxtrain checkpoint step folder' if _exists(path) else 'does not exist'}; pass "
              f"one like out/tiny/checkpoints/400 (a folder named by its step, holding `state` and `meta`)",
    }
    # A step its run no longer holds, or the run's checkpoints/ itself: the steps it holds, by name
    listed = name == "checkpoints"
    root = os.path.join(*runfolder.parent_and_name(path)) if listed else os.path.join(_run_of(path), "checkpoints")
    held = _step_names(root)
    if found is None and held and listed:
        what[None] = (f"is a run's checkpoints folder, holding steps {_listing(held)}; pass one of those, e.g. "
                      f"{os.path.join(root, held[-1])}")
    elif found is None and held and not _exists(path):
        what[None] = (f"does not exist: its run holds steps {_listing(held)} (a step is kept once saved, until "
                      f"checkpoint.max_to_keep rotates it out); pass one of those")
    if command == "to-hf":
        what[TORCHREF_RUN] = f"is a torchref run folder; pass one of its checkpoints, e.g. {step}"
        what[HF] = "is a Hugging Face GPT-2 folder already"
    raise UserError(f"{given_as} {path} {_local_only(path, found) or what[found]}")


_LOCAL_KINDS = {TORCH: "a torch-format checkpoint", HF: "a Hugging Face GPT-2 folder", TORCHREF_RUN: "a torchref run"}


def _local_only(path: str, found: str | None) -> str | None:
    """What a folder in a bucket of a kind read from a local disk only is, and the copy to make; None otherwise."""
    if not runfolder.is_url(path) or found not in _LOCAL_KINDS:
        return None
    return (f"is {_LOCAL_KINDS[found]}, which is read from a local disk only (from a bucket, a jaxtrain run and its "
            f"step folders are): copy it here first (gcloud storage cp -r)")


def _listing(steps: list[str]) -> str:
    """Step names for a message: all of up to eight, else the first and last three and how many."""
    if len(steps) <= 8:
        return ", ".join(steps)
    return f"{', '.join(steps[:3])}, ..., {', '.join(steps[-3:])} ({len(steps)} steps)"


def check_hf_source(path: str) -> None:
    """UserError unless `path`, from-hf's SRC, is a Hugging Face GPT-2 folder, or may be one that the reader
    explains (config.json beside weights in another file, or beside a model.safetensors that cannot be read, which
    would otherwise be told a torch-format folder): a torch-format folder, from-hf's own output among them, would
    have its weights transposed a second time."""
    found = kind(path)
    unreadable = found == TORCH and _conv1d_layout(os.path.join(path, MODEL)) is None  # HF's layout, or nanoGPT's?
    if found == HF or ((found is None or unreadable) and os.path.exists(os.path.join(path, HF_CONFIG))):
        return
    step = newest_step(path)
    what = {
        TORCH: "is a torch-format checkpoint (nanoGPT's layout, as from-hf writes it) already: --init.from takes it "
               "as it is, and to-hf makes a Hugging Face folder of it",
        JAXTRAIN_STEP: f"is a jaxtrain checkpoint; python -m jaxtrain.convert to-hf {path} DST makes a Hugging Face "
                       f"folder of it",
        JAXTRAIN_RUN: f"is a jaxtrain run folder; python -m jaxtrain.convert to-hf {step} DST makes a Hugging Face "
                      f"folder of its newest checkpoint",
        TORCHREF_RUN: f"is a torchref run folder, whose checkpoints are torch-format already, e.g. {step}",
        None: f"{_missing(path, 'holds no Hugging Face GPT-2 model')}; point it at a folder that "
              f"GPT2LMHeadModel.save_pretrained wrote ({HF_CONFIG}, {MODEL})",
    }
    raise UserError(f"from-hf SRC {path} {what[found]}")


def check_model_source(path: str, command: str) -> str:
    """The kind of `path`, the --from of `command` (sample, evaluate), where it is one they read: a jaxtrain step, a
    Hugging Face folder (or config.json beside weights the reader explains), a torch-format folder whose
    trainer_state.json or config.json (from-hf's) says its model; else a UserError saying what it is and what to
    pass instead."""
    found = kind(path)
    if found == TORCH and _hf_trainer_checkpoint(path):
        return HF  # whose reader names what it cannot read (a pytorch_model.bin)
    if found == JAXTRAIN_STEP:
        check_jaxtrain_step(path, command)  # named by its step, as Orbax reads it
    said = [name for name in (TRAINER_STATE, HF_CONFIG) if os.path.exists(os.path.join(path, name))]
    if found in (JAXTRAIN_STEP, HF) or (found == TORCH and said):
        return found
    if found is None and said == [HF_CONFIG]:
        return HF
    step = newest_step(path)
    what = {
        TORCH: f"holds weights alone, with neither {TRAINER_STATE} (a checkpoint's, which holds its config) nor "
               f"{HF_CONFIG} (from-hf's) to say the model's shape; {command} the folder the weights came from",
        JAXTRAIN_RUN: f"is a jaxtrain run folder; {command} it with --run {path} (its newest checkpoint, or --step)",
        TORCHREF_RUN: f"is a torchref run folder, not a checkpoint; pass one of its checkpoints, e.g. --from {step}",
        None: f"{_missing(path, 'holds no model')}; pass a Hugging Face GPT-2 folder, a torch-format checkpoint or "
              f"a jaxtrain step folder (or a jaxtrain run with --run)",
    }
    raise UserError(f"--from {path} {what[found]}")


def _hf_trainer_checkpoint(path: str) -> bool:
    """Whether `path` holds config.json beside a trainer_state.json that is HF Trainer's, not jaxtrain's format: a
    Trainer's checkpoint-N/ (one of safetensors in HF's layout is HF to kind() already)."""
    if not os.path.exists(os.path.join(path, HF_CONFIG)):
        return False
    try:
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):  # damaged: read_trainer_state says so
        return False
    return not (isinstance(state, dict) and state.get("format") == FORMAT)


def _missing(path: str, otherwise: str) -> str:
    return "does not exist" if not os.path.exists(path) else "is a file" if not os.path.isdir(path) else otherwise


def check_jaxtrain_run(path: str, flag: str) -> None:
    """A torchref run, a torch-format or Hugging Face folder or a jaxtrain step folder, given as `flag` where a
    jaxtrain run folder goes (jaxtrain.sample's --run), is named, with the command that takes it; others are the
    caller's."""
    if runfolder.is_url(path):
        runfolder.check_readable(path, flag)
    found = kind(path)
    if local_only := _local_only(path, found):
        raise UserError(f"{flag} {path} {local_only}")
    what = {
        TORCHREF_RUN: f"is a torchref run folder (torch-format checkpoints); convert its checkpoint into a jaxtrain "
                      f"run first: python -m jaxtrain.convert from-torch {newest_step(path)} DST, then {flag} DST",
        TORCH: f"is a torch-format checkpoint; convert it into a jaxtrain run first: python -m jaxtrain.convert "
               f"from-torch {path} DST, then {flag} DST" if holds_training_state(path) else
               f"is a torch-format folder of weights alone, not a run; start a run from them: python -m jaxtrain.run "
               f"--config CONFIG --init.from={path}, then {flag} that run's folder",
        HF: f"is a Hugging Face GPT-2 folder, not a run; convert it (python -m jaxtrain.convert from-hf {path} DST) "
            f"and start a run from it (python -m jaxtrain.run --config CONFIG --init.from=DST), then {flag} that "
            f"run's folder",
        JAXTRAIN_STEP: f"is a checkpoint step folder, not a run folder; pass {flag} {_run_of(path)} --step "
                       f"{runfolder.parent_and_name(path)[1]}",
    }
    if found in what:
        raise UserError(f"{flag} {path} {what[found]}")


def other_step_held(held, step: int, where: str) -> str | None:
    """Where the step folder `where`, named `step`, holds another step (`held`, what its own record says), what
    both backends say of it: a copy or a backup under another step's name, which, resumed as its name, trained on
    from its own step and collided with the saves it made, and sampled or converted was labelled a step it is not.
    None where they agree (or the record names none)."""
    if held is None or held == step:
        return None
    return (f"checkpoint {where} holds step {held}, not the step its folder is named for (a copy or a backup put "
            f"there?)")


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
