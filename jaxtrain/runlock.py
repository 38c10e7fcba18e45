"""A run folder belongs to one run at a time: `<out_dir>/.lock`, held for the whole run by both backends (pure
Python: torchref imports it). On several processes only process 0 holds it (the others write into the same folder
as part of the same run). A refused start touches nothing else in the folder, and the lock says who holds it; a
start that stops before writing anything leaves the folder as it found it (FileLock._unmake_if_unused).

On a local disk (or a network file system with flock): an exclusive flock on an open file. The kernel drops it when
the process ends however it ends (kill -9 included), so a killed run never leaves the folder locked.

In a gs:// folder there is no flock and nobody drops a lock for a dead process: a lease instead (GcsLease).
Another object store (s3://, ...) gets no lock, and a warning says so.
"""

import contextlib
import fcntl
import math
import os
import socket
import sys
import threading
import time

from jaxtrain import runfolder
from jaxtrain.errors import UserError

NAME = ".lock"
TIMEOUT_FIELD = "\nlock_timeout_s="  # a gs:// lease's holder's run.lock_timeout_s follows its holder's line


def take(out_dir: str, timeout_s: float = 60.0, dead_lease: int | None = None):
    """The lock of `out_dir`, taken; release() gives it back. `timeout_s`: how long this run's gs:// lease may go
    without a heartbeat before a new run takes it over (run.lock_timeout_s, recorded in the lease). `dead_lease`:
    check_free's answer, a gs:// lease this start already watched die, taken over without watching it again."""
    if not runfolder.is_url(out_dir):
        return FileLock(out_dir)
    if out_dir.startswith("gs://"):
        return GcsLease(out_dir, timeout_s, dead_lease)
    print(f"warning: run.out_dir={out_dir} is not locked (locks exist for local folders and gs:// only): a second "
          f"run started on it now would write into this one", file=sys.stderr)
    return NoLock()


def check_free(out_dir: str, timeout_s: float) -> int | None:
    """Refuse in one line where a live run holds out_dir's lock: a check before the processes of a run join
    (jax.distributed.initialize), which is a barrier of all of them, so that none of a launch has taken the lock
    yet. Joining first would connect a second launch's processes to the live run's coordinator (the same hosts and
    port), and JAX's coordination service ends a run one of whose processes "restarted": every process aborts, the
    steps since its last checkpoint lost.

    A local lock: a shared flock, taken and dropped at once (the processes of one launch do not refuse each other).
    A gs:// lease: watched as GcsLease watches it (reads only, on every process), up to its holder's timeout;
    dead, its generation is returned for process 0's take() to take over without a second wait."""
    if out_dir.startswith("gs://"):
        current = GcsLease.current(GcsLease.blob_of(out_dir))
        return None if current is None else GcsLease.watch(out_dir, timeout_s, *current)
    path = os.path.join(out_dir, NAME)
    if runfolder.is_url(out_dir) or not os.path.exists(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:  # a lock file this user may not read (another user's run left it)
        raise _unwritable(out_dir, e) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out_dir, _holder_in(fd)) from None
    except OSError as e:
        raise _no_locks(out_dir, e) from None
    finally:
        os.close(fd)
    return None


def _unwritable(out_dir: str, e: OSError) -> UserError:
    return UserError(f"run.out_dir={out_dir!r} cannot be created or written ({e.strerror}: {e.filename}); choose "
                     f"another --run.out_dir")


def _no_locks(out_dir: str, e: OSError) -> UserError:
    return UserError(f"run.out_dir={out_dir!r} is on a file system without file locks ({e.strerror}), which keep a "
                     f"second run out of the folder; mount it with them (Lustre: -o flock) or choose another "
                     f"--run.out_dir")


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"


def _holder_in(fd: int) -> str:
    """Who holds the lock, as its holder wrote it into the open lock file."""
    return os.read(fd, 1000).decode("utf-8", "replace").strip() or "another process"


def _in_use(out_dir: str, holder: str) -> UserError:
    return UserError(f"run folder {out_dir} is in use by {holder}; wait for that run to finish (or stop it), "
                     f"or give this one another run.out_dir")


def _timeout(written: str) -> float | None:
    """A lease's timeout_s as its holder wrote it; None where it holds none, or none a run could have set (an object
    edited by hand): the watcher's own timeout then serves."""
    try:
        timeout_s = float(written)
    except ValueError:
        return None
    return timeout_s if math.isfinite(timeout_s) and timeout_s > 0 else None


