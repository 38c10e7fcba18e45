"""`python -m jaxtrain.evaluate`: a run's checkpoint scores the eval loss and accuracy its run logged at that step
(bit for bit: same device, same sequences, same eval step), from the run, its step folder and to-torch's folder, a
run with a continued data seed among them; a Hugging Face model the loss and accuracy transformers' logits give; what
it cannot evaluate refused in one line; Ctrl-C one line too, in sample as well."""

import json
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import safetensors.numpy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxtrain import config, convert, dryrun, evaluate, gpt2_bpe, kernel_choice, model_source, prepare, run, sample
from jaxtrain.errors import UserError
from test_run import small_args
from test_sample_from import gpt2_tokenizer_folder, hf_model
from read_counts import COUNTING

SEQ_LEN = 32  # small_args' model.seq_len, and test_sample_from's DIMS n_positions


def evaluated(capsys, *argv: str) -> tuple[dict, str]:
    """(the JSON line on stdout, stderr) of `python -m jaxtrain.evaluate`."""
    capsys.readouterr()
    evaluate.main(list(argv))
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1, captured.out
    return json.loads(lines[0]), captured.err


def refused(capsys, argv: list[str], named: str) -> None:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert exit_info.value.code == 2 and not out
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], err


def logged_evals(run_dir) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: (line["eval_loss"], line["eval_accuracy"]) for line in lines if "eval_loss" in line}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    """A run of the small model on the embedded corpus (bytes) to step 8, evaluated at 4 and 8, each batch in two
    micro-batches; and one that starts from its step 4's full state under another run.seed, so that it draws its
    batches and eval set with the checkpoint's data seed (data.continued_seed), not its own run.seed."""
    first, second, torch_dir = (tmp_path_factory.mktemp(name) for name in ("first", "second", "torch"))
    run.train(config.load(small_args(first, cache_dir, "--optim.grad_accum_steps=2")))
    shutil.rmtree(torch_dir)
    convert.main(["to-torch", str(first / "checkpoints" / "4"), str(torch_dir)])
    run.train(config.load(small_args(second, cache_dir, "--optim.grad_accum_steps=2", f"--init.from={torch_dir}",
                                     "--run.seed=5")))
    return first, second, torch_dir


def test_a_checkpoint_scores_what_its_run_logged(trained, capsys):
    """metrics.jsonl's eval_loss and eval_accuracy at each step, exactly: from --run (its newest and --step), its
    step folder, to-torch's folder of it (the same fp32 weights), and the run that continued another's data seed."""
    first, second, torch_dir = trained
    logged = logged_evals(first)
    assert sorted(logged) == [4, 8]
    for argv, step in [(["--run", str(first)], 8), (["--run", str(first), "--step=4"], 4),
                       (["--from", str(first / "checkpoints" / "8")], 8), (["--from", str(torch_dir)], 4)]:
        line, err = evaluated(capsys, *argv)
        assert (line["eval_loss"], line["eval_accuracy"]) == logged[step], argv
        assert line["step"] == step and line["tokens"] == 2 * 8 * SEQ_LEN  # train.eval_batches x batch_size x T
        assert line["perplexity"] == pytest.approx(np.exp(line["eval_loss"]), rel=1e-15), line  # float64 exp
        assert "2 batches of 8 x 32 tokens, 4 sequences at a time" in err and "seed 0" in err, err
        assert f"eval loss {line['eval_loss']:.4f}" in err, err
    line, err = evaluated(capsys, "--run", str(second))
    assert (line["eval_loss"], line["eval_accuracy"]) == logged_evals(second)[8] and "seed 0" in err, err
    other, _ = evaluated(capsys, "--run", str(second), "--seed=5")  # the run's own run.seed: other sequences
    assert other["eval_loss"] != line["eval_loss"]


def test_parts_and_batches_change_the_sequences_or_their_sum_only_as_they_should(trained, capsys):
    """--micro_batches 1 evaluates the same sequences 8 at a time, not 4: the same loss but for fp32 rounding
    (matmuls of other shapes, sums in another order: measured 2.4e-7 on a loss of 5.24, margin x20), the same
    predictions (measured equal: the small model's top-2 gaps far above that rounding). --batches 4: twice the
    tokens, other ones."""
    first = trained[0]
    two, _ = evaluated(capsys, "--run", str(first))
    one, err = evaluated(capsys, "--run", str(first), "--micro_batches=1")
    assert "8 sequences at a time" in err and one["eval_accuracy"] == two["eval_accuracy"]
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], abs=5e-6)
    four, _ = evaluated(capsys, "--run", str(first), "--batches=4")
    assert four["tokens"] == 2 * two["tokens"] and four["eval_loss"] != two["eval_loss"]


