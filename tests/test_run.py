"""The main job end to end on a small model: metrics.jsonl, checkpoints, resume, Ctrl-C, clean errors."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest

from design_formulas import default_lr_at
from parity_tests import inject_nan
from parity_tests.runs import read_metrics
from jaxtrain import agreed_stop, config, convert, data, model, run, runlock
from jaxtrain import mesh as mesh_lib
from jaxtrain.divergence import Divergence
from jaxtrain.errors import UserError

TIMING_KEYS = ("tokens_per_s", "mfu")  # wall-clock measurements, the only fields that may differ between runs


def small_args(out_dir, cache_dir, *extra):
    return ["--config", "configs/tiny.yaml", f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}",
            "--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.seq_len=32",
            "--data.batch_size=8", "--train.steps=8", "--optim.warmup_steps=2", "--checkpoint.every=4",
            "--train.eval_every=4", "--train.eval_batches=2", "--log.progress=false", "--train.precision=fp32",
            "--log.sample_tokens=0", *extra]  # tiny.yaml's end-of-run sample: tests/test_sample.py's


def without_timing(lines):
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


def files_but_the_lock(folder) -> dict[str, bytes]:
    """Every file of a run folder by relative path, but the run lock, which each start takes (runlock.py)."""
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names if n != runlock.NAME}


def final_params(out_dir, cache_dir, *extra):
    cfg = config.load(small_args(out_dir, cache_dir, *extra))
    trainer = run.Trainer(cfg)
    state = trainer.checkpointer.restore(cfg.train.steps, trainer.abstract_state)
    trainer.close()
    return jax.tree.leaves(jax.device_get(state))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("reference"))
    summary = run.train(config.load(small_args(out_dir, cache_dir)))
    return out_dir, summary


def test_metrics_lines_and_checkpoints(reference_run, cache_dir):
    out_dir, summary = reference_run
    lines = read_metrics(out_dir)
    train_lines = [line for line in lines if "loss" in line]
    assert [line["step"] for line in train_lines] == list(range(1, 9))
    assert set(train_lines[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}
    assert all(np.isfinite(line["loss"]) for line in train_lines)
    assert [line["tokens"] for line in train_lines] == [8 * 32 * s for s in range(1, 9)]
    for line in train_lines:  # the lr column is the LR applied by the update at 0-based optimizer step `step - 1`
        # tiny.yaml's lr 1e-3 and min_lr 1e-4, small_args' warmup 2 and decay over train.steps 8, in float64;
        # the step evaluates optax's schedule in float32: a few ulps.
        assert line["lr"] == pytest.approx(default_lr_at(line["step"] - 1, 1e-3, 1e-4, 2, 8), rel=1e-6)
    eval_lines = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in eval_lines] == [4, 8]
    assert all(set(line) == {"step", "eval_loss", "eval_accuracy"} for line in eval_lines)
    # Token-weighted over the 2 eval batches of 8 x 32 targets, none of them padding: hits / 512.
    assert all((line["eval_accuracy"] * 512).is_integer() for line in eval_lines)
    assert sorted(os.listdir(os.path.join(out_dir, "checkpoints"))) == ["4", "8"]
    assert os.path.isfile(os.path.join(out_dir, "config.yaml"))
    assert summary["eval_loss"] == lines[-1]["eval_loss"]
    assert summary["eval_accuracy"] == lines[-1]["eval_accuracy"]


def test_resume_after_kill_is_bit_exact(reference_run, tmp_path, cache_dir):
    """A run killed at step 6, after its checkpoint at step 4, in the middle of writing a line, and started again
    with the same command: lines 1..4 are kept, 5..6 are rewritten (not duplicated), the cut line is dropped, and
    every later loss and the final params equal the uninterrupted run's bit for bit."""
    ref_dir, _ = reference_run
    out_dir = str(tmp_path / "killed")
    shutil.copytree(ref_dir, out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "8"))
    lines = read_metrics(out_dir)
    killed = [line for line in lines if line["step"] <= 4 or (line["step"] <= 6 and "loss" in line)]
    killed[-1] = dict(killed[-1], loss=123.0)  # a line past the checkpoint must be replaced, not kept
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in killed)
        f.write(json.dumps(lines[-1])[:25])  # the kill cut the last line short

    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(out_dir, cache_dir)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "resuming from step 4" in proc.stderr
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(ref_dir))
    for a, b in zip(final_params(out_dir, cache_dir), final_params(ref_dir, cache_dir)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("change, named", [("--optim.lr=1e-2", "optim.lr: 0.001 -> 0.01"),
                                           ("--model.n_layer=3", "model.n_layer: 2 -> 3")])
def test_config_change_refuses_to_resume_and_changes_nothing(reference_run, tmp_path, cache_dir, change, named):
    """Refused with the changed key named (a model shape too, before Orbax reads any array), and the run folder,
    config.yaml included, left byte for byte as it was."""
    out_dir = str(tmp_path / "changed")
    shutil.copytree(reference_run[0], out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "8"))
    before = {name: open(os.path.join(out_dir, name), "rb").read() for name in ("config.yaml", "metrics.jsonl")}
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, change)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert {name: open(os.path.join(out_dir, name), "rb").read() for name in before} == before


