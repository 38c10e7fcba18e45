"""The command line, `--config FILE.yaml [--section.key=value ...]`, read into one raw mapping of sections: the YAML
file's, each override parsed as a YAML value (a text key's kept as typed) in place of its key's value. Malformed
flags, files that are not UTF-8 and YAML errors become one-line `UserError`s; config.load checks the keys and values
that come out. `usage` is the --help that lists them. Pure Python: torchref imports jaxtrain.config, which imports
this module.
"""

import argparse
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import sys
import tokenize

import yaml

from jaxtrain import runfolder
from jaxtrain.errors import UserError, quiet_logger


# For tools that hand the flags they do not know to config.load (argparse's parse_known_args: the benchmarks), whose
# --help lists only their own flags: what else they take, in words.
CONFIG_FLAGS_HELP = """the run's config, read as python -m jaxtrain.run reads it (every other flag goes to it):
  --config FILE.yaml    the YAML file, e.g. configs/small.yaml (default: the built-in defaults)
  --section.key=VALUE   overrides of its keys, e.g. --optim.grad_accum_steps=4
                        (every key, with its default: python -m jaxtrain.run --help)"""


def yaml_name(field) -> str:
    """How YAML and the command line spell a config dataclass field: its name, unless its metadata gives another
    (`init.from`, whose field is `from_` because `from` is a Python keyword)."""
    return field.metadata.get("yaml", field.name)


def read(argv: list[str], text_keys: frozenset[str] = frozenset()) -> dict:
    """{section: {key: value}} from `--config PATH` and the overrides, which win. One command line reads one YAML
    file: a second --config is refused, not read over the first (which would drop the first's keys unsaid).
    An override replaces its key's whole value (`--optim.groups={}` leaves no group of the file's). `text_keys`
    ("run.out_dir", ...): the keys that hold free text, whose unquoted overrides are kept as typed."""
    args = _split_args(argv)
    path = one_config([value for key, value in args if key == "config"])
    raw = _read_yaml(path) if path is not None else {}
    raw = {section: {} if values is None else values for section, values in raw.items()}  # `optim:`, keys commented
    for section, values in _parse_overrides([(k, v) for k, v in args if k != "config"], text_keys).items():
        raw.setdefault(section, {})
        if isinstance(raw[section], dict):  # else config.from_dict refuses the file's section, not a mapping
            raw[section].update(values)
    return raw


def usage(config_cls) -> str:
    """--help: every key of `config_cls` (jaxtrain.config.Config) with its default and the comment beside it in
    config.py."""
    script = os.path.abspath(sys.argv[0])  # python -m jaxtrain.run or torchref.run
    prog = f"python -m {os.path.basename(os.path.dirname(script))}.{os.path.splitext(os.path.basename(script))[0]}"
    lines = [f"usage: {prog} [--config FILE.yaml] [--section.key=VALUE ...]", "",
             "One config (configs/ holds the recipes, e.g. configs/tiny.yaml); without one, the defaults below.",
             "Keys (YAML sections; the same names override on the command line):"]
    for section in dataclasses.fields(config_cls):
        lines.append(f"  {section.name}:")
        comments = _field_comments(section.type)
        for f in dataclasses.fields(section.type):
            name = yaml_name(f)
            default = getattr(section.type(), f.name)
            default = ("null" if default is None else  # as an override spells it, typed in a shell
                       default if not isinstance(default, str) or default.isprintable() else
                       f"'{json.dumps(default)}'")  # YAML's double quotes, whose escapes are JSON's: '"\n"'
            lines.append(f"    {f'--{section.name}.{name}={default}':<34} {comments.get(f.name, '')}".rstrip())
    return "\n".join(lines)


