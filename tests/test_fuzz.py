"""Bad input, fuzzed: every invalid override, YAML file, data folder or run folder ends in one `error: ...` line that
names the cause (exit 2, no traceback) and leaves what it found as it was; every valid one starts.

Most examples go in-process through what the command lines call before their first array work (config.load,
data.load, run.Trainer: config -> data -> mesh -> resume check), where any exception but UserError fails; a few run
the real `python -m jaxtrain.run` and `python -m torchref.run`. Hypothesis is derandomized and keeps no database, so
CI sees the same examples every run; the session ends by printing how many invalid inputs it generated.
"""

import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import typing

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxtrain import cmdline, config, data, prepare, run, runlock
from jaxtrain.config_checks import INT32_MAX
from jaxtrain.errors import UserError
from jaxtrain.param_groups import ParamGroup

FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
INVALID = collections.Counter()  # generated invalid inputs by kind, recorded per test (report_invalid_count)
INVALID_PROPERTY = "fuzz_invalid_inputs"  # the report property conftest.py sums


@pytest.fixture(autouse=True)
def report_invalid_count(record_property):
    """Each test's generated invalid inputs, by kind, as a property of its report: conftest.py sums them at the end
    (a report reaches the terminal from an xdist worker; a print would not)."""
    before = INVALID.copy()
    yield
    record_property(INVALID_PROPERTY, dict(INVALID - before))


