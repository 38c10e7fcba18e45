"""Whether a process a test started, or had started, has ended: for the tests that stop processes (a stage past its
cap, CI's background install) and check that nothing they started is left running."""

import time


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie has ended (nobody reaps a killed orphan in some containers)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def ended_within(pid: int, seconds: float = 5.0) -> bool:
    """Whether process `pid` has ended within `seconds` from now (a killed process takes a moment to go)."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)
