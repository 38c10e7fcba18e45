"""torchref alone: the schedule, the decay groups, token-weighted accumulation, checkpoints and resume, metrics.

Runs use a 2-layer, d=32, T=16 model on a small random token folder, so the whole file takes seconds.
"""

import dataclasses
import json
import os
import re
import shutil
import signal

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from design_formulas import FP64, TOP1_HITS, TOP1_LOGITS, TOP1_TARGETS
from test_run import files_but_the_lock, read_metrics
from jaxtrain import config
from jaxtrain.errors import UserError
from torchref import metrics_log, run
from torchref.model import GPT
from torchref.optim import configure_optimizer, get_lr, lr_scheduler

VOCAB = 40


def write_token_dir(path, train, val) -> str:
    """A nanoGPT-format token folder: train.bin, val.bin (uint16) and meta.json."""
    for split, ids in (("train", train), ("val", val)):
        ids.astype(np.uint16).tofile(path / f"{split}.bin")
    meta = {"vocab_size": VOCAB, "dtype": "uint16", "tokenizer": "bytes", "train_tokens": len(train),
            "val_tokens": len(val)}
    (path / "meta.json").write_text(json.dumps(meta))
    return str(path)


@pytest.fixture(scope="module")
def token_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    return write_token_dir(tmp_path_factory.mktemp("tokens"), rng.integers(0, VOCAB, 4000),
                           rng.integers(0, VOCAB, 1000))


def tiny_argv(token_dir, out_dir, *overrides):
    return [f"--data.path={token_dir}", f"--run.out_dir={out_dir}", "--model.n_layer=2", "--model.n_head=2",
            "--model.d_model=32", "--model.seq_len=16", "--model.dropout=0.1", "--data.batch_size=8",
            "--optim.grad_accum_steps=2", "--optim.warmup_steps=2", "--train.steps=6", "--train.eval_every=3",
            "--train.eval_batches=2", "--checkpoint.every=3", "--log.progress=false", *overrides]


def tiny_cfg(token_dir, out_dir, *overrides):
    return config.load(tiny_argv(token_dir, out_dir, *overrides))


def tiny_model(cfg):
    torch.manual_seed(0)
    return GPT(dataclasses.replace(cfg.model, vocab_size=VOCAB))


def trajectory(out_dir):
    """The metrics that must repeat bit for bit (throughput is wall-clock and may not)."""
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu")} for r in read_metrics(out_dir)]


def final_tensors(out_dir, step=6):
    ckpt = os.path.join(out_dir, "checkpoints", str(step))
    return {**load_file(os.path.join(ckpt, "model.safetensors")),
            **load_file(os.path.join(ckpt, "optimizer.safetensors"))}


@pytest.fixture(scope="module")
def straight_run(token_dir, tmp_path_factory):
    """Six steps never interrupted, checkpoints at 3 and 6; tests copy it before changing anything."""
    out = str(tmp_path_factory.mktemp("straight"))
    run.train(tiny_cfg(token_dir, out))
    return out


# The schedule and the decay groups -------------------------------------------------------------------------------

def test_schedule_values(token_dir, tmp_path):
    cfg = tiny_cfg(token_dir, tmp_path, "--optim.lr=1e-3", "--optim.min_lr=1e-4", "--optim.warmup_steps=10",
                   "--train.steps=100")
    assert get_lr(0, cfg) == pytest.approx(1e-3 / 11, rel=FP64)  # lr / (W + 1): step 0 is never a no-op
    assert get_lr(5, cfg) == pytest.approx(1e-3 * 6 / 11, rel=FP64)
    assert get_lr(10, cfg) == pytest.approx(1e-3, rel=FP64)
    assert get_lr(55, cfg) == pytest.approx(1e-4 + 0.9e-3 * 0.5, rel=FP64)  # half way down the cosine
    assert get_lr(100, cfg) == pytest.approx(1e-4, rel=FP64)
    assert get_lr(150, cfg) == pytest.approx(1e-4, rel=FP64)
    no_warmup = tiny_cfg(token_dir, tmp_path, "--optim.lr=1e-3", "--optim.warmup_steps=0", "--train.steps=100")
    assert get_lr(0, no_warmup) == pytest.approx(1e-3, rel=FP64)


def test_scheduler_applies_the_schedule_per_optimizer_step(token_dir, tmp_path):
    cfg = tiny_cfg(token_dir, tmp_path, "--optim.warmup_steps=3", "--train.steps=8")
    model = tiny_model(cfg)
    optimizer = configure_optimizer(model, cfg)
    scheduler = lr_scheduler(optimizer, cfg)
    applied = []
    for _ in range(10):
        applied.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert applied == pytest.approx([get_lr(t, cfg) for t in range(10)], rel=FP64)
    resumed = lr_scheduler(configure_optimizer(model, cfg), cfg, step=4)
    assert resumed.optimizer.param_groups[1]["lr"] == applied[4]


