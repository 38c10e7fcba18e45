"""`python -m jaxtrain.sample --from FOLDER`: a Hugging Face GPT-2 folder's greedy text against transformers' own
generate (and tiktoken's decode), its tokenizer told from its files; a torch-format checkpoint's and a step folder's
text against `--run`'s; folders it cannot sample refused in one line."""

import json
import os
import shutil

import pytest
import torch
import transformers

from jaxtrain import convert, gpt2_bpe, run, config, sample
from test_run import small_args
from test_sample import refused as refused_alone

DIMS = dict(n_positions=32, n_embd=32, n_layer=2, n_head=2, activation_function="gelu")  # exact GELU: nanoGPT's
N_NEW = 12


def hf_model(folder, vocab_size: int, **overrides) -> transformers.GPT2LMHeadModel:
    """A randomly initialised GPT-2 saved in `folder` (its logits' top-2 gaps, ~1e-3, are far above the two
    implementations' fp32 differences, ~1e-7, so greedy texts agree token for token)."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab_size, bos_token_id=None,
                                                              eos_token_id=None, **{**DIMS, **overrides})).eval()
    hf.save_pretrained(folder)
    return hf


def greedy(hf: transformers.GPT2LMHeadModel, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy generate: the prompt and N_NEW tokens."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                          max_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def refused(capsys, argv: list[str], named: str) -> None:
    """test_sample's check of a refusal (exit 2, the one line), with what came before it dropped: transformers'
    progress bars, the conversions' lines."""
    capsys.readouterr()
    refused_alone(capsys, argv, named)


def sampled(capsys, *argv: str) -> tuple[str, str]:
    """(stdout, stderr) of a greedy `python -m jaxtrain.sample` of N_NEW tokens."""
    capsys.readouterr()
    sample.main([*argv, "--temperature=0", f"--max_new_tokens={N_NEW}"])
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_a_hugging_face_model_samples_as_transformers_generates(tmp_path, capsys):
    """A byte-level model (vocab 256, no tokenizer files: --tokenizer bytes says which), from its own folder and
    from from-hf's: the text of transformers' greedy ids, bytes read as UTF-8."""
    hf = hf_model(tmp_path / "hf", 256)
    want = bytes(greedy(hf, list(b"def "))).decode("utf-8", errors="replace") + "\n"
    convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "jt")])
    shutil.copytree(tmp_path / "hf", tmp_path / "checkpoint-10")  # as HF's Trainer saves one, with its own state
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 10, "epoch": 1.0}))
    for folder in ("hf", "jt", "checkpoint-10"):
        out, err = sampled(capsys, "--from", str(tmp_path / folder), "--tokenizer=bytes", "--prompt=def ")
        assert out == want and err.startswith(f"{tmp_path / folder}, fp32, temperature 0.0"), (folder, err)
    refused(capsys, ["--from", str(tmp_path / "hf")], f"error: {tmp_path / 'hf'} holds no tokenizer files "
                                                      f"(tokenizer.json, vocab.json, merges.txt) to say which "
                                                      f"tokenizer its model reads; pass --tokenizer bytes or "
                                                      f"--tokenizer gpt2, the one it was trained with")
    gpt2_tokenizer_folder(tmp_path / "hf", "vocab.json and merges.txt")  # beside 256 rows: not its model's
    refused(capsys, ["--from", str(tmp_path / "hf")], f"error: {tmp_path / 'hf'}'s tokenizer files are GPT-2's BPE, "
                                                      f"whose 50257 tokens are more than its model's 256 embedding "
                                                      f"rows: they are not its model's tokenizer; pass --tokenizer "
                                                      f"bytes if it was trained on bytes")
    assert sampled(capsys, "--from", str(tmp_path / "hf"), "--tokenizer=bytes", "--prompt=def ")[0] == want
    os.replace(tmp_path / "checkpoint-10" / "model.safetensors", tmp_path / "checkpoint-10" / "pytorch_model.bin")
    refused(capsys, ["--from", str(tmp_path / "checkpoint-10")], f"error: {tmp_path / 'checkpoint-10'} has no "
                                                                f"model.safetensors nor model.safetensors.index.json "
                                                                f"(a pytorch_model.bin checkpoint?)")


