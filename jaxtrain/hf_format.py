"""Hugging Face transformers' GPT-2 format (a `GPT2LMHeadModel` folder: config.json, model.safetensors, or the
shards a model.safetensors.index.json maps), written and read with json, numpy and safetensors only: jaxtrain
never imports transformers (nor, through it, torch).

nanoGPT took GPT-2's parameter names, so the torch format's model.safetensors (torch_format.py) and HF's differ in
two things only: HF's attention and MLP projections are `Conv1D`s, whose weight is (in, out), the transpose of
nanoGPT's Linear (out, in); and HF leaves `lm_head.weight` out when the head is tied to `wte`. config.json states
what nanoGPT's model is: exact GELU (`activation_function="gelu"`), or GPT-2's tanh approximation (`gelu_new`,
model.gelu_approximate=tanh: OpenAI's GPT-2 checkpoints), LayerNorm eps 1e-5, an MLP of 4 x n_embd, biases everywhere
(a model without them is written with zero ones, which add nothing, and `"jaxtrain_bias": false`, a key transformers
keeps through a load and a save, so that from-hf gives back a model without them). Models that differ otherwise
(another activation or MLP width) are refused with the reason: converting them would change what they compute.
"""

import json
import os
import shutil

import ml_dtypes  # numpy's bfloat16
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxtrain import runfolder
from jaxtrain.checkpoint_kind import HF_SHARD_INDEX
from jaxtrain.checkpoint_model import HF_GELUS, hf_gelu
from jaxtrain.config import ModelConfig
from jaxtrain.errors import UserError
from jaxtrain.gpt2_bpe import EOT_ID as GPT2_EOT_ID
from jaxtrain.gpt2_bpe import HF_FAST, HF_MERGES, HF_SETTINGS, HF_VOCAB
from jaxtrain.layer_norm import LN_EPS
from jaxtrain.torch_format import folder_into_place

CONFIG, MODEL = "config.json", "model.safetensors"
# GPT-2's BPE as OpenAI released it (gpt2_bpe.files) -> the names HF's GPT2Tokenizer reads: the same files.
GPT2_TOKENIZER_FILES = {"encoder.json": HF_VOCAB, "vocab.bpe": HF_MERGES}
# What from-hf carries beside the weights, and to-hf back from its folder, byte for byte: the tokenizer that came with
# the model (any of transformers' files of it) and how generate() draws from it.
TOKENIZER_FILES = (HF_VOCAB, HF_MERGES, HF_FAST, HF_SETTINGS, "special_tokens_map.json")
CARRIED_FILES = (*TOKENIZER_FILES, "generation_config.json")
EOT = "<|endoftext|>"
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
LM_HEAD = "lm_head.weight"
MODULES = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")  # a layer's, each weight and bias
BASE = "transformer."  # GPT2LMHeadModel's name for the GPT2Model in it, which nanoGPT's GPT took too
BIAS = "jaxtrain_bias"  # config.json's key: false for a model without biases (model.bias=false), written as zeros
# to-hf --dtype: the weights' dtype, which config.json's "dtype" (transformers 5) and "torch_dtype" (4) name and
# from_pretrained loads them in (transformers 5 by default; 4 with torch_dtype="auto")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def hf_config(model: ModelConfig, vocab_size: int) -> dict:
    """config.json of a GPT2LMHeadModel that computes what jaxtrain's `model` computes (with the residual stream in
    fp32 whatever model.residual_dtype says: transformers' GPT-2 has no bf16 stream; the weights are the same; a
    model without biases with the zero ones of with_zero_biases)."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab_size,
            "n_positions": model.seq_len, "n_embd": model.d_model, "n_layer": model.n_layer,
            "n_head": model.n_head, "n_inner": None,
            "activation_function": "gelu_new" if model.gelu_approximate == "tanh" else "gelu",
            "layer_norm_epsilon": LN_EPS, "resid_pdrop": model.dropout, "embd_pdrop": model.dropout,
            "attn_pdrop": model.dropout, "initializer_range": 0.02, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": model.tie_embeddings, **_special_tokens(vocab_size),
            **({} if model.bias else {BIAS: False})}


def _special_tokens(vocab_size: int) -> dict:
    """GPT-2's <|endoftext|> (50256) as the begin and end of text where the vocabulary holds it (GPT-2 BPE data);
    none for a byte-level vocabulary, where transformers' default of 50256 lies outside it and every load warns."""
    eot = GPT2_EOT_ID if vocab_size > GPT2_EOT_ID else None
    return {"bos_token_id": eot, "eos_token_id": eot}


