"""Host memory: glibc's malloc on transparent huge pages, which has to be chosen before the process starts.

XLA:CPU mallocs a step's buffers and frees them after it; glibc hands large blocks back to the kernel and maps
fresh ones the next step, which faults every 4 KiB page in again: on configs/small.yaml here, ~820,000 minor faults
and 2.6 s of system time a step (benchmarks/NOTES.md). With glibc's `glibc.malloc.hugetlb=1` tunable, malloc asks
for transparent huge pages (madvise), 2 MiB a fault: ~5,000 faults a step. glibc reads its tunables only when a
process starts, so the command lines (`python -m jaxtrain.run`, `python -m benchmarks.run`) execute themselves once
more with it set, first thing: the same PID and arguments, so signals, SLURM and TPU runtimes see one process.
"""

import os
import platform
import signal
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
MIN_GLIBC = (2, 35)  # the first glibc with the hugetlb tunable
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
_BLOCKED = "JAXTRAIN_STOP_SIGNALS_BLOCKED"  # set across the re-execution: its stop signals wait, blocked


def use_huge_pages(keep_blocked: bool = False) -> None:
    """Re-execute this process with GLIBC_TUNABLES=glibc.malloc.hugetlb=1. Nothing happens where GLIBC_TUNABLES is
    set already (by the re-execution, or by the user: `GLIBC_TUNABLES=` turns this off), or where the C library is
    not glibc 2.35 or newer. Call it before anything else: the process starts over from its first line.

    SIGINT and SIGTERM are blocked through the exec, which keeps them pending: a Ctrl-C that Python's C handler had
    noted just before the exec was lost with the old image (a run then trained to its end). The new image takes
    them where it calls this again: at once, or, with `keep_blocked`, at release_signals, once its own handler is in
    place (jaxtrain.run's preemption handler)."""
    if os.environ.get(_BLOCKED):
        if not keep_blocked:
            release_signals()
        return
    if "GLIBC_TUNABLES" in os.environ or not glibc_has_hugetlb():
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # a signal before this: handled here, before the exec
    os.environ["GLIBC_TUNABLES"], os.environ[_BLOCKED] = TUNABLE, "1"
    try:
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    except OSError:  # no exec: on as this process, its signals taken again
        del os.environ["GLIBC_TUNABLES"]
        release_signals()
        raise


def release_signals() -> None:
    """Take the stop signals that use_huge_pages blocked through the re-execution (a pending one arrives now)."""
    if os.environ.pop(_BLOCKED, None):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def glibc_has_hugetlb() -> bool:
    library, version = platform.libc_ver()
    try:
        return library == "glibc" and tuple(int(n) for n in version.split(".")[:2]) >= MIN_GLIBC
    except ValueError:
        return False
