"""Weights & Biases (log.wandb=true, jaxtrain/wandb_log.py), all offline: one W&B run per run folder, each step once
and in order across a Ctrl-C and a resume, the values of metrics.jsonl. W&B's offline files are read back with
wandb's own reader (`wandb leet inspect --json`, the transaction log's records as JSON lines); the expectation is
metrics.jsonl, written by other code."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from test_preemption import wait_for
from test_run import read_metrics, small_args
from jaxtrain import config, run, wandb_log
from jaxtrain.errors import UserError
from torchref import run as torchref_run

pytestmark = pytest.mark.usefixtures("wandb_offline")

WANDB = ("--log.wandb=true",)
STEPS_300 = ("--train.steps=300", "--checkpoint.every=100", "--train.eval_every=100")  # ~5 s: a signal lands mid-run
EVAL_EVERY_2 = ("--optim.decay_steps=8", "--train.eval_every=2")  # the same schedule and evals for 6 or 8 steps


def wandb_records(out_dir) -> list[list[dict]]:
    """The records of each offline W&B run in <out_dir>/wandb (one per process), in the order the processes
    started, as `wandb leet inspect --json` prints them."""
    runs = []
    for folder in (out_dir / "wandb").glob("offline-run-*"):
        [log] = folder.glob("run-*.wandb")
        printed = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                                 capture_output=True, text=True, check=True).stdout
        runs.append([json.loads(line) for line in printed.splitlines()])
    return sorted(runs, key=lambda records: next(r["run"]["start_time"] for r in records if r["type"] == "run"))


def run_ids(runs) -> list[str]:
    return [next(r["run"]["run_id"] for r in records if r["type"] == "run") for records in runs]


def history(runs) -> list[dict]:
    """Every history row of every process, in order: _step and the logged fields, W&B's own (_runtime,
    _timestamp) left out."""
    return [{k: v for k, v in r["history"]["item"].items() if k == "_step" or not k.startswith("_")}
            for records in runs for r in records if r["type"] == "history"]


def expected_rows(lines) -> list[dict]:
    """metrics.jsonl's lines as W&B rows: one row per step, train fields under train/, eval_loss and eval_accuracy
    as they are, mfu (null on a CPU) absent."""
    rows = {}
    for line in lines:
        row = rows.setdefault(line["step"], {"_step": line["step"]})
        row.update({k if k in ("eval_loss", "eval_accuracy") else f"train/{k}": v for k, v in line.items()
                    if k != "step" and v is not None})
    return list(rows.values())


def logged_lines(out_dir) -> int:
    path = out_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_a_run_stopped_by_ctrl_c_and_resumed_is_one_wandb_run_with_each_step_once(tmp_path, cache_dir):
    """Ctrl-C as a terminal sends it, to the whole process group (wandb-core included, were it in the group),
    mid-run; then the same command to the end. Two processes, one run id (the one in wandb.json), steps 1..300 once
    each and in order, every value equal to metrics.jsonl's."""
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "-u", "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, *STEPS_300, *WANDB)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for(proc, "compiled the train step")
    deadline = time.monotonic() + 600
    while proc.poll() is None and logged_lines(out_dir) <= 100:  # past the first checkpoint: a real resume
        assert time.monotonic() < deadline, f"fewer than 101 lines in {out_dir}/metrics.jsonl after 600 s"
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 0 and "Traceback" not in err, err
    saved = int(err.split("saved step ")[1].split(";")[0])
    assert 100 <= saved < 300, saved
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0 and f"resuming from step {saved}" in resumed.stderr, resumed.stderr

    runs = wandb_records(out_dir)
    assert len(runs) == 2
    assert run_ids(runs) == [json.loads((out_dir / "wandb.json").read_text())["id"]] * 2
    rows = history(runs)
    assert [row["_step"] for row in rows] == list(range(1, 301))
    assert rows == expected_rows(read_metrics(out_dir))


@pytest.mark.parametrize("backend", [run, torchref_run], ids=["jaxtrain", "torchref"])
def test_steps_logged_past_the_last_checkpoint_are_not_logged_again(tmp_path, cache_dir, capsys, backend):
    """A process that logged steps 5 and 6 and died before saving step 6 (its checkpoint removed): the resumed
    process trains 5 and 6 again and rewrites them in metrics.jsonl, but W&B, which has them, gets only 7 and 8.
    The values W&B keeps for 5 and 6 are the first process's: the same, timing aside, in a bit-exact resume."""
    out_dir = tmp_path / "run"
    backend.train(config.load(small_args(out_dir, cache_dir, "--train.steps=6", *EVAL_EVERY_2, *WANDB)))
    shutil.rmtree(out_dir / "checkpoints" / "6")
    backend.train(config.load(small_args(out_dir, cache_dir, "--train.steps=8", *EVAL_EVERY_2, *WANDB)))
    assert "resuming from step 4 " in capsys.readouterr().err

    runs = wandb_records(out_dir)
    assert len(set(run_ids(runs))) == 1 and len(runs) == 2
    assert [[row["_step"] for row in history([records])] for records in runs] == [[1, 2, 3, 4, 5, 6], [7, 8]]
    timing = ("train/tokens_per_s",)
    assert [{k: v for k, v in row.items() if k not in timing} for row in history(runs)] == \
        [{k: v for k, v in row.items() if k not in timing} for row in expected_rows(read_metrics(out_dir))]


