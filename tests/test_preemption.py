"""Stopping on a signal (jaxtrain.preemption): SIGTERM and Ctrl-C save the step in flight and exit 0, on every
process the same step; a second signal stops at once; a signal during start-up stops it. Every case then resumes
with the same command to the uninterrupted run's metrics and params, bit for bit."""

import os
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from processes import finish, start_processes
from test_mesh import SMALL
from test_run import final_params, read_metrics, small_args, without_timing
from jaxtrain import checkpoint, config, preemption, run

# Long enough (~10 s here) that a signal 1 s after compilation lands mid-run.
LONG = ("--train.steps=600", "--checkpoint.every=200", "--train.eval_every=200")


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("straight"))
    run.train(config.load(small_args(out_dir, cache_dir, *LONG)))
    return out_dir


def start(out_dir, cache_dir, *extra, env=None):
    cmd = [sys.executable, "-u", "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, *LONG, *extra)]
    return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env), cmd


def wait_for(proc, words: str, timeout_s: float = 600) -> str:
    """stderr up to the first line holding `words`; a process that has not printed it within `timeout_s` is killed
    (its stderr then ends) and the test fails."""
    seen, killer = "", threading.Timer(timeout_s, proc.kill)
    killer.start()
    try:
        for line in proc.stderr:
            seen += line
            if words in line:
                return seen
    finally:
        killer.cancel()
    raise AssertionError(f"never printed {words!r} (or not within {timeout_s} s):\n{seen}")


def train_steps(out_dir) -> list[int]:
    """The steps of metrics.jsonl's training lines (log.every=1), eval lines left out."""
    return [line["step"] for line in read_metrics(out_dir) if "loss" in line]


def assert_resumes_to(out_dir, cache_dir, straight_dir, command=None):
    """`command` (default: the one that started the run) ends where the uninterrupted run ended, bit for bit."""
    command = command or [sys.executable, "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, *LONG)]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert not [n for n in os.listdir(os.path.join(out_dir, "checkpoints")) if "tmp" in n]
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(straight_dir))
    for a, b in zip(final_params(out_dir, cache_dir, *LONG), final_params(straight_dir, cache_dir, *LONG)):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_step_in_flight_and_resumes_bitwise(tmp_path, cache_dir, straight, signum):
    out_dir = str(tmp_path / "stopped")
    proc, _ = start(out_dir, cache_dir, "--log.sample_tokens=5")  # a stopped run prints no sample
    wait_for(proc, "compiled the train step")
    time.sleep(1.0)
    logged = len(train_steps(out_dir))  # steps go on between this read and the signal: a bound below, not above
    proc.send_signal(signum)
    err = proc.stderr.read()
    assert proc.wait() == 0 and "Traceback" not in err, err
    saved = int(err.split("saved step ")[1].split(";")[0])
    assert err.splitlines()[-1] == (f"saved step {saved}; run the same command to resume, or python -m jaxtrain.run "
                                    f"--config {out_dir}/config.yaml")
    assert "sample (" not in err
    assert logged <= saved < 600, (logged, saved)
    # The step in flight was finished, logged and saved, and none after it was logged: each step once, up to it.
    assert train_steps(out_dir) == list(range(1, saved + 1)), saved
    assert os.path.isdir(os.path.join(out_dir, "checkpoints", str(saved)))
    # Resumed by the line's own command: the run's config.yaml, without the command that started it
    assert_resumes_to(out_dir, cache_dir, straight, [sys.executable, *shlex.split(err.split(", or python")[1])])


@pytest.mark.parametrize("delay", [0.3, 2.5], ids=["during-imports", "during-start-up"])
def test_ctrl_c_during_start_up_stops_cleanly(tmp_path, cache_dir, straight, delay):
    out_dir = str(tmp_path / "early")
    proc, _ = start(out_dir, cache_dir)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait() == 0 and "Traceback" not in err and "Exception ignored" not in err, err
    assert "stopped before the first step" in err or "saved step" in err, err  # a slow start may reach step 1
    if "stopped before the first step" in err:  # no step was in flight: the first line said so too
        assert "SIGINT: stopping at the end of this start-up phase, before the first step" in err, err
    assert_resumes_to(out_dir, cache_dir, straight)


