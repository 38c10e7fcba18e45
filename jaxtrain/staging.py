"""Staging folders: where a prepare writes a data folder's files before they replace the folder's own (prepare.py),
and where the embedded corpus is written before it is renamed into place (embedded_corpus.py).

A prepare killed with -9 (or a second Ctrl-C) runs no clean-up and leaves its staging folder, which may hold
gigabytes of tokens; the next prepare into the same folder removes it. Whether its writer is dead is asked of a lock
file beside the folder (`<folder>.lock`): each live writer holds an exclusive flock on it, taken before the folder
is made, which the kernel drops when the process ends, however it ends. The process id in the folder's name is for
people: a test of it (os.kill(pid, 0)) took a reused id for the writer, for good (in a container the new prepare is
often process 1 itself, which is always alive). A regular file opened for writing, not the folder: on NFS, Linux
takes a flock as a byte-range lock, which needs a file open for writing.

Standard library only: jaxtrain.data, which torchref imports, imports this module through prepare.py.
"""

import fcntl
import os
import re
import secrets
import shutil
import socket
import sys

from jaxtrain.errors import UserError

PREFIX = ".prepare-"  # + host-pid-random: the staging folder of the prepare of that process
LOCK = ".lock"  # + on the staging folder's name: the file whose flock marks its writer alive

_held: dict[str, int] = {}  # staging folder -> the descriptor of its lock file, flocked


def make(out: str, *, refuse_live: bool) -> str:
    """A new staging folder in `out`, held by this process until release(), after removing those that killed
    writers left there (remove_killed). Its lock is taken before the folder exists, so that no other process sees
    the folder unheld. Made by os.mkdir, with the umask's permissions, those of any folder the user makes:
    tempfile.mkdtemp's 0700 kept a shared cache's other users out of the folder it is renamed into."""
    remove_killed(out, refuse_live)
    staging = os.path.join(out, f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}")
    descriptor = os.open(staging + LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.mkdir(staging)
    except BaseException:
        os.close(descriptor)
        os.unlink(staging + LOCK)
        raise
    _held[staging] = descriptor
    return staging


def release(staging: str) -> None:
    """Remove the staging folder (what is left of it) and its lock file, and let go of the lock."""
    shutil.rmtree(staging, ignore_errors=True)
    descriptor = _held.pop(staging, None)
    if descriptor is not None:
        _unlink(staging + LOCK)
        os.close(descriptor)


def remove_killed(out: str, refuse_live: bool) -> None:
    """Delete the staging folders in `out` that a writer on this host left when it was killed, and their lock
    files. refuse_live: refuse while another writer is writing into `out`, whose files and this one's would replace
    each other's one by one (else leave its folder be: the embedded corpus, where the loser of a race drops its
    copy). A staging folder of another host is left, its flock possibly not seen from here (a shared file system),
    and so is one of another user, who alone may delete it (said on stderr)."""
    host = socket.gethostname()
    for name in sorted(os.listdir(out)):
        folder = os.path.join(out, name)
        owner = re.fullmatch(rf"{re.escape(PREFIX + host)}-(\d+)-\w+", name)
        if not (owner and os.path.isdir(folder)) or folder in _held:
            continue
        uid = _owner(folder)
        if uid is None:  # its writer finished meanwhile
            continue
        if uid != os.getuid():
            print(f"prepare: left {folder}, a staging folder of another user's prepare, to its owner",
                  file=sys.stderr)
            continue
        descriptor = _lock_if_dead(folder)
        if descriptor is None:  # live
            if refuse_live:
                raise UserError(f"another prepare (process {owner.group(1)}) is writing into --out {out} (its "
                                f"{name}); wait for it to finish, or choose another --out")
            continue
        try:  # the lock held until both are gone, so that no other process removes them meanwhile
            shutil.rmtree(folder, ignore_errors=True)
            _unlink(folder + LOCK)
        finally:
            if descriptor >= 0:
                os.close(descriptor)
        print(f"prepare: removed {folder}, left by a prepare that was killed", file=sys.stderr)


def _lock_if_dead(folder: str) -> int | None:
    """None where a live process holds the folder's lock, or where the lock cannot be asked (a file system without
    locks: the folder is left, as a live one); else the lock's descriptor, now this process's (-1: the folder has no
    lock file, as a killed writer of an earlier jaxtrain left it)."""
    try:
        descriptor = os.open(folder + LOCK, os.O_RDWR)
    except FileNotFoundError:
        return -1
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held
        os.close(descriptor)
        return None
    return descriptor


def _owner(folder: str) -> int | None:
    """The folder's owner's user id; None where it is gone."""
    try:
        return os.stat(folder).st_uid
    except FileNotFoundError:
        return None


def _unlink(file: str) -> None:
    try:
        os.unlink(file)
    except FileNotFoundError:
        pass