@contextlib.contextmanager
def _refusing_an_unusable_bucket(blob):
    """A run's first request to the bucket of its lease `blob`, where GCS's answer that the bucket does not exist
    (404), or that the run's credentials may not use it (403), is a UserError naming the bucket and the fix; so is
    a bucket the run cannot reach (no network to it: the client's retries ended, or its token could not be
    fetched)."""
    from google.api_core import exceptions
    from google.auth.exceptions import TransportError

    bucket = f"gs://{blob.bucket.name}"
    try:
        yield
    except (exceptions.RetryError, TransportError, OSError) as e:  # requests' ConnectionError is an OSError
        raise UserError(f"run.out_dir's bucket {bucket} could not be reached ({type(e).__name__}: {e}); check this "
                        f"machine's network to Google Cloud Storage, or fix run.out_dir") from None
    except exceptions.NotFound:
        raise UserError(f"run.out_dir's bucket {bucket} does not exist; create it (gcloud storage buckets create "
                        f"{bucket}) or fix run.out_dir") from None
    except exceptions.Forbidden as e:
        raise UserError(f"run.out_dir's bucket {bucket} refuses this run's credentials (403 Forbidden: {e.message}); "
                        f"fix the credentials (gcloud auth application-default login) or their permissions on the "
                        f"bucket, or fix run.out_dir") from None


class FileLock:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, NAME)
        self.made_folders = _missing_folders(out_dir)
        self.found = set() if self.made_folders else set(os.listdir(out_dir))  # what the start found there
        try:  # the run's first write: a folder that cannot be made (/proc, /sys, a read-only disk) is refused here
            os.makedirs(out_dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise _unwritable(out_dir, e) from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_in(self.fd)
            os.close(self.fd)
            raise _in_use(out_dir, holder) from None
        except OSError as e:  # ENOSYS, EOPNOTSUPP: the lock file it made goes, as the folders it made
            self._unmake_if_unused()
            os.close(self.fd)
            raise _no_locks(out_dir, e) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, _holder().encode())

    def release(self) -> None:
        if self.fd is not None:
            self._unmake_if_unused()
            os.close(self.fd)  # closing the file drops the lock
            self.fd = None

    def _unmake_if_unused(self) -> None:
        """A start that ended before writing anything (an init.from that is no checkpoint, a step the host's memory
        does not hold) leaves the run folder as it found it: what it added there goes where that is only its lock
        file and empty folders (checkpoints/) but a set-aside's, and so do the folders it made for run.out_dir. The
        lock is still held meanwhile, so a start that opened the file before it went is refused."""
        out_dir = os.path.dirname(self.path)
        added = [os.path.join(out_dir, name) for name in set(os.listdir(out_dir)) - self.found]
        if not all(path == self.path or _holds_no_file(path) and not runfolder.holds_set_aside_work(
                os.path.basename(path)) for path in added):
            return
        try:
            for path in added:
                if path == self.path:
                    os.unlink(path)
                else:
                    _remove_empty_folders(path)
            for folder in reversed(self.made_folders):
                os.rmdir(folder)
        except OSError:  # another start wrote into it meanwhile: its folder now
            return


def _holds_no_file(path: str) -> bool:
    return os.path.isdir(path) and not any(names for _, _, names in os.walk(path))


def _remove_empty_folders(folder: str) -> None:
    for inner, _, _ in sorted(os.walk(folder), reverse=True):  # innermost first
        os.rmdir(inner)


def _missing_folders(out_dir: str) -> list[str]:
    """The folders os.makedirs(out_dir) would make, outermost first."""
    missing, folder = [], os.path.abspath(out_dir)
    while not os.path.exists(folder):
        missing.insert(0, folder)
        folder = os.path.dirname(folder)
    return missing