def test_fresh_starts_a_new_wandb_run_and_sets_the_old_one_aside(tmp_path, cache_dir):
    out_dir = tmp_path / "run"
    run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3", *WANDB)))
    first_id = json.loads((out_dir / "wandb.json").read_text())["id"]
    run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3", "--run.fresh=true", *WANDB)))
    [moved] = out_dir.glob("wandb.json.*")
    assert json.loads(moved.read_text())["id"] == first_id
    runs = wandb_records(out_dir)
    assert run_ids(runs) == [json.loads((out_dir / "wandb.json").read_text())["id"]] != [first_id]
    assert [row["_step"] for row in history(runs)] == [1, 2, 3]


@pytest.mark.parametrize("backend", [run, torchref_run], ids=["jaxtrain", "torchref"])
def test_a_start_that_resumes_no_checkpoint_logs_to_a_new_wandb_run(tmp_path, cache_dir, capsys, backend):
    """An attempt that logged steps 1..3 and saved no checkpoint (removed), then another at another learning rate:
    metrics.jsonl starts over, and so does W&B, in a run of its own with steps 1..4. It went on in the first one,
    skipping steps 1..3 and putting 4 after the other learning rate's 3."""
    out_dir = tmp_path / "run"
    backend.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3", "--optim.decay_steps=8", *WANDB)))
    first_id = json.loads((out_dir / "wandb.json").read_text())["id"]
    shutil.rmtree(out_dir / "checkpoints")
    capsys.readouterr()
    backend.train(config.load(small_args(out_dir, cache_dir, "--train.steps=4", "--optim.decay_steps=8",
                                         "--optim.lr=1e-4", *WANDB)))
    assert (f"W&B: this start resumes no checkpoint of {out_dir}, so it logs to a new W&B run; the earlier "
            f"attempt's steps stay in W&B run {first_id}") in capsys.readouterr().err
    runs = wandb_records(out_dir)
    second_id = json.loads((out_dir / "wandb.json").read_text())["id"]
    assert run_ids(runs) == [first_id, second_id] and second_id != first_id
    assert [[row["_step"] for row in history([records])] for records in runs] == [[1, 2, 3], [1, 2, 3, 4]]
    assert history(runs[1:]) == expected_rows(read_metrics(out_dir))


@pytest.mark.parametrize("backend", [run, torchref_run], ids=["jaxtrain", "torchref"])
def test_a_wandb_failure_mid_run_is_one_warning_and_the_run_trains_on(tmp_path, cache_dir, capsys, monkeypatch,
                                                                        backend):
    """W&B's log raising at step 3 as it does once wandb-core is gone (ConnectionResetError): the run ended there in a
    traceback, exit 1, losing the steps since its last checkpoint. Now one warning; the run trains to its end, saves,
    and W&B keeps steps 1 and 2."""
    start = wandb_log._start

    def start_failing_at_step_3(cfg, run_id):
        wandb_run, log = start(cfg, run_id), None
        log = wandb_run.log

        def failing_log(row, step, commit):
            if step >= 3:
                raise ConnectionResetError("Connection lost")
            return log(row, step=step, commit=commit)

        wandb_run.log = failing_log
        return wandb_run

    monkeypatch.setattr(wandb_log, "_start", start_failing_at_step_3)
    out_dir = tmp_path / "run"
    backend.train(config.load(small_args(out_dir, cache_dir, "--train.steps=6", *EVAL_EVERY_2, *WANDB)))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "W&B" in line]
    assert warnings == ["warning: W&B failed (ConnectionResetError: Connection lost); the run goes on without it, "
                        "which holds the steps up to 2 (metrics.jsonl holds every step)"]
    assert [line["step"] for line in read_metrics(out_dir) if "loss" in line] == list(range(1, 7))
    assert "6" in os.listdir(out_dir / "checkpoints")  # the run saved its last step
    assert [row["_step"] for row in history(wandb_records(out_dir))] == [1, 2]