def test_moved_data_resumes_and_other_data_is_refused(reference_run, tmp_path, cache_dir):
    """The resume check compares the data's content, not where it lies: the corpus copied to another
    data.cache_dir resumes and finishes like the run that never stopped; one token changed there is refused."""
    out_dir, moved = str(tmp_path / "run"), str(tmp_path / "moved-cache")
    shutil.copytree(reference_run[0], out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "8"))
    shutil.copytree(cache_dir, moved)
    run.train(config.load(small_args(out_dir, moved)))
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(reference_run[0]))
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "8"))
    (corpus,) = os.listdir(moved)
    tokens = np.memmap(os.path.join(moved, corpus, "train.bin"), np.uint16, "r+")
    tokens[0] = (tokens[0] + 1) % 256
    tokens.flush()
    with pytest.raises(UserError, match=r"the data \(the embedded corpus\) differs from the data that wrote "
                                        r".*checkpoints/4 \(data fingerprint"):
        run.Trainer(config.load(small_args(out_dir, moved)))


@pytest.fixture(scope="module")
def byte_runs(tmp_path_factory, cache_dir):
    """backend -> a run of 4 steps on a prepared byte-level data folder; tokenizer -> a folder of the same text."""
    root = tmp_path_factory.mktemp("byte-runs")
    (root / "text.txt").write_text("the cat sat on the mat. " * 400)
    folders = {tokenizer: str(root / tokenizer) for tokenizer in ("bytes", "gpt2")}
    for tokenizer, folder in folders.items():
        data.main(["prepare", "--input", str(root / "text.txt"), "--out", folder, "--tokenizer", tokenizer])
    runs = {backend: str(root / backend) for backend in ("jaxtrain", "torchref")}
    for backend, out_dir in runs.items():
        _train(backend, config.load(small_args(out_dir, cache_dir, f"--data.path={folders['bytes']}",
                                               "--train.steps=4")))
    return runs, folders


def _train(backend: str, cfg):
    return (run.train if backend == "jaxtrain" else importlib.import_module("torchref.run").train)(cfg)


