"""For every test folder: one JAX persistent compilation cache for the session, shared by the pytest process and
every run it starts in a subprocess.

Most end-to-end tests start `python -m jaxtrain.run` on the same small configs, and each process used to compile
the same train, eval and init steps again: a tiny.yaml run of 20 steps took 21.6 s fresh and 11.9 s with the cache
warm (same losses: the cache holds what the compiler would have produced). The folder is new for each session, so
nothing compiled by another version of the code is ever loaded. A JAX_COMPILATION_CACHE_DIR set by the caller wins.
pytest-xdist's workers start after the controller's pytest_configure, so they inherit its folder and share it.

And how many pytest-xdist workers `-n auto` (pyproject's addopts) starts, and how many threads torch takes in each
(THREAD_ENV).
"""

import os
import shutil
import tempfile

import pytest

CACHE_ENV = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.1",  # the steps, not the many one-op jits (not worth a file)
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
# torch's intra-op threads (OpenMP's; OpenBLAS's under numpy too), in the workers and every run they start: one. The
# workers are one a core already, and an OpenMP pool spinning on a core another worker holds is slow: a torchref run
# of 40 tiny steps took 4.3 and 8.0 s with one thread, 17.6 and 50.1 s with two, beside one busy process on this
# 2-core machine (3.7 s either way alone).
THREAD_ENV = {"OMP_NUM_THREADS": "1"}
_made: list[str] = []


def pytest_configure(config):
    """Before any test module imports jax (jax reads these variables when it is imported)."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _made.append(tempfile.mkdtemp(prefix="jaxtrain-test-compile-cache-"))
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _made[0]
    for key, value in {**CACHE_ENV, **THREAD_ENV}.items():
        os.environ.setdefault(key, value)


def pytest_unconfigure(config):
    for folder in _made:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # a pytest without pytest-xdist (the GPU image) has no such hook
def pytest_xdist_auto_num_workers(config):
    """One worker a core and one more for the default suite, whose workers also wait (for the runs they start to
    import jax, for checkpoints to be written, for a signal to land): on this 2-core EPYC, 3 workers kept 1.93 cores
    busy on average (`/usr/bin/time -v`: 1,752 s of CPU in 907 s). A modest gain, within this machine's run-to-run
    spread: the suite took 900-1,122 s in four runs on 3 workers (mean 979 s), 787-1,161 s in five on 2 (mean 1,018
    s), all on 2026-12-02. One a core for any other selection (`-m slow`, CI's: its cases each keep a core busy for
    minutes). As many as the memory holds: a worker with the runs it starts reaches ~2.5 GB (the largest process of
    either, `/usr/bin/time -v`), so one per 4 GiB. PYTEST_XDIST_AUTO_NUM_WORKERS, when set, is left to xdist's own
    hook (=2: one a core again, here)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    waiting = 1 if config.getoption("markexpr") == "not slow" else 0  # pyproject's addopts, unless -m says otherwise
    return max(1, min(len(os.sched_getaffinity(0)) + waiting, int(memory_gib // 4)))
