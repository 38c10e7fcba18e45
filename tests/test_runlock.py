"""One run per run folder (jaxtrain.runlock): a second process started on a folder in use refuses in one line and
touches nothing; the first finishes as if alone; a killed run leaves no lock behind."""

import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
from etils import epath

from processes import coordinator_env, finish, start_processes
from test_preemption import LONG, start, wait_for_a_logged_step
from test_run import read_metrics, small_args, without_timing
from jaxtrain import config, run, runlock
from jaxtrain.errors import UserError

HOLD = ("from jaxtrain import runlock; import sys, time; runlock.take(sys.argv[1], float(sys.argv[2])); "
        "print('held', flush=True); time.sleep(600)")
TAKE = ("import sys; from jaxtrain import runlock; from jaxtrain.errors import exit_on_user_error\n"
        "with exit_on_user_error(): runlock.take(sys.argv[1], float(sys.argv[2])).release()")
# What jaxtrain.run does around the join: check_free on every process, then take() on process 0 with its answer.
CHECK = ("import sys; from jaxtrain import runlock; from jaxtrain.errors import exit_on_user_error\n"
         "with exit_on_user_error():\n"
         "    dead_lease = runlock.check_free(sys.argv[1], float(sys.argv[2]))\n")
CHECK_THEN_TAKE = CHECK + "    runlock.take(sys.argv[1], float(sys.argv[2]), dead_lease).release()"
LEASE_S = 2.0  # run.lock_timeout_s of the gs:// cases: a dead holder's lease is taken over after this long


def hold(out_dir) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, out_dir, str(LEASE_S)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def try_lock(out_dir, background=False):
    """A start that takes the lock and gives it back; its CompletedProcess, or with `background` its Popen."""
    cmd = [sys.executable, "-c", TAKE, out_dir, str(LEASE_S)]
    if background:
        return subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=10 * LEASE_S)


@pytest.mark.parametrize("out_dir,why", [("/proc/x", "No such file or directory"),
                                         ("/sys/x", "Operation not permitted")])
def test_a_run_folder_that_cannot_be_created_is_one_line(out_dir, why):
    """Folders the kernel refuses even to root (os.access says yes): both backends take this lock first."""
    with pytest.raises(UserError) as e:
        runlock.take(out_dir)
    assert str(e.value) == (f"run.out_dir='{out_dir}' cannot be created or written ({why}: {out_dir}); choose another "
                            f"--run.out_dir")


def test_a_lock_file_that_cannot_be_opened_is_one_line(tmp_path):
    """check_free opens a run folder's lock file to read who holds it; where that fails (another user's, unreadable;
    here a socket, which the kernel opens to nobody, root included) the start is refused as take() refuses, not
    with a traceback."""
    lock = tmp_path / runlock.NAME
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(lock))
        with pytest.raises(UserError) as e:
            runlock.check_free(str(tmp_path), 1.0)
    assert str(e.value) == (f"run.out_dir='{tmp_path}' cannot be created or written (No such device or address: "
                            f"{lock}); choose another --run.out_dir")


@pytest.mark.parametrize("errno_name", ["ENOSYS", "EOPNOTSUPP"])
def test_a_file_system_without_locks_is_one_line_and_leaves_no_lock_file(tmp_path, monkeypatch, errno_name):
    """flock fails with ENOSYS on Lustre mounted without -o flock (launch/gpt-1b.sbatch's note), EOPNOTSUPP on some
    FUSE mounts: that was an OSError traceback, exit 1, and a .lock left; now one line naming the mount option, and
    the folders and the lock file the start made go again. The check of a folder another start locked, too."""
    import errno as errno_lib

    def no_locks(fd, operation):
        raise OSError(getattr(errno_lib, errno_name), os.strerror(getattr(errno_lib, errno_name)))

    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)
    out_dir = tmp_path / "lustre" / "run"
    with pytest.raises(UserError, match=r"is on a file system without file locks .*\(Lustre: -o flock\)"):
        runlock.FileLock(str(out_dir))
    assert os.listdir(tmp_path) == []
    out_dir.mkdir(parents=True)
    (out_dir / runlock.NAME).write_text("pid 1 on elsewhere\n")
    with pytest.raises(UserError, match=r"is on a file system without file locks"):
        runlock.check_free(str(out_dir), 1.0)