@pytest.mark.parametrize("rule", ["ndim", "names"])
@pytest.mark.parametrize("tied", [True, False])
def test_param_groups(token_dir, tmp_path, rule, tied):
    cfg = tiny_cfg(token_dir, tmp_path, f"--optim.decay_mask={rule}", f"--model.tie_embeddings={tied}")
    model = tiny_model(cfg)
    optimizer = configure_optimizer(model, cfg)
    names = {p: n for n, p in model.named_parameters()}
    decayed = {names[p] for p in optimizer.param_groups[0]["params"]}
    undecayed = {names[p] for p in optimizer.param_groups[1]["params"]}
    assert optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    assert decayed | undecayed == set(names.values()) and not decayed & undecayed
    assert ("lm_head.weight" in names.values()) == (not tied)
    matrices = {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"}
    norms_and_biases = {"transformer.h.0.ln_1.weight", "transformer.ln_f.bias", "transformer.h.1.mlp.c_fc.bias"}
    embeddings = {"transformer.wte.weight", "transformer.wpe.weight"}
    assert matrices <= decayed and norms_and_biases <= undecayed
    assert embeddings <= (decayed if rule == "ndim" else undecayed)
    if not tied:
        assert "lm_head.weight" in decayed


# Token-weighted accumulation -------------------------------------------------------------------------------------

def test_accumulation_is_token_weighted(token_dir, tmp_path):
    """k=2 micro-batches with very different padding give exactly the gradient of the one big batch."""
    cfg = tiny_cfg(token_dir, tmp_path, "--model.dropout=0.0")
    model = tiny_model(cfg).double()
    no_autocast = torch.autocast("cpu", enabled=False)
    rng = np.random.default_rng(1)
    inputs = torch.from_numpy(rng.integers(0, VOCAB, (1, 4, 16)))
    targets = torch.from_numpy(rng.integers(0, VOCAB, (1, 4, 16)))
    targets[0, 0, 3:] = -1  # micro-batch 0: 3 + 16 valid targets; micro-batch 1: 32
    targets[0, 1, :] = -1
    targets[0, 1, 0] = 0
    grads = {}
    for k in (1, 2):
        model.zero_grad(set_to_none=True)
        run.accumulate_gradients(model, inputs.view(k, 4 // k, 16), targets.view(k, 4 // k, 16), no_autocast)
        grads[k] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads[1].items():
        # float64: the split only reorders sums of O(1) terms, ~1e-16 each; 1e-12 is exact for any rule purpose.
        torch.testing.assert_close(grads[2][name], g, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_correct_sum_counts_top1_hits_with_ties_to_the_lowest_index(dtype):
    hits = run.correct_sum(torch.tensor(TOP1_LOGITS, dtype=dtype), torch.tensor(TOP1_TARGETS))
    assert int(hits) == TOP1_HITS


# A run, its metrics and checkpoints ------------------------------------------------------------------------------

def test_metrics_lines(straight_run):
    records = read_metrics(straight_run)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert all(set(r) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"} for r in train)
    assert all(r["mfu"] is None for r in train)  # CPU: peak unknown
    assert [r["tokens"] for r in train] == [8 * 16 * s for s in range(1, 7)]
    assert train[0]["lr"] == pytest.approx(1e-3 / 3, rel=FP64)
    assert [r["step"] for r in evals] == [3, 6]
    assert all(set(r) == {"step", "eval_loss", "eval_accuracy"} and 0 <= r["eval_accuracy"] <= 1 for r in evals)
    assert os.path.exists(os.path.join(straight_run, "config.yaml"))


def test_checkpoint_files(straight_run):
    ckpt = os.path.join(straight_run, "checkpoints", "6")
    assert sorted(os.listdir(os.path.join(straight_run, "checkpoints"))) == ["3", "6"]
    weights = load_file(os.path.join(ckpt, "model.safetensors"))
    assert "lm_head.weight" not in weights and weights["transformer.wte.weight"].dtype == torch.float32
    moments = load_file(os.path.join(ckpt, "optimizer.safetensors"))
    assert set(moments) == {f"{n}.{m}" for n in weights for m in ("exp_avg", "exp_avg_sq")}
    with open(os.path.join(ckpt, "trainer_state.json")) as f:
        state = json.load(f)
    assert state["format"] == "jaxtrain-torch/1" and state["step"] == 6 and state["tied_embeddings"]
    assert state["data"] == {"seed": 0, "next_step": 6, "tokens": 6 * 8 * 16}
    umask = os.umask(0)  # the mode open() gives a new file, which the weights get too (safetensors' own: 0600)
    os.umask(umask)
    assert {oct(os.stat(os.path.join(ckpt, n)).st_mode & 0o777) for n in os.listdir(ckpt)} == {oct(0o666 & ~umask)}


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_resume_after_a_signal_is_bit_exact(straight_run, token_dir, tmp_path, monkeypatch, capsys, signum):
    """Ctrl-C or SIGTERM (a preemption) during step 3 stops after it with a checkpoint; the same command then
    finishes the run exactly as the run that never stopped (dropout on, so the RNG state must be restored too)."""
    calls = []

    def interrupted_at_step_3(*args):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signum)
        return train_step(*args)

    train_step = run.train_step
    monkeypatch.setattr(run, "train_step", interrupted_at_step_3)
    run.train(tiny_cfg(token_dir, tmp_path))
    monkeypatch.undo()
    assert "interrupted: saved step 3" in capsys.readouterr().err
    assert os.listdir(tmp_path / "checkpoints") == ["3"]
    run.train(tiny_cfg(token_dir, tmp_path))
    assert "resuming from step 3" in capsys.readouterr().err
    assert trajectory(tmp_path) == trajectory(straight_run)
    expected = final_tensors(straight_run)
    for name, t in final_tensors(tmp_path).items():
        assert torch.equal(t, expected[name]), name


def test_resume_drops_metrics_past_the_checkpoint(straight_run, token_dir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))
    run.train(tiny_cfg(token_dir, out))
    assert trajectory(out) == trajectory(straight_run)


def test_resume_drops_a_garbled_metrics_tail_with_a_warning(straight_run, token_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))
    with open(os.path.join(out, "metrics.jsonl"), "ab") as f:
        f.write(b"\xff\xfe\x00 not UTF-8\n")
    run.train(tiny_cfg(token_dir, out))
    assert trajectory(out) == trajectory(straight_run)
    assert "metrics.jsonl: dropped 1 damaged line(s)" in capsys.readouterr().err


def test_a_stray_init_from_on_resume_is_not_recorded(straight_run, token_dir, tmp_path):
    """As jaxtrain's (tests/test_run.py): config.yaml and the checkpoints saved after the resume keep the run's own
    init.from (none), not the one the resume did not read."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))
    run.train(tiny_cfg(token_dir, out, "--init.from=/another/run/checkpoint"))
    assert config.load(["--config", os.path.join(out, "config.yaml")]).init.from_ is None
    with open(os.path.join(out, "checkpoints", "6", "trainer_state.json"), encoding="utf-8") as f:
        assert json.load(f)["config"]["init"]["from"] is None
    assert trajectory(out) == trajectory(straight_run)


def test_resume_with_a_changed_config_names_the_keys(straight_run, token_dir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    with pytest.raises(UserError, match=r"optim\.lr: 0\.001 -> 0\.002.*run\.fresh=true"):
        run.train(tiny_cfg(token_dir, out, "--optim.lr=2e-3"))


def test_moved_data_resumes_and_other_data_is_refused(straight_run, token_dir, tmp_path):
    """The resume check compares the data's content, not its data.path: a copy of the token folder resumes and
    finishes like the run that never stopped; one token changed there is refused, naming the data."""
    out, moved = str(tmp_path / "run"), str(tmp_path / "moved")
    shutil.copytree(straight_run, out)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))
    shutil.copytree(token_dir, moved)
    run.train(tiny_cfg(moved, out))
    assert trajectory(out) == trajectory(straight_run)
    shutil.rmtree(os.path.join(out, "checkpoints", "6"))
    tokens = np.memmap(os.path.join(moved, "train.bin"), np.uint16, "r+")
    tokens[0] = (tokens[0] + 1) % VOCAB
    tokens.flush()
    with pytest.raises(UserError, match=r"the data \(.*moved\) differs from the data that wrote .*checkpoints/3"):
        run.train(tiny_cfg(moved, out))


def test_corrupt_checkpoint_file_is_named(straight_run, token_dir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    model_file = os.path.join(out, "checkpoints", "6", "model.safetensors")
    with open(model_file, "r+b") as f:
        f.truncate(100)
    resume_fix = re.escape("; that checkpoint is damaged: delete its folder (a resume then takes the previous one), "
                           "or start over with --run.fresh=true") + "$"
    with pytest.raises(UserError, match=r"checkpoints/6/model\.safetensors .*" + resume_fix):
        run.train(tiny_cfg(token_dir, out))
    state_file = os.path.join(out, "checkpoints", "6", "trainer_state.json")
    with open(state_file, "w") as f:
        f.write('{"step": 6}')  # JSON, not ours: it had the fix of a wrong init.from ("point at a ... folder")
    with pytest.raises(UserError, match=r"checkpoints/6/trainer_state\.json is not a .*" + resume_fix):
        run.train(tiny_cfg(token_dir, out))
    os.remove(state_file)
    with pytest.raises(UserError, match=r"checkpoints/6/trainer_state\.json .*" + resume_fix):
        run.train(tiny_cfg(token_dir, out))


def test_a_damaged_init_from_source_is_not_to_be_deleted(straight_run, token_dir, tmp_path):
    """A resume falls back to the previous checkpoint once a damaged one is deleted; init.from has none."""
    source = tmp_path / "source"
    shutil.copytree(os.path.join(straight_run, "checkpoints", "6"), source)
    os.truncate(source / "model.safetensors", 100)
    with pytest.raises(UserError) as e:
        run.train(tiny_cfg(token_dir, tmp_path / "run", f"--init.from={source}"))
    assert str(e.value).startswith(f"checkpoint file {source}/model.safetensors is missing or unreadable (")
    assert str(e.value).endswith("); the init.from checkpoint is damaged: copy or convert it again, or point "
                                 "--init.from at another checkpoint")


# trainer_state.json damaged in a field torchref reads (KeyError, TypeError and RuntimeError tracebacks before; the
# reader is jaxtrain's now, checkpoint_kind.read_trainer_state): each, and what the error says of it.
TRAINER_STATE_DAMAGE = {
    "no data seed": (lambda s: s["data"].pop("seed"), "'data.seed' is missing or not an integer (got None)"),
    "no step": (lambda s: s.pop("step"), "'step' is missing or not an integer from 0 to 2^31 - 1 (got None)"),
    "rng a list": (lambda s: s.update(rng=[1]), "'rng' is not {torch: <base64> or null"),
    "rng not torch's": (lambda s: s["rng"].update(torch="AAAA"), "'rng' does not hold torch's RNG states ("),
    "loss scale text": (lambda s: s.update(loss_scale={"scale": "x", "growth_tracker": 0}),
                        "'loss_scale' is not {scale: a finite number > 0"),
}


@pytest.mark.parametrize("damage", TRAINER_STATE_DAMAGE)
def test_a_damaged_trainer_state_is_one_line(straight_run, token_dir, tmp_path, damage):
    edit, problem = TRAINER_STATE_DAMAGE[damage]
    source = tmp_path / "source"
    shutil.copytree(os.path.join(straight_run, "checkpoints", "6"), source)
    state = json.loads((source / "trainer_state.json").read_text())
    edit(state)
    (source / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(UserError) as e:
        run.train(tiny_cfg(token_dir, tmp_path / "run", f"--init.from={source}"))
    assert str(e.value).startswith(f"{source}/trainer_state.json: ") and problem in str(e.value), str(e.value)
    assert str(e.value).endswith("; the init.from checkpoint is damaged: copy or convert it again, or point "
                                 "--init.from at another checkpoint")


def test_fresh_run_sets_old_checkpoints_aside(straight_run, token_dir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    run.train(tiny_cfg(token_dir, out, "--run.fresh=true"))
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["3", "6"]
    assert any(n.startswith("checkpoints.before-fresh-") for n in os.listdir(out))
    assert any(n.startswith("metrics.jsonl.before-fresh-") for n in os.listdir(out))  # the old metrics are kept
    assert trajectory(out) == trajectory(straight_run)


def test_metrics_lines_come_every_log_every_steps_and_at_the_last(token_dir, tmp_path):
    """jaxtrain's rule (Config.logs_at): with train.steps=6 and log.every=4, lines at steps 4 and 6 (before,
    torchref wrote none at 6, and its report lacked the run's last step)."""
    run.train(tiny_cfg(token_dir, str(tmp_path), "--log.every=4", "--checkpoint.every=6"))
    assert [line["step"] for line in read_metrics(tmp_path) if "loss" in line] == [4, 6]


def test_each_evaluation_prints_jaxtrains_line_on_stdout(token_dir, tmp_path, capsys):
    """torchref printed nothing after an evaluation, where jaxtrain prints `step N: eval loss L, accuracy A%`."""
    run.train(tiny_cfg(token_dir, str(tmp_path)))
    evals = [line for line in read_metrics(tmp_path) if "eval_loss" in line]
    assert [line["step"] for line in evals] == [3, 6]
    want = [f"step {e['step']}: eval loss {round(e['eval_loss'], 4):.4f}, accuracy "
            f"{round(100 * e['eval_accuracy'], 2):.2f}%" for e in evals]
    assert capsys.readouterr().out.splitlines() == want


def test_the_summary_is_jaxtrains_line_on_stderr_with_mfu(token_dir, tmp_path, capsys):
    """torchref printed its own summary on stdout, without MFU even where the peak was known. Now jaxtrain's line
    (metrics.summary_line) on stderr: tokens/s the run's tokens after step 1 over the seconds their metrics lines
    took (each line's tokens over its tokens_per_s; one line a step), MFU that times 6 N + 12 L d T FLOPs a token (N:
    the model's parameters by torch's count, less the looked-up position embedding) over the given peak, 1 TFLOP/s."""
    cfg = tiny_cfg(token_dir, str(tmp_path), "--log.peak_tflops=1")
    run.train(cfg)
    captured = capsys.readouterr()
    summary = captured.err.strip().splitlines()[-1]
    assert "done:" not in captured.out and summary.startswith("done: steps 0->6  loss "), summary
    lines = [line for line in read_metrics(tmp_path) if "loss" in line]
    tokens = np.diff([0] + [line["tokens"] for line in lines])
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    want_tokens_per_s = tokens[1:].sum() / sum(t / line["tokens_per_s"] for t, line in zip(tokens[1:], lines[1:]))
    m = cfg.model
    n = sum(p.numel() for p in GPT(dataclasses.replace(m, vocab_size=VOCAB)).parameters()) - m.seq_len * m.d_model
    want_mfu = want_tokens_per_s * (6 * n + 12 * m.n_layer * m.d_model * m.seq_len) / 1e12
    got_tokens_per_s = float(summary.split("tokens/s ")[1].split()[0].replace(",", ""))
    got_mfu = float(summary.split("mfu ")[1].split("%")[0]) / 100
    assert got_tokens_per_s == pytest.approx(want_tokens_per_s, abs=0.5 + 1e-9)  # printed to the token a second
    assert got_mfu == pytest.approx(want_mfu, abs=0.0005 + 1e-9)  # printed to 0.1%


def test_a_step_folder_holding_another_step_is_refused_naming_it(straight_run, token_dir, tmp_path):
    """checkpoints/3 copied to checkpoints/9: torchref resumed "from step 3 (.../9)", overwrote the later saves, and
    rotation kept 9, the newest by name, so every later start trained from 3 again. Now refused, naming it."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    checkpoints = os.path.join(out, "checkpoints")
    shutil.copytree(os.path.join(checkpoints, "3"), os.path.join(checkpoints, "9"))
    before = files_but_the_lock(out)
    with pytest.raises(UserError) as refused:
        run.train(tiny_cfg(token_dir, out))
    assert str(refused.value) == (f"checkpoint {checkpoints}/9 holds step 3, not the step its folder is named for "
                                  f"(a copy or a backup put there?); move it out of {checkpoints}")
    assert files_but_the_lock(out) == before


def test_a_start_with_nothing_to_train_leaves_config_yaml_as_it_was(straight_run, token_dir, tmp_path, capsys):
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    before = open(os.path.join(out, "config.yaml")).read()
    run.train(tiny_cfg(token_dir, out, "--train.steps=4", "--optim.decay_steps=6"))
    assert "nothing to train: at step 6 of train.steps=4" in capsys.readouterr().err
    assert open(os.path.join(out, "config.yaml")).read() == before


def test_a_save_before_any_update_holds_zero_moments_and_resumes_exactly(token_dir, tmp_path):
    """fp16 from a loss scale of 2^40: the first three windows overflow and are skipped, so the save at step 3 comes
    before AdamW has made any state (before: KeyError 'exp_avg', no checkpoint). It holds zero moments, and the run
    resumed from it ends where the uninterrupted run ends, bit for bit."""
    args = ("--train.precision=fp16", "--train.loss_scale_init=1099511627776", "--optim.decay_steps=6")
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    run.train(tiny_cfg(token_dir, straight, *args))
    run.train(tiny_cfg(token_dir, resumed, *args, "--train.steps=3"))
    state = json.load(open(os.path.join(resumed, "checkpoints", "3", "trainer_state.json")))
    assert state["skipped"] == 3  # no update before this save
    moments = load_file(os.path.join(resumed, "checkpoints", "3", "optimizer.safetensors"))
    assert moments and all(not t.any() for t in moments.values())
    run.train(tiny_cfg(token_dir, resumed, *args))
    assert trajectory(resumed) == trajectory(straight)
    assert all(torch.equal(a, b) for a, b in zip(final_tensors(resumed).values(), final_tensors(straight).values()))


def test_keep_best_keeps_the_lowest_eval_loss_across_a_resume(tmp_path, capsys):
    """checkpoint.keep_best, as jaxtrain keeps it: the newest checkpoint and the save of the lowest eval loss (the
    eval lines of metrics.jsonl say which), also after a resume, which must remember the best of the steps before
    it (before, torchref ignored the key and deleted that checkpoint). The scenario, the best older than the resume,
    is made by the data, not found in a trajectory: the training tokens count up (each the last plus one) and the
    evaluation tokens are random, so every step's growing trust in the count makes the eval loss worse (measured
    3.76, 3.88, 4.04 at steps 3, 6, 9 with torch 2.13 and 3.74, 3.86, 4.05 with torch 2.6; on random tokens for
    both the best had been step 3 by 0.01 with torch 2.13 and step 9 with torch 2.6)."""
    data = write_token_dir(tmp_path, np.arange(4000) % VOCAB, np.random.default_rng(0).integers(0, VOCAB, 1000))
    out = str(tmp_path / "run")
    args = ("--checkpoint.keep_best=true", "--checkpoint.max_to_keep=1", "--optim.schedule=constant",
            "--optim.warmup_steps=0", "--optim.lr=0.01")
    for steps in (6, 9):
        run.train(tiny_cfg(data, out, *args, f"--train.steps={steps}"))
        evals = {line["step"]: line["eval_loss"] for line in read_metrics(out) if "eval_loss" in line}
        best = min(evals, key=evals.get)
        assert sorted(map(int, os.listdir(os.path.join(out, "checkpoints")))) == sorted({best, steps}), evals
        if steps == 6:
            shutil.copytree(out, str(tmp_path / "released"))
    assert best == 3, evals  # the scenario's premise, as the data makes it
    # A resume without the flag deletes the best at its next save, as asked; it says so first, in jaxtrain's words.
    capsys.readouterr()
    run.train(tiny_cfg(data, str(tmp_path / "released"), *args, "--checkpoint.keep_best=false", "--train.steps=9"))
    assert capsys.readouterr().err.count(
        f"warning: checkpoint.keep_best is false, so the next save deletes step 3, the lowest eval loss kept so far "
        f"({evals[3]:.4f}), older than the newest checkpoint.max_to_keep=1; resume with --checkpoint.keep_best=true "
        f"to keep it") == 1
    assert os.listdir(tmp_path / "released" / "checkpoints") == ["9"]


def test_a_dry_run_is_refused_before_the_run_folder_is_touched(token_dir, tmp_path):
    with pytest.raises(UserError, match=r"^run.dry_run=true is jaxtrain's: .* run it with python -m jaxtrain.run"):
        run.train(tiny_cfg(token_dir, str(tmp_path / "run"), "--run.dry_run=true"))
    assert not (tmp_path / "run").exists()


def test_a_refused_fresh_start_leaves_the_previous_run_to_resume(straight_run, token_dir, tmp_path, capsys):
    """run.fresh with an unreadable init.from is refused before anything moves: the run folder stays byte for byte
    and a resume without run.fresh finds its last step (before, its checkpoints and metrics were moved aside first,
    and that resume started at step 0)."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"cut short")
    before = files_but_the_lock(out)
    with pytest.raises(UserError, match=r"damaged/model\.safetensors is missing or unreadable"):
        run.train(tiny_cfg(token_dir, out, "--run.fresh=true", f"--init.from={damaged}"))
    assert files_but_the_lock(out) == before
    capsys.readouterr()
    run.train(tiny_cfg(token_dir, out))
    assert "nothing to train: at step 6 of train.steps=6" in capsys.readouterr().err


def test_a_fresh_start_stopped_before_its_first_step_moves_nothing(straight_run, token_dir, tmp_path, capsys,
                                                                  monkeypatch):
    """A Ctrl-C during a fresh start's start-up (here: while the optimizer is built) stops it before the previous
    run is moved aside, as jaxtrain's does; the line names the command that starts over. Before, torchref moved the
    run aside first and then said to resume without run.fresh, which trained a new run from step 0."""
    out = str(tmp_path / "run")
    shutil.copytree(straight_run, out)
    before = files_but_the_lock(out)
    real = run.configure_optimizer

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(run, "configure_optimizer", interrupted)
    run.train(tiny_cfg(token_dir, out, "--run.fresh=true"))
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped before the first step, nothing new to save; run.fresh has moved nothing aside yet: run the same "
        "command to start over")
    assert files_but_the_lock(out) == before
    monkeypatch.undo()
    run.train(tiny_cfg(token_dir, out))
    assert "nothing to train: at step 6 of train.steps=6" in capsys.readouterr().err