def test_wandb_disabled_from_the_environment_records_no_wandb_run(tmp_path, cache_dir, monkeypatch):
    """WANDB_MODE=disabled: wandb's stand-in run has an id, which wandb.json kept; a later start with W&B on then
    continued a run that never existed, skipping the steps trained meanwhile."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    out_dir = tmp_path / "run"
    run.train(config.load(small_args(out_dir, cache_dir, "--train.steps=3", *WANDB)))
    assert not (out_dir / "wandb.json").exists() and not (out_dir / "wandb").exists()
    (out_dir / "wandb.json").write_text("{}")  # damaged: refused where W&B logs, not read where it does not
    wandb_log.WandbLog(config.load(small_args(out_dir, cache_dir, *WANDB)), start_step=3, resumed=True,
                       last_jsonl_step=3).close()
    assert (out_dir / "wandb.json").read_text() == "{}"


def test_online_without_an_api_key_logs_offline_and_says_so_in_one_line(tmp_path, cache_dir):
    """No API key (the session's W&B environment has none, and no netrc): wandb.init refuses to start online
    before it contacts anything; the run logs offline instead, with one line saying so, and trains to the end."""
    out_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.run", *small_args(
        out_dir, cache_dir, "--train.steps=3", "--log.wandb_mode=online", *WANDB)], capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "W&B could not start online" in line]
    assert len(said) == 1 and "No API key configured" in said[0] and "offline" in said[0], proc.stderr
    assert [row["_step"] for row in history(wandb_records(out_dir))] == [1, 2, 3]


@pytest.mark.parametrize("content", [b"", b"{}", b"[1]", b'{"id": 5}', b'{"id": ""}', b"\xff"])
def test_a_damaged_wandb_json_is_named_before_wandb_starts(tmp_path, content):
    """Read by both backends (their metrics loggers make a WandbLog), before W&B is imported."""
    (tmp_path / "wandb.json").write_bytes(content)
    cfg = config.load([f"--run.out_dir={tmp_path}", "--log.wandb=true", "--log.tensorboard=false",
                       "--log.progress=false", "--model.vocab_size=256"])
    with pytest.raises(UserError) as e:
        wandb_log.WandbLog(cfg, start_step=0, resumed=False, last_jsonl_step=None)
    assert str(e.value).startswith(f"{tmp_path}/wandb.json is damaged: it holds the id of this run folder's W&B run, "
                                   f"as {{\"id\": \"<id>\"}}; write the id back")
    assert str(e.value).endswith("or move the file aside to log to a new W&B run")
    assert (tmp_path / "wandb.json").read_bytes() == content and not (tmp_path / "wandb").exists()


def test_without_the_package_one_line_names_the_fix_and_nothing_starts(tmp_path, cache_dir):
    out_dir = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None\n"  # what `import wandb` meets where it is not installed
            "from jaxtrain import run; run.main(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, *small_args(out_dir, cache_dir, *WANDB)],
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: log.wandb=true needs the wandb package") and "pip install 'jaxtrain[wandb]'" in line
    assert not out_dir.exists()


@pytest.mark.parametrize("overrides, env, words", [
    (["--log.wandb_project=team/proj"], {}, "log.wandb_project='team/proj' is not one W&B takes (Invalid project"),
    ([f"--log.wandb_project={'p' * 129}"], {}, "exceeded 128 characters"),
    ([], {"WANDB_MODE": "garbage"}, "WANDB_MODE='garbage' is not one W&B takes (Input should be 'online'"),
])
def test_a_project_or_mode_wandb_refuses_is_one_line_before_anything_starts(tmp_path, monkeypatch, overrides, env,
                                                                            words):
    """wandb.init refused them after the step compiled: a ValidationError or UsageError traceback, exit 1, and a
    run folder left with config.yaml and a lock. Now wandb's own Settings judges them when the config loads."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match=re.escape(words)):
        config.load(["--config", "configs/tiny.yaml", "--log.wandb=true", f"--run.out_dir={tmp_path / 'run'}",
                     *overrides])
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WANDB_MODE", "garbage")  # the config's own mode stands over the environment's
    assert config.load(["--config", "configs/tiny.yaml", "--log.wandb=true", "--log.wandb_mode=offline"]).log.wandb


def test_what_wandb_may_hold_outlives_a_resume_that_stopped_before_it(tmp_path, cache_dir):
    """A process sent steps 1..6 and died with checkpoint 4 its newest; the next resumed at 4, cut metrics.jsonl
    back to step 4 and stopped (Ctrl-C) before step 5; the third resumed at 4 too. metrics.jsonl no longer says that
    W&B has 5 and 6: the third sent them again (a reviewer's run: steps 42-45 twice). wandb.json keeps the mark."""
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    cfg = config.load(small_args(out_dir, cache_dir, *WANDB))
    first = wandb_log.WandbLog(cfg, start_step=0, resumed=False, last_jsonl_step=None)
    for step in range(1, 7):
        first.log(step, {"train/loss": float(step)})
    first.close()
    wandb_log.WandbLog(cfg, start_step=4, resumed=True, last_jsonl_step=6).close()  # metrics.jsonl: 1..6, cut to 4
    third = wandb_log.WandbLog(cfg, start_step=4, resumed=True, last_jsonl_step=4)
    for step in range(5, 9):
        third.log(step, {"train/loss": 10.0 + step})
    third.close()
    runs = wandb_records(out_dir)
    assert [[row["_step"] for row in history([records])] for records in runs] == [[1, 2, 3, 4, 5, 6], [], [7, 8]]
    assert len(set(run_ids(runs))) == 1
