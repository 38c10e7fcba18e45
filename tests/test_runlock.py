"""One run per run folder (jaxtrain.runlock): a second process started on a folder in use refuses in one line and
touches nothing; the first finishes as if alone; a killed run leaves no lock behind."""

import os
import signal
import subprocess
import sys

import pytest

from test_preemption import LONG, start, wait_for
from test_run import read_metrics, small_args, without_timing
from jaxtrain import config, run

HOLD = "from jaxtrain import runlock; import sys, time; runlock.RunLock(sys.argv[1]); print('held', flush=True); time.sleep(600)"


def try_lock(out_dir) -> subprocess.CompletedProcess:
    code = "import sys; from jaxtrain import runlock; from jaxtrain.errors import exit_on_user_error\n" \
           "with exit_on_user_error(): runlock.RunLock(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, out_dir], capture_output=True, text=True)


def test_a_held_folder_refuses_and_a_killed_holder_leaves_no_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    refused = try_lock(str(tmp_path))
    assert refused.returncode == 2 and f"is in use by pid {holder.pid} on " in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert try_lock(str(tmp_path)).returncode == 0  # the kernel dropped the lock with the process


@pytest.fixture(scope="module")
def straight(tmp_path_factory, cache_dir):
    out_dir = str(tmp_path_factory.mktemp("straight"))
    run.train(config.load(small_args(out_dir, cache_dir, *LONG)))
    return out_dir


def second_run(module: str, out_dir, cache_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *small_args(out_dir, cache_dir, *LONG)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("second", ["jaxtrain.run", "torchref.run"])
def test_a_second_run_on_a_folder_in_use_refuses_and_the_first_finishes_alone(tmp_path, cache_dir, straight, second):
    """Staggered: the first is training when the second starts (either backend)."""
    out_dir = str(tmp_path / "shared")
    first, _ = start(out_dir, cache_dir)
    wait_for(first, "compiled the train step")
    before = {name: open(os.path.join(out_dir, name), "rb").read() for name in ("config.yaml",)}
    refused = second_run(second, out_dir, cache_dir)
    assert refused.returncode == 2 and "is in use by pid" in refused.stderr and "Traceback" not in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert {name: open(os.path.join(out_dir, name), "rb").read() for name in before} == before
    assert first.wait() == 0, first.stderr.read()
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(straight))


def test_two_runs_started_together_one_refuses(tmp_path, cache_dir, straight):
    out_dir = str(tmp_path / "together")
    procs = [start(out_dir, cache_dir)[0] for _ in range(2)]
    errs = [p.stderr.read() for p in procs]
    codes = sorted(p.wait() for p in procs)
    assert codes == [0, 2], errs
    refused = errs[[p.returncode for p in procs].index(2)]
    assert "is in use by pid" in refused and "Traceback" not in refused and len(refused.strip().splitlines()) == 1
    assert without_timing(read_metrics(out_dir)) == without_timing(read_metrics(straight))