def test_a_signal_during_the_last_step_ends_the_complete_run_at_once(token_dir, tmp_path, monkeypatch, capsys):
    """As jaxtrain's (tests/test_preemption.py): a SIGTERM while step 6 of 6 trains saves it and ends with 128 +
    signal, the run trained and saved; it said "interrupted: saved step 6; run the same command to resume", exit 0."""
    from jaxtrain import preemption
    out, real_step, steps = str(tmp_path / "run"), run.train_step, []

    def signalled_in_the_last_step(*args):
        steps.append(len(steps) + 1)
        if len(steps) == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args)

    def exit_now(signum, line):
        raise SystemExit((signum, line))

    monkeypatch.setattr(run, "train_step", signalled_in_the_last_step)
    monkeypatch.setattr(preemption, "_exit_now", exit_now)
    with pytest.raises(SystemExit) as exited:
        run.train(tiny_cfg(token_dir, out))
    assert exited.value.code == (signal.SIGTERM, "SIGTERM: stopping now; the run is trained and saved at step 6")
    assert "interrupted" not in capsys.readouterr().err
    assert max(int(step) for step in os.listdir(os.path.join(out, "checkpoints"))) == 6


def test_a_full_disk_during_a_save_is_one_line_naming_the_newest_checkpoint(token_dir, tmp_path, monkeypatch):
    """safetensors' error on a full disk (its text from a full 200 KiB tmpfs) is a SafetensorError, no OSError: it
    was a traceback, exit 1, the save's .tmp-<step> left. Now jaxtrain's line (runfolder.unwritten_checkpoint) and
    the folder removed."""
    from safetensors import SafetensorError
    from torchref import checkpoint as torchref_checkpoint
    out, real_save_file = str(tmp_path / "run"), torchref_checkpoint.save_file

    def full_from_step_6(tensors, path, *args, **kwargs):
        if f"{os.sep}.tmp-6{os.sep}" in path:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real_save_file(tensors, path, *args, **kwargs)

    monkeypatch.setattr(torchref_checkpoint, "save_file", full_from_step_6)
    with pytest.raises(UserError) as failed:
        run.train(tiny_cfg(token_dir, out))
    assert str(failed.value) == (f"a checkpoint could not be written into {out}/checkpoints (Error while "
                                 f"serializing: I/O error: No space left on device (os error 28)); the newest "
                                 f"complete one is step 3: mend what it names (free space, write access, the "
                                 f"storage) and run the same command to resume")
    assert os.listdir(os.path.join(out, "checkpoints")) == ["3"]  # .tmp-6 removed


