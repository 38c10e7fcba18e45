"""The model that `python -m jaxtrain.sample` draws from and `python -m jaxtrain.evaluate` scores, with its model
config, the precision it computes in and, where the weights are a run's, that run's config (its data, its eval set):
a checkpoint of a jaxtrain run (--run, --step), or a folder of weights (--from), as nanoGPT's sample.py takes a
run's checkpoint or GPT-2's weights from Hugging Face; and the tokenizer its text is read with (text_tokenizer):

    Hugging Face   a GPT2LMHeadModel folder (config.json, model.safetensors or its shards); its tokenizer files
                   (vocab.json and merges.txt, or tokenizer.json) say its tokenizer where they are GPT-2's BPE
    torch format   what convert from-hf writes (its weights in nanoGPT's layout, config.json and the tokenizer files
                   kept beside them) or to-torch writes, and torchref's checkpoints (trainer_state.json's config)
    jaxtrain step  a step folder of a run, <run>/checkpoints/<step>, read as --run <run> --step <step> reads it

A run folder, or a step folder of one, may be in a bucket (a pod's run.out_dir=gs://...): read there as a resume
reads it. Other folders are read from a local disk.

Weights are computed in fp32 where no run's train.precision says otherwise (a Hugging Face model's own dtype is the
dtype it was stored in, not one it trained with).
"""

import argparse
import dataclasses
import os
from typing import Callable, NamedTuple

import jax
from flax import nnx

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import checkpoint_kind
from jaxtrain import checkpoint_model
from jaxtrain import convert
from jaxtrain import dryrun
from jaxtrain import gpt2_bpe
from jaxtrain import hf_format
from jaxtrain import kernel_choice
from jaxtrain import mesh as mesh_lib
from jaxtrain import model as model_lib
from jaxtrain import prepare as prepare_lib
from jaxtrain import run_tokenizer, runfolder, torch_format
from jaxtrain.autocast import COMPUTE_DTYPES
from jaxtrain.config import Config, ModelConfig
from jaxtrain.errors import NotTheCheckpoint, UserError

REPLACEMENT = "\ufffd".encode()  # what an id no tokenizer token has decodes to, as undecodable bytes do
RESTORE_TRIES = 3  # reads of the newest checkpoint of a run still training, each replaced as it was read: give up

# Where load puts the weights: None, on the default device; a list of devices, split over them; a rule, over those it
# picks from the config of the run they are a checkpoint of (None for a model without a run), before they are read.
Devices = list | Callable[[Config | None], list] | None


class Tokenizer(NamedTuple):
    encode: Callable[[str], list[int]]
    token_bytes: Callable[[int], bytes]
    size: int  # ids below this have bytes; a model's vocabulary may be padded past it
    eot: int | None = None  # the id that ends a document (prepare ends each with it), where the tokenizer has one

    def decode(self, ids) -> str:
        """Each id's bytes, read as UTF-8 with U+FFFD where they are not (a byte token may be part of a character),
        as tiktoken's decode does; ids past the tokenizer's, which training never showed, read as U+FFFD too."""
        pieces = (self.token_bytes(i) if i < self.size else REPLACEMENT for i in map(int, ids))
        return b"".join(pieces).decode("utf-8", errors="replace")


def tokenizer(name: str) -> Tokenizer:
    """A data folder's tokenizer by its meta.json name. Training reads any folder's ids; encoding a prompt and
    decoding tokens needs one of prepare's TOKENIZERS (another's ids, read as GPT-2's, would be refused or decode
    wrong)."""
    if name not in prepare_lib.TOKENIZERS:
        raise UserError(f"the data's tokenizer is {name!r}, and jaxtrain encodes and decodes text with "
                        f"{' or '.join(prepare_lib.TOKENIZERS)} only")
    if name == "bytes":  # surrogateescape: bytes of the command line that were not UTF-8 come back as they were
        return Tokenizer(lambda text: list(text.encode("utf-8", "surrogateescape")), lambda i: bytes([i]), 256)
    enc = gpt2_bpe.encoding()
    # <|endoftext|> may start a prompt, as in nanoGPT's sample.py (tiktoken refuses special tokens unless allowed)
    return Tokenizer(lambda text: enc.encode(text, allowed_special={"<|endoftext|>"}),
                     enc.decode_single_token_bytes, enc.n_vocab, enc.eot_token)


