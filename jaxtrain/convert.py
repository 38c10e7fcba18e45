"""`python -m jaxtrain.convert to-torch|from-torch|to-hf|from-hf SRC DST`: jaxtrain checkpoints <-> the torch
format, and to and from Hugging Face's GPT-2 folder (hf_format.py).

    python -m jaxtrain.convert to-torch out/tiny/checkpoints/400 out/tiny-torch
    python -m torchref.run --config configs/tiny.yaml --init.from=out/tiny-torch \
        --run.out_dir=out/tiny-torchref                                             # continues at step 400
    python -m jaxtrain.convert from-torch out/tiny-torch out/tiny-back
    python -m jaxtrain.run --config out/tiny-back/config.yaml                       # resumes at step 400

Both directions keep params and AdamW's state bit for bit (jaxtrain/torch_format.py). A jaxtrain step folder is
self-describing: its `meta` item holds the config that built the state, so no --config is needed. Conversion runs
on one device whatever mesh trained the run, so the whole state must fit in one device's memory (to-hf reads the
weights alone).
"""

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
from typing import Callable, NamedTuple

import jax
import orbax.checkpoint as ocp
from flax import nnx

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import checkpoint_kind
from jaxtrain import checkpoint_model
from jaxtrain import config as config_lib
from jaxtrain import dryrun
from jaxtrain import gpt2_bpe
from jaxtrain import hf_format
from jaxtrain import mesh as mesh_lib
from jaxtrain import orbax_quiet
from jaxtrain import prepare as prepare_lib
from jaxtrain import run_tokenizer, runfolder
from jaxtrain import step as step_lib
from jaxtrain import torch_format
from jaxtrain.config import Config
from jaxtrain.errors import NotTheCheckpoint, OneLineParser, UserError, exit_on_user_error


def to_torch(step_dir: str, out_dir: str) -> None:
    """A jaxtrain step folder (<out_dir>/checkpoints/<step>) -> a torch-format folder."""
    torch_format.check_new_folder(out_dir)
    checkpoint_kind.check_jaxtrain_step(step_dir, "to-torch")
    state, cfg, meta = restore_step(step_dir)
    torch_format.export(state, cfg, out_dir, meta.get("data_seed", cfg.run.seed), meta.get("data_fingerprint"),
                        meta.get("tokens"))
    print(f"wrote {out_dir} (step {int(state.step)}) from {step_dir}", file=sys.stderr)


