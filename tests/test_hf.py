"""python -m jaxtrain.convert to-hf / from-hf against Hugging Face transformers itself: exports load in
GPT2LMHeadModel with no missing or unexpected keys and compute the same logits; a model transformers wrote
round-trips bit for bit and fine-tunes with --init.from; models jaxtrain cannot compute the same way are refused."""

import dataclasses
import filecmp
import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from safetensors import safe_open

from jaxtrain import checkpoint_kind, config, convert, gpt2_bpe, hf_format, model, prepare, run, torch_format
from jaxtrain.errors import UserError
from test_run import read_metrics, small_args

DIMS = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2)  # test_run's small model, bytes


def hf_model(tmp_path, **overrides):
    torch.manual_seed(0)
    hf_config = transformers.GPT2Config(**{**DIMS, "activation_function": "gelu", **overrides})
    path = tmp_path / "hf"
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(path)
    return str(path)


def tensors(folder):
    with safe_open(f"{folder}/model.safetensors", framework="np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def jaxtrain_logits(model_cfg, params, idx) -> np.ndarray:
    """The fp32 logits (float64) of jaxtrain's model of `model_cfg` (256 byte ids) with `params` on the batch idx."""
    graphdef = model.graphdef(model_cfg, vocab_size=256, precision="fp32")
    return np.asarray(jax.jit(model.apply, static_argnums=0)(graphdef, params, idx), np.float64)


def refused(capsys, argv: list[str]) -> str:
    """What `python -m jaxtrain.convert ARGV` prints on stderr, where it exits 2 (what came before is dropped:
    transformers' progress bars, earlier commands' lines)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        convert.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("tie", [True, False])
def test_a_model_transformers_wrote_round_trips_bit_for_bit(tmp_path, tie):
    source = hf_model(tmp_path, tie_word_embeddings=tie)
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    before, after = tensors(source), tensors(tmp_path / "back")
    assert set(before) == set(after) and ("lm_head.weight" in after) == (not tie)
    assert all(np.array_equal(before[name], after[name]) for name in before)
    # nanoGPT's layout in between: Linear weights (out, in), the transpose of HF's Conv1D (in, out)
    np.testing.assert_array_equal(tensors(tmp_path / "jt")["transformer.h.0.mlp.c_fc.weight"],
                                  before["transformer.h.0.mlp.c_fc.weight"].T)


def sharded_save(tmp_path) -> tuple[str, str]:
    """(the one-file save, the same model saved in shards of 40 KB: several, which model.safetensors.index.json
    maps)"""
    source = hf_model(tmp_path)
    transformers.GPT2LMHeadModel.from_pretrained(source).save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    return source, str(tmp_path / "sharded")


def test_a_sharded_save_converts_as_the_one_file_does(tmp_path):
    """save_pretrained cuts a model past max_shard_size (transformers 4's default: 5 GB, under GPT-2 XL's 6.2 GB of
    fp32) into files a model.safetensors.index.json maps: from-hf refused the folder ("has no model.safetensors").
    It reads the shards, and the round trip gives the one-file save's tensors bit for bit. init.from is told to
    convert it, as a one-file HF folder."""
    source, sharded = sharded_save(tmp_path)
    shards = sorted(name for name in os.listdir(sharded) if name.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors" not in shards, shards
    assert checkpoint_kind.kind(sharded) == checkpoint_kind.HF
    with pytest.raises(UserError, match="from-hf"):
        checkpoint_kind.check_torch_source(sharded, "init.from")
    convert.main(["from-hf", sharded, str(tmp_path / "jt")])
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    before, after = tensors(source), tensors(tmp_path / "back")
    assert set(before) == set(after) and all(np.array_equal(before[name], after[name]) for name in before)


RESAVE = "copy the folder again, or save it again with model.save_pretrained(dir)"


@pytest.mark.parametrize("damage", ["no weight_map", "a shard gone", "a tensor mapped to the wrong shard",
                                    "a tensor the index leaves out"])
def test_a_sharded_save_whose_index_and_shards_disagree_is_one_line(tmp_path, capsys, damage):
    _, sharded = sharded_save(tmp_path)
    index = os.path.join(sharded, "model.safetensors.index.json")
    written = json.loads(open(index).read())
    weight_map = written["weight_map"]
    first, last = sorted(set(weight_map.values()))[0], sorted(set(weight_map.values()))[-1]
    name = min(n for n, shard in weight_map.items() if shard == first)
    if damage == "no weight_map":
        written = {"metadata": written["metadata"]}
        says = f"{index} holds no weight_map of tensor name -> file name, as save_pretrained writes; {RESAVE}"
    elif damage == "a shard gone":
        os.remove(os.path.join(sharded, last))
        says = f"{index} maps tensors to {last}, which {sharded} does not hold; {RESAVE}"
    elif damage == "a tensor mapped to the wrong shard":
        weight_map[name] = last
        says = f"{index} maps {name!r} to {last}, which does not hold it; {RESAVE}"
    else:
        del weight_map[name]
        says = f"{os.path.join(sharded, first)} holds {name!r}, which {index} does not map to it; {RESAVE}"
    open(index, "w").write(json.dumps(written))
    assert refused(capsys, ["from-hf", sharded, str(tmp_path / "jt")]) == f"error: {says}\n"
    assert not (tmp_path / "jt").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_save_converts_to_its_values_in_fp32(tmp_path, dtype):
    """A model saved in bf16 (numpy reads it through ml_dtypes, which jax brings) or fp16 converts to fp32 tensors
    holding exactly its values, which torch's own cast to fp32 gives."""
    source = hf_model(tmp_path)
    transformers.GPT2LMHeadModel.from_pretrained(source, dtype=dtype).save_pretrained(tmp_path / "half")
    convert.main(["from-hf", str(tmp_path / "half"), str(tmp_path / "jt")])
    with safe_open(f"{tmp_path / 'half'}/model.safetensors", framework="pt") as f:
        saved = {name: f.get_tensor(name) for name in f.keys()}
    assert {x.dtype for x in saved.values()} == {dtype}
    converted = tensors(tmp_path / "jt")
    assert set(converted) == set(saved)
    for name, x in saved.items():
        want = x.float().numpy()
        assert converted[name].dtype == np.float32
        np.testing.assert_array_equal(converted[name], want.T if name.endswith(hf_format.CONV1D) else want)


def torch_tensors(folder) -> dict[str, torch.Tensor]:
    with safe_open(f"{folder}/model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_save_goes_back_to_transformers_as_it_came(tmp_path, capsys, dtype):
    """from-hf reads a bf16 or fp16 save as fp32; to-hf of its folder writes the dtype its config.json says (each
    value exactly the one saved), and config.json names it, so that from_pretrained loads the model in it; --dtype
    float32 widens it, and config.json says so (transformers 5 would load fp32 weights named bf16 as bf16)."""
    name = str(dtype).removeprefix("torch.")
    transformers.GPT2LMHeadModel.from_pretrained(hf_model(tmp_path), dtype=dtype).save_pretrained(tmp_path / "half")
    convert.main(["from-hf", str(tmp_path / "half"), str(tmp_path / "jt")])
    capsys.readouterr()
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    assert capsys.readouterr().err.endswith(f"; the weights are {name} (config.json's dtype: from-hf read them in "
                                            f"it), exactly: each was a {name} value already\n")
    saved, back = torch_tensors(tmp_path / "half"), torch_tensors(tmp_path / "back")
    assert set(back) == set(saved)
    for key, x in saved.items():
        assert back[key].dtype == dtype and torch.equal(back[key], x), key
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "wide"), "--dtype", "float32"])
    for folder, want in (("back", dtype), ("wide", torch.float32)):
        written = json.loads((tmp_path / folder / "config.json").read_text())
        assert written["dtype"] == written["torch_dtype"] == str(want).removeprefix("torch.")
        loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / folder)  # transformers 5: dtype="auto"
        assert {p.dtype for p in loaded.parameters()} == {want}


