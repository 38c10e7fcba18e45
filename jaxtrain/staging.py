"""Staging folders: where a prepare writes a data folder's files before they replace the folder's own (prepare.py),
and where the embedded corpus is written before it is renamed into place (embedded_corpus.py).

A prepare killed with -9 (or a second Ctrl-C) runs no clean-up and leaves its staging folder, which may hold
gigabytes of tokens; the next prepare into the same folder removes it. Whether its writer is dead is asked of the
folder itself: each live writer holds an exclusive flock on it, which the kernel drops when the process ends, however
it ends. The process id in the folder's name is for people: a test of it (os.kill(pid, 0)) took a reused id for the
writer, for good (in a container the new prepare is often process 1 itself, which is always alive).

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

_held: dict[str, int] = {}  # staging folder -> the descriptor whose flock marks its writer alive


def make(out: str, *, refuse_live: bool) -> str:
    """A new staging folder in `out`, held by this process until release(), after removing those that killed
    writers left there (remove_killed). Made by os.mkdir, with the umask's permissions, those of any folder the user
    makes: tempfile.mkdtemp's 0700 kept a shared cache's other users out of the folder it is renamed into."""
    remove_killed(out, refuse_live)
    staging = os.path.join(out, f"{PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(8)}")
    os.mkdir(staging)
    descriptor = os.open(staging, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    _held[staging] = descriptor
    return staging


def release(staging: str) -> None:
    """Remove the staging folder (what is left of it) and let go of its flock."""
    shutil.rmtree(staging, ignore_errors=True)
    descriptor = _held.pop(staging, None)
    if descriptor is not None:
        os.close(descriptor)


def remove_killed(out: str, refuse_live: bool) -> None:
    """Delete the staging folders in `out` whose writer on this host is gone. refuse_live: refuse while another
    writer is writing into `out`, whose files and this one's would replace each other's one by one (else leave its
    folder be: the embedded corpus, where the loser of a race drops its copy). A staging folder of another host is
    left: its flock may not reach this one (a shared file system)."""
    host = socket.gethostname()
    for name in sorted(os.listdir(out)):
        folder = os.path.join(out, name)
        owner = re.fullmatch(rf"{re.escape(PREFIX + host)}-(\d+)-\w+", name)
        if not (owner and os.path.isdir(folder)) or folder in _held:
            continue
        if _being_written(folder):
            if refuse_live:
                raise UserError(f"another prepare (process {owner.group(1)}) is writing into --out {out} (its "
                                f"{name}); wait for it to finish, or choose another --out")
            continue
        shutil.rmtree(folder)
        print(f"prepare: removed {folder}, left by a prepare that was killed", file=sys.stderr)


def _being_written(folder: str) -> bool:
    """Whether a live process holds the folder's flock (make). One this user cannot open is left to its owner."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except (FileNotFoundError, PermissionError):  # its writer finished meanwhile; another user's
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(descriptor)
    return False