def gpt2_tokenizer_folder(folder, form: str) -> None:
    """GPT-2's tokenizer files in `folder`: GPT2Tokenizer's own (GPT-2's encoder.json and vocab.bpe as vocab.json and
    merges.txt, as to-hf writes them), or as transformers writes them back (tokenizer.json)."""
    files = gpt2_bpe.files()
    shutil.copyfile(files["encoder.json"], folder / "vocab.json")
    shutil.copyfile(files["vocab.bpe"], folder / "merges.txt")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    if form == "tokenizer.json":
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            os.remove(folder / name)
        tokenizer.save_pretrained(folder)
        held = set(os.listdir(folder))
        assert "tokenizer.json" in held and not held & {"vocab.json", "merges.txt"}, held


@pytest.mark.parametrize("form", ["vocab.json and merges.txt", "tokenizer.json"])
def test_a_folder_with_gpt2s_tokenizer_files_is_read_with_gpt2s_bpe(tmp_path, capsys, form):
    """No --tokenizer: the folder's files say GPT-2's BPE. The prompt's ids are transformers' tokenizer's, the
    continuation transformers' greedy one, decoded by transformers' tokenizer. The model has GPT-2's own tanh GELU
    (gelu_new, model.gelu_approximate=tanh), as OpenAI's checkpoints."""
    folder = tmp_path / "hf"
    hf = hf_model(folder, gpt2_bpe.EOT_ID + 1, activation_function="gelu_new")
    gpt2_tokenizer_folder(folder, form)
    if form == "tokenizer.json":  # its own add_prefix_space, which transformers overrides with tokenizer_config's
        held = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        held["pre_tokenizer"]["add_prefix_space"] = True
        (folder / "tokenizer.json").write_text(json.dumps(held), encoding="utf-8")
    prompt, tokenizer = "Hello, world", transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer("Hello")["input_ids"] == [15496]  # GPT-2's "Hello", not " Hello"
    ids = greedy(hf, tokenizer(prompt)["input_ids"])
    out, _ = sampled(capsys, "--from", str(folder), f"--prompt={prompt}")
    assert out == tokenizer.decode(ids, clean_up_tokenization_spaces=False) + "\n"
    refused(capsys, ["--from", str(folder), "--tokenizer=bytes"], f"--tokenizer bytes is not the tokenizer of "
                                                                  f"{folder}: its tokenizer files are GPT-2's BPE")


@pytest.mark.parametrize("form, edit, named", [
    ("vocab.json and merges.txt", "a token renamed", "its vocabulary is another"),
    ("vocab.json and merges.txt", "two merges swapped", "its merges are others"),
    ("vocab.json and merges.txt", "add_prefix_space", "it has add_prefix_space (a text is encoded as if it followed "
                                                      "a space)"),
    ("tokenizer.json", "add_prefix_space", "it has add_prefix_space (a text is encoded as if it followed a space)"),
    ("tokenizer.json", "WordPiece", "tokenizer.json's model is 'WordPiece', not BPE"),
    ("tokenizer.json", "a normalizer", "tokenizer.json splits or normalizes text otherwise than GPT-2's byte-level "
                                       "rule"),
    ("tokenizer.json", "cut short", "its tokenizer files cannot be read (JSONDecodeError: ")])