def test_to_hf_dtype_rounds_a_runs_weights_as_torch_does(tmp_path, cache_dir, capsys):
    """A run's fp32 weights written in bf16 or fp16 (--dtype): each the value torch's .to(dtype) gives (round to
    nearest, ties to even), bit for bit; to-hf says they were rounded."""
    out = tmp_path / "run"
    run.train(config.load(small_args(out, cache_dir, "--train.steps=4")))
    step = str(out / "checkpoints" / "4")
    convert.main(["to-hf", step, str(tmp_path / "fp32")])
    exact = torch_tensors(tmp_path / "fp32")
    assert {x.dtype for x in exact.values()} == {torch.float32}
    for dtype in (torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        capsys.readouterr()
        convert.main(["to-hf", step, str(tmp_path / name), f"--dtype={name}"])
        assert f"; the weights are rounded to {name} (" in capsys.readouterr().err
        half = torch_tensors(tmp_path / name)
        assert set(half) == set(exact) and json.loads((tmp_path / name / "config.json").read_text())["dtype"] == name
        for key, x in exact.items():
            assert half[key].dtype == dtype
            assert torch.equal(half[key].view(torch.int16), x.to(dtype).view(torch.int16)), (name, key)


@pytest.mark.parametrize("said, written", [({"dtype": None, "torch_dtype": "bfloat16"}, "bfloat16"),
                                           ({"dtype": ["bfloat16"]}, "float32"), ({"dtype": "int8"}, "float32"),
                                           ({"dtype": "float16"}, "float32")])
def test_to_hf_of_from_hfs_folder_takes_its_config_dtype_only_where_it_holds(tmp_path, capsys, said, written):
    """config.json's dtype (transformers 5's key, else 4's torch_dtype) where it is one to-hf writes and the
    weights are all values of it; a list (a hand edit: it was a raw TypeError) or another dtype is no such word;
    float16 said of weights that are not fp16 values (fp32 ones, here) is not believed, and to-hf says so."""
    source = hf_model(tmp_path)
    if written == "bfloat16":  # weights that are bf16 values, as a bf16 save's are
        transformers.GPT2LMHeadModel.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(source)
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    config_file = tmp_path / "jt" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **said}))
    capsys.readouterr()
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    err = capsys.readouterr().err
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == written
    assert {x.dtype for x in torch_tensors(tmp_path / "back").values()} == {getattr(torch, written)}
    distrusted = ("; the weights are float32: config.json says float16, and they are not all float16 values (changed "
                  "since from-hf read them?); --dtype float16 rounds them")
    assert (distrusted in err) == (said == {"dtype": "float16"}), err


