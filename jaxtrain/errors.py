"""Errors a user can cause and fix, and the one place that turns them into a clean exit.

Every entry point (jaxtrain.run, .data, .convert, .sample, .evaluate, torchref.run, the benchmarks, the parity report)
wraps its main in `exit_on_user_error`, so a bad config, missing data or a corrupt checkpoint ends in one line that
names the cause and the fix, with exit code 2, instead of a traceback.
"""

import argparse
import contextlib
import errno
import logging
import sys
from typing import NoReturn


class UserError(Exception):
    """Something the user can fix. The message names the cause and the fix, in one line."""


class NotTheCheckpoint(UserError):
    """A refusal that no other checkpoint of the run mends, nor reading the same one again (the devices' memory, the
    command's flags): refused at once where the newest of a run still training is read (model_source)."""


# What a disk says when it is full, over its quota or read-only: the user's to mend, wherever the write was.
STORAGE_REFUSED = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


@contextlib.contextmanager
def exit_on_user_error():
    try:
        yield
    except UserError as e:
        # One line even when a message quotes a library's multi-line text (the tests hold every message to one).
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        sys.exit(2)
    except OSError as e:
        if e.errno not in STORAGE_REFUSED:
            raise
        where = f" {e.filename}" if e.filename else ""
        print(f"error: could not write{where} ({e.strerror}): mend what it names (free space, write access, the "
              f"storage) and run the same command again", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def exit_on_interrupt(unchanged: str):
    """A Ctrl-C during the block as one line, `interrupted; <unchanged>` (what the command leaves as it was), and the
    shell's exit code for SIGINT, 130, not Python's KeyboardInterrupt traceback: for the commands that write nothing
    or undo what they wrote (a run saves its step instead: preemption.py)."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"\ninterrupted; {unchanged}", file=sys.stderr)  # below a progress bar's line
        sys.exit(130)


@contextlib.contextmanager
def quiet_logger(name: str, level: int):
    """The library logger `name` held to `level` and above meanwhile, where a library logs what jaxtrain turns into
    its one line (orbax's warnings through absl; gcsfs's tracebacks of the requests it gave up on)."""
    logger = logging.getLogger(name)
    before = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser, whose refusals (a missing or unknown argument, a bad value) are UserErrors: one line that
    names the cause and where the usage is, not argparse's usage block above it. The parsers of its subcommands are
    of this class too (argparse makes them with their parent's). Parse inside exit_on_user_error."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see {self.prog} --help")

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an argument no parser knows names the subcommand's --help (argparse's own error comes
        from the top parser, whose help lists only the subcommands): subcommands are stored in `command`."""
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            command = getattr(parsed, "command", None)
            prog = f"{self.prog} {command}" if command else self.prog
            raise UserError(f"unrecognized arguments: {' '.join(unknown)}; see {prog} --help")
        return parsed


def exit_no_command_of_its_own(use_instead: str) -> NoReturn:
    """For `python -m` of a module without a command line of its own whose name is a likely guess at one: one line
    saying what to run instead (`use_instead`, e.g. "prepare data with `python -m ...`"), exit code 2, rather than
    doing nothing and exiting 0."""
    print(f"error: this module has no command of its own; {use_instead}", file=sys.stderr)
    sys.exit(2)
