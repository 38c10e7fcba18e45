"""A run folder belongs to one run at a time: `<out_dir>/.lock`, held for the whole run by both backends (pure
Python: torchref imports it).

An exclusive flock on an open file: the kernel drops it when the process ends however it ends (kill -9 included),
so a killed run never leaves the folder locked, and a stale file is simply locked again. The file also says who
holds it, for the message of a refused start. A refused start touches nothing else in the folder. On several
processes only process 0 holds it (the others write into the same folder as part of the same run). flock works on
local disks; object stores (run.out_dir=gs://...) and network file systems need the pod issue's own lock.
"""

import fcntl
import os
import socket
import time

from jaxtrain.errors import UserError

NAME = ".lock"


class RunLock:
    def __init__(self, out_dir: str):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, NAME)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 1000).decode("utf-8", "replace").strip() or "another process"
            os.close(self.fd)
            raise UserError(f"run folder {out_dir} is in use by {holder}; wait for that run to finish (or stop it), "
                            f"or give this one another run.out_dir") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                 .encode())

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the file drops the lock
            self.fd = None