def test_a_weight_past_float16s_range_is_refused_naming_it(tmp_path, capsys):
    """Written in fp16 it would be inf; bf16 has fp32's range and takes it."""
    source = hf_model(tmp_path)
    held = tensors(source)
    held["transformer.h.1.mlp.c_proj.weight"][3, 5] = -70000.0
    safetensors.numpy.save_file(held, f"{source}/model.safetensors", metadata={"format": "pt"})
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    said = refused(capsys, ["to-hf", str(tmp_path / "jt"), str(tmp_path / "back"), "--dtype=float16"])
    assert said == (f"error: --dtype float16: {tmp_path / 'jt'}'s transformer.h.1.mlp.c_proj.weight holds 70000, "
                    f"past float16's largest value, 65504; write it with --dtype bfloat16 (float32's range) or "
                    f"float32\n")
    assert not (tmp_path / "back").exists()
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back"), "--dtype=bfloat16"])
    assert tensors(tmp_path / "back")["transformer.h.1.mlp.c_proj.weight"][3, 5] == -70144  # bf16's nearest, 8 bits


@pytest.mark.parametrize("bias, gelu", [(True, "none"), (False, "none"), (True, "tanh")])
def test_a_trained_run_loads_in_transformers_with_the_same_logits(tmp_path, cache_dir, capsys, bias, gelu):
    """With biases or without (bias=False, nanoGPT's train.py default: HF's GPT-2 always has them, and to-hf writes
    zeros; before, to-hf refused such a model); with the exact GELU or GPT-2's tanh one (gelu_new)."""
    out = tmp_path / "run"
    run.train(config.load(small_args(out, cache_dir, "--train.steps=4", f"--model.bias={str(bias).lower()}",
                                     f"--model.gelu_approximate={gelu}")))
    capsys.readouterr()
    convert.main(["to-hf", str(out / "checkpoints" / "4"), str(tmp_path / "hf")])
    said = capsys.readouterr().err
    assert said.endswith("; the model has no biases (model.bias=false): they are written as zeros, which add "
                         "nothing\n") != bias, said
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert all(not keys for keys in info.values()), info
    held = tensors(tmp_path / "hf")
    biases = [name for name in held if name.endswith(".bias")]
    assert len(biases) == 2 * 6 + 1  # each layer's two LayerNorms and four projections, and ln_f
    nonzero = [np.any(held[name]) for name in biases]
    assert all(nonzero) if bias else not any(nonzero)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["activation_function"] == {
        "none": "gelu", "tanh": "gelu_new"}[gelu]
    state, cfg, _ = convert.restore_step(str(out / "checkpoints" / "4"))
    idx = np.random.default_rng(0).integers(0, 256, (3, 32))
    ours = jaxtrain_logits(cfg.model, state.params, idx)
    with torch.no_grad():
        theirs = loaded.eval()(torch.from_numpy(idx)).logits.double().numpy()
    # fp32 both sides, summed in other orders: each of the 2 * 4 + 1 matmuls (<= 128 terms) and 5 LayerNorms adds
    # a few fp32 ulps of its output; 1e-5 of the logits' scale is ~100 ulps (measured 2.1e-7: 3.5 ulps).
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    assert not (tmp_path / "hf" / "vocab.json").exists()  # byte tokens: no HF tokenizer encodes them
    # no <|endoftext|> among 256 byte ids: transformers' default of 50256 lay outside the vocabulary, and it warned
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (None, None)