def to_hf(src: str, out_dir: str, tokenizer: str | None = None, dtype: str | None = None) -> None:
    """A jaxtrain step folder or a torch-format folder (one from-hf wrote, too) -> a Hugging Face GPT-2 folder;
    `tokenizer` (--tokenizer): the run's, where its data folder is not on this machine to say; `dtype` (--dtype):
    the weights', by default float32 (a run's are) or, for from-hf's folder, what its config.json says they were."""
    torch_format.check_new_folder(out_dir)
    cfg, data_fingerprint = None, None  # a run's config, which names its data and so its tokenizer
    if runfolder.is_url(src) or checkpoint_kind.kind(src) != checkpoint_kind.TORCH:  # a Hugging Face folder too:
        checkpoint_kind.check_jaxtrain_step(src, "to-hf")  # its weights are laid out as Conv1D's, transposed again
        weights, cfg, meta = restore_step(src, weights_only=True)
        tensors, data_fingerprint = torch_format.model_tensors(weights.params), meta.get("data_fingerprint")
    else:
        tensors = hf_format.read_tensors(src)
        if os.path.exists(os.path.join(src, torch_format.TRAINER_STATE)):  # with or without the optimizer's file
            trainer_state = checkpoint_kind.read_trainer_state(src)
            cfg = config_lib.from_dict(trainer_state["config"])
            data_fingerprint = trainer_state.get("data_fingerprint")
        elif not os.path.exists(os.path.join(src, hf_format.CONFIG)):
            raise UserError(f"to-hf SRC {src} holds weights alone, with neither {torch_format.TRAINER_STATE} (a "
                            f"checkpoint's, which holds its model config) nor {hf_format.CONFIG} (from-hf's) to say "
                            f"the model's shape; convert the checkpoint folder the weights came from")
    if cfg:
        vocab_rows = tensors[checkpoint_kind.WTE].shape[0]
        config, carried = hf_format.hf_config(cfg.model, vocab_rows), ()
        with_bpe, note = _run_tokenizer(cfg, data_fingerprint, vocab_rows, tokenizer, src)
        if not cfg.model.bias:  # HF's GPT-2 always has biases
            tensors, zeros_note = hf_format.with_zero_biases(tensors, cfg.model, src)
            note += zeros_note
    elif tokenizer is not None:
        raise UserError(f"--tokenizer: {src} holds no run's config (from-hf's weights), and to-hf carries its "
                        f"tokenizer files as they are; leave --tokenizer out")
    else:  # weights that from-hf wrote, with the model's config.json and the files it carried beside them
        config, carried, with_bpe = hf_format.read_config(src), hf_format.carried_files(src), False
        note = _carried_tokenizer_note(carried)
        model = hf_format.model_overrides(config, os.path.join(src, hf_format.CONFIG))
        if not model["bias"]:  # from-hf left out the zero biases of a model to-hf wrote without them
            tensors, zeros_note = hf_format.with_zero_biases(tensors, config_lib.ModelConfig(**model), src,
                                                             f"{hf_format.BIAS}: false")
            note += zeros_note
    written, why = dtype or "float32", ""
    if dtype is None and not cfg and (saved := hf_format.saved_dtype(config)) != "float32":  # from-hf's folder
        if hf_format.held_exactly(tensors, saved):
            written, why = saved, f" ({hf_format.CONFIG}'s dtype: from-hf read them in it)"
        else:
            note += (f"; the weights are float32: {hf_format.CONFIG} says {saved}, and they are not all {saved} "
                     f"values (changed since from-hf read them?); --dtype {saved} rounds them")
    tensors, dtype_note = hf_format.in_dtype(tensors, written, src, why)
    note += dtype_note
    hf_format.write(out_dir, hf_format.from_nanogpt(tensors), {**config, "dtype": written, "torch_dtype": written},
                    gpt2_bpe.files() if with_bpe else None, carried)
    print(f"wrote {out_dir}: load it with transformers.GPT2LMHeadModel.from_pretrained({out_dir!r}){note}",
          file=sys.stderr)


def _run_tokenizer(cfg: Config, data_fingerprint: str | None, vocab_rows: int, given: str | None,
                   src: str) -> tuple[bool, str]:
    """(whether to-hf writes GPT-2's BPE files beside a run's model, what it says of its tokenizer): `given` or that
    of the data the run trained on (run_tokenizer's rule, jaxtrain.sample's too), and never one with more tokens
    than the model has embedding rows."""
    try:
        tokenizer = run_tokenizer.chosen(cfg, data_fingerprint, given, src)
    except UserError as e:
        if given is not None:  # another than the run's own
            raise
        return False, f"; no tokenizer files: {e}"
    gpt2_tokens = gpt2_bpe.EOT_ID + 1
    if tokenizer == "gpt2" and vocab_rows >= gpt2_tokens:
        source = "--tokenizer says" if given else "the run's data"
        return True, f" and its tokenizer with AutoTokenizer.from_pretrained (GPT-2's BPE, as {source})"
    if tokenizer == "gpt2" and given:
        raise UserError(f"--tokenizer gpt2 has {gpt2_tokens} tokens, more than the {vocab_rows} embedding rows of "
                        f"{src}: the run was trained with another tokenizer; leave --tokenizer out, or pass bytes if "
                        f"its data was")
    if tokenizer == "gpt2":  # a checkpoint with no data fingerprint, whose data folder was prepared again since
        why = (f"the run's data folder names GPT-2's BPE, whose {gpt2_tokens} tokens are more than the model's "
               f"{vocab_rows} embedding rows: the run was trained with another tokenizer")
    elif tokenizer == "bytes":
        why = "the run's tokens are bytes (id = byte value: list(text.encode()))"
    else:  # a meta.json written by another tool than jaxtrain.data prepare
        why = f"the run's data names the tokenizer {tokenizer!r}, and to-hf writes GPT-2's BPE files only"
    return False, f"; no tokenizer files: {why}"


def _carried_tokenizer_note(carried: tuple[str, ...]) -> str:
    """What to-hf says of the tokenizer files of a folder without a run's config (from-hf's), carried as they are."""
    names = [os.path.basename(file) for file in carried if os.path.basename(file) in hf_format.TOKENIZER_FILES]
    if names:
        return f" and its tokenizer ({', '.join(names)}, as from-hf found them) with AutoTokenizer.from_pretrained"
    return "; no tokenizer files: the folder holds none, nor says which data it was trained on"