def jaxtrain_run(root):
    """A run folder laid out as jaxtrain's, steps 2 and 4: each step folder holds Orbax's metadata file and the
    `state` item, the names checkpoint_kind tells it by (tests/test_checkpoint_kind.py: on a real one)."""
    for at in (2, 4):
        (root / "checkpoints" / str(at) / "state").mkdir(parents=True)
        (root / "checkpoints" / str(at) / "_CHECKPOINT_METADATA").write_text("{}")
    (root / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    return root


def test_a_jaxtrain_run_folder_is_named_not_called_damaged(straight_run, token_dir, tmp_path):
    """Refused, the folder as it was; then the fix it names, run.fresh, sets the jaxtrain checkpoints aside."""
    out = jaxtrain_run(tmp_path / "jaxtrain-run")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    with pytest.raises(UserError) as e:
        run.train(tiny_cfg(token_dir, out))
    step = out / "checkpoints" / "4"
    assert str(e.value) == (f"{step} is a jaxtrain checkpoint (an Orbax step folder), which torchref starts from once "
                            f"converted: python -m jaxtrain.convert to-torch {step} DST, then --init.from=DST; move it "
                            f"out of {out / 'checkpoints'}, or choose another --run.out_dir (or start over with "
                            f"--run.fresh=true, which sets the checkpoints aside)")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.name != ".lock") == before
    run.train(tiny_cfg(token_dir, out, "--run.fresh=true"))
    [aside] = [name for name in os.listdir(out) if name.startswith("checkpoints.before-fresh-")]
    assert sorted(os.listdir(out / aside)) == ["2", "4"] and sorted(os.listdir(out / "checkpoints")) == ["3", "6"]
    assert trajectory(out) == trajectory(straight_run)


