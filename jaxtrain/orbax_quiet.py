"""What orbax prints around a failure, brought down to the one line jaxtrain's own error says (checkpoint.py).

A save that fails in orbax's background threads (a full disk, a bucket refusing a write) is logged by orbax with
three tracebacks of ~60 lines each. The writes still in flight then end, after the run's error line, in asyncio's
"Task exception was never retrieved" reports (~80 on the tiny model), and their tensorstore callbacks, finding the
event loop orbax closed on the first failure, each print an "Event loop is closed" traceback (160 on a full 200 KiB
tmpfs with the tiny model; a read that fails one array does the same). Here: a log filter, and event loops that
finish their pending tasks before they close, while any checkpoint is open or read.
"""

import asyncio
import contextlib
import logging
import os

_ORBAX = f"{os.sep}orbax{os.sep}"


def filter_logs() -> None:
    """one_line_records on absl's logger (orbax's) and asyncio's, for the process's life: orbax's threads may log
    after a Checkpointer's close. Adding it again changes nothing (logging keeps one of each filter)."""
    for logger in ("absl", "asyncio"):
        logging.getLogger(logger).addFilter(one_line_records)


# Orbax's warnings about a step folder it then fails to read, which jaxtrain's own line names ("checkpoint ... cannot
# be read (...)") with orbax's error: said twice otherwise (an empty _CHECKPOINT_METADATA, and one of bytes that are
# not UTF-8, found by test_fuzz)
_SAID_BY_THE_READ = ("Failed to json parse Metadata file", "Failed to read Metadata file")


def one_line_records(record: logging.LogRecord) -> bool:
    """Orbax's records keep their one line, without the traceback, but for what the failed read says anyway;
    asyncio's reports of orbax's tasks go."""
    if record.name == "asyncio":
        return not (record.exc_info and _ORBAX in record.getMessage())
    if _ORBAX in record.pathname:
        record.exc_info, record.exc_text = None, None
        return not record.getMessage().startswith(_SAID_BY_THE_READ)
    return True


class _DrainingLoop(asyncio.SelectorEventLoop):
    def close(self):
        pending = asyncio.all_tasks(self)
        if pending and not self.is_closed():
            self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        super().close()


class _DrainingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self):
        return _DrainingLoop()


class DrainingLoops:
    """Between enter() and leave(), the event loops made (orbax makes one per save or read thread) run their
    pending tasks when closed. Counted: Checkpointers close in any order (benchmarks/save_cost.py opens two), and a
    read happens while one is open; after the last leave(), asyncio's policy is as it was."""

    def __init__(self):
        self.open, self.before = 0, None

    def enter(self) -> None:
        if self.open == 0:
            self.before = asyncio.get_event_loop_policy()
            asyncio.set_event_loop_policy(_DrainingPolicy())
        self.open += 1

    def leave(self) -> None:
        self.open -= 1
        if self.open == 0:
            asyncio.set_event_loop_policy(self.before)

    @contextlib.contextmanager
    def meanwhile(self):
        self.enter()
        try:
            yield
        finally:
            self.leave()


DRAINING = DrainingLoops()