def test_a_start_that_fails_before_writing_leaves_the_folders_as_they_were(tmp_path, cache_dir):
    """Starts that took the lock and then stopped leave no trace: data.path a folder but not a data folder (before
    the checkpoints' folder is made), and init.from a folder that does not exist (after). Not the two folders a start
    made for run.out_dir, not a lock file or checkpoints/ in an empty folder, nor in a run folder holding a file."""
    not_data, used = tmp_path / "not-data", tmp_path / "used"
    failures = {f"--data.path={not_data}": "meta.json is missing",
                f"--init.from={tmp_path / 'nothing'}": "does not exist; point it at a torch-format checkpoint"}
    for flag, message in failures.items():
        for folder in (not_data, tmp_path / "empty", used):
            folder.mkdir(exist_ok=True)
        (used / "metrics.jsonl").write_text("{}\n")
        for out_dir in (tmp_path / "new" / "nested", tmp_path / "empty", used):
            with pytest.raises(UserError, match=message):
                run.train(config.load(small_args(str(out_dir), cache_dir, flag)))
        assert sorted(os.listdir(tmp_path)) == ["empty", "not-data", "used"], flag
        assert os.listdir(tmp_path / "empty") == [] and os.listdir(used) == ["metrics.jsonl"], flag


def test_a_start_that_wrote_nothing_keeps_what_it_set_aside_even_empty(tmp_path):
    """A start that moved a corrupt step's empty folder aside and a run.fresh start that moved an empty tb/ aside: the
    warnings named those folders, so they stay (the run's exit removed them), and the start, which wrote, leaves
    what it made; one that set nothing aside leaves nothing."""
    set_aside = ["checkpoints.corrupt", "tb.before-fresh-20261201-085618"]
    for names in ([], set_aside):
        folder = tmp_path / str(len(names))
        folder.mkdir()
        lock = runlock.take(str(folder))
        for name in ["checkpoints", *names]:
            (folder / name).mkdir()
        if names:
            (folder / names[0] / "8-20261201-085618-499108").mkdir()
        lock.release()
        assert sorted(os.listdir(folder)) == ([".lock", "checkpoints", *names] if names else [])


def test_a_held_folder_refuses_and_a_killed_holder_leaves_no_lock(tmp_path):
    holder = hold(str(tmp_path))
    refused = try_lock(str(tmp_path))
    assert refused.returncode == 2 and f"is in use by pid {holder.pid} on " in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert try_lock(str(tmp_path)).returncode == 0  # the kernel dropped the lock with the process


def test_a_gs_lease_refuses_while_renewed_and_passes_to_one_start_once_its_holder_is_killed(gcs):
    """A live holder renews its lease: a second start watches it change and refuses. Killed, it renews no more:
    of two starts racing for the dead lease, exactly one takes it over. Released, the lease is gone: the next
    start takes it at once."""
    out_dir = f"{gcs()}/run"
    holder = hold(out_dir)
    refused = try_lock(out_dir)
    assert refused.returncode == 2 and f"is in use by pid {holder.pid} on " in refused.stderr, refused.stderr
    holder.kill()
    holder.wait()
    racers = [try_lock(out_dir, background=True) for _ in range(2)]
    ends = sorted((racer.wait(timeout=10 * LEASE_S), racer.stderr.read()) for racer in racers)
    assert [code for code, _ in ends] == [0, 2], ends
    assert f"took over the lock of a run that stopped renewing it (pid {holder.pid} on " in ends[0][1]
    assert "in use by" in ends[1][1]
    again = try_lock(out_dir)
    assert again.returncode == 0 and again.stderr == "", again.stderr  # released: nothing to watch


