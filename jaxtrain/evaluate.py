"""`python -m jaxtrain.evaluate --run out/tiny [--step N]`: the eval loss and accuracy of a run's checkpoint, or of
a model's weights (--from FOLDER: a Hugging Face GPT-2 folder among them), on the val split of a data folder, without
training: nanoGPT's eval_only (its eval_gpt2 configs give GPT-2's loss on OpenWebText), Levanter's eval_lm.

    python -m jaxtrain.evaluate --run out/tiny                     # the run's eval set: the loss the run logged
    python -m jaxtrain.evaluate --run out/tiny --data data/other   # its model on another folder's val split
    python -m jaxtrain.evaluate --from gpt2-hf --data data/owt --batches 500 --batch_size 8

The eval set is drawn as a run draws its own (data.eval_batch): --batches batches of --batch_size sequences of the
model's seq_len tokens, from the val split (--split train: from the train split, where the same keys draw sequences at
random, as nanoGPT's estimate_loss, not the windows the first steps trained on), with --seed's keys, each batch in
--micro_batches parts. A run's checkpoint takes its run's: train.eval_batches, data.batch_size, optim.grad_accum_steps
and the data seed it trained with, on its data. It computes on the devices of this machine (--devices N: its first
N; by default, of the counts each part splits over evenly, the largest of those that split each weight into the most
pieces), each part split over them as a run splits its own and each weight over gcd(the run's mesh.fsdp, N) of them
(mesh.model_mesh), restored straight into that layout: for a run that evaluated on as many devices of this kind with
that mesh, the numbers metrics.jsonl holds for that step, bit for bit (on other counts its matmuls of other shapes
may round otherwise: a run of the small test model in fp32 on 2 CPU devices, each weight over both, logged
5.2440739, scored on one 5.2440743). A model without a run (a Hugging Face folder, from-hf's) takes --data and
nanoGPT's eval_gpt2 batch size, 8, its weights whole on each device.

The loss is the token-weighted mean cross-entropy over the set's tokens (nats; the run's eval step,
step.make_eval_step, in the precision the run trained in, fp32 for a Hugging Face model, with the kernels the
defaults pick where the run named one), the accuracy the share of them whose target is the top-1 prediction. Prints
one JSON line on stdout (metrics.jsonl's eval_loss and eval_accuracy with the perplexity, the tokens and what was
evaluated) and a sentence of them on stderr. Refused in one line: data of another tokenizer (check_tokens),
weights holding inf or NaN, a batch too big for a device's memory or that does not split over the devices.
"""

import argparse
import dataclasses
import math
import sys
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from jaxtrain import data as data_lib
from jaxtrain import dryrun
from jaxtrain import gpt2_bpe
from jaxtrain import mesh as mesh_lib
from jaxtrain import metrics as metrics_lib
from jaxtrain import model_source
from jaxtrain import prepare as prepare_lib
from jaxtrain import run_tokenizer
from jaxtrain import step as step_lib
from jaxtrain.config import Config
from jaxtrain.errors import OneLineParser, UserError, exit_on_interrupt, exit_on_user_error

FOLDER_BATCH_SIZE = 8  # sequences a batch for a model without a run: nanoGPT's config/eval_gpt2*.py


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """The sequences evaluated: `batches` batches of `batch_size` windows of `split` (val, or train), drawn with
    `seed`'s keys, each batch in `micro_batches` parts (data.eval_batch)."""
    data: data_lib.TokenData
    batches: int
    batch_size: int
    micro_batches: int
    seed: int
    split: str = "val"

    @property
    def at_a_time(self) -> int:
        """Sequences a forward pass takes."""
        return self.batch_size // self.micro_batches

    def check(self, devices: int = 1) -> None:
        """Each number as given, or its default (a run's: see the module's docstring); the sequences a forward
        pass takes split evenly over `devices`."""
        if self.batches <= 0:
            raise UserError(f"--batches must be > 0, got {self.batches}")
        if self.batch_size <= 0 or self.micro_batches <= 0:
            raise UserError(f"--batch_size and --micro_batches must be > 0, got {self.batch_size} and "
                            f"{self.micro_batches}")
        if self.batch_size % self.micro_batches:
            raise UserError(f"--batch_size {self.batch_size} is not divisible by --micro_batches "
                            f"{self.micro_batches} (a run's default: its optim.grad_accum_steps): each micro-batch "
                            f"is batch_size / micro_batches sequences; give both")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"--seed must be in [0, 2**32) (a run's default: its data seed), got {self.seed}")
        if self.at_a_time % devices:
            fewer = max(d for d in range(1, devices) if self.at_a_time % d == 0)
            multiple = devices * self.micro_batches
            raise UserError(f"--batch_size {self.batch_size} in --micro_batches {self.micro_batches} is "
                            f"{self.at_a_time} sequences at a time, which do not split over {devices} devices; "
                            f"pass --devices {fewer}, or a --batch_size of a multiple of {multiple}")


