"""One process per benchmark row, driven in turns from the parent.

A row's process builds its step (benchmarks/steps.py), warms it up and then waits; the parent asks each in turn
for a few timed steps (round-robin, so drift of a shared machine falls on every row alike), and at the end for its
peak memory. Only the row asked is running at any moment, so rows never compete for cores, and each has its own
allocator, thread pools and peak RSS. Processes are spawned, not forked: jax and torch are not fork-safe.
"""

import multiprocessing
import os
import time
from typing import NamedTuple

import numpy as np

from jaxtrain import data as data_lib

WARMUP_STEPS = 2  # the first compiles (jit, torch.compile) and the second settles the allocator


class Row(NamedTuple):
    name: str
    builder: str  # a function of benchmarks.steps
    cfg: object  # the resolved config this row runs
    args: tuple = ()


def tokens(cfg, synthetic: bool) -> data_lib.TokenData:
    """The config's token data, or uniform random ids over model.vocab_size (throughput does not depend on
    which tokens they are; GPT-2 runs need no prepared OpenWebText)."""
    if not synthetic:
        return data_lib.load(cfg.data, cfg.model.seq_len)
    ids = np.random.default_rng(0).integers(0, cfg.model.vocab_size, 2**22, dtype=np.uint32)
    return data_lib.TokenData(ids, ids, cfg.model.vocab_size, "synthetic", "synthetic", "synthetic")


def _serve(conn, row: Row, synthetic: bool) -> None:
    from benchmarks import steps
    builder = getattr(steps, row.builder)
    start = time.perf_counter()
    try:
        timed = builder(row.cfg, *row.args) if row.builder.endswith("matmul") else builder(
            row.cfg, tokens(row.cfg, synthetic), *row.args)
        first = timed.step()
        for _ in range(WARMUP_STEPS - 1):
            timed.step()
    except Exception as e:  # out of memory, a kernel that does not exist here: the row says so, the rest runs
        conn.send(_error(e))
        return
    conn.send({"first_step_s": first, "warmup_s": time.perf_counter() - start})
    while (request := conn.recv()) is not None:
        try:
            conn.send([timed.step() for _ in range(request)] if request > 0 else timed.peak_memory())
        except Exception as e:  # a timed step that fails (memory a later step needs): the row's answer
            conn.send(_error(e))
            return


def _error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]}


class Worker:
    """A row's process: `warmup` says what its start cost (or holds the "error" that ended it), `times(n)` runs
    n timed steps, `peak_memory()`; each answers {"error": ...} instead where the process failed or died."""

    def __init__(self, row: Row, synthetic: bool):
        self.row = row
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child, row, synthetic), name=row.name, daemon=True)
        self._process.start()
        self.warmup = self._receive()
        if "error" in self.warmup:
            self._process.join(timeout=60)

    def times(self, n: int) -> list[float] | dict:
        return self._request(n)

    def peak_memory(self) -> int | dict:
        return self._request(0)

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(timeout=60)

    def _request(self, request: int):
        try:
            self._conn.send(request)
        except OSError:  # the process is gone (a broken pipe): _receive says how it ended
            pass
        return self._receive()

    def _receive(self):
        try:
            while not self._conn.poll(1.0):
                if not self._process.is_alive():
                    break
            else:
                return self._conn.recv()
        except (EOFError, OSError):
            pass
        self._process.join(timeout=60)  # killed (out of memory), or a crash below Python
        return {"error": f"its process died (exit {self._process.exitcode}); its output above says why"}


def quiet_gpu_allocators() -> None:
    """Several rows share one GPU: jax must not take 75% of it at start (XLA_PYTHON_CLIENT_PREALLOCATE), so that
    each process holds what it uses. Set before the processes start, which inherit it."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