def test_a_gs_lease_is_checked_before_the_join_and_a_dead_one_is_watched_once(gcs):
    """check_free, which runs before a launch's processes join, refuses a renewed gs:// lease (a second launch must
    not reach a live run's coordinator), and watches a dead one once: take() then takes it over at once."""
    out_dir = f"{gcs()}/run"
    holder = hold(out_dir)
    check = lambda script: subprocess.run([sys.executable, "-c", script, out_dir, str(LEASE_S)],
                                          capture_output=True, text=True, timeout=10 * LEASE_S)
    refused = check(CHECK)
    assert refused.returncode == 2 and f"is in use by pid {holder.pid} on " in refused.stderr, refused.stderr
    holder.kill()
    holder.wait()
    taken = check(CHECK_THEN_TAKE)
    assert taken.returncode == 0, taken.stderr
    assert taken.stderr.count("watching the lock for up to") == 1, taken.stderr
    assert f"took over the lock of a run that stopped renewing it (pid {holder.pid} on " in taken.stderr


def test_a_gs_lease_is_watched_for_its_holders_timeout_not_the_watchers(gcs):
    """A start with a shorter run.lock_timeout_s than the live holder's waits for the holder's (which sets how often
    the holder renews), so it refuses, before the join (check_free) as at take(); it waited for its own, saw no
    renewal in that time and took the live run's folder over. A lease without the holder's timeout (written before
    leases held it) is watched for the watcher's own."""
    out_dir = f"{gcs()}/run"
    holder = hold(out_dir)  # renews every LEASE_S / 4
    try:
        for script in (CHECK_THEN_TAKE, TAKE):
            refused = subprocess.run([sys.executable, "-c", script, out_dir, "0.05"], capture_output=True, text=True,
                                     timeout=10 * LEASE_S)
            assert refused.returncode == 2 and f"is in use by pid {holder.pid} on " in refused.stderr, refused.stderr
            assert f"watching the lock for up to {LEASE_S:.0f} s" in refused.stderr, refused.stderr
    finally:
        holder.kill()
        holder.wait()
    old_lease = epath.Path(out_dir) / runlock.NAME
    old_lease.write_text("pid 1 on old-host, since 2025-01-01 00:00:00")
    taken = try_lock(out_dir)
    assert taken.returncode == 0, taken.stderr
    assert f"watching the lock for up to {LEASE_S:.0f} s" in taken.stderr, taken.stderr
    assert "took over the lock of a run that stopped renewing it (pid 1 on old-host, since " in taken.stderr


def raising(error: Exception):
    """A stand-in for a client call that fails with `error`."""
    def call(*args, **kwargs):
        raise error
    return call


def test_a_renewal_whose_answer_was_lost_keeps_the_lease_and_a_taken_one_is_said(gcs, capsys):
    """google-cloud-storage retries a conditional upload whose answer was lost; the retry meets the generation the
    applied write moved on, 412. The heartbeat took that as "taken over", stopped renewing a live run's lease, and
    a later start took the folder over while it ran (the review's fake-gcs run: after 4 s). Now the lease is read
    back: holding this run's own line, it is still this run's. Rewritten by another start, it is not, as before."""
    from google.api_core import exceptions

    out_dir = gcs() + "/run"
    lease = runlock.take(out_dir, LEASE_S)
    real, lost = lease.blob.upload_from_string, []

    def answer_lost(*args, **kwargs):
        real(*args, **kwargs)
        if not lost:  # the first renewal's answer: the retry sees its own write's generation
            lost.append(1)
            raise exceptions.PreconditionFailed("conditionNotMet")

    lease.blob.upload_from_string = answer_lost
    deadline = time.monotonic() + 30
    while not lost and time.monotonic() < deadline:
        time.sleep(0.1)
    assert lost, "no renewal in 30 s"
    time.sleep(LEASE_S)  # four more renewals (one each LEASE_S / 4) after the lost answer
    assert lease.heartbeat.is_alive() and "taken over" not in capsys.readouterr().err
    holder = runlock.GcsLease.current(lease.blob)
    assert holder is not None and holder[1].startswith(f"pid {os.getpid()} on "), holder
    other = type(lease.blob)(lease.blob.name, lease.blob.bucket)
    for _ in range(50):  # as a start takes a lease over: conditional on the generation it read, which a renewal
        seen = lease.blob.bucket.get_blob(lease.blob.name)  # (every LEASE_S / 4) may move on in between
        try:
            other.upload_from_string("pid 1 on another-host, since now", if_generation_match=seen.generation)
            break
        except exceptions.PreconditionFailed:
            continue
    else:
        pytest.fail("a renewal came between each of 50 reads of the lease and the write after it")
    lease.heartbeat.join(timeout=30)
    assert not lease.heartbeat.is_alive()
    assert "was taken over by another run" in capsys.readouterr().err
    lease.release()


