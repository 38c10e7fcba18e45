"""run.out_dir=gs://... against a GCS emulator on 127.0.0.1 (tests/gcs_emulator.py): a run killed with -9 and
started again with the same command ends bit for bit where the same run on a local disk ends (params, AdamW's
moments, every metrics line); keep-K, TensorBoard, the lease lock and the corruption fallback work there too."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath
from safetensors import safe_open

from test_output_paths import check_a_killed_set_aside_is_finished_under_its_stamp
from test_run import final_params, read_metrics, small_args, without_timing
from jaxtrain import config, convert, evaluate, run, runfolder, sample

# 200 steps with a save every 10: the run is killed once its step-20 checkpoint is committed, far from the end.
ARGS = ("--train.steps=200", "--checkpoint.every=10", "--checkpoint.max_to_keep=2", "--train.eval_every=50",
        "--log.tensorboard=true", "--run.lock_timeout_s=3")
TIME_LIMIT_S = 240  # bounded: a hang fails the test instead of stalling CI


@pytest.mark.slow
def test_a_gs_run_killed_and_resumed_matches_a_local_run_bit_for_bit(gcs, tmp_path, cache_dir):
    local, remote = str(tmp_path / "local"), f"{gcs()}/runs/remote"
    run.train(config.load(small_args(local, cache_dir, *ARGS)))
    cmd = [sys.executable, "-m", "jaxtrain.run", *small_args(remote, cache_dir, *ARGS)]
    deadline = time.monotonic() + TIME_LIMIT_S
    with open(tmp_path / "killed.txt", "w") as err:
        killed = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        while not epath.Path(f"{remote}/checkpoints/20/commit_success.txt").exists():
            assert killed.poll() is None and time.monotonic() < deadline, open(tmp_path / "killed.txt").read()
            time.sleep(0.05)
        killed.kill()
        assert killed.wait() == -9
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr
    assert "took over the lock of a run that stopped renewing it" in resumed.stderr  # the killed run's lease
    assert "resuming from step " in resumed.stderr, resumed.stderr

    lines = [json.loads(line) for line in epath.Path(f"{remote}/metrics.jsonl").read_text().splitlines()]
    assert without_timing(lines) == without_timing(read_metrics(local))
    for a, b in zip(final_params(remote, cache_dir, *ARGS), final_params(local, cache_dir, *ARGS)):
        assert np.array_equal(a, b)
    folder = epath.Path(remote)
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["190", "200"]  # keep-K, nothing else
    assert not (folder / ".lock").exists()  # released at the end
    assert config.load(["--config", os.fspath(folder / "config.yaml")]).run.out_dir == remote
    assert [p.name for p in (folder / "tb").iterdir() if p.name.startswith("events.out.tfevents")]


@pytest.mark.slow
def test_a_corrupt_gs_checkpoint_is_moved_aside_and_the_run_falls_back(gcs, tmp_path, cache_dir):
    """The newest checkpoint's array data overwritten: the same command moves it, whole, to checkpoints.corrupt,
    resumes from the one before and ends where the run ended before."""
    extra = ("--train.steps=20", "--checkpoint.every=10", "--train.eval_every=10", "--log.tensorboard=false")
    remote = f"{gcs()}/run"
    run.train(config.load(small_args(remote, cache_dir, *extra)))
    before = final_params(remote, cache_dir, *extra)
    step = epath.Path(f"{remote}/checkpoints/20")
    data = max((p for p in step.glob("state/ocdbt.process_0/d/*")), key=lambda p: len(p.read_bytes()))
    data.write_bytes(b"\0" * len(data.read_bytes()))
    again = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(remote, cache_dir, *extra)],
                           capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert again.returncode == 0, again.stderr
    assert "resuming from step 10" in again.stderr and "moved it to gs://" in again.stderr, again.stderr
    moved = list(epath.Path(f"{remote}/checkpoints.corrupt").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["20"]
    assert (moved[0] / "state").exists()  # moved whole
    for a, b in zip(final_params(remote, cache_dir, *extra), before):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_fresh_sets_the_previous_run_aside_in_a_bucket(gcs, monkeypatch):
    """runfolder.set_aside_previous_run on gs://, where a folder is only a prefix and a move copies each object:
    two fresh starts in one second (the stamp frozen) keep both previous runs, whole."""
    monkeypatch.setattr(runfolder.time, "strftime", lambda fmt: "20261125-010203")
    folder = epath.Path(f"{gcs()}/run")
    for label in ("first", "second"):
        for name in ("checkpoints/4/state/data", "metrics.jsonl", "tb/events", "config.yaml"):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(label)
        runfolder.set_aside_previous_run(os.fspath(folder))
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.yaml"] + [
        f"{name}.before-fresh-20261125-010203{count}"
        for name in ("checkpoints", "config.yaml", "metrics.jsonl", "tb") for count in ("", "-1")])
    for count, label in (("", "first"), ("-1", "second")):
        assert (folder / f"checkpoints.before-fresh-20261125-010203{count}/4/state/data").read_text() == label
        assert (folder / f"tb.before-fresh-20261125-010203{count}/events").read_text() == label


@pytest.mark.slow
def test_a_set_aside_killed_inside_a_folder_is_finished_under_its_stamp(gcs, monkeypatch):
    """In a bucket a folder moves an object at a time: killed after two of the checkpoints' four objects, the next
    fresh start moves the other two into the same checkpoints.before-fresh-<stamp>, not into a folder below it
    (fsspec's recursive mv onto an existing prefix) nor under a second stamp."""
    left = check_a_killed_set_aside_is_finished_under_its_stamp(gcs(), monkeypatch)
    moved = [name for name in left if name.startswith("/checkpoints.before-fresh-20261128-093000/")]
    still = [name for name in left if name.startswith("/checkpoints/")]
    assert (len(moved), len(still)) == (2, 2) and "/metrics.jsonl" in left, sorted(left)


def test_a_bucket_that_does_not_exist_is_one_line(gcs, cache_dir):
    """run.out_dir in a bucket nobody created (the emulator answers 404, as GCS does): one line naming the bucket
    and the fix, exit 2. It was two tracebacks ending in Google's NotFound, from the lease's first write."""
    gcs()  # the emulator running, with buckets of other names
    cmd = [sys.executable, "-m", "jaxtrain.run", *small_args("gs://no-such-bucket/run", cache_dir)]
    missing = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr == ("error: run.out_dir's bucket gs://no-such-bucket does not exist; create it (gcloud "
                              "storage buckets create gs://no-such-bucket) or fix run.out_dir\n")


def test_evaluate_sample_and_convert_read_a_run_in_a_bucket(gcs, tmp_path, cache_dir, capsys):
    """A pod's run folder in a bucket (run.out_dir=gs://...) is read where it is, as a resume reads it: evaluate
    --run scores what the run logged, bit for bit; to-torch and to-hf of its step folder write what they write of a
    local one (the same tensors); sample --run continues a prompt as sample --from to-torch's folder does. What a
    bucket cannot hold for these commands is refused in one line."""
    remote = f"{gcs()}/runs/tiny"
    run.train(config.load(small_args(remote, cache_dir)))
    logged = [json.loads(line) for line in epath.Path(f"{remote}/metrics.jsonl").read_text().splitlines()]
    eval_8 = next(line for line in logged if line["step"] == 8 and "eval_loss" in line)
    for where in (["--run", remote], ["--from", f"{remote}/checkpoints/8"]):
        capsys.readouterr()
        evaluate.main(where)
        line = json.loads(capsys.readouterr().out)
        assert (line["eval_loss"], line["eval_accuracy"], line["step"]) == (eval_8["eval_loss"],
                                                                            eval_8["eval_accuracy"], 8), where
    convert.main(["to-torch", f"{remote}/checkpoints/8", str(tmp_path / "torch")])
    convert.main(["to-hf", f"{remote}/checkpoints/8", str(tmp_path / "hf")])
    with safe_open(str(tmp_path / "torch" / "model.safetensors"), "np") as torch_file, \
            safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as hf_file:
        wte = "transformer.wte.weight"  # the same in both layouts (Conv1D's transpose is of the blocks' weights)
        assert np.array_equal(torch_file.get_tensor(wte), hf_file.get_tensor(wte))
    texts = []
    for where in (["--run", remote], ["--from", str(tmp_path / "torch")]):
        capsys.readouterr()
        sample.main([*where, "--prompt", "def ", "--temperature", "0", "--max_new_tokens", "12"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("def "), texts
    step_4, step_8 = f"{remote}/checkpoints/4", f"{remote}/checkpoints/8"
    for command, argv, says in [  # named as on a disk, with the steps the run holds
            (evaluate.main, ["--run", f"{remote}-none"], f"--run {remote}-none does not exist"),
            (evaluate.main, ["--run", step_8], f"--run {step_8} is a checkpoint step folder, not a run folder; pass "
                                               f"--run {remote} --step 8"),
            (evaluate.main, ["--from", remote], f"evaluate --from {remote} is a jaxtrain run folder; pass one of its "
                                                f"step folders, e.g. {step_8}"),
            (convert.main, ["to-torch", f"{remote}/checkpoints", str(tmp_path / "t2")],
             f"to-torch SRC {remote}/checkpoints is a run's checkpoints folder, holding steps 4, 8; pass one of "
             f"those, e.g. {step_8}"),
            (convert.main, ["to-hf", f"{remote}/checkpoints/6", str(tmp_path / "t2")],
             f"to-hf SRC {remote}/checkpoints/6 does not exist: its run holds steps 4, 8"),
            (sample.main, ["--run", "https://storage.googleapis.com/b/run"], "--run https://storage.googleapis.com/b/"
                                                                            "run is not a folder jaxtrain reads"),
            (convert.main, ["from-hf", remote, str(tmp_path / "t3")], f"SRC {remote} is a URL")]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            command(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    state = epath.Path(step_8) / "state"  # its largest array file zeroed: the fingerprint check refuses it
    data = max((p for p in state.glob("ocdbt.process_0/d/*")), key=lambda p: len(p.read_bytes()))
    data.write_bytes(b"\0" * len(data.read_bytes()))
    with pytest.raises(SystemExit):
        convert.main(["to-torch", step_8, str(tmp_path / "t4")])
    err = capsys.readouterr().err
    assert f"checkpoint {step_8}" in err and f"convert another step folder of the run ({step_4})" in err, err
