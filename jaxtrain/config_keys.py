"""A config mapping's keys and values checked before draccus decodes it (config.from_dict): unknown keys named with
the key meant, and each value of a kind its field takes. draccus would pass null into any field, read a boolean as
a number and turn a list or a mapping into a path string."""

import dataclasses
import difflib
import typing
from typing import Optional

from jaxtrain import cmdline
from jaxtrain.errors import UserError


def check(raw: dict, config_cls) -> None:
    """`raw` (YAML names) against `config_cls` (config.Config): a UserError naming the first key or value wrong."""
    _check_keys(raw, config_cls, (), {f.name: f.type for f in dataclasses.fields(config_cls)})


def _check_keys(raw: dict, cls, prefix: tuple, sections: dict) -> None:
    """Unknown keys name themselves and the closest valid key; `sections`: the config's, by name."""
    names = {cmdline.yaml_name(f): f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        dotted = ".".join(prefix + (str(key),))
        if key not in names:
            hint = _hint(str(key), list(names), prefix, sections)
            if ":" in str(key):  # {lr_scale:0.5} is one key to YAML: a flow mapping's colon needs a space after it
                hint += f" (YAML reads {key!r} as one key: write a space after the colon, as in {{lr_scale: 0.5}})"
            raise UserError(f"unknown config key {dotted!r}; {hint}")
        field_type = names[key].type
        if typing.get_origin(field_type) is dict:
            _check_mapping(dotted, value, typing.get_args(field_type)[1], sections)
        elif not dataclasses.is_dataclass(field_type):
            _check_scalar(dotted, value, field_type)
        elif not isinstance(value, dict):
            raise UserError(f"config section {dotted!r} must be a mapping of keys, got {value!r}")
        else:
            _check_keys(value, field_type, prefix + (str(key),), sections)


# Other trainers' names for keys of ours (nanoGPT's train.py, Hugging Face's TrainingArguments): `unknown config key`
# names ours
OTHER_NAMES = {"block_size": "model.seq_len", "n_embd": "model.d_model", "learning_rate": "optim.lr",
               "gradient_accumulation_steps": "optim.grad_accum_steps", "max_iters": "train.steps",
               "max_steps": "train.steps", "eval_interval": "train.eval_every", "eval_steps": "train.eval_every",
               "eval_iters": "train.eval_batches", "warmup_iters": "optim.warmup_steps",
               "lr_decay_iters": "optim.decay_steps", "grad_clip": "optim.max_grad_norm",
               "max_grad_norm": "optim.max_grad_norm", "beta1": "optim.b1", "beta2": "optim.b2",
               "dtype": "train.precision", "output_dir": "run.out_dir", "save_steps": "checkpoint.every",
               "logging_steps": "log.every", "per_device_train_batch_size": "data.batch_size"}


def _hint(key: str, names: list[str], prefix: tuple, sections: dict) -> str:
    """What an unknown `key` of section `prefix` (whose keys are `names`; () the sections) may have meant: the key
    of that name in another section (--log.eval_every: train.eval_every; a section-less `seq_len:` in YAML), the key
    another trainer's name stands for (--model.block_size: model.seq_len), a key of the section spelled alike, of
    any section spelled alike; else the section's keys."""
    top = not prefix or len(prefix) == 1 and prefix[0] in sections  # (not an optim.groups entry's keys)
    dotted = [f"{s}.{cmdline.yaml_name(f)}" for s, c in sections.items() for f in dataclasses.fields(c)] * top
    elsewhere = [name for name in dotted if name.split(".")[1] == key] + ([OTHER_NAMES[key]] if top and key in
                                                                            OTHER_NAMES else [])
    close = difflib.get_close_matches(key, names, n=1)
    close_anywhere = difflib.get_close_matches(key, [name.split(".")[1] for name in dotted], n=1)
    if elsewhere:
        return f"did you mean {elsewhere[0]}?"
    if close:
        return f"did you mean {'.'.join(prefix + (close[0],))}?"
    if close_anywhere:
        return f"did you mean {next(name for name in dotted if name.endswith('.' + close_anywhere[0]))}?"
    return f"valid keys: {', '.join(names)}"


def _check_mapping(key: str, value, entry_type, sections: dict) -> None:
    """A mapping of text -> `entry_type` sections (optim.groups: pattern -> {lr_scale, weight_decay})."""
    if not isinstance(value, dict):
        raise UserError(f"{key} must be a mapping, e.g. {{'wte|wpe': {{lr_scale: 0.1}}}}, got {value!r}")
    for name, entry in value.items():
        if not isinstance(name, str):
            raise UserError(f"{key}: the key {name!r} must be text (quote it)")
        if not isinstance(entry, dict):
            raise UserError(f"{key}[{name!r}] must be a mapping of keys, got {entry!r}")
        _check_keys(entry, entry_type, (f"{key}[{name!r}]",), sections)


TEXT_TYPES = (str, Optional[str])


def _check_scalar(key: str, value, field_type) -> None:
    """One plain value of a kind the field takes. draccus would pass null into any field, read a boolean as a
    number and turn a list or a mapping into a path string, so these are refused before it sees them."""
    if value is None:
        if type(None) not in typing.get_args(field_type):
            raise UserError(f"{key} cannot be null; give it a value (see --help for its default)")
    elif not isinstance(value, (str, int, float)):
        raise UserError(f"{key} takes a single value, got {value!r}; quote it if you mean text")
    elif isinstance(value, bool) and bool not in (field_type, *typing.get_args(field_type)):
        raise UserError(f"{key} got the boolean {str(value).lower()} (YAML reads true/false/yes/no/on/off as "
                        f"booleans); give a {_type_name(field_type)} (quoted, if you mean that text)")
    elif isinstance(value, cmdline.ReadOtherwise) and field_type not in TEXT_TYPES:
        raise UserError(f"{key}={value.text} reads as {int(value)} in YAML (a leading 0 makes a number octal, colons "
                        f"base 60); write the number without them")
    elif field_type in TEXT_TYPES and not isinstance(value, str):  # the command line keeps text as typed
        raise UserError(f"{key} takes text, but the YAML file's value reads as the number {value!r} (YAML reads "
                        f"017 as 15, 1_000 as 1000, 12:30 as 750); quote it there to keep it as written")


def _type_name(field_type) -> str:
    words = {str: "text", int: "whole number", float: "number", bool: "boolean"}
    kinds = typing.get_args(field_type) or (field_type,)
    return " or ".join(words.get(t, repr(t)) for t in kinds if t is not type(None))