def _trained_from(out_dir: str, backend: str, old_dir: str, data_dir: str, fingerprint: bool) -> None:
    """The run's config.yaml and checkpoint as if trained from data_dir, the checkpoint with or without its data's
    fingerprint (one of before them): jaxtrain's meta, torchref's trainer_state.json."""
    with open(os.path.join(out_dir, "config.yaml")) as f:
        text = f.read()
    with open(os.path.join(out_dir, "config.yaml"), "w") as f:
        f.write(text.replace(old_dir, data_dir))
    step = os.path.join(out_dir, "checkpoints", "4")
    meta_file = os.path.join(step, "meta", "metadata") if backend == "jaxtrain" else f"{step}/trainer_state.json"
    with open(meta_file) as f:
        meta = json.load(f)
    meta["config"]["data"]["path"] = data_dir
    if not fingerprint:
        del meta["data_fingerprint"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("backend", ["jaxtrain", "torchref"])
@pytest.mark.parametrize("case", ["other data", "a checkpoint without its data's fingerprint", "fresh",
                                  "a first start", "the run's command with another data.path"])
def test_a_resume_on_data_with_more_tokens_names_the_data_not_the_vocab_size(byte_runs, tmp_path, cache_dir, backend,
                                                                            case):
    """config.yaml's model.vocab_size (256: bytes), its data folder prepared again as GPT-2 BPE: a resume says the
    data is not the data the run trained on, in both backends. It said to raise model.vocab_size, which the resume's
    config check then refused. A checkpoint from before data fingerprints (the data's path alone checked) is told
    the same once read; a fresh start has no other data to name, nor a first one: there the vocab_size's own refusal
    stands, before the end-of-run sample's (whose prompt has GPT-2 ids past 256), with nothing left behind. The
    run's own command with the GPT-2 folder (model.vocab_size null: 50257, the data's) was told that model.vocab_size
    changed, 256 -> 50257; the data is named first now."""
    runs, folders = byte_runs
    out_dir, data_dir = str(tmp_path / "run"), str(tmp_path / "data")
    if case == "the run's command with another data.path":
        shutil.copytree(runs[backend], out_dir)
        with pytest.raises(UserError, match=rf"^the data \({folders['gpt2']}\) differs from the data that wrote "
                                            rf"{out_dir}/checkpoints/4 \(data fingerprint "):
            _train(backend, config.load(small_args(out_dir, cache_dir, f"--data.path={folders['gpt2']}",
                                                   "--train.steps=4")))
        return
    if case == "a first start":
        with pytest.raises(UserError, match=r"^model.vocab_size=256 is smaller than the data's vocab_size=50257 \("):
            _train(backend, config.load(small_args(out_dir, cache_dir, f"--data.path={folders['gpt2']}",
                                                   "--model.vocab_size=256", "--log.sample_tokens=20")))
        assert not os.path.exists(out_dir)
        return
    shutil.copytree(runs[backend], out_dir)
    shutil.copytree(folders["gpt2"], data_dir)
    _trained_from(out_dir, backend, folders["bytes"], data_dir, case != "a checkpoint without its data's fingerprint")
    says = {"other data": rf"the data \({data_dir}\) differs from the data that wrote {out_dir}/checkpoints/4 "
                          rf"\(data fingerprint [0-9a-f]+ -> [0-9a-f]+: ",
            "fresh": r"model.vocab_size=256 is smaller than the data's vocab_size=50257 \(",
            }.get(case, rf"the data \({data_dir}\) has a vocabulary of 50257, larger than the model.vocab_size the "
                        rf"run in {out_dir} was trained with: it is not the data the run trained on \(its checkpoint "
                        rf"is older than data fingerprints")
    cfg = config.load(["--config", os.path.join(out_dir, "config.yaml"), f"--run.out_dir={out_dir}",
                       f"--run.fresh={str(case == 'fresh').lower()}"])
    with pytest.raises(UserError, match="^" + says):
        _train(backend, cfg)


def test_a_stray_init_from_on_resume_is_not_recorded(reference_run, tmp_path, cache_dir):
    """A resume given an init.from of another run warns it is not read, and config.yaml and the checkpoints saved
    after it keep the run's own (none): before, they recorded the stray one, and a later --run.fresh=true of that
    config.yaml started from the other run's state."""
    out_dir = str(tmp_path / "run")
    shutil.copytree(reference_run[0], out_dir)
    shutil.rmtree(os.path.join(out_dir, "checkpoints", "8"))
    run.train(config.load(small_args(out_dir, cache_dir, "--init.from=/another/run/checkpoint")))
    assert config.load(["--config", os.path.join(out_dir, "config.yaml")]).init.from_ is None
    meta = json.load(open(os.path.join(out_dir, "checkpoints", "8", "meta", "metadata")))
    assert meta["config"]["init"]["from"] is None
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(reference_run[0]))


def test_finished_run_does_nothing(reference_run, cache_dir):
    summary = run.train(config.load(small_args(reference_run[0], cache_dir)))
    assert summary == {"steps": 8}


def test_fresh_sets_previous_run_aside(reference_run, tmp_path, cache_dir):
    out_dir = str(tmp_path / "fresh")
    shutil.copytree(reference_run[0], out_dir)
    run.train(config.load(small_args(out_dir, cache_dir, "--run.fresh=true", "--train.steps=4",
                                     "--optim.warmup_steps=1")))
    names = os.listdir(out_dir)
    assert {"checkpoints", "metrics.jsonl"} <= {n.split(".before-fresh-")[0] for n in names if ".before-fresh-" in n}
    assert sorted(os.listdir(os.path.join(out_dir, "checkpoints"))) == ["4"]
    # run.fresh acted once: the saved config resumes this run, it does not set it aside again
    again = config.load(["--config", os.path.join(out_dir, "config.yaml")])
    assert not again.run.fresh and run.train(again) == {"steps": 4}
    assert sorted(os.listdir(out_dir)) == sorted(names)