def eval_set(loaded: model_source.Loaded, args, devices: int = 1) -> EvalSet:
    """The set `args` asks for (_asked), with the data of the run of `loaded`'s checkpoint or --data's, split over
    `devices`."""
    chosen = _asked(args, loaded.cfg, loaded.data_seed)
    chosen.check(devices)  # before the data is read
    own = loaded.cfg if loaded.cfg is not None else Config()
    data_cfg = own.data if args.data is None else dataclasses.replace(own.data, path=args.data)
    try:
        data = data_lib.load(data_cfg, loaded.model_cfg.seq_len)
    except UserError as e:  # its fix may name a run's keys: evaluate reads the val split of another folder instead
        whose = "the run's data" if args.data is None else "--data"
        raise UserError(f"{e} ({whose}; evaluate on another data folder with --data FOLDER)") from None
    return dataclasses.replace(chosen, data=data)


def _asked(args, run: Config | None, data_seed: int | None = None) -> EvalSet:
    """The set `args` ask for, without its data: each number not given the `run`'s (see the module's docstring), the
    seed its `data_seed` (None: its run.seed, a stand-in for the range check where only the run's config is at hand,
    as in _devices_for's rule); a model without a run needs --data."""
    if run is None and args.data is None:
        raise UserError(f"--from {args.from_} is a model's weights without a run's data to evaluate on: pass "
                        f"--data FOLDER, a folder {prepare_lib.COMMAND} wrote (its val split is evaluated, or "
                        f"--split's)")
    own = run if run is not None else Config()

    def pick(given, of_run, without_run):
        return given if given is not None else of_run if run is not None else without_run
    return EvalSet(None, pick(args.batches, own.train.eval_batches, Config().train.eval_batches),
                   pick(args.batch_size, own.data.batch_size, FOLDER_BATCH_SIZE),
                   pick(args.micro_batches, own.optim.grad_accum_steps, 1),
                   pick(args.seed, data_seed if data_seed is not None else own.run.seed, Config().run.seed),
                   args.split)


def check_tokens(loaded: model_source.Loaded, data: data_lib.TokenData) -> None:
    """Refuses data whose ids are not the model's tokens: ids past its embedding rows, or another tokenizer's than
    the one model_tokenizer tells the model reads. Where it cannot tell, or the tokenizer is one whose name says
    nothing of its ids (not one of prepare's: two character-level folders may name theirs alike), a note says so."""
    if data.vocab_size > loaded.model_cfg.vocab_size:
        raise UserError(f"the data {data.path} ({data.tokenizer}) has a vocabulary of {data.vocab_size}, more than "
                        f"the {loaded.model_cfg.vocab_size} embedding rows of the model of {loaded.where}: it was "
                        f"tokenized for another model; evaluate on data prepared with the model's tokenizer")
    if loaded.cfg is not None and data.fingerprint == loaded.data_fingerprint:
        return  # the data the run trained on
    own, why = model_tokenizer(loaded, data)
    if own is not None and own != data.tokenizer:
        raise UserError(f"the data {data.path} was tokenized with {data.tokenizer}, and the model of {loaded.where} "
                        f"reads {own} ({why}): its loss there would be of other text; evaluate on data prepared "
                        f"with the model's tokenizer")
    if own is None or own not in prepare_lib.TOKENIZERS:
        why = why if own is None else (f"both name the tokenizer {own!r}, which is not one of jaxtrain's: the name "
                                       f"alone does not say the ids are the same")
        print(f"note: which tokenizer the model of {loaded.where} reads cannot be told here ({why}); the ids of "
              f"{data.path} ({data.tokenizer}) are read as its tokens", file=sys.stderr)