class Loaded(NamedTuple):
    params: object  # nnx.State on one device, or split over the devices load was given (mesh.model_mesh)
    model_cfg: ModelConfig
    precision: str
    step: int | None  # the checkpoint's; None for a Hugging Face model
    source: str  # what the header line names: "step 40 of out/tiny", a folder
    where: str  # the run folder or the folder of weights, as given
    cfg: Config | None = None  # the config of the run the weights are a checkpoint of; None for a Hugging Face model
    data_fingerprint: str | None = None  # of the data that run trained on, where its checkpoint records it
    data_seed: int | None = None  # that run's data seed (its batch order and eval set), where recorded


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The command-line arguments that say which model sample or evaluate reads (load), and in what precision."""
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run folder (its run.out_dir), e.g. out/tiny or gs://bucket/run")
    source.add_argument("--from", dest="from_", metavar="FOLDER",
                        help="a Hugging Face GPT-2 folder (save_pretrained's), a torch-format checkpoint (what "
                             "convert from-hf or to-torch writes, torchref's) or a jaxtrain step folder (in a bucket "
                             "too)")
    ap.add_argument("--step", type=int, help="the run's checkpoint's step; default: the newest complete one")
    ap.add_argument("--precision", choices=tuple(COMPUTE_DTYPES),
                    help="default: the run's train.precision (fp32 for a Hugging Face model)")


def load(args: argparse.Namespace, command: str, devices: Devices = None) -> Loaded:
    """The model add_arguments' `args` name, for `command` ("sample", "evaluate": what the refusals say to do with
    another checkpoint or folder), on the default device or, given `devices` (a list, or a rule: Devices), split over
    them as mesh.model_mesh lays out a model of its run's mesh.fsdp (1 for a Hugging Face model's)."""
    if args.from_ is not None and args.step is not None:
        raise UserError(f"--step picks a checkpoint of --run; --from {args.from_} names one folder of weights "
                        f"already: leave --step out")
    if args.from_ is None:
        return from_run(args.run, args.step, args.precision, command, devices)
    return from_folder(args.from_, args.precision, command, devices)


def from_run(run_dir: str, step: int | None, precision: str | None, command: str,
             devices: Devices = None) -> Loaded:
    """The run's params at `step` (None: the newest complete checkpoint) on one device (or over `devices`: load), its
    config and the precision to compute in (None: the run's train.precision). `command` ("sample", "evaluate") is
    what the refusals say to do with another checkpoint."""
    runfolder.check_given(run_dir, "--run", "the run folder, e.g. --run out/tiny")
    checkpoint_kind.check_jaxtrain_run(run_dir, "--run")  # in a bucket, first that its store answers
    if not checkpoint_kind.is_folder(run_dir):  # else said to hold no complete checkpoint, as a run that saved none
        raise UserError(f"--run {run_dir} does not exist; pass the run.out_dir of a jaxtrain run")
    step, (weights, cfg, meta) = _restore(run_dir, step, command, devices)
    return _of_run(weights.params, cfg, step, meta, precision, run_dir)


def _of_run(params, cfg: Config, step: int, meta: dict, precision: str | None, where: str) -> Loaded:
    """Loaded of a run's checkpoint of `step` held at `where` (its config `cfg`; `meta`: its data_fingerprint and
    data_seed, where recorded), in its train.precision unless given."""
    return Loaded(params, cfg.model, precision or cfg.train.precision, step, f"step {step} of {where}", where, cfg,
                  meta.get("data_fingerprint"), meta.get("data_seed", cfg.run.seed))


def computed_here(model_cfg: ModelConfig, precision: str) -> tuple[ModelConfig, list[str]]:
    """(the config a checkpoint's model computes with in `precision` outside its run, the kernel settings whose kernel
    that changes): the forward kernels the defaults pick, not one the run named (kernel_choice.runs_anywhere: the same
    function); its residual stream bf16 only under bf16, as config_checks holds a run to."""
    model_cfg, changed = kernel_choice.runs_anywhere(model_cfg, precision)
    stream = model_cfg.residual_dtype if precision == "bf16" else "fp32"
    return dataclasses.replace(model_cfg, residual_dtype=stream), changed


def text_tokenizer(loaded: Loaded, given: str | None) -> Tokenizer:
    """The tokenizer the text of `loaded`'s model is read with: `given` (--tokenizer) or, for a run's checkpoint,
    that of the run's data (run_tokenizer.chosen), for a Hugging Face folder the one its files are
    (run_tokenizer.of_hf_folder)."""
    if loaded.cfg is not None:
        name = run_tokenizer.chosen(loaded.cfg, loaded.data_fingerprint, given, loaded.where)
    else:
        name = run_tokenizer.of_hf_folder(loaded.where, given, loaded.model_cfg.vocab_size)
    return _text_tokenizer(name, loaded.model_cfg.vocab_size, loaded.where)


def _restore(run_dir: str, step: int | None, command: str, devices: Devices):
    """(step, convert.restore_step's (weights, config, meta)) of checkpoint `step`, or with None of the newest one.

    A run still training deletes its older checkpoints once a newer one is saved (checkpoint.max_to_keep), so the
    newest can vanish while it is read: when it is no longer the newest afterwards, the new newest is read, up to
    RESTORE_TRIES times. One that fails while it is still the newest is refused as it is: it is corrupt."""
    for _ in range(RESTORE_TRIES):
        steps = checkpoint_lib.saved_steps(run_dir)
        if not steps:
            raise UserError(f"{run_dir} holds no complete checkpoint (no "
                            f"{os.path.join(run_dir, 'checkpoints', '<step>')}); pass the run.out_dir of a run that "
                            f"saved one")
        if step is not None and step not in steps:
            raise UserError(f"{run_dir} has no checkpoint of step {step}; its steps are {', '.join(map(str, steps))}")
        chosen = steps[-1] if step is None else step
        others = ", ".join(str(s) for s in steps if s != chosen)
        fix = (f"{command} another of its checkpoints with --step ({others})" if others else
               f"its run has no other checkpoint to {command}")
        try:
            return chosen, convert.restore_step(os.path.join(run_dir, "checkpoints", str(chosen)), fix, devices,
                                                weights_only=True)
        except NotTheCheckpoint:
            raise  # the next newest is no smaller, nor are the flags other for it
        except UserError:
            if step is not None or checkpoint_lib.saved_steps(run_dir)[-1:] == [chosen]:
                raise
    raise UserError(f"{run_dir} is still training and replaced its newest checkpoint while it was read, "
                    f"{RESTORE_TRIES} times; raise its checkpoint.max_to_keep (older steps then stay to be read) or "
                    f"{command} once the run has ended")


def _text_tokenizer(name: str, vocab_size: int, where: str) -> Tokenizer:
    """The tokenizer `name` (the model's, or --tokenizer), never one with more tokens than the model of `where` has
    embeddings."""
    try:
        text_tokenizer = tokenizer(name)
    except UserError as e:
        raise UserError(f"{e}; sample {where} outside jaxtrain, with its data's tokenizer (`python -m jaxtrain."
                        f"convert to-torch` writes its checkpoint in nanoGPT's format)") from None
    if text_tokenizer.size > vocab_size:  # its ids past the model's have no embedding, and those below are not its
        fix = ("pass --tokenizer bytes" if name != "bytes" and tokenizer("bytes").size <= vocab_size else
               "sample it outside jaxtrain, with its data's tokenizer")
        raise UserError(f"--tokenizer {name} has {text_tokenizer.size} tokens, more than the {vocab_size} of the "
                        f"model of {where}: the run was trained with another tokenizer; {fix}")
    return text_tokenizer


def from_folder(src: str, precision: str | None, command: str, devices: Devices = None) -> Loaded:
    """The model of the folder of weights `src` (--from: see the module's docstring) on one device (or over `devices`:
    load), its config and the precision to compute in (None: the run's train.precision where a run's config is there,
    else fp32). `command` ("sample", "evaluate") is what the refusals say to do with another folder."""
    runfolder.check_given(src, "--from", "a folder of weights, e.g. --from my-gpt2-hf")
    if runfolder.is_url(src):  # a step folder of a run in a bucket, the only kind read there
        checkpoint_kind.check_jaxtrain_step(src, command)
        found = checkpoint_kind.JAXTRAIN_STEP
    else:
        found = checkpoint_kind.check_model_source(src, command)
    if found == checkpoint_kind.JAXTRAIN_STEP:
        weights, cfg, meta = convert.restore_step(src, f"{command} another step folder of its run", devices,
                                                  weights_only=True)
        return _of_run(weights.params, cfg, int(weights.step), meta, precision, src)
    if found == checkpoint_kind.TORCH and os.path.exists(os.path.join(src, checkpoint_kind.TRAINER_STATE)):
        trainer_state = checkpoint_kind.read_trainer_state(src)  # to-torch's, torchref's
        cfg = checkpoint_model.written_config(src, trainer_state)
        devices = _picked(devices, cfg)  # before the weights are read
        params = torch_format.load_params(src, _template(cfg.model), lambda shapes: checkpoint_model.model_keys_hint(
            shapes, cfg.model, checkpoint_kind.TRAINER_STATE))
        meta = {"data_fingerprint": trainer_state.get("data_fingerprint"), "data_seed": trainer_state["data"]["seed"]}
        return placed(_of_run(params, cfg, trainer_state["step"], meta, precision, src), devices)
    devices = _picked(devices, None)  # before the weights are read
    return placed(_from_hf(src, found, precision), devices)


def _picked(devices: Devices, run: Config | None) -> list | None:
    """The devices `devices` names for a model of the `run` (None: without one)."""
    return devices(run) if callable(devices) else devices


def placed(loaded: Loaded, devices: list | None) -> Loaded:
    """`loaded` as it is (None: on the default device), or with its params split over `devices` as mesh.model_mesh
    lays out a model of its run's mesh.fsdp (1 without a run: a Hugging Face model whole on each)."""
    if devices is None:
        return loaded
    mesh = mesh_lib.model_mesh(fsdp_of(loaded.cfg), devices)
    with dryrun.out_of_memory(lambda needs: dryrun.TooBig(
            f"placing the weights of {loaded.where} ({_layout(mesh)}) {needs}; load them onto "
            f"{dryrun.more_memory(devices[0], copies=mesh.shape['data'])}")):
        params = jax.device_put(loaded.params, mesh_lib.fsdp_sharding(mesh, loaded.params))
        return loaded._replace(params=jax.block_until_ready(params))  # (an allocator refuses as it is done)


def _layout(mesh: jax.sharding.Mesh) -> str:
    """How a model's weights lie on `mesh`, as a refusal says it."""
    if mesh.size == 1:
        return "on one device"
    if mesh.shape["fsdp"] == 1:
        return f"whole on each of {mesh.size} devices"
    return f"each split over {mesh.shape['fsdp']} of {mesh.size} devices"


def machine_devices(count: int | None) -> list:
    """The first `count` of this machine's devices (--devices), or all of them."""
    available = jax.devices()
    if count is not None and not 1 <= count <= len(available):
        raise UserError(f"--devices {count}: this machine has {len(available)} {available[0].device_kind} device"
                        f"{'s' if len(available) > 1 else ''}; pass a count from 1 to {len(available)}")
    return available if count is None else available[:count]


def mesh_of(loaded: Loaded) -> jax.sharding.Mesh:
    """The mesh `loaded`'s params were placed on (load's devices)."""
    return jax.tree.leaves(loaded.params)[0].sharding.mesh


def on_devices(loaded: Loaded) -> str:
    """What a header says of the devices computing: nothing of one."""
    mesh = mesh_of(loaded)
    if mesh.size == 1:
        return ""
    return (f", on {mesh.size} {mesh.devices.flat[0].device_kind} devices (data {mesh.shape['data']} x fsdp "
            f"{mesh.shape['fsdp']})")


def fsdp_of(run: Config | None) -> int:
    """The mesh.fsdp of the `run` a model's weights are a checkpoint of; 1 without a run (a Hugging Face model)."""
    return run.mesh.fsdp if run is not None else 1


def _from_hf(src: str, found: str, precision: str | None) -> Loaded:
    """from_folder of a Hugging Face folder (found: HF; a Trainer's checkpoint-N/ holds a trainer_state.json of its
    own) or of from-hf's (TORCH: nanoGPT's layout beside the config.json it kept)."""
    if found == checkpoint_kind.HF:
        tensors, model, _, _ = hf_format.read_model(src)
    else:
        model = hf_format.model_overrides(hf_format.read_config(src), os.path.join(src, hf_format.CONFIG))
    model_cfg = ModelConfig(**model)

    def hint(shapes: dict) -> str:
        return checkpoint_model.model_keys_hint(shapes, model_cfg, hf_format.CONFIG)

    params = (torch_format.params_from(_template(model_cfg), tensors, hf_format.weights_file(src), hint)
              if found == checkpoint_kind.HF else torch_format.load_params(src, _template(model_cfg), hint))
    return Loaded(params, model_cfg, precision or "fp32", None, src, src)


def _template(model_cfg: ModelConfig) -> nnx.State:
    """The model's params as shapes alone (as checkpoint.abstract_state makes a run's), to read weights into on the
    default device: initialised ones would cost GPT-2 XL's 6 GB twice. The attention kernel shapes none, and
    cuDNN's, which a GPU run may have trained with, refuses a machine without a GPU (as convert's _for_shapes)."""
    written_out = dataclasses.replace(model_cfg, attention="xla")
    return jax.eval_shape(lambda: model_lib.init_params(written_out, vocab_size=model_cfg.vocab_size,
                                                        precision="fp32", seed=0)[1])