def test_a_rematted_run_evaluates_and_saves(tmp_path, cache_dir):
    """model.remat=dots (gpt-1b.yaml's and pod-fsdp.yaml's) through a whole run: before, its first evaluation raised
    flax's TraceContextError, ahead of that step's save, at every restart."""
    out_dir = str(tmp_path / "remat")
    run.train(config.load(small_args(out_dir, cache_dir, "--model.remat=dots", "--train.steps=4")))
    assert [line["step"] for line in read_metrics(out_dir) if "eval_loss" in line] == [4]
    assert os.listdir(os.path.join(out_dir, "checkpoints")) == ["4"]


@pytest.mark.parametrize("refusal", ["init.from unreadable", "step does not fit"])
def test_a_refused_fresh_start_leaves_the_previous_run_to_resume(reference_run, tmp_path, cache_dir, monkeypatch,
                                                                 refusal):
    """run.fresh refused by an unreadable init.from, or by a step too large for the device (the last check, after
    compiling), moves nothing: the run folder stays byte for byte and the command without run.fresh resumes it at
    its last step, as it does the untouched reference run (before, the refusal came after its checkpoints and
    metrics were moved aside, and that command started at step 0)."""
    out_dir = str(tmp_path / "fresh")
    shutil.copytree(reference_run[0], out_dir)
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "model.safetensors").write_bytes(b"cut short")
    flags, says = [f"--init.from={damaged}"], r"damaged/model\.safetensors is missing or unreadable"
    if refusal == "step does not fit":
        def does_not_fit(*args):
            raise UserError("the train step needs 99 GiB per device")
        monkeypatch.setattr(run.dryrun, "check_fits", does_not_fit)
        flags, says = [], "needs 99 GiB"
    before = files_but_the_lock(out_dir)
    with pytest.raises(UserError, match=says):
        run.train(config.load(small_args(out_dir, cache_dir, "--run.fresh=true", *flags)))
    assert files_but_the_lock(out_dir) == before
    monkeypatch.undo()
    assert run.train(config.load(small_args(out_dir, cache_dir))) == run.train(
        config.load(small_args(reference_run[0], cache_dir))) == {"steps": 8}


def test_a_fresh_start_stopped_before_its_first_step_moves_nothing(reference_run, tmp_path, cache_dir, monkeypatch,
                                                                  capsys):
    """A signal during a fresh start's start-up stops it before the previous run is moved aside; the line says so
    and names the command that starts over (the same one, not a resume without run.fresh)."""
    out_dir = str(tmp_path / "fresh")
    shutil.copytree(reference_run[0], out_dir)
    before = files_but_the_lock(out_dir)

    def signalled(self):
        raise agreed_stop.StoppedInStartUp

    monkeypatch.setattr(agreed_stop.AgreedStop, "check_start_up", signalled)
    assert run.train(config.load(small_args(out_dir, cache_dir, "--run.fresh=true"))) == {"stopped": True}
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "stopped before the first step, nothing new to save; run.fresh has moved nothing aside yet: run the same "
        "command to start over")
    assert files_but_the_lock(out_dir) == before


class SavesThatFail:
    """A Checkpointer's failure look: the background failures it reports at each call, in turn."""

    def __init__(self, *failures):
        self.failures = list(failures)

    def background_failure(self):
        return self.failures.pop(0)

    def cannot_write(self, reason):
        return UserError(f"could not write ({reason})")


@pytest.mark.parametrize("several", [False, True])
def test_a_save_that_failed_ends_the_run_once_every_process_heard(several):
    """One process raises its failed save after the step it saw it at. Several vote on it with the stop flag, a step
    late as on a stop: every process raises after the next step (here one process, made to vote as one of several,
    is the collective's only voter), and a stop requested meanwhile does not save over it."""
    disk_full = UserError("could not write (disk full)")
    agreed = agreed_stop.AgreedStop(types.SimpleNamespace(requested=False), mesh_lib.one_device_mesh())
    agreed.several = several
    saves = SavesThatFail(None, disk_full, None, None)
    assert agreed.after_step(saves) is False
    if several:
        agreed.stop.requested = True
        assert agreed.after_step(saves) is False  # voted on now, read after the next step
    with pytest.raises(UserError) as failed:
        agreed.after_step(saves)
    assert failed.value is disk_full


def test_a_failure_voted_by_another_process_is_named_as_one():
    agreed = agreed_stop.AgreedStop(types.SimpleNamespace(requested=False), mesh_lib.one_device_mesh())
    agreed.several, agreed.vote = True, jax.numpy.array([False, True])  # another process's failure, read now
    with pytest.raises(UserError, match=r"^could not write \(on another process of this run; its error names "
                                        r"why\)$"):
        agreed.after_step(SavesThatFail(None))