def lease_in(bucket_name: str, **calls) -> types.SimpleNamespace:
    """A fake lease blob in bucket `bucket_name`: `calls` its bucket's get_blob and its own upload_from_string."""
    bucket = types.SimpleNamespace(name=bucket_name, get_blob=calls.get("get_blob"))
    return types.SimpleNamespace(bucket=bucket, name="run/.lock", upload_from_string=calls.get("upload_from_string"))


def test_a_gs_bucket_that_refuses_the_credentials_is_one_line(monkeypatch):
    """A bucket that answers 403 (the emulator checks no credentials: a fake one here): the lease's first read
    (check_free, before the join) and its first write (take) each refuse in one line naming the bucket, the
    credentials and the fix, not in Google's Forbidden traceback."""
    from google.api_core.exceptions import Forbidden

    refuse = raising(Forbidden("ci@example.iam.gserviceaccount.com does not have storage.objects.get access"))
    lease = lease_in("their-bucket", get_blob=refuse, upload_from_string=refuse)
    monkeypatch.setattr(runlock.GcsLease, "blob_of", staticmethod(lambda out_dir: lease))
    for first_request in (runlock.check_free, runlock.take):
        with pytest.raises(UserError) as e:
            first_request("gs://their-bucket/run", LEASE_S)
        assert str(e.value) == (
            "run.out_dir's bucket gs://their-bucket refuses this run's credentials (403 Forbidden: "
            "ci@example.iam.gserviceaccount.com does not have storage.objects.get access); fix the credentials "
            "(gcloud auth application-default login) or their permissions on the bucket, or fix run.out_dir")


def _no_credentials(monkeypatch):
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage
    monkeypatch.setattr(storage, "Client", raising(DefaultCredentialsError("No default credentials were found.")))


def _unreachable(monkeypatch):
    from requests.exceptions import ConnectionError
    unreachable = raising(ConnectionError("Max retries exceeded with url: /b/their-bucket"))
    lease = lease_in("their-bucket", get_blob=unreachable)
    monkeypatch.setattr(runlock.GcsLease, "blob_of", staticmethod(lambda out_dir: lease))


@pytest.mark.parametrize("machine,message", [
    (_no_credentials, "run.out_dir=gs://their-bucket/run is in Google Cloud Storage, and this machine has no "
                      "credentials for it: run `gcloud auth application-default login`, or set "
                      "GOOGLE_APPLICATION_CREDENTIALS to a service account's key file"),
    (_unreachable, "run.out_dir's bucket gs://their-bucket could not be reached (ConnectionError: Max retries "
                   "exceeded with url: /b/their-bucket); check this machine's network to Google Cloud Storage, or "
                   "fix run.out_dir")], ids=["no credentials", "no network"])
def test_a_gs_folder_without_credentials_or_network_is_one_line(monkeypatch, machine, message):
    """No Google credentials on the machine: storage.Client() raised DefaultCredentialsError, a 41-line traceback
    from the lock's check before the join. A bucket the machine cannot reach: requests' ConnectionError (the
    client's retries ended) at the lease's first read. Each is one line naming the fix."""
    machine(monkeypatch)
    with pytest.raises(UserError) as e:
        runlock.check_free("gs://their-bucket/run", LEASE_S)
    assert str(e.value) == message


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
    wait_for_a_logged_step(out_dir)  # config.yaml is written once every start-up check has passed, then step 1
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


# A start on the lock's other path: no check before the processes join (a gs:// lease has none), so process 0
# meets the held lock after the join.
UNCHECKED = ("import sys; from jaxtrain import run, runlock\n"
             "runlock.check_free = lambda out_dir, timeout_s: None\n"
             "run.main(sys.argv[1:])")