def _token_folder(folder, val: np.ndarray, vocab_size: int, tokenizer: str) -> str:
    train = np.arange(4 * SEQ_LEN) % vocab_size
    prepare.write_token_dir(str(folder), train, val, vocab_size, tokenizer)
    return str(folder)


def test_a_hugging_face_model_scores_what_transformers_logits_give(tmp_path, capsys):
    """A byte-level model (256 rows, no tokenizer files) on a val split one window long (33 tokens: every sequence
    drawn is that window, whatever the seed): the mean cross-entropy and top-1 accuracy of transformers' logits.
    Both fp32: the two implementations' logits differ by ~1e-7 of their scale (test_hf's 1e-5 bound), a loss of ~5.5
    by ~1e-6; 1e-5. The top-1: the random model's top-2 gaps (~1e-3) far above that, so exactly."""
    hf = hf_model(tmp_path / "hf", 256)
    window = _window(b"def evaluate(loaded, chosen):\n    cfg")
    data = _token_folder(tmp_path / "data", window, 256, "bytes")
    want_loss, want_accuracy = _transformers_loss_and_accuracy(hf, window)
    line, err = evaluated(capsys, "--from", str(tmp_path / "hf"), f"--data={data}")
    assert line["step"] is None and line["tokens"] == 8 * 8 * SEQ_LEN  # 8 batches of 8: the defaults without a run
    assert line["eval_loss"] == pytest.approx(want_loss, abs=1e-5) and line["eval_accuracy"] == want_accuracy
    assert line["split"] == "val"
    assert f"note: which tokenizer the model of {tmp_path / 'hf'} reads cannot be told here (it holds no " in err
    assert f"\n{tmp_path / 'hf'}, fp32: 8 batches of 8 x 32 tokens, 8 sequences at a time" in err, err


def _window(text: bytes) -> np.ndarray:
    return np.frombuffer(text, np.uint8)[:SEQ_LEN + 1].astype(np.int64)


def _transformers_loss_and_accuracy(hf, window: np.ndarray) -> tuple[float, float]:
    with torch.no_grad():
        logits = hf(torch.tensor(window[None, :-1])).logits[0].double()
    targets = torch.tensor(window[1:])
    return (torch.nn.functional.cross_entropy(logits, targets).item(),
            (logits.argmax(-1) == targets).double().mean().item())


def test_split_train_scores_the_train_split(tmp_path, capsys):
    """Each split one window long, another text each: --split train scores the train split's (transformers'
    logits, the bound above), the default the val split's."""
    hf = hf_model(tmp_path / "hf", 256)
    train = _window(b"import numpy as np\nfrom jaxtrain import data")
    val = _window(b"def evaluate(loaded, chosen):\n    cfg")
    data = str(tmp_path / "data")
    prepare.write_token_dir(data, train, val, 256, "bytes")
    for split, window in [("train", train), ("val", val)]:
        want_loss, want_accuracy = _transformers_loss_and_accuracy(hf, window)
        line, err = evaluated(capsys, "--from", str(tmp_path / "hf"), f"--data={data}", f"--split={split}")
        assert line["eval_loss"] == pytest.approx(want_loss, abs=1e-5) and line["eval_accuracy"] == want_accuracy
        assert line["split"] == split and f"from the {split} split of {data}" in err, err


