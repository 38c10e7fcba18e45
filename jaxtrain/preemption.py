"""Stopping on a signal, in both backends (pure Python: torchref imports it, and `python -m jaxtrain.run` installs it
before it imports jax, so that a signal during start-up is handled too).

SIGTERM (what TPU/GCE preemption, SLURM and Kubernetes send, with a grace period) and SIGINT (Ctrl-C) mean: finish
the step in flight, save it, exit 0 naming the step and the resume command. Before the first step there is nothing
new to save: the run stops at the end of the start-up phase it is in. A second signal means now: one line, exit
128 + signal, no traceback; a save it interrupts never becomes a checkpoint (Orbax and torchref write to a
temporary name and rename only a complete one), and the next start cleans what it left.

On several processes each sees only its own signal (a preemption may reach one host); jaxtrain's loop agrees on the
request through a collective (mesh.any_process) so that every host saves the same step. After the last save a
signal stops one process at once, but one of several ends with the others (nothing_left_to_save).
"""

import os
import signal
import sys

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self):
        self.requested, self.signum = False, 0
        self.training = False  # whether a step may be in flight (training_started), or start-up still runs
        self.saved_all: str | None = None  # once the run's last save is done: what to say when a signal stops it
        self.several = False  # one of several processes (nothing_left_to_save)
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.saved_all is not None:
            if not self.several or self.requested:
                _exit_now(signum, f"\n{name}: stopping now; {self.saved_all}")
            self.requested, self.signum = True, signum  # one of several: its peers' shutdown waits for it
            print(f"\n{name}: {self.saved_all}; ending with the other processes, whose shutdown waits for this "
                  f"one ({name} again to stop at once)", file=sys.stderr, flush=True)
            return
        if self.requested:
            _exit_now(signum, f"\n{name} again: stopping now, without saving this step (the checkpoints already "
                              f"saved are intact)")
        self.requested, self.signum = True, signum
        when = ("once the step in flight is done and saved" if self.training else
                "at the end of this start-up phase, before the first step")
        print(f"\n{name}: stopping {when} ({name} again to stop at once)", file=sys.stderr, flush=True)

    def training_started(self) -> None:
        """Start-up is over: a signal from now on stops after the step in flight, saved."""
        self.training = True

    def nothing_left_to_save(self, saved: str, several: bool = False) -> None:
        """After the run's last save (the summary line and the end-of-run sample are all that is left): from now
        on a signal stops the process at once, with one line ending in `saved`, and exit 128 + signal; one that
        came during the last save's wait does so now. One of `several` processes instead says so and ends with
        the others: every process must reach JAX's shutdown barrier, and the others, left waiting for one that
        died, abort minutes later (a finished run reported failed)."""
        self.saved_all, self.several = saved, several
        if self.requested and not several:
            _exit_now(self.signum, f"{signal.Signals(self.signum).name}: stopping now; {saved}")

    def reclaim(self) -> None:
        """Handle the signals again after something took them: jax.distributed.initialize installs TSL's
        preemption notifier as the SIGTERM handler, which would note the signal for its own sync point and keep
        training; jaxtrain agrees on a stop through its own collective instead (agreed_stop.AgreedStop)."""
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def _exit_now(signum: int, line: str):
    print(line, file=sys.stderr, flush=True)
    os._exit(128 + signum)


_installed: StopRequest | None = None


def install() -> StopRequest:
    """The process's StopRequest, installed on first use (the main thread only: Python's rule for signals)."""
    global _installed
    if _installed is None:
        _installed = StopRequest()
    return _installed


def reclaim() -> None:
    """After jax.distributed.initialize: the StopRequest, if one is installed, takes the signals back."""
    if _installed is not None:
        _installed.reclaim()


def uninstall() -> None:
    """Give the signals back (a run called in-process, as the tests do, must not leave its handlers behind)."""
    global _installed
    if _installed is not None:
        _installed.restore()
        _installed = None
