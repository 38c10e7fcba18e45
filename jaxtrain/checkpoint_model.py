"""Which model a torch-format checkpoint holds, told from its tensors' names and shapes, and from its config files
where the tensors cannot say (the head count, the GELU): the model.* flags a config of another shape needs
(model_keys_hint), and init.from's refusals before anything is built or read, the same in both backends.

Pure Python (no jax, no torch), as checkpoint_kind.py.
"""

import json
import os
import re

from safetensors import SafetensorError, safe_open

from jaxtrain import config as config_lib
from jaxtrain.checkpoint_kind import HF_CONFIG, MODEL, TRAINER_STATE, WPE, WTE
from jaxtrain.errors import UserError


def model_keys_hint(shapes: dict[str, tuple], model_cfg, config_from: str | None = None) -> str:
    """What to set, for a torch-format checkpoint whose tensors (`shapes`: name -> shape, of its model.safetensors)
    do not fit the model config `model_cfg`: the model.* keys its tensors tell (an lm_head tensor: untied
    embeddings; bias tensors, LayerNorms' too: model.bias; wte's and wpe's shapes: vocab_size, d_model, seq_len; the
    blocks: n_layer), each as the flag that sets it; else the model config it was written with. `config_from`: the
    file model_cfg was read from (the folder's own trainer_state.json, in a conversion or a resume), where no flag
    could mend it: its files disagree."""
    told = {key: value for key, value in _told_by_tensors(shapes).items() if value != getattr(model_cfg, key)}
    if not told and config_from:
        return (f"it does not hold the model its {config_from} describes (damaged, or copied from another "
                f"checkpoint); copy or convert the whole folder again")
    if not told:
        return (f"set the model.* config to the checkpoint's (its {TRAINER_STATE} holds it, or the {HF_CONFIG} "
                f"that convert from-hf keeps)")
    said = ", ".join(f"model.{key}={_yaml(value)} ({config_from or 'this config'}: {_yaml(getattr(model_cfg, key))})"
                     for key, value in told.items())
    if config_from:
        return (f"the checkpoint's tensors are those of {said}: the folder's files disagree (one copied from "
                f"another checkpoint, or {config_from} edited); copy or convert the whole folder again")
    return f"the checkpoint's tensors are those of {said}; pass {model_flags(told)}"


def model_flags(values: dict) -> str:
    """`--model.key=value` for each model.* value, as the command line takes it (true, not True)."""
    return " ".join(f"--model.{key}={_yaml(value)}" for key, value in values.items())


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _told_by_tensors(shapes: dict[str, tuple]) -> dict:
    """The model.* values a torch-format checkpoint's tensor names and shapes show (n_head is not among them)."""
    told = {"tie_embeddings": not any(name.startswith("lm_head.") for name in shapes),
            "bias": any(name.endswith(".bias") for name in shapes)}
    blocks = {int(m.group(1)) for name in shapes if (m := re.match(r"transformer\.h\.(\d+)\.", name))}
    if blocks:
        told["n_layer"] = max(blocks) + 1
    for name, keys in ((WTE, ("vocab_size", "d_model")), (WPE, ("seq_len", "d_model"))):
        if len(shapes.get(name, ())) == 2:
            told.update(zip(keys, (int(n) for n in shapes[name])))
    return told


def vocab_rows(path: str) -> int:
    """The embedding rows (vocab size) of the torch-format folder `path`, from its model.safetensors' header."""
    file = os.path.join(path, MODEL)
    try:
        with safe_open(file, framework="np") as f:
            shape = f.get_slice(WTE).get_shape()
    except (OSError, SafetensorError) as e:
        raise UserError(f"{file} is missing, unreadable or has no {WTE!r} ({e}); re-export the checkpoint") from None
    if len(shape) != 2:
        raise UserError(f"{file}: {WTE!r} has shape {tuple(shape)}, not (vocab_size, d_model); re-export the "
                        f"checkpoint")
    return shape[0]


def written_config(path: str, trainer_state: dict) -> config_lib.Config:
    """The config of the run whose checkpoint the torch-format folder `path` is (its trainer_state.json, read), with
    model.vocab_size written down from the weights' rows where the run took the data's (its config says null)."""
    cfg = config_lib.from_dict(trainer_state["config"])
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = vocab_rows(path)
    return cfg


def check_vocab_rows(path: str, data) -> None:
    """init.from's embedding must hold a row for each token id of `data` (a data.TokenData): the torch-format folder
    `path` with fewer rows was trained with another tokenizer. Told to pass its vocab size (model_keys_hint), a run
    would refuse that as below the data's next."""
    try:
        rows = vocab_rows(path)
    except UserError:  # unreadable, or without wte: the loader says so, as for any tensor
        return
    if rows < data.vocab_size:
        raise UserError(f"init.from={path!r} has {rows} embedding rows (model.vocab_size={rows}), fewer than the "
                        f"{data.vocab_size} token ids of the data ({data.tokenizer}, {data.path}): it was trained "
                        f"with another tokenizer; fine-tune it on data of its own tokenizer (data.path), or start "
                        f"from a checkpoint of this data's")


# Hugging Face's activation_function names of the GELUs jaxtrain's model computes -> model.gelu_approximate
# (transformers' own default, where config.json names none, is gelu_new; gelu_python is the exact one written out,
# gelu_pytorch_tanh, gelu_python_tanh, gelu_fast and gelu_accurate the same tanh formula with other roundings)
HF_GELUS = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
            "gelu_python_tanh": "tanh", "gelu_fast": "tanh", "gelu_accurate": "tanh"}


def hf_gelu(config: dict) -> str | None:
    """model.gelu_approximate of an HF config.json's activation_function, read as transformers reads it (gelu_new
    where it names none); None where it names no GELU jaxtrain's model computes (or no name at all: a hand edit)."""
    activation = config.get("activation_function", "gelu_new")
    return HF_GELUS.get(activation) if isinstance(activation, str) else None


def check_written(path: str, model_cfg) -> None:
    """The model.* settings a checkpoint's tensors do not show: the head count (c_attn's weight is (3d, d) however d
    is split into heads) and the GELU. Where the torch-format folder `path` (init.from) says what it was trained with
    (its trainer_state.json's config, or the HF config.json that from-hf keeps), each must be the run's
    (`model_cfg`): the same weights split into other heads, or through the other GELU, compute another model."""
    for key, written in _written(path).items():
        if written != getattr(model_cfg, key):
            raise UserError(f"init.from={path!r} was trained with model.{key}={written}, and this run has "
                            f"model.{key}={getattr(model_cfg, key)}: its weights would compute another model; set "
                            f"--model.{key}={written}")


def _written(path: str) -> dict:
    """{"n_head": ..., "gelu_approximate": ...} as the folder's trainer_state.json or config.json states them (each
    where it does: a config.json's as transformers reads it, n_head 12 and gelu_new where it names none); empty where
    neither file does (weights alone), or where it cannot be read (the loader names that). A trainer_state.json from
    before model.gelu_approximate was its default, none."""
    for name in (TRAINER_STATE, HF_CONFIG):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                held = json.load(f)
            said = held["config"]["model"] if name == TRAINER_STATE else held
            n_head = said.get("n_head", 12 if name == HF_CONFIG else None)
            gelu = said.get("gelu_approximate", "none") if name == TRAINER_STATE else hf_gelu(said)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        return {**({"n_head": n_head} if isinstance(n_head, int) and not isinstance(n_head, bool) else {}),
                **({"gelu_approximate": gelu} if gelu in ("none", "tanh") else {})}
    return {}

