"""kill -9 at random moments (start-up, steps, asynchronous saves), restarting each time with the same command:
the run ends bit for bit where an uninterrupted run ends (params, AdamW's moments, every metrics line), no
restart fails, and no temporary folder is left behind.

CI runs KILLS=5; `CRASH_LOOP_KILLS=20 python -m pytest -s -m slow tests/test_crash_loop.py` runs the issue's 20 and
prints where the kills landed.
"""

import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from test_run import final_params, read_metrics, small_args, without_timing
from jaxtrain import config, run

KILLS = int(os.environ.get("CRASH_LOOP_KILLS", "5"))
# A save every 5 steps (asynchronous) of a ~10 ms step: a kill in training lands in a save about as often as not.
ARGS = ("--train.steps=600", "--checkpoint.every=5", "--checkpoint.max_to_keep=2", "--train.eval_every=200")
TIME_LIMIT_S = 60 * KILLS  # bounded: a restart that hangs fails the test instead of stalling CI
COMPILED = "compiled the train step"


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_is_bitwise(tmp_path, cache_dir):
    straight, crashed = str(tmp_path / "straight"), str(tmp_path / "crashed")
    run.train(config.load(small_args(straight, cache_dir, *ARGS)))
    cmd = [sys.executable, "-m", "jaxtrain.run", *small_args(crashed, cache_dir, *ARGS)]
    rng, deadline = random.Random(0), time.monotonic() + TIME_LIMIT_S
    landed = {"start-up": 0, "a save": 0, "a step": 0, "a finished run": 0}
    for kill in range(KILLS):
        log = str(tmp_path / f"stderr-{kill}")
        with open(log, "w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            if kill % 4 == 0:  # one kill in four inside start-up: imports, the resume check, restore, compilation
                time.sleep(rng.uniform(0.2, 4.0))
            else:  # the rest within the first 2 s of training, so the run is far from done at every restart
                wait_for(proc, log, COMPILED, deadline)
                time.sleep(rng.uniform(0.0, 2.0))
            proc.kill()
            proc.wait()
        stderr = open(log).read()
        assert proc.returncode in (-9, 0) and "Traceback" not in stderr, f"restart {kill} failed:\n{stderr}"
        landed[where_killed(proc.returncode, stderr, crashed)] += 1
        assert time.monotonic() < deadline, f"{kill} kills took over {TIME_LIMIT_S} s"
    print(f"\n{KILLS} kills landed in: " + ", ".join(f"{where} {n}" for where, n in landed.items()))
    final = subprocess.run(cmd, capture_output=True, text=True, timeout=TIME_LIMIT_S)
    assert final.returncode == 0, final.stderr
    root = os.path.join(crashed, "checkpoints")
    assert not [n for n in os.listdir(root) if not n.isdigit()], os.listdir(root)
    assert without_timing(read_metrics(crashed)) == without_timing(read_metrics(straight))
    for a, b in zip(final_params(crashed, cache_dir, *ARGS), final_params(straight, cache_dir, *ARGS)):
        assert np.array_equal(a, b)


def wait_for(proc, log: str, words: str, deadline: float) -> None:
    """Until the process has written `words` to its stderr file, or has ended; bounded by `deadline`."""
    while words not in open(log).read() and proc.poll() is None:
        assert time.monotonic() < deadline, f"no {words!r} before the time limit"
        time.sleep(0.05)


def where_killed(returncode: int, stderr: str, out_dir: str) -> str:
    """Start-up until the train step is compiled; a save while a step's temporary folder is on disk."""
    if returncode == 0:
        return "a finished run"
    if COMPILED not in stderr:
        return "start-up"
    root = os.path.join(out_dir, "checkpoints")
    return "a save" if any(not n.isdigit() for n in os.listdir(root)) else "a step"