@pytest.mark.parametrize("checked", [True, False], ids=["before the join", "after the join"])
def test_a_refused_start_of_several_processes_is_one_line_on_each(tmp_path, cache_dir, checked):
    """Two processes on a folder another run holds: each refuses in one line, exit 2, and the folder is as it was.
    Before the join (a local lock), each names the holder; after it (process 0 meets the lock), process 1 says
    process 0 refused: it went on into the checkpoints' collective, which process 0 never joined, and ended in a
    Gloo DEADLINE_EXCEEDED traceback 30 s later."""
    out_dir = str(tmp_path / "held")
    holder = hold(out_dir)
    start = ["-m", "jaxtrain.run"] if checked else ["-c", UNCHECKED]
    try:
        procs = start_processes([[sys.executable, *start, *small_args(out_dir, cache_dir), "--mesh.fsdp=2"]] * 2, 2,
                                stderr=subprocess.PIPE, text=True)
        errs = [err for *_, err in finish(procs, 120)]
    finally:
        holder.kill()
    assert [p.returncode for p in procs] == [2, 2], errs
    assert all(err.count("\n") == 1 for err in errs), errs
    in_use = f"run folder {out_dir} is in use by pid {holder.pid}"
    assert in_use in errs[0] and (in_use if checked else "error: process 0 refused to start") in errs[1]
    assert os.listdir(out_dir) == [".lock"]


def wait_for_the_lease(out_dir, timeout_s: float = 300.0) -> None:
    """Until a gs:// run's lease exists: its processes have joined and process 0 holds the folder."""
    lease, deadline = epath.Path(out_dir) / runlock.NAME, time.monotonic() + timeout_s
    while not lease.exists():
        assert time.monotonic() < deadline, f"no lease in {out_dir} after {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_a_second_launch_on_the_live_runs_coordinator_is_refused_and_the_run_goes_on(tmp_path, cache_dir, where,
                                                                                     request):
    """Two processes on localhost, launched again with the same coordinator while the run is alive (a TPU VM's fixed
    port, a requeue racing the old job): the second launch's processes refuse in one line before they join, and the
    live run goes on (stopped by SIGTERM after that, it exits 0). They joined first, reached the live run's
    coordinator as a "restarted" process 1, and JAX's coordination service aborted the live run (SIGABRT on both,
    its steps since the last checkpoint lost). In a gs:// folder each process of the second launch watches the live
    run's lease renewed (every second, at run.lock_timeout_s=4) and refuses; before, only process 0 looked at the
    lease, after the join."""
    out_dir = str(tmp_path / "live") if where == "local" else f"{request.getfixturevalue('gcs')()}/live"
    hosts = coordinator_env(2)  # one for both launches: the second reaches the live run's coordinator
    cmd = [sys.executable, "-m", "jaxtrain.run", *small_args(out_dir, cache_dir, "--train.steps=100000",
                                                             "--checkpoint.every=1000", "--run.lock_timeout_s=4"),
           "--mesh.fsdp=2"]  # a run that outlives the second launch whatever the load: the test stops it
    launch = lambda: start_processes([cmd] * 2, 2, hosts, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live, second = launch(), []
    try:
        wait_for_a_logged_step(out_dir) if where == "local" else wait_for_the_lease(out_dir)
        second = launch()
        errs = [err for *_, err in finish(second, 120)]
        assert [p.returncode for p in second] == [2, 2], errs
        in_use = f"error: run folder {out_dir} is in use by pid"
        assert all(err.strip().splitlines()[-1].startswith(in_use) for err in errs), errs
        assert all(err.count("\n") == (1 if where == "local" else 2) for err in errs), errs  # gs://: "watching" too
        assert [p.poll() for p in live] == [None, None]  # not aborted
        live[1].send_signal(signal.SIGTERM)
        live_errs = [err for *_, err in finish(live, 300)]
        assert [p.returncode for p in live] == [0, 0], [err[-2000:] for err in live_errs]
    finally:  # a failed check leaves no run behind
        for p in live + second:
            p.kill()


def test_a_leases_timeout_is_read_where_a_run_could_have_written_it():
    """The holder's lock_timeout_s as its lease holds it; anything else (no field: a lease from before the field, or
    an object edited by hand) leaves the watcher's own timeout to serve, never a traceback or an endless watch."""
    assert runlock._timeout("2.5") == 2.5 and runlock._timeout("60.0") == 60.0
    assert [runlock._timeout(text) for text in ("", "x", "inf", "nan", "-1", "0")] == [None] * 6