def test_a_gpt2_model_takes_gpt2_tokens_only(tmp_path, capsys):
    """A model with GPT-2's tokenizer files: GPT-2 tokens evaluated without a note, bytes refused; a byte model
    refuses GPT-2 tokens (ids past its rows)."""
    folder = tmp_path / "hf"
    hf_model(folder, gpt2_bpe.EOT_ID + 1)
    gpt2_tokenizer_folder(folder, "vocab.json and merges.txt")
    val = np.arange(SEQ_LEN + 1) * 997 % (gpt2_bpe.EOT_ID + 1)
    gpt2_data = _token_folder(tmp_path / "gpt2", val, gpt2_bpe.EOT_ID + 1, "gpt2")
    bytes_data = _token_folder(tmp_path / "bytes", val % 256, 256, "bytes")
    _, err = evaluated(capsys, "--from", str(folder), f"--data={gpt2_data}", "--batches=1", "--batch_size=1")
    assert "note:" not in err, err
    refused(capsys, ["--from", str(folder), f"--data={bytes_data}"],
            f"error: the data {bytes_data} was tokenized with bytes, and the model of {folder} reads gpt2 (its "
            f"tokenizer files' vocabulary is GPT-2's)")
    hf_model(tmp_path / "bytes-model", 256)
    refused(capsys, ["--from", str(tmp_path / "bytes-model"), f"--data={gpt2_data}"],
            f"error: the data {gpt2_data} (gpt2) has a vocabulary of 50257, more than the 256 embedding rows of the "
            f"model of {tmp_path / 'bytes-model'}")


def test_a_torchref_checkpoint_scores_what_torchref_logged(tmp_path, cache_dir, capsys):
    """torchref's run of the same config, its checkpoint of step 8 scored by jaxtrain's eval step: torchref's logged
    numbers, to the two frameworks' fp32 forward passes (the parity suite's model bound: logits within 1e-6 of their
    scale; here measured 3.6e-7 on a loss of 5.24, margin x28) and the same predictions (measured equal)."""
    from torchref import run as torchref_run
    torchref_run.train(config.load(small_args(tmp_path, cache_dir, "--optim.grad_accum_steps=2")))
    line, err = evaluated(capsys, "--from", str(tmp_path / "checkpoints" / "8"))
    want = logged_evals(tmp_path)[8]
    assert line["step"] == 8 and "seed 0" in err and line["eval_accuracy"] == want[1]
    assert line["eval_loss"] == pytest.approx(want[0], abs=1e-5), (line["eval_loss"], want[0])


def test_a_tokenizer_name_says_the_ids_only_when_it_is_one_of_prepares(trained, tmp_path, cache_dir, capsys):
    """A run on bytes takes no folder of another name's ids, even one of 256 ("char": ids of another meaning); a run
    on one "char" folder takes another with a note (the name is no tokenizer of jaxtrain's: it does not say the ids
    are the same); a Hugging Face model without tokenizer files takes such a folder with a note; GPT-2's vocabulary
    with a setting that splits text otherwise (add_prefix_space) still gives GPT-2's ids, and takes GPT-2 tokens
    without one."""
    val = np.arange(SEQ_LEN + 1) % 256
    char = _token_folder(tmp_path / "char", val, 256, "char")
    refused(capsys, ["--run", str(trained[0]), f"--data={char}"], f"error: the data {char} was tokenized with char, "
                                                                  f"and the model of {trained[0]} reads bytes")
    run.train(config.load(small_args(tmp_path / "char-run", cache_dir, f"--data.path={char}", "--train.steps=4")))
    other = _token_folder(tmp_path / "char2", val * 7 % 256, 256, "char")
    _, err = evaluated(capsys, "--run", str(tmp_path / "char-run"), f"--data={other}", "--batches=1")
    assert "(both name the tokenizer 'char', which is not one of jaxtrain's: the name alone does not say" in err, err
    hf_model(tmp_path / "hf", 256)
    _, err = evaluated(capsys, "--from", str(tmp_path / "hf"), f"--data={char}", "--batches=1")
    assert "it holds no tokenizer files" in err and f"the ids of {char} (char) are read as its tokens" in err, err
    gpt2 = tmp_path / "gpt2"
    hf_model(gpt2, gpt2_bpe.EOT_ID + 1)
    gpt2_tokenizer_folder(gpt2, "vocab.json and merges.txt")
    (gpt2 / "tokenizer_config.json").write_text(json.dumps({"add_prefix_space": True}))
    data = _token_folder(tmp_path / "gpt2-data", val * 97, gpt2_bpe.EOT_ID + 1, "gpt2")
    _, err = evaluated(capsys, "--from", str(gpt2), f"--data={data}", "--batches=1", "--batch_size=1")
    assert "note:" not in err, err