class _Warnings(logging.Handler):
    """Log records of WARNING and above (orbax's absl warnings among them): lines a command line prints on stderr."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def refused(call, kind: str, names: str) -> str:
    """call()'s UserError message: one line that names `names`, and nothing else said on stderr or in the logs on
    the way. Any other exception fails the test as the traceback a user would see."""
    warnings, stderr = _Warnings(), io.StringIO()
    logging.getLogger().addHandler(warnings)
    try:
        with contextlib.redirect_stderr(stderr):
            call()
    except UserError as e:
        message = str(e)
        assert "\n" not in message and "\r" not in message, message
        assert names in message, (names, message)
        assert not warnings.lines and not stderr.getvalue(), (warnings.lines, stderr.getvalue(), message)
        INVALID[kind] += 1
        return message
    finally:
        logging.getLogger().removeHandler(warnings)
    pytest.fail(f"{kind}: accepted an invalid input (expected an error naming {names!r})")


def snapshot(root: str) -> dict:
    """path -> sha256 of every file under root (root itself when a file), None for folders. The run lock's file
    (runlock.NAME) names whichever process took the lock last: the one thing a start may rewrite."""
    if os.path.isfile(root):
        return {root: hashlib.sha256(open(root, "rb").read()).hexdigest()}
    files = {}
    for folder, _, names in os.walk(root):
        files[folder] = None
        files.update({os.path.join(folder, n): hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
                      for n in names if n != runlock.NAME})
    return files


def assert_untouched(before: dict, root: str) -> None:
    after = snapshot(root) if os.path.exists(root) else {}
    assert {path: after.get(path, "gone") for path in before} == before, "a pre-existing file was changed or removed"


# Config overrides --------------------------------------------------------------------------------------------------

FIELDS = {f"{s.name}.{cmdline.yaml_name(f)}": f.type
          for s in dataclasses.fields(config.Config) for f in dataclasses.fields(s.type)}
# Free text (paths, names, the prompt): an unquoted override of one is kept as typed, whatever YAML would read.
TEXT = sorted(k for k, t in FIELDS.items() if t in (str, typing.Optional[str]))
# configs/tiny.yaml has d_model 128, n_head 4, batch_size 32, lr 1e-3, min_lr 1e-4; valid values keep them consistent.
BASE = ["--config", "configs/tiny.yaml", "--train.steps=8", "--optim.warmup_steps=2"]


def _text():
    """Path-like text that YAML reads back as the same string."""
    return st.from_regex(r"[a-z][a-z0-9_/.-]{0,15}", fullmatch=True).filter(lambda s: yaml.safe_load(s) == s)


def _ints(lo, hi):
    return st.integers(lo, hi).map(str)


def _normal(x: float) -> bool:
    """0, or a magnitude float32 holds as a normal number: config_checks refuses a nonzero one below 2**-126, which
    XLA would flush to 0 (tests/test_config.py's property test draws those)."""
    return x == 0 or abs(x) >= 2.0**-126


def _floats(lo, hi, **kw):
    return st.floats(lo, hi, allow_nan=False, **kw).filter(_normal).map(repr)


_BOOL, _NULL = st.sampled_from(["true", "false"]), st.just("null")


@st.composite
def _groups(draw, valid: bool = True) -> str:
    """optim.groups as YAML flow text: patterns (any regular expressions; whether they match the model's names is
    checked where the optimizer is built) -> lr_scale > 0 and weight_decay >= 0 or null. Invalid: one entry
    broken."""
    patterns = draw(st.lists(st.sampled_from(["wte", "wpe|wte", "ln_", "bias$", r"h\.0\.", "c_(fc|proj)"]),
                             max_size=3, unique=True))
    entries = {p: {"lr_scale": draw(st.floats(1e-6, 1e6)),
                   "weight_decay": draw(st.none() | st.floats(0.0, 10.0).filter(_normal))} for p in patterns}
    if not valid:
        pattern = draw(st.sampled_from(["(", "[a-", "*", ""]) | st.just("a"))
        entries[pattern] = ({"lr_scale": 1.0} if pattern != "a" else draw(st.sampled_from([
            {"lr_scale": 0.0}, {"lr_scale": -1.0}, {"lr_scale": float("nan")}, {"lr_scale": float("inf")},
            {"weight_decay": -0.1}, {"weight_decay": float("nan")}, {"lr_scal": 1.0}, {"lr_scale": "x"}])))
    return yaml.safe_dump(entries, default_flow_style=True, width=10**6).strip()
_UNIT = _floats(0.0, 1.0, exclude_max=True)
VALID = {
    "run.out_dir": _text().map(lambda s: f"/nonexistent/{s}") | _text().map(lambda s: f"gs://bucket/{s}"),
    "run.seed": _ints(0, 2**32 - 1), "run.fresh": _BOOL, "run.lock_timeout_s": _floats(1e-3, 1e6),
    "model.vocab_size": _NULL | _ints(1, INT32_MAX), "model.seq_len": _ints(1, INT32_MAX),
    "model.n_layer": _ints(1, INT32_MAX), "model.n_head": st.sampled_from(["1", "2", "4", "8", "32", "128"]),
    "model.d_model": st.integers(1, 2**20).map(lambda k: str(128 * k)), "model.dropout": _UNIT,
    "model.bias": _BOOL, "model.tie_embeddings": _BOOL, "model.attention": st.sampled_from(["auto", "xla"]),
    "model.norm": st.sampled_from(["auto", "xla"]), "model.gelu_grad": st.just("xla"),
    "model.qkv_grad": st.just("xla"),
    "model.remat": st.sampled_from(["none", "full", "dots"]), "model.vocab_tiles": st.just("1"),
    "run.dry_run_devices": _NULL, "run.target_device": _NULL,  # set, they need run.dry_run: OUT_OF_RANGE
    "data.path": _NULL, "data.batch_size": st.integers(1, 2**20).map(lambda k: str(32 * k)),
    "data.cache_dir": _NULL | _text(),
    "optim.lr": _floats(1e-3, 1e3), "optim.min_lr": _floats(0.0, 1e-3), "optim.warmup_steps": _ints(0, 7),
    "optim.warmup_init_lr": _NULL | _floats(0.0, 10.0), "optim.decay_steps": _NULL | _ints(8, INT32_MAX),
    "optim.b1": _UNIT, "optim.b2": _UNIT, "optim.eps": _floats(0.0, 1.0, exclude_min=True),
    "optim.weight_decay": _floats(0.0, 10.0),
    "optim.decay_mask": st.sampled_from(["ndim", "names"]), "optim.max_grad_norm": _floats(0.0, 100.0),
    "optim.grad_accum_steps": st.sampled_from(["1", "2", "4", "8", "16", "32"]),
    "optim.schedule": st.sampled_from(["cosine", "linear", "constant_with_warmup", "cosine_with_restarts"]),
    "optim.cycles": _ints(1, 2**20), "optim.groups": _groups(),
    "train.steps": _ints(8, INT32_MAX), "train.precision": st.sampled_from(["bf16", "fp16", "fp32"]),
    "train.eval_every": _ints(0, INT32_MAX), "train.eval_batches": _ints(1, INT32_MAX),
    "checkpoint.every": _ints(1, INT32_MAX), "checkpoint.max_to_keep": _ints(1, INT32_MAX),
    "checkpoint.async_save": _BOOL,
    "mesh.data": st.just("-1") | _ints(1, 4096), "mesh.fsdp": _ints(1, 4096),
    "log.every": _ints(1, INT32_MAX), "log.tensorboard": _BOOL, "log.progress": _BOOL,
    "log.peak_tflops": _NULL | _floats(1e-3, 1e6), "log.sample_tokens": _ints(0, INT32_MAX - 16),  # _text()'s prompt
    "log.sample_prompt": _text(), "init.from": _NULL | _text(), "init.reseed": _BOOL,
}
# Keys whose valid values no other key's range depends on: extras beside an invalid override.
FREE = [k for k in VALID if k.split(".")[0] in ("run", "checkpoint", "log", "init") or k in (
    "model.n_layer", "model.dropout", "model.bias", "optim.b1", "optim.b2", "optim.eps", "train.precision")]

_NEGATIVE = st.integers(-INT32_MAX, 0).map(str)
_BELOW_ZERO = _floats(-1e6, -1e-300)
OUT_OF_RANGE = {
    "run.seed": st.integers(-10**6, -1).map(str) | _ints(2**32, 2**40),
    "model.vocab_size": _NEGATIVE, "model.seq_len": _NEGATIVE, "model.n_layer": _NEGATIVE,
    "model.n_head": _NEGATIVE | st.sampled_from(["3", "5", "6", "7", "100", "256"]),
    "model.d_model": _NEGATIVE | st.integers(1, 10**6).filter(lambda d: d % 4).map(str),
    "model.dropout": _floats(1.0, 1e6) | _BELOW_ZERO, "model.vocab_tiles": _NEGATIVE,
    "run.dry_run_devices": _NEGATIVE | _ints(1, 4096), "run.lock_timeout_s": _floats(-1e6, 0.0),
    "run.target_device": st.sampled_from(["v4", "v5e", "v5p", "v6e", "a100-40gb", "a100-80gb", "h100", "h200"]),
    # a store a run cannot write to, or no bucket
    "run.out_dir": st.sampled_from(["http", "file", "az", "hf", "memory", "gcs"]).flatmap(
        lambda scheme: _text().map(lambda s: f"{scheme}://bucket/{s}")) | st.sampled_from(["gs://", "s3:///"]),
    "data.batch_size": _NEGATIVE,
    "optim.lr": _floats(-1e6, 0.0) | _floats(1e-12, 9.9e-5), "optim.min_lr": _BELOW_ZERO | _floats(1.01e-3, 1e6),
    "optim.warmup_steps": st.integers(-10**6, -1).map(str) | _ints(8, INT32_MAX),
    "optim.warmup_init_lr": _BELOW_ZERO, "optim.decay_steps": st.integers(-INT32_MAX, 2).map(str),
    "optim.b1": _floats(1.0, 1e6) | _BELOW_ZERO, "optim.b2": _floats(1.0, 1e6) | _BELOW_ZERO,
    "optim.eps": _BELOW_ZERO | st.just("0.0"), "optim.weight_decay": _BELOW_ZERO, "optim.max_grad_norm": _BELOW_ZERO,
    "optim.grad_accum_steps": _NEGATIVE | st.sampled_from(["3", "5", "6", "7", "64", "33"]),
    "optim.schedule": st.just("constant"),  # with BASE's warmup: constant has none
    "optim.cycles": _NEGATIVE, "optim.groups": _groups(valid=False),
    "train.steps": st.integers(-INT32_MAX, 2).map(str), "train.eval_every": st.integers(-10**6, -1).map(str),
    "train.eval_batches": _NEGATIVE, "checkpoint.every": _NEGATIVE, "checkpoint.max_to_keep": _NEGATIVE,
    "mesh.data": st.just("0") | st.integers(-10**6, -2).map(str), "mesh.fsdp": _NEGATIVE,
    "log.every": _NEGATIVE, "log.peak_tflops": _floats(-1e6, 0.0),
    "log.sample_tokens": st.integers(-10**6, -1).map(str) | st.just(str(INT32_MAX)),  # no room for a prompt
}
NON_FINITE = st.sampled_from(["nan", ".nan", "NaN", "inf", "-inf", ".inf", "-.Inf", "1e400", "-1e999", "infinity"])
BAD_YAML = st.sampled_from(["[", "{", "[1,", "'a", '"a', "*a", "&", "!!python/object:os.system x", "!include x", "@x",
                            "`x", "%x", "a: b: c", ": x", "a: [", "!!binary '@@'", "[" * 5000 + "]" * 5000])
CONTAINERS = st.sampled_from(["[1, 2]", "{a: 1}", "[]", "{}", "- x", "? x", "2024-01-01"])
YAML_BOOLS = ["true", "false", "yes", "no", "on", "off", "True", "FALSE"]
_WORDS = st.from_regex(r"[a-z]{1,8}", fullmatch=True).filter(lambda w: isinstance(yaml.safe_load(w), str))


def _kinds(field_type) -> tuple:
    """The types a field takes besides null; a Literal's choices stand as they are."""
    if typing.get_origin(field_type) is typing.Literal:
        return (field_type,)
    return tuple(t for t in (typing.get_args(field_type) or (field_type,)) if t is not type(None))


def wrong_type(key: str):
    """A value of another kind than the field's: text for a number, a list, a word outside a Literal's choices, null
    where the field takes none (for a text key any other unquoted scalar is its text, cmdline._override_value)..."""
    field_type = FIELDS[key]
    if typing.get_origin(field_type) is dict:  # a mapping of sections: anything else, or entries that are not
        return st.sampled_from(["[1, 2]", "[]", "- x", "3", "text", "true", "null", "{a: 1}", "{a: [1]}", "{a: x}"])
    kinds = _kinds(field_type)
    options = [CONTAINERS.filter(lambda v: v != "2024-01-01")] if key in TEXT else [CONTAINERS]
    if type(None) not in typing.get_args(field_type):  # "#comment" and "~" are YAML's null, a text key's text
        options.append(st.sampled_from(["null"] + ([] if key in TEXT else ["~", "#comment"])))
    if bool in kinds:
        options += [_WORDS, _ints(-5, 5), _floats(-5.0, 5.0)]
    elif int in kinds or float in kinds:  # a word is never a number: "inf", "nan" and "infinity" are not finite
        options += [_WORDS, st.sampled_from(YAML_BOOLS)]
        if int in kinds:
            options.append(st.sampled_from(["1.5", "-0.5", "1e3", "2.0"]))
    elif key not in TEXT:
        options += [_WORDS.filter(lambda w: w not in typing.get_args(field_type)), _ints(-5, 5)]
    return st.one_of(options)


NUMERIC = sorted(k for k, t in FIELDS.items() if {int, float} & set(_kinds(t)))


def non_finite_or_huge(key: str):
    """nan or inf for a float; for a count, an integer beyond int32 (beyond 32 bits for run.seed)."""
    if float in _kinds(FIELDS[key]):
        return NON_FINITE
    lo = 2**32 if key == "run.seed" else 2**31
    return st.integers(lo, 10**40).map(str) | st.integers(-10**40, -lo).map(str)


@st.composite
def unknown_key(draw) -> str:
    """A key one slip away from a real one (a dropped or added letter, another section), or made up."""
    section, name = draw(st.sampled_from(sorted(FIELDS))).split(".")
    how = draw(st.sampled_from(["drop", "add", "section", "made up"]))
    i = draw(st.integers(0, len(name) - 1))
    if how == "drop":
        name = name[:i] + name[i + 1:] or "x"
    elif how == "add":
        name = name[:i] + draw(st.sampled_from("abcxyz_")) + name[i:]
    elif how == "section":
        section = draw(st.sampled_from(sorted({k.split(".")[0] for k in FIELDS})))
    else:
        section = draw(st.from_regex(r"[a-z_]{1,8}", fullmatch=True))
    return f"{section}.{name}"


MALFORMED = st.one_of(
    st.from_regex(r"[a-z0-9=.][a-z0-9=._]{0,10}", fullmatch=True).map(lambda a: [a]),  # positional
    st.from_regex(r"-[a-gi-z][a-z.=]{0,8}", fullmatch=True).map(lambda a: [a]),  # one dash (but not -h)
    st.sampled_from(["--", "--=x", "--.x=1", "--a..b=1", "---a.b=1", "--a.b.c=1", "--a-b.c=1", "--1a.b=1",
                     "--a b.c=1", "--optim.=1", "--.lr=1", "--optim", "--run=3"]).map(lambda a: [a]),
    st.sampled_from(["--optim.lr", "--config", "--train.steps"]).map(lambda a: [a]),  # no value, at the end
    st.sampled_from(["--optim.lr", "--config"]).map(lambda a: [a, "--train.steps=8"]),  # no value before a flag
)


def _empty(key: str):
    """Nothing, or blanks: a path of blanks is empty, but a prompt of blanks is text to continue."""
    return st.just("") if key == "log.sample_prompt" else st.sampled_from(["", " ", "  \t"])


@st.composite
def invalid_override(draw):
    """(kind, args, what the message must name)."""
    kind = draw(st.sampled_from(["wrong type", "out of range", "nan/inf/huge", "empty", "bad YAML value",
                                 "unknown key", "malformed"]))
    if kind == "unknown key":
        key = draw(unknown_key().filter(lambda k: k not in FIELDS))
        section = key.split(".")[0]
        named = key if any(k.startswith(section + ".") for k in FIELDS) else section
        return kind, [f"--{key}={draw(_ints(0, 9))}"], named
    if kind == "malformed":
        args = draw(MALFORMED)
        return kind, args, repr(args[0])
    keys = {"out of range": OUT_OF_RANGE, "nan/inf/huge": NUMERIC,
            "bad YAML value": [k for k in FIELDS if k not in TEXT]}.get(kind, FIELDS)
    key = draw(st.sampled_from(sorted(keys)))
    values = {"wrong type": wrong_type, "out of range": OUT_OF_RANGE.get, "nan/inf/huge": non_finite_or_huge,
              "empty": _empty, "bad YAML value": lambda _: BAD_YAML}
    value = draw(values[kind](key))
    return kind, [f"--{key}={value}"], key


@settings(FUZZ, max_examples=250)
@given(extras=st.lists(st.sampled_from(FREE), max_size=3, unique=True).flatmap(
           lambda keys: st.tuples(*[VALID[k].map(lambda v, k=k: f"--{k}={v}") for k in keys])),
       case=invalid_override())
def test_invalid_overrides_are_refused_naming_the_key(extras, case):
    kind, args, named = case  # last: it wins over an extra of the same key
    refused(lambda: config.load(BASE + list(extras) + args), f"override: {kind}", named)


@settings(FUZZ, max_examples=60)
@given(overrides=st.lists(st.sampled_from(sorted(VALID)), min_size=1, max_size=5, unique=True).flatmap(
           lambda keys: st.tuples(*[VALID[k].map(lambda v, k=k: (k, v)) for k in keys])))
def test_valid_overrides_load_as_given(overrides):
    cfg = config.load(BASE + [f"--{k}={v}" for k, v in overrides])
    for key, value in overrides:
        section, name = key.split(".")
        got = getattr(getattr(cfg, section), "from_" if key == "init.from" else name)
        want = yaml.safe_load(value)
        if key == "optim.groups":  # sections: compare their fields, absent ones at their defaults
            got = {p: dataclasses.asdict(g) for p, g in got.items()}
            want = {p: {**dataclasses.asdict(ParamGroup()), **g} for p, g in want.items()}
        assert got == (float(want) if isinstance(want, str) and float in _kinds(FIELDS[key]) else want), key


# YAML files --------------------------------------------------------------------------------------------------------

# Each breaks any YAML document it ends: PyYAML raises on every one (on the last, a RecursionError).
BROKEN_ENDINGS = ["run: [", "model: {", "'open", '"open', "\tx: 1", "@x: 1", "`x: 1", "x: *nowhere",
                  "x: !!python/name:os.system", "x: y: z", "- item", "  - item", "x: [1, 2", "%YAML 9.9", "x: 'a' b",
                  "? [a, b]: c", "&: x", "x: \x00", "x: " + "[" * 5000 + "]" * 5000]
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\xe2\x82", b"\x80"]


@st.composite
def valid_mapping(draw) -> dict:
    keys = draw(st.lists(st.sampled_from(FREE), max_size=4, unique=True))
    raw = {}
    for key in keys:
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = yaml.safe_load(draw(VALID[key]))
    return raw


@st.composite
def bad_yaml_file(draw) -> tuple[str, bytes, str]:
    """(kind, file bytes, what the message must name)."""
    raw = {"run": {"seed": 0}, **draw(valid_mapping())}
    text = yaml.safe_dump(raw, sort_keys=False)
    kind = draw(st.sampled_from(["syntax", "utf-8", "not a mapping", "nesting", "bad value", "key twice"]))
    if kind == "syntax":
        return kind, (text + draw(st.sampled_from(BROKEN_ENDINGS)) + "\n").encode(), "is not valid YAML"
    if kind == "key twice":  # a section of the file written again at its end (PyYAML would keep only that one)
        section = draw(st.sampled_from(sorted(raw)))
        again = yaml.safe_dump({section: raw[section]}, sort_keys=False)
        return kind, (text + again).encode(), f"key {section!r} is given twice"
    if kind == "utf-8":
        data, at = text.encode(), draw(st.integers(0, len(text)))
        return kind, data[:at] + draw(st.sampled_from(BAD_UTF8)) + data[at:], "is not UTF-8"
    if kind == "not a mapping":
        top = draw(st.sampled_from([[raw], [1, 2], "text", 3, 1.5, True]))
        return kind, yaml.safe_dump(top).encode(), "must hold a mapping"
    if kind == "nesting":
        section, name = draw(st.sampled_from(sorted(FIELDS))).split(".")
        wrong, named = draw(st.sampled_from([({section: 3}, section), ({section: [name]}, section),
                                             ({section: {name: {"value": 1}}}, f"{section}.{name}"),
                                             ({name: 1}, name), ({"run": {section: {name: 1}}}, f"run.{section}")]))
        return kind, yaml.safe_dump({**raw, **wrong}).encode(), named
    _, args, key = draw(invalid_override().filter(lambda case: case[0] in ("wrong type", "out of range",
                                                                            "nan/inf/huge", "unknown key")))
    dotted, _, value = args[0][2:].partition("=")  # the override's value, as the file holds it
    section, name = dotted.split(".")
    bad = {**raw, section: {**raw.get(section, {}), name: yaml.safe_load(value)}}
    return kind, yaml.safe_dump(bad, sort_keys=False).encode(), key


@settings(FUZZ, max_examples=100)
@given(case=bad_yaml_file())
def test_bad_yaml_files_are_refused_in_one_line(case):
    kind, content, named = case
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.yaml")
        with open(path, "wb") as f:
            f.write(content)
        message = refused(lambda: config.load(["--config", path]), f"yaml: {kind}", named)
        assert kind in ("bad value", "nesting") or repr(path) in message, message  # those name the key
        assert open(path, "rb").read() == content


@settings(FUZZ, max_examples=40)
@given(content=st.binary(max_size=64))
def test_random_bytes_as_yaml_load_or_are_refused(content):
    """Arbitrary bytes: a few happen to be an empty or valid config; the rest are refused, all in one line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.yaml")
        with open(path, "wb") as f:
            f.write(content)
        try:
            config.load(["--config", path])
        except UserError as e:
            assert "\n" not in str(e) and repr(path) in str(e), str(e)
            INVALID["yaml: random bytes"] += 1


# Data folders ------------------------------------------------------------------------------------------------------

def _edit_meta(path: str, edit) -> None:
    meta_path = os.path.join(path, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump(edit(meta), f)


def _resize(file: str, new_size) -> None:
    with open(file, "r+b") as f:
        f.truncate(new_size(os.path.getsize(file)))


_META_EDITS = st.sampled_from(["vocab_size", "dtype", "tokenizer", "train_tokens", "val_tokens"]).flatmap(
    lambda key: st.sampled_from([None, "12", 1.5, True, [], {}, -1, 0, 2**40, "float32", "int16", "", "<u2"]).map(
        lambda value, key=key: (key, value))).filter(lambda kv: not (kv[0] == "tokenizer" and isinstance(kv[1], str)))


DATA_KINDS = ["none", "truncated", "appended", "dtype mismatch", "ids beyond vocab", "model vocab too small",
              "meta garbage", "meta value", "missing", "window too long", "not a folder"]


@st.composite
def data_case(draw, kind: str):
    """(vocab_size, (train, val) token arrays, seq_len, the split to break, the value the corruption `kind` takes)."""
    vocab = draw(st.sampled_from([2, 256, 1000, 65536, 65537, 100_000]))
    seq_len = draw(st.integers(1, 32))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    train, val = (rng.integers(0, vocab, draw(st.integers(seq_len + 1, 3000))) for _ in range(2))
    train[0] = vocab - 1  # the top id is there to be too large for a smaller vocab
    garbage = st.sampled_from([b"[]", b"null", b'"x"', b"{", b"\xff", b"[" * 10**5]) | st.binary(max_size=64)
    arg = draw({"truncated": st.integers(1, 2**20), "appended": st.binary(min_size=1, max_size=16),
                "ids beyond vocab": st.integers(1, vocab - 1), "model vocab too small": st.integers(1, vocab - 1),
                "meta garbage": garbage, "meta value": _META_EDITS,
                "missing": st.sampled_from(["meta.json", "train.bin", "val.bin", ""]),
                "window too long": st.integers(min(len(train), len(val)), 10**6)}.get(kind, st.none()))
    return vocab, (train, val), seq_len, draw(st.sampled_from(["train.bin", "val.bin"])), arg


def corrupt(path: str, kind: str, split: str, arg) -> None:
    """Break the token folder at `path` the way `kind` says, with the drawn `arg`."""
    if kind == "truncated":
        _resize(os.path.join(path, split), lambda size: max(size - arg, 0))
    elif kind == "appended":
        with open(os.path.join(path, split), "ab") as f:
            f.write(arg)
    elif kind == "dtype mismatch":
        _edit_meta(path, lambda meta: {**meta, "dtype": "uint32" if meta["dtype"] == "uint16" else "uint16"})
    elif kind == "ids beyond vocab":
        _edit_meta(path, lambda meta: {**meta, "vocab_size": arg})
    elif kind == "meta garbage":
        with open(os.path.join(path, "meta.json"), "wb") as f:
            f.write(arg)
    elif kind == "meta value":  # a None value drops the key
        _edit_meta(path, lambda meta: {k: v for k, v in {**meta, arg[0]: arg[1]}.items() if v is not None})
    elif kind == "missing":
        shutil.rmtree(path) if not arg else os.remove(os.path.join(path, arg))


def start_on_data(argv: list[str]) -> None:
    """What both command lines do with the data before their first array work, and the first batches."""
    cfg = config.load(argv)
    tokens = data.load(cfg.data, cfg.model.seq_len)
    data.resolve_vocab_size(cfg.model.vocab_size, tokens)
    batch = dict(seed=0, batch_size=2, accum_steps=1, seq_len=cfg.model.seq_len)
    data.window(tokens, step=0, **batch)
    data.eval_batch(tokens, index=0, **batch)


@pytest.mark.parametrize("kind", DATA_KINDS)
def test_bad_data_folders_are_refused_naming_the_folder(kind):
    @settings(FUZZ, max_examples=8)
    @given(case=data_case(kind))
    def check(case):
        check_data_case(kind, *case)
    check()


def check_data_case(kind, vocab, splits, seq_len, split, arg) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tokens")
        prepare.write_token_dir(path, *splits, vocab, "bytes")
        corrupt(path, kind, split, arg)
        data_path = os.path.join(path, "train.bin") if kind == "not a folder" else path
        seq_len = arg if kind == "window too long" else seq_len
        argv = [f"--data.path={data_path}", f"--model.seq_len={seq_len}"]
        argv += [f"--model.vocab_size={arg}"] if kind == "model vocab too small" else []
        before = snapshot(tmp)
        if kind == "none":
            start_on_data(argv)
        else:
            refused(lambda: start_on_data(argv), f"data: {kind}", path)
        assert_untouched(before, tmp)


# Run folders that hold something else ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tokens"))
    rng = np.random.default_rng(0)
    prepare.write_token_dir(path, rng.integers(0, 64, 2000), rng.integers(0, 64, 500), 64, "bytes")
    return path


def run_args(tokens: str, out_dir: str, *extra) -> list[str]:
    return [f"--data.path={tokens}", f"--run.out_dir={out_dir}", "--model.n_layer=1", "--model.d_model=16",
            "--model.n_head=2", "--model.seq_len=8", "--data.batch_size=4", "--train.steps=2", "--optim.warmup_steps=0",
            "--checkpoint.every=1", "--log.progress=false", "--log.tensorboard=false", "--train.precision=fp32",
            "--checkpoint.async_save=false", *extra]


@pytest.fixture(scope="module")
def jax_run(tokens, tmp_path_factory) -> str:
    """A jaxtrain run folder with its step-0 checkpoint (the initial state: no train step to compile)."""
    out = str(tmp_path_factory.mktemp("jax_run"))
    trainer = run.Trainer(config.load(run_args(tokens, out)))
    config.save(trainer.cfg, out)
    trainer.checkpointer.save(trainer.initial_state(), trainer.data_seed)
    trainer.checkpointer.wait()
    trainer.checkpointer.close()
    return out


@pytest.fixture(scope="module")
def torch_run(tokens, tmp_path_factory) -> str:
    """A torchref run folder after one step: checkpoints/1 in the torch format."""
    from torchref import run as torch_run_lib
    out = str(tmp_path_factory.mktemp("torch_run"))
    torch_run_lib.train(config.load(run_args(tokens, out, "--train.steps=1")))
    return out


CHANGES = [("--model.n_layer=2", "model.n_layer"), ("--model.d_model=32", "model.d_model"),
           ("--model.seq_len=16", "model.seq_len"), ("--optim.lr=0.01", "optim.lr"), ("--run.seed=5", "run.seed"),
           ("--data.batch_size=8", "data.batch_size"), ("--train.precision=bf16", "train.precision")]


def _write_garbage(folder: str, files: dict) -> None:
    os.makedirs(folder, exist_ok=True)
    for name, content in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(content)


RUN_FOLDER_KINDS = ["same run", "another model", "torch run folder", "torch checkpoint among steps", "garbage step",
                    "misplaced", "damaged checkpoint"]
GARBAGE_NAMES = ["meta", "state", "_CHECKPOINT_METADATA", "model.safetensors", "trainer_state.json", "x",
                 "commit_success.txt"]


@st.composite
def run_folder_case(draw, kind: str):
    """The values building a run folder of `kind` takes: a step number and one drawn per kind."""
    step = str(draw(st.integers(1, 10**6)))
    arg = draw({"another model": st.sampled_from(CHANGES),
                "garbage step": st.dictionaries(st.sampled_from(GARBAGE_NAMES), st.binary(max_size=32), max_size=4),
                "misplaced": st.sampled_from(["out_dir", "under a file", "checkpoints", "config.yaml",
                                              "metrics.jsonl", f"checkpoints/{step}"]),
                "damaged checkpoint": st.tuples(st.integers(0, 10**6), st.binary(max_size=64))}.get(kind, st.none()))
    return step, arg


def build_run_folder(kind: str, out: str, jax: str, torch: str, step: str, arg) -> tuple[str | None, list[str]]:
    """Make `out` a run folder of `kind`: (what the refusal must name, None for a valid resume; extra overrides)."""
    steps = os.path.join(out, "checkpoints")
    if kind in ("same run", "another model", "damaged checkpoint"):
        shutil.copytree(jax, out)
    if kind == "same run":
        return None, []
    if kind == "another model":
        return arg[1], [arg[0]]
    if kind == "damaged checkpoint":  # one file of the checkpoint overwritten
        files = sorted(os.path.join(d, n) for d, _, names in os.walk(os.path.join(steps, "0")) for n in names)
        with open(files[arg[0] % len(files)], "wb") as f:
            f.write(arg[1])
        return os.path.join(steps, "0"), []
    if kind == "torch run folder":
        shutil.copytree(torch, out)
        return os.path.join(steps, "1"), []
    if kind == "torch checkpoint among steps":
        shutil.copytree(os.path.join(torch, "checkpoints", "1"), os.path.join(steps, step))
        return os.path.join(steps, step), []
    if kind == "garbage step":
        _write_garbage(os.path.join(steps, step), arg)
        return os.path.join(steps, step), []
    return _misplace(out, arg)


def _misplace(out: str, where: str) -> tuple[str, list[str]]:
    """A file where the run keeps a folder, or a folder where it keeps a file: (the path to name, overrides)."""
    if where in ("out_dir", "under a file"):
        _write_garbage(os.path.dirname(out), {os.path.basename(out): b"x"})
        return out, [f"--run.out_dir={out}/sub"] if where == "under a file" else []
    path = os.path.join(out, where)
    if where in ("config.yaml", "metrics.jsonl"):
        os.makedirs(path)
    else:
        _write_garbage(os.path.dirname(path), {os.path.basename(path): b"x"})
    return path, []


def start_jaxtrain(argv: list[str]) -> None:
    """What `python -m jaxtrain.run` does before it trains: run.Trainer (config, data, mesh, the run lock, the resume
    check and the restore of the checkpoint it resumes from)."""
    run.Trainer(config.load(argv)).close()


@pytest.mark.parametrize("kind", RUN_FOLDER_KINDS)
def test_run_folders_holding_something_else_are_refused(kind, tokens, jax_run, torch_run):
    @settings(FUZZ, max_examples=6)
    @given(case=run_folder_case(kind))
    def check(case):
        check_run_folder_case(kind, *case, tokens, jax_run, torch_run)
    check()


@pytest.mark.parametrize("metadata", [b"", b"\x80"], ids=["empty", "not utf-8"])
def test_a_step_folder_with_garbage_checkpoint_metadata_is_refused_in_one_line(tokens, jax_run, torch_run, metadata):
    """Found by the case above: orbax's absl warning "Failed to json parse Metadata file" (empty), or "Failed to read
    Metadata file" (not UTF-8), came before jaxtrain's own line, which names the folder and the failed read."""
    check_run_folder_case("garbage step", "1", {"_CHECKPOINT_METADATA": metadata}, tokens, jax_run, torch_run)


def check_run_folder_case(kind, step, arg, tokens, jax_run, torch_run) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        named, extra = build_run_folder(kind, out, jax_run, torch_run, step, arg)
        argv = run_args(tokens, out, *extra)
        before = snapshot(tmp)
        if named is None:
            start_jaxtrain(argv)
        elif kind == "damaged checkpoint":  # some files matter only to a later step, or to none
            try:
                start_jaxtrain(argv)
            except UserError as e:
                assert "\n" not in str(e) and named in str(e), str(e)
                INVALID[f"run folder: {kind}"] += 1
        else:
            refused(lambda: start_jaxtrain(argv), f"run folder: {kind}", named)
        assert_untouched(before, tmp)


# The command lines -------------------------------------------------------------------------------------------------

def _file(tmp: str, content: bytes) -> str:
    path = os.path.join(tmp, "c.yaml")
    with open(path, "wb") as f:
        f.write(content)
    return path


def _truncated_copy(tokens: str, tmp: str) -> str:
    path = shutil.copytree(tokens, os.path.join(tmp, "tokens"))
    _resize(os.path.join(path, "train.bin"), lambda size: size - 3)
    return path


def _altered_copy(tokens: str, tmp: str) -> str:
    path = shutil.copytree(tokens, os.path.join(tmp, "tokens"))
    ids = np.memmap(os.path.join(path, "train.bin"), np.uint16, "r+")
    ids[0] = (ids[0] + 1) % 64
    ids.flush()
    return path


def _damaged_arrays(jax_run: str, out: str) -> str:
    shutil.copytree(jax_run, out)
    arrays = os.path.join(out, "checkpoints", "0", "state", "d")
    for name in os.listdir(arrays):
        with open(os.path.join(arrays, name), "wb") as f:
            f.write(b"garbage")
    return out


# name -> (backend, build(tmp, out, tokens, jax_run, torch_run) -> argv, what the error line must name); the
# issue's known failures first.
COMMAND_LINES = {
    "empty out_dir": ("jaxtrain", lambda tmp, out, tok, jax, torch: run_args(tok, ""), "run.out_dir is empty"),
    "YAML not UTF-8": ("jaxtrain", lambda tmp, out, *_: ["--config", _file(tmp, b"run:\n  out_dir: \xff\n")],
                       "is not UTF-8"),
    "YAML syntax error": ("jaxtrain", lambda tmp, out, *_: ["--config", _file(tmp, b"run:\n  out_dir: [\n")],
                          "at line 3, column 1"),
    "huge steps": ("jaxtrain", lambda tmp, out, tok, *_: run_args(tok, out, "--train.steps=99999999999999999999999"),
                   "train.steps"),
    "truncated train.bin": ("jaxtrain", lambda tmp, out, tok, *_: run_args(_truncated_copy(tok, tmp), out),
                            "train.bin"),
    "another model's run folder": ("jaxtrain", lambda tmp, out, tok, jax, torch: run_args(
        tok, shutil.copytree(jax, out), "--model.n_layer=2"), "model.n_layer: 1 -> 2"),
    "a torchref run folder": ("jaxtrain", lambda tmp, out, tok, jax, torch: run_args(
        tok, shutil.copytree(torch, out)), "a torch-format checkpoint"),
    "a damaged checkpoint array": ("jaxtrain", lambda tmp, out, tok, jax, torch: run_args(
        tok, _damaged_arrays(jax, out)), "checkpoints/0 cannot be read"),
    "torchref: empty out_dir": ("torchref", lambda tmp, out, tok, *_: run_args(tok, ""), "run.out_dir is empty"),
    "torchref: a jaxtrain run folder": ("torchref", lambda tmp, out, tok, jax, torch: run_args(
        tok, shutil.copytree(jax, out)), "checkpoints/0 is a jaxtrain checkpoint"),
    "torchref: other data": ("torchref", lambda tmp, out, tok, jax, torch: run_args(
        _altered_copy(tok, tmp), shutil.copytree(torch, out), "--train.steps=1"), "differs from the data"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tokens, jax_run, torch_run) -> dict:
    """Every command line started at once (each spends seconds importing jax or torch): name -> (process, its
    folder, the folder's snapshot before the start)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # -m imports this checkout's packages
    started = {}
    for name, (backend, build, _) in COMMAND_LINES.items():
        tmp = str(tmp_path_factory.mktemp("cli"))
        argv = build(tmp, os.path.join(tmp, "run"), tokens, jax_run, torch_run)
        before = snapshot(tmp)
        started[name] = (subprocess.Popen([sys.executable, "-m", f"{backend}.run", *argv], cwd=root, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE), tmp, before)
    return started


@pytest.mark.parametrize("name", COMMAND_LINES)
def test_command_line_refuses_in_one_line(name, launched):
    (proc, tmp, before), (backend, _, named) = launched[name], COMMAND_LINES[name]
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr
    assert_untouched(before, tmp)
    assert "Traceback" not in stderr and named in stderr, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    INVALID[f"command line: {backend}"] += 1