def test_a_model_without_biases_comes_back_from_transformers_without_them(tmp_path, cache_dir, capsys):
    """to-hf writes a bias-free model (nanoGPT's default) with zero biases, which HF's GPT-2 always has: from-hf of
    it gave a model with biases, trained from zero. config.json's jaxtrain_bias: false (which transformers keeps
    through a load and a save) says they are to-hf's zeros: from-hf leaves them out, the model fine-tunes without
    them and goes back to HF bit for bit. Biases trained in transformers since are kept, the key dropped."""
    out, hf, again = tmp_path / "run", tmp_path / "hf", tmp_path / "hf-again"
    run.train(config.load(small_args(out, cache_dir, "--train.steps=4", "--model.bias=false")))
    convert.main(["to-hf", str(out / "checkpoints" / "4"), str(hf)])
    assert json.loads((hf / "config.json").read_text())["jaxtrain_bias"] is False
    transformers.GPT2LMHeadModel.from_pretrained(hf).save_pretrained(again)  # as a user's load and save
    capsys.readouterr()
    convert.main(["from-hf", str(again), str(tmp_path / "jt")])
    said = capsys.readouterr().err
    assert "--model.bias=false" in said and "no longer zero" not in said, said
    held = tensors(tmp_path / "jt")
    assert not [name for name in held if name.endswith(".bias")] and len(held) == 2 + 2 * 6 + 1  # wte, wpe, ln_f
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    assert capsys.readouterr().err.endswith("; the model has no biases (jaxtrain_bias: false): they are written as "
                                            "zeros, which add nothing\n")
    first, back = tensors(hf), tensors(tmp_path / "back")
    assert set(first) == set(back) and all(np.array_equal(first[name], back[name]) for name in first)
    run.train(config.load(small_args(tmp_path / "tuned", cache_dir, "--train.steps=3", "--model.bias=false",
                                     f"--init.from={tmp_path / 'jt'}")))
    assert [line["step"] for line in read_metrics(str(tmp_path / "tuned")) if "loss" in line][-1] == 3
    trained = transformers.GPT2LMHeadModel.from_pretrained(again)
    with torch.no_grad():
        trained.transformer.h[1].mlp.c_fc.bias += 0.01
    trained.save_pretrained(tmp_path / "hf-trained")
    capsys.readouterr()
    convert.main(["from-hf", str(tmp_path / "hf-trained"), str(tmp_path / "jt-trained")])
    said = capsys.readouterr().err
    assert ("(jaxtrain_bias was false: to-hf wrote the model without biases, and 1 of its bias tensors, "
            "'transformer.h.1.mlp.c_fc.bias' first, are no longer zero: trained since, so kept, and the model has "
            "biases)") in said and "--model.bias=true" in said, said
    assert len([name for name in tensors(tmp_path / "jt-trained") if name.endswith(".bias")]) == 2 * 6 + 1
    assert "jaxtrain_bias" not in json.loads((tmp_path / "jt-trained" / "config.json").read_text())