def test_tokenizer_files_that_are_not_gpt2s_are_refused(tmp_path, capsys, form, edit, named):
    """Each a tokenizer that encodes text otherwise than GPT-2's BPE: add_prefix_space as tokenizer_config.json sets
    it, which transformers 4 and 5 both follow over tokenizer.json's."""
    folder = tmp_path / "hf"
    hf_model(folder, gpt2_bpe.EOT_ID + 1)
    gpt2_tokenizer_folder(folder, form)
    fast = folder / "tokenizer.json"
    if edit in ("WordPiece", "a normalizer"):
        held = json.loads(fast.read_text(encoding="utf-8"))
        if edit == "WordPiece":
            held["model"]["type"] = "WordPiece"
        else:
            held["normalizer"] = {"type": "NFKC"}
        fast.write_text(json.dumps(held), encoding="utf-8")
    elif edit == "cut short":
        fast.write_bytes(fast.read_bytes()[:1000])
    elif edit == "a token renamed":
        vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
        vocab["hello!"] = vocab.pop("Hello")
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    elif edit == "two merges swapped":
        lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
        lines[5], lines[6] = lines[6], lines[5]
        (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    else:
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "add_prefix_space": True}))
        if form == "tokenizer.json":  # transformers, which the refusal is about, encodes as if after a space
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
            assert tokenizer("Hello")["input_ids"] == tokenizer(" Hello")["input_ids"] != [15496]  # 15496: "Hello"
    ending = "" if edit == "cut short" else "), and jaxtrain encodes text with GPT-2's BPE or bytes only"
    refused(capsys, ["--from", str(folder)], f"error: {folder}'s tokenizer is not GPT-2's BPE ({named}{ending}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A run of the small model (bytes: the embedded corpus) to step 4."""
    out = tmp_path_factory.mktemp("run")
    run.train(config.load(small_args(out, cache_dir, "--train.steps=4", "--log.sample_tokens=0")))
    return out


def test_a_checkpoint_folder_samples_as_its_run(trained, tmp_path, capsys):
    """The run's step folder, to-torch's folder of it, and the folder from-hf makes of to-hf's: --run's text (the
    same fp32 weights; the run's tokenizer from its data, a Hugging Face folder's from --tokenizer)."""
    step = trained / "checkpoints" / "4"
    convert.main(["to-torch", str(step), str(tmp_path / "torch")])
    convert.main(["to-hf", str(step), str(tmp_path / "hf")])
    want, err = sampled(capsys, "--run", str(trained), "--prompt=def ", "--precision=fp32")
    assert err.startswith(f"step 4 of {trained}, fp32")
    for folder in (step, tmp_path / "torch"):
        assert sampled(capsys, "--from", str(folder), "--prompt=def ", "--precision=fp32") == (
            want, err.replace(f"step 4 of {trained}", f"step 4 of {folder}"))
    assert sampled(capsys, "--from", str(tmp_path / "hf"), "--prompt=def ", "--tokenizer=bytes") == (
        want, err.replace(f"step 4 of {trained}", str(tmp_path / "hf")))  # fp32: a Hugging Face model's default
    state = json.loads((tmp_path / "torch" / "trainer_state.json").read_text())
    assert state["config"]["model"]["vocab_size"] == 256
    state["config"]["model"]["vocab_size"] = None  # as torchref writes a run that took the data's
    (tmp_path / "torch" / "trainer_state.json").write_text(json.dumps(state))
    assert sampled(capsys, "--from", str(tmp_path / "torch"), "--prompt=def ", "--precision=fp32")[0] == want


def test_folders_sample_cannot_read_are_refused_in_one_line(trained, tmp_path, capsys):
    weights = tmp_path / "weights"
    convert.main(["to-torch", str(trained / "checkpoints" / "4"), str(tmp_path / "torch")])
    weights.mkdir()
    shutil.copyfile(tmp_path / "torch" / "model.safetensors", weights / "model.safetensors")
    refused(capsys, ["--from", str(weights)], f"error: --from {weights} holds weights alone, with neither "
                                              f"trainer_state.json (a checkpoint's, which holds its config) nor "
                                              f"config.json (from-hf's) to say the model's shape")
    refused(capsys, ["--from", str(trained)], f"error: --from {trained} is a jaxtrain run folder; sample it with "
                                              f"--run {trained}")
    refused(capsys, ["--from", str(tmp_path / "torch"), "--step=4"], "error: --step picks a checkpoint of --run")
    shutil.copytree(tmp_path / "torch", tmp_path / "torchref-run" / "checkpoints" / "4")
    refused(capsys, ["--from", str(tmp_path / "torchref-run")], f"error: --from {tmp_path / 'torchref-run'} is a "
                                                               f"torchref run folder, not a checkpoint; pass one of "
                                                               f"its checkpoints, e.g. --from "
                                                               f"{tmp_path / 'torchref-run' / 'checkpoints' / '4'}")
    refused(capsys, ["--from", ""], "error: --from is an empty path (an unset variable?)")
    shutil.copytree(trained / "checkpoints" / "4", tmp_path / "best")
    refused(capsys, ["--from", str(tmp_path / "best")], f"error: sample --from {tmp_path / 'best'} is a jaxtrain "
                                                       f"step folder renamed 'best'; Orbax finds a step by its "
                                                       f"folder's name")
    state = json.loads((tmp_path / "torch" / "trainer_state.json").read_text())
    state["config"]["model"]["n_layer"] = 3
    (tmp_path / "torch" / "trainer_state.json").write_text(json.dumps(state))
    refused(capsys, ["--from", str(tmp_path / "torch")], "the checkpoint's tensors are those of model.n_layer=2 "
                                                        "(trainer_state.json: 3): the folder's files disagree")