def model_tokenizer(loaded: model_source.Loaded, data: data_lib.TokenData) -> tuple[str | None, str]:
    """(the tokenizer whose ids the model reads, or None where this machine cannot tell; why). A run's: its data's
    (run_tokenizer.trained_tokenizer). A Hugging Face folder's: GPT-2's where its tokenizer files give GPT-2's ids
    (gpt2_bpe.same_ids); "its own tokenizer" where they give others and `data`'s is one of prepare's (GPT-2's and
    bytes, whose ids are known), else None: the data may be of that tokenizer."""
    if loaded.cfg is not None:
        try:
            return run_tokenizer.trained_tokenizer(loaded.cfg, loaded.data_fingerprint), "its run's data's"
        except UserError as e:
            return None, str(e)
    if not run_tokenizer.holds_hf_files(loaded.where):
        return None, f"it holds no tokenizer files: {', '.join(run_tokenizer.HF_FILES)}"
    try:
        gpt2_ids = gpt2_bpe.same_ids(loaded.where)
    except UserError as e:  # GPT-2's own files are not on this machine to compare with
        return None, str(e)
    if gpt2_ids is None:
        return None, "its tokenizer files cannot be read for their vocabulary"
    if not gpt2_ids:
        why = "its tokenizer files' vocabulary is not GPT-2's"
        return ("its own tokenizer", why) if data.tokenizer in prepare_lib.TOKENIZERS else (None, why)
    if loaded.model_cfg.vocab_size <= gpt2_bpe.EOT_ID:
        return None, "its tokenizer files are GPT-2's, with more tokens than its model has embedding rows"
    return "gpt2", "its tokenizer files' vocabulary is GPT-2's"


def evaluate(loaded: model_source.Loaded, chosen: EvalSet, eval_step) -> dict:
    """The eval line of `loaded`'s model on `chosen` through `eval_step` (compiled_eval_step's): eval_loss,
    eval_accuracy (token-weighted), perplexity, tokens. Each batch is split over the devices of the params' mesh,
    as a run splits its eval batches."""
    sharding, sums = mesh_lib.window_sharding(model_source.mesh_of(loaded)), []
    for index in tqdm(range(chosen.batches), unit="batch", desc="evaluate", dynamic_ncols=True, disable=None,
                      file=sys.stderr):  # disable=None: a bar on a terminal only
        inputs, targets = data_lib.eval_batch(chosen.data, seed=chosen.seed, index=index,
                                              batch_size=chosen.batch_size, accum_steps=chosen.micro_batches,
                                              seq_len=loaded.model_cfg.seq_len, split=chosen.split)
        batch = (mesh_lib.global_array(x, sharding) for x in (inputs, targets))
        with dryrun.out_of_memory(lambda needs: _too_big(chosen, sharding.mesh.size, needs)):
            sums.append(jax.device_get(eval_step(loaded.params, *batch)))  # each batch done: the bar is true
    loss, accuracy = step_lib.eval_means(sums)
    try:
        perplexity = math.exp(loss)
    except OverflowError:  # past e^709: a model that predicts nothing
        perplexity = math.inf
    return {"step": loaded.step, "eval_loss": loss, "eval_accuracy": accuracy, "perplexity": perplexity,
            "tokens": sum(int(s[2]) for s in sums)}