def model_overrides(hf: dict, file: str) -> dict:
    """The jaxtrain model.* settings of an HF GPT-2 config.json, or one UserError naming what jaxtrain's model
    cannot compute the same way."""
    if hf.get("model_type") != "gpt2":
        raise UserError(f"{file}: model_type {hf.get('model_type')!r}; only GPT-2 (GPT2LMHeadModel) converts")
    _check_values(hf, file)
    d = hf.get("n_embd", 768)
    unlike = {"n_inner": (4 * d if hf.get("n_inner") is None else hf["n_inner"], 4 * d),  # None: HF's 4 x n_embd
              "layer_norm_epsilon": (hf.get("layer_norm_epsilon", 1e-5), LN_EPS),
              "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), False),
              "reorder_and_upcast_attn": (hf.get("reorder_and_upcast_attn", False), False),
              "scale_attn_weights": (hf.get("scale_attn_weights", True), True)}
    for key, (found, jaxtrain_has) in unlike.items():
        if found != jaxtrain_has:
            raise UserError(f"{file}: {key}={found!r}, where jaxtrain's model (nanoGPT's) has {jaxtrain_has!r}; "
                            f"converted, the model would compute something else")
    gelu = hf_gelu(hf)
    if gelu is None:
        activation = hf["activation_function"]  # named: absent is gelu_new
        raise UserError(f"{file}: activation_function={activation!r}, where jaxtrain's model computes a GELU, exact "
                        f"or tanh (model.gelu_approximate none or tanh: {', '.join(HF_GELUS)}); converted, the model "
                        f"would compute something else")
    return {"vocab_size": hf.get("vocab_size", 50257), "seq_len": hf.get("n_positions", 1024),
            "n_layer": hf.get("n_layer", 12), "n_head": hf.get("n_head", 12), "d_model": d,
            "dropout": hf.get("resid_pdrop", 0.1), "bias": hf.get(BIAS, True),
            "tie_embeddings": hf.get("tie_word_embeddings", True), "gelu_approximate": gelu}


# config.json's keys that shape the model: each a whole number > 0 where given (HF's defaults otherwise)
_SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


def _check_values(hf: dict, file: str) -> None:
    """One UserError naming the first key whose value jaxtrain cannot take (a hand-edited config.json: "2", 2.0,
    "yes", a dropout of 1, a head count that does not divide the width)."""
    for key in _SIZES:
        if key in hf and not (type(hf[key]) is int and hf[key] > 0):
            raise UserError(f"{file}: {key}={hf[key]!r}, where a whole number > 0 is needed")
    if hf.get("n_embd", 768) % hf.get("n_head", 12):
        raise UserError(f"{file}: n_head={hf.get('n_head', 12)} does not divide n_embd={hf.get('n_embd', 768)}")
    for key in ("tie_word_embeddings", BIAS):
        if not isinstance(hf.get(key, True), bool):
            raise UserError(f"{file}: {key}={hf[key]!r}, where true or false is needed")
    dropout = hf.get("resid_pdrop", 0.1)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise UserError(f"{file}: resid_pdrop={dropout!r}, where a number in [0, 1) is needed")


def check_shapes(tensors: dict[str, np.ndarray], model: dict, file: str) -> None:
    """Each tensor (HF's names and Conv1D layout) the shape config.json's model gives it, or one UserError naming
    the first that differs: config.json and the weights disagree, and a run would refuse the conversion later."""
    d, V, T = model["d_model"], model["vocab_size"], model["seq_len"]
    for name, x in tensors.items():
        want = _shape(name, d, V, T)
        if tuple(x.shape) != want:
            raise UserError(f"{file}: {name} is {tuple(x.shape)}, but config.json (vocab_size {V}, n_positions "
                            f"{T}, n_embd {d}) makes it {want}; convert a folder whose config.json describes its "
                            f"weights, as model.save_pretrained(dir) writes them")