def test_a_gpt2_bpe_run_exports_its_tokenizer(tmp_path, cache_dir, capsys):
    """A run on GPT-2 BPE tokens: to-hf adds the tokenizer, which encodes and decodes as tiktoken's gpt2 encoding
    (the one prepare wrote the tokens with) does, with <|endoftext|> = 50256 as its end of text."""
    text = "def main():\n    return sum(x * x for x in range(10))  # naïve ünïcode, tabs\tand  spaces\n"
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text(text * 40)
    prepare.prepare([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")], str(tmp_path / "tokens"), "gpt2", 0.5)
    out = tmp_path / "run"
    run.train(config.load(small_args(out, cache_dir, "--train.steps=3", "--checkpoint.every=3",
                                     f"--data.path={tmp_path / 'tokens'}")))
    convert.main(["to-hf", str(out / "checkpoints" / "3"), str(tmp_path / "hf")])
    assert "and its tokenizer" in capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    want = gpt2_bpe.encoding().encode_ordinary(text)
    assert tokenizer(text)["input_ids"] == want and tokenizer.decode(want) == text
    assert tokenizer.eos_token_id == 50256 and tokenizer.model_max_length == 32
    loaded, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert all(not keys for keys in info.values()) and loaded.config.vocab_size >= 50257, info
    assert (loaded.config.bos_token_id, loaded.config.eos_token_id) == (50256, 50256)  # GPT-2's, as its tokenizer's
    # --tokenizer: refused where it is not the data's, which is here to say; where the data is gone, it says
    step, hf = str(out / "checkpoints" / "3"), str(tmp_path / "hf2")
    assert refused(capsys, ["to-hf", step, hf, "--tokenizer", "bytes"]) == (
        f"error: --tokenizer bytes is not the tokenizer of {step}: its data folder {tmp_path / 'tokens'} was "
        f"tokenized with gpt2; leave --tokenizer out to use the run's own\n")
    os.rename(tmp_path / "tokens", tmp_path / "tokens-elsewhere")
    convert.main(["to-hf", step, hf])
    assert capsys.readouterr().err.endswith(
        f"; no tokenizer files: the run's data folder {tmp_path / 'tokens'} is not here to say which tokenizer it "
        f"used (its meta.json); pass --tokenizer bytes or --tokenizer gpt2, the one the run's data used\n")
    assert not os.path.exists(os.path.join(hf, "vocab.json"))
    shutil.rmtree(hf)
    convert.main(["to-hf", step, hf, "--tokenizer", "gpt2"])
    assert capsys.readouterr().err.endswith("and its tokenizer with AutoTokenizer.from_pretrained (GPT-2's BPE, as "
                                            "--tokenizer says)\n")
    assert transformers.AutoTokenizer.from_pretrained(hf)(text)["input_ids"] == want


def test_to_hf_of_a_byte_run_refuses_tokenizer_gpt2_and_of_from_hfs_weights_any(tmp_path, cache_dir, capsys):
    """A byte run (its data folder gone, so nothing says bytes) has 256 embedding rows, too few for GPT-2's 50257
    tokens; a folder from-hf wrote carries its own tokenizer files (if any): --tokenizer is refused for both, and
    nothing is written."""
    (tmp_path / "a.txt").write_text("some text to train on, " * 400)
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "tokens"), "bytes", 0.5)
    out, from_hf = tmp_path / "run", str(tmp_path / "from-hf")
    run.train(config.load(small_args(out, cache_dir, "--train.steps=3", "--checkpoint.every=3",
                                     f"--data.path={tmp_path / 'tokens'}")))
    shutil.rmtree(tmp_path / "tokens")
    convert.main(["from-hf", hf_model(tmp_path), from_hf])
    step = str(out / "checkpoints" / "3")
    for src, says in [(step, f"--tokenizer gpt2 has 50257 tokens, more than the 256 embedding rows of {step}: the "
                             f"run was trained with another tokenizer; leave --tokenizer out, or pass bytes if its "
                             f"data was"),
                      (from_hf, f"--tokenizer: {from_hf} holds no run's config (from-hf's weights), and to-hf "
                                f"carries its tokenizer files as they are; leave --tokenizer out")]:
        assert refused(capsys, ["to-hf", src, str(tmp_path / "hf-out"), "--tokenizer", "gpt2"]) == f"error: {says}\n"
        assert not (tmp_path / "hf-out").exists()


def test_a_run_on_a_tokenizer_to_hf_cannot_write_says_so(tmp_path, cache_dir, capsys):
    """A data folder whose meta.json names a tokenizer neither GPT-2's BPE nor bytes (another tool wrote it): to-hf
    writes the model and says why no tokenizer files came with it; it said the data folder was not here."""
    (tmp_path / "a.txt").write_text("some text to train on, " * 400)
    prepare.prepare([str(tmp_path / "a.txt")], str(tmp_path / "tokens"), "bytes", 0.5)
    meta = json.loads((tmp_path / "tokens" / "meta.json").read_text())
    (tmp_path / "tokens" / "meta.json").write_text(json.dumps({**meta, "tokenizer": "char"}))
    out = tmp_path / "run"
    run.train(config.load(small_args(out, cache_dir, "--train.steps=3", "--checkpoint.every=3",
                                     "--log.sample_tokens=0", f"--data.path={tmp_path / 'tokens'}")))
    capsys.readouterr()
    convert.main(["to-hf", str(out / "checkpoints" / "3"), str(tmp_path / "hf")])
    assert capsys.readouterr().err.endswith("; no tokenizer files: the run's data names the tokenizer 'char', and "
                                            "to-hf writes GPT-2's BPE files only\n")