def compiled_eval_step(loaded: model_source.Loaded, chosen: EvalSet):
    """The run's eval step compiled for `chosen`'s micro-batches: the model computes as its run's eval step did, but
    with the forward kernels the defaults pick where the run named one (a note says which: model_source.
    computed_here); refused in one line where it needs more memory than the device has."""
    model_cfg, changed = model_source.computed_here(loaded.model_cfg, loaded.precision)
    if changed:
        print(f"note: {', '.join(changed)}: computed with the kernels the defaults pick here (the same function; "
              f"the last digits may differ from the run's)", file=sys.stderr)
    cfg = Config() if loaded.cfg is None else loaded.cfg
    cfg = dataclasses.replace(cfg, model=model_cfg, train=dataclasses.replace(cfg.train, precision=loaded.precision))
    mesh = model_source.mesh_of(loaded)
    tokens = jax.ShapeDtypeStruct((chosen.micro_batches, chosen.at_a_time, model_cfg.seq_len), np.int32,
                                  sharding=mesh_lib.window_sharding(mesh))
    with dryrun.out_of_memory(lambda needs: _too_big(chosen, mesh.size, needs)), jax.set_mesh(mesh):
        compiled = step_lib.jit_eval_step(cfg).lower(loaded.params, tokens, tokens).compile()
    if (needs := dryrun.shortfall(compiled, mesh)) is not None:
        raise _too_big(chosen, mesh.size, needs)
    return compiled


def _devices_for(args, devices: list, given: bool) -> Callable[[Config | None], list]:
    """The rule (model_source.Devices) by which evaluate takes its devices once the run is known, its numbers checked
    there, before the weights are read: `devices` where `given` (--devices), which each part of a batch must split
    over; else of the counts of them each part splits over evenly, the largest of those that split each weight into
    the most pieces (mesh.most_splitting: fsdp 2 and 6 sequences on 4 GPUs, 2 not 3)."""
    def devices_of(run: Config | None) -> list:
        parts = _asked(args, run)
        parts.check(len(devices) if given else 1)
        if given:
            return devices
        counts = [d for d in range(1, len(devices) + 1) if parts.at_a_time % d == 0]
        return devices[:max(mesh_lib.most_splitting(model_source.fsdp_of(run), counts))]
    return devices_of


def _note_fewer(chosen: EvalSet, fsdp: int, count: int, devices: int) -> None:
    """Say why `chosen` is computed on `count` of this machine's `devices` where that is fewer: each weight of a run
    of mesh.fsdp `fsdp` is split into more pieces on fewer (then --devices computes on all, with a batch its parts
    split over), or its parts do not split over all (a run's micro-batches split over the devices it trained on, a
    Hugging Face model's 8 may not)."""
    if count == devices:
        return
    split_here, split_on_all = math.gcd(fsdp, count), math.gcd(fsdp, devices)
    batch = f"a --batch_size of a multiple of {devices * chosen.micro_batches}"
    if split_here > split_on_all:
        also = f" with {batch}" if chosen.at_a_time % devices else ""
        why = (f"each weight split over {split_here} of them, on all over {split_on_all}: --devices {devices}{also} "
               f"computes on all")
    else:
        why = f"{batch} splits over all of them"
    print(f"note: {chosen.at_a_time} sequences at a time, computed on {count} of this machine's {devices} devices "
          f"({why})", file=sys.stderr)


def _too_big(chosen: EvalSet, devices: int, needs: str) -> UserError:
    """The refusal of `chosen` split over `devices` of this machine's, which `needs` more memory than one has, with
    the levers that lower it: fewer sequences a part; on GPUs and TPUs a count of more devices that the part splits
    over and that splits each weight over as many (a multiple of `devices`); on a CPU, whose devices share the
    host's memory and each hold their copy of the weights, one device."""
    levers = ["raise --micro_batches or lower --batch_size"] if chosen.at_a_time > devices else []
    machine = jax.devices()
    more = [d for d in range(devices + 1, len(machine) + 1) if chosen.at_a_time % d == 0 and d % devices == 0]
    if more and machine[0].platform != "cpu":
        levers.append(f"split each part over more of this machine's {len(machine)} devices (--devices {more[-1]})")
    if devices > 1 and machine[0].platform == "cpu":
        levers.append(f"compute on {dryrun.one_device()}")
    fix = ", or ".join(levers) or f"one sequence a device is the least: evaluate on {dryrun.more_memory(machine[0])}"
    return UserError(f"evaluating {chosen.at_a_time} sequence{'s' if chosen.at_a_time > 1 else ''} at a time "
                     f"{needs}; {fix}")