def test_nan_loss_stops_with_a_clear_message(tmp_path, cache_dir):
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run",
                           *small_args(str(tmp_path / "nan"), cache_dir, "--optim.lr=1e30", "--optim.max_grad_norm=0")],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "training diverged" in proc.stderr and "Traceback" not in proc.stderr


def test_the_way_on_a_halt_names_is_one_that_runs(tmp_path, cache_dir, monkeypatch):
    """A run that diverges at step 3 (a NaN injected there) names how to go on from its newest checkpoint, 2, with a
    lower LR: a resume of the folder refuses the changed optim.lr (before, the message said "lower optim.lr, then
    run again", which that refusal followed); a new run from the converted checkpoint, as the message says, goes
    on at step 3 and to the end."""
    out_dir, new = str(tmp_path / "diverged"), str(tmp_path / "new")
    args = small_args(out_dir, cache_dir, "--checkpoint.every=2")
    monkeypatch.setattr(model, "apply", model.apply)  # put back after the test: poison_jaxtrain replaces it
    inject_nan.poison_jaxtrain(inject_nan.poisoned_inputs(args, [3]))
    with pytest.raises(UserError) as e:
        run.train(config.load(args))
    monkeypatch.undo()
    found = re.search(r"the newest checkpoint, step 2, .*: lower optim\.lr.* and go on from step 2 in a new run \(a "
                      r"resume of \S+ refuses the changed keys\): python -m jaxtrain\.convert to-torch (\S+) DST, "
                      r"then run with --init\.from=DST --run\.out_dir=NEW", str(e.value))
    assert found and found.group(1) == f"{out_dir}/checkpoints/2", str(e.value)
    with pytest.raises(UserError, match=r"optim.lr: 0.001 -> 0.0005"):
        run.train(config.load(small_args(out_dir, cache_dir, "--optim.lr=5e-4")))
    convert.main(["to-torch", found.group(1), str(tmp_path / "dst")])
    run.train(config.load(small_args(new, cache_dir, "--optim.lr=5e-4", f"--init.from={tmp_path / 'dst'}")))
    assert [line["step"] for line in read_metrics(new) if "loss" in line] == [3, 4, 5, 6, 7, 8]

def test_accumulation_keeps_every_step_loss(reference_run, tmp_path, cache_dir):
    """grad_accum_steps=4 at the same data.batch_size trains on the same sequences with the same gradient: every
    per-step loss matches accumulation 1 within fp32 rounding, and the schedule advanced once per window."""
    out_dir = str(tmp_path / "accum4")
    run.train(config.load(small_args(out_dir, cache_dir, "--optim.grad_accum_steps=4")))
    accum4, accum1 = read_metrics(out_dir), read_metrics(reference_run[0])
    assert [line["step"] for line in accum4] == [line["step"] for line in accum1]
    assert [line.get("lr") for line in accum4] == [line.get("lr") for line in accum1]
    # fp32: summation order differs (4 partial sums vs one), a few ulps per step, compounded over 8 Adam steps.
    for a, b in zip(accum4, accum1):
        key = "loss" if "loss" in a else "eval_loss"
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=0), (a["step"], key)


@pytest.mark.parametrize("clip,levers", [(1.0, "lower optim.lr or lengthen optim.warmup_steps"),
                                         (0.0, "lower optim.lr, lengthen optim.warmup_steps or set "
                                               "optim.max_grad_norm")])
def test_a_halt_names_clipping_only_where_it_is_off(clip, levers):
    cfg = config.load(["--config", "configs/tiny.yaml", f"--optim.max_grad_norm={clip}"])
    divergence = Divergence(cfg, lambda: 2, "jaxtrain", 0)
    with pytest.raises(UserError) as e:
        divergence.check({"step": 3, "loss": float("nan"), "grad_norm": float("nan")})
    assert f": {levers}, " in str(e.value) or f": {levers} and" in str(e.value), str(e.value)