def test_what_it_cannot_evaluate_is_refused_in_one_line(trained, tmp_path, capsys, monkeypatch):
    first, _, torch_dir = trained
    hf_model(tmp_path / "hf", 256)
    with monkeypatch.context() as reading:  # refused before the folders' weights are read
        reading.setattr(model_source, "_from_hf", lambda *args: pytest.fail("the weights were read"))
        reading.setattr(model_source.torch_format, "load_params", lambda *args: pytest.fail("the weights were read"))
        refused(capsys, ["--from", str(tmp_path / "hf")], f"error: --from {tmp_path / 'hf'} is a model's weights "
                                                          f"without a run's data to evaluate on: pass --data FOLDER")
        refused(capsys, ["--from", str(torch_dir), "--batch_size=9", "--micro_batches=2"],
                "error: --batch_size 9 is not divisible by --micro_batches 2")
    refused(capsys, ["--from", str(first)], f"error: --from {first} is a jaxtrain run folder; evaluate it with "
                                            f"--run {first}")
    refused(capsys, ["--from", str(torch_dir), "--step=4"], "error: --step picks a checkpoint of --run")
    refused(capsys, ["--run", str(first), "--step=5"], f"error: {first} has no checkpoint of step 5")
    refused(capsys, ["--run", str(first), "--batch_size=6", "--micro_batches=4"],
            "error: --batch_size 6 is not divisible by --micro_batches 4")
    gpt2_data = _token_folder(tmp_path / "gpt2", np.arange(SEQ_LEN + 1), gpt2_bpe.EOT_ID + 1, "gpt2")
    refused(capsys, ["--run", str(first), f"--data={gpt2_data}"], "has a vocabulary of 50257, more than the 256")
    other = _token_folder(tmp_path / "other", np.arange(SEQ_LEN + 1), 256, "gpt2")  # a gpt2 folder of small ids
    refused(capsys, ["--run", str(first), f"--data={other}"],
            f"error: the data {other} was tokenized with gpt2, and the model of {first} reads bytes (its run's "
            f"data's)")
    refused(capsys, ["--run", str(first), f"--data={tmp_path / 'nowhere'}"], f"{tmp_path / 'nowhere'}' not found")


@settings(max_examples=300, deadline=None)
@given(batches=st.integers(-3, 3), batch_size=st.integers(-3, 12), micro_batches=st.integers(-3, 5),
       seed=st.sampled_from([-1, 0, 5, 2**32 - 1, 2**32]), devices=st.integers(1, 4))
def test_an_eval_set_is_refused_exactly_when_a_number_is_out_of_range(batches, batch_size, micro_batches, seed,
                                                                       devices):
    """The rule written out: positive counts, the batch in whole parts, a seed of PCG64's 32 bits, as many
    sequences on each device."""
    valid = (batches > 0 and batch_size > 0 and micro_batches > 0 and batch_size % micro_batches == 0
             and 0 <= seed < 2**32 and batch_size % (micro_batches * devices) == 0)
    chosen = evaluate.EvalSet(None, batches, batch_size, micro_batches, seed)
    if valid:
        chosen.check(devices)
    else:
        with pytest.raises(UserError, match=r"^--(batches|batch_size|seed) "):
            chosen.check(devices)


def test_a_checkpoint_naming_kernels_scores_with_the_kernels_the_defaults_pick(trained, tmp_path, capsys):
    """to-torch's folder of step 4 with its config edited to name forward kernels that may not run outside their run
    (cuDNN's attention, the Hopper MLP kernel, oneDNN's dots) and a backward one (c_attn's gradient kernel, kept: no
    matter to a forward pass): the run's logged numbers, bit for bit (the run trained with the defaults, which are
    what they go back to), and a note naming those whose kernel changes here (oneDNN's dots where auto would not pick
    them: this jaxlib or CPU). A bf16 residual stream evaluated in fp32 is fp32's."""
    folder = shutil.copytree(trained[2], tmp_path / "torch")
    state = json.loads((folder / "trainer_state.json").read_text())
    state["config"]["model"].update(attention="cudnn", gelu_fwd="pallas", cpu_dots="onednn", qkv_grad="pallas")
    (folder / "trainer_state.json").write_text(json.dumps(state))
    line, err = evaluated(capsys, "--from", str(folder))
    assert (line["eval_loss"], line["eval_accuracy"]) == logged_evals(trained[0])[4]
    onednn_anyway = kernel_choice.onednn_dots(config.ModelConfig(), "fp32")  # auto's choice on this machine
    named = "model.attention=cudnn, model.gelu_fwd=pallas" + ("" if onednn_anyway else ", model.cpu_dots=onednn")
    assert f"note: {named}: computed with the kernels the defaults pick here" in err, err
    named_kernels = config.ModelConfig(norm="pallas", attention="xla", residual_dtype="bf16", head_lse="pallas")
    computed, changed = model_source.computed_here(named_kernels, "fp32")
    assert (computed.norm, computed.attention, computed.residual_dtype, computed.head_lse, changed) == (
        "auto", "xla", "fp32", "pallas", ["model.norm=pallas"])