def _shape(name: str, d: int, V: int, T: int) -> tuple[int, ...]:
    """The shape of GPT-2's tensor `name` (HF's Conv1D layout) for n_embd d, vocab size V and n_positions T."""
    by_suffix = {"wte.weight": (V, d), "wpe.weight": (T, d), "attn.c_attn.weight": (d, 3 * d),
                 "attn.c_attn.bias": (3 * d,), "attn.c_proj.weight": (d, d), "mlp.c_fc.weight": (d, 4 * d),
                 "mlp.c_fc.bias": (4 * d,), "mlp.c_proj.weight": (4 * d, d), LM_HEAD: (V, d)}
    return next((shape for suffix, shape in by_suffix.items() if name.endswith(suffix)), (d,))  # LN, other biases


def read_model(src: str) -> tuple[dict[str, np.ndarray], dict, dict, str]:
    """(its tensors in nanoGPT's names and layout, its jaxtrain model.* settings, its config.json, what to say of
    them) of the Hugging Face GPT-2 folder `src`: what from-hf writes, and sample --from reads. A model to-hf wrote
    without biases (jaxtrain_bias false) comes without to-hf's zero biases, or with its biases where they were
    trained since (not all zero), and config.json then without the key."""
    config = read_config(src)
    model = model_overrides(config, os.path.join(src, CONFIG))
    listed = weights_file(src)  # what the refusals of its tensors name
    tensors = lm_head_model_tensors(read_tensors(src), model["n_layer"], model["tie_embeddings"], listed)
    check_shapes(tensors, model, listed)
    if model["tie_embeddings"]:
        tensors.pop(LM_HEAD, None)  # the same array as wte's, where a writer kept it
    note = ""
    if not model["bias"] and (trained := trained_biases(tensors)):
        model["bias"], config = True, {key: x for key, x in config.items() if key != BIAS}
        note = (f" ({BIAS} was false: to-hf wrote the model without biases, and {len(trained)} of its bias tensors, "
                f"{trained[0]!r} first, are no longer zero: trained since, so kept, and the model has biases)")
    elif not model["bias"]:  # to-hf's zeros: the model trains without them, as before its export
        tensors = {name: x for name, x in tensors.items() if not name.endswith(".bias")}
    return to_nanogpt(tensors), model, config, note


def lm_head_model_tensors(tensors: dict[str, np.ndarray], n_layer: int, tied: bool,
                          file: str) -> dict[str, np.ndarray]:
    """HF's state dict named as GPT2LMHeadModel's: the names of a GPT2Model's (GPT2Model.save_pretrained) lack
    "transformer.", which is added, as GPT2LMHeadModel.from_pretrained adds it. A tensor nanoGPT's GPT of `n_layer`
    layers has no place for (a classification head's score.weight) is refused, naming it, and so is one it needs
    that is missing (config.json's n_layer above the file's layers; an untied model without its head): a run would
    refuse the converted checkpoint, with a message about the run's model config, or init.from naming one."""
    if not any(name.startswith(BASE) for name in tensors):
        tensors = {BASE + name: x for name, x in tensors.items()}
    layer = [f"h.{i}.{module}.{kind}" for i in range(n_layer) for kind in ("weight", "bias") for module in MODULES]
    gpt = {BASE + name for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", *layer)} | {LM_HEAD}
    unknown = sorted(tensors.keys() - gpt)
    if unknown:
        raise UserError(f"{file}: tensor {unknown[0]!r} has no place in a GPT2LMHeadModel of {n_layer} layers "
                        f"(nanoGPT's GPT); convert the GPT-2 body alone, saved with "
                        f"model.transformer.save_pretrained(dir)")
    missing = sorted(gpt - tensors.keys() - ({LM_HEAD} if tied else set()))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"{file}: holds no tensor {missing[0]!r}{more}, which a GPT2LMHeadModel of {n_layer} layers "
                        f"(config.json) needs; convert a folder whose config.json describes its weights, as "
                        f"model.save_pretrained(dir) writes them")
    return tensors


def with_zero_biases(tensors: dict[str, np.ndarray], model: ModelConfig, src: str,
                     setting: str = "model.bias=false") -> tuple[dict[str, np.ndarray], str]:
    """The torch format's tensors of a model without biases (model.bias=false, nanoGPT's train.py default; from-hf's
    folder of one says `setting`, jaxtrain_bias: false) with the biases HF's GPT-2 always has, as zeros: x + 0 is x,
    so transformers computes what the model does; and to-hf's note of it. Refused where `src`'s tensors hold biases
    all the same: its config and its weights disagree."""
    held = sorted(name for name in tensors if name.endswith(".bias"))
    if held:
        raise UserError(f"{src}: its config says {setting}, and its weights hold {len(held)} bias tensors "
                        f"({held[0]!r} first): its files disagree (one edited, or copied from another checkpoint); "
                        f"copy or convert the whole folder again")
    names = [f"{BASE}h.{i}.{module}.bias" for i in range(model.n_layer) for module in MODULES] + [f"{BASE}ln_f.bias"]
    dtype = tensors[f"{BASE}ln_f.weight"].dtype
    zeros = {name: np.zeros(_shape(name, model.d_model, model.vocab_size, model.seq_len), dtype) for name in names}
    note = f"; the model has no biases ({setting}): they are written as zeros, which add nothing"
    return {**tensors, **zeros}, note