def _field_comments(cls) -> dict[str, str]:
    """Field name -> what its source comment says: the comment after it on its line, else the comment lines above
    it, which also speak for the uncommented fields right after it (train.loss_scale_init and its growth interval).
    draccus's reader passes over a comment above, and over any field whose type holds quotes (Literal choices)."""
    lines = inspect.getsource(cls).splitlines(keepends=True)
    comment_at = {token.start[0] - 1: token.string.lstrip("#").strip()
                  for token in tokenize.generate_tokens(iter(lines).__next__) if token.type == tokenize.COMMENT}
    comments, above, in_block = {}, [], False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#"):
            above, in_block = (above if in_block else []) + [comment_at[i]], True
            continue
        in_block, field = False, re.match(r"\s+(\w+)\s*:", line)
        if field:
            comments[field.group(1)] = comment_at.get(i) or " ".join(above)
        if not field or i in comment_at:
            above = []
    return comments


def one_config(paths: list[str]) -> str | None:
    """The one --config of a command line (None: none given); a second is refused, not read over the first (which
    would drop the first's keys unsaid)."""
    if len(paths) > 1:
        raise UserError(f"--config is given {len(paths)} times ({', '.join(map(repr, paths))}) but a run reads one "
                        f"YAML file; merge them into one file, or give the later file's keys as "
                        f"--section.key=value overrides")
    return paths[0] if paths else None


def given(argv: list[str], key: str) -> str | None:
    """The value given last for `--key` ("config", "run.out_dir"), as written; None when it was not given."""
    values = [value for k, value in _split_args(argv) if k == key]
    return values[-1] if values else None


def _read_yaml(path: str) -> dict:
    """A local file, or a run folder's config.yaml in an object store (gs://...: what a stopped run's resume
    hint names)."""
    runfolder.check_given(path, "--config", "a YAML file (see configs/)")
    path = path if runfolder.is_url(path) else os.path.expanduser(path)  # --config=~/x.yaml: no shell expands it
    try:
        with quiet_logger("gcsfs", logging.CRITICAL):  # its tracebacks of each request it gave up on
            data = runfolder.path(path).read_bytes()
    except IsADirectoryError:
        raise UserError(f"--config {path!r} is a folder; pass a YAML file (see configs/)") from None
    except FileNotFoundError:
        raise UserError(f"config file {path!r} not found; pass an existing YAML file to --config (see "
                        f"configs/)") from None
    except OSError as e:  # a bucket this machine cannot reach (gcsfs's retries ended), or a file it may not read
        raise UserError(f"config file {path!r} could not be read ({type(e).__name__}: {e}); check the network to "
                        f"it and the permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"config file {path!r} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                        f"save it as UTF-8") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except (yaml.YAMLError, RecursionError) as e:
        raise UserError(f"config file {path!r} is not valid YAML: {_yaml_problem(e)}; fix that line") from None
    if not isinstance(raw, dict):
        raise UserError(f"config file {path!r} must hold a mapping of sections (run:, model:, ...)")
    return raw


class ReadOtherwise(int):
    """An integer YAML 1.1 read from text most readers take for another number: a leading 0 (octal: 010 is 8) or
    colons (base 60: 1:30 is 90). config refuses it for a number key, naming what YAML made of it (`text`)."""
    text: str

    def __new__(cls, value: int, text: str):
        number = super().__new__(cls, value)
        number.text = text
        return number

    def __reduce__(self):  # copy.deepcopy of the raw config keeps the mark
        return ReadOtherwise, (int(self), self.text)


class _NumberLoader(yaml.SafeLoader):
    """PyYAML's safe loader, its octal and base-60 integers marked (ReadOtherwise)."""

    def construct_yaml_int(self, node):
        value = super().construct_yaml_int(node)
        digits = str(node.value).replace("_", "")
        return ReadOtherwise(value, node.value) if re.fullmatch(r"[-+]?0[0-7]+", digits) or ":" in digits else value


_NumberLoader.add_constructor("tag:yaml.org,2002:int", _NumberLoader.construct_yaml_int)