def test_weights_holding_nan_and_an_eval_set_past_the_memory_are_refused(trained, tmp_path, capsys, monkeypatch):
    """NaN in a weight: its loss is no number (not a null in the JSON and exit 0). On a device of 64 MiB, the small
    model's 4 sequences at a time fit, 4096 do not: their fp32 logits alone are 128 MiB (asked before anything is
    drawn); and a run whose data folder is gone is told of --data."""
    folder = shutil.copytree(trained[2], tmp_path / "torch")
    weights = {name: a.copy() for name, a in safetensors.numpy.load_file(folder / "model.safetensors").items()}
    weights["transformer.h.0.mlp.c_fc.weight"][3, 5] = np.nan
    safetensors.numpy.save_file(weights, folder / "model.safetensors")
    refused(capsys, ["--from", str(folder)], f"error: {folder} holds inf or NaN (h/0/mlp/c_fc/kernel)")
    monkeypatch.setattr(dryrun, "device_memory", lambda device: 2**26)  # a device of 64 MiB, whatever this host has
    evaluated(capsys, "--run", str(trained[0]))  # 4 sequences at a time: a few MiB
    capsys.readouterr()
    with pytest.raises(SystemExit):
        evaluate.main(["--run", str(trained[0]), f"--batch_size={2**12}", "--micro_batches=1"])
    err = capsys.readouterr().err
    said = re.fullmatch(r"error: evaluating 4096 sequences at a time needs (\d+\.\d+) GiB a device and this host "
                        r"has 0.06 GiB; raise --micro_batches or lower --batch_size\n", err)  # a CPU: the host's
    assert said and float(said[1]) >= 0.125, err  # the logits alone: 2^12 x 32 x 256 x 4 bytes
    state = json.loads((trained[2] / "trainer_state.json").read_text())
    state["config"]["data"]["path"] = str(tmp_path / "gone")
    moved = shutil.copytree(trained[2], tmp_path / "moved")
    (moved / "trainer_state.json").write_text(json.dumps(state))
    refused(capsys, ["--from", str(moved)], "(the run's data; evaluate on another data folder with --data FOLDER)")


def test_a_named_kernel_that_auto_picks_again_is_not_said_to_change(monkeypatch):
    """Where auto would pick the named kernel here (oneDNN's dots on a CPU with bf16 units and a jaxlib that hands
    them over: made so), the setting goes back to auto and is not named; the Hopper MLP kernel, which auto never
    picks, is."""
    monkeypatch.setattr(kernel_choice, "onednn_dots", lambda cfg, precision: True)
    computed, changed = kernel_choice.runs_anywhere(config.ModelConfig(cpu_dots="onednn", gelu_fwd="pallas"), "bf16")
    assert (computed.cpu_dots, computed.gelu_fwd, changed) == ("auto", "xla", ["model.gelu_fwd=pallas"])