def from_hf(src: str, out_dir: str) -> None:
    """A Hugging Face GPT-2 folder -> a torch-format folder of weights (its config.json kept beside them), which
    `--init.from` starts a run from."""
    torch_format.check_new_folder(out_dir)
    checkpoint_kind.check_hf_source(src)
    tensors, model, config, note = hf_format.read_model(src)
    hf_format.write(out_dir, tensors, config, carried=hf_format.carried_files(src))
    print(f"wrote {out_dir}{note}; fine-tune it with `python -m jaxtrain.run --config CONFIG "
          f"{checkpoint_model.model_flags(model)} "
          f"--init.from={out_dir}`", file=sys.stderr)


def _convert_another(step_dir: str) -> str:
    """What to do when the step folder <run>/checkpoints/<step> is corrupt: convert one of the run's other steps."""
    checkpoints, name = runfolder.parent_and_name(step_dir)
    run_dir, folder = runfolder.parent_and_name(checkpoints)
    steps = checkpoint_lib.saved_steps(run_dir or ".") if folder == "checkpoints" else []
    others = ", ".join(os.path.join(checkpoints, str(step)) for step in steps if str(step) != name)
    return "convert another step folder of the run" + (f" ({others})" if others else "")


class Weights(NamedTuple):
    """A step folder's params and its optimizer step, read without the optimizer's state (restore_step's
    weights_only): what sample, evaluate and to-hf need, a quarter of a run's checkpoint (AdamW's two moments and
    MultiSteps' gradient sum are each as large: GPT-2 124M's evaluate read 472 of 1,888 MiB, its peak RSS 4.6 GB ->
    1.3 GB)."""
    params: nnx.State
    step: jax.Array


def restore_step(step_dir: str, fix: str | None = None, devices: list | Callable[[Config], list] | None = None,
                 weights_only: bool = False):
    """(state, config, meta) of a jaxtrain step folder (checkpoint_kind.check_jaxtrain_step), restored on one device
    (or split over `devices`, or over those it picks from the run's config, as mesh.model_mesh lays a model out for
    its run's mesh.fsdp; its refusal is a NotTheCheckpoint) and checked against its fingerprint, as a resume checks
    it: one that cannot be read or does not match is refused with `fix`, what the caller's user can do instead (by
    default, convert another of the run's steps, which are listed only then).
    weights_only: the state is Weights, the arrays read and checked those alone (orbax's partial restore)."""
    root, name = runfolder.parent_and_name(os.fspath(runfolder.path(step_dir)))  # a bucket's too (gs://)
    step = int(name)
    orbax_quiet.filter_logs()  # a corrupt step: one line, not orbax's tracebacks and its loops' (as a resume)
    with orbax_quiet.DRAINING.meanwhile(), ocp.CheckpointManager(root, item_handlers={
            "meta": ocp.JsonCheckpointHandler()}) as manager:
        with _unreadable(step_dir, fix):
            meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    try:
        checkpoint_lib.check_named_step(meta, step, step_dir)
    except checkpoint_lib.CorruptCheckpoint as e:
        raise UserError(f"{e}; {fix or _convert_another(step_dir)}") from None
    cfg = config_lib.from_dict(meta["config"])  # jaxtrain.run writes the resolved model.vocab_size into it
    if callable(devices):  # picked before the weights are read, so they are read once, where they are computed
        try:
            devices = devices(cfg)
        except UserError as e:  # the command's flags, refused for the run's config as this checkpoint records it
            raise NotTheCheckpoint(str(e)) from None
    mesh = mesh_lib.one_device_mesh() if devices is None else mesh_lib.model_mesh(cfg.mesh.fsdp, devices)
    target = checkpoint_lib.abstract_state(_for_shapes(cfg), cfg.model.vocab_size, mesh)
    if weights_only:  # the fingerprint's paths of these: "params/...", "opt_state/gradient_step"
        target = {"params": target.params, "opt_state": {"gradient_step": target.opt_state.gradient_step}}
    args = ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                                  partial_restore=weights_only)
    with orbax_quiet.DRAINING.meanwhile(), _unreadable(step_dir, fix, mesh):
        state = ocp.PyTreeCheckpointHandler().restore(runfolder.path(step_dir) / "state", args=args)
    _check_read(state, step_dir, fix)
    if "fingerprint" in meta:  # checkpoints of jaxtrain before fingerprints have none to check against
        try:
            checkpoint_lib.check_fingerprint(state, meta["fingerprint"], step_dir,
                                             ("params/", "opt_state/gradient_step") if weights_only else ("",))
        except checkpoint_lib.CorruptCheckpoint as e:
            raise UserError(f"{e}: it is corrupt; {fix or _convert_another(step_dir)}") from None
    return (Weights(state["params"], state["opt_state"]["gradient_step"]) if weights_only else state), cfg, meta


