"""Which tokenizer a run's text is read with: one rule for `jaxtrain.sample` and `convert to-hf`; and a Hugging Face
folder's (of_hf_folder), for `jaxtrain.sample --from`.

A run's tokens mean text only through the tokenizer of the data it trained on. That data's meta.json names it while
the folder is on this machine and still holds that data; `--tokenizer` names it where the folder is gone, and is
refused where it says another than the data's (its ids would read as other text, and nothing would say so).

No jax and no torch, as data.py (which torchref imports too).
"""

import os

from jaxtrain import data as data_lib
from jaxtrain import gpt2_bpe
from jaxtrain import prepare as prepare_lib
from jaxtrain.config import Config
from jaxtrain.errors import UserError

HF_FILES = (gpt2_bpe.HF_FAST, gpt2_bpe.HF_VOCAB, gpt2_bpe.HF_MERGES)  # a GPT-2 folder's tokenizer, either form


def trained_tokenizer(cfg: Config, data_fingerprint: str | None) -> str:
    """The tokenizer in the run's data folder's meta.json while the folder still holds the data the run trained on:
    its fingerprint (data.load's, which a resume checks) is the checkpoint's `data_fingerprint`. A folder prepared
    again since, with other text or another tokenizer, would name a tokenizer that is not the run's. Checkpoints
    older than data fingerprints record none: the folder's word is all there is. UserError, saying why, where this
    machine cannot tell."""
    path = cfg.data.path
    if path is None:
        return data_lib.tokenizer_name(cfg.data)  # the embedded corpus's: bytes
    relative = not os.path.isabs(path)  # read from this directory, which need not be the one the run ran in
    named = f"{path} (relative: read from {os.getcwd()})" if relative else path
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise UserError(f"the run's data folder {named} is not here to say which tokenizer it used (its meta.json)")
    data = data_lib.load(cfg.data, cfg.model.seq_len)
    if data_fingerprint not in (None, data.fingerprint):
        why = "prepared again since" + (", or another folder than the run's of that name" if relative else "")
        raise UserError(f"the run's data folder {named} no longer holds the data the run trained on (its data "
                        f"fingerprint changed: {why}), so its meta.json does not say the run's tokenizer")
    return data.tokenizer


def chosen(cfg: Config, data_fingerprint: str | None, given: str | None, run: str) -> str:
    """`given` (--tokenizer, or None) or the run's own (trained_tokenizer): never another than the data's where this
    machine can tell which that is; where it cannot, `given`, else a UserError asking for it. `run` names the run
    (its folder or checkpoint) in the refusals."""
    try:
        own = trained_tokenizer(cfg, data_fingerprint)
    except UserError as e:
        if given is not None:
            return given
        choices = " or ".join(f"--tokenizer {name}" for name in prepare_lib.TOKENIZERS)
        raise UserError(f"{e}; pass {choices}, the one the run's data used") from None
    if given is not None and given != own:
        data = f"data folder {cfg.data.path}" if cfg.data.path is not None else "data (the embedded corpus)"
        raise UserError(f"--tokenizer {given} is not the tokenizer of {run}: its {data} was tokenized with {own}; "
                        f"leave --tokenizer out to use the run's own")
    return own


def holds_hf_files(src: str) -> bool:
    """Whether the Hugging Face folder `src` holds tokenizer files (HF_FILES) to say its model's tokenizer."""
    return any(os.path.isfile(os.path.join(src, name)) for name in HF_FILES)


def of_hf_folder(src: str, given: str | None, vocab_size: int) -> str:
    """The tokenizer a Hugging Face GPT-2 folder's text is read with (from-hf's carries the files of the one it came
    with): GPT-2's BPE where its files are GPT-2's (gpt2_bpe.differs) and its model has a row for each of its
    tokens; `given` (--tokenizer) where it holds no files, or GPT-2's with too few rows for them; else a UserError
    asking for it. Refused where its files are another tokenizer's, which jaxtrain cannot encode with, and where
    `given` is not the one its files are."""
    choices = " or ".join(f"--tokenizer {name}" for name in prepare_lib.TOKENIZERS)
    if not holds_hf_files(src):
        if given is not None:
            return given
        raise UserError(f"{src} holds no tokenizer files ({', '.join(HF_FILES)}) to say which tokenizer its model "
                        f"reads; pass {choices}, the one it was trained with")
    why = gpt2_bpe.differs(src)
    if why is not None:
        raise UserError(f"{src}'s tokenizer is not GPT-2's BPE ({why}), and jaxtrain encodes text with GPT-2's BPE "
                        f"or bytes only; sample it with transformers' generate")
    if vocab_size <= gpt2_bpe.EOT_ID:  # GPT-2's files beside a model that cannot have been trained on them
        if given == "bytes":
            return given
        raise UserError(f"{src}'s tokenizer files are GPT-2's BPE, whose {gpt2_bpe.EOT_ID + 1} tokens are more than "
                        f"its model's {vocab_size} embedding rows: they are not its model's tokenizer; pass "
                        f"--tokenizer bytes if it was trained on bytes")
    if given not in (None, "gpt2"):
        raise UserError(f"--tokenizer {given} is not the tokenizer of {src}: its tokenizer files are GPT-2's BPE; "
                        f"leave --tokenizer out to use its own")
    return "gpt2"