@pytest.mark.parametrize("command", ["evaluate", "sample"])
def test_ctrl_c_ends_in_one_line_and_130(trained, capsys, monkeypatch, command):
    """A KeyboardInterrupt while it computes (raised where the next batch, or the text, would come): one line and
    the shell's 130 for SIGINT, not Python's traceback; nothing printed on stdout."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    if command == "evaluate":
        monkeypatch.setattr(evaluate.data_lib, "eval_batch", interrupted)
        main = evaluate.main
    else:
        monkeypatch.setattr(sample, "drawer", interrupted)
        main = sample.main
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["--run", str(trained[0])])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 130 and not out and err.endswith("\ninterrupted; nothing was written\n"), err
    assert "Traceback" not in err


# Trains the small model on this process's devices, writes to-torch's folder of its step 4, then evaluates: the
# params' layout as evaluate restores them, and a JSON line a command (exit code, stdout, stderr, the device counts
# of the checkpoints it read and of the layouts it placed weights in)
DEVICES_SCRIPT = """
import contextlib, io, json, sys
import jax
from jaxtrain import config, convert, dryrun, evaluate, model_source, run
out_dir, torch_dir, *args = sys.argv[1:]
""" + COUNTING + """run.train(config.load(args))
convert.main(["to-torch", f"{out_dir}/checkpoints/4", torch_dir])
kernel = model_source.from_run(out_dir, 8, None, "evaluate", jax.devices()).params["h"][0]["mlp"]["c_fc"]["kernel"]
print(json.dumps({"spec": list(kernel.sharding.spec), "devices": kernel.sharding.mesh.size}))
for argv in [["--run", out_dir], ["--run", out_dir, "--step=4"], ["--from", torch_dir],
             ["--from", f"{out_dir}/checkpoints/8"], ["--run", out_dir, "--devices=1"], ["--run", out_dir,
             "--devices=3"], ["--run", out_dir, "--batch_size=6"], ["--run", out_dir, "--devices=2",
             "--batch_size=6"], ["--run", out_dir, "--batch_size=9"], ["--run", out_dir, "--batch_size=4096",
             "--micro_batches=1"]]:
    out, err = io.StringIO(), io.StringIO()
    placements.clear()
    reads.clear()
    if argv[-1] == "--micro_batches=1":  # a device of 64 MiB
        dryrun.device_memory = lambda device: 2**26
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            evaluate.main(argv)
            code = 0
        except SystemExit as e:
            code = e.code
    print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "placed": placements,
                      "read": reads}))