def trained_biases(tensors: dict[str, np.ndarray]) -> list[str]:
    """The bias tensors that are not all zero: of a model to-hf wrote without biases (config.json's jaxtrain_bias
    false), those trained since in transformers, which make it a model with biases."""
    return sorted(name for name, x in tensors.items() if name.endswith(".bias") and np.any(x))


def saved_dtype(config: dict) -> str:
    """The dtype an HF config.json says its weights were saved in (what from-hf read, as fp32), where it is one of
    DTYPES; float32 otherwise (none said, or another, or no string at all: a hand-edited file)."""
    said = config.get("dtype") or config.get("torch_dtype")
    return said if isinstance(said, str) and said in DTYPES else "float32"


def held_exactly(tensors: dict[str, np.ndarray], dtype: str) -> bool:
    """Whether every value of the fp32 `tensors` is one of `dtype`'s: written in it, none changes."""
    with np.errstate(over="ignore"):
        return all(_same(x.astype(DTYPES[dtype]), x) for x in tensors.values())


def _same(cast: np.ndarray, x: np.ndarray) -> bool:
    """Whether `cast`, fp32 `x` in a narrower dtype, holds x's values (an overflow to inf does not)."""
    return np.array_equal(cast.astype(np.float32), x, equal_nan=True)


def in_dtype(tensors: dict[str, np.ndarray], dtype: str, src: str,
             why: str = "") -> tuple[dict[str, np.ndarray], str]:
    """fp32 `tensors` in `dtype`, each rounded to the nearest value (ties to even), as torch's .to(dtype) rounds, and
    what to-hf says of it (`why` that dtype after its name); one UserError where a weight lies past dtype's range
    (float16's 65504; bfloat16's is float32's but for its last half-ulp), which the cast would turn to inf."""
    if dtype == "float32":
        return tensors, ""
    with np.errstate(over="ignore"):
        cast = {name: x.astype(DTYPES[dtype]) for name, x in tensors.items()}
    for name, x in cast.items():
        over = np.isinf(x) & np.isfinite(tensors[name])
        if np.any(over):
            wider = "--dtype bfloat16 (float32's range) or float32" if dtype == "float16" else "--dtype float32"
            raise UserError(f"--dtype {dtype}: {src}'s {name} holds {np.max(np.abs(tensors[name][over])):.6g}, past "
                            f"{dtype}'s largest value, {float(ml_dtypes.finfo(DTYPES[dtype]).max):.6g}; write it "
                            f"with {wider}")
    rounded = sum(not _same(cast[name], x) for name, x in tensors.items())
    if not rounded:
        return cast, f"; the weights are {dtype}{why}, exactly: each was a {dtype} value already"
    return cast, (f"; the weights are rounded to {dtype}{why} ({rounded} of {len(cast)} tensors changed; --dtype "
                  f"float32 writes them exactly)")


