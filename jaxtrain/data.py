"""Token data: nanoGPT-format token folders, their fingerprint, and deterministic batches.

A data folder holds `train.bin` and `val.bin`, flat arrays of token ids (uint16 when vocab_size <= 65536, else
uint32, as nanoGPT writes them), and `meta.json` = {"vocab_size", "dtype", "tokenizer", "train_tokens",
"val_tokens"}. The splits are read through read-only `np.memmap`, so a 9B-token split costs no RAM.

    python -m jaxtrain.data prepare --input notes/ book.txt --out data/mine --tokenizer gpt2
    python -m jaxtrain.data stats [--data-path data/mine]

(prepare lives in jaxtrain.prepare, GPT-2's BPE in jaxtrain.gpt2_bpe.) Without `data.path` the data is the Python
standard library's own source, byte-tokenized and prepared once into a cache folder (jaxtrain.embedded_corpus).

Batches are a pure function of (seed, split, step): random windows as in nanoGPT, whose offsets come from PCG64
seeded with those numbers, drawn for the GLOBAL batch of the step, then cut into micro-batches, of which each
process keeps its own rows. Both backends, any resumed run, any accumulation and any number of hosts therefore see
the same tokens at every step.

numpy and the standard library only: torchref imports this module, so it must never import jax or torch.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import sys

import numpy as np

from jaxtrain import data_stats
from jaxtrain import embedded_corpus
from jaxtrain import gpt2_bpe
from jaxtrain import prepare as prepare_lib
from jaxtrain import prepare_records
from jaxtrain import runfolder
from jaxtrain.cmdline import positive_int
from jaxtrain.config import Config, DataConfig
from jaxtrain.errors import OneLineParser, UserError, exit_on_interrupt, exit_on_user_error

TRAIN, VAL = 0, 1  # split ids, part of every batch's RNG key
_PREPARE_HINT = f"create it with {prepare_lib.COMMAND}"
_META_TYPES = {"vocab_size": int, "dtype": str, "tokenizer": str, "train_tokens": int, "val_tokens": int}


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Both splits of a token folder: 1-D read-only arrays of token ids (uint16 or uint32)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    tokenizer: str
    path: str
    fingerprint: str  # of the content, wherever the folder lies: checkpoints record it (see _fingerprint)


def load(data_cfg: DataConfig, seq_len: int) -> TokenData:
    """The token folder at data_cfg.path, or the embedded corpus (prepared on first use) when path is None.

    Checks the folder against its meta.json, that each split holds at least one window of seq_len + 1 tokens, and
    the token ids it fingerprints (a whole small split; a large one's ends) against vocab_size.
    """
    if data_cfg.path is not None:
        path, fix = data_cfg.path, _PREPARE_HINT
    else:  # a cache: the prepare command would put other text under the corpus's name
        path = embedded_corpus.folder(data_cfg.cache_dir)
        fix = f"the embedded corpus's cache is damaged: delete {path}, and the next run prepares it again"
    meta = _read_meta(path, fix)
    dtype = np.dtype(meta["dtype"])
    train = _open_split(path, "train", dtype, meta["train_tokens"], seq_len, fix)
    val = _open_split(path, "val", dtype, meta["val_tokens"], seq_len, fix)
    ends = [_ends(train), _ends(val)]
    _check_ids(max(int(e.max()) for e in ends), meta["vocab_size"], path, fix)
    return TokenData(train, val, meta["vocab_size"], meta["tokenizer"], path, _fingerprint(meta, ends))


# The bytes read from each end of a split for its fingerprint; a split of up to twice this is read whole.
_FINGERPRINT_BYTES = 2**20


def _ends(tokens: np.ndarray) -> np.ndarray:
    """A split's first and last MiB of tokens, or all of it when that is no more."""
    n = _FINGERPRINT_BYTES // tokens.itemsize
    return np.asarray(tokens) if len(tokens) <= 2 * n else np.concatenate([tokens[:n], tokens[-n:]])


def _fingerprint(meta: dict, ends: list[np.ndarray]) -> str:
    """sha256 of meta.json's fields (its token counts among them) and of both splits' ends. Not of whole files: a
    9B-token split is 18 GB, some 20 s of hashing at every start on every host. Other text, another tokenizer, a
    re-sample, an append or a cut change the counts or the ends; an edit inside a split over 2 MiB that keeps its
    length is what this misses."""
    h = hashlib.sha256(json.dumps({k: meta[k] for k in _META_TYPES}, sort_keys=True).encode())
    for tokens in ends:
        h.update(tokens.tobytes())
    return h.hexdigest()


def check_same_data(saved: dict, fingerprint: str, cfg: Config, where: str) -> None:
    """Refuse to resume from a checkpoint trained on other data; `saved` is its meta (jaxtrain) or trainer_state
    (torchref), both holding `data_fingerprint` and `config`. The content decides, so a data folder moved or copied
    elsewhere resumes. Checkpoints from before fingerprints record none: their data.path and data.cache_dir must
    then be the config's, the rule they were written under."""
    saved_fingerprint = saved.get("data_fingerprint")
    fresh = "or start over with --run.fresh=true or a new --run.out_dir"
    if saved_fingerprint is None:
        saved_data = saved["config"]["data"]
        moved = [f"data.{k}: {saved_data.get(k)!r} -> {getattr(cfg.data, k)!r}" for k in ("path", "cache_dir")
                 if saved_data.get(k) != getattr(cfg.data, k)]
        if moved:
            raise UserError(f"{where} records no data fingerprint (an older checkpoint), so its data paths must be "
                            f"the config's ({', '.join(moved)}); resume with those paths, {fresh}")
    elif saved_fingerprint != fingerprint:
        data = cfg.data.path if cfg.data.path is not None else "the embedded corpus"
        raise UserError(f"the data ({data}) differs from the data that wrote {where} (data fingerprint "
                        f"{saved_fingerprint[:12]} -> {fingerprint[:12]}: meta.json, a split's length or its first "
                        f"or last MiB changed); resume with the data it was trained on, {fresh}")


def resolve_vocab_size(model_vocab: int | None, data: TokenData) -> int:
    """The model's vocab size: the data's when None; larger is padding (e.g. 50304 for GPT-2's 50257)."""
    if model_vocab is None:
        return data.vocab_size
    if model_vocab < data.vocab_size:
        raise UserError(f"model.vocab_size={model_vocab} is smaller than the data's vocab_size={data.vocab_size} "
                        f"({data.path}/meta.json), so token ids up to {data.vocab_size - 1} would have no embedding; "
                        f"set model.vocab_size >= {data.vocab_size}, or null to take the data's")
    return model_vocab


def vocab_size_before_resume(model_vocab: int | None, data: TokenData, fresh: bool) -> tuple[int, UserError | None]:
    """resolve_vocab_size's answer, and its refusal held back where the run may resume (not run.fresh): there a
    model.vocab_size (config.yaml's) below the data's means other data than the run trained on, which the resume's
    own checks name; raising model.vocab_size, as the refusal says, would be refused by them next. Both backends
    build the model at model_vocab, resume, then call refuse_vocab_size_after_resume."""
    try:
        return resolve_vocab_size(model_vocab, data), None
    except UserError as e:
        if fresh:
            raise
        return model_vocab, e


def refuse_vocab_size_after_resume(refusal: UserError | None, resumed: bool, data: TokenData, out_dir: str) -> None:
    """vocab_size_before_resume's refusal, where the resume's checks did not refuse: as it was where nothing
    resumed; where a checkpoint from before data fingerprints did (its data paths alone are checked), as other data
    at the same path."""
    if refusal is None:
        return
    if not resumed:
        raise refusal
    raise UserError(f"the data ({data.path}) has a vocabulary of {data.vocab_size}, larger than the model.vocab_size "
                    f"the run in {out_dir} was trained with: it is not the data the run trained on (its checkpoint "
                    f"is older than data fingerprints, so only the data's path was checked); resume with the data it "
                    f"was trained on, or start over with --run.fresh=true or a new --run.out_dir")


def tokenizer_name(data_cfg: DataConfig) -> str | None:
    """The tokenizer of the data a config names ("bytes" or "gpt2"): the embedded corpus is bytes, a folder's is in
    its meta.json; None where that folder is not on this machine."""
    if data_cfg.path is None:
        return "bytes"
    if not os.path.isfile(os.path.join(data_cfg.path, "meta.json")):
        return None
    return _read_meta(data_cfg.path)["tokenizer"]


def _nanogpt_meta(path: str) -> str:
    """Where `path` holds a train.bin and val.bin of whole uint16 tokens, as nanoGPT's prepare scripts write them
    (without a meta.json; GPT-2's BPE in openwebtext and shakespeare), the meta.json that reads them as such: no
    tokenizing again. Else nothing."""
    sizes = [os.path.getsize(os.path.join(path, f"{split}.bin")) if os.path.isfile(os.path.join(path, f"{split}.bin"))
             else None for split in ("train", "val")]
    if None in sizes or any(size % 2 for size in sizes) or os.path.exists(os.path.join(path, "meta.pkl")):
        return ""  # meta.pkl: nanoGPT's character-level vocabulary, no tokenizer of jaxtrain's
    meta = {"vocab_size": gpt2_bpe.EOT_ID + 1, "dtype": "uint16", "tokenizer": "gpt2",
            "train_tokens": sizes[0] // 2, "val_tokens": sizes[1] // 2}
    return f"if its .bin files are nanoGPT's GPT-2 tokens, write this meta.json there: {json.dumps(meta)}; else "


def _read_meta(path: str, fix: str = _PREPARE_HINT) -> dict:
    """meta.json of the token folder `path`, checked; `fix`: what a message says to do about a damaged folder."""
    if runfolder.is_url(path):
        raise UserError(f"data folder {path!r} is a URL, and data is read from a local folder: copy it to each host "
                        f"(e.g. `gcloud storage cp -r {path} /data`) and give that folder")
    if os.path.isfile(path):
        raise UserError(f"data folder {path!r} is a file; give the folder prepare wrote (train.bin, val.bin, "
                        f"meta.json); {_PREPARE_HINT}")
    if not os.path.isdir(path):  # a relative data.path is read from where the command runs: a resume elsewhere
        where = "" if os.path.isabs(path) or fix != _PREPARE_HINT else (
            f" in the current folder, {os.getcwd()} (a relative path: run where it was given, or give the folder's "
            f"absolute path)")
        raise UserError(f"data folder {path!r} not found{where}; {fix}")
    if not os.access(path, os.R_OK | os.X_OK):  # else its files look missing
        raise _unreadable(f"data folder {path!r}")
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise UserError(f"{meta_path} is missing (not a jaxtrain data folder, or its prepare was cut short); "
                        f"{_nanogpt_meta(path) if fix == _PREPARE_HINT else ''}{fix}")  # (not the corpus's cache)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8 (both ValueErrors), or nesting too deep to parse
        raise UserError(f"{meta_path} is not valid JSON ({e}); {_recreate(fix)}") from None
    except PermissionError:
        raise _unreadable(meta_path) from None
    expected = ", ".join(f"{k}: {t.__name__}" for k, t in _META_TYPES.items())
    if not isinstance(meta, dict) or any(type(meta.get(k)) is not t for k, t in _META_TYPES.items()):
        raise UserError(f"{meta_path} is malformed: it must hold {{{expected}}}; {_recreate(fix)}")
    if meta["dtype"] not in ("uint16", "uint32") or meta["vocab_size"] <= 0:
        raise UserError(f"{meta_path} has dtype {meta['dtype']!r} and vocab_size {meta['vocab_size']}; "
                        f"dtype must be uint16 or uint32 and vocab_size > 0")
    if meta["vocab_size"] > 2**31:  # batches hold ids as int32
        raise UserError(f"{meta_path} has vocab_size {meta['vocab_size']}, beyond the 2**31 ids of int32; "
                        f"re-create the folder with the prepare command, or fix vocab_size")
    if meta["dtype"] == "uint16" and meta["vocab_size"] > 2**16:
        raise UserError(f"{meta_path}: dtype mismatch, uint16 cannot hold the ids of vocab_size {meta['vocab_size']}; "
                        f"write the .bin files as uint32 and set \"dtype\": \"uint32\"")
    return meta


def _open_split(path: str, split: str, dtype: np.dtype, n_tokens: int, seq_len: int, fix: str) -> np.ndarray:
    file = os.path.join(path, f"{split}.bin")
    if not os.path.isfile(file):
        raise UserError(f"{file} not found; {fix}")
    size = os.path.getsize(file)
    if size != n_tokens * dtype.itemsize:
        raise UserError(_size_mismatch(file, size, dtype, n_tokens, fix))
    if n_tokens < seq_len + 1:
        more = "lower model.seq_len or prepare more text" if seq_len > 1 else "prepare more text"  # 1: the least
        raise UserError(f"{file} has {n_tokens} tokens but a window of model.seq_len={seq_len} needs "
                        f"{seq_len + 1}; {more}")
    try:
        return np.memmap(file, dtype=dtype, mode="r")
    except PermissionError:
        raise _unreadable(file) from None


def _unreadable(what: str) -> UserError:
    return UserError(f"{what} cannot be read by this user (its permissions); make it readable (chmod), or ask its "
                     f"owner to")


def _size_mismatch(file: str, size: int, dtype: np.dtype, n_tokens: int, fix: str) -> str:
    other = np.dtype(np.uint32 if dtype == np.uint16 else np.uint16)
    if size == n_tokens * other.itemsize:
        edit = f"set \"dtype\": \"{other.name}\" in meta.json or " if fix == _PREPARE_HINT else ""  # not a cache's
        return (f"{file} holds {n_tokens} {other.name} tokens but meta.json says dtype {dtype.name} (dtype mismatch); "
                f"{edit}{_recreate(fix)}")
    return (f"{file} is {size} bytes, but meta.json says {n_tokens} {dtype.name} tokens ({n_tokens * dtype.itemsize} "
            f"bytes): a dtype mismatch, a truncated file or a stale meta.json; {fix}")


# Batches ---------------------------------------------------------------------------------------------------------

def window(data: TokenData, *, seed: int, step: int, batch_size: int, accum_steps: int, seq_len: int,
           process_index: int = 0, process_count: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The training micro-batches of optimizer step `step` (0-based) for this process.

    batch_size: global sequences per optimizer step (all micro-steps, all processes). Returns (inputs, targets),
    int32, each (accum_steps, batch_size // accum_steps // process_count, seq_len); targets are the inputs shifted
    by one token. The step's batch_size windows are drawn from the key (seed, TRAIN, step) and cut into accum_steps
    micro-batches, of which this process keeps its contiguous rows: any accumulation and any number of processes
    train on the same sequences at every step, and a resumed run needs no data state.
    """
    return _batch(data.train, data.vocab_size, (seed, TRAIN, step), batch_size, accum_steps, seq_len,
                  process_index, process_count)


def eval_batch(data: TokenData, *, seed: int, index: int, batch_size: int, accum_steps: int, seq_len: int,
               process_index: int = 0, process_count: int = 1, split: str = "val") -> tuple[np.ndarray, np.ndarray]:
    """Fixed validation batch number `index`, shaped and cut as `window` (a step's worth of sequences, in
    micro-batches that fit where training's do), drawn from the val split with the key (seed, VAL, index): the
    same sequences at every evaluation, whatever the accumulation. split="train" draws from the train split with
    these keys (evaluate's --split train): sequences at random, not the windows of the first steps (TRAIN's keys)."""
    tokens = {"val": data.val, "train": data.train}[split]
    return _batch(tokens, data.vocab_size, (seed, VAL, index), batch_size, accum_steps, seq_len, process_index,
                  process_count)


def _batch(tokens: np.ndarray, vocab_size: int, key: tuple[int, int, int], batch_size: int, accum_steps: int,
           seq_len: int, process_index: int, process_count: int) -> tuple[np.ndarray, np.ndarray]:
    if batch_size % accum_steps:
        raise UserError(f"data.batch_size={batch_size} is not divisible by optim.grad_accum_steps={accum_steps}; "
                        f"batch_size counts sequences per optimizer step, so pick a multiple")
    starts_KxB = _starts(len(tokens), key, batch_size, seq_len).reshape(accum_steps, -1)
    w = _windows(tokens, vocab_size, _rows_of(starts_KxB, process_index, process_count), seq_len)
    return np.ascontiguousarray(w[..., :-1]), np.ascontiguousarray(w[..., 1:])


def continued_seed(checkpoint_seed: int, cfg: Config) -> int:
    """The data seed of a run that starts from a full training state (init.from), in both backends: the
    checkpoint's, so that the run sees the batches the checkpoint's own run would have seen next, unless
    init.reseed asks for this run's run.seed. Says so on stderr when the two differ."""
    if checkpoint_seed == cfg.run.seed:
        return checkpoint_seed
    if cfg.init.reseed:
        print(f"init.from: drawing batches from run.seed={cfg.run.seed} (init.reseed), not from the checkpoint's "
              f"batch order (data seed {checkpoint_seed})", file=sys.stderr)
        return cfg.run.seed
    print(f"warning: init.from continues the checkpoint's batch order (data seed {checkpoint_seed}), not "
          f"run.seed={cfg.run.seed}; pass --init.reseed=true to draw batches from run.seed instead", file=sys.stderr)
    return checkpoint_seed


def _starts(n_tokens: int, key: tuple[int, ...], n: int, seq_len: int) -> np.ndarray:
    """n window offsets into a split of n_tokens: PCG64's raw 64-bit outputs modulo the number of start positions
    (bias < 1e-9 for any real split). numpy guarantees the bit stream of PCG64 and SeedSequence across versions,
    but not Generator.integers."""
    if not 0 <= key[0] < 2**32:
        raise UserError(f"run.seed={key[0]} must be in [0, 2**32)")
    raw = np.random.PCG64(list(key)).random_raw(n)
    return (raw % np.uint64(n_tokens - seq_len)).astype(np.int64)


def _rows_of(starts_KxB: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's contiguous share of each micro-batch's rows: (K, B // process_count)."""
    rows = starts_KxB.shape[1]
    if rows % process_count:
        raise UserError(f"the micro-batch of {rows} sequences does not split over {process_count} processes; "
                        f"make data.batch_size a multiple of {process_count} x optim.grad_accum_steps")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    per_process = rows // process_count
    return starts_KxB[:, process_index * per_process:(process_index + 1) * per_process]


def _windows(tokens: np.ndarray, vocab_size: int, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """The windows of seq_len + 1 tokens at `starts`: starts.shape + (seq_len + 1,), int32."""
    w = tokens[starts[..., None] + np.arange(seq_len + 1)]
    # before the int32 cast, which would make a huge id "ignored"
    _check_ids(int(w.max()), vocab_size, "the data", _PREPARE_HINT)
    return w.astype(np.int32)


def _check_ids(top: int, vocab_size: int, where: str, fix: str) -> None:
    if top >= vocab_size:
        also = ", or fix vocab_size" if fix == _PREPARE_HINT else ""
        raise UserError(f"token id {top} in {where} is >= vocab_size {vocab_size} from meta.json; the files and "
                        f"meta.json disagree: {_recreate(fix)}{also}")


def _recreate(fix: str) -> str:
    """A damaged data folder's fix: a data.path's is to prepare it again."""
    return f"re-create the folder: {fix}" if fix == _PREPARE_HINT else fix


def _prepare(args: argparse.Namespace) -> None:
    with exit_on_interrupt(f"{args.out} is unchanged"):  # prepare leaves --out as it was when interrupted
        prepare_lib.prepare(args.input, args.out, args.tokenizer, args.val_fraction, args.workers,
                            overwrite=args.overwrite, text_field=args.text_field)


def main(argv: list[str] | None = None) -> None:
    ap = OneLineParser(prog="python -m jaxtrain.data", description="Prepare token data and inspect it.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into train.bin, val.bin, meta.json")
    p.add_argument("--input", nargs="+", required=True,
                   help="text files, JSON Lines or Parquet files of documents, or folders (their files, recursively; "
                        "hidden names and data folders skipped)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--text-field", default=prepare_records.DEFAULT_FIELD,
                   help="the field of a JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet file's records that "
                        "holds their text, a document each (default: text)")
    p.add_argument("--tokenizer", choices=prepare_lib.TOKENIZERS, required=True)
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="tail of the token stream held out for val (default 0.1)")
    p.add_argument("--overwrite", action="store_true", help="replace the data an existing --out folder holds")
    p.add_argument("--workers", type=positive_int, help=f"encoding threads, at most the cores this process may run "
                                                        f"on; default: those, at most {prepare_lib.MAX_WORKERS}")
    s = sub.add_parser("stats", help="token counts and the entropies a model's loss should beat")
    s.add_argument("--data-path", help="data folder; default: the embedded corpus")
    s.add_argument("--cache-dir", help="where the embedded corpus is prepared; default: ~/.cache/jaxtrain")
    with exit_on_user_error():
        args = ap.parse_args(argv)
        if args.command == "prepare":
            _prepare(args)
        else:
            data_stats.print_stats(load(DataConfig(path=args.data_path, cache_dir=args.cache_dir), seq_len=1))


if __name__ == "__main__":
    main()