@pytest.mark.parametrize("given", ["run folder", "step folder"])
def test_init_from_a_jaxtrain_checkpoint_says_to_convert_it(token_dir, tmp_path, given):
    jaxtrain = jaxtrain_run(tmp_path / "jaxtrain-run")
    source = jaxtrain if given == "run folder" else jaxtrain / "checkpoints" / "4"
    with pytest.raises(UserError) as e:
        run.train(tiny_cfg(token_dir, tmp_path / "run", f"--init.from={source}"))
    assert str(e.value).startswith(f"init.from='{source}' is a jaxtrain ")
    assert str(e.value).endswith(f"not a torch-format {'checkpoint' if given == 'run folder' else 'one'}: jaxtrain.run "
                                 f"resumes it with --run.out_dir={jaxtrain}; to start another run from it, convert it "
                                 f"first: python -m jaxtrain.convert to-torch {jaxtrain}/checkpoints/4 DST, then "
                                 f"--init.from=DST")


def test_init_from_a_hugging_face_folder_says_to_convert_it(token_dir, tmp_path):
    """A GPT2LMHeadModel folder: config.json, and the state dict with the Conv1D weights (in, out), the transpose of
    nanoGPT's Linear."""
    cfg = tiny_cfg(token_dir, tmp_path / "run", f"--init.from={tmp_path / 'hf'}")
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    hf = {name: (t.T if name.endswith(conv1d) else t).contiguous()
          for name, t in tiny_model(cfg).state_dict().items() if name != "lm_head.weight"}
    (tmp_path / "hf").mkdir()
    save_file(hf, tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32}))
    with pytest.raises(UserError) as e:
        run.train(cfg)
    assert str(e.value) == (f"init.from='{tmp_path / 'hf'}' is a Hugging Face GPT-2 folder (its Conv1D weights are "
                            f"laid out (in, out)), not a torch-format checkpoint; convert it first: python -m "
                            f"jaxtrain.convert from-hf {tmp_path / 'hf'} DST, then --init.from=DST")