def _parser() -> OneLineParser:
    ap = OneLineParser(prog="python -m jaxtrain.evaluate",
                       description="The eval loss and accuracy of a checkpoint of a trained run, or of a model's "
                                   "weights, on the val split of a data folder (or its train split).",
                       epilog="examples:\n"
                              "  python -m jaxtrain.evaluate --run out/tiny\n"
                              "  python -m jaxtrain.evaluate --from my-gpt2-hf --data data/owt --batches 100",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    model_source.add_arguments(ap)
    ap.add_argument("--data", metavar="FOLDER",
                    help="a data folder (prepare's); its val split is evaluated (or --split's). Default: the run's "
                         "data")
    ap.add_argument("--batches", type=int, help="batches to evaluate; default: the run's train.eval_batches "
                                                f"({Config().train.eval_batches} without a run)")
    ap.add_argument("--batch_size", type=int, help="sequences a batch; default: the run's data.batch_size "
                                                   f"({FOLDER_BATCH_SIZE} without a run)")
    ap.add_argument("--micro_batches", type=int, help="parts each batch is evaluated in, to fit in memory; default: "
                                                      "the run's optim.grad_accum_steps (1 without a run)")
    ap.add_argument("--split", choices=("val", "train"), default="val",
                    help="the split the sequences are drawn from (default val; train: with the same keys, so at "
                         "random, as nanoGPT's estimate_loss, not the windows the first steps trained on)")
    ap.add_argument("--seed", type=int, help="which sequences are drawn; default: the run's data seed "
                                             f"({Config().run.seed} without a run)")
    ap.add_argument("--devices", type=int, help="how many of this machine's devices compute (its first N): each "
                                                "part of a batch split over them, each weight over gcd(the run's "
                                                "mesh.fsdp, N) of them; default: of the counts each part splits "
                                                "over evenly, the largest of those that split each weight into the "
                                                "most pieces")
    return ap


def main(argv: list[str] | None = None) -> None:
    with exit_on_user_error(), exit_on_interrupt("nothing was written"):
        args = _parser().parse_args(argv)
        devices = model_source.machine_devices(args.devices)
        loaded = model_source.load(args, "evaluate", _devices_for(args, devices, given=args.devices is not None))
        if (name := step_lib.non_finite_leaf(loaded.params)) is not None:
            raise UserError(f"{loaded.where} holds inf or NaN ({name}): its loss is no number; evaluate a checkpoint "
                            f"saved before its values overflowed")
        count = model_source.mesh_of(loaded).size
        chosen = eval_set(loaded, args, count)
        _note_fewer(chosen, model_source.fsdp_of(loaded.cfg), count, len(devices))
        check_tokens(loaded, chosen.data)
        eval_step = compiled_eval_step(loaded, chosen)
        print(f"{loaded.source}, {loaded.precision}: {chosen.batches} batches of {chosen.batch_size} x "
              f"{loaded.model_cfg.seq_len} tokens, {chosen.at_a_time} sequences at a time, from the {chosen.split} "
              f"split of {chosen.data.path}, seed {chosen.seed}{model_source.on_devices(loaded)}",
              file=sys.stderr)
        line = evaluate(loaded, chosen, eval_step)
        print(f"eval loss {line['eval_loss']:.4f} (perplexity {line['perplexity']:.2f}), accuracy "
              f"{line['eval_accuracy']:.2%} over {line['tokens']:,} tokens", file=sys.stderr)
        where = {"source": loaded.source, "data": chosen.data.path, "split": chosen.split}
        print(metrics_lib.json_line({**where, **line}), end="")


if __name__ == "__main__":
    main()