def _check_read(state, step_dir: str, fix: str | None) -> None:
    """Refuse a state in which orbax's partial restore left an array of the target unread: one the checkpoint lacks
    comes back as the target's ShapeDtypeStruct, without an error (orbax 0.12's placeholders)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise UserError(f"checkpoint {step_dir} cannot be read (it holds no "
                            f"{jax.tree_util.keystr(path, simple=True, separator='/')}); "
                            f"{fix or _convert_another(step_dir)}")


def from_torch(src: str, out_dir: str) -> None:
    """A torch-format folder -> a jaxtrain run folder: <out_dir>/config.yaml (the checkpoint's config, with
    run.out_dir=out_dir) and the Orbax checkpoint <out_dir>/checkpoints/<step>, where jaxtrain.run resumes."""
    torch_format.check_new_folder(out_dir)
    checkpoint_kind.check_torch_source(src, "SRC")
    if not checkpoint_kind.holds_training_state(src):
        raise UserError(f"{src} holds weights only (no {torch_format.OPTIMIZER} and {torch_format.TRAINER_STATE}), not "
                        f"a training state to resume; start a run from it with --init.from={src} instead")
    trainer_state = checkpoint_kind.read_trainer_state(src)
    cfg = checkpoint_model.written_config(src, trainer_state)  # vocab_size: the run folder depends on no data for it
    # run.seed orders jaxtrain's batches: the run goes on with the data order the checkpoint was trained on.
    # An absolute run.out_dir: config.yaml resumes the run from any folder (a relative one named a folder below it).
    cfg.run.out_dir, cfg.run.seed, cfg.run.fresh = os.path.abspath(out_dir), trainer_state["data"]["seed"], False
    state, _ = torch_format.load(src, step_lib.fresh_state(_for_shapes(cfg), cfg.model.vocab_size), cfg,
                                 torch_format.TRAINER_STATE)
    _check_finite(state, src)
    existed = os.path.isdir(out_dir)
    try:
        checkpointer = checkpoint_lib.Checkpointer(cfg, trainer_state.get("data_fingerprint"))
        try:
            checkpointer.save(state, cfg.run.seed, tokens=trainer_state["data"].get("tokens"))
            checkpointer.wait()
        finally:
            checkpointer.close()  # the save's writes end here, before a failure removes what they wrote
        # Last: a conversion killed before it (kill -9 runs no clean-up) leaves no config.yaml, whose resume
        # command would have trained from step 0 beside an empty checkpoints/.
        config_lib.save(cfg, out_dir)
    except BaseException:  # a complete conversion or nothing, as the other conversions (folder_into_place)
        shutil.rmtree(out_dir, ignore_errors=True)
        if existed:  # it was an empty folder (check_new_folder): left as it was
            os.makedirs(out_dir, exist_ok=True)
        raise
    print(f"wrote {out_dir} (step {int(state.step)}); resume with "
          f"`python -m jaxtrain.run --config {os.path.join(cfg.run.out_dir, 'config.yaml')}`", file=sys.stderr)


def _check_finite(state, src: str) -> None:
    """A torch-format state holding inf or NaN is refused before anything is written: a run resumed from it would
    train on nothing (jaxtrain's saves refuse such a state too)."""
    if (name := step_lib.non_finite_leaf(state)) is not None:
        raise UserError(f"{src} holds inf or NaN ({name}), which no run can resume from; convert a checkpoint saved "
                        f"before its values overflowed")


@contextlib.contextmanager
def _unreadable(step_dir: str, fix: str | None, mesh: jax.sharding.Mesh | None = None):
    """Orbax's failures (ValueError, FileNotFoundError, tensorstore errors, ...) as one UserError (restore_step's
    `fix`); the memory of `mesh`'s devices too small for the arrays read onto them (XLA's RESOURCE_EXHAUSTED, not a
    store's: a bucket's rate limit or a full disk say it too) as dryrun.TooBig, whose fix is no other checkpoint."""
    try:
        yield
    except Exception as e:
        out_of_memory = isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)  # no store's
        if out_of_memory and mesh is not None:
            where = dryrun.more_memory(mesh.devices.flat[0], copies=mesh.shape["data"])
            raise dryrun.TooBig(f"checkpoint {step_dir} needs more memory than a device has to be read "
                                f"({runfolder.error_text(e)}); read it onto {where}") from None
        raise UserError(f"checkpoint {step_dir} cannot be read ({runfolder.error_text(e)}); "
                        f"{fix or _convert_another(step_dir)}") from None