# init.from -------------------------------------------------------------------------------------------------------

def test_init_from_full_state_continues_the_run(straight_run, token_dir, tmp_path):
    run.train(tiny_cfg(token_dir, tmp_path, f"--init.from={straight_run}/checkpoints/3"))
    assert [r["step"] for r in read_metrics(tmp_path)] == [4, 5, 6, 6]
    assert trajectory(tmp_path) == [r for r in trajectory(straight_run) if r["step"] > 3]


def test_init_from_weights_only(straight_run, token_dir, tmp_path):
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    shutil.copy(os.path.join(straight_run, "checkpoints", "6", "model.safetensors"), weights_dir)
    cfg = tiny_cfg(token_dir, tmp_path / "run", f"--init.from={weights_dir}", "--train.steps=3")
    run.train(cfg)
    assert read_metrics(tmp_path / "run")[0]["step"] == 1


@pytest.mark.parametrize("override, offender", [("--model.d_model=48", "transformer.wte.weight"),
                                                ("--model.tie_embeddings=false", "lm_head.weight"),
                                                ("--model.n_layer=3", "transformer.h.2.ln_1.weight")])
def test_init_from_mismatch_names_the_tensor(straight_run, token_dir, tmp_path, override, offender):
    cfg = tiny_cfg(token_dir, tmp_path, f"--init.from={straight_run}/checkpoints/6", override)
    with pytest.raises(UserError, match=rf"model\.safetensors.*'{offender}'"):
        run.train(cfg)