@pytest.mark.parametrize("written, named", [("[\"gpt2\"]", "holds a JSON list, not an object of GPT-2's settings"),
                                            ("{", "is missing or not JSON (")])
def test_a_config_json_that_is_no_object_is_one_line(tmp_path, capsys, written, named):
    source = hf_model(tmp_path)
    with open(f"{source}/config.json", "w") as f:
        f.write(written)
    err = refused(capsys, ["from-hf", source, str(tmp_path / "jt")])
    assert err.count("\n") == 1 and named in err and "Traceback" not in err, err
    assert not (tmp_path / "jt").exists()


def test_a_model_from_transformers_fine_tunes(tmp_path, cache_dir):
    """--init.from starts from exactly transformers' weights (checked against the HF file), and trains."""
    source = hf_model(tmp_path)
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    cfg = config.load(small_args(tmp_path / "run", cache_dir, "--train.steps=3", f"--init.from={tmp_path / 'jt'}"))
    trainer = run.Trainer(cfg)
    start = torch_format.model_tensors(trainer.initial_state().params)
    trainer.close()
    hf = tensors(source)
    assert all(np.array_equal(start[name], hf[name].T if name.endswith(hf_format.CONV1D) else hf[name])
               for name in start) and set(start) == set(hf)
    run.train(cfg)
    losses = [line for line in read_metrics(str(tmp_path / "run")) if "loss" in line]
    assert losses[-1]["step"] == 3 and all(np.isfinite(line["loss"]) for line in losses)


@pytest.mark.parametrize("activation", ["gelu_new", "gelu_pytorch_tanh", "gelu_fast"])
def test_gpt2s_tanh_gelu_converts_and_computes_transformers_logits(tmp_path, cache_dir, capsys, activation):
    """GPT-2's own checkpoints use the tanh GELU (gelu_new; gelu_pytorch_tanh and gelu_fast are the same formula):
    refused before, now model.gelu_approximate=tanh, which from-hf's fine-tune line names. The converted model's
    logits are transformers' (fp32 both sides), and to-hf gives the folder back bit for bit, as gelu_new."""
    source = hf_model(tmp_path, activation_function=activation)
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    assert "--model.gelu_approximate=tanh" in capsys.readouterr().err
    cfg = config.load(small_args(tmp_path / "run", cache_dir, "--model.gelu_approximate=tanh",
                                 f"--init.from={tmp_path / 'jt'}"))
    trainer = run.Trainer(cfg)
    params = trainer.initial_state().params
    trainer.close()
    idx = np.random.default_rng(0).integers(0, 256, (3, 32))
    ours = jaxtrain_logits(cfg.model, params, idx)
    with torch.no_grad():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(source).eval()(torch.from_numpy(idx)).logits.double()
    # as test_a_trained_run_loads_in_transformers_with_the_same_logits: fp32 both sides, other summation orders
    assert np.abs(ours - theirs.numpy()).max() <= 1e-5 * np.abs(theirs.numpy()).max()
    erf = jaxtrain_logits(dataclasses.replace(cfg.model, gelu_approximate="none"), params, idx)  # the option acts
    assert np.abs(erf - theirs.numpy()).max() > 10 * np.abs(ours - theirs.numpy()).max()
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    assert json.loads((tmp_path / "back" / "config.json").read_text())["activation_function"] == activation
    before, after = tensors(source), tensors(tmp_path / "back")
    assert set(before) == set(after) and all(np.array_equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("overrides,named", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"activation_function": "quick_gelu"}, "activation_function='quick_gelu'"),  # x sigmoid(1.702 x)
    ({"n_inner": 48}, "n_inner"), ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon")])
def test_what_jaxtrain_cannot_compute_the_same_is_refused(tmp_path, capsys, overrides, named):
    err = refused(capsys, ["from-hf", hf_model(tmp_path, **overrides), str(tmp_path / "jt")])
    assert named in err and "converted, the model would compute something else" in err
    assert not (tmp_path / "jt").exists()