class GcsLease:
    """`<out_dir>/.lock` as a GCS object, written only where it is absent (ifGenerationMatch=0) and rewritten by
    its holder every timeout_s/4 (each rewrite conditional on the generation it last wrote). It holds the holder's
    line and its timeout_s.

    A start that finds the object watches it for the holder's timeout_s, whatever its own: the holder renews on its
    own timeout's schedule, and a start that waited less could miss every renewal and take a live run's folder over,
    which a local lock never allows. Rewritten meanwhile, a live run holds it and the start is refused; unchanged
    that long, its holder died (kill -9, a lost VM) and the lease is taken over by a write conditional on the
    generation watched, so of two starts racing for a dead lease exactly one wins. Watching the object, not
    comparing timestamps, needs no agreement between the hosts' clocks. A run stopped cleanly deletes the object, so
    its restart waits for nothing; one killed waits its timeout_s."""

    def __init__(self, out_dir: str, timeout_s: float, dead_lease: int | None = None):
        from google.api_core import exceptions

        self.out_dir, self.timeout_s, self.gone = out_dir, timeout_s, exceptions.PreconditionFailed
        self.blob = self.blob_of(out_dir)
        self.generation = self._take(dead_lease)
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="jaxtrain-lease", daemon=True)
        self.heartbeat.start()

    @staticmethod
    def blob_of(out_dir: str):
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage  # gcsfs depends on google-cloud-storage: `pip install jaxtrain[gcs]`

        bucket, _, prefix = out_dir[len("gs://"):].partition("/")
        try:
            client = storage.Client()
        except DefaultCredentialsError:
            raise UserError(f"run.out_dir={out_dir} is in Google Cloud Storage, and this machine has no credentials "
                            f"for it: run `gcloud auth application-default login`, or set "
                            f"GOOGLE_APPLICATION_CREDENTIALS to a service account's key file") from None
        return client.bucket(bucket).blob(f"{prefix.rstrip('/')}/{NAME}".lstrip("/"))

    @staticmethod
    def current(blob):
        """The lease object as it is now, with its holder's line and timeout_s (None in a lease written before
        leases held it); None where there is no lease."""
        with _refusing_an_unusable_bucket(blob):  # jaxtrain.run's first request (a missing bucket reads as no lease)
            seen = blob.bucket.get_blob(blob.name)
        if seen is None:
            return None
        holder, _, written = seen.download_as_text().partition(TIMEOUT_FIELD)
        return seen, holder, _timeout(written)

    @staticmethod
    def watch(out_dir: str, timeout_s: float, seen, holder: str, holder_timeout_s: float | None) -> int:
        """`seen`'s generation once it has stood unchanged for its holder's timeout (this start's `timeout_s` where
        the lease does not say it): its holder is dead. Refused as soon as it is rewritten or deleted (its holder is
        alive, or was until just now)."""
        timeout_s = timeout_s if holder_timeout_s is None else holder_timeout_s
        print(f"run folder {out_dir} is locked by {holder}; watching the lock for up to {timeout_s:.0f} s to tell a "
              f"live run from a dead one", file=sys.stderr)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, timeout_s / 8))
            now = seen.bucket.get_blob(seen.name)
            if now is None or now.generation != seen.generation:
                raise _in_use(out_dir, holder)
        return seen.generation

    def _take(self, dead_lease: int | None) -> int:
        """The generation this run wrote the lease at: a new lease, or a dead run's taken over."""
        try:
            with _refusing_an_unusable_bucket(self.blob):  # the first write (torchref's first request): 404 here
                return self._write(0)
        except self.gone:
            if (mine := self._still_ours()) is not None:
                return mine
        current = self.current(self.blob)
        if current is None:  # released between the two calls
            return self._write(0)
        seen, holder, _ = current
        if seen.generation != dead_lease:  # not the lease check_free watched die: watch this one
            self.watch(self.out_dir, self.timeout_s, *current)
        try:
            generation = self._write(seen.generation)
        except self.gone:  # another start took it over first
            raise _in_use(self.out_dir, "another run that took over its dead lock") from None
        print(f"took over the lock of a run that stopped renewing it ({holder})", file=sys.stderr)
        return generation

    def _write(self, generation: int) -> int:
        self.written = f"{_holder()}{TIMEOUT_FIELD}{self.timeout_s}"
        self.blob.upload_from_string(self.written, if_generation_match=generation)
        return self.blob.generation

    def _still_ours(self) -> int | None:
        """After a write refused as "the lease moved on" (412): the lease's generation where it holds what this run
        last wrote, else None. google-cloud-storage retries a conditional upload whose answer was lost, and the
        retry finds the generation that the write itself, applied, moved on. The holder line (pid, host, time)
        tells this run's write from another's."""
        seen = self.blob.bucket.get_blob(self.blob.name)
        try:
            text = seen.download_as_text(if_generation_match=seen.generation) if seen is not None else None
        except self.gone:  # rewritten between the two reads: not by this run, whose writes wait for their answer
            return None
        return seen.generation if text == self.written else None

    def _renewed(self) -> int:
        try:
            return self._write(self.generation)
        except self.gone:
            if (mine := self._still_ours()) is None:
                raise
            return mine

    def _beat(self) -> None:
        while not self.stopped.wait(self.timeout_s / 4):
            try:
                self.generation = self._renewed()
            except self.gone:
                print(f"warning: the lock of {self.out_dir} was taken over by another run (this one did not renew "
                      f"it for {self.timeout_s:.0f} s); both now write into the folder", file=sys.stderr)
                return
            except Exception as e:  # a network error: the next beat tries again, well before the timeout
                print(f"warning: could not renew the lock of {self.out_dir}: {e}", file=sys.stderr)

    def release(self) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.heartbeat.join()
        try:
            self.blob.delete(if_generation_match=self.generation)
        except Exception as e:  # taken over, or unreachable: the lease times out on its own
            print(f"warning: could not delete the lock of {self.out_dir}: {e}", file=sys.stderr)


class NoLock:
    def release(self) -> None:
        pass
