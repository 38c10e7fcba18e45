"""Whether a run stops after this step, agreed by every process of it (run.py's loop asks after each step).

A signal (preemption.py) reaches one process, maybe one host of several; a save may fail in the background on one.
Every host must still save the same step, or end at the same one: the processes vote through a collective.
"""

import jax
import numpy as np

from jaxtrain import checkpoint as checkpoint_lib
from jaxtrain import mesh as mesh_lib
from jaxtrain import preemption


class StoppedInStartUp(Exception):
    """A signal before the first step: nothing trained, nothing to save."""


class AgreedStop:
    """Whether the run stops after this step, the same answer on every process; and whether it ends at once, a
    save having failed in the background on any of them. One process: its own signal and failure. Several:
    mesh.any_process over every process's two flags, dispatched after each step and read after the next, so the
    loop never waits for it and every host saves the same step (a preemption may signal one host only)."""

    def __init__(self, stop: preemption.StopRequest, mesh):
        self.stop, self.mesh, self.several = stop, mesh, jax.process_count() > 1
        self.vote = None
        self.failed = None  # this process's failed save (a UserError), kept until every process has heard

    def check_start_up(self) -> None:
        """Between start-up phases: raise StoppedInStartUp when any process was signalled."""
        if self.requested_now():
            raise StoppedInStartUp

    def requested_now(self) -> bool:
        """Whether any process was signalled, waiting for every process's answer: where all of them sync anyway
        (start-up, an evaluation's end)."""
        return bool(mesh_lib.any_process(self.stop.requested, self.mesh)) if self.several else self.stop.requested

    def after_step(self, checkpointer: checkpoint_lib.Checkpointer) -> bool:
        """Whether to save this step and stop; raises the UserError of a save that failed instead."""
        self.failed = self.failed or checkpointer.background_failure()
        if not self.several:
            if self.failed:
                raise self.failed
            return self.stop.requested
        stop, failed = (False, False) if self.vote is None else (bool(x) for x in np.asarray(self.vote))
        self.vote = mesh_lib.any_process((self.stop.requested, self.failed is not None), self.mesh)
        if failed:  # every process ends at the same step; the failure's own words are in its process's output
            raise self.failed or checkpointer.cannot_write("on another process of this run; its error names why")
        return stop