def test_an_mlp_width_stated_as_4_n_embd_is_nanogpts(tmp_path):
    """n_inner=None and n_inner=4 * n_embd are the same MLP (transformers' GPT2MLP takes None for 4 * n_embd);
    the second was refused as "where jaxtrain's model has None"."""
    convert.main(["from-hf", hf_model(tmp_path, n_inner=4 * DIMS["n_embd"]), str(tmp_path / "jt")])
    assert tensors(tmp_path / "jt")["transformer.h.0.mlp.c_fc.weight"].shape == (4 * DIMS["n_embd"], DIMS["n_embd"])


def test_a_gpt2_model_without_its_head_converts_as_gpt2lmheadmodel_loads_it(tmp_path):
    """GPT2Model.save_pretrained names its tensors without "transformer.": from-hf exited 0 with a checkpoint a run
    refused, "unexpected tensor 'h.0.attn.c_attn.bias'". Now it adds the prefix, as GPT2LMHeadModel.from_pretrained
    does: the checkpoint holds what transformers loads from the GPT2Model folder, under the same names."""
    torch.manual_seed(0)
    base_model = transformers.GPT2Model(transformers.GPT2Config(**DIMS, activation_function="gelu"))
    base_model.save_pretrained(tmp_path / "base")
    convert.main(["from-hf", str(tmp_path / "base"), str(tmp_path / "jt")])
    want = {name: x.numpy() for name, x in
            transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base").state_dict().items()}
    got = tensors(tmp_path / "jt")
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: wte's
    assert all(np.array_equal(got[name], want[name].T if name.endswith(hf_format.CONV1D) else want[name])
               for name in got)


def test_a_tensor_nanogpts_model_has_no_place_for_is_refused_naming_it(tmp_path, capsys):
    """A sequence-classification model's score.weight: from-hf wrote it into the checkpoint, which a run refused
    with a message about the run's model config. Now from-hf refuses, in one line naming the tensor."""
    transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        **DIMS, activation_function="gelu", pad_token_id=0)).save_pretrained(tmp_path / "classifier")
    err = refused(capsys, ["from-hf", str(tmp_path / "classifier"), str(tmp_path / "jt")])
    assert err == (
        f"error: {tmp_path / 'classifier' / 'model.safetensors'}: tensor 'score.weight' has no place in a "
        f"GPT2LMHeadModel of 2 layers (nanoGPT's GPT); convert the GPT-2 body alone, saved with "
        f"model.transformer.save_pretrained(dir)\n")
    assert not (tmp_path / "jt").exists()


@pytest.mark.parametrize("case", ["config_has_more_layers", "untied_without_its_head"])
def test_a_tensor_the_model_needs_that_the_file_lacks_is_refused_naming_it(tmp_path, capsys, case):
    """config.json's n_layer above the file's layers, or an untied model saved without lm_head.weight: from-hf
    wrote a folder that init.from refused later. Now from-hf refuses, naming the first missing tensor by name order
    and how many more there are."""
    source = hf_model(tmp_path, tie_word_embeddings=case == "config_has_more_layers")
    if case == "config_has_more_layers":
        config = json.loads(open(f"{source}/config.json").read())
        open(f"{source}/config.json", "w").write(json.dumps({**config, "n_layer": 3}))
        want = "'transformer.h.2.attn.c_attn.bias' and 11 more, which a GPT2LMHeadModel of 3 layers"
    else:
        kept = {name: x for name, x in safetensors.numpy.load_file(f"{source}/model.safetensors").items()
                if name != "lm_head.weight"}
        safetensors.numpy.save_file(kept, f"{source}/model.safetensors", metadata={"format": "pt"})
        want = "'lm_head.weight', which a GPT2LMHeadModel of 2 layers"
    err = refused(capsys, ["from-hf", source, str(tmp_path / "jt")])
    assert err == (
        f"error: {source}/model.safetensors: holds no tensor {want} (config.json) needs; convert a folder whose "
        f"config.json describes its weights, as model.save_pretrained(dir) writes them\n")
    assert not (tmp_path / "jt").exists()