def test_ctrl_c_stops_a_dry_run_at_once(tmp_path, cache_dir):
    """A dry run has no step to save: Ctrl-C stops it then, not after a compile that may take minutes, and not with
    exit 0, which would read as a config that fits."""
    cmd = [sys.executable, "-u", "-m", "jaxtrain.run", *small_args(str(tmp_path / "dry"), cache_dir),
           "--run.dry_run=true"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # in the imports, as test_ctrl_c_during_start_up_stops_cleanly's first case
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    assert "SIGINT: stopping now; a dry run trains and saves nothing" in err and "dry run:" not in out, (out, err)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_stops_at_once_and_the_next_start_resumes(tmp_path, cache_dir, straight, signum):
    """The second signal lands in the step or the save the first one asked for: exit 128 + signal at once (or 0
    when the save won the race), one line, no traceback; a cut save is no checkpoint, and the next start cleans it
    up."""
    out_dir = str(tmp_path / "twice")
    proc, _ = start(out_dir, cache_dir)
    wait_for(proc, "compiled the train step")
    time.sleep(1.0)
    proc.send_signal(signum)
    wait_for(proc, f"{signal.Signals(signum).name}: stopping")
    proc.send_signal(signum)
    err = proc.stderr.read()
    assert proc.wait() in (0, 128 + signum) and "Traceback" not in err, err
    assert_resumes_to(out_dir, cache_dir, straight)


def wait_for_a_logged_step(out_dir, timeout_s: float = 300.0) -> None:
    """Until metrics.jsonl holds a step (written one step late, by process 0, once every process voted to go on
    past start-up), polling every 50 ms. A fixed sleep after process 0's compilation was not enough: with the
    compilation cache warm, process 1 was still in start-up 1 s later, and both stopped before the first step."""
    metrics, deadline = os.path.join(out_dir, "metrics.jsonl"), time.monotonic() + timeout_s
    while not (os.path.exists(metrics) and os.path.getsize(metrics)):
        assert time.monotonic() < deadline, f"no step logged in {out_dir} after {timeout_s} s"
        time.sleep(0.05)


# A pair's run: 30 steps (it was 60; the three runs of the SIGTERM case took 132 s of the slow suite). A SIGTERM
# sent once step 1 is logged was saved at step 4 on this 2-core machine: margin enough before the last step (a
# signal in the last step would print no "saved step": the case would fail, not pass untested).
PAIR_STEPS = 30


def pair_args(out_dir, cache_dir, *extra) -> list[str]:
    """jaxtrain.run's arguments for each process of two_processes' run."""
    return [*SMALL, f"--run.out_dir={out_dir}", f"--data.cache_dir={cache_dir}", "--mesh.fsdp=2",
            f"--train.steps={PAIR_STEPS}", f"--checkpoint.every={PAIR_STEPS // 2}",
            f"--train.eval_every={PAIR_STEPS // 2}", *extra]


def two_processes(out_dir, cache_dir, *extra):
    cmd = [sys.executable, "-u", "-m", "jaxtrain.run", *pair_args(out_dir, cache_dir, *extra)]
    return start_processes([cmd] * 2, 2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_sigterm_to_one_host_saves_the_same_step_on_both(tmp_path, cache_dir):
    """Two processes on localhost; SIGTERM reaches process 1 only (a preemption notice to one host): both agree,
    save the same step and exit 0; started again, the pair finishes exactly like a pair never stopped."""
    straight_dir, out_dir = str(tmp_path / "straight2"), str(tmp_path / "stopped2")
    for p in two_processes(straight_dir, cache_dir):
        assert p.wait(timeout=600) == 0, p.stderr.read()
    procs = two_processes(out_dir, cache_dir)
    wait_for_a_logged_step(out_dir)  # both past start-up: a signal there would stop them before the first step
    procs[1].send_signal(signal.SIGTERM)
    errs = [err for *_, err in finish(procs, 600)]
    assert [p.returncode for p in procs] == [0, 0], errs
    saved = {int(e.split("saved step ")[1].split(";")[0]) for e in errs if "saved step " in e}
    assert len(saved) == 1 and all("saved step" in e for e in errs), errs
    assert os.path.isdir(os.path.join(out_dir, "checkpoints", str(saved.pop())))
    for p in two_processes(out_dir, cache_dir):
        assert p.wait(timeout=600) == 0, p.stderr.read()
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(straight_dir))


def test_the_signal_line_says_whether_a_step_is_in_flight(capsys):
    stop = preemption.StopRequest()
    try:
        stop._handle(signal.SIGTERM, None)
        assert capsys.readouterr().err == ("\nSIGTERM: stopping at the end of this start-up phase, before the first "
                                           "step (SIGTERM again to stop at once)\n")
        stop.requested = False
        stop.training_started()
        stop._handle(signal.SIGINT, None)
        assert capsys.readouterr().err == ("\nSIGINT: stopping once the step in flight is done and saved (SIGINT "
                                           "again to stop at once)\n")
    finally:
        stop.restore()


class ExitedNow(Exception):
    pass


def _exit_raises(signum, line):
    raise ExitedNow(signum, line)


@pytest.mark.parametrize("several", [False, True], ids=["one process", "several"])
def test_after_the_last_save_one_process_stops_at_once_one_of_several_ends_with_the_others(several, capsys,
                                                                                           monkeypatch):
    """One process: a signal after the last save exits at once (128 + signal), saying the run is saved. One of
    several: it says so and goes on to the shutdown barrier its peers wait at; a second signal exits at once."""
    monkeypatch.setattr(preemption, "_exit_now", _exit_raises)
    stop = preemption.StopRequest()
    try:
        stop.training_started()
        stop.nothing_left_to_save("the run is trained and saved at step 9", several)
        if not several:
            with pytest.raises(ExitedNow) as exited:
                stop._handle(signal.SIGTERM, None)
            assert exited.value.args == (signal.SIGTERM, "\nSIGTERM: stopping now; the run is trained and saved "
                                                         "at step 9")
            return
        stop._handle(signal.SIGTERM, None)
        assert capsys.readouterr().err == ("\nSIGTERM: the run is trained and saved at step 9; ending with the other "
                                           "processes, whose shutdown waits for this one (SIGTERM again to stop at "
                                           "once)\n")
        with pytest.raises(ExitedNow):
            stop._handle(signal.SIGINT, None)
    finally:
        stop.restore()


@pytest.mark.parametrize("several", [False, True], ids=["one process", "several"])
def test_a_signal_during_the_last_save_stops_one_process_once_it_is_saved(several, monkeypatch):
    monkeypatch.setattr(preemption, "_exit_now", _exit_raises)
    stop = preemption.StopRequest()
    try:
        stop.training_started()
        stop._handle(signal.SIGTERM, None)  # during the last save's wait
        if several:
            stop.nothing_left_to_save("saved", several)  # and on to the shutdown barrier
        else:
            with pytest.raises(ExitedNow):
                stop.nothing_left_to_save("saved", several)
    finally:
        stop.restore()


def test_saved_step_is_said_once_its_checkpoint_is_committed(tmp_path, cache_dir, monkeypatch):
    """"saved step N" is the line an operator or a preemption script trusts before the grace period ends: the step's
    folder is committed when it is printed (it was printed as the asynchronous save began, ~1.6 s before its commit
    on an 8-layer model, so a kill -9 then left no checkpoint)."""
    out_dir = str(tmp_path / "run")
    cfg = config.load(small_args(out_dir, cache_dir, "--train.steps=50", "--checkpoint.every=100"))
    real_report, listed = run.report, []

    def report_then_signal(pending, logger, divergence):
        if pending[0] == 3:  # a preemption notice during step 4
            os.kill(os.getpid(), signal.SIGTERM)
        return real_report(pending, logger, divergence)

    def resume_hint(cfg, module):  # evaluated as the line is printed
        listed.append(sorted(os.listdir(os.path.join(out_dir, "checkpoints"))))
        return "run the same command to resume"
    monkeypatch.setattr(run, "report", report_then_signal)
    monkeypatch.setattr(run.config_lib, "resume_hint", resume_hint)
    summary = run.train(cfg)
    assert summary["stopped"] and listed == [[str(summary["step"])]]  # committed: no orbax-checkpoint-tmp name


def test_a_signal_during_an_evaluation_saves_the_evaluated_step(tmp_path, cache_dir, monkeypatch, capsys):
    """A preemption notice while step 3 is evaluated (not a save step) saves step 3 at once, as torchref does; it
    trained step 4 first, which a short grace period may not leave time for."""
    out_dir, real_evaluate = str(tmp_path / "run"), run.Trainer.evaluate

    def signalled_meanwhile(self, params, batches):
        os.kill(os.getpid(), signal.SIGTERM)
        return real_evaluate(self, params, batches)

    monkeypatch.setattr(run.Trainer, "evaluate", signalled_meanwhile)
    summary = run.train(config.load(small_args(out_dir, cache_dir, "--checkpoint.every=8", "--train.eval_every=3")))
    assert summary["stopped"] and "saved step 3;" in capsys.readouterr().err
    assert checkpoint.saved_steps(out_dir) == [3] and train_steps(out_dir) == [1, 2, 3]


def test_a_signal_during_the_last_step_ends_the_complete_run_at_once(tmp_path, cache_dir, monkeypatch, capsys):
    """A SIGTERM while step 8 of 8 trains: the step is saved and the run is complete, so it ends as a signal after
    the last save does (128 + signal, "the run is trained and saved"), not with "saved step 8; run the same command
    to resume", exit 0, for a run whose restart has nothing to do. torchref: tests/test_torchref.py."""
    out_dir, real_report = str(tmp_path / "run"), run.report

    def signalled_in_the_last_step(pending, logger, divergence):
        if pending[0] == 7:  # reported while step 8 runs
            os.kill(os.getpid(), signal.SIGTERM)
        return real_report(pending, logger, divergence)

    monkeypatch.setattr(run, "report", signalled_in_the_last_step)
    monkeypatch.setattr(preemption, "_exit_now", _exit_raises)
    with pytest.raises(ExitedNow) as exited:
        run.train(config.load(small_args(out_dir, cache_dir)))
    assert exited.value.args == (signal.SIGTERM, "SIGTERM: stopping now; the run is trained and saved at step 8")
    assert "saved step" not in capsys.readouterr().err and checkpoint.saved_steps(out_dir)[-1] == 8


@pytest.mark.slow
def test_an_end_of_run_sample_one_host_has_no_room_for_is_refused_by_both(tmp_path, cache_dir):
    """Process 1's devices report no memory left beside the trained state (its dryrun.room_left 0; CPU devices
    report none): both refuse the end-of-run sample in the same line, the run saved, and end at once with exit 2.
    Process 1 alone refused, and process 0 drew, waiting in the sample's collectives for a peer gone: still
    waiting after 300 s. (A refusal at the compile reaches the same vote: tests/test_sample_devices.py.)"""
    out_dir = str(tmp_path / "run")
    args = pair_args(out_dir, cache_dir, "--log.sample_tokens=40")
    patched = ("import sys; from jaxtrain import dryrun, run; dryrun.room_left = lambda device: 0; "
               "run.main(sys.argv[1:])")
    procs = start_processes([[sys.executable, "-u", "-m", "jaxtrain.run", *args],
                             [sys.executable, "-u", "-c", patched, *args]], 2, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(procs[0], "done: steps")
    (code0, out0, err0), (code1, out1, err1) = finish(procs, 120)  # the refusal: seconds; a peer left waiting: never
    refusal = (f"error: the end-of-run sample (log.sample_tokens=40) needs more memory than a device has beside the "
               f"trained state; the run is trained and saved: draw it with `python -m jaxtrain.sample --run "
               f"{out_dir} --prompt='def ' --max_new_tokens 40 --seed 0`")  # tiny.yaml's prompt
    assert (code0, code1) == (2, 2) and refusal in err0 and refusal in err1, (err0[-2000:], err1[-2000:])
    assert checkpoint.saved_steps(out_dir)[-1] == PAIR_STEPS and "sample (40 tokens" not in err0 + err1


@pytest.mark.slow
def test_a_signal_to_one_host_after_the_last_save_lets_both_end(tmp_path, cache_dir):
    """SIGTERM to process 1 while the two draw the end-of-run sample: process 1 says the run is saved and ends
    with process 0, both exit 0 at once. It died at once, and process 0, left alone at JAX's shutdown barrier,
    aborted (SIGABRT) some 85 s later: a finished run reported failed. The sample, drawn by both from the weights
    each holds half of (mesh.fsdp=4 over both processes' 2 devices), is process 0's alone to print, and reads as
    `jaxtrain.sample` draws it on one device."""
    out_dir = str(tmp_path / "run")
    procs = two_processes(out_dir, cache_dir, "--log.sample_tokens=160", "--mesh.fsdp=4")
    wait_for(procs[0], "done: steps")
    procs[1].send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-3000:] for _, err in outs]
    # the sample, not a dead peer's time-out (~85 s): measured 11 s alone here; at 400 tokens 19 s alone and 66 s
    # under CI's parallel slow suite, so ~38 s at 160 under that load, margin 1.6x
    assert time.monotonic() - t0 < 60
    assert (f"SIGTERM: the run is trained and saved at step {PAIR_STEPS}; ending with the other processes"
            in outs[1][1])
    one = subprocess.run([sys.executable, "-m", "jaxtrain.sample", "--run", out_dir, "--prompt", "def ",
                          "--max_new_tokens=160", "--devices=1"], capture_output=True, text=True)  # tiny.yaml's
    assert one.returncode == 0 and one.stdout.startswith("def ") and len(one.stdout) > 100, one.stderr[-3000:]
    printed = outs[0][0].split(f"step {PAIR_STEPS}: eval loss ")[1].split("\n", 1)[1]
    text = "".join(line for line in printed.splitlines(keepends=True) if not line.startswith("[Gloo] "))
    assert text == one.stdout, printed  # (less the lines of the CPU collectives' library, Gloo)
    assert one.stdout not in outs[1][0] and "eval loss" not in outs[1][0], outs[1][0]  # (Gloo's lines only)