def test_cli_reports_user_errors(token_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run.main(tiny_argv(token_dir, tmp_path, "--init.from=/nonexistent"))
    assert e.value.code == 2 and "init.from='/nonexistent' does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run"])
def test_a_run_folder_in_a_bucket_is_refused_as_such_not_sent_for_a_package(token_dir, tmp_path, capsys, url):
    """Config validation asked for s3fs first (`pip install 's3fs'`), after which torchref refused the URL anyway."""
    with pytest.raises(SystemExit) as e:
        run.main(tiny_argv(token_dir, tmp_path, f"--run.out_dir={url}"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"error: run.out_dir={url!r}: torchref writes its run folder on a "
                                                f"local disk only"), err


def test_the_keys_torchref_does_not_read_are_named(token_dir, tmp_path):
    """A config with jaxtrain's devices and kernels set trains in torchref, on one device (the same math): those
    keys are named in its one note, as the TensorBoard and sample keys were, not passed over unsaid."""
    quiet = tiny_cfg(token_dir, tmp_path, "--log.tensorboard=false", "--log.sample_tokens=0")
    assert metrics_log.jaxtrain_only(quiet) == []
    pod = tiny_cfg(token_dir, tmp_path, "--log.tensorboard=false", "--log.sample_tokens=0", "--mesh.fsdp=2",
                   "--model.attention=cudnn", "--model.remat=dots", "--model.vocab_tiles=2")
    assert metrics_log.jaxtrain_only(pod) == ["mesh.fsdp=2", "model.attention=cudnn", "model.remat=dots",
                                              "model.vocab_tiles=2"]
    assert metrics_log.jaxtrain_only(tiny_cfg(token_dir, tmp_path, "--log.tensorboard=true")) == [
        "log.tensorboard=True"]


# What torchref/model.py's GPT reads of the model's keys: the math. Every other model key must be in JAXTRAIN_ONLY.
TORCHREF_READS = {"vocab_size", "seq_len", "n_layer", "n_head", "d_model", "dropout", "bias", "tie_embeddings",
                  "gelu_approximate", "residual_dtype"}


def test_every_model_key_is_read_by_torchref_or_named_as_jaxtrains():
    """A model key added to jaxtrain (a kernel's switch: model.gelu_fwd was once left out) is either math torchref
    computes too (TORCHREF_READS, written here by hand) or one JAXTRAIN_ONLY names, so that torchref's note says
    it is not read rather than passing over it unsaid."""
    keys = {f.name for f in dataclasses.fields(config.ModelConfig)}
    named = {key.split(".", 1)[1] for key in metrics_log.JAXTRAIN_ONLY if key.startswith("model.")}
    assert keys - TORCHREF_READS == named