@pytest.mark.parametrize("skipped_before", [0, 3])
def test_a_skip_at_the_first_step_of_a_process_counts(skipped_before):
    """nan_policy=skip counts a skipped update at a run's first step, and at a resumed run's (whose state already
    skipped some): with nan_skip_limit=1 that one skip halts."""
    cfg = config.load(["--config", "configs/tiny.yaml", "--train.nan_policy=skip", "--train.nan_skip_limit=1"])
    divergence = Divergence(cfg, lambda: 2, "jaxtrain", skipped_before)
    with pytest.raises(UserError, match="1 updates in a row were skipped"):
        divergence.check({"step": 3, "loss": float("nan"), "grad_norm": float("nan"), "skipped": skipped_before + 1})


def test_the_summary_gives_mfu_at_its_own_tokens_per_s(tmp_path, cache_dir):
    """The summary's tokens_per_s is the run's mean; its mfu is taken at that rate, not the last line's."""
    out_dir = str(tmp_path / "mfu")
    summary = run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3", "--checkpoint.every=1",
                                               "--log.peak_tflops=1e-3")))
    last = [line for line in read_metrics(out_dir) if "loss" in line][-1]
    # mfu is tokens_per_s times one constant (FLOPs per token over the peak); rel: the two divisions' rounding
    assert summary["mfu"] / summary["tokens_per_s"] == pytest.approx(last["mfu"] / last["tokens_per_s"], rel=1e-12)


def test_building_the_eval_set_is_not_the_first_steps_time(tmp_path, cache_dir, monkeypatch):
    """The loop builds the eval batches once before step 1: 2 s of it (a large eval set read from its memmap) were
    step 1's tokens_per_s, as torchref's are not. Bound: a step of the test's model, milliseconds, far below 1 s."""
    out_dir, real_eval_batches = str(tmp_path / "run"), run.Trainer.eval_batches

    def slow_eval_batches(self):
        time.sleep(2.0)
        return real_eval_batches(self)

    monkeypatch.setattr(run.Trainer, "eval_batches", slow_eval_batches)
    run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3")))
    first = [line for line in read_metrics(out_dir) if "loss" in line][0]
    assert first["tokens"] / first["tokens_per_s"] < 1.0, first


def test_a_new_run_from_a_training_state_counts_on_from_its_tokens(tmp_path, cache_dir):
    """init.from's full state trained 4 steps of 8 x 32 tokens; a new run from it at data.batch_size=16 counts on
    from those 1,024 tokens (torchref does too), not from 4 of its own larger windows. Its folder held the lines of
    an attempt that saved no checkpoint: the run's metrics.jsonl holds none of them (jaxtrain kept those up to
    init.from's step 4, torchref none)."""
    first, new = str(tmp_path / "first"), str(tmp_path / "new")
    run.train(config.load(small_args(first, cache_dir, "--train.steps=4")))
    convert.main(["to-torch", f"{first}/checkpoints/4", str(tmp_path / "dst")])
    os.makedirs(new)
    with open(os.path.join(new, "metrics.jsonl"), "w") as f:
        f.writelines(f'{{"step": {s}, "loss": 99.0, "tokens": 1}}\n' for s in (1, 2, 3))
    run.train(config.load(small_args(new, cache_dir, "--data.batch_size=16", f"--init.from={tmp_path / 'dst'}")))
    assert [line["tokens"] for line in read_metrics(new) if "loss" in line] == [4 * 8 * 32 + s * 16 * 32
                                                                               for s in (1, 2, 3, 4)]


def test_a_resumed_run_counts_on_from_its_checkpoints_tokens(tmp_path, cache_dir):
    """A new run from init.from's state of 4 steps of 8 x 32 tokens, at data.batch_size=16, saved at step 6; its
    metrics.jsonl lost (as when a stop comes before a run's first line, log.every beyond the save): resumed, it
    counts on from the checkpoint's 4 x 8 x 32 + 2 x 16 x 32 tokens, not from 6 of its own windows."""
    first, new = str(tmp_path / "first"), str(tmp_path / "new")
    run.train(config.load(small_args(first, cache_dir, "--train.steps=4")))
    convert.main(["to-torch", f"{first}/checkpoints/4", str(tmp_path / "dst")])
    from_state = small_args(new, cache_dir, "--data.batch_size=16", f"--init.from={tmp_path / 'dst'}",
                            "--optim.decay_steps=8")  # the schedule of train.steps=8 in the run stopped at 6
    run.train(config.load(from_state + ["--train.steps=6"]))
    os.remove(os.path.join(new, "metrics.jsonl"))
    run.train(config.load(from_state))
    assert [line["tokens"] for line in read_metrics(new) if "loss" in line] == [4 * 8 * 32 + s * 16 * 32
                                                                               for s in (3, 4)]