class _UniqueKeyLoader(_NumberLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last, so a section written
    twice would lose the first one's keys unsaid (their defaults would train)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key (a list): the base loader refuses it, below
                    break
                if repeated:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping (YAML would keep only the last: "
                        f"merge the two)", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_problem(e: Exception) -> str:
    """PyYAML's message, which spans several lines, as one: the problem and where it is."""
    if isinstance(e, RecursionError):
        return "lists or mappings nested too deeply"
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return " ".join(str(getattr(e, "problem", None) or e).split()) + where


# An override names one key of one section: the config has no deeper nesting.
_OVERRIDE_KEY = re.compile(r"[A-Za-z_]\w*\.[A-Za-z_]\w*")


def _split_args(argv: list[str]) -> list[tuple[str, str]]:
    """`--key=value` or `--key value` -> (key, value) pairs, in order, values as written."""
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise UserError(f"unexpected argument {arg!r}; overrides look like --section.key=value")
        key, eq, value = arg[2:].partition("=")
        if key != "config" and not _OVERRIDE_KEY.fullmatch(key):  # a mistyped flag too: say what flags look like
            raise UserError(f"malformed argument {arg!r}; overrides look like --section.key=value "
                            f"(e.g. --optim.lr=3e-4), and the YAML file comes with --config FILE")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise UserError(f"{arg!r} has no value; write {arg}=VALUE")
            value, i = argv[i + 1], i + 1
        pairs.append((key, value))
        i += 1
    return pairs


def _parse_overrides(pairs: list[tuple[str, str]], text_keys: frozenset[str]) -> dict:
    """[('optim.lr', '3e-4')] -> {'optim': {'lr': 3e-4}}; values are parsed as YAML scalars."""
    tree = {}
    for key, value in pairs:
        section, name = key.split(".")
        tree.setdefault(section, {})[name] = _override_value(key, value, key in text_keys)
    return tree


def _override_value(key: str, value: str, text_key: bool):
    """The value as YAML reads it, except text: unquoted text is kept as typed, since YAML would strip the blanks
    around it (`--log.sample_prompt="def "` continues "def ", space included) and read a blank value, or one that
    starts a comment (`--log.sample_prompt="# "`), as null (a silent default for data.path). For a key that holds
    text (`text_key`) that is any unquoted scalar but null: YAML would read `--run.out_dir=017` as the number 15,
    and `12:30` as 750, so the run would write elsewhere unsaid; a lone ~ is the home folder there, not YAML's null.
    A list or a mapping stays YAML's, which config.load refuses for a text key.
    Quoted text is YAML's: `--run.out_dir="'yes'"` is the text yes."""
    if not value.strip() or value.lstrip().startswith("#"):
        return value
    quoted = value.lstrip().startswith(("'", '"'))
    try:
        parsed = yaml.load(value, Loader=_NumberLoader)
    except (yaml.YAMLError, RecursionError) as e:
        if text_key and not quoted:  # text that holds YAML syntax: `--log.sample_prompt=def f(x): [`
            return value
        raise UserError(f"--{key}={value!r} is not a valid YAML value ({_yaml_problem(e)}); quote a text "
                        f"value that holds YAML syntax: --{key}='\"...\"'") from None
    scalar = not isinstance(parsed, (list, dict)) and (parsed is not None or value.strip() == "~")
    return value if not quoted and (isinstance(parsed, str) or (text_key and scalar)) else parsed


# argparse types for the tools' own flags (benchmarks, the parity report): a bad value ends in argparse's usage
# line and one error line, exit code 2, before anything runs.

def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (a peak FLOP/s, a rate): nan, inf and what is not a number are refused."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0")
    return value


def output_file(text: str) -> str:
    """A file a tool will write when it is done: refused now, not after an hour, where it cannot be."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        problem = "is a folder"
    elif not os.path.isdir(folder):
        problem = f"is in {folder}, which is not a folder"
    else:
        problem = runfolder.unwritable(folder)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; choose another file")
    return text


def output_folder(text: str) -> str:
    """A folder a tool will create (or add to): it must be one, or be creatable (runfolder.unwritable)."""
    problem = runfolder.unwritable(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; choose another folder")
    return text