@pytest.mark.parametrize("edit,says", [
    ({"n_layer": "2"}, "n_layer='2', where a whole number > 0 is needed"),
    ({"n_layer": 2.0}, "n_layer=2.0, where a whole number > 0 is needed"),
    ({"vocab_size": -1}, "vocab_size=-1, where a whole number > 0 is needed"),
    ({"n_head": 5}, "n_head=5 does not divide n_embd=32"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes', where true or false is needed"),
    ({"jaxtrain_bias": 0}, "jaxtrain_bias=0, where true or false is needed"),
    ({"resid_pdrop": 1.0}, "resid_pdrop=1.0, where a number in [0, 1) is needed"),
    ({"resid_pdrop": True}, "resid_pdrop=True, where a number in [0, 1) is needed"),
    ({"activation_function": ["gelu"]}, "activation_function=['gelu'], where jaxtrain's model computes a GELU"),
    ({"vocab_size": 400}, "model.safetensors: transformer.wte.weight is (256, 32), but config.json (vocab_size 400, "
                          "n_positions 32, n_embd 32) makes it (400, 32)"),
    ({"n_positions": 64}, "model.safetensors: transformer.wpe.weight is (32, 32), but config.json (vocab_size 256, "
                          "n_positions 64, n_embd 32) makes it (64, 32)")])
def test_a_config_json_its_weights_or_its_types_contradict_is_refused_naming_the_key(tmp_path, capsys, edit, says):
    """A hand-edited config.json: a number as a string or a float ended in a traceback (exit 1), "yes" became
    --model.tie_embeddings=yes, and sizes the weights do not have were converted, exit 0, into a folder that
    init.from refused naming that same config.json, and transformers refused after to-hf."""
    source = hf_model(tmp_path)
    written = json.loads(open(f"{source}/config.json").read())
    open(f"{source}/config.json", "w").write(json.dumps({**written, **edit}))
    err = refused(capsys, ["from-hf", source, str(tmp_path / "jt")])
    assert err.startswith(f"error: {source}/") and says in err, err
    assert len(err.splitlines()) == 1 and not (tmp_path / "jt").exists()


def test_a_truncated_weights_file_beside_config_json_is_named_unreadable(tmp_path, capsys):
    """The first 3000 bytes of model.safetensors beside config.json: from-hf called the folder "a torch-format
    checkpoint already" (the layout of a file it could not read was taken for nanoGPT's)."""
    source = hf_model(tmp_path)
    os.truncate(f"{source}/model.safetensors", 3000)
    err = refused(capsys, ["from-hf", source, str(tmp_path / "jt")])
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {source}/model.safetensors is unreadable (") and "truncated" in err, err


def test_the_tokenizer_and_generation_config_cross_hf_to_jaxtrain_and_back(tmp_path, capsys):
    """from-hf kept config.json and the weights only: HF -> jaxtrain -> HF lost the tokenizer and
    generation_config.json. Both ways now carry them byte for byte, and the tokenizer encodes as the source's."""
    source = hf_model(tmp_path)
    bpe = gpt2_bpe.files()
    shutil.copyfile(bpe["encoder.json"], f"{source}/vocab.json")  # GPT-2's own tokenizer files, which
    shutil.copyfile(bpe["vocab.bpe"], f"{source}/merges.txt")        # transformers 5 reads but writes no more
    transformers.AutoTokenizer.from_pretrained(source).save_pretrained(source)  # tokenizer(_config).json
    transformers.GenerationConfig(max_new_tokens=7, do_sample=True, top_k=5).save_pretrained(source)
    with open(f"{source}/special_tokens_map.json", "w") as f:  # as transformers 4 wrote it
        json.dump({name: "<|endoftext|>" for name in ("bos_token", "eos_token", "unk_token")}, f)
    carried = ["generation_config.json", "merges.txt", "special_tokens_map.json", "tokenizer.json",
               "tokenizer_config.json", "vocab.json"]
    assert sorted(set(os.listdir(source)) - {"config.json", "model.safetensors"}) == carried
    convert.main(["from-hf", source, str(tmp_path / "jt")])
    capsys.readouterr()
    convert.main(["to-hf", str(tmp_path / "jt"), str(tmp_path / "back")])
    assert "and its tokenizer (vocab.json, merges.txt, tokenizer.json" in capsys.readouterr().err
    for folder in (tmp_path / "jt", tmp_path / "back"):
        assert sorted(os.listdir(folder)) == sorted([*carried, "config.json", "model.safetensors"])
        assert all(filecmp.cmp(f"{source}/{name}", folder / name, shallow=False) for name in carried)
    text = "def main():\n    return 1  # naïve"
    assert (transformers.AutoTokenizer.from_pretrained(tmp_path / "back")(text)["input_ids"]
            == transformers.AutoTokenizer.from_pretrained(source)(text)["input_ids"]
            == gpt2_bpe.encoding().encode_ordinary(text))
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "back").top_k == 5
