"""hostmem: the command lines start over once with glibc's malloc on huge pages, and glibc and the kernel honour it."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxtrain import hostmem

needs_glibc = pytest.mark.skipif(not hostmem.glibc_has_hugetlb(), reason="no glibc >= 2.35 (no hugetlb tunable)")

# Prints its PID and GLIBC_TUNABLES after use_huge_pages(), then how much of a freshly malloc'd and written 64 MiB
# block the kernel backs with huge pages (AnonHugePages of the whole process, kB).
SCRIPT = r"""
import ctypes, os
from jaxtrain import hostmem
hostmem.use_huge_pages()
print(os.getpid(), repr(os.environ.get("GLIBC_TUNABLES")), flush=True)
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
with open("/proc/self/smaps_rollup") as f:
    print(next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")))
"""


def run_script(**env) -> tuple[int, list[str]]:
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], env={**clean, **env}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    return proc.pid, out.split()


def transparent_huge_pages() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


@needs_glibc
def test_the_process_starts_over_once_with_the_tunable():
    pid, (printed_pid, tunables, _) = run_script()
    assert int(printed_pid) == pid  # exec, not a child: signals and launchers see the same process
    assert tunables == repr(hostmem.TUNABLE)  # and only the second start printed


@needs_glibc
def test_a_tunable_the_user_set_is_left_alone():
    pid, (printed_pid, tunables, _) = run_script(GLIBC_TUNABLES="")
    assert int(printed_pid) == pid and tunables == repr("")


@needs_glibc
@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
                    or transparent_huge_pages() != "madvise",
                    reason="transparent huge pages are not in madvise mode, where only a tunable gives them")
def test_glibc_and_the_kernel_back_malloc_with_huge_pages():
    _, (_, _, huge_kb) = run_script()
    _, (_, _, huge_kb_without) = run_script(GLIBC_TUNABLES="")
    assert int(huge_kb_without) == 0
    assert int(huge_kb) >= 32 << 10  # most of the 64 MiB block (2 MiB-aligned pages inside it)


@needs_glibc
@pytest.mark.parametrize("module,flags", [("jaxtrain.run", ["--run.dry_run=true"]),
                                          ("benchmarks.profile", ["--steps=1"])])
def test_the_command_lines_execute_themselves_with_the_tunable(tmp_path, module, flags):
    """The real command lines, the trainer's and the profile's (which traces the step as the trainer runs it):
    their environment, read from /proc while they run (each restarts within milliseconds; the wait is bounded)."""
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-m", module, "--config", "configs/tiny.yaml", *flags,
                             f"--data.cache_dir={tmp_path}"], env=clean,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, environ = time.monotonic() + 30, b""
        while time.monotonic() < deadline and b"GLIBC_TUNABLES" not in environ and proc.poll() is None:
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                environ = f.read()
            time.sleep(0.05)
        assert f"GLIBC_TUNABLES={hostmem.TUNABLE}".encode() in environ.split(b"\0")
    finally:
        proc.kill()
        proc.wait()


# A Ctrl-C as the process re-executes itself: sent from inside os.execv, before the exec proper (the old image's
# last moment). The new image installs its handler, then takes the signals; the handler must see the SIGINT.
SIGNAL_SCRIPT = r"""
import os, signal
from jaxtrain import hostmem
if not os.environ.get("GLIBC_TUNABLES"):
    real_execv = os.execv
    def execv_after_a_ctrl_c(*args):
        os.kill(os.getpid(), signal.SIGINT)
        real_execv(*args)
    os.execv = execv_after_a_ctrl_c
hostmem.use_huge_pages(keep_blocked=True)
seen = []
signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
hostmem.release_signals()
print(seen, os.environ.get("JAXTRAIN_STOP_SIGNALS_BLOCKED"), flush=True)
"""


@needs_glibc
def test_a_ctrl_c_during_the_re_execution_reaches_the_new_images_handler():
    """One was seen lost: a run sent SIGINT at 0.3 s trained to its end (Python's C handler had noted it, and the
    exec dropped the old image before it ran). Blocked through the exec, it waits for the new image's handler
    (jaxtrain.run's preemption handler, installed before release_signals); the block does not outlive it."""
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT], env=clean, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.split("\n")[0] == f"[{int(signal.SIGINT)}] None", proc