def from_nanogpt(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """nanoGPT's state dict (the torch format's) -> HF's: the Conv1D weights transposed. Both leave a tied head out."""
    return {name: np.ascontiguousarray(x.T) if name.endswith(CONV1D) else x for name, x in tensors.items()}


def to_nanogpt(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """HF's state dict -> nanoGPT's (its own inverse: the Conv1D weights transposed back)."""
    return from_nanogpt(tensors)


def write(out_dir: str, tensors: dict[str, np.ndarray], config: dict, gpt2_files: dict[str, str] | None = None,
          carried: tuple[str, ...] = ()) -> None:
    """An HF model folder, with GPT-2's tokenizer where `gpt2_files` (gpt2_bpe.files) are given and the
    `carried` files (carried_files) copied in under their names, written under a temporary name and moved into
    place."""
    with folder_into_place(out_dir) as tmp:
        save_file(tensors, os.path.join(tmp, MODEL), metadata={"format": "pt"})
        runfolder.as_open_makes_it(os.path.join(tmp, MODEL))
        _write_json(os.path.join(tmp, CONFIG), config)
        for file in carried:
            shutil.copyfile(file, os.path.join(tmp, os.path.basename(file)))
        if gpt2_files:
            for name, hf_name in GPT2_TOKENIZER_FILES.items():
                shutil.copyfile(gpt2_files[name], os.path.join(tmp, hf_name))
            _write_json(os.path.join(tmp, HF_SETTINGS), {
                "tokenizer_class": "GPT2Tokenizer", "model_max_length": config["n_positions"],
                "bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "add_prefix_space": False})


def carried_files(src: str) -> tuple[str, ...]:
    """The CARRIED_FILES that the folder `src` holds."""
    return tuple(os.path.join(src, name) for name in CARRIED_FILES if os.path.isfile(os.path.join(src, name)))


def _write_json(path: str, content: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2)


def read_config(src: str) -> dict:
    file = os.path.join(src, CONFIG)
    fix = "point at a folder that GPT2LMHeadModel.save_pretrained wrote"
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{file} is missing or not JSON ({e}); {fix}") from None
    if not isinstance(config, dict):
        raise UserError(f"{file} holds a JSON {type(config).__name__}, not an object of GPT-2's settings; {fix}")
    return config


def weights_file(src: str) -> str:
    """The file that lists src's tensors: its model.safetensors, or the model.safetensors.index.json of a save
    cut into shards (save_pretrained past its max_shard_size: GPT-2 XL's 6.2 GB of fp32 is past transformers 4's 5
    GB); model.safetensors where both are, as transformers reads them. UserError where neither is."""
    for name in (MODEL, HF_SHARD_INDEX):
        if os.path.exists(os.path.join(src, name)):
            return os.path.join(src, name)
    raise UserError(f"{src} has no {MODEL} nor {HF_SHARD_INDEX} (a pytorch_model.bin checkpoint?); load it in "
                    f"transformers and save it again with model.save_pretrained(dir) (safetensors)")


def read_tensors(src: str) -> dict[str, np.ndarray]:
    """The tensors of src's weights_file, or of the shards it maps, in fp32 whatever they were saved in (bf16 too:
    safetensors >= 0.4.1 reads it into numpy as ml_dtypes' bfloat16, imported above), HF's causal-mask buffers left
    out (older checkpoints saved them)."""
    listed = weights_file(src)
    shards = {listed: None} if os.path.basename(listed) == MODEL else _shards(src, listed)
    tensors = {}
    for file, names in shards.items():
        try:
            with safe_open(file, framework="np") as f:
                if names is not None and set(names) != set(f.keys()):
                    raise UserError(_disagree(listed, file, set(names), set(f.keys())))
                tensors |= {name: f.get_tensor(name).astype(np.float32) for name in f.keys()
                            if not name.endswith((".attn.bias", ".attn.masked_bias"))}
        except (OSError, SafetensorError, TypeError) as e:
            raise UserError(f"{file} is unreadable ({e}); copy it again if it was truncated, or save it again with "
                            f"model.save_pretrained(dir)") from None
    return tensors


_RESAVE = "copy the folder again, or save it again with model.save_pretrained(dir)"


def _shards(src: str, index: str) -> dict[str, list[str]]:
    """shard file -> the tensor names the sharded save's `index` maps to it."""
    try:
        with open(index, encoding="utf-8") as f:
            written = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{index} is unreadable ({e}); {_RESAVE}") from None
    weight_map = written.get("weight_map") if isinstance(written, dict) else None
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise UserError(f"{index} holds no weight_map of tensor name -> file name, as save_pretrained writes; "
                        f"{_RESAVE}")
    files = {}
    for name, shard in weight_map.items():
        files.setdefault(os.path.join(src, shard), []).append(name)
    for file in files:
        if not os.path.isfile(file):
            raise UserError(f"{index} maps tensors to {os.path.basename(file)}, which {src} does not hold; {_RESAVE}")
    return files


def _disagree(index: str, file: str, mapped: set[str], held: set[str]) -> str:
    """The first tensor the index and a shard disagree on, named."""
    shard = os.path.basename(file)
    if mapped - held:
        return f"{index} maps {min(mapped - held)!r} to {shard}, which does not hold it; {_RESAVE}"
    return f"{file} holds {min(held - mapped)!r}, which {index} does not map to it; {_RESAVE}"
