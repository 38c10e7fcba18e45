"""Config loading: YAML + dotted overrides, and one clear error per user mistake."""

import dataclasses
import logging
import os
import shlex
import subprocess
import sys
import typing

import numpy as np
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxtrain import cmdline, config, config_checks, data, mesh, runfolder, same_run
from jaxtrain.errors import UserError


@pytest.fixture
def yaml_path(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run: {out_dir: /tmp/x}\noptim: {lr: 3e-4, warmup_steps: 5}\ninit: {from: /some/dir}\n")
    return str(path)


def test_yaml_then_overrides(yaml_path):
    cfg = config.load(["--config", yaml_path, "--optim.lr=1e-2", "--train.steps", "50", "--train.precision=fp32"])
    assert cfg.optim.lr == 1e-2 and cfg.optim.warmup_steps == 5
    assert cfg.train.steps == 50 and cfg.train.precision == "fp32"
    assert cfg.init.from_ == "/some/dir"


@pytest.mark.parametrize("typed, read", [
    ("def ", "def "),  # YAML alone reads "def": the end-of-run sample would continue a different prompt
    ("  x ", "  x "),
    ("a # b", "a # b"),  # YAML alone drops " # b" as a comment
    ("# b", "# b"),  # YAML alone reads a comment: null, refused as a prompt
    ("'quoted '", "quoted "),  # quoted: YAML's text
    ('"tab\\t"', "tab\t"),  # double quotes: YAML's escapes
])
def test_override_text_is_kept_as_typed(yaml_path, typed, read):
    assert config.load(["--config", yaml_path, f"--log.sample_prompt={typed}"]).log.sample_prompt == read


# Text that YAML alone reads as something else: octal, a number with underscores, hex, base 60, a float's zeros,
# a date, booleans.
NOT_TEXT_TO_YAML = st.one_of(st.from_regex(r"0[0-7]{1,4}", fullmatch=True),
                             st.from_regex(r"[1-9](_[0-9]{3}){1,2}", fullmatch=True),
                             st.from_regex(r"0x[0-9A-F]{1,4}", fullmatch=True),
                             st.from_regex(r"[1-5][0-9]?:[0-5][0-9]", fullmatch=True),
                             st.from_regex(r"[1-9]\.[0-9]0", fullmatch=True),
                             st.from_regex(r"20[0-9]{2}-0[1-9]-[12][0-9]", fullmatch=True),
                             st.sampled_from(["yes", "no", "on", "off", "True", "FALSE", "1.5e+3", "-7"]))


@settings(deadline=None, derandomize=True, database=None, max_examples=100)
@given(key=st.sampled_from(["run.out_dir", "log.wandb_name", "log.wandb_project", "log.sample_prompt"]),
       typed=NOT_TEXT_TO_YAML)
@example(key="run.out_dir", typed="017").via("YAML's 15: the run wrote into ./15")
@example(key="log.wandb_name", typed="12:30").via("YAML's 750")
def test_an_unquoted_override_of_a_text_key_is_kept_as_typed(key, typed):
    assert not isinstance(yaml.safe_load(typed), str)  # the case: YAML alone would change it
    section, name = key.split(".")
    assert getattr(getattr(config.load([f"--{key}={typed}"]), section), name) == typed


@pytest.mark.parametrize("typed, read", [("null", None), ("~", os.path.expanduser("~")), ("'017'", "017")])
def test_a_text_keys_null_home_and_quotes_stay_as_they_were(yaml_path, typed, read):
    """null resets an optional text key; a lone ~ is the home folder there, not YAML's null; quotes are YAML's."""
    assert config.load(["--config", yaml_path, f"--init.from={typed}"]).init.from_ == read


@pytest.mark.parametrize("typed", ["[1, 2]", "{a: 1}", "- x"])
def test_a_list_or_a_mapping_for_a_text_key_is_refused(yaml_path, typed):
    with pytest.raises(UserError, match="^run.out_dir takes a single value"):
        config.load(["--config", yaml_path, f"--run.out_dir={typed}"])


@pytest.mark.parametrize("written, number", [("017", "15"), ("1_000", "1000"), ("12:30", "750"), ("1.50", "1.5")])
def test_a_yaml_file_number_for_a_text_key_is_refused_not_turned_into_other_text(tmp_path, written, number):
    """In a file YAML has read the value before config sees it: a number where text belongs is refused, naming the
    quotes that keep it; quoted, it is the text as written."""
    path = tmp_path / "c.yaml"
    path.write_text(f"log: {{wandb_name: {written}}}\n")
    with pytest.raises(UserError, match=f"^log.wandb_name takes text, but the YAML file's value reads as the number "
                                        f"{number} .*; quote it there"):
        config.load(["--config", str(path)])
    path.write_text(f"log: {{wandb_name: '{written}'}}\n")
    assert config.load(["--config", str(path)]).log.wandb_name == written


@pytest.mark.parametrize("key, written, read", [("run.seed", "010", 8), ("train.steps", "0200", 128),
                                               ("checkpoint.every", "1:30", 90), ("optim.lr", "-017", -15),
                                               ("train.eval_every", "0_10", 8)])
def test_a_number_yaml_reads_as_octal_or_base_60_is_refused_on_the_command_line_and_in_a_file(tmp_path, key, written,
                                                                                             read):
    """YAML 1.1 reads a leading 0 as octal and colons as base 60: --run.seed=010 trained seed 8 without a word."""
    message = f"^{key}={written} reads as {read} in YAML \\(a leading 0 makes a number octal, colons base 60\\)"
    with pytest.raises(UserError, match=message):
        config.load([f"--run.out_dir={tmp_path}", f"--{key}={written}"])
    section, name = key.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {name}: {written}\n")
    with pytest.raises(UserError, match=message):
        config.load(["--config", str(tmp_path / "c.yaml"), f"--run.out_dir={tmp_path}"])
    assert config.load([f"--run.out_dir={tmp_path}", "--train.steps=0128"]).train.steps == 128  # no octal: decimal


def test_keep_best_needs_saves_that_fall_on_evaluations(tmp_path):
    """Evaluations every 2 and saves every 3 meet first at step 6: within 8 steps, no save before the last has an
    eval loss, and keep_best kept nothing extra without a word; within 12, step 6's has. Without evaluations
    (train.eval_every=0), none has."""
    base = [f"--run.out_dir={tmp_path}", "--optim.warmup_steps=1", "--checkpoint.keep_best=true"]
    for steps, every, eval_every in ((6, 3, 2), (8, 4, 0), (8, 8, 8)):
        with pytest.raises(UserError, match=f"^checkpoint.keep_best keeps the save with the lowest eval loss, .*: "
                                            f"with checkpoint.every={every} and train.eval_every={eval_every} none "
                                            f"falls on one before the last step \\({steps}\\)"):
            config.load(base + [f"--train.steps={steps}", f"--checkpoint.every={every}",
                                f"--train.eval_every={eval_every}"])
    for steps, every, eval_every in ((7, 3, 2), (8, 4, 2), (1300, 300, 200)):  # saves at 6; 4; 600 and 1200
        assert config.load(base + [f"--train.steps={steps}", f"--checkpoint.every={every}",
                                   f"--train.eval_every={eval_every}"]).checkpoint.keep_best


@pytest.mark.parametrize("key, value", [("run.target_device", "h100"), ("run.dry_run_devices", "8")])
def test_a_dry_run_key_without_the_dry_run_is_refused(tmp_path, key, value):
    """A "will it fit" command without its --run.dry_run=true trained on this machine, the key ignored."""
    with pytest.raises(UserError, match=f"^{key}={value} acts in a dry run only .*; add --run.dry_run=true"):
        config.load([f"--run.out_dir={tmp_path}", f"--{key}={value}"])
    assert config.load([f"--run.out_dir={tmp_path}", f"--{key}={value}", "--run.dry_run=true"]).run.dry_run


def test_a_dry_run_does_not_ask_for_a_run_folder_it_could_write(tmp_path):
    """It writes nothing there: configs/gpt-1b.yaml's /mnt/shared/... refused a user who cannot write /mnt."""
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="run.out_dir"):
        config.load([f"--run.out_dir={tmp_path / 'file' / 'run'}"])
    config.load([f"--run.out_dir={tmp_path / 'file' / 'run'}", "--run.dry_run=true"])