"""


def test_on_two_devices_a_run_of_two_scores_what_it_logged_bit_for_bit(tmp_path, cache_dir):
    """A run on 2 (fake CPU) devices with mesh.fsdp=2, each weight split over both: evaluate, on the 2 devices this
    process has, restores the params straight into that layout and scores what the run logged at steps 4 and 8,
    from the run, its step folder and to-torch's folder, bit for bit (the same sums in the same order); on one
    (--devices 1) within fp32 rounding of it (matmuls of other shapes: measured 4.8e-7 on a loss of 5.24, margin
    x10). 3 sequences at a time split over 1 of the 2 devices: read onto that one alone and computed there, with a
    note, or refused before the checkpoint is read where --devices 2 asks for both, as is a --batch_size the run's
    micro-batches do not divide. A count past the machine's, and parts too big for the host
    that both devices share, each refused in one line that names its fix."""
    out_dir, torch_dir = tmp_path / "run", tmp_path / "torch"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run([sys.executable, "-c", DEVICES_SCRIPT, str(out_dir), str(torch_dir), *small_args(
        out_dir, cache_dir, "--optim.grad_accum_steps=2", "--mesh.fsdp=2")], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    layout, *results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert layout == {"spec": [None, "fsdp"], "devices": 2}  # c_fc's kernel (32, 128): its columns over fsdp=2
    logged = logged_evals(out_dir)
    run8, run4, torch4, folder8, one, three, six, six_on_two, nine, too_big = results
    for result, step in [(run8, 8), (run4, 4), (torch4, 4), (folder8, 8)]:
        line = json.loads(result["out"])
        assert result["code"] == 0 and (line["eval_loss"], line["eval_accuracy"]) == logged[step], result
        assert (result["read"], result["placed"]) == ([] if result is torch4 else [2], [2]), result  # once
        assert "4 sequences at a time, from the val split" in result["err"], result
        assert "seed 0, on 2 cpu devices (data 1 x fsdp 2)\n" in result["err"], result
    line = json.loads(one["out"])
    assert line["eval_loss"] == pytest.approx(logged[8][0], abs=5e-6) and "cpu devices" not in one["err"], one
    assert three["err"] == "error: --devices 3: this machine has 2 cpu devices; pass a count from 1 to 2\n"
    assert six["code"] == 0 and json.loads(six["out"])["tokens"] == 2 * 6 * SEQ_LEN, six
    assert six["err"].startswith("note: 3 sequences at a time, computed on 1 of this machine's 2 devices (a "
                                 "--batch_size of a multiple of 4 splits over all of them)\n"), six
    assert (six["read"], six["placed"], one["read"], one["placed"]) == ([1], [1], [1], [1]), (six, one)
    assert six_on_two["err"] == ("error: --batch_size 6 in --micro_batches 2 is 3 sequences at a time, which do not "
                                 "split over 2 devices; pass --devices 1, or a --batch_size of a multiple of 4\n")
    said = re.fullmatch(r"error: evaluating 4096 sequences at a time needs (\d+\.\d+) GiB a device, (\d+\.\d+) GiB "
                        r"for 2 CPU devices, and this host has 0.06 GiB; raise --micro_batches or lower "
                        r"--batch_size, or compute on one device \(--devices 1: the host then holds the weights "
                        r"once\)\n", too_big["err"])
    assert said and float(said[2]) == pytest.approx(2 * float(said[1]), abs=0.015), too_big  # 2 decimals each
    assert nine["err"].startswith("error: --batch_size 9 is not divisible by --micro_batches 2 (a run's default: its "
                                  "optim.grad_accum_steps)"), nine
    assert (six_on_two["read"], nine["read"]) == ([], []), (six_on_two, nine)  # refused before the checkpoint is read
    assert [r["code"] for r in (three, six_on_two, nine, too_big)] == [2, 2, 2, 2]
    assert not any(r["out"] for r in (three, six_on_two, nine, too_big))


def flags(**given) -> types.SimpleNamespace:
    """evaluate's flags, none given but `given` (a run's --run)."""
    return types.SimpleNamespace(**{"run": "out", "from_": None, "data": None, "batches": None, "batch_size": None,
                                    "micro_batches": None, "seed": None, "split": "val", **given})


@pytest.mark.parametrize("fsdp,batch_size,micro_batches,count", [
    (1, 6, 1, 3), (2, 6, 1, 2), (4, 12, 1, 4), (1, 8, 1, 4), (3, 5, 1, 1), (4, 12, 2, 2), (None, None, None, 4)])
def test_by_default_it_computes_on_the_most_devices_the_parts_and_the_weights_split_over(fsdp, batch_size,
                                                                                          micro_batches, count):
    """4 devices: of the counts each part (the run's batch in its micro-batches, or without a run 8 sequences)
    splits over evenly, those that split each weight into the most pieces (gcd with the run's mesh.fsdp), the
    largest: counted here by hand."""
    run, args = None, flags(run=None, from_="hf", data="data")
    if fsdp is not None:
        run, args = config.Config(), flags()
        run.mesh.fsdp, run.data.batch_size, run.optim.grad_accum_steps = fsdp, batch_size, micro_batches
    assert evaluate._devices_for(args, list("abcd"), given=False)(run) == list("abcd")[:count]


@pytest.mark.parametrize("fsdp,at_a_time,count,devices,why", [
    (4, 6, 2, 3, "each weight split over 2 of them, on all over 1: --devices 3 computes on all"),
    (2, 4, 2, 3, "each weight split over 2 of them, on all over 1: --devices 3 with a --batch_size of a multiple of "
                 "6 computes on all"),  # micro-batches 2; 4 do not split over 3
    (1, 3, 1, 2, "a --batch_size of a multiple of 4 splits over all of them"),
    (4, 5, 5, 6, "a --batch_size of a multiple of 12 splits over all of them"),  # on all over 2, here over 1
    (2, 4, 4, 4, None)])
def test_a_note_says_why_fewer_devices_compute(capsys, fsdp, at_a_time, count, devices, why):
    """Fewer devices than the machine's compute where each weight is split into more pieces on fewer (then the
    count that computes on all, with a --batch_size its parts split over where they do not), or where the parts do
    not split over all (then a --batch_size that does); no note on all of them."""
    evaluate._note_fewer(evaluate.EvalSet(None, 1, 2 * at_a_time, 2, 0), fsdp, count, devices)
    note = capsys.readouterr().err
    assert note == ("" if why is None else
                    f"note: {at_a_time} sequences at a time, computed on {count} of this machine's {devices} devices "
                    f"({why})\n")


def a_run_of_12_in_2(fsdp: int = 1) -> config.Config:
    """A run of data.batch_size 12 in optim.grad_accum_steps 2 and mesh.fsdp `fsdp`: 6 sequences at a time."""
    run = config.Config()
    run.mesh.fsdp, run.data.batch_size, run.optim.grad_accum_steps = fsdp, 12, 2
    return run


@pytest.mark.parametrize("given,fsdp,devices,picked", [
    ({}, 1, None, "abc"), ({"batch_size": 8}, 1, None, "abcd"), ({"micro_batches": 12}, 1, None, "a"),
    ({}, 1, 2, "ab"), ({}, 4, None, "ab"), ({}, 4, 3, "abc")])
def test_the_numbers_that_pick_the_devices_are_given_or_the_runs(given, fsdp, devices, picked):
    """A run of 6 sequences at a time on 4 devices: with fsdp 1 over 3 of them, --batch_size 8 (in the run's 2) over
    4, --micro_batches 12 over 1; with fsdp 4 over the 2 that split each weight in half; --devices N: its first N
    (3 with fsdp 4, where the default takes 2)."""
    machine = list("abcd")[:devices]
    assert evaluate._devices_for(flags(**given), machine, given=devices is not None)(a_run_of_12_in_2(fsdp)) == \
        list(picked)


@pytest.mark.parametrize("given,refused", [
    ({"micro_batches": 0}, "must be > 0"), ({"batch_size": 9}, "not divisible"),
    ({"batches": 0}, "--batches must be > 0"), ({"seed": -1}, "--seed must be in"),
    ({"batch_size": 9, "seed": -1}, "not divisible"), ({"batches": 0, "micro_batches": 0}, "--batches must be > 0"),
    ({"run": None, "from_": "hf"}, "--from hf is a model's weights without a run's data")])
@pytest.mark.parametrize("devices", [None, 2])
def test_numbers_that_make_no_eval_set_are_refused_before_a_read(given, refused, devices):
    """The flags that make no eval set of the run's 12 sequences in 2 (or of a model without a run), refused in
    the rule load calls before the weights are read, with or without --devices (2, which 6 sequences split over),
    the first of two faults as EvalSet.check finds it."""
    run = None if "from_" in given else a_run_of_12_in_2()
    with pytest.raises(UserError, match=re.escape(refused)):
        evaluate._devices_for(flags(**given), list("abcd")[:devices], given=devices is not None)(run)


def test_parts_that_do_not_split_over_the_devices_given_are_refused_before_a_read():
    with pytest.raises(UserError, match=re.escape("6 sequences at a time, which do not split over 4 devices; pass "
                                                  "--devices 3")):
        evaluate._devices_for(flags(), list("abcd"), given=True)(a_run_of_12_in_2())


@pytest.mark.parametrize("at_a_time,devices,said", [
    (12, 2, "raise --micro_batches or lower --batch_size, or split each part over more of this machine's 8 devices "
            "(--devices 6)"),
    (4, 4, "one sequence a device is the least: evaluate on devices with more memory, or the host's "
           "(JAX_PLATFORMS=cpu)"),  # 8 devices: 4 do not split
    (8, 4, "raise --micro_batches or lower --batch_size, or split each part over more of this machine's 8 devices "
           "(--devices 8)"),
    (12, 4, "raise --micro_batches or lower --batch_size"),  # 8 does not split 12; 6 would split the weights less
    (3, 1, "raise --micro_batches or lower --batch_size, or split each part over more of this machine's 8 devices "
           "(--devices 3)")])
def test_a_part_too_big_for_a_gpu_names_a_count_of_devices_it_splits_over(monkeypatch, at_a_time, devices, said):
    """On a machine of 8 GPUs: more devices where a larger multiple of the count divides the part (the largest
    such: each weight then split over as many), fewer sequences a part where a device holds more than one, and
    neither where it holds one already."""
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(evaluate.jax, "devices", lambda: [gpu] * 8)
    refusal = evaluate._too_big(evaluate.EvalSet(None, 1, at_a_time, 1, 0), devices, "needs 90 GiB")
    assert str(refusal) == f"evaluating {at_a_time} sequences at a time needs 90 GiB; {said}"
