"""A run folder belongs to one run at a time: `<out_dir>/.lock`, held for the whole run by both backends (pure
Python: torchref imports it). On several processes only process 0 holds it (the others write into the same folder
as part of the same run). A refused start touches nothing else in the folder, and the lock says who holds it.

On a local disk (or a network file system with flock): an exclusive flock on an open file. The kernel drops it when
the process ends however it ends (kill -9 included), so a killed run never leaves the folder locked.

In a gs:// folder there is no flock and nobody drops a lock for a dead process: a lease instead (GcsLease).
Another object store (s3://, ...) gets no lock, and a warning says so.
"""

import fcntl
import os
import socket
import sys
import threading
import time

from jaxtrain import runfolder
from jaxtrain.errors import UserError

NAME = ".lock"


def take(out_dir: str, timeout_s: float = 60.0):
    """The lock of `out_dir`, taken; release() gives it back. `timeout_s`: how long a gs:// lease may go without a
    heartbeat before a new run takes it over (run.lock_timeout_s)."""
    if not runfolder.is_url(out_dir):
        return FileLock(out_dir)
    if out_dir.startswith("gs://"):
        return GcsLease(out_dir, timeout_s)
    print(f"warning: run.out_dir={out_dir} is not locked (locks exist for local folders and gs:// only): a second "
          f"run started on it now would write into this one", file=sys.stderr)
    return NoLock()


def check_free(out_dir: str) -> None:
    """Refuse in one line where a live run holds out_dir's local lock: a check before the processes of a run join
    (jax.distributed.initialize), which is a barrier of all of them, so that none of a launch has taken the lock
    yet. Joining first would connect a second launch's processes to the live run's coordinator (the same hosts and
    port), and JAX's coordination service ends a run one of whose processes "restarted": every process aborts, the
    steps since its last checkpoint lost. A shared lock, taken and dropped at once: the processes of one launch do
    not refuse each other. A gs:// lease cannot be told live or dead without watching it for run.lock_timeout_s:
    there the lock is taken after the join only."""
    path = os.path.join(out_dir, NAME)
    if runfolder.is_url(out_dir) or not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(out_dir, _holder_in(fd)) from None
    finally:
        os.close(fd)


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"


def _holder_in(fd: int) -> str:
    """Who holds the lock, as its holder wrote it into the open lock file."""
    return os.read(fd, 1000).decode("utf-8", "replace").strip() or "another process"


def _in_use(out_dir: str, holder: str) -> UserError:
    return UserError(f"run folder {out_dir} is in use by {holder}; wait for that run to finish (or stop it), "
                     f"or give this one another run.out_dir")


class FileLock:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, NAME)
        try:  # the run's first write: a folder that cannot be made (/proc, /sys, a read-only disk) is refused here
            os.makedirs(out_dir, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"run.out_dir={out_dir!r} cannot be created or written ({e.strerror}: {e.filename}); "
                            f"choose another --run.out_dir") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_in(self.fd)
            os.close(self.fd)
            raise _in_use(out_dir, holder) from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, _holder().encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the lock
            self.fd = None


class GcsLease:
    """`<out_dir>/.lock` as a GCS object, written only where it is absent (ifGenerationMatch=0) and rewritten by
    its holder every timeout_s/4 (each rewrite conditional on the generation it last wrote).

    A start that finds the object watches it, up to timeout_s: rewritten meanwhile, a live run holds it and the
    start is refused; unchanged that long, its holder died (kill -9, a lost VM) and the lease is taken over by a
    write conditional on the generation watched, so of two starts racing for a dead lease exactly one wins.
    Watching the object, not comparing timestamps, needs no agreement between the hosts' clocks. A run stopped
    cleanly deletes the object, so its restart waits for nothing; one killed waits timeout_s."""

    def __init__(self, out_dir: str, timeout_s: float):
        from google.api_core import exceptions  # gcsfs depends on google-cloud-storage: `pip install jaxtrain[gcs]`
        from google.cloud import storage

        self.out_dir, self.timeout_s, self.gone = out_dir, timeout_s, exceptions.PreconditionFailed
        bucket, _, prefix = out_dir[len("gs://"):].partition("/")
        self.blob = storage.Client().bucket(bucket).blob(f"{prefix.rstrip('/')}/{NAME}".lstrip("/"))
        self.generation = self._take(exceptions)
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="jaxtrain-lease", daemon=True)
        self.heartbeat.start()

    def _take(self, exceptions) -> int:
        """The generation this run wrote the lease at: a new lease, or a dead run's taken over."""
        try:
            return self._write(0)
        except exceptions.PreconditionFailed:
            pass
        seen = self.blob.bucket.get_blob(self.blob.name)
        if seen is None:  # released between the two calls
            return self._write(0)
        holder = seen.download_as_text()
        print(f"run folder {self.out_dir} is locked by {holder}; watching the lock for up to {self.timeout_s:.0f} s "
              f"to tell a live run from a dead one", file=sys.stderr)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            time.sleep(min(1.0, self.timeout_s / 8))
            now = self.blob.bucket.get_blob(self.blob.name)
            if now is None or now.generation != seen.generation:
                raise _in_use(self.out_dir, holder)
        try:
            generation = self._write(seen.generation)
        except exceptions.PreconditionFailed:  # another start took it over first
            raise _in_use(self.out_dir, "another run that took over its dead lock") from None
        print(f"took over the lock of a run that stopped renewing it ({holder})", file=sys.stderr)
        return generation

    def _write(self, generation: int) -> int:
        self.blob.upload_from_string(_holder(), if_generation_match=generation)
        return self.blob.generation

    def _beat(self) -> None:
        while not self.stopped.wait(self.timeout_s / 4):
            try:
                self.generation = self._write(self.generation)
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