def test_an_empty_yaml_section_and_a_home_relative_config_path_load(tmp_path, monkeypatch):
    """`optim:` with its keys commented out was refused ('must be a mapping of keys, got None') unless an override
    of optim was given; --config=~/c.yaml (no shell expands ~ after =) was 'not found'."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("optim:\n  # lr: 1.0e-3\nmodel:\n  n_layer: 3\n")
    cfg = config.load(["--config=~/c.yaml", f"--run.out_dir={tmp_path}"])
    assert cfg.model.n_layer == 3 and cfg.optim.lr == config.OptimConfig().lr


@pytest.mark.parametrize("typed, meant", [
    ("log.eval_every", "train.eval_every"), ("optim.steps", "train.steps"), ("train.grad_accum_steps",
     "optim.grad_accum_steps"), ("train.seed", "run.seed"), ("data.seq_len", "model.seq_len"),  # another section's
    ("model.block_size", "model.seq_len"), ("train.learning_rate", "optim.lr"), ("model.n_embd", "model.d_model"),
    ("optim.lrr", "optim.lr"), ("log.wandbb", "log.wandb"), ("train.eval_evry", "train.eval_every"),
    ("data.n_layr", "model.n_layer")])
def test_an_unknown_key_names_the_key_meant_in_any_section(tmp_path, typed, meant):
    """The hint looked in the key's own section only: --log.eval_every suggested log.every, --optim.steps optim.eps,
    --model.block_size (nanoGPT's name) model.vocab_size."""
    with pytest.raises(UserError, match=f"^unknown config key '{typed}'; did you mean {meant}\\?$"):
        config.load([f"--run.out_dir={tmp_path}", f"--{typed}=1"])
    (tmp_path / "c.yaml").write_text("block_size: 256\n")  # nanoGPT's, without a section
    with pytest.raises(UserError, match="^unknown config key 'block_size'; did you mean model.seq_len\\?$"):
        config.load(["--config", str(tmp_path / "c.yaml"), f"--run.out_dir={tmp_path}"])


def test_an_override_replaces_its_keys_whole_value(tmp_path):
    """optim.groups from the command line replaces the file's groups: `{}` clears them, and a new pattern is not
    added beside the file's (where it could clash with a pattern the user never wrote on this command line)."""
    path = tmp_path / "g.yaml"
    path.write_text("optim: {lr: 3e-4, groups: {'wte|wpe': {lr_scale: 0.1}}}\nrun: {out_dir: /tmp/x}\n")
    assert set(config.load(["--config", str(path)]).optim.groups) == {"wte|wpe"}
    cleared = config.load(["--config", str(path), "--optim.groups={}"])
    assert cleared.optim.groups == {} and cleared.optim.lr == 3e-4  # the section's other keys stay the file's
    replaced = config.load(["--config", str(path), "--optim.groups={wte: {lr_scale: 0.5}}"]).optim.groups
    assert list(replaced) == ["wte"] and replaced["wte"].lr_scale == 0.5


@pytest.mark.parametrize("prompt, tokens, accepted", [
    ("\n", 2**31 - 2, True), ("\n", 2**31 - 1, False),  # one byte of prompt: positions 0 .. 2**31 - 1
    ("abc", 2**31 - 4, True), ("abc", 2**31 - 3, False),
])
def test_the_end_of_run_samples_length_is_checked_before_training(yaml_path, prompt, tokens, accepted):
    """log.sample_tokens after the prompt must fit int32 positions: refused when the run starts, not after it
    trained, in another command's words (--max_new_tokens)."""
    args = ["--config", yaml_path, f"--log.sample_prompt={prompt}", f"--log.sample_tokens={tokens}"]
    if accepted:
        assert config.load(args).log.sample_tokens == tokens
    else:
        with pytest.raises(UserError, match=f"^log.sample_tokens={tokens} after a prompt of up to {len(prompt)} "
                                            f"tokens runs past"):
            config.load(args)


@pytest.mark.parametrize("key, noun", [("log.wandb_name", "name"), ("log.wandb_project", "name"),
                                       ("run.out_dir", "folder"), ("data.cache_dir", "folder")])
def test_an_empty_text_key_is_named_for_what_it_holds(yaml_path, key, noun):
    with pytest.raises(UserError, match=f"^{key} is empty; give it a {noun}, or leave it out for its default$"):
        config.load(["--config", yaml_path, f"--{key}= "])


def test_an_override_that_starts_like_a_yaml_comment_is_not_a_silent_default(yaml_path):
    """YAML reads `#1` as a comment, null: data.path's default, the embedded corpus, trained on without a word."""
    cfg = config.load(["--config", yaml_path, "--data.path=#1"])
    with pytest.raises(UserError, match=r"^data folder '#1' not found in the current folder, .*; create it with "
                                        r"`python -m jaxtrain.data prepare"):
        data.load(cfg.data, cfg.model.seq_len)


def test_a_data_path_in_a_bucket_is_named_a_url():
    """It was 'not a folder'; data is read from a local copy on each host."""
    with pytest.raises(UserError, match="^data folder 'gs://b/x' is a URL, and data is read from a local folder: "
                                        "copy it to each host"):
        data.load(config.load(["--data.path=gs://b/x", "--model.vocab_size=256"]).data, 32)


def test_derived_defaults(yaml_path):
    cfg = config.load(["--config", yaml_path, "--train.steps=80"])
    assert cfg.decay_steps == 80
    assert cfg.warmup_init_lr == 3e-4 / 6  # lr / (warmup_steps + 1): the same float64 division


def test_dump_reads_back(yaml_path, tmp_path):
    cfg = config.load(["--config", yaml_path, "--model.n_layer=3"])
    config.save(cfg, str(tmp_path / "out"))
    assert config.load(["--config", str(tmp_path / "out" / "config.yaml")]) == cfg


@pytest.mark.parametrize("args, words", [
    (["--optim.lrr=1"], ["optim.lrr", "did you mean optim.lr"]),
    (["--optimx.lr=1"], ["optimx", "did you mean optim"]),
    (["--optim.lr=abc"], ["optim.lr", "float"]),
    (["--train.precision=fp8"], ["train.precision", "fp16"]),
    (["--train.loss_scale_init=1000"], ["train.loss_scale_init=1000.0", "power of 2"]),
    (["--model.n_head=5"], ["model.n_head=5", "model.d_model=128"]),
    (["--optim.warmup_steps=100", "--train.steps=50"], ["optim.warmup_steps=100", "decay"]),
    (["--data.batch_size=33", "--optim.grad_accum_steps=2"], ["data.batch_size=33", "optim.grad_accum_steps=2"]),
    (["--run.target_device=h100"], ["run.target_device=h100", "--run.dry_run=true"]),  # (data.path: data.load's)
    (["--optim.min_lr=1"], ["optim.min_lr", "optim.lr"]),
    (["--optim.eps=0"], ["optim.eps must be > 0, got 0.0"]),  # an untied embedding row no token reached went NaN
    (["--train.steps"], ["--train.steps", "no value"]),
    (["--synthtic"], ["malformed argument '--synthtic'", "--section.key=value"]),  # a mistyped flag, no value
    (["positional"], ["positional"]),
    (["--optim.lr=nan"], ["optim.lr", "finite"]),
    (["--optim.lr=inf"], ["optim.lr", "finite"]),
    (["--optim.weight_decay=-inf"], ["optim.weight_decay", "finite"]),
    (["--train.steps=99999999999999999999999"], ["train.steps", "2147483647"]),
    (["--checkpoint.every=2147483648"], ["checkpoint.every", "2147483647"]),
    (["--optim.schedule=constant"], ["optim.schedule=constant", "optim.warmup_steps=5", "constant_with_warmup"]),
    (["--optim.schedule=step"], ["optim.schedule", "cosine_with_restarts"]),
    (["--optim.schedule=cosine_with_restarts", "--optim.cycles=30000000", "--train.steps=100"],
     ["optim.cycles=30000000", "int32"]),
    (["--optim.groups={wte: {lr_scale: 0}}"], ["optim.groups['wte'].lr_scale", "> 0"]),
    (["--optim.groups={'[': {}}"], ["optim.groups['[']", "regular expression"]),
    (["--model.vocab_tiles=0"], ["model.vocab_tiles", ">= 1"]),
    (["--model.vocab_tiles=3"], ["model.vocab_tiles=3", "4096 tokens", "e.g. 1"]),
    (["--model.vocab_tiles=6"], ["model.vocab_tiles=6", "4096 tokens", "e.g. 2"]),
    (["--model.residual_dtype=bf16", "--train.precision=fp32"], ["model.residual_dtype=bf16", "train.precision=fp32",
                                                                 "use train.precision=bf16"]),
    (["--model.residual_dtype=bf16", "--train.precision=fp16"],
     ["model.residual_dtype=bf16", "train.precision=fp16"]),
])
def test_user_errors_name_the_key(yaml_path, args, words):
    with pytest.raises(UserError) as e:
        config.load(["--config", yaml_path, *args])
    for word in words:
        assert word in str(e.value)


@pytest.mark.parametrize("schedule, warmup", [("constant", 0), ("constant_with_warmup", 5)])
def test_a_schedule_that_never_decays_takes_an_lr_below_min_lr(yaml_path, schedule, warmup):
    """The constant schedules never reach min_lr, so a min_lr above lr (the default 1e-4 beside a fine-tuning LR)
    is not refused there (it was, as if the schedule decayed); a schedule that decays to it still refuses it."""
    args = ["--config", yaml_path, f"--optim.warmup_steps={warmup}", "--optim.lr=1e-5", "--optim.min_lr=1e-4"]
    assert config.load([*args, f"--optim.schedule={schedule}"]).optim.lr == 1e-5
    for decaying in ("cosine", "linear", "cosine_with_restarts"):
        with pytest.raises(UserError, match=f"optim.min_lr=0.0001 is larger than optim.lr=1e-05; "
                                            f"optim.schedule={decaying} decays"):
            config.load([*args, f"--optim.schedule={decaying}"])


@settings(deadline=None, derandomize=True, database=None, max_examples=200)
@given(sequences=st.integers(1, 64), accum=st.sampled_from([1, 2, 4]), seq_len=st.integers(1, 512),
       tiles=st.integers(-3, 300))
def test_vocab_tiles_must_divide_the_micro_batch_tokens(sequences, accum, seq_len, tiles):
    """model.vocab_tiles is accepted exactly when it is >= 1 and divides a micro-batch's tokens (sequences x
    seq_len); otherwise one error names the key."""
    args = [f"--data.batch_size={sequences * accum}", f"--optim.grad_accum_steps={accum}",
            f"--model.seq_len={seq_len}", f"--model.vocab_tiles={tiles}"]
    if tiles >= 1 and (sequences * seq_len) % tiles == 0:
        assert config.load(args).model.vocab_tiles == tiles
    else:
        with pytest.raises(UserError, match=r"^model\.vocab_tiles"):
            config.load(args)


@settings(deadline=None, derandomize=True, database=None, max_examples=200)
@given(exponent=st.integers(-1074, 1023), key=st.sampled_from(["loss_scale_init", "loss_scale_min"]))
@example(-200, "loss_scale_init").via("the run that trained nothing")
@example(-127, "loss_scale_init").via("below the bound")
@example(-126, "loss_scale_min").via("the bound")
@example(127, "loss_scale_min").via("the bound")
@example(128, "loss_scale_init").via("above the bound")
def test_loss_scales_are_powers_of_2_that_fp32_holds(exponent, key):
    """train.loss_scale_init or train.loss_scale_min = 2**e is accepted exactly when fp32 holds it as a normal
    number. Below, fp32 rounds it to a subnormal (scaling no longer exact) or to 0: at 2**-200 an fp16 run skipped
    every window for good, its scale 0 and every gradient 0/0, and trained nothing without a word. Above, fp32 rounds
    it to inf. The other key is set out of the way (init >= min is a rule of its own)."""
    scale, fp32 = 2.0 ** exponent, np.finfo(np.float32)
    other = ({"loss_scale_min": float(fp32.tiny)} if key == "loss_scale_init" else
             {"loss_scale_init": 2.0 ** 127})
    args = [f"--train.{key}={scale!r}", *(f"--train.{k}={v!r}" for k, v in other.items())]
    if float(fp32.tiny) <= scale <= float(fp32.max):
        assert getattr(config.load(args).train, key) == scale
    else:
        with pytest.raises(UserError, match=rf"^train\.{key}=.* must be a power of 2"):
            config.load(args)


def test_the_loss_scale_starts_at_or_above_its_floor():
    with pytest.raises(UserError, match=r"^train\.loss_scale_init=1024.0 is below train\.loss_scale_min=2048.0"):
        config.load(["--train.loss_scale_init=1024", "--train.loss_scale_min=2048"])
    assert config.load(["--train.loss_scale_init=1024", "--train.loss_scale_min=1024"]).train.loss_scale_min == 1024


# Float keys of each kind: a rate, a bound, an optional one, one jax never sees, a parameter group's.
FLOAT_FLAGS = ["--optim.lr={}", "--optim.eps={}", "--optim.max_grad_norm={}", "--optim.warmup_init_lr={}",
               "--log.peak_tflops={}", "--optim.groups={{wte: {{lr_scale: {}}}}}"]


@settings(deadline=None, derandomize=True, database=None, max_examples=300)
@given(flag=st.sampled_from(FLOAT_FLAGS), value=st.floats(allow_nan=False, allow_infinity=False))
@example(flag="--optim.lr={}", value=1e300).via("inf in jaxtrain's schedule")
@example(flag="--optim.lr={}", value=3.4028235677973366e38).via("rounds to float32's largest, not inf")
@example(flag="--optim.eps={}", value=1e-40).via("a subnormal, flushed on CPUs: m / (sqrt(v) + 0)")
@example(flag="--optim.eps={}", value=1e-46).via("0 in float32")
@example(flag="--optim.eps={}", value=2.0**-126).via("float32's smallest normal")
@example(flag="--optim.eps={}", value=2.0**-126 * (1 - 2.0**-30)).via("rounds up to it")
def test_a_float_is_refused_where_float32_cannot_hold_it(flag, value):
    """jax computes with the config's floats in float32: one that numpy's float32 makes inf, or a nonzero one it makes
    0 or subnormal (XLA flushes those to 0 on CPUs), is refused naming the key (by the float32 check, or first by a
    check of its range: lr=-1e300 must be > 0); any other is not refused for float32's sake."""
    with np.errstate(over="ignore"):
        in_float32 = np.float32(value)
    lost = np.isinf(in_float32) or (value != 0 and abs(in_float32) < np.finfo(np.float32).tiny)
    key = flag.split("=")[0].lstrip("-")
    try:
        config.load([flag.format(repr(value))])
        refused = None
    except UserError as e:
        refused = str(e)
    if lost:
        assert refused is not None and key in refused, refused
    else:
        assert refused is None or "float32" not in refused, refused
    if flag == "--optim.eps={}" and value > 0:  # a key whose other checks pass any positive value
        assert (refused is not None and "float32" in refused) == lost, refused


def test_missing_config_file():
    with pytest.raises(UserError, match="not found"):
        config.load(["--config", "/nope.yaml"])


def test_devices_must_split_the_micro_batch(yaml_path):
    cfg = config.load(["--config", yaml_path, "--data.batch_size=12", "--optim.grad_accum_steps=2"])
    assert mesh.validate_devices(cfg, 2) == (2, 1)
    with pytest.raises(UserError) as e:
        mesh.validate_devices(cfg, 4)
    assert str(e.value) == ("the micro-batch of 6 sequences (data.batch_size / optim.grad_accum_steps) does not split "
                            "over 4 devices; make data.batch_size a multiple of 8, or set optim.grad_accum_steps=1 "
                            "(the same batch in fewer, bigger micro-batches; a run without dropout may resume with it)")
    with pytest.raises(UserError, match=r"multiple of 16$"):  # 12 rows split over 8 devices in no accumulation
        mesh.validate_devices(cfg, 8)


def test_a_config_that_cannot_be_read_is_one_line(tmp_path, monkeypatch, caplog):
    """A folder, and a file in a bucket this machine cannot reach: gcsfs retried for ~50 s, logged each request it
    gave up on as an ERROR with its traceback, and raised aiohttp's connection error (a traceback more)."""
    with pytest.raises(UserError, match=r"^--config '.*' is a folder; pass a YAML file \(see configs/\)$"):
        config.load(["--config", str(tmp_path)])

    class Unreachable:
        def read_bytes(self):
            logging.getLogger("gcsfs").error("_request out of retries on exception: Cannot connect to host")
            raise OSError("Cannot connect to host storage.googleapis.com:443 ssl:default [Name or service not known]")

    monkeypatch.setattr(runfolder, "path", lambda *names: Unreachable())
    with pytest.raises(UserError) as e:
        config.load(["--config", "gs://their-bucket/run/config.yaml"])
    assert str(e.value) == ("config file 'gs://their-bucket/run/config.yaml' could not be read (OSError: Cannot "
                            "connect to host storage.googleapis.com:443 ssl:default [Name or service not known]); "
                            "check the network to it and the permissions")
    assert not [r for r in caplog.records if r.name == "gcsfs"]
    assert logging.getLogger("gcsfs").level == logging.NOTSET  # as it was


def test_cli_error_is_one_line_exit_2(yaml_path):
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", "--config", yaml_path, "--optim.lrr=1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: unknown config key 'optim.lrr'; did you mean optim.lr?"]


@pytest.mark.parametrize("flags", [
    ["--config", "{a}", "--config", "{b}"],
    ["--config={a}", "--config", "{b}"],
    ["--config", "{a}", "--config={b}"],
    ["--config={a}", "--train.steps=2", "--config={b}"],
])
def test_a_second_config_is_refused_not_read_over_the_first(yaml_path, tmp_path, flags):
    """Two --config in one line: the second used to replace the first, whose keys (lr, warmup, init.from) were
    dropped unsaid. Refused, naming both files and what to do instead, whichever way each flag is written."""
    other = tmp_path / "other.yaml"
    other.write_text("train: {steps: 7}\n")
    argv = [flag.format(a=yaml_path, b=other) for flag in flags]
    with pytest.raises(UserError) as e:
        config.load(argv)
    message = str(e.value)
    assert "\n" not in message
    assert repr(yaml_path) in message and repr(str(other)) in message
    assert "merge them into one file" in message and "--section.key=value" in message


@pytest.mark.parametrize("flags", [["--config="], ["--config", ""]])
def test_an_empty_config_path_is_refused_not_taken_for_no_config(flags):
    """`--config=$CFG` with CFG unset trained with the built-in defaults (1,000 steps into out/run), unsaid."""
    with pytest.raises(UserError, match=r"^--config is an empty path \(an unset variable\?\); pass a YAML file"):
        config.load(flags + ["--train.steps=2"])


@pytest.mark.parametrize("text, key, line", [
    ("optim: {lr: 3.0e-4, warmup_steps: 5}\ntrain: {steps: 20}\noptim:\n  lr: 1.0e-3\n", "optim", 3),
    ("model:\n  n_layer: 2\n  n_head: 2\n  n_layer: 3\n", "n_layer", 4),
    ("train: {steps: 20, steps: 30}\n", "steps", 1),
])
def test_a_key_given_twice_in_the_yaml_is_refused_not_the_last_one_kept(tmp_path, text, key, line):
    """PyYAML keeps a repeated key's last value: a section written twice lost the first copy's keys (their defaults
    trained: warmup_steps 100 where the file said 5). Refused, naming the key and its second line."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        config.load(["--config", str(path)])
    assert f"key {key!r} is given twice" in str(e.value) and f"at line {line}," in str(e.value)


def test_every_shipped_config_has_each_key_once():
    """The refusal above, on the project's own configs: each loads."""
    for name in sorted(os.listdir("configs")):
        config.load(["--config", os.path.join("configs", name), "--run.dry_run=true"])


@pytest.mark.parametrize("backend", ["jaxtrain", "torchref"])
def test_a_second_config_is_one_line_exit_2_in_both_backends(yaml_path, tmp_path, backend):
    other = tmp_path / "other.yaml"
    other.write_text("train: {steps: 7}\n")
    proc = subprocess.run([sys.executable, "-m", f"{backend}.run", "--config", "configs/tiny.yaml",
                           f"--config={other}", "--train.steps=2"], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: --config is given 2 times ('configs/tiny.yaml', {str(other)!r}) but a run reads one YAML file; "
        f"merge them into one file, or give the later file's keys as --section.key=value overrides"]


def test_help_lists_every_key(capsys):
    with pytest.raises(SystemExit) as e:
        config.load(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "--optim.grad_accum_steps=1" in out and "--init.from=null" in out and "--data.batch_size=32" in out


def test_each_default_help_prints_loads_back_as_that_default(capsys):
    """`--help` prints each key as an override; typed back in a shell, it is the default (None was printed, which a
    number refused and a text key took as the text 'None'; log.sample_prompt's new line as '\n', two characters)."""
    with pytest.raises(SystemExit):
        config.load(["--help"])
    flags = [shlex.split(line.split()[0])[0] for line in capsys.readouterr().out.splitlines()
             if line.lstrip().startswith("--")]
    defaults = config.Config()
    for flag in flags:
        section, name = flag[2:].split("=")[0].split(".")
        field = "from_" if name == "from" else name
        loaded = getattr(getattr(config.load([flag]), section), field)
        assert loaded == getattr(getattr(defaults, section), field), flag


def test_help_gives_each_key_the_comment_config_py_writes_for_it(capsys):
    """A key's comment reaches --help whether it sits after the key or on the lines above it, and whatever the key's
    type. draccus's reader, used before, passed over comments above and fields typed Literal["..."]: --help said
    nothing of optim.decay_mask, optim.groups, train.precision, the loss scaling or train.nan_policy."""
    with pytest.raises(SystemExit):
        config.load(["--help"])
    flags = {line.split()[0].split("=")[0]: line for line in capsys.readouterr().out.splitlines()
             if line.lstrip().startswith("--")}
    # config.py's comments, copied
    assert flags["--optim.schedule"].endswith(
        "cosine | linear | constant | constant_with_warmup | cosine_with_restarts")
    assert flags["--optim.decay_mask"].endswith(
        "ndim: decay params with ndim >= 2; names: all but bias/norm/embedding")
    assert "per-group LR multiplier and weight decay" in flags["--optim.groups"]
    assert "bf16 | fp16: bf16 or fp16 matmuls" in flags["--train.precision"]
    # one comment above the three
    for key in ("--train.loss_scale_init", "--train.loss_scale_growth_interval", "--train.loss_scale_min"):
        assert "fp16: dynamic loss scaling as torch's GradScaler" in flags[key]
    assert flags["--train.nan_policy"].endswith("halt (resume from the last checkpoint) or skip that update")
    assert flags["--train.eval_every"].endswith("optimizer steps between evaluations; 0: only at the end")
    assert flags["--optim.b1"].endswith("--optim.b1=0.9")  # no comment: none is made up


def test_help_names_every_choice_of_a_key_that_takes_a_few(capsys):
    """A key typed Literal[...] takes only its choices; --help says which (run.target_device said nothing)."""
    with pytest.raises(SystemExit):
        config.load(["--help"])
    flags = {line.split()[0].split("=")[0]: line for line in capsys.readouterr().out.splitlines()
             if line.lstrip().startswith("--")}
    checked = 0
    for section in dataclasses.fields(config.Config):
        for f in dataclasses.fields(section.type):
            literal = [t for t in (f.type, *typing.get_args(f.type)) if typing.get_origin(t) is typing.Literal]
            for choice in (typing.get_args(literal[0]) if literal else ()):
                assert str(choice) in flags[f"--{section.name}.{cmdline.yaml_name(f)}"], (f.name, choice)
                checked += 1
    assert checked >= 20


@pytest.mark.parametrize("name", sorted(os.listdir("configs")))
def test_shipped_configs_decode(name):
    """Every shipped config has only known keys of the right types (data.path may not exist on this machine)."""
    with open(os.path.join("configs", name)) as f:
        cfg = config.from_dict(yaml.safe_load(f))
    if cfg.data.path is None:
        config_checks.validate(cfg)


def test_trajectory_check_names_changed_keys_and_allows_extending(yaml_path):
    cfg = config.load(["--config", yaml_path, "--optim.decay_steps=100", "--train.steps=100"])
    saved = yaml.safe_load(config.dump(cfg))
    longer = config.load(["--config", yaml_path, "--optim.decay_steps=100", "--train.steps=300",
                          "--run.out_dir=/elsewhere", "--checkpoint.every=7"])
    same_run.check(saved, longer, "ckpt", 4, "jaxtrain")  # same schedule and model: extending is fine
    other_kernels = config.load(["--config", yaml_path, "--optim.decay_steps=100", "--train.steps=100",
                                 "--model.remat=full", "--model.attention=xla", "--model.vocab_tiles=4"])
    same_run.check(saved, other_kernels, "ckpt", 4, "jaxtrain")  # how the model computes may change
    for key in ("attention", "remat", "vocab_tiles", "residual_dtype"):  # a checkpoint from before these keys
        del saved["model"][key]
    same_run.check(saved, cfg, "ckpt", 4, "jaxtrain")
    with pytest.raises(UserError, match=r"decay length: 100 -> 300"):  # the default decay follows train.steps
        same_run.check(saved, config.load(["--config", yaml_path, "--train.steps=300"]), "ckpt", 4, "jaxtrain")
    with pytest.raises(UserError, match=r"model.n_layer: 4 -> 2.*--run.fresh=true"):
        same_run.check(saved, config.load(["--config", yaml_path, "--optim.decay_steps=100", "--train.steps=100",
                                           "--model.n_layer=2"]), "ckpt", 4, "jaxtrain")


@pytest.mark.parametrize("backend,start", [
    ("jaxtrain", "python -m jaxtrain.convert to-torch out/r/checkpoints/4 DST, then run with --init.from=DST"),
    ("torchref", "run with --init.from=out/r/checkpoints/4")])
def test_a_refused_resume_says_how_to_keep_the_change(yaml_path, backend, start):
    """Where the weights still fit the model, the refusal names the README's way on with the changed keys, a new run
    from the checkpoint's whole state (before: only starting over); a changed model shape cannot go that way."""
    common = ["--config", yaml_path, "--run.out_dir=out/r"]
    saved = yaml.safe_load(config.dump(config.load(common)))
    with pytest.raises(UserError) as e:
        same_run.check(saved, config.load([*common, "--optim.lr=5e-4"]), "out/r/checkpoints/4", 4, backend)
    assert str(e.value).endswith(
        f"(optim.lr: 0.0003 -> 0.0005); resume with the same config, or keep the changes and go on from step 4 in a "
        f"new run (a resume of out/r refuses the changed keys): {start} --run.out_dir=NEW; or start over with "
        f"--run.fresh=true or a new --run.out_dir")
    with pytest.raises(UserError) as e:  # the stream's dtype changes the numerics, not the weights' shapes
        same_run.check(saved, config.load([*common, "--train.precision=bf16", "--model.residual_dtype=bf16"]),
                       "out/r/checkpoints/4", 4, backend)
    assert "model.residual_dtype: 'fp32' -> 'bf16'" in str(e.value) and "keep the changes" in str(e.value)
    with pytest.raises(UserError) as e:
        same_run.check(saved, config.load([*common, "--model.n_layer=2"]), "out/r/checkpoints/4", 4, backend)
    assert str(e.value).endswith("(model.n_layer: 4 -> 2); resume with the same config, or start over with "
                                 "--run.fresh=true or a new --run.out_dir")


def test_a_key_that_stops_acting_is_not_named_as_changed(yaml_path):
    """Dropout 0.1 -> 0 is the change; the accumulation, compared only with dropout, was named too, as "1 -> None"."""
    for before, after in (("0.1", "0.0"), ("0.0", "0.1")):
        saved = yaml.safe_load(config.dump(config.load(["--config", yaml_path, f"--model.dropout={before}"])))
        with pytest.raises(UserError) as e:
            same_run.check(saved, config.load(["--config", yaml_path, f"--model.dropout={after}"]), "c", 4, "jaxtrain")
        assert f"(model.dropout: {before} -> {after}); " in str(e.value)


def test_a_run_whose_decay_followed_train_steps_extends_with_that_decay_length(yaml_path):
    """The decay length compared is the effective one: a run of 100 steps with no optim.decay_steps extends to 300
    with --optim.decay_steps=100 (before, refused as "optim.decay_steps: None -> 100"), and the refusal of a plain
    --train.steps=300 names that flag."""
    saved = yaml.safe_load(config.dump(config.load(["--config", yaml_path, "--train.steps=100"])))
    same_run.check(saved, config.load(["--config", yaml_path, "--train.steps=300", "--optim.decay_steps=100"]), "c",
                   4, "jaxtrain")
    with pytest.raises(UserError) as e:
        same_run.check(saved, config.load(["--config", yaml_path, "--train.steps=300"]), "c", 4, "jaxtrain")
    assert "(decay length: 100 -> 300; to go on with the schedule it had, pass --optim.decay_steps=100)" in str(e.value)


@pytest.mark.parametrize("saved_args,resumed_args,accepted", [
    # a schedule that does not decay: its decay length and min_lr do not act
    (["--optim.schedule=constant", "--optim.warmup_steps=0"], ["--optim.schedule=constant", "--optim.warmup_steps=0",
                                                               "--train.steps=300", "--optim.min_lr=0"], True),
    (["--optim.schedule=constant_with_warmup", "--train.steps=100"],
     ["--optim.schedule=constant_with_warmup", "--train.steps=300"], True),
    (["--optim.schedule=constant_with_warmup"], ["--optim.schedule=constant_with_warmup", "--optim.warmup_steps=7"],
     False),
    (["--optim.warmup_steps=0"], ["--optim.warmup_steps=0", "--optim.warmup_init_lr=0.5"], True),  # no warmup
    (["--optim.schedule=cosine"], ["--optim.schedule=cosine", "--optim.min_lr=0"], False),
    (["--optim.schedule=cosine"], ["--optim.schedule=cosine", "--optim.cycles=3"], True),
    (["--optim.schedule=cosine_with_restarts"], ["--optim.schedule=cosine_with_restarts", "--optim.cycles=3"], False),
    (["--optim.warmup_steps=1"], ["--optim.warmup_steps=1", "--optim.warmup_init_lr=0.0004"], False),
    # the warmup's start given as the value its default stands for, lr / (warmup_steps + 1), either way round
    (["--optim.lr=3e-3"], ["--optim.lr=3e-3", "--optim.warmup_init_lr=0.001"], True),
    (["--optim.lr=3e-3", "--optim.warmup_init_lr=0.001"], ["--optim.lr=3e-3"], True),
    (["--optim.lr=3e-3"], ["--optim.lr=3e-3", "--optim.warmup_init_lr=0.0011"], False),
    # loss scaling acts under fp16 only
    (["--train.precision=bf16"], ["--train.precision=bf16", "--train.loss_scale_init=1024"], True),
    (["--train.precision=fp16"], ["--train.precision=fp16", "--train.loss_scale_init=1024"], False),
    # the accumulation, at the same batch: the same batches and gradient without dropout, other masks with it
    (["--model.dropout=0", "--optim.grad_accum_steps=4"], ["--model.dropout=0", "--optim.grad_accum_steps=2"], True),
    (["--model.dropout=0.1", "--optim.grad_accum_steps=4"], ["--model.dropout=0.1", "--optim.grad_accum_steps=2"],
     False),
])
def test_a_key_is_compared_only_where_it_acts(yaml_path, saved_args, resumed_args, accepted):
    common = ["--config", yaml_path, "--data.batch_size=8", "--train.steps=100", "--optim.warmup_steps=2"]
    saved = yaml.safe_load(config.dump(config.load(common + saved_args)))
    resumed = config.load(common + resumed_args)
    if accepted:
        same_run.check(saved, resumed, "c", 4, "jaxtrain")
    else:
        with pytest.raises(UserError, match="the config differs from the one that wrote c"):
            same_run.check(saved, resumed, "c", 4, "jaxtrain")


def test_an_init_from_a_resume_does_not_read_is_named(yaml_path, capsys):
    """init.from starts a run; a resume reads its own checkpoint. One it was not started from is named as not read
    (before, it was ignored in silence, and config.yaml recorded it as where the run came from)."""
    saved = yaml.safe_load(config.dump(config.load(["--config", yaml_path])))  # started from /some/dir
    for overrides in ([], ["--init.from=null"], ["--init.from=/other"]):  # the run goes on with its own
        resumed = same_run.check(saved, config.load(["--config", yaml_path, *overrides]), "ckpt", 4, "jaxtrain")
        assert resumed.init.from_ == "/some/dir"
    assert capsys.readouterr().err == ("warning: init.from='/other' is not read: the run resumes from ckpt (init.from "
                                       "starts a run; this one started from /some/dir, which its config.yaml "
                                       "keeps)\n")
    saved["init"]["from"] = None
    resumed = same_run.check(saved, config.load(["--config", yaml_path, "--init.from=/other"]), "ckpt", 4, "jaxtrain")
    assert resumed.init.from_ is None
    assert capsys.readouterr().err.endswith("this one started from scratch, which its config.yaml keeps)\n")


def test_a_flow_mapping_without_a_space_after_its_colon_is_named(yaml_path):
    with pytest.raises(UserError) as e:
        config.load(["--config", yaml_path, '--optim.groups={"wte":{lr_scale:0.5}}'])
    assert str(e.value).endswith("(YAML reads 'lr_scale:0.5' as one key: write a space after the colon, as in "
                                 "{lr_scale: 0.5})")


def test_when_the_loops_log_evaluate_and_save(yaml_path):
    """Both backends' cadence, one rule (Config.logs_at, evaluates_at, saves_at): every n steps and at the last."""
    cfg = config.load(["--config", yaml_path, "--train.steps=10", "--log.every=4", "--train.eval_every=3",
                       "--checkpoint.every=5"])
    steps = range(1, 11)
    assert [s for s in steps if cfg.logs_at(s)] == [4, 8, 10]
    assert [s for s in steps if cfg.evaluates_at(s)] == [3, 6, 9, 10]
    assert [s for s in steps if cfg.saves_at(s)] == [5, 10]
    at_the_end = config.load(["--config", yaml_path, "--train.steps=10", "--train.eval_every=0"])
    assert [s for s in steps if at_the_end.evaluates_at(s)] == [10]


def test_trajectory_check_reads_keys_added_since_as_their_defaults(yaml_path):
    """A checkpoint written before optim.schedule, cycles and groups existed resumes under the defaults, and only
    under them; groups added or dropped are both a different trajectory."""
    cfg = config.load(["--config", yaml_path])
    saved = yaml.safe_load(config.dump(cfg))
    for key in ("schedule", "cycles", "groups"):
        del saved["optim"][key]
    same_run.check(saved, cfg, "ckpt", 4, "jaxtrain")
    with pytest.raises(UserError, match=r"optim.schedule: 'cosine' -> 'linear'"):
        same_run.check(saved, config.load(["--config", yaml_path, "--optim.schedule=linear"]), "ckpt", 4, "jaxtrain")
    grouped = config.load(["--config", yaml_path, "--optim.groups={wte: {lr_scale: 0.5}}"])
    with pytest.raises(UserError, match=r"optim.groups.wte.lr_scale: None -> 0.5"):
        same_run.check(saved, grouped, "ckpt", 4, "jaxtrain")
    with pytest.raises(UserError, match=r"optim.groups.wte.lr_scale: 0.5 -> None"):
        same_run.check(yaml.safe_load(config.dump(grouped)), cfg, "ckpt", 4, "jaxtrain")


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(yaml_path, tmp_path, monkeypatch):
    """`--run.out_dir=~/runs/x` reaches the trainer as typed (no shell expands ~ there), as does a YAML file's:
    the run went into ./~/runs/x. A ~ inside a path stays as written."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    cfg = config.load(["--config", yaml_path, "--run.out_dir=~/runs/x", "--data.path=~/data", "--init.from=~/init",
                       "--data.cache_dir=a/~b"])
    assert (cfg.run.out_dir, cfg.data.path, cfg.init.from_, cfg.data.cache_dir) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/data", f"{tmp_path}/init", "a/~b")