def _for_shapes(cfg: Config) -> Config:
    """`cfg` with the written-out attention, to build the state's shapes from: the attention kernel shapes no
    param, and cuDNN's (model.attention=cudnn, which a GPU run may have trained with) refuses a machine without a
    GPU, where conversions run. The config written out stays the run's."""
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="xla"))


def _parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m jaxtrain.convert",
        description="Convert checkpoints between jaxtrain (Orbax) and the torch format that torchref writes "
                    "(model.safetensors, optimizer.safetensors, trainer_state.json), lossless both ways; and "
                    "to and from a Hugging Face GPT2LMHeadModel folder (weights).",
        epilog="examples:\n"
               "  python -m jaxtrain.convert to-torch out/tiny/checkpoints/400 out/tiny-torch\n"
               "  python -m jaxtrain.convert from-torch out/tiny-torch out/tiny-back\n"
               "  python -m jaxtrain.run --config out/tiny-back/config.yaml    # resumes at step 400\n"
               "  python -m jaxtrain.convert to-hf out/tiny/checkpoints/400 out/tiny-hf    # for transformers\n"
               "  python -m jaxtrain.convert from-hf my-gpt2-hf out/my-gpt2    # prints the run that fine-tunes it",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    to = sub.add_parser("to-torch", help="jaxtrain step folder -> torch-format folder",
                        description="Export one jaxtrain checkpoint; its config is read from the checkpoint.")
    to.add_argument("src", help="a jaxtrain step folder, e.g. out/tiny/checkpoints/400 (or in a bucket, gs://...)")
    to.add_argument("dst", help="the torch-format folder to create (must not exist, or be empty)")
    back = sub.add_parser("from-torch", help="torch-format folder -> jaxtrain run folder",
                          description="Import a torch-format training state as a jaxtrain run that "
                                      "`python -m jaxtrain.run --config DST/config.yaml` resumes.")
    back.add_argument("src", help="a torch-format folder (model.safetensors, optimizer.safetensors, "
                                  "trainer_state.json)")
    back.add_argument("dst", help="the jaxtrain run folder to create (must not exist, or be empty)")
    for name, direction, src in (
            ("to-hf", "jaxtrain step folder or torch-format folder -> Hugging Face GPT-2 folder",
             "a jaxtrain step folder (out/tiny/checkpoints/400, or in a bucket, gs://...) or a torch-format folder"),
            ("from-hf", "Hugging Face GPT-2 folder -> torch-format weights for --init.from",
             "a folder GPT2LMHeadModel.save_pretrained wrote (config.json, model.safetensors)")):
        hf = sub.add_parser(name, help=direction, description=direction)
        hf.add_argument("src", help=src)
        hf.add_argument("dst", help="the folder to create (must not exist, or be empty)")
    hf_out = sub.choices["to-hf"]
    hf_out.add_argument("--tokenizer", choices=prepare_lib.TOKENIZERS,
                        help="the run's, where its data folder is not on this machine to say (default, and the only "
                             "one accepted where it is: that data's); gpt2 writes GPT-2's BPE files beside the model")
    hf_out.add_argument("--dtype", choices=tuple(hf_format.DTYPES),
                        help="the weights' (default float32, a run's own; for a folder from-hf wrote, the dtype its "
                             "config.json says they were saved in); config.json names it, and from_pretrained loads "
                             "them in it (transformers 5 by default, 4 with torch_dtype='auto')")
    return ap


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error():
        args = _parser().parse_args(argv)
        if args.command in ("from-torch", "from-hf"):  # to-torch and to-hf read a step folder in a bucket too
            runfolder.check_not_url(args.src, "SRC")
        commands = {"to-torch": to_torch, "from-torch": from_torch, "from-hf": from_hf,
                    "to-hf": lambda src, dst: to_hf(src, dst, args.tokenizer, args.dtype)}
        commands[args.command](args.src, args.dst)


if __name__ == "__main__":
    main()
